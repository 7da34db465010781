"""The split-KV decode attention's plan on the GPU: which sequence, split and tiles each program of the split launch
takes, computed from the step's lengths (the host's mirror is :func:`sglang_fp8rl.kernels.split_kv_plan.plan_splits`).

:func:`write_plan` launches the plan kernel once and returns the buffer the split and merge kernels of
:mod:`sglang_fp8rl.kernels.fp8_decode_attention` read (``preplan``). Every layer of a decode step attends over the
same lengths, so one plan serves them all (kernels/step_plan.py keeps the step's plan for the dispatcher).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglang_fp8rl.kernels.split_kv_plan import MAX_SPLITS

PLAN_BLOCK_P = 64  # split-launch programs one program of the plan launch describes (``preplan``)


def plan_size(programs: int, batch: int) -> int:
    """int32 entries of a plan: (sequence, split, tiles) per program of the split launch, (first program, splits)
    per sequence."""
    return 3 * programs + 2 * batch


def plan_constants(batch: int, block_n: int, fine: int) -> dict:
    """The compile-time constants every kernel that computes or reads a plan takes."""
    return dict(BLOCK_B=triton.next_power_of_2(batch), BLOCK_N=block_n, MAX_SPLITS=MAX_SPLITS, FINE=fine)


def check_plan(plan: torch.Tensor, programs: int, batch: int, device: torch.device) -> None:
    """Refuse a ``plan`` not written for a grid of ``programs`` over ``batch`` sequences on ``device``."""
    size = plan_size(programs, batch)
    if plan.dtype != torch.int32 or plan.numel() != size or plan.device != device:
        raise ValueError(f"fp8_decode_attention: plan must be int32 [{size}] on {device} (decode_plan's for this "
                         f"call), got {plan.dtype} {tuple(plan.shape)} on {plan.device}")


_COUNTS: dict[tuple[torch.device, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept: a CUDA graph captured with an earlier buffer goes on using it


def merge_counts(device: torch.device, rows: int) -> torch.Tensor:
    """Zeroed int32 counts of at least ``rows`` entries for the current stream of ``device`` (``fused_merge``): each
    call leaves them at 0, so one buffer serves every call of the stream; two streams never share one."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream)
    kept = _COUNTS.get(key)
    if kept is None or kept.numel() < rows:
        if kept is not None:
            _OUTGROWN.append(kept)
        _COUNTS[key] = torch.zeros(max(rows, 2 * kept.numel() if kept is not None else rows), dtype=torch.int32,
                                   device=device)
    return _COUNTS[key]


def write_plan(cache_seqlens: torch.Tensor, budget: int, programs: int, block_n: int, fine: int,
               pdl: bool) -> torch.Tensor:
    """The plan for these lengths (``budget`` programs per KV head a wave, a grid of ``programs``), written by one
    launch into a new int32 buffer."""
    batch = cache_seqlens.shape[0]
    plan = torch.empty(plan_size(programs, batch), dtype=torch.int32, device=cache_seqlens.device)
    _decode_attn_plan_kernel[(triton.cdiv(programs, PLAN_BLOCK_P),)](
        cache_seqlens, plan, batch, budget, programs, BLOCK_P=PLAN_BLOCK_P, PDL=pdl, launch_pdl=pdl,
        **plan_constants(batch, block_n, fine))
    return plan


@triton.jit
def _plan(seqlens_ptr, batch, budget, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
          FINE: tl.constexpr):
    """Per sequence: its tiles, its splits and the end of its run of programs (cumulative splits); see plan_splits."""
    offs_b = tl.arange(0, BLOCK_B)
    in_batch = offs_b < batch
    tiles = tl.cdiv(tl.load(seqlens_ptr + offs_b, mask=in_batch, other=0), BLOCK_N)
    even = tl.maximum(tl.cdiv(tl.sum(tiles, 0), budget), 1)  # tiles per program if they divided evenly
    # the fewest tiles per program with which every sequence's splits fit one wave (a binary search; none fits when
    # the batch alone overfills the wave; a batch of exactly one wave fits with one split each)
    lo = even
    hi = tl.where(batch <= budget, tl.maximum(even, tl.max(tiles, 0)), even)
    while lo < hi:
        mid = (lo + hi) // 2
        fits = tl.sum(tl.where(in_batch, tl.maximum(tl.cdiv(tiles, mid), 1), 0), 0) <= budget
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid + 1)
    # one wave if it costs at most 4/3 of the even share, else FINE times more, smaller programs over several waves
    per_program = tl.where(3 * lo <= 4 * even, lo, tl.maximum(tl.cdiv(even, FINE), 1))
    splits = tl.where(in_batch, tl.minimum(tl.maximum(tl.cdiv(tiles, per_program), 1), MAX_SPLITS), 0)
    return offs_b, tiles, splits, tl.cumsum(splits, 0)


@triton.jit
def _single_plan(seqlens_ptr, budget, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """One sequence's (tiles, splits): ``_plan`` for a batch of one, whose binary search ends at its start, the even
    share of the tiles (with it the splits fit one wave)."""
    tiles = tl.cdiv(tl.load(seqlens_ptr), BLOCK_N)
    per_program = tl.maximum(tl.cdiv(tiles, budget), 1)
    return tiles, tl.minimum(tl.maximum(tl.cdiv(tiles, per_program), 1), MAX_SPLITS)


@triton.jit
def _decode_attn_plan_kernel(seqlens_ptr, plan_ptr, batch, budget, programs, BLOCK_B: tl.constexpr,
                             BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, FINE: tl.constexpr,
                             BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    """The step's plan written once (``preplan``), for BLOCK_P programs per program of this launch: per program of
    the split launch its sequence (``batch``: no work), split and tiles per split, at plan_ptr[0:3 * programs]; per
    sequence its first program and its splits after them."""
    if PDL:
        gdc_wait()  # the lengths were written by the step's preparation, before the kernel before this one
        gdc_launch_dependents()  # the split kernel waits for this grid before it reads the plan
    offs_b, tiles, splits, ends = _plan(seqlens_ptr, batch, budget, BLOCK_B, BLOCK_N, MAX_SPLITS, FINE)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    seq = tl.sum((ends[None, :] <= offs_p[:, None]).to(tl.int32), 1)
    mine = offs_b[None, :] == seq[:, None]
    my_splits = tl.sum(tl.where(mine, splits[None, :], 0), 1)
    split = offs_p - (tl.sum(tl.where(mine, ends[None, :], 0), 1) - my_splits)
    tiles_per_split = tl.cdiv(tl.sum(tl.where(mine, tiles[None, :], 0), 1), tl.maximum(my_splits, 1))
    in_grid = offs_p < programs
    tl.store(plan_ptr + offs_p, seq, mask=in_grid)
    tl.store(plan_ptr + programs + offs_p, split, mask=in_grid)
    tl.store(plan_ptr + 2 * programs + offs_p, tiles_per_split, mask=in_grid)
    if tl.program_id(0) == 0:
        in_batch = offs_b < batch
        tl.store(plan_ptr + 3 * programs + offs_b, ends - splits, mask=in_batch)
        tl.store(plan_ptr + 3 * programs + batch + offs_b, splits, mask=in_batch)
