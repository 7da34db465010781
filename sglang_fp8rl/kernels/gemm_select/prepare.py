"""Load-time preparation: compile what CUDA-graph capture will launch, look up the model's shapes in the cache,
measure what is missing (mode ``auto``) within a wall budget, install the choices for the apply path, log once.

:func:`prepare_model` runs once after the model is loaded and before CUDA graphs are captured, with the (N, K) of
the model's 128x128 blockwise layers on this rank. Modes (``--fp8rl-gemm-select``): ``auto`` tune what is missing,
``cache`` only use cached choices, ``off`` always SGLang's dispatch. Selection is also off when the user named a
backend with ``--fp8-gemm-backend`` (anything but ``auto``): SGLang runs that backend for every block GEMM, as asked.
A DeepGEMM variant is never chosen where SGLang's DeepGEMM is off (``SGLANG_ENABLE_JIT_DEEPGEMM=0``) or wants UE8M0
scales: measurements are keyed by that state (:func:`~.cache.env_info`), and a cached choice whose candidate cannot
run here (:meth:`~.candidates.Candidate.can_implement`) counts as missing.

DeepGEMM kernels are compiled by a :class:`~sglang_fp8rl.kernels.jit_warmup.WarmupPool` (as many workers as free GPU
memory allows, see :func:`~sglang_fp8rl.kernels.jit_warmup.decide_workers`) in two rounds: SGLang's default at every
captured M and measured bucket, then (in auto mode) the num_sms variants phase 2 of the autotune will measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import torch

from sglang_fp8rl.kernels import deepgemm, jit_warmup
from sglang_fp8rl.kernels.deepgemm import AUTO_BACKEND, DeepGemmFacts, candidate_errors, deepgemm_takes_shape
from sglang_fp8rl.kernels.gemm_select import lookup
from sglang_fp8rl.kernels.gemm_select.buckets import (
    DEFAULT_MAX_M,
    bucket_points,
    buckets_upto,
    captured_in,
    parse_shape_key,
    shape_key,
    wanted_keys,
)
from sglang_fp8rl.kernels.gemm_select.cache import (
    Entry,
    cache_path,
    env_info,
    env_key,
    format_table,
    load_entries,
    merge_entries,
)
from sglang_fp8rl.kernels.gemm_select.candidates import (
    BLOCK,
    DEFAULT,
    OURS_PREFIX,
    Candidate,
    check_excluded,
    server_candidates,
)
from sglang_fp8rl.kernels.gemm_select.measure import Bench, random_block_weight
from sglang_fp8rl.kernels.gemm_select.tune import DEFAULT_BUDGET_S, Todo, TuneSettings, autotune

logger = logging.getLogger(__name__)
# the TP exchange of prepare_model: this rank's table in, the table every rank serves with out (None: SGLang's dispatch)
Agree = Callable[[dict[str, Entry]], Mapping[str, Entry] | None]

GEMM_SELECT_MODES = ("auto", "cache", "off")
WARMUP_LOG = "[fp8rl] DeepGEMM JIT warm-up for %s: %s"  # parsed by scripts/bench_startup.py
WORKERS_LOG = "[fp8rl] DeepGEMM JIT warm-up: %s%s"  # the worker count decision; parsed by scripts/bench_startup.py
DIRECT_LOG = "[fp8rl] block-FP8 linears on SGLang's default GEMM: %s"
NO_WORKERS = "; SGLang compiles DeepGEMM's kernels during CUDA-graph capture instead"

Streams = dict[tuple[int, int, int | None], set[int]]  # (N, K, num_sms or None) -> M values to launch


@dataclasses.dataclass(frozen=True)
class PrepareRequest:
    """The options of one preparation (the server's ``--fp8rl-*`` and SGLang's own, passed in by the caller)."""

    mode: str = "auto"
    budget_s: float = DEFAULT_BUDGET_S
    jit_workers: int = jit_warmup.AUTO_WORKERS
    capture_ms: tuple[int, ...] = ()
    ranks_on_node: int = 1
    fp8_gemm_backend: str = AUTO_BACKEND
    max_m: int = DEFAULT_MAX_M
    mem_fraction_static: float | None = None
    pre_load_free_bytes: int | None = None
    exclude: tuple[str, ...] = ()  # candidates left out of the selection

    def __post_init__(self) -> None:
        if self.mode not in GEMM_SELECT_MODES:
            raise ValueError(f"gemm_select mode must be one of {GEMM_SELECT_MODES}, got {self.mode!r}")
        object.__setattr__(self, "capture_ms", tuple(int(m) for m in self.capture_ms))
        object.__setattr__(self, "exclude", check_excluded(self.exclude))

    @property
    def selecting(self) -> bool:
        """Whether choices other than SGLang's dispatch may be made at all."""
        return self.mode != "off" and self.fp8_gemm_backend == AUTO_BACKEND


def cuda_memory() -> tuple[int, int]:
    """(free, total) bytes of this rank's GPU, after returning this process's cached blocks (as SGLang measures)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def _gpu_bench(facts: DeepGemmFacts) -> Bench:
    return Bench.create(facts=facts)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What preparation runs against: detected on the GPU by :meth:`detect`, built by hand in CPU tests."""

    facts: DeepGemmFacts
    candidates: dict[str, Candidate]
    info: dict[str, str]  # the cache environment
    cache_path: str
    device_index: int = 0
    gpu_memory: Callable[[], tuple[int, int]] = cuda_memory
    make_bench: Callable[[DeepGemmFacts], Bench] = _gpu_bench
    direct_reason: Callable[[DeepGemmFacts], str | None] = deepgemm.direct_reason

    @classmethod
    def detect(cls, exclude: Sequence[str] = ()) -> Runtime:
        """This process: SGLang's DeepGEMM state, the server's candidates but ``exclude``, the cache file, the
        current GPU."""
        facts = deepgemm.detect()
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return cls(facts, server_candidates(exclude), env_info(facts), cache_path(), device)


def prepare_model(shapes: Sequence[tuple[int, int]], *, mode: str, budget_s: float, jit_workers: int,
                  capture_ms: Sequence[int] = (), ranks_on_node: int = 1, fp8_gemm_backend: str = AUTO_BACKEND,
                  max_m: int = DEFAULT_MAX_M, mem_fraction_static: float | None = None,
                  pre_load_free_bytes: int | None = None, exclude: Sequence[str] = (),
                  agree: Agree | None = None) -> dict[str, Entry]:
    """Prepare this rank's block GEMMs of shapes ``shapes`` ((N, K) of its 128x128 blockwise layers): warm-up,
    lookup, measurement, agreement, install, one log. ``capture_ms``: the token counts CUDA graphs are captured for;
    ``mem_fraction_static`` / ``pre_load_free_bytes``: SGLang's, bounding the warm-up workers by GPU memory;
    ``exclude``: candidates left out (``--fp8rl-gemm-exclude``); ``agree``: the exchange that gives every rank one
    table (:func:`agreed_entries` over the TP ranks' tables).
    Returns the valid entries of this model ({} when selection is off or there is nothing to do)."""
    request = PrepareRequest(mode=mode, budget_s=budget_s, jit_workers=jit_workers, capture_ms=tuple(capture_ms),
                             ranks_on_node=ranks_on_node, fp8_gemm_backend=fp8_gemm_backend, max_m=max_m,
                             mem_fraction_static=mem_fraction_static, pre_load_free_bytes=pre_load_free_bytes,
                             exclude=tuple(exclude))
    if not shapes:
        lookup.install({}, {})
        return {}
    return prepare_shapes(shapes, request, Runtime.detect(request.exclude), agree)


def prepare_shapes(shapes: Sequence[tuple[int, int]], request: PrepareRequest, runtime: Runtime,
                   agree: Agree | None = None) -> dict[str, Entry]:
    """:func:`prepare_model` against an explicit runtime."""
    shapes = sorted(set(shapes))
    lookup.install({}, runtime.candidates)  # SGLang's dispatch until this preparation has decided
    if not shapes:
        return {}
    if request.mode != "off" and not request.selecting:
        logger.info("[fp8rl] gemm_select off: --fp8-gemm-backend %s was named, so SGLang runs it for every "
                    "block-FP8 GEMM", request.fp8_gemm_backend)
    wanted = wanted_keys(shapes, request.max_m)
    valid = usable_entries(load_entries(runtime.info, runtime.cache_path), wanted, runtime) if request.selecting \
        else {}
    tune = request.selecting and request.mode == "auto" and len(valid) < len(wanted) and request.budget_s > 0
    with warmup_pool(request, runtime) as pool:
        light = start_light_warmup(runtime.candidates if request.selecting else {})
        streams = warmup_streams(shapes, request.capture_ms, choices_of(valid), wanted - set(valid) if tune else set(),
                                 runtime.candidates, request.max_m)
        jit_round(pool, streams, f"{len(request.capture_ms)} CUDA-graph token counts", runtime.info)
        light.join()
        if tune:
            valid.update(_tune(shapes, request, runtime, valid, pool))
    if not request.selecting:
        return {}
    if agree is not None:
        valid = agreed_table(valid, agree(valid), wanted, runtime)
    lookup.install(choices_of(valid), runtime.candidates, direct=install_direct(runtime))
    logger.info("[fp8rl] gemm_select (%s, cache %s%s): %d shapes x %d M buckets, %d on %s for lack of a "
                "measurement\n%s", request.mode, runtime.cache_path,
                f", excluded {', '.join(request.exclude)}" if request.exclude else "", len(shapes),
                len(buckets_upto(request.max_m)), len(wanted) - len(valid), DEFAULT, format_table(valid))
    return valid


def agreed_entries(tables: Sequence[Mapping[str, Entry] | None]) -> dict[str, Entry] | None:
    """One table from every rank's (in rank order): each key's entry from the lowest rank that has it; None when a
    rank could not prepare (then every rank keeps SGLang's dispatch). Ranks measure apart and may choose differently
    where two candidates are close, and the candidates do not all give the same bits (split-K): one table keeps every
    rank, and a later start that reads the cache, on the same kernels."""
    if any(t is None for t in tables):
        return None
    out: dict[str, Entry] = {}
    for table in tables:
        for key, entry in table.items():
            out.setdefault(key, entry)
    return out


def agreed_table(valid: dict[str, Entry], agreed: Mapping[str, Entry] | None, wanted: Collection[str],
                 runtime: Runtime) -> dict[str, Entry]:
    """This rank's part of the agreed table; written to the cache where it differs from this rank's own choices, so
    that the next start reads what this one serves with."""
    if agreed is None:
        logger.warning("[fp8rl] gemm_select: a TP rank could not prepare its block-FP8 GEMMs; every rank uses "
                       "SGLang's dispatch")
        return {}
    mine = usable_entries(agreed, wanted, runtime)
    changed = sorted(k for k in mine if valid.get(k) is None or valid[k].choice != mine[k].choice)
    if changed:
        logger.info("[fp8rl] gemm_select: %d choices taken from a lower TP rank's measurement, so that every rank "
                    "runs the same kernels: %s", len(changed), ", ".join(changed[:8]))
        try:
            merge_entries(runtime.cache_path, runtime.info, {k: mine[k] for k in changed})
        except OSError as e:
            logger.warning("[fp8rl] gemm_select: could not write the cache %s (%s)", runtime.cache_path, e)
    return mine


def install_direct(runtime: Runtime) -> bool:
    """Whether the default's DeepGEMM calls are made directly here (deepgemm.linear_direct); logged once."""
    why_not = runtime.direct_reason(runtime.facts)
    if why_not is None:
        logger.info(DIRECT_LOG, "outside CUDA graphs, DeepGEMM launched directly (SGLang's quantizer and GEMM "
                                "kernels, the same bits, without the Python layers between them: less host time)")
    else:
        logger.info(DIRECT_LOG, f"through SGLang's own linear ({why_not})")
    return why_not is None


def usable_entries(entries: Mapping[str, Entry], wanted: Collection[str], runtime: Runtime) -> dict[str, Entry]:
    """The entries of ``wanted`` measured against this registry whose choice can run here (the rest are missing)."""
    names = list(runtime.candidates)
    out = {}
    for key in wanted:
        entry = entries.get(key)
        choice = entry.valid_choice(names) if entry is not None else None
        if choice is None:
            continue
        n, k, bucket = parse_shape_key(key)
        if choice == DEFAULT or runtime.candidates[choice].can_implement(n, k, runtime.facts, bucket) is None:
            out[key] = entry
    return out


def choices_of(entries: Mapping[str, Entry]) -> dict[str, str]:
    """Shape key -> chosen candidate name."""
    return {key: e.choice for key, e in entries.items()}


def _tune(shapes: Sequence[tuple[int, int]], request: PrepareRequest, runtime: Runtime, valid: Mapping[str, Entry],
          pool: jit_warmup.WarmupPool | None) -> dict[str, Entry]:
    """The load-time autotune (variants compiled on ``pool`` before phase 2), cached on disk, logged in one line."""
    t0 = time.time()

    def compile_alternatives(todo: Todo) -> None:
        jit_round(pool, variant_streams(todo, request.capture_ms, runtime.candidates),
                  "the num_sms variants to measure", runtime.info)

    # autotune's own progress lines go to debug: the one summary and table of prepare are the decision log
    new = autotune(shapes, runtime.candidates, TuneSettings(max_m=request.max_m, budget_s=request.budget_s),
                   bench=runtime.make_bench(runtime.facts), skip=set(valid), log=logger.debug,
                   before_alternatives=compile_alternatives)
    try:
        merge_entries(runtime.cache_path, runtime.info, new)
    except OSError as e:
        logger.warning("[fp8rl] gemm_select: could not write the cache %s (%s); choices kept for this process",
                       runtime.cache_path, e)
    logger.info("[fp8rl] gemm_select: measured %d entries for %d shapes in %.1f s (budget %.0f s)",
                len(new), len(shapes), time.time() - t0, request.budget_s)
    return new


# ---------------------------------------------------------------------------------------------------------------------
# what the JIT warm-up launches


def warmup_streams(shapes: Sequence[tuple[int, int]], capture_ms: Sequence[int], choices: Mapping[str, str],
                   to_measure: Collection[str], cands: Mapping[str, Candidate],
                   max_m: int = DEFAULT_MAX_M) -> Streams:
    """(N, K, num_sms or None) -> the M values DeepGEMM launches before serving, as far as known before measuring:
    the default at every captured M and at the measured points of the entries ``to_measure``; a chosen num_sms
    variant at the captured M of its bucket. Shapes DeepGEMM does not take (SGLang runs Triton) are left out."""
    sms_of = {c.name: c.num_sms for c in cands.values() if c.num_sms is not None}
    streams: Streams = {}
    for n, k in shapes:
        if not deepgemm_takes_shape(n, k):
            continue
        default_ms = set(capture_ms)
        for b in buckets_upto(max_m):
            key = shape_key(n, k, b)
            if key in to_measure:
                default_ms.update(bucket_points(b))
            elif choices.get(key) in sms_of:
                streams.setdefault((n, k, sms_of[choices[key]]), set()).update(captured_in(b, capture_ms))
        streams[(n, k, None)] = default_ms
    return {key: ms for key, ms in streams.items() if ms}


def variant_streams(todo: Todo, capture_ms: Sequence[int], cands: Mapping[str, Candidate]) -> Streams:
    """(N, K, num_sms) -> M values for the num_sms variants phase 2 measures: each entry's measured points and the
    captured M of its bucket (what capture launches if the variant wins)."""
    streams: Streams = {}
    for n, k, bucket, names in todo:
        if not deepgemm_takes_shape(n, k):
            continue
        ms = set(bucket_points(bucket)) | captured_in(bucket, capture_ms)
        for name in names:
            if cands[name].num_sms is not None:
                streams.setdefault((n, k, cands[name].num_sms), set()).update(ms)
    return streams


@contextlib.contextmanager
def warmup_pool(request: PrepareRequest, runtime: Runtime) -> Iterator[jit_warmup.WarmupPool | None]:
    """A warm-up pool on this rank's GPU, sized by :func:`jit_warmup.decide_workers` (the decision logged once);
    None when the warm-up is off, SGLang's default is not float32-scale DeepGEMM, or no worker fits in memory."""
    if request.jit_workers == 0 or not runtime.facts.default_is_fp32_deepgemm:
        yield None
        return
    free, total = runtime.gpu_memory()
    decision = jit_warmup.decide_workers(request.jit_workers, request.ranks_on_node, free, total,
                                         request.mem_fraction_static, request.pre_load_free_bytes)
    logger.info(WORKERS_LOG, decision.describe(), "" if decision.workers else NO_WORKERS)
    if decision.workers < 1:
        yield None
        return
    with jit_warmup.WarmupPool(decision.workers, runtime.device_index, env=jit_warmup.worker_env()) as pool:
        yield pool


def jit_round(pool: jit_warmup.WarmupPool | None, streams: Streams, what: str, info: Mapping[str, str]) -> None:
    """One warm-up round on ``pool`` (nothing without a pool); one log line when it launched anything."""
    if pool is None:
        return
    result = jit_warmup.warm_up(pool, streams, env_key(info))
    if result.jobs:
        (logger.warning if result.failed else logger.info)(WARMUP_LOG, what, result.summary())


def start_light_warmup(candidates: Mapping[str, Candidate]) -> threading.Thread:
    """Compile, in a thread while the DeepGEMM round runs, the small JIT kernels of the block path: SGLang's 1x128
    activation quantizer (tvm-ffi JIT in SGLang 0.5.17, ~8 s on a cold cache) and our Triton GEMM of ``candidates``
    at M=1 and M=16. Their shapes are tiny: these kernels take N and K at run time."""
    ours = [c for c in candidates.values() if c.name.startswith(OURS_PREFIX)]

    def run() -> None:
        if not torch.cuda.is_available():
            return
        x = torch.randn(16, 4 * BLOCK[1], device="cuda", dtype=torch.bfloat16)
        w, scale = random_block_weight(2 * BLOCK[0], 4 * BLOCK[1], x.device)
        try:
            deepgemm.sglang_fp8_kernel().sglang_per_token_group_quant_fp8(
                x, BLOCK[1], column_major_scales=True, scale_tma_aligned=True, scale_ue8m0=False)
            for m in (1, 16):
                for c in ours:
                    c.fn(x[:m], w, scale, None)
            torch.cuda.synchronize()
        except candidate_errors() as e:  # the first real call compiles it instead
            logger.debug("[fp8rl] light JIT warm-up: %s", e)

    thread = threading.Thread(target=run, name="fp8rl-light-jit", daemon=True)
    thread.start()
    return thread
