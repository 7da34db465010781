"""The cells of the decode-attention benchmarks (scripts/gpu/bench_decode_attention.py, scripts/gpu/fa3_knobs.py):
one query token per sequence over Qwen3-8B's attention and SGLang's paged FP8 cache, FA3's call on it, the CUDA-graph
timing over layer copies, the error against a float64 reference, and the loop that measures a run's cells."""
from __future__ import annotations

import json
import math
import os
import time

import torch
from decode_roofline_child import copy_bandwidth  # the roofline's measurement: one definition for all

from sglang_fp8rl.kernels.gemm_select import measure

HEADS, KV_HEADS, DIM = 32, 8, 128
CELLS = [(1, 4096), (1, 12288), (8, 4096), (8, 12288), (32, 4096), (32, 12288), (128, 1024), (128, 4096),
         (384, 1024)]
RAGGED_CELLS = [(8, 4096), (32, 4096), (64, 2048), (128, 1024)]
QUICK_CELLS = [(1, 4096), (8, 4096), (32, 4096), (128, 1024)]
RAGGED_SIGMA = 1.0
L2_DEFEAT_BYTES = 512 << 20  # the cache copies of a cell span at least this much
MAX_COPIES = 36
REPLAYS = 5


class Cell:
    """The caches, page table and queries of one (batch, context) cell, in ``copies`` layer copies."""

    def __init__(self, batch: int, context: int, dev: torch.device, bf16: bool, ragged: bool = False):
        self.batch, self.context, self.ragged = batch, context, ragged
        self.lengths = ragged_lengths(batch, context) if ragged else [context] * batch
        tokens = sum(self.lengths)
        layer_bytes = tokens * KV_HEADS * DIM * 2
        self.copies = max(2, min(MAX_COPIES, math.ceil(L2_DEFEAT_BYTES / layer_bytes)))
        slots = tokens + 1  # slot 0 is SGLang's padding slot
        gen = torch.Generator(device=dev).manual_seed(batch * 100003 + context)
        self.k = [(torch.randn(slots, 1, KV_HEADS, DIM, device=dev, generator=gen) * 1.5).to(torch.float8_e4m3fn)
                  for _ in range(self.copies)]
        self.v = [(torch.randn(slots, 1, KV_HEADS, DIM, device=dev, generator=gen) * 1.5).to(torch.float8_e4m3fn)
                  for _ in range(self.copies)]
        self.k_bf16 = [k.to(torch.bfloat16) for k in self.k] if bf16 else None
        self.v_bf16 = [v.to(torch.bfloat16) for v in self.v] if bf16 else None
        order = torch.randperm(batch, generator=torch.Generator().manual_seed(context)).tolist()
        offsets, next_slot = [0] * batch, 1  # each sequence's slots contiguous, the sequences in shuffled order
        for seq in order:
            offsets[seq], next_slot = next_slot, next_slot + self.lengths[seq]
        width = max(self.lengths)
        cols = torch.arange(width)[None, :]
        table = torch.tensor(offsets)[:, None] + cols
        table = torch.where(cols < torch.tensor(self.lengths)[:, None], table, 0)  # past a sequence's end: slot 0
        self.page_table = table.to(torch.int32).to(dev)
        self.seqlens = torch.tensor(self.lengths, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.q = torch.randn(batch, HEADS, DIM, device=dev, generator=gen).to(torch.bfloat16)
        self.q8 = self.q.to(torch.float8_e4m3fn)
        self.k_scale = torch.tensor([0.75], device=dev)
        self.v_scale = torch.tensor([1.25], device=dev)
        self.scale = DIM ** -0.5

    @property
    def label(self) -> str:
        return f"{self.batch} x {self.context}{'r' if self.ragged else ''}"

    def read_bytes(self, kv_bytes_per_elem: int, q_bytes: int) -> int:
        kv = 2 * sum(self.lengths) * KV_HEADS * DIM * kv_bytes_per_elem
        return kv + self.batch * HEADS * DIM * (q_bytes + 2)

    def reference(self, seqs: int = 2) -> torch.Tensor:
        """float64 attention of the first ``seqs`` sequences (layer copy 0), from the E4M3 query and cache."""
        group = HEADS // KV_HEADS
        out = []
        for b in range(min(seqs, self.batch)):
            rows = self.page_table[b, : self.lengths[b]].long()
            k = self.k[0][rows, 0].float().double() * self.k_scale.double()
            v = self.v[0][rows, 0].float().double() * self.v_scale.double()
            q = self.q8[b].float().double()
            k = k.repeat_interleave(group, dim=1)  # [ctx, heads, dim]
            v = v.repeat_interleave(group, dim=1)
            s = torch.einsum("hd,thd->ht", q, k) * self.scale
            out.append(torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), v))
        return torch.stack(out)


def ragged_lengths(batch: int, mean: int) -> list[int]:
    """``batch`` lognormal contexts of mean ``mean`` (sigma RAGGED_SIGMA), clipped to [64, 8 x mean], seeded."""
    gen = torch.Generator().manual_seed(batch * 7 + mean)
    draw = torch.exp(torch.randn(batch, generator=gen, dtype=torch.float64) * RAGGED_SIGMA)
    return [int(x) for x in (draw / draw.mean() * mean).clamp(64, 8 * mean).round().tolist()]


def fa3_calls(cell: Cell, fp8: bool, num_splits: int = 0, pack_gqa: bool | None = None):
    """FA3 on the cell's cache as SGLang calls it; ``num_splits`` / ``pack_gqa`` are FA3's knobs (0 / None: its
    heuristics, what SGLang runs), in the call and in its scheduler metadata alike (scripts/gpu/fa3_knobs.py)."""
    from sgl_kernel.flash_attn import flash_attn_with_kvcache, get_scheduler_metadata

    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    meta = get_scheduler_metadata(batch_size=cell.batch, max_seqlen_q=1, max_seqlen_k=max(cell.lengths),
                                  num_heads=HEADS, num_heads_k=KV_HEADS, headdim=DIM, cache_seqlens=cell.seqlens,
                                  qkv_dtype=dtype, cu_seqlens_q=cell.cu_q, page_size=1, causal=True,
                                  has_softcap=False, num_splits=num_splits, pack_gqa=pack_gqa)
    extra = {}
    if fp8:
        shape = (cell.batch, KV_HEADS)
        extra = {"k_descale": cell.k_scale.expand(shape), "v_descale": cell.v_scale.expand(shape)}
    q = cell.q8 if fp8 else cell.q
    ks, vs = (cell.k, cell.v) if fp8 else (cell.k_bf16, cell.v_bf16)

    def call(i: int) -> torch.Tensor:
        return flash_attn_with_kvcache(q=q, k_cache=ks[i], v_cache=vs[i], page_table=cell.page_table,
                                       cache_seqlens=cell.seqlens, cu_seqlens_q=cell.cu_q, max_seqlen_q=1,
                                       softmax_scale=cell.scale, causal=True, scheduler_metadata=meta,
                                       num_splits=num_splits, pack_gqa=pack_gqa, **extra)
    return call


def time_graph(call, copies: int) -> float:
    """Microseconds per call: every layer copy once per CUDA graph, replayed REPLAYS times, median."""
    return measure.time_graph(call, nrot=copies, calls=copies, reps=REPLAYS)


def error_vs(ref: torch.Tensor, out: torch.Tensor) -> dict:
    got = out[: ref.shape[0]].double()
    diff = (got - ref).abs()
    return {"max_abs": float(diff.max()), "max_rel": float((diff / ref.abs().clamp_min(1e-2)).max()),
            "ref_max": float(ref.abs().max())}


def cell_label(row: dict) -> str:
    """'8 x 4096', or '8 x 4096r (max 21337)' for ragged contexts of mean 4096."""
    if not row.get("ragged"):
        return f"{row['batch']} x {row['context']}"
    return f"{row['batch']} x {row['context']}r (max {row['max_context']})"


def cells_of(which: str, quick: bool = False) -> list[tuple[int, int, bool]]:
    """(batch, context, ragged) of the cells of equal contexts, the ragged ones, or both ("all")."""
    cells = [(b, c, False) for b, c in (QUICK_CELLS if quick else CELLS) if which != "ragged"]
    return cells + [(b, c, True) for b, c in RAGGED_CELLS if which != "equal"]


def new_result(script: str, dev: torch.device) -> dict:
    """A run's record before its cells: the device, its SMs, the copy bandwidth measured now, the date, torch."""
    props = torch.cuda.get_device_properties(dev)
    copy = copy_bandwidth(1 << 30)
    if "gbps" not in copy:
        raise SystemExit(f"{script}: no copy bandwidth to compare with: {copy['skipped']}")
    return {"device": props.name, "sms": props.multi_processor_count, "copy_gbps": copy["gbps"],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__, "cells": []}


def write_report(text: str, path: str) -> None:
    """The markdown report into ``path`` (its folder made) and on stdout."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)


def run_cells(cells, dev, t0: float, deadline_s: float, result: dict, report_of, out_json: str, run_one) -> None:
    """Each cell built in turn and measured by ``run_one(cell, its deadline)`` into result["cells"]; its report line
    printed and the result written after every cell (a killed call keeps what it measured)."""
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    for i, (batch, context, ragged) in enumerate(cells):
        cell = Cell(batch, context, dev, bf16=True, ragged=ragged)
        result["cells"].append(run_one(cell, t0 + deadline_s * (i + 1) / len(cells)))
        del cell
        torch.cuda.empty_cache()
        print(report_of(result).splitlines()[-1], flush=True)
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
