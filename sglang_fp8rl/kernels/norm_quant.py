"""The kernels that produce a decode linear's input, each also writing the input's 1x128 FP8 quantization (Triton).

A block-FP8 linear quantizes its BF16 input in 1x128 groups before its GEMM: a launch of its own per linear (144 a
decode step of Qwen3-8B, about 1.4 us each on an H100, docs/RESULTS.md sec. 33b). Where the input is made by one
kernel that already holds each row (the RMSNorm before qkv and gate_up, the SiLU-and-multiply before down), that
kernel can write the codes and multipliers too, and the quantizer's launch goes away:

* :func:`add_rmsnorm_quant`: ``residual += x`` (optional, in place, as SGLang's fused add-RMSNorm), then
  ``out = x * rsqrt(mean(x^2) + eps) * weight`` in float32, rounded to BF16, one program per row;
* :func:`silu_mul_quant`: ``out = silu(gate) * up`` in float32, rounded to BF16 (``gate_up = [gate | up]``);

and both quantize their BF16 ``out`` with :func:`sglang_fp8rl.kernels.block_gemm.quantize_activation`'s arithmetic,
so the codes and multipliers are ``quant.quantize_activation_groups(out)`` bit for bit. ``out`` itself is the
unfused kernels' within their own float32 rounding (the reduction order of the mean, the exponential): at most one
BF16 rounding step apart, checked against a float64 reference in the tests.

The multipliers are written row-major ``[M, K/128]`` (this package's GEMM) or as SGLang lays them out for DeepGEMM
(``scale_layout="tma"``: column-major, M padded to 4). ``pdl=True`` launches either as a programmatic dependent
launch, as SGLang's own RMSNorm and SiLU kernels are launched on Hopper: its programs start while the kernel before
drains (the norm's weight vector is read then) and wait (``griddepcontrol.wait``) before reading what that kernel
wrote; they let the next kernel start at once, which waits for this grid before it reads the output. Served under
``--fp8rl-producer-quant on``
(:mod:`sglang_fp8rl.hooks.producers`); measured against the unfused pair by ``scripts/bench_norm_quant.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglang_fp8rl.kernels.block_gemm import ACT_QUANT_GROUPS, GROUP_K, _quantize_columns
from sglang_fp8rl.kernels.pdl import INTERPRETED
from sglang_fp8rl.kernels.triton_quant import _AMAX_FLOOR_BITS
from sglang_fp8rl.quant import FP8_MAX

SCALE_LAYOUTS = ("row", "tma")
TMA_ALIGN_M = 4  # DeepGEMM's scale rows: 16 bytes of float32 (SGLang's scale_tma_aligned)
MAX_NORM_GROUPS = 64  # the fused RMSNorm holds a row in one program's tile: 64 x 128 = 8192 values at most
MAX_NORM_WIDTH = MAX_NORM_GROUPS * GROUP_K
# Warps of the norm's one program a row. More warps cut a thread's instructions (a 4096-wide row on sm90: 1,632 SASS
# instructions a thread at 4 warps, 616 at 16; scripts/kernel_asm.py --kernel norm) but not the time: on an H100 16
# warps took 4.2 us a call at 8 rows against 4 warps' 2.8 (docs/RESULTS.md 39; likely the row's reductions crossing
# 16 warps through shared memory, not profiled). Rows over 32 groups keep 8 warps, as before (not measured against 4).
NORM_WARPS, WIDE_NORM_WARPS, WIDE_NORM_GROUPS = 4, 8, 32


@triton.jit
def _add_rmsnorm_quant_kernel(x_ptr, r_ptr, w_ptr, out_ptr, q_ptr, s_ptr, k_groups, eps,
                              stride_xm, stride_rm, stride_om, stride_qm, stride_sm, stride_sg,
                              GROUP: tl.constexpr, GROUPS_P2: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                              FP8_MAX: tl.constexpr, AMAX_FLOOR_BITS: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs_g = tl.arange(0, GROUPS_P2)
    g_ok = offs_g < k_groups
    cols = tl.arange(0, GROUP)[:, None] + offs_g[None, :] * GROUP  # [GROUP, GROUPS_P2]: a group per column
    mask = g_ok[None, :]
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a parameter: no kernel before writes it
    if PDL:
        gdc_wait()  # x and the residual are the output of the kernel before this one
        gdc_launch_dependents()  # the linear's programs may start; they wait for this grid before reading out / q / s
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_ptr + row * stride_rm + cols, x.to(r_ptr.dtype.element_ty), mask=mask)
    mean_sq = tl.sum(tl.sum(x * x, 1), 0) / (k_groups * GROUP)
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    y = (x * rstd * w).to(tl.bfloat16)
    tl.store(out_ptr + row * stride_om + cols, y, mask=mask)
    q, scale = _quantize_columns(y, FP8_MAX, AMAX_FLOOR_BITS)
    tl.store(q_ptr + row * stride_qm + cols, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + offs_g * stride_sg, scale, mask=g_ok)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, out_ptr, q_ptr, s_ptr, k_groups, half,
                           stride_gm, stride_om, stride_qm, stride_sm, stride_sg,
                           GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX: tl.constexpr,
                           AMAX_FLOOR_BITS: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    g_ok = offs_g < k_groups
    cols = tl.arange(0, GROUP)[:, None] + offs_g[None, :] * GROUP
    mask = g_ok[None, :]
    if PDL:
        gdc_wait()  # gate_up is the output of the GEMM before this one
        gdc_launch_dependents()
    gate = tl.load(gu_ptr + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gm + half + cols, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16)
    tl.store(out_ptr + row * stride_om + cols, y, mask=mask)
    q, scale = _quantize_columns(y, FP8_MAX, AMAX_FLOOR_BITS)
    tl.store(q_ptr + row * stride_qm + cols, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + offs_g * stride_sg, scale, mask=g_ok)


def empty_scales(m: int, k: int, device: torch.device, scale_layout: str = "row") -> torch.Tensor:
    """Float32 multipliers [M, K/128]: row-major, or column-major with M padded to 4 as SGLang hands DeepGEMM."""
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    groups = k // GROUP_K
    if scale_layout == "row":
        return torch.empty(m, groups, dtype=torch.float32, device=device)
    padded = triton.cdiv(m, TMA_ALIGN_M) * TMA_ALIGN_M
    return torch.empty(groups, padded, dtype=torch.float32, device=device).t()[:m]


def empty_codes(m: int, k: int, device: torch.device, scale_layout: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [M, K], float32 multipliers [M, K/128] in ``scale_layout``): room for one 1x128 quantization."""
    return torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device), empty_scales(m, k, device, scale_layout)


def norm_warps(groups: int) -> int:
    """Warps of the fused norm's program for a row of ``groups`` 1x128 groups."""
    return WIDE_NORM_WARPS if groups > WIDE_NORM_GROUPS else NORM_WARPS


def _check_rows(name: str, t: torch.Tensor, k: int) -> None:
    if t.dtype != torch.bfloat16 or t.dim() != 2 or t.stride(1) != 1 or t.shape[1] != k or k % GROUP_K:
        raise ValueError(f"{name} must be a 2-D BF16 tensor with contiguous rows of width {k} (a multiple of "
                         f"{GROUP_K}), got {t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}")


def add_rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                      scale_layout: str = "row", pdl: bool = False, *, num_warps: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out BF16, e4m3 codes, float32 multipliers) of RMSNorm(x [+ residual]) [M, K]; ``residual`` becomes
    ``x + residual`` in place, as SGLang's fused add-RMSNorm leaves it; ``pdl``: a programmatic dependent launch;
    ``num_warps``: :func:`norm_warps`'s unless a benchmark names another."""
    m, k = x.shape if x.dim() == 2 else (0, -1)
    _check_rows("x", x, k)
    if residual is not None:
        _check_rows("residual", residual, k)
        if residual.shape[0] != m:
            raise ValueError(f"residual has {residual.shape[0]} rows, x has {m}")
    if weight.dtype != torch.bfloat16 or tuple(weight.shape) != (k,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous BF16 vector of {k}, got {weight.dtype} {tuple(weight.shape)}")
    if k // GROUP_K > MAX_NORM_GROUPS:
        raise ValueError(f"rows wider than {MAX_NORM_GROUPS * GROUP_K} are not one program's tile, got {k}")
    out = torch.empty_like(x)
    q, s = empty_codes(m, k, x.device, scale_layout)
    if m == 0:
        return out, q, s
    r = residual if residual is not None else x  # not read without HAS_RESIDUAL
    groups = k // GROUP_K
    pdl = pdl and not INTERPRETED
    _add_rmsnorm_quant_kernel[(m,)](
        x, r, weight, out, q, s, groups, float(eps), x.stride(0), r.stride(0), out.stride(0), q.stride(0),
        s.stride(0), s.stride(1), GROUP=GROUP_K, GROUPS_P2=triton.next_power_of_2(groups),
        HAS_RESIDUAL=residual is not None, FP8_MAX=FP8_MAX, AMAX_FLOOR_BITS=_AMAX_FLOOR_BITS, PDL=pdl,
        num_warps=num_warps or norm_warps(groups), launch_pdl=pdl,
    )
    return out, q, s


def silu_mul_quant(gate_up: torch.Tensor, scale_layout: str = "row", pdl: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out BF16 [M, K], e4m3 codes, float32 multipliers) of ``silu(gate) * up`` for ``gate_up = [gate | up]``
    [M, 2K]; ``pdl``: a programmatic dependent launch."""
    m, k2 = gate_up.shape if gate_up.dim() == 2 else (0, -1)
    _check_rows("gate_up", gate_up, k2)
    k = k2 // 2
    if k % GROUP_K:
        raise ValueError(f"gate_up's halves must be a multiple of {GROUP_K} wide, got {k}")
    out = torch.empty(m, k, dtype=torch.bfloat16, device=gate_up.device)
    q, s = empty_codes(m, k, gate_up.device, scale_layout)
    if m == 0:
        return out, q, s
    groups = k // GROUP_K
    pdl = pdl and not INTERPRETED
    _silu_mul_quant_kernel[(m, triton.cdiv(groups, ACT_QUANT_GROUPS))](
        gate_up, out, q, s, groups, k, gate_up.stride(0), out.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUP=GROUP_K, GROUPS=ACT_QUANT_GROUPS, FP8_MAX=FP8_MAX, AMAX_FLOOR_BITS=_AMAX_FLOOR_BITS, PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )
    return out, q, s
