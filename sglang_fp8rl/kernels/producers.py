"""A block-FP8 linear's input handed over already quantized by the kernel that made it (``--fp8rl-producer-quant``).

The producer (the RMSNorm before qkv / gate_up, the SiLU-and-multiply before down) computes its BF16 output and that
output's 1x128 FP8 codes and multipliers in one kernel (:mod:`sglang_fp8rl.kernels.norm_quant` on CUDA, a torch
reference elsewhere) and attaches them to the output's storage (:func:`attach`); the linear's apply takes them
(:func:`quantized_input`) for that tensor or a contiguous reshape of it (the attention output reaches o_proj as a
view) instead of quantizing the BF16 input again. A slice, a copy or a gathered tensor has none, and its linear
quantizes as before; so does a tensor written in place after the producer (its version counter moved). The codes are
``quant.quantize_activation_groups`` of the BF16 output, the multipliers in the layout SGLang hands DeepGEMM
(column-major, M padded to 4), which this package's GEMM reads too. On Hopper and later the kernels are programmatic
dependent launches, as SGLang launches its own RMSNorm and SiLU kernels there (sgl-kernel's ``enable_pdl`` default):
a plain launch between two dependent ones would wait for the whole kernel before it, launch latency included.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from sglang_fp8rl.kernels import pdl
from sglang_fp8rl.kernels.tensor_version import version_counter
from sglang_fp8rl.quant import DEFAULT_GROUP_SIZE, quantize_activation_groups

ATTR = "_fp8rl_quantized"  # a Handed on the storage of a producer's BF16 output
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Handed:
    """A producer's output's quantization, and which tensor of that storage it is of, as written then."""

    codes: torch.Tensor  # [M, K] e4m3
    scales: torch.Tensor  # [M, K/128] float32 multipliers
    version: int  # the output's version counter (shared by its views): an in-place write moves it
    offset: int
    numel: int


def attach(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``out`` carrying its own quantization for the linear that reads it next (``out`` a fresh, contiguous
    allocation of the producer's: nothing else writes its storage); an inference tensor carries none (no version
    counter to tell a later in-place write by), and its linear quantizes as before."""
    version = version_counter(out)
    if version is not None:
        setattr(out.untyped_storage(), ATTR, Handed(codes, scales, version, out.storage_offset(), out.numel()))
    return out


def quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (codes, multipliers) a producer attached to ``x`` or to the tensor ``x`` is a contiguous reshape of, or
    None; None too where it was written in place since (the version counter moved), so stale codes are never used."""
    if torch.compiler.is_compiling() or not x.is_contiguous():
        return None
    handed = vars(x.untyped_storage()).get(ATTR)
    if (handed is None or handed.version != version_counter(x) or handed.offset != x.storage_offset()
            or handed.numel != x.numel() or x.shape[-1] != handed.codes.shape[-1]):
        return None
    return handed.codes, handed.scales


def note_taken() -> None:
    """A linear computed with handed-over codes: logged once a process (the option works end to end)."""
    if not _TAKEN:
        _TAKEN.append(True)
        logger.info("[fp8rl] producer quantization: a block-FP8 linear took its input's codes from the kernel that "
                    "made the input (logged once)")


_TAKEN: list[bool] = []

# The fused norm and SiLU are taken for batches of at most this many rows; larger ones run SGLang's kernels and their
# linears quantize as before. On an H100 the fused norm beat SGLang's norm + quantizer by 1.1-1.3 us at 1-64 rows and
# lost 0.9 us at 384 (docs/RESULTS.md sec. 35a); with the norm limited, the served FP8 + FP8 KV step was still 1.2 %
# slower with the fused SiLU alone at 128 x 1k, 128 x 4k and 384 x 1k, and 0.1-3.2 % faster at 1-32 rows (sec. 36)
FUSED_MAX_ROWS = 64


def add_rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, codes, multipliers) of RMSNorm(x [+ residual]); ``residual`` becomes ``x + residual`` in place."""
    if x.is_cuda:
        from sglang_fp8rl.kernels.norm_quant import add_rmsnorm_quant as kernel  # Triton, at the first call

        return kernel(x, weight, eps, residual, scale_layout="tma", pdl=pdl.capable(x.device))
    h = x.float()
    if residual is not None:  # SGLang's RMSNorm.forward_native, op for op
        h = h + residual.float()
        residual.copy_(h.to(residual.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (h * weight).to(x.dtype)
    return (out, *quantize_activation_groups(out, DEFAULT_GROUP_SIZE))


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, codes, multipliers) of ``silu(gate) * up`` for ``gate_up = [gate | up]``."""
    if gate_up.is_cuda:
        from sglang_fp8rl.kernels.norm_quant import silu_mul_quant as kernel

        return kernel(gate_up, scale_layout="tma", pdl=pdl.capable(gate_up.device))
    half = gate_up.shape[-1] // 2
    out = torch.nn.functional.silu(gate_up[..., :half]) * gate_up[..., half:]  # SiluAndMul.forward_native
    return (out, *quantize_activation_groups(out, DEFAULT_GROUP_SIZE))
