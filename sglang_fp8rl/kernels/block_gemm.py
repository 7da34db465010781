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
  per-tile counters reset themselves, so the kernel is CUDA-graph safe; they are kept per CUDA stream.

Whether it is used for a shape is decided by measurement only (:mod:`sglang_fp8rl.kernels.gemm_select`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE, DEFAULT_GROUP_SIZE

GROUP_K = DEFAULT_GROUP_SIZE  # activation group = weight block along K = one K step (the kernel takes no other)
WEIGHT_BLOCK_N = DEFAULT_BLOCK_SIZE[0]  # weight-scale rows cover this many output channels
BLOCK_N_CHOICES = (64, 128)
SPLIT_K_CHOICES = (1, 2, 4)
MAX_BLOCK_M = 128

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}  # per (device, stream): int32 per-tile counters


@triton.jit
def _block_fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, bias_ptr, part_ptr, count_ptr,
    M, N, K_GROUPS, GROUPS_PER_SPLIT,
    stride_xm, stride_xsm, stride_xsg, stride_wn, stride_wsn, stride_wsg, stride_om,
    GROUP: tl.constexpr, W_BLOCK_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(g_start, g_end):
        w = tl.load(w_ptrs + g * GROUP, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs + g * GROUP, mask=m_ok[None, :], other=0.0)
        xs = tl.load(xs_ptrs + g * stride_xsg, mask=m_ok, other=0.0)
        ws = tl.load(ws_row + g * stride_wsg)
        acc += tl.dot(w, x) * (xs * ws)[None, :]

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
def _store_out(acc, out_ptr, bias_ptr, offs_n, offs_m, n_ok, out_mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


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


def check_operands(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> None:
    """Raise ValueError naming the operand whose shape or dtype the kernel cannot take."""
    m, k = xq.shape
    n = wq.shape[0]
    if k % GROUP_K:
        raise ValueError(f"block_fp8_gemm: K={k} is not a multiple of {GROUP_K}")
    if wq.shape[1] != k or wq.stride(1) != 1 or xq.stride(1) != 1:
        raise ValueError(f"block_fp8_gemm: xq {tuple(xq.shape)} and wq {tuple(wq.shape)} need the same K, contiguous")
    if tuple(xs.shape) != (m, k // GROUP_K):
        raise ValueError(f"block_fp8_gemm: xs has shape {tuple(xs.shape)}, expected {(m, k // GROUP_K)}")
    if tuple(ws.shape) != (triton.cdiv(n, WEIGHT_BLOCK_N), k // GROUP_K):
        raise ValueError(f"block_fp8_gemm: ws has shape {tuple(ws.shape)}, expected "
                         f"{(triton.cdiv(n, WEIGHT_BLOCK_N), k // GROUP_K)}")
    if xs.dtype != torch.float32 or ws.dtype != torch.float32:
        raise ValueError(f"block_fp8_gemm: scales must be float32, got xs {xs.dtype}, ws {ws.dtype}")


def block_fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    block_n: int = 64,
    split_k: int = 1,
) -> torch.Tensor:
    """(xq * xs) @ (wq * ws)^T in float32, cast to ``out_dtype`` (+ bias): see the module docstring."""
    if block_n not in BLOCK_N_CHOICES or split_k not in SPLIT_K_CHOICES:
        raise ValueError(f"block_fp8_gemm: block_n {block_n} / split_k {split_k} not in "
                         f"{BLOCK_N_CHOICES} / {SPLIT_K_CHOICES}")
    check_operands(xq, xs, wq, ws)
    m, k = xq.shape
    n = wq.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    block_m = block_m_for(m)
    k_groups = k // GROUP_K
    split_k = min(split_k, k_groups)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    if split_k > 1:
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=xq.device)
        counts = _counters(xq.device, grid[0] * grid[1])
    else:
        part = counts = out  # unused
    _block_fp8_gemm_kernel[grid](
        xq, xs, wq, ws, out, bias if bias is not None else out, part, counts,
        m, n, k_groups, triton.cdiv(k_groups, split_k),
        xq.stride(0), xs.stride(0), xs.stride(1), wq.stride(0), ws.stride(0), ws.stride(1), out.stride(0),
        GROUP=GROUP_K, W_BLOCK_N=WEIGHT_BLOCK_N, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=split_k,
        HAS_BIAS=bias is not None,
        num_warps=8 if block_m * block_n >= 8192 else 4, num_stages=4 if block_m <= 64 else 3,
    )
    return out
