"""The split-KV decode attention's host side (Triton-free): which calls it takes, and how a step's work is planned.

:func:`plan_splits` mirrors the plan the kernel computes on the GPU from each step's lengths
(:mod:`sglang_fp8rl.kernels.fp8_decode_attention`); :func:`work_budget` and :func:`grid_programs` size its grid;
:func:`cannot_run` and :func:`check_out_codes` judge a call's operands before anything is launched.
"""

from __future__ import annotations

import torch

from sglang_fp8rl.quant import DEFAULT_GROUP_SIZE

MIN_BLOCK_H = 16  # the smallest MMA M: a GQA group of 4 query heads is padded to it
# head dims it takes: 128 measured on H100 / H200, 64 on CPU only; 256 would double the K/V tiles in shared memory
HEAD_DIMS = (64, 128)
MAX_SPLITS = 64  # splits of one sequence at most: the merge reads this many partial results per row
# the defaults, from two sweeps on H100s (docs/RESULTS.md sec. 23a): 128 tokens per step with 4 warps was the
# fastest of BLOCK_N 32/64/128 x 4/8 warps x 2-4 stages at every cell of the first, and within 10 % of the best
# configuration at every cell of the second (BLOCK_N 64/128 x 2-4 stages x 16 split counts)
DEFAULT_BLOCK_N = 128
# programs per SM in the work budget (one wave): chosen by measurement, not derived from the SM's resources (the
# default configuration, compiled offline for sm90 by Triton 3.7, reports 20 KB of shared memory at 2, 3 and 4
# stages alike). On the H100 sweep at equal lengths, the splits this budget gives (32 at batch 1, 1 from batch 32
# on) were the best measured, and the ceiling of the same quotient (5 at batch 8: a second wave of 56 programs) was
# 1.28x slower than the best there
RESIDENT_PER_SM = 2
# when the splits of ragged lengths do not fit one wave at about the even share of tiles per program, the plan takes
# programs this many times smaller over several waves: in the H100 sweep of ragged batches (docs/RESULTS.md sec. 24b)
# three times the one-wave budget was the fastest budget tried at 32-128 sequences, 1.18-1.22x faster than one wave's
FINE = 3
# the kernel's optional forms, each the same arithmetic with fewer launches, that a server turns on with
# --fp8rl-split-kv-forms: single_plan (a batch of one plans in closed form inside both kernels, no plan launch),
# step_plan (one plan a decode step for all its layers, kernels/step_plan.py), fused_merge (the last split of each
# sequence merges the splits, no merge launch). On by default those measured faster with the same bits, per call on
# an H100 (scripts/gpu/bench_decode_attention.py, docs/RESULTS.md sec. 37): single_plan 9.8 against 11.7 us at
# 1 x 4096; step_plan 0.4-2.1 us less a call at 1-128 sequences; fused_merge 4-34 % slower (the last split merges
# the group's heads one after the other), so off
FORMS = ("single_plan", "step_plan", "fused_merge")
DEFAULT_FORMS: tuple[str, ...] = ("single_plan", "step_plan")
def work_budget(kv_heads: int, sms: int, per_sm: int = RESIDENT_PER_SM) -> int:
    """Programs per KV head that one wave of resident programs holds: the step's tiles are shared among this many."""
    return max(1, sms * per_sm // max(1, kv_heads))


def grid_programs(batch: int, budget: int, fine: int = FINE) -> int:
    """Programs per KV head the grid must hold for any lengths: a plan's splits sum to at most fine x budget + batch."""
    return fine * budget + batch


def call_grid(q: torch.Tensor, k_cache: torch.Tensor, budget: int | None, fine: int) -> tuple[int, int]:
    """(programs per KV head a wave, programs per KV head in the grid) for a call."""
    if budget is None:
        budget = work_budget(k_cache.shape[2], sm_count(q.device))
    return budget, grid_programs(q.shape[0], budget, fine)


def plan_splits(seqlens: list[int], budget: int, block_n: int = DEFAULT_BLOCK_N, fine: int = FINE) -> list[int]:
    """Splits per sequence as the kernel plans them (the host's mirror of ``_plan``): the fewest tiles per program
    with which all splits fit one wave of ``budget`` programs, if that is at most 4/3 of the step's tiles over
    ``budget``; else ``fine`` times smaller programs than that even share, over several waves. Each sequence gets
    ceil(its tiles / tiles per program) splits, at least one, at most MAX_SPLITS."""
    tiles = [-(-n // block_n) for n in seqlens]
    even = max(1, -(-sum(tiles) // budget))

    def splits(per_program: int) -> list[int]:
        return [min(MAX_SPLITS, max(1, -(-t // per_program))) for t in tiles]

    # a batch of exactly ``budget`` sequences fits one wave with one split each (found by the property test)
    lo, hi = even, max(even, max(tiles)) if len(tiles) <= budget else even
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(max(1, -(-t // mid)) for t in tiles) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return splits(lo if 3 * lo <= 4 * even else max(1, -(-even // fine)))


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


def check_out_codes(out_codes: tuple[torch.Tensor, torch.Tensor], batch: int, heads: int, dim: int) -> None:
    """Refuse an ``out_codes`` pair that is not (e4m3 [B, H * D], float32 [B, H]) for a head dim of one group."""
    codes, scales = out_codes
    if dim != DEFAULT_GROUP_SIZE:
        raise ValueError(f"fp8_decode_attention: out_codes needs a head dim of {DEFAULT_GROUP_SIZE} (one head a "
                         f"group), got {dim}")
    if codes.dtype != torch.float8_e4m3fn or tuple(codes.shape) != (batch, heads * dim) or codes.stride(1) != 1:
        raise ValueError(f"fp8_decode_attention: out_codes[0] must be float8_e4m3fn [{batch}, {heads * dim}] with "
                         f"contiguous rows, got {codes.dtype} {tuple(codes.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (batch, heads):
        raise ValueError(f"fp8_decode_attention: out_codes[1] must be float32 [{batch}, {heads}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a few on CPU, where the interpreter runs the kernel)."""
    if device.type != "cuda":
        return 8  # the Triton interpreter on CPU: a few splits, so that the merge is exercised
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
