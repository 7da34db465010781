"""Reference FP8 (E4M3) quantizers: pure torch, device-agnostic, the single source of truth for the numerics.

Every other path (the SGLang layers, the weight-update path, the Triton kernel) is checked bit-for-bit against
these functions. The rules, shared by all of them:

* weights are first rounded to BF16 (FP32/FP16 -> BF16 -> FP8, the path the trainer-side references use);
* a group's ``amax`` is the max |x| over its *valid* elements (edge blocks are never padded with values that
  change it), clamped below at ``AMAX_FLOOR``;
* ``scale_inv = amax / FP8_MAX`` in float32. ``scale_inv`` is the **dequantization multiplier**: ``x ~= q * scale_inv``
  (SGLang's ``weight_scale_inv`` convention). With ``scale_format="pow2"`` it is the smallest power of two
  ``>= amax / FP8_MAX``;
* ``q = clamp(x.float() / scale_inv, -FP8_MAX, FP8_MAX).to(float8_e4m3fn)``: a true division, never a multiplication
  by a reciprocal (the two differ in the last bit and so, sometimes, in the FP8 code);
* NaN or Inf raises ``ValueError`` naming the first offending position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

FP8_DTYPE = torch.float8_e4m3fn
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what a weight may arrive in, to be quantized
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
AMAX_FLOOR = 1e-10
DEFAULT_BLOCK_SIZE: tuple[int, int] = (128, 128)
DEFAULT_GROUP_SIZE = 128
SCALE_FORMATS = ("fp32", "pow2")

ScaleFormat = Literal["fp32", "pow2"]


# ---------------------------------------------------------------------------------------------------------------------
# primitives


def ceil_div(a: int, b: int) -> int:
    """Integer ceil(a / b)."""
    return -(-a // b)


def round_to_bf16(w: torch.Tensor) -> torch.Tensor:
    """FP32/FP16 -> BF16 (round to nearest even); BF16 is returned as is."""
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise TypeError(f"expected a floating-point tensor in bf16/fp16/fp32, got {w.dtype}")
    return w if w.dtype == torch.bfloat16 else w.to(torch.bfloat16)


def check_finite(x: torch.Tensor, what: str = "w") -> None:
    """Raise ValueError naming the first NaN/Inf element of ``x`` (row-major order)."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        value = x[pos].item()
        index = ", ".join(str(i) for i in pos)
        raise ValueError(f"{what}[{index}] is {value} ({x.dtype}): NaN/Inf cannot be quantized to FP8")


def extremes(x: torch.Tensor) -> torch.Tensor:
    """[min, max] of a non-empty ``x`` as float32 (one read-only reduction): NaN propagates into both, +-Inf shows."""
    low, high = torch.aminmax(x)
    return torch.stack((low, high)).float()


def extremes_finite_in_bf16(ends: torch.Tensor) -> bool:
    """Whether extremes (from :func:`extremes`, possibly several concatenated) stay finite once rounded to BF16.

    Rounding is monotone, so BF16(min) and BF16(max) bound every rounded element; an FP32 value past BF16's range
    becomes Inf there, exactly as in :func:`round_to_bf16` + :func:`check_finite`. One host sync."""
    return bool(torch.isfinite(ends.to(torch.bfloat16)).all())


def _check_scale_format(scale_format: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")


def scale_from_amax(amax: torch.Tensor, scale_format: ScaleFormat = "fp32") -> torch.Tensor:
    """Dequantization multiplier from a group's amax: amax/448, or its power-of-two ceiling."""
    _check_scale_format(scale_format)
    amax = amax.float().clamp(min=AMAX_FLOOR)
    # divide by a tensor: on CUDA, torch turns division by a Python scalar into multiplication by its reciprocal,
    # which differs in the last bit and would make the reference device-dependent
    scale = amax / torch.full_like(amax, FP8_MAX)
    if scale_format == "pow2":
        # frexp is exact: scale = m * 2**e with m in [0.5, 1); scale is a power of two iff m == 0.5
        mantissa, exponent = torch.frexp(scale)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        scale = torch.ldexp(torch.ones_like(scale), exponent)
    return scale


def cast_to_fp8(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP8 codes of ``x / scale_inv`` (``scale_inv`` broadcast to ``x``), saturated at +-448."""
    return (x.float() / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _block_amax(x: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """Max |x| per (bn, bk) block, over valid elements only: zero padding never raises an abs-max."""
    bn, bk = block_size
    n, k = x.shape
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    padded = torch.nn.functional.pad(x.float().abs(), (0, kb * bk - k, 0, nb * bn - n))
    return padded.view(nb, bn, kb, bk).amax(dim=(1, 3))


def expand_block_scale(scale_inv: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int]) -> torch.Tensor:
    """Per-element view of a (ceil(N/bn), ceil(K/bk)) block scale, cropped to ``shape``."""
    bn, bk = block_size
    n, k = shape
    return scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def check_block_size(block_size: Sequence[int]) -> tuple[int, int]:
    """(block_n, block_k) as ints; ValueError unless it is two positive integers."""
    if len(block_size) != 2 or any(isinstance(b, bool) or int(b) != b or b < 1 for b in block_size):
        raise ValueError(f"block_size must be two positive ints (block_n, block_k), got {tuple(block_size)!r}")
    return int(block_size[0]), int(block_size[1])


def _check_2d(w: torch.Tensor, what: str = "w") -> None:
    if w.dim() != 2:
        raise ValueError(f"{what} must be 2-D [N, K], got shape {tuple(w.shape)}")


# ---------------------------------------------------------------------------------------------------------------------
# blockwise (128x128 weights)


def quantize_blockwise(
    w: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    scale_format: ScaleFormat = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8: ``q`` [N, K] e4m3fn and ``scale_inv`` [ceil(N/bn), ceil(K/bk)] float32 dequant multipliers."""
    _check_2d(w)
    block_size = check_block_size(block_size)
    x = round_to_bf16(w)
    check_finite(x)
    scale_inv = scale_from_amax(_block_amax(x, block_size), scale_format)
    q = cast_to_fp8(x, expand_block_scale(scale_inv, tuple(x.shape), block_size))
    return q, scale_inv


def blockwise_scale_shape(shape: tuple[int, int], block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> tuple[int, int]:
    """Shape of the block scale of an [N, K] weight."""
    return ceil_div(shape[0], block_size[0]), ceil_div(shape[1], block_size[1])


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{what} must be {dtype} of shape {tuple(shape)}, got {out.dtype} of shape {tuple(out.shape)}")


def quantize_blockwise_into(
    w: torch.Tensor,
    q_out: torch.Tensor,
    scale_inv_out: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    scale_format: ScaleFormat = "fp32",
) -> None:
    """In-place :func:`quantize_blockwise`: write into preallocated (possibly row-sliced) ``q_out``/``scale_inv_out``.

    Everything is validated and computed before the first write, so a rejected input leaves both outputs untouched.
    """
    block_size = check_block_size(block_size)
    _check_out(q_out, tuple(w.shape), FP8_DTYPE, "q_out")
    _check_out(scale_inv_out, blockwise_scale_shape(tuple(w.shape), block_size), torch.float32, "scale_inv_out")
    q, scale_inv = quantize_blockwise(w.to(q_out.device), block_size, scale_format)
    q_out.copy_(q)
    scale_inv_out.copy_(scale_inv)


def dequantize_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> torch.Tensor:
    """float32 ``q * scale_inv`` with the block scale broadcast over its 128x128 block."""
    _check_2d(q, "q")
    block_size = check_block_size(block_size)
    _check_out(scale_inv, blockwise_scale_shape(tuple(q.shape), block_size), torch.float32, "scale_inv")
    return q.float() * expand_block_scale(scale_inv, tuple(q.shape), block_size)


# ---------------------------------------------------------------------------------------------------------------------
# per output channel (fallback for layers whose per-rank shapes do not fit 128-blocks)


def quantize_per_channel(w: torch.Tensor, scale_format: ScaleFormat = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row FP8: ``q`` [N, K] e4m3fn and ``scale`` [N] float32 dequant multipliers."""
    _check_2d(w)
    x = round_to_bf16(w)
    check_finite(x)
    scale = scale_from_amax(x.float().abs().amax(dim=1), scale_format)
    return cast_to_fp8(x, scale[:, None]), scale


def quantize_per_channel_into(
    w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, scale_format: ScaleFormat = "fp32"
) -> None:
    """In-place :func:`quantize_per_channel` into preallocated (possibly row-sliced) outputs; validates first."""
    _check_out(q_out, tuple(w.shape), FP8_DTYPE, "q_out")
    _check_out(scale_out, (w.shape[0],), torch.float32, "scale_out")
    q, scale = quantize_per_channel(w.to(q_out.device), scale_format)
    q_out.copy_(q)
    scale_out.copy_(scale)


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` with one scale per output row."""
    _check_2d(q, "q")
    _check_out(scale, (q.shape[0],), torch.float32, "scale")
    return q.float() * scale[:, None]


# ---------------------------------------------------------------------------------------------------------------------
# activations (dynamic 1x128 per-token groups; reference for the CPU path of the layers)


def quantize_activation_groups(
    x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, scale_format: ScaleFormat = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 of ``x`` [..., K]: ``q`` like ``x`` and ``scale`` [..., ceil(K/group_size)] float32.

    Activations arrive in the model dtype and are quantized from it as is (as SGLang's kernels do); the group,
    amax, division and clamping rules are those of the weights.
    """
    if x.dim() < 1 or group_size < 1:
        raise ValueError(f"x must have a last dimension and group_size must be >= 1, got {tuple(x.shape)}, "
                         f"{group_size}")
    check_finite(x, "x")
    k = x.shape[-1]
    groups = ceil_div(k, group_size)
    flat = x.reshape(-1, k)
    amax = torch.nn.functional.pad(flat.float().abs(), (0, groups * group_size - k)).view(-1, groups, group_size)
    scale = scale_from_amax(amax.amax(dim=-1), scale_format)
    q = cast_to_fp8(flat, scale.repeat_interleave(group_size, dim=1)[:, :k])
    return q.view(x.shape), scale.view(*x.shape[:-1], groups)


def dequantize_activation_groups(q: torch.Tensor, scale: torch.Tensor,
                                 group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """float32 ``q * scale`` with one scale per token group."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group_size, dim=-1)[..., :k]
