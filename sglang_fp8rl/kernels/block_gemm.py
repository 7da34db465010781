"""Decode-oriented block-FP8 GEMM of our own (Triton): out[M, N] = (xq * xs) @ (wq * ws)^T.

Operands as the rest of the package stores them: ``xq`` [M, K] e4m3 with 1x128 activation scales ``xs`` [M, K/128]
(any strides), ``wq`` [N, K] e4m3 with 128x128 weight scales ``ws`` [ceil(N/128), K/128] (``weight_scale_inv``, the
dequantization multiplier). K must be a multiple of 128; M and N are free.

Why a kernel of our own: decode GEMMs read every weight byte once for a handful of tokens, so they are bound by
weight bandwidth. The shapes where SGLang's kernels stay well below that bound (the small qkv / o_proj GEMMs of a
dense model, docs/RESULTS.md sec. 7) want many small weight tiles in flight, not large M tiles:

* swap-AB: the weight tile is the MMA's M side (``BLOCK_N`` = 64 rows, the wgmma minimum) and the tokens are its N
  side (``BLOCK_M`` = 16..128), so a batch of 1..64 tokens wastes no MMA rows and no weight byte is read twice;
* one 128-wide K step per iteration, which is exactly one activation group and one weight-scale column, so the
  partial product is rescaled by ``xs[m, g] * ws[n_block, g]`` once per step (as DeepGEMM's 1D2D kernel does);
* split-K (``split_k`` 2 or 4) for narrow N (4096 rows = 64 tiles, half of an H100), with a deterministic
  reduction: every split stores its float32 partial, and the last split of a tile to finish (counted with an
  acquire-release atomic) sums the partials in split order, so the result is bitwise reproducible run to run. The
  per-tile counters reset themselves, so the kernel is CUDA-graph safe; they are kept per CUDA stream;
* ``QUANT_X`` (:func:`block_fp8_linear`): the kernel takes the BF16 activation and quantizes each 1x128 group it
  reads, with the arithmetic of :func:`sglang_fp8rl.quant.quantize_activation_groups` (the weight quantizer's
  primitives, :mod:`sglang_fp8rl.kernels.triton_quant`), so a decode linear is one launch instead of two and its
  activation codes never go through device memory. Every weight tile's program quantizes the same few tokens again:
  at M <= 16 that is 16 x 128 values a step, against a 64 x 128 weight tile.
* ``PREFETCH`` (``prefetch=True``): before its loop every program asks L2 for its whole weight slice (one bulk
  prefetch a row, ``cp.async.bulk.prefetch.L2``), so all of a program's weight bytes are in flight from its start
  instead of the pipeline's few tiles; ``PDL`` (``pdl=True``): the kernel is launched as a programmatic dependent
  launch, so its programs start while the kernel before it drains, and wait for it (``griddepcontrol.wait``) before
  anything that kernel may have written is read (after the prefetch, when both are on: the weights never depend on
  it). The prefetch made every linear slower on an H100 (``scripts/bench_gemm.py --prefetch`` only); the dependent
  launch saves 1.2-1.5 us a call there and is a server candidate (docs/RESULTS.md sec. 31c, 32).
* :func:`quantize_activation`: the 1x128 activation quantizer of our own, with the arithmetic of ``QUANT_X``, that can
  itself be a dependent launch (``pdl=True``), so that the chain norm -> quantizer -> GEMM overlaps both launches
  with the kernel before them, not only the GEMM's (SGLang's quantizer is a plain launch). On an H100 that chain was
  0.2-0.3 us a call faster at M 1 only, the spread of two runs (docs/RESULTS.md sec. 33a): a benchmark form.

Whether it is used for a shape is decided by measurement only (:mod:`sglang_fp8rl.kernels.gemm_select`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglang_fp8rl.kernels.pdl import INTERPRETED  # the interpreter runs no inline PTX: no prefetch, no PDL
from sglang_fp8rl.kernels.triton_quant import (
    _AMAX_FLOOR_BITS,
    _abs_bits,
    _clamped_quotient,
    _reciprocal,
    _scale_from_amax_bits,
)
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE, DEFAULT_GROUP_SIZE, FP8_MAX

GROUP_K = DEFAULT_GROUP_SIZE  # activation group = weight block along K = one K step (the kernel takes no other)
WEIGHT_BLOCK_N = DEFAULT_BLOCK_SIZE[0]  # weight-scale rows cover this many output channels
BLOCK_N_CHOICES = (64, 128)
SPLIT_K_CHOICES = (1, 2, 4)
MAX_BLOCK_M = 128

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}  # per (device, stream): int32 per-tile counters
PREFETCH_ALIGN = 16  # cp.async.bulk.prefetch takes 16-byte aligned addresses and sizes
# groups a program of quantize_activation takes: a 4096-wide row in 4 programs, 12288 in 12 (decode rows are few, so
# programs along K keep the launch short)
ACT_QUANT_GROUPS = 8


@triton.jit
def _block_fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, bias_ptr, part_ptr, count_ptr,
    M, N, K_GROUPS, GROUPS_PER_SPLIT,
    stride_xm, stride_xsm, stride_xsg, stride_wn, stride_wsn, stride_wsg, stride_om,
    GROUP: tl.constexpr, W_BLOCK_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT_X: tl.constexpr = False,
    FP8_MAX: tl.constexpr = FP8_MAX, AMAX_FLOOR_BITS: tl.constexpr = _AMAX_FLOOR_BITS,
    PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, GROUP)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, GROUP]
    x_ptrs = x_ptr + offs_k[:, None] + offs_m[None, :] * stride_xm  # [GROUP, BLOCK_M]: x^T, K contiguous
    xs_ptrs = xs_ptr + offs_m * stride_xsm
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // W_BLOCK_N) * stride_wsn  # the tile lies in one weight-scale row
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, K_GROUPS)
    if PREFETCH:
        if g_end > g_start:  # a trailing split of an uneven K may hold no group
            _prefetch_rows_to_l2(w_ptr + tl.minimum(offs_n, N - 1) * stride_wn + g_start * GROUP,
                                 (g_end - g_start) * GROUP + tl.zeros_like(offs_n))
    if PDL:
        gdc_wait()  # everything below may read what the kernel before this one wrote
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(g_start, g_end):
        w = tl.load(w_ptrs + g * GROUP, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs + g * GROUP, mask=m_ok[None, :], other=0.0)
        if QUANT_X:
            x, xs = _quantize_columns(x, FP8_MAX, AMAX_FLOOR_BITS)
        else:
            xs = tl.load(xs_ptrs + g * stride_xsg, mask=m_ok, other=0.0)
        ws = tl.load(ws_row + g * stride_wsg)
        acc += tl.dot(w, x) * (xs * ws)[None, :]
    if PDL:
        gdc_launch_dependents()  # the next kernel may start; it waits for this one before reading its output

    out_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:
        part_ptrs = part_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(part_ptrs + pid_k * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        tile = pid_n * tl.num_programs(1) + pid_m
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:  # last split of this tile: reduce in split order (deterministic)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptrs + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call / replay
            _store_out(acc, out_ptr, bias_ptr, offs_n, offs_m, n_ok, out_mask, stride_om, HAS_BIAS)
    else:
        _store_out(acc, out_ptr, bias_ptr, offs_n, offs_m, n_ok, out_mask, stride_om, HAS_BIAS)


@triton.jit
def _quantize_columns(x, FP8_MAX: tl.constexpr, AMAX_FLOOR_BITS: tl.constexpr):
    """One 1x128 group per token of a BF16 x^T tile [GROUP, BLOCK_M]: its E4M3 codes and dequantization multipliers,
    as quant.quantize_activation_groups computes them. A NaN never raises the amax (as SGLang's quantizer ignores
    it) and quantizes to a finite code: a CUDA-graph warm-up on uninitialized buffers writes no FP8 NaN."""
    bits = _abs_bits(x)
    amax_bits = tl.max(tl.where(bits > 0x7F800000, 0, bits), 0)
    scale = _scale_from_amax_bits(amax_bits, FP8_MAX, AMAX_FLOOR_BITS, False)
    y = _clamped_quotient(x.to(tl.float32), scale[None, :], _reciprocal(scale)[None, :], FP8_MAX)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale


@triton.jit
def _prefetch_rows_to_l2(row_ptrs, nbytes):
    """One bulk L2 prefetch of ``nbytes`` from each address (16-byte aligned, a multiple of 16 bytes)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r", [row_ptrs, nbytes],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_out(acc, out_ptr, bias_ptr, offs_n, offs_m, n_ok, out_mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _quantize_activation_kernel(x_ptr, q_ptr, s_ptr, K_GROUPS, stride_xm, stride_qm, stride_sm,
                                GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX: tl.constexpr,
                                AMAX_FLOOR_BITS: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    g_ok = offs_g < K_GROUPS
    cols = tl.arange(0, GROUP)[:, None] + offs_g[None, :] * GROUP  # [GROUP, GROUPS]: a group per column
    if PDL:
        gdc_wait()  # x is the output of the kernel before this one
        gdc_launch_dependents()  # the GEMM's programs may start now; they wait for this grid before reading q / s
    x = tl.load(x_ptr + row * stride_xm + cols, mask=g_ok[None, :], other=0.0)
    q, scale = _quantize_columns(x, FP8_MAX, AMAX_FLOOR_BITS)
    tl.store(q_ptr + row * stride_qm + cols, q, mask=g_ok[None, :])
    tl.store(s_ptr + row * stride_sm + offs_g, scale, mask=g_ok)


def quantize_activation(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] BF16 -> (e4m3 codes [M, K], float32 dequantization multipliers [M, K/128]), bit for bit
    :func:`sglang_fp8rl.quant.quantize_activation_groups`; ``pdl``: launched as a programmatic dependent launch."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % GROUP_K:
        raise ValueError(f"quantize_activation: x must be a 2-D BF16 tensor with contiguous rows and K a multiple "
                         f"of {GROUP_K}, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // GROUP_K, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    groups = ACT_QUANT_GROUPS
    pdl = pdl and not INTERPRETED
    _quantize_activation_kernel[(m, triton.cdiv(k // GROUP_K, groups))](
        x, q, s, k // GROUP_K, x.stride(0), q.stride(0), s.stride(0), GROUP=GROUP_K, GROUPS=groups,
        FP8_MAX=FP8_MAX, AMAX_FLOOR_BITS=_AMAX_FLOOR_BITS, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return q, s


def block_m_for(m: int) -> int:
    """Token tile: the power of two >= m, between 16 (the smallest MMA N) and MAX_BLOCK_M."""
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        # inside a CUDA-graph capture this comes from the graph's pool and the zero-fill is recorded; the tensor is
        # held here, so the memory stays ours, and the counters reset themselves after every use
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def check_weight(k: int, wq: torch.Tensor, ws: torch.Tensor) -> None:
    """Raise ValueError naming the weight operand whose shape or dtype does not fit an activation of width ``k``."""
    n = wq.shape[0]
    if k % GROUP_K:
        raise ValueError(f"block_fp8_gemm: K={k} is not a multiple of {GROUP_K}")
    if wq.shape[1] != k or wq.stride(1) != 1:
        raise ValueError(f"block_fp8_gemm: the activation's K={k} and wq {tuple(wq.shape)} need the same K, "
                         "contiguous")
    if tuple(ws.shape) != (triton.cdiv(n, WEIGHT_BLOCK_N), k // GROUP_K):
        raise ValueError(f"block_fp8_gemm: ws has shape {tuple(ws.shape)}, expected "
                         f"{(triton.cdiv(n, WEIGHT_BLOCK_N), k // GROUP_K)}")
    if ws.dtype != torch.float32:
        raise ValueError(f"block_fp8_gemm: scales must be float32, got ws {ws.dtype}")


def check_operands(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> None:
    """Raise ValueError naming the operand whose shape or dtype the kernel cannot take."""
    m, k = xq.shape
    check_weight(k, wq, ws)
    if xq.stride(1) != 1:
        raise ValueError(f"block_fp8_gemm: xq {tuple(xq.shape)} needs contiguous rows")
    if tuple(xs.shape) != (m, k // GROUP_K):
        raise ValueError(f"block_fp8_gemm: xs has shape {tuple(xs.shape)}, expected {(m, k // GROUP_K)}")
    if xs.dtype != torch.float32:
        raise ValueError(f"block_fp8_gemm: scales must be float32, got xs {xs.dtype}")


def block_fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    block_n: int = 64,
    split_k: int = 1,
    prefetch: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """(xq * xs) @ (wq * ws)^T in float32, cast to ``out_dtype`` (+ bias): see the module docstring."""
    _check_config(block_n, split_k)
    check_operands(xq, xs, wq, ws)
    return _launch(xq, xs, wq, ws, out_dtype, bias, block_n, split_k, quant_x=False, prefetch=prefetch, pdl=pdl)


def block_fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     bias: torch.Tensor | None = None, block_n: int = 64, split_k: int = 1) -> torch.Tensor:
    """x [M, K] BF16 quantized per 1x128 group inside the kernel (``QUANT_X``), then as :func:`block_fp8_gemm`."""
    _check_config(block_n, split_k)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"block_fp8_linear: x must be a 2-D BF16 tensor with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)}")
    check_weight(x.shape[1], wq, ws)
    return _launch(x, x, wq, ws, out_dtype, bias, block_n, split_k, quant_x=True)  # x stands in for the unread xs


def _check_config(block_n: int, split_k: int) -> None:
    if block_n not in BLOCK_N_CHOICES or split_k not in SPLIT_K_CHOICES:
        raise ValueError(f"block_fp8_gemm: block_n {block_n} / split_k {split_k} not in "
                         f"{BLOCK_N_CHOICES} / {SPLIT_K_CHOICES}")


def _launch(x: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
            bias: torch.Tensor | None, block_n: int, split_k: int, quant_x: bool, prefetch: bool = False,
            pdl: bool = False) -> torch.Tensor:
    m, k = x.shape
    n = wq.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    block_m = block_m_for(m)
    k_groups = k // GROUP_K
    split_k = min(split_k, k_groups)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    if split_k > 1:
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        counts = _counters(x.device, grid[0] * grid[1])
    else:
        part = counts = out  # unused
    # a weight that is not 16-byte aligned (a view at an odd offset) is read without the prefetch
    prefetch = (prefetch and not INTERPRETED and wq.data_ptr() % PREFETCH_ALIGN == 0
                and wq.stride(0) % PREFETCH_ALIGN == 0)
    pdl = pdl and not INTERPRETED
    _block_fp8_gemm_kernel[grid](
        x, xs, wq, ws, out, bias if bias is not None else out, part, counts,
        m, n, k_groups, triton.cdiv(k_groups, split_k),
        x.stride(0), xs.stride(0), xs.stride(1), wq.stride(0), ws.stride(0), ws.stride(1), out.stride(0),
        GROUP=GROUP_K, W_BLOCK_N=WEIGHT_BLOCK_N, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=split_k,
        HAS_BIAS=bias is not None, QUANT_X=quant_x, PREFETCH=prefetch, PDL=pdl,
        num_warps=8 if block_m * block_n >= 8192 else 4, num_stages=4 if block_m <= 64 else 3, launch_pdl=pdl,
    )
    return out
