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
* the work is planned at run time from the step's lengths (``_plan``; its host mirror is ``plan_splits``): each
  sequence gets splits in proportion to its tiles, with one bound on the tiles a program reads: the fewest with which
  all splits fit one wave (``work_budget`` programs per KV head), if that is within 4/3 of an even share of the
  step's tiles, else ``FINE`` times less than the even share, over several waves. A long sequence among short ones
  is read by many programs, not by one that the whole step waits for. The grid is fixed per batch size
  (``grid_programs``), so a CUDA graph captured at one context replays at any lengths;
* a second launch merges each sequence's splits by their log-sum-exp, in split order (deterministic); with
  ``fused_merge`` (``FUSED_MERGE``, off: slower on an H100, sec. 37) the last split of each (sequence, KV head) to
  finish does that merge itself, counted by one atomic a split, and no merge launch runs;
* a first, small launch writes the plan (``_decode_attn_plan_kernel``) and both kernels read their part of it:
  three loads a program (``preplan``, the default since the H200 sweep of docs/RESULTS.md sec. 26a); a batch of one
  plans in closed form inside both kernels instead (``single_plan``, ``SINGLE_PLAN``, on: sec. 37);
  ``preplan=False`` computes the plan in every program of both launches instead (the same plan, so the same bits):
  the benchmark's baseline. In a served step the plan launch costs 2.6 us a layer (sec. 27b); a plan written once
  serves every layer of a step (``plan=``, :func:`decode_plan`; the dispatcher's kernels/step_plan.py).

K, V and the query are widened to FP16 in registers (E4M3 -> FP16 is exact); the scores and the weighted sum use FP16
MMAs with float32 accumulation, P rounded to FP16 (FA3's FP8 path rounds it to E4M3). That widening is most of the
loop's instructions (V is unpacked byte by byte as the transposed MMA operand): ``scripts/kernel_asm.py`` reads the
compiled loop (docs/RESULTS.md sec. 28f); a form with the tokens on the MMA's M side and 22 % fewer instructions was
not faster on an H100 (sec. 29a) and was removed. ``v_widen_tile`` (``V_WIDEN_TILE``, off) widens V on its tile as
loaded and hands the FP16 tile to the MMA through shared memory: no byte loads, a third fewer instructions (sec. 30f),
the same error against a float64 reference but not the same bits (its FP32 adds run in another order), and 1-11 %
slower than the default at 1-32 sequences on an H100, 4-11 % faster at 128-384 (sec. 31b). ``pdl`` (``PDL``, on)
launches the three kernels as programmatic dependent launches: each waits (``griddepcontrol.wait``) before reading
what the kernel before it wrote, the plan and the merge let the next kernel launch at once, the split kernel only after
its stores (an early successor would take SM slots from its later waves); the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources

from sglang_fp8rl.kernels.block_gemm import _quantize_columns
from sglang_fp8rl.kernels.pdl import INTERPRETED  # the interpreter widens V the plain way
from sglang_fp8rl.kernels.pdl import capable as pdl_capable
from sglang_fp8rl.kernels.split_kv_plan import (  # noqa: F401 - the plan's names, re-exported for the kernel's users
    DEFAULT_BLOCK_N,
    DEFAULT_FORMS,
    FINE,
    HEAD_DIMS,
    MAX_SPLITS,
    MIN_BLOCK_H,
    RESIDENT_PER_SM,
    call_grid,
    cannot_run,
    check_out_codes,
    grid_programs,
    plan_splits,
    sm_count,
    work_budget,
)
from sglang_fp8rl.kernels.split_kv_plan_kernel import (  # noqa: F401 - re-exported for the kernel's tests
    PLAN_BLOCK_P,
    _decode_attn_plan_kernel,
    _plan,
    _single_plan,
    check_plan,
    merge_counts,
    plan_constants,
    plan_size,
    write_plan,
)
from sglang_fp8rl.kernels.triton_quant import _AMAX_FLOOR_BITS
from sglang_fp8rl.quant import FP8_MAX

DEFAULT_WARPS = 4
DEFAULT_STAGES = 3
LOG2E = 1.4426950408889634
# the plan written once by a launch of its own and read by both kernels, instead of computed by every program: in the
# H200 sweep of docs/RESULTS.md sec. 26a, against the same tile and FINE without it, 0.87-1.00x the time (geometric
# mean over the tiles) at each of its 13 cells; at the default tile 1 x 12288 took 19.3 us instead of 23.5
PREPLAN = True
# V widened on its loaded tile and handed to the MMA through shared memory as FP16, instead of read back from shared
# memory one byte at a time as the transposed MMA operand: 734 instead of 1,105 SASS instructions a thread a tile, no
# LDS.U8, 74 KB of shared memory instead of 41 KB (scripts/kernel_asm.py --v-widen-tile). Off: slower on an H100 at
# 1-8 sequences (docs/RESULTS.md sec. 31b); the H200 is not measured
# (scripts/gpu/bench_decode_attention.py --v-widen-tile compares the two forms)
V_WIDEN_TILE = False
# programmatic dependent launches of the plan, split and merge kernels (compute capability 9.0 and later): on an
# H100, 1.6-2.7 us less a call than plain launches at 1-128 sequences, the same bits (scripts/gpu/
# bench_decode_attention.py --pdl: calls back to back in a CUDA graph; docs/RESULTS.md sec. 35d)
PDL = True
# a batch of one sequence (the tail of a rollout, its batch-1 graph) plans its splits in closed form inside both
# kernels, so no plan launch runs before them (``_single_plan``: the plan of ``_plan`` for one length, the same bits).
# scripts/gpu/bench_decode_attention.py --single-plan compares it with the default
SINGLE_PLAN = "single_plan" in DEFAULT_FORMS
# the sequence's last split to finish merges its partial results (an atomic count per sequence and KV head), so no
# merge launch follows the split launch; the same arithmetic as the merge kernel's
# (scripts/gpu/bench_decode_attention.py --fused-merge compares it with the default)
FUSED_MERGE = "fused_merge" in DEFAULT_FORMS
# what a launch raises when Triton cannot build the kernel for this GPU (its shared memory, an unsupported op): the
# caller may run another kernel instead; a kernel that compiled never raises these
BUILD_ERRORS = (CompilationError, OutOfResources)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """One tile of the online softmax over the tokens (axis 1) of log2 scores: (p, alpha, running max, sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _widen_tile(v8):
    """E4M3 -> FP16 (exact) by ``cvt.rn.f16x2.e4m3x2``, as an opaque (impure) op: Triton cannot move it into the MMA
    operand's layout, so the widening runs on the tile as loaded and the MMA reads FP16 through shared memory."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [v8.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _decode_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seqlens_ptr, k_descale_ptr, v_descale_ptr, part_o_ptr, part_lse_ptr,
    stride_q_tok, stride_q_head,
    stride_k_page, stride_k_off, stride_k_head,
    stride_v_page, stride_v_off, stride_v_head,
    stride_pt, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h,
    scale_log2, num_heads, batch, budget, plan_ptr, programs,
    counts_ptr, out_ptr, stride_o_tok, stride_o_head, codes_ptr, scales_ptr, stride_c_tok, stride_s_tok, stride_s_head,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MAX_SPLITS: tl.constexpr, FINE: tl.constexpr,
    PREPLAN: tl.constexpr, V_WIDEN_TILE: tl.constexpr = False, PDL: tl.constexpr = False,
    SINGLE: tl.constexpr = False, FUSED_MERGE: tl.constexpr = False, SPLITS_P2: tl.constexpr = 1,
    FP8_MAX: tl.constexpr = 448.0, AMAX_FLOOR_BITS: tl.constexpr = 0, QUANT_OUT: tl.constexpr = False,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    if PDL:
        gdc_wait()  # the plan, the query and the cache are written by the kernels before this one
    if SINGLE:  # one sequence: its plan in closed form, no plan launch
        tiles, splits = _single_plan(seqlens_ptr, budget, BLOCK_N, MAX_SPLITS)
        if program >= splits:
            return
        seq = program * 0
        split = program
        tiles_per_split = tl.cdiv(tiles, splits)
        my_splits = splits
    elif PREPLAN:  # the plan kernel's descriptors: three loads instead of the plan
        seq = tl.load(plan_ptr + program)
        if seq >= batch:
            return  # no work in this step's plan
        split = tl.load(plan_ptr + programs + program)
        tiles_per_split = tl.load(plan_ptr + 2 * programs + program)
        my_splits = 0
        if FUSED_MERGE:
            my_splits = tl.load(plan_ptr + 3 * programs + batch + seq)
    else:
        offs_b, tiles, splits, ends = _plan(seqlens_ptr, batch, budget, BLOCK_B, BLOCK_N, MAX_SPLITS, FINE)
        seq = tl.sum((ends <= program).to(tl.int32), 0)  # the sequence whose run of programs holds this one
        if seq >= batch:
            return  # the grid holds the most programs a plan can need; this one has no work in this step's plan
        mine = offs_b == seq
        my_splits = tl.sum(tl.where(mine, splits, 0), 0)
        split = program - (tl.sum(tl.where(mine, ends, 0), 0) - my_splits)
        tiles_per_split = tl.cdiv(tl.sum(tl.where(mine, tiles, 0), 0), my_splits)
    seq = seq.to(tl.int64)
    seqlen = tl.load(seqlens_ptr + seq)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seqlen)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    k_descale = tl.load(k_descale_ptr + seq * stride_kd_b + kv_head * stride_kd_h)
    v_descale = tl.load(v_descale_ptr + seq * stride_vd_b + kv_head * stride_vd_h)
    k_base = k_ptr + kv_head * stride_k_head + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_v_head + offs_d[None, :]
    row_scale = k_descale * scale_log2  # scores in log2 units
    q_ptrs = q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0).to(tl.float16)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        pos = t0 + offs_n
        pos_ok = pos < end
        page = tl.load(page_table_ptr + seq * stride_pt + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
        k_rows = page * stride_k_page + (pos % PAGE_SIZE) * stride_k_off
        v_rows = page * stride_v_page + (pos % PAGE_SIZE) * stride_v_off
        k = tl.load(k_base + k_rows[:, None], mask=pos_ok[:, None], other=0.0)
        s = tl.where(pos_ok[None, :], tl.dot(q, tl.trans(k.to(tl.float16))) * row_scale, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        v = tl.load(v_base + v_rows[:, None], mask=pos_ok[:, None], other=0.0)
        if V_WIDEN_TILE:
            v = _widen_tile(v)
        else:
            v = v.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)

    filled = l_i > 0.0  # an empty split (a sequence of length 0) has no tile
    o = acc * (v_descale / tl.where(filled, l_i, 1.0))[:, None]
    lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
    row = program.to(tl.int64) * num_heads + heads  # partial results indexed by program: one plan, no collisions
    tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=head_ok[:, None])
    tl.store(part_lse_ptr + row, lse, mask=head_ok)
    if FUSED_MERGE:  # the sequence's last split to finish merges its KV head's query heads (fused_merge)
        tl.debug_barrier()  # every thread's partial results stored before the release below
        count = counts_ptr + seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == my_splits - 1:
            tl.store(count, 0)  # ready for the next call (a kernel boundary orders it)
            for h in range(kv_head * GROUP, kv_head * GROUP + GROUP):
                _merge_head(part_o_ptr, part_lse_ptr, out_ptr, codes_ptr, scales_ptr, seq, h, program - split,
                            my_splits, num_heads, stride_o_tok, stride_o_head, stride_c_tok, stride_s_tok,
                            stride_s_head, SPLITS_P2, HEAD_DIM, FP8_MAX, AMAX_FLOOR_BITS, QUANT_OUT, ".cg")
    if PDL:
        gdc_launch_dependents()  # after the work: the merge's programs would take slots from this grid's later waves


@triton.jit
def _decode_attn_merge_kernel(seqlens_ptr, part_o_ptr, part_lse_ptr, out_ptr, stride_o_tok, stride_o_head,
                              num_heads, batch, budget, plan_ptr, programs, codes_ptr, scales_ptr, stride_c_tok,
                              stride_s_tok, stride_s_head, BLOCK_B: tl.constexpr,
                              BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, FINE: tl.constexpr,
                              SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, PREPLAN: tl.constexpr,
                              FP8_MAX: tl.constexpr, AMAX_FLOOR_BITS: tl.constexpr, PDL: tl.constexpr = False,
                              QUANT_OUT: tl.constexpr = False, SINGLE: tl.constexpr = False):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if PDL:
        gdc_wait()  # the split kernel's partial results
        gdc_launch_dependents()
    if SINGLE:
        first = seq * 0
        my_splits = _single_plan(seqlens_ptr, budget, BLOCK_N, MAX_SPLITS)[1]
    elif PREPLAN:
        first = tl.load(plan_ptr + 3 * programs + seq)
        my_splits = tl.load(plan_ptr + 3 * programs + batch + seq)
    else:
        offs_b, tiles, splits, ends = _plan(seqlens_ptr, batch, budget, BLOCK_B, BLOCK_N, MAX_SPLITS, FINE)
        mine = offs_b == seq
        my_splits = tl.sum(tl.where(mine, splits, 0), 0)
        first = tl.sum(tl.where(mine, ends, 0), 0) - my_splits
    _merge_head(part_o_ptr, part_lse_ptr, out_ptr, codes_ptr, scales_ptr, seq, head, first, my_splits, num_heads,
                stride_o_tok, stride_o_head, stride_c_tok, stride_s_tok, stride_s_head, SPLITS_P2, HEAD_DIM, FP8_MAX,
                AMAX_FLOOR_BITS, QUANT_OUT, "")


@triton.jit
def _merge_head(part_o_ptr, part_lse_ptr, out_ptr, codes_ptr, scales_ptr, seq, head, first, my_splits, num_heads,
                stride_o_tok, stride_o_head, stride_c_tok, stride_s_tok, stride_s_head, SPLITS_P2: tl.constexpr,
                HEAD_DIM: tl.constexpr, FP8_MAX: tl.constexpr, AMAX_FLOOR_BITS: tl.constexpr,
                QUANT_OUT: tl.constexpr, CACHE: tl.constexpr):
    """One sequence's output of one query head: its splits' partial results merged by their log-sum-exp, in split
    order (``CACHE`` ".cg": read from L2, as written by other programs of the same launch)."""
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < my_splits
    row = (first + offs_s).to(tl.int64) * num_heads + head
    lse = tl.load(part_lse_ptr + row, mask=split_ok, other=float("-inf"), cache_modifier=CACHE)
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(w, 0)
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None], other=0.0,
                cache_modifier=CACHE)
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    y = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d, y)
    if QUANT_OUT:  # one head's output is one 1x128 group of the o_proj input [tokens, heads * HEAD_DIM]
        codes, scale = _quantize_columns(tl.reshape(y, [HEAD_DIM, 1]), FP8_MAX, AMAX_FLOOR_BITS)
        tl.store(codes_ptr + seq.to(tl.int64) * stride_c_tok + head * HEAD_DIM + tl.reshape(offs_d, [HEAD_DIM, 1]),
                 codes)
        tl.store(scales_ptr + seq * stride_s_tok + head * stride_s_head + tl.arange(0, 1), scale)


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
    budget: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_WARPS,
    num_stages: int = DEFAULT_STAGES,
    fine: int = FINE,
    preplan: bool = PREPLAN,
    v_widen_tile: bool = V_WIDEN_TILE,
    pdl: bool = PDL,
    out_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    single_plan: bool = SINGLE_PLAN,
    plan: torch.Tensor | None = None,
    fused_merge: bool = FUSED_MERGE,
) -> torch.Tensor:
    """softmax(q K^T * scale) V per sequence and query head, K/V read from the FP8 cache: see the module docstring.

    ``q`` [B, H, D] (E4M3 or BF16), ``k_cache`` / ``v_cache`` [pages, page_size, H_kv, D] E4M3, ``page_table``
    [B, max_pages] int32, ``cache_seqlens`` [B] int32, ``k_descale`` / ``v_descale`` float32 broadcastable to
    [B, H_kv] (a scalar or per-head scale expanded); ``budget``: programs per KV head to share the step's tiles among
    (default ``work_budget``); ``fine``: how many times smaller than the even share the programs of a plan that does
    not fit one wave are (the grid holds ``grid_programs`` of them); ``preplan``: one small launch writes the plan
    first and the two kernels read their part of it, instead of every program computing it; ``v_widen_tile``: V
    widened on its tile (``V_WIDEN_TILE``; the same values reach the MMA, added in another order); ``pdl``: the three
    launches as programmatic dependent launches where the GPU has them (``PDL``; the same bits); ``out_codes``:
    (codes [B, H * D] e4m3, multipliers [B, H] float32, any strides) to write the output's 1x128 quantization into
    as well (D 128 only: one head a group), ``quant.quantize_activation_groups`` of the BF16 output bit for bit;
    ``single_plan``: a batch of one plans in closed form inside both kernels, without the plan launch (the same
    bits); ``plan``: the plan :func:`decode_plan` wrote for these lengths with the same planning arguments (another
    layer of the step; ``preplan`` only), read instead of written again; ``fused_merge``: the last split of each
    (sequence, KV head) to finish merges its query heads, without the merge launch (the same arithmetic). Returns
    ``out`` (or a new tensor) [B, H, D] in BF16."""
    reason = cannot_run(q, k_cache, v_cache, page_table, cache_seqlens)
    if reason:
        raise ValueError(f"fp8_decode_attention: {reason}")
    if not isinstance(fine, int) or fine < 1:
        raise ValueError(f"fp8_decode_attention: fine must be an int >= 1, got {fine!r}")
    for name, flag in (("preplan", preplan), ("v_widen_tile", v_widen_tile), ("pdl", pdl),
                       ("single_plan", single_plan), ("fused_merge", fused_merge)):
        if not isinstance(flag, bool):
            raise ValueError(f"fp8_decode_attention: {name} must be a bool, got {flag!r}")
    batch, heads, dim = q.shape
    if out_codes is not None:
        check_out_codes(out_codes, batch, heads, dim)
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if out is None:
        out = torch.empty(batch, heads, dim, dtype=torch.bfloat16, device=q.device)
    if batch == 0:
        return out
    k_descale = k_descale.expand(batch, kv_heads)
    v_descale = v_descale.expand(batch, kv_heads)
    budget, programs = call_grid(q, k_cache, budget, fine)
    part_o = torch.empty(programs * heads, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(programs * heads, dtype=torch.float32, device=q.device)
    pdl = pdl and pdl_capable(q.device)
    single = single_plan and batch == 1
    preplan = preplan and not single
    if preplan and plan is not None:
        check_plan(plan, programs, batch, q.device)
    elif preplan:
        plan = write_plan(cache_seqlens, budget, programs, block_n, fine, pdl)
    # without preplan the kernels never read plan_ptr: any int32 tensor will do, nothing is allocated
    plan_buf = plan if preplan else cache_seqlens
    planning = plan_constants(batch, block_n, fine)
    out3 = out.view(batch, heads, dim)
    codes, scales = out_codes if out_codes is not None else (out3, part_lse)  # not written without QUANT_OUT
    merged = (out3, out3.stride(0), out3.stride(1), codes, scales, codes.stride(0), scales.stride(0), scales.stride(-1))
    merge = dict(SPLITS_P2=triton.next_power_of_2(min(MAX_SPLITS, fine * budget)), FP8_MAX=FP8_MAX,
                 AMAX_FLOOR_BITS=_AMAX_FLOOR_BITS, QUANT_OUT=out_codes is not None)
    # fused_merge: one count of finished splits per (sequence, KV head), back at 0 after each call
    counts = merge_counts(q.device, batch * kv_heads) if fused_merge else cache_seqlens
    _decode_attn_split_kernel[(programs, kv_heads)](
        q, k_cache, v_cache, page_table, cache_seqlens, k_descale, v_descale, part_o, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), k_descale.stride(0), k_descale.stride(1), v_descale.stride(0), v_descale.stride(1),
        float(softmax_scale) * LOG2E, heads, batch, budget, plan_buf, programs, counts, *merged,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)), HEAD_DIM=dim,
        num_warps=num_warps, num_stages=num_stages, PREPLAN=preplan, V_WIDEN_TILE=v_widen_tile and not INTERPRETED,
        PDL=pdl, launch_pdl=pdl, SINGLE=single, FUSED_MERGE=fused_merge, **merge, **planning,
    )
    if fused_merge:
        return out
    out_ptr, stride_o_tok, stride_o_head, *coded = merged
    _decode_attn_merge_kernel[(batch, heads)](
        cache_seqlens, part_o, part_lse, out_ptr, stride_o_tok, stride_o_head, heads, batch, budget, plan_buf,
        programs, *coded, HEAD_DIM=dim, num_warps=4, PREPLAN=preplan, PDL=pdl, launch_pdl=pdl, SINGLE=single,
        **merge, **planning,
    )
    return out


def decode_plan(q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor, budget: int | None = None,
                block_n: int = DEFAULT_BLOCK_N, fine: int = FINE, pdl: bool = PDL) -> torch.Tensor:
    """The plan :func:`fp8_decode_attention` would write for these operands, written now (one launch), for every
    call over the same lengths to read (``plan=``)."""
    budget, programs = call_grid(q, k_cache, budget, fine)
    return write_plan(cache_seqlens, budget, programs, block_n, fine, pdl and pdl_capable(q.device))

