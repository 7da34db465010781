"""Split-KV decode attention over an FP8 (E4M3) paged KV cache (Triton): one query token per sequence.

The call is FlashAttention-3's decode call as SGLang's FA3 backend makes it with an FP8 cache
(``flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale, k_descale, v_descale)``),
and the arithmetic is FA3's up to rounding: the query as it arrives (SGLang casts it to E4M3), ``k_descale`` and
``v_descale`` the dequantization multipliers of K and V per (sequence, KV head), the softmax in float32.

Why a kernel of our own: a decode step reads each sequence's whole cache once, so it is bound by bandwidth; FA3's FP8
decode read its cache at 1.6-2.0 TB/s on an H100 and an H200, where its BF16 decode reads twice the bytes at 2.4-3.5
TB/s (docs/RESULTS.md sec. 21a), so half the bytes bought 1.1-1.3x. This kernel is flash-decoding:

* one program per (KV split, KV head, sequence) reads its slice of the cache once for all the query heads of the
  group (GQA), as ``BLOCK_N`` gathered rows of K and V per step (any page size; page size 1 is SGLang's default);
* the splits are fixed per batch size (``num_splits``), not per context, so a CUDA graph captured at one batch size
  replays at any context: each split takes an equal share of the sequence's tiles at run time;
* a second launch merges the splits by their log-sum-exp, in split order (deterministic).

K, V and the query are widened to FP16 in registers (E4M3 -> FP16 is exact); the scores and the weighted sum use FP16
MMAs with float32 accumulation, P rounded to FP16 (FA3's FP8 path rounds it to E4M3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

MIN_BLOCK_H = 16  # the smallest MMA M: a GQA group of 4 query heads is padded to it
# head dims it takes: 128 measured on H100 / H200, 64 on CPU only; 256 would double the K/V tiles in shared memory
HEAD_DIMS = (64, 128)
MAX_SPLITS = 64
# the defaults, from two sweeps on H100s (docs/RESULTS.md sec. 23a): 128 tokens per step with 4 warps was the
# fastest of BLOCK_N 32/64/128 x 4/8 warps x 2-4 stages at every cell of the first, and within 10 % of the best
# configuration at every cell of the second (BLOCK_N 64/128 x 2-4 stages x 16 split counts)
DEFAULT_BLOCK_N = 128
DEFAULT_WARPS = 4
DEFAULT_STAGES = 3
# programs of the default configuration an SM holds at once (their K and V tiles in flight, 32 KB a stage, fill most
# of its shared memory): the splits fill one wave of them and never start a second, partly empty one. On the H100
# sweep, the splits of this rule (33 at batch 1, 1 from batch 32 on) were the best measured, and the ceiling of the
# same quotient (5 at batch 8: a second wave of 56 programs) was 1.28x slower than the best there
RESIDENT_PER_SM = 2
LOG2E = 1.4426950408889634
# what a launch raises when Triton cannot build the kernel for this GPU (its shared memory, an unsupported op): the
# caller may run another kernel instead; a kernel that compiled never raises these
BUILD_ERRORS = (CompilationError, OutOfResources)


@triton.jit
def _decode_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seqlens_ptr, k_descale_ptr, v_descale_ptr, part_o_ptr, part_lse_ptr,
    stride_q_tok, stride_q_head,
    stride_k_page, stride_k_off, stride_k_head,
    stride_v_page, stride_v_off, stride_v_head,
    stride_pt, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h,
    scale_log2, num_heads, num_splits,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    seqlen = tl.load(seqlens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seqlen)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float16)
    k_descale = tl.load(k_descale_ptr + seq * stride_kd_b + kv_head * stride_kd_h)
    v_descale = tl.load(v_descale_ptr + seq * stride_vd_b + kv_head * stride_vd_h)
    k_base = k_ptr + kv_head * stride_k_head + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_v_head + offs_d[None, :]
    row_scale = k_descale * scale_log2  # scores in log2 units

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        pos = t0 + offs_n
        pos_ok = pos < end
        page = tl.load(page_table_ptr + seq * stride_pt + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
        k_rows = page * stride_k_page + (pos % PAGE_SIZE) * stride_k_off
        v_rows = page * stride_v_page + (pos % PAGE_SIZE) * stride_v_off
        k = tl.load(k_base + k_rows[:, None], mask=pos_ok[:, None], other=0.0).to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * row_scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_rows[:, None], mask=pos_ok[:, None], other=0.0).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new

    filled = l_i > 0.0  # an empty split (a short sequence) has no tile
    o = acc * (v_descale / tl.where(filled, l_i, 1.0))[:, None]
    lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
    row = (seq * num_heads + heads) * num_splits + split
    tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=head_ok[:, None])
    tl.store(part_lse_ptr + row, lse, mask=head_ok)


@triton.jit
def _decode_attn_merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_o_tok, stride_o_head, num_heads, num_splits,
                  SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    row = (seq * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(w, 0)
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + offs_d, o.to(out_ptr.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, sms: int, per_sm: int = RESIDENT_PER_SM) -> int:
    """Splits per (sequence, KV head) for a batch: as many as one wave of resident programs holds (1 to
    ``MAX_SPLITS``)."""
    return max(1, min(MAX_SPLITS, sms * per_sm // max(1, batch * kv_heads)))


def cannot_run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
               cache_seqlens: torch.Tensor) -> str | None:
    """Why this kernel cannot take the call, or None (the caller has already checked it is a plain decode)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        return f"q {tuple(q.shape)} / k_cache {tuple(k_cache.shape)}: expected [tokens, heads, dim] / [pages, " \
               "page_size, kv_heads, dim]"
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        return f"KV cache {k_cache.dtype} / {v_cache.dtype}, not float8_e4m3fn"
    if tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.shape[3] != dim:
        return f"K {tuple(k_cache.shape)} and V {tuple(v_cache.shape)} caches differ, or from q's head dim {dim}"
    if dim not in HEAD_DIMS:
        return f"head dim {dim} (only {HEAD_DIMS})"
    if kv_heads == 0 or heads % kv_heads or heads // kv_heads > MIN_BLOCK_H * 4:
        return f"{heads} query heads over {kv_heads} KV heads"
    if tokens != cache_seqlens.shape[0] or page_table.shape[0] != tokens:
        return f"{tokens} query tokens for {cache_seqlens.shape[0]} sequences: not one token per sequence"
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1 or page_table.stride(1) != 1:
        return "a non-contiguous head dimension or page table row"
    return None


def fp8_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_WARPS,
    num_stages: int = DEFAULT_STAGES,
) -> torch.Tensor:
    """softmax(q K^T * scale) V per sequence and query head, K/V read from the FP8 cache: see the module docstring.

    ``q`` [B, H, D] (E4M3 or BF16), ``k_cache`` / ``v_cache`` [pages, page_size, H_kv, D] E4M3, ``page_table``
    [B, max_pages] int32, ``cache_seqlens`` [B] int32, ``k_descale`` / ``v_descale`` float32 broadcastable to
    [B, H_kv] (a scalar or per-head scale expanded). Returns ``out`` (or a new tensor) [B, H, D] in BF16."""
    reason = cannot_run(q, k_cache, v_cache, page_table, cache_seqlens)
    if reason:
        raise ValueError(f"fp8_decode_attention: {reason}")
    batch, heads, dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if out is None:
        out = torch.empty(batch, heads, dim, dtype=torch.bfloat16, device=q.device)
    if batch == 0:
        return out
    k_descale = k_descale.expand(batch, kv_heads)
    v_descale = v_descale.expand(batch, kv_heads)
    if splits is None:
        splits = num_splits(batch, kv_heads, _sm_count(q.device))
    part_o = torch.empty(batch * heads * splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch * heads * splits, dtype=torch.float32, device=q.device)
    _decode_attn_split_kernel[(splits, kv_heads, batch)](
        q, k_cache, v_cache, page_table, cache_seqlens, k_descale, v_descale, part_o, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), k_descale.stride(0), k_descale.stride(1), v_descale.stride(0), v_descale.stride(1),
        float(softmax_scale) * LOG2E, heads, splits,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
    out3 = out.view(batch, heads, dim)
    _decode_attn_merge_kernel[(batch, heads)](
        part_o, part_lse, out3, out3.stride(0), out3.stride(1), heads, splits,
        SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=dim, num_warps=4,
    )
    return out


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the Triton interpreter on CPU: a few splits, so that the merge is exercised
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
