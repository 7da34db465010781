"""In-place FP8 quantizers that pick the Triton kernel on CUDA and the torch reference everywhere else.

:func:`quantize_blockwise_into` and :func:`quantize_per_channel_into` have the signature, the validation and the
results (bit for bit) of the functions of the same name in :mod:`sglang_fp8rl.quant`. The Triton kernel runs when
the outputs are on one CUDA device, Triton imports, the input is BF16/FP16/FP32 and 2-D and non-empty (and, for
blockwise, the block is two powers of two); every other call is handed to ``quant.py`` unchanged, so the reference
raises its own errors for odd arguments.

NaN/Inf, two modes on the Triton path:

* default: one read-only reduction (``torch.aminmax``, NaN propagates, +-Inf shows as is) and one host sync before
  the launch; on failure the reference check names the first bad element and nothing is written;
* ``nonfinite_flag`` (a 1-element int32 CUDA tensor): no pre-check and no sync; a block (row, per channel) holding
  a NaN/Inf writes nothing and sets the flag. The caller checks it once per weight update with
  :func:`check_nonfinite_flag`, which on failure re-runs the reference check to name the position.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence

import torch

from sglang_fp8rl import quant
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE, FP8_DTYPE, UNQUANTIZED_DTYPES, ScaleFormat

NONFINITE_FLAG_DTYPE = torch.int32


@functools.cache
def _kernels():
    """The Triton kernel module, or None where Triton does not import (imported once, on first use)."""
    try:
        from sglang_fp8rl.kernels import triton_quant
    except ImportError:
        return None
    return triton_quant


@functools.cache
def _grouped_kernels():
    """The grouped Triton kernel module, or None where Triton does not import."""
    if _kernels() is None:
        return None
    from sglang_fp8rl.kernels import triton_grouped
    return triton_grouped


def _on_kernel_path(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> bool:
    """Kernel conditions shared by both quantizers; anything else is the reference's business."""
    return (
        q_out.is_cuda
        and scale_out.device == q_out.device
        and w.dim() == 2
        and w.numel() > 0
        and w.dtype in UNQUANTIZED_DTYPES
        and _kernels() is not None
    )


def _current_device_is(device: torch.device):
    """Triton launches on the current device: make it the outputs' one (no context switch when it already is)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# ---------------------------------------------------------------------------------------------------------------------
# NaN/Inf


def new_nonfinite_flag(device: torch.device | str) -> torch.Tensor:
    """A cleared flag for one weight update: pass it to every quantizer call, then to check_nonfinite_flag."""
    return torch.zeros(1, dtype=NONFINITE_FLAG_DTYPE, device=device)


def _check_flag(flag: torch.Tensor, device: torch.device) -> None:
    if flag.dtype != NONFINITE_FLAG_DTYPE or flag.numel() != 1 or flag.device != device:
        raise ValueError(
            f"nonfinite_flag must be a 1-element {NONFINITE_FLAG_DTYPE} tensor on {device}, "
            f"got {flag.dtype} of shape {tuple(flag.shape)} on {flag.device}"
        )


def check_nonfinite_flag(flag: torch.Tensor, inputs: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise ValueError if a kernel set ``flag`` (one host sync); ``inputs`` (name -> weight) locate the bad element.

    ``flag`` may hold one slot per input (same order as ``inputs``): then only the flagged inputs are re-checked.
    """
    slots = flag.reshape(-1).cpu()
    if not bool(slots.any()):
        return
    named = list((inputs or {}).items())
    if len(slots) > 1 and len(named) == len(slots):  # one slot per input: re-check only the flagged ones
        named = [item for item, bad in zip(named, slots.tolist()) if bad]
    for name, w in named:
        # slow path, only on error: the reference check names the first bad element in row-major order
        quant.check_finite(quant.round_to_bf16(w), name)
    raise ValueError(
        "a NaN/Inf reached the FP8 quantizer during this weight update (nonfinite flag set); "
        "the affected blocks were not written"
        + ("" if named else "; pass the weights as `inputs` to locate it")
    )


def _check_finite_before_write(w: torch.Tensor) -> None:
    """One read-only reduction; the reference check runs (to name the position) only when it fails."""
    if quant.extremes_finite_in_bf16(quant.extremes(w)):
        return
    quant.check_finite(quant.round_to_bf16(w))
    raise ValueError("w holds a NaN/Inf: NaN/Inf cannot be quantized to FP8")


def _prepare_input(w: torch.Tensor, device: torch.device, flag: torch.Tensor | None) -> torch.Tensor:
    """Move ``w`` to the output device (as the reference does) and, without a flag, reject NaN/Inf before writing."""
    if w.device != device:
        w = w.to(device)
    if flag is None:
        _check_finite_before_write(w)
    else:
        _check_flag(flag, device)
    return w


# ---------------------------------------------------------------------------------------------------------------------
# public quantizers


def quantize_blockwise_into(
    w: torch.Tensor,
    q_out: torch.Tensor,
    scale_inv_out: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    scale_format: ScaleFormat = "fp32",
    nonfinite_flag: torch.Tensor | None = None,
) -> None:
    """quant.quantize_blockwise_into, on the Triton kernel when the outputs are on CUDA (see module docstring)."""
    if not (_on_kernel_path(w, q_out, scale_inv_out) and _kernels().supports_block_size(block_size)):
        quant.quantize_blockwise_into(w, q_out, scale_inv_out, block_size, scale_format)
        return
    # the reference's checks, in the reference's order (w is known 2-D and block_size valid here)
    quant._check_out(q_out, tuple(w.shape), FP8_DTYPE, "q_out")
    scale_shape = quant.blockwise_scale_shape(tuple(w.shape), block_size)
    quant._check_out(scale_inv_out, scale_shape, torch.float32, "scale_inv_out")
    w = _prepare_input(w, q_out.device, nonfinite_flag)
    quant._check_scale_format(scale_format)
    with _current_device_is(q_out.device):
        _kernels().quantize_blockwise_launch(
            w, q_out, scale_inv_out, tuple(block_size), scale_format == "pow2", nonfinite_flag
        )


def quantize_per_channel_into(
    w: torch.Tensor,
    q_out: torch.Tensor,
    scale_out: torch.Tensor,
    scale_format: ScaleFormat = "fp32",
    nonfinite_flag: torch.Tensor | None = None,
) -> None:
    """quant.quantize_per_channel_into, on the Triton kernel when the outputs are on CUDA (see module docstring)."""
    if not _on_kernel_path(w, q_out, scale_out):
        quant.quantize_per_channel_into(w, q_out, scale_out, scale_format)
        return
    quant._check_out(q_out, tuple(w.shape), FP8_DTYPE, "q_out")
    quant._check_out(scale_out, (w.shape[0],), torch.float32, "scale_out")
    w = _prepare_input(w, q_out.device, nonfinite_flag)
    quant._check_scale_format(scale_format)
    with _current_device_is(q_out.device):
        _kernels().quantize_per_channel_launch(w, q_out, scale_out, scale_format == "pow2", nonfinite_flag)


def grouped_reason(w: torch.Tensor, q_out: torch.Tensor, scale_inv_out: torch.Tensor,
                   block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> str | None:
    """Why :func:`quantize_blockwise_many` writes this item on its own, or None if it joins a grouped launch."""
    if _grouped_kernels() is None:
        return "Triton does not import"
    return _grouped_kernels().cannot_group(w, q_out, scale_inv_out, block_size)


def quantize_blockwise_many(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    nonfinite_flag: torch.Tensor | None,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    scale_format: ScaleFormat = "fp32",
) -> int:
    """:func:`quantize_blockwise_into` on each ``(w, q_out, scale_inv_out)``, same results bit for bit; the items the
    grouped kernel takes (see :func:`grouped_reason`) go in one launch per input dtype (more where a dtype has more
    tensors than one launch takes). Returns the launches made.

    Grouped only in the ``nonfinite_flag`` mode (a validated weight update): a grouped launch has no per-tensor
    pre-read; without a flag every item is written on its own."""
    quant._check_scale_format(scale_format)
    groups: dict[tuple[torch.device, torch.dtype], list] = {}
    launches = 0
    for w, q_out, scale_inv_out in items:
        if (nonfinite_flag is None or q_out.dtype != FP8_DTYPE
                or grouped_reason(w, q_out, scale_inv_out, block_size) is not None):
            quantize_blockwise_into(w, q_out, scale_inv_out, block_size, scale_format, nonfinite_flag)
            launches += 1
            continue
        groups.setdefault((q_out.device, w.dtype), []).append((w, q_out, scale_inv_out))
    for (device, _), group in groups.items():
        _check_flag(nonfinite_flag, device)
        with _current_device_is(device):
            launches += _grouped_kernels().quantize_blockwise_grouped_launch(
                group, tuple(block_size), scale_format == "pow2", nonfinite_flag)
    return launches
