"""The measurement loop (autotune), in two phases, both by measurement.

Phase 1 (:func:`measure_defaults`) times ``deepgemm_default`` at every bucket of every shape (largest weight first;
its kernels are the ones CUDA-graph capture needs anyway) and its efficiency: ``linear_bytes`` / time / copy
bandwidth. Phase 2 (:func:`measure_alternatives`) measures, least efficient entry first, the other candidates where
that efficiency is low: a DeepGEMM ``num_sms`` variant below ``variant_below`` (each new variant configuration costs
a JIT compile of seconds), any other candidate below ``alt_below``; an entry efficient enough is complete without
them. No new measurement starts once the budget is spent; entries it cut are not returned (a later start measures
them). A non-default candidate must beat the default by ``min_gain``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from sglang_fp8rl.kernels.gemm_select.buckets import DEFAULT_MAX_M, bucket_points, buckets_upto, shape_key
from sglang_fp8rl.kernels.gemm_select.cache import Entry
from sglang_fp8rl.kernels.gemm_select.candidates import DEFAULT, MIN_GAIN, Candidate, choose, make_candidates
from sglang_fp8rl.kernels.gemm_select.measure import (
    REL_TOL,
    Bench,
    Operands,
    linear_bytes,
    make_inputs,
    make_operands,
    measure_candidate,
)

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 30.0  # wall budget of the load-time measurement (--fp8rl-gemm-tune-budget-s)
ALT_BELOW = 0.70  # alternatives are measured where the default moves less than this fraction of copy bandwidth
# ... and DeepGEMM num_sms variants (a JIT compile each) only below this: on an H100 the variants won by x2.3 where
# the default reached 33-35 % (gate_up, M 80-128) and by <= 6.5 % anywhere else (docs/RESULTS.md, sec. 7c)
VARIANT_BELOW = 0.50

Todo = list[tuple[int, int, int, list[str]]]  # phase 2's work: (N, K, M bucket, candidate names)


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    """What the measurement covers and how hard it looks."""

    max_m: int = DEFAULT_MAX_M  # largest M bucket
    budget_s: float = DEFAULT_BUDGET_S  # no new measurement starts after this many seconds
    rot_bytes: float = 200e6  # weight bytes rotated through per timed graph (so weights come from HBM, not L2)
    calls: int = 24  # calls per timed CUDA graph
    reps: int = 5  # graph replays timed (median)
    points: str = "upper"  # M points per bucket: its upper edge, or both ends
    rel_tol: float = REL_TOL  # float64 check bound (rel. Frobenius error)
    min_gain: float = MIN_GAIN  # a non-default candidate must beat the default by this fraction
    alt_below: float = ALT_BELOW
    variant_below: float = VARIANT_BELOW


@dataclasses.dataclass(frozen=True)
class Deadline:
    """The wall budget of one autotune."""

    budget_s: float
    start: float = dataclasses.field(default_factory=time.time)

    def spent(self) -> bool:
        """Whether no new measurement may start."""
        return time.time() - self.start > self.budget_s


@dataclasses.dataclass
class Pending:
    """An entry phase 1 left for phase 2: the default's efficiency and the candidates still to measure."""

    efficiency: float
    n: int
    k: int
    bucket: int
    entry: Entry
    names: list[str]


@dataclasses.dataclass
class PhaseOne:
    """What phase 1 produced: complete entries, entries for phase 2 (least efficient first), operands per shape."""

    done: dict[str, Entry]
    pending: list[Pending]
    operands: dict[tuple[int, int], Operands]
    waiting: int = 0  # entries the budget cut

    def todo(self) -> Todo:
        """Phase 2's work, for the caller that compiles it beforehand."""
        return [(p.n, p.k, p.bucket, list(p.names)) for p in self.pending]


def alternatives(cands: Mapping[str, Candidate], eff: float, settings: TuneSettings, entry: Entry) -> list[str]:
    """The non-default candidates phase 2 measures for an entry whose default reached ``eff`` of copy bandwidth;
    the others are recorded in ``entry.skipped`` with the reason."""
    tried = []
    for c in list(cands.values())[1:]:
        below = settings.variant_below if c.num_sms is not None else settings.alt_below
        if eff < below:
            tried.append(c.name)
        else:
            entry.skipped[c.name] = f"default at {eff:.0%} of copy bandwidth (>= {below:.0%})"
    return tried


def measure_defaults(shapes: Sequence[tuple[int, int]], cands: Mapping[str, Candidate], settings: TuneSettings,
                     bench: Bench, deadline: Deadline, skip: Collection[str] = ()) -> PhaseOne:
    """Phase 1: the default at every bucket of every shape not in ``skip``, largest weight first."""
    names = list(cands)
    phase = PhaseOne({}, [], {})
    for n, k in sorted(set(shapes), key=lambda s: -s[0] * s[1]):  # largest weights (most time) first
        for b in (b for b in buckets_upto(settings.max_m) if shape_key(n, k, b) not in skip):
            if deadline.spent():
                phase.waiting += 1
                continue
            if (n, k) not in phase.operands:
                phase.operands[(n, k)] = make_operands(n, k, settings.rot_bytes, bench)
            ops = phase.operands[(n, k)]
            entry = Entry(candidates=names, points=list(bucket_points(b, settings.points)),
                          copy_gbs=round(bench.copy_gbs, 1))
            inputs = [make_inputs(m, k, ops, bench) for m in entry.points]
            measure_candidate(cands[DEFAULT], n, k, entry, ops, inputs, bench, settings.rel_tol, settings.calls,
                              settings.reps)
            us = entry.us.get(DEFAULT)
            moved = sum(linear_bytes(m, n, k) for m in entry.points)
            eff = moved / (us * 1e-6) / 1e9 / bench.copy_gbs if us else 0.0
            entry.default_frac_copy_bw = round(eff, 3)
            tried = alternatives(cands, eff, settings, entry)
            if tried:
                phase.pending.append(Pending(eff, n, k, b, entry, tried))
            else:
                entry.choice = choose(entry.us, entry.rejected, settings.min_gain)
                phase.done[shape_key(n, k, b)] = entry
    phase.pending.sort(key=lambda p: p.efficiency)  # least efficient default first
    return phase


def measure_alternatives(phase: PhaseOne, cands: Mapping[str, Candidate], settings: TuneSettings, bench: Bench,
                         deadline: Deadline) -> dict[str, Entry]:
    """Phase 2: the pending entries' alternatives, least efficient default first; returns every complete entry."""
    out = dict(phase.done)
    for p in phase.pending:
        if deadline.spent():
            phase.waiting += 1
            continue
        ops = phase.operands[(p.n, p.k)]
        inputs = [make_inputs(m, p.k, ops, bench) for m in p.entry.points]  # fresh x, as phase 1 had
        for name in p.names:
            measure_candidate(cands[name], p.n, p.k, p.entry, ops, inputs, bench, settings.rel_tol, settings.calls,
                              settings.reps)
        p.entry.choice = choose(p.entry.us, p.entry.rejected, settings.min_gain)
        out[shape_key(p.n, p.k, p.bucket)] = p.entry
    return out


def autotune(shapes: Sequence[tuple[int, int]], candidates: Mapping[str, Candidate] | None = None,
             settings: TuneSettings = TuneSettings(), *, bench: Bench | None = None, skip: Collection[str] = (),
             log: Callable[[str], None] = logger.info,
             before_alternatives: Callable[[Todo], None] | None = None) -> dict[str, Entry]:
    """Measure the candidates for each (N, K) in ``shapes`` and each bucket <= ``settings.max_m``; return the new
    entries (keys in ``skip`` are already valid and not measured). ``before_alternatives`` gets phase 2's work once
    before it starts (the caller compiles those kernels in parallel). ``bench``: this rank's GPU by default."""
    cands = dict(candidates) if candidates is not None else make_candidates()
    if next(iter(cands)) != DEFAULT:
        raise ValueError(f"autotune: {DEFAULT} must be the first candidate, got {next(iter(cands))}")
    bench = bench if bench is not None else Bench.create()
    deadline = Deadline(settings.budget_s)
    phase = measure_defaults(shapes, cands, settings, bench, deadline, skip)
    if before_alternatives is not None and phase.pending and not deadline.spent():
        before_alternatives(phase.todo())
    out = measure_alternatives(phase, cands, settings, bench, deadline)
    phase.operands.clear()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
    if phase.waiting:
        log(f"gemm_select: budget {settings.budget_s:.0f}s spent; {phase.waiting} entries wait for a later start")
    log(f"gemm_select: measured {len(out)} (N, K, M bucket) entries in {time.time() - deadline.start:.1f}s")
    return out
