"""K/V amax -> FP8 E4M3 KV-cache scales: host arithmetic on small tables, device-agnostic, no SGLang.

Convention (SGLang's): the scale is the **dequantization multiplier**, the cache holds ``fp8(x / scale)`` and
attention reads ``code * scale``.

``scale = round_up(max(amax, KV_AMAX_FLOOR) * margin / 448)``, computed exactly (rationals) on the host:

* ``margin`` (default 2): the calibration batch is not the rollout. K or V of a later token may exceed the amax seen
  on it and is then clipped (:func:`saturating_scale_`: on CUDA an E4M3 cast past 448 gives NaN, measured on an
  H100 with torch 2.11; torch 2.13 on CPU saturates, PyTorch #178817). E4M3 is a floating-point format, so headroom
  costs range at the bottom only (values below ``2**-6 * scale`` are subnormal, below ``2**-10 * scale`` zero), never
  relative precision: with margin 2 and power-of-two rounding at least 2**12 of normal range lies below the amax.
* rounding ``pow2`` (default): the smallest power of two >= the value. Division by a power of two is exact in BF16, so
  ``k / scale`` is rounded once (to E4M3), not twice (to BF16, then E4M3); the decode fold of the float-reading
  backends (decode_fold.py) stays exact; and small amax drifts leave the scale unchanged. ``fp32``: the smallest
  float32 >= the value (never below it, so ``amax * margin`` itself never saturates).
* ``KV_AMAX_FLOOR`` (2**-10): a layer whose K or V stayed below it on the whole calibration batch (e.g. a
  zero-initialised projection) carries no range information; the floor keeps its scale a positive normal float.
* a non-finite amax (the model produced NaN/Inf K or V) is rejected: no scale is derived from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import torch

from sglang_fp8rl.quant import FP8_MAX, SCALE_FORMATS

KV_SCALE_FORMATS = SCALE_FORMATS  # the weights' two: exact float32, or powers of two
DEFAULT_KV_SCALE_FORMAT = "pow2"
DEFAULT_KV_MARGIN = 2.0
KV_AMAX_FLOOR = 2.0**-10
_FLOOR = Fraction(KV_AMAX_FLOOR)
KV_NAMES = ("k", "v")  # column order of every [layers, 2] table in this package


@dataclasses.dataclass(frozen=True)
class ScalePolicy:
    """How K/V amax becomes a scale: headroom factor and rounding."""

    margin: float = DEFAULT_KV_MARGIN
    scale_format: str = DEFAULT_KV_SCALE_FORMAT

    def __post_init__(self) -> None:
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 1.0 <= margin < float("inf"):
            raise ValueError(f"KV scale margin must be a finite number >= 1, got {margin!r}")
        if self.scale_format not in KV_SCALE_FORMATS:
            raise ValueError(f"KV scale format must be one of {KV_SCALE_FORMATS}, got {self.scale_format!r}")


def pow2_ceil(x: Fraction) -> float:
    """Smallest power of two >= ``x`` (> 0), exactly."""
    e = x.numerator.bit_length() - x.denominator.bit_length()  # 2**(e-1) < x < 2**(e+1)
    if Fraction(2) ** e < x:
        e += 1
    if Fraction(2) ** (e - 1) >= x:
        e -= 1
    return math.ldexp(1.0, e)


def fp32_ceil(x: Fraction) -> float:
    """Smallest float32 >= ``x``, exactly (inf if ``x`` exceeds float32's largest value)."""
    f = np.float32(float(x))
    while Fraction(float(f)) < x:
        f = np.nextafter(f, np.float32(np.inf))
    while f > 0 and Fraction(float(np.nextafter(f, np.float32(0)))) >= x:
        f = np.nextafter(f, np.float32(0))
    return float(f)


def _ceil(x: Fraction, scale_format: str) -> float:
    return pow2_ceil(x) if scale_format == "pow2" else fp32_ceil(x)


def _describe_first(bad: torch.Tensor, table: torch.Tensor, labels: Sequence[str]) -> str:
    """``"<row label> K: <value>"`` for the first True element of ``bad`` (row-major)."""
    index = tuple(int(i) for i in bad.nonzero()[0])
    row = labels[index[0]] if len(labels) > index[0] else f"row {index[0]}"
    which = f" {KV_NAMES[index[1]].upper()}" if table.dim() == 2 and table.shape[1] == len(KV_NAMES) else ""
    return f"{row}{which}: {table[index].item()!r}"


def check_amax(amax: torch.Tensor, labels: Sequence[str] = ()) -> None:
    """Raise ValueError naming the first non-finite or negative amax (``labels`` name the rows)."""
    amax = amax.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(amax) | (amax < 0)
    if bool(bad.any()):
        raise ValueError(f"amax of {_describe_first(bad, amax, labels)}; no FP8 KV scale can be derived from it")


def scales_from_amax(amax: torch.Tensor, policy: ScalePolicy = ScalePolicy(),
                     labels: Sequence[str] = ()) -> torch.Tensor:
    """float32 scales (same shape, on the CPU) from amax values of any shape, e.g. ``[layers, 2]`` (K, V).

    Exact rational arithmetic on the host (a table of a few hundred values): the scale is never below
    ``amax * margin / 448`` whatever the margin's binary expansion."""
    amax = amax.detach().to("cpu", torch.float64)
    check_amax(amax, labels)
    factor = Fraction(policy.margin) / Fraction(FP8_MAX)
    values = [_ceil(max(Fraction(a), _FLOOR) * factor, policy.scale_format) for a in amax.flatten().tolist()]
    scales = torch.tensor(values, dtype=torch.float64).reshape(amax.shape)
    check_scales(scales, labels)  # only an amax near float32's largest value can overflow here
    return scales.to(torch.float32)


def reduce_heads(amax_per_head: torch.Tensor) -> torch.Tensor:
    """Per-tensor amax from per-KV-head amax (max over the last dimension); NaN propagates."""
    return amax_per_head.amax(dim=-1)


def check_scales(scales: torch.Tensor, labels: Sequence[str] = ()) -> None:
    """Raise ValueError naming the first scale that is not a finite float32 > 0."""
    values = scales.detach().to("cpu", torch.float64)
    as_fp32 = values.to(torch.float32).double()
    bad = ~torch.isfinite(as_fp32) | ~(as_fp32 > 0)
    if bool(bad.any()):
        raise ValueError(f"KV scale of {_describe_first(bad, values, labels)} is not a finite float32 > 0")


def round_scales(scales: torch.Tensor, policy: ScalePolicy = ScalePolicy()) -> torch.Tensor:
    """Externally supplied scales (validated) rounded up the way ours are: pow2 ceiling, or float32 ceiling."""
    check_scales(scales)
    values = scales.detach().to("cpu", torch.float64)
    rounded = torch.tensor([_ceil(Fraction(v), policy.scale_format) for v in values.flatten().tolist()],
                           dtype=torch.float64).reshape(values.shape)
    check_scales(rounded)  # a power-of-two ceiling can pass float32's largest value
    return rounded.to(torch.float32)


def headroom(amax: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``448 * scale / amax``: how far the calibrated amax sits below saturation (>= margin by construction)."""
    amax = amax.detach().to("cpu", torch.float64).clamp(min=KV_AMAX_FLOOR)
    return scales.detach().to("cpu", torch.float64) * FP8_MAX / amax


def saturating_scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in place, clamped to +-448: on CUDA (torch 2.11) an E4M3 cast of a value past 448 gives NaN, not
    448, so a K/V beyond the calibrated range would turn into NaN attention; saturated, it is off by the clipping."""
    return x.div_(scale).clamp_(-FP8_MAX, FP8_MAX)
