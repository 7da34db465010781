"""Parallel DeepGEMM JIT warm-up: compile the kernels that CUDA-graph capture and the GEMM autotune will launch, in
worker processes, before either runs.

Why: DeepGEMM compiles one kernel per tile configuration (tile sizes, stages, multicast, num_sms; M, N and K are
runtime arguments) with nvcc on its first launch, 2.5-5.5 s each on an H100, one after the other in the launching
process, and keeps the cubin in its disk cache (``DG_JIT_CACHE_DIR``). SGLang 0.5.17's prefill CUDA-graph capture
(58 token counts) made a cold ``fp8_online_blockwise`` start 111 s slower than BF16 that way (docs/RESULTS.md
sec. 8). Here worker processes first launch DeepGEMM exactly as SGLang's DeepGEMM linear does, for the same
(M, N, K, num_sms), so the compiles run side by side and capture and autotune only load cubins (measured: +18 s
over a cold BF16 start instead of +142 s).

Jobs go one at a time to whichever worker is idle, ordered coarse-to-fine in M (:func:`spread_order`): neighbouring
M usually share a configuration, and one that two workers compile at the same time is compiled twice. A failed job,
a dead worker or the timeout costs only the warm-up. The pool is :mod:`~sglang_fp8rl.kernels.jit_pool`, the worker
:mod:`~sglang_fp8rl.kernels.jit_worker`; both are re-exported here.

How many workers (:func:`decide_workers`): ``--fp8rl-jit-workers`` (:data:`AUTO_WORKERS`: the node's CPUs shared by
its ranks, at most :data:`MAX_WORKERS`), then bounded by GPU memory, since each worker holds about
:data:`WORKER_GPU_BYTES` while it runs::

    workers = min(requested, floor((free - reserve) / WORKER_GPU_BYTES)),  0 when that is below 1
    reserve = free before the model was loaded x (1 - mem_fraction_static) + SAFETY_BYTES

``free`` is measured after loading, when the warm-up starts. SGLang 0.5.17 sizes its KV cache after the load as
free memory minus exactly that first term (``pre_model_load_memory * (1 - mem_fraction_static)``): the part of the
GPU the engine leaves to activations and to other processes (a colocated trainer, a second engine). What lies above
it is the engine's own, not yet allocated KV cache, so the workers only borrow memory this engine is about to take
anyway, and they exit before SGLang measures it. ``SAFETY_BYTES`` covers this process's own scratch meanwhile (the
GEMM measurement's operands) and allocator slack. Without a known ``mem_fraction_static`` the whole free memory is
reserved (no workers): SGLang then compiles DeepGEMM's kernels during capture, one by one, as without warm-up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from sglang_fp8rl.compat.runtime import captured_token_counts
from sglang_fp8rl.kernels.atomic_json import write_json_atomic
from sglang_fp8rl.kernels.deepgemm import PRECOMPILE_ENV
from sglang_fp8rl.kernels.jit_pool import TIMEOUT_S, WarmupPool, WarmupResult, worker_command
from sglang_fp8rl.kernels.jit_worker import DEFAULT_RUNNER, Job, deepgemm_job, load_runner, worker_loop

__all__ = [
    "AUTO_WORKERS", "DEFAULT_RUNNER", "GIB", "MAX_WORKERS", "RECORD_NAME", "SAFETY_BYTES", "TIMEOUT_S",
    "WORKER_GPU_BYTES", "Job", "WarmupPool", "WarmupResult", "WorkerDecision", "capture_token_counts",
    "decide_workers", "deepgemm_cache_dir", "deepgemm_job", "default_workers", "engine_reserve_bytes", "load_runner",
    "plan_jobs", "record_path", "record_warmed", "spread_order", "warm_up", "warmed_jobs", "worker_command",
    "worker_env", "worker_loop",
]

logger = logging.getLogger(__name__)

AUTO_WORKERS = -1  # --fp8rl-jit-workers: one per CPU of this rank (bounded by GPU memory); 0 = no warm-up
MAX_WORKERS = 12  # nvcc is one core per compile; more workers than this mostly duplicate compiles
GIB = 1 << 30
WORKER_GPU_BYTES = 2 * GIB  # per worker: CUDA context, weights of every shape, the largest activation and output
SAFETY_BYTES = 1 * GIB  # this process's own scratch while workers run (GEMM measurement operands), allocator slack
RECORD_NAME = "fp8rl_jit_warmed.json"


# ---------------------------------------------------------------------------------------------------------------------
# plan


def spread_order(values: Iterable[int]) -> list[int]:
    """The sorted distinct values, reordered coarse-to-fine: both ends, the middle, then the quarters, and so on."""
    vals = sorted(set(values))
    if len(vals) <= 2:
        return vals
    order = [0, len(vals) - 1]
    seen = set(order)
    step = len(vals) - 1
    while len(order) < len(vals):
        step = max(1, step // 2)
        for i in range(step, len(vals), step):
            if i not in seen:
                seen.add(i)
                order.append(i)
    return [vals[i] for i in order]


def plan_jobs(streams: dict[tuple[int, int, int | None], Iterable[int]]) -> list[Job]:
    """Jobs for every (N, K, num_sms) -> M values of ``streams`` (num_sms None = DeepGEMM's own), interleaved.

    Each stream is in :func:`spread_order`; the streams are interleaved round-robin, so the first jobs of a warm-up
    are far apart in M and shape (likely different tile configurations)."""
    lists = [[Job(n, k, m, sms) for m in spread_order(ms)] for (n, k, sms), ms in streams.items()]
    jobs: list[Job] = []
    for i in range(max((len(s) for s in lists), default=0)):
        jobs.extend(s[i] for s in lists if i < len(s))
    return jobs


def capture_token_counts(server_args: Any) -> list[int]:
    """Token counts SGLang captures CUDA graphs for: decode batch sizes and prefill token counts, for every phase
    whose backend is not ``disabled`` (decode with one token per request; speculative decoding is not covered)."""
    return captured_token_counts(server_args)


# ---------------------------------------------------------------------------------------------------------------------
# how many workers


def default_workers(ranks_on_node: int = 1, cpus: int | None = None) -> int:
    """Workers per rank: the node's CPUs shared by its ranks, one left for the rank itself, at most MAX_WORKERS."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cpus // max(1, ranks_on_node) - 1))


def engine_reserve_bytes(total_bytes: int, mem_fraction_static: float | None,
                         pre_load_free_bytes: int | None = None) -> int:
    """GPU memory the warm-up leaves free: what SGLang keeps out of its KV cache (free before the model load, or the
    device's total when unknown, x (1 - mem_fraction_static)) plus SAFETY_BYTES; everything when the fraction is
    unknown."""
    if mem_fraction_static is None:
        return total_bytes
    base = total_bytes if pre_load_free_bytes is None else pre_load_free_bytes
    return int(base * (1.0 - mem_fraction_static)) + SAFETY_BYTES


@dataclasses.dataclass(frozen=True)
class WorkerDecision:
    """How many warm-up workers this rank starts, and the numbers behind it (for the one log line)."""

    workers: int
    requested: int
    free_bytes: int
    reserve_bytes: int

    def describe(self) -> str:
        """The decision in words."""
        return (f"{self.workers} workers (requested {self.requested}; {self.free_bytes / GIB:.1f} GiB free, "
                f"{self.reserve_bytes / GIB:.1f} GiB kept free for SGLang's non-KV share and other processes, "
                f"{WORKER_GPU_BYTES / GIB:.0f} GiB per worker)")


def decide_workers(option: int, ranks_on_node: int, free_bytes: int, total_bytes: int,
                   mem_fraction_static: float | None, pre_load_free_bytes: int | None = None,
                   cpus: int | None = None) -> WorkerDecision:
    """Workers for ``--fp8rl-jit-workers`` ``option`` (AUTO_WORKERS: by CPUs), bounded by free GPU memory (module
    docstring): min(requested, floor((free - reserve) / WORKER_GPU_BYTES)), 0 when below 1."""
    requested = default_workers(ranks_on_node, cpus) if option == AUTO_WORKERS else max(0, option)
    reserve = engine_reserve_bytes(total_bytes, mem_fraction_static, pre_load_free_bytes)
    fit = max(0, (free_bytes - reserve) // WORKER_GPU_BYTES)
    return WorkerDecision(int(min(requested, fit)), requested, free_bytes, reserve)


# ---------------------------------------------------------------------------------------------------------------------
# record of what was warmed: a file inside DeepGEMM's cache folder, so it goes wherever the cubins go


def deepgemm_cache_dir() -> str:
    """DeepGEMM's JIT cache folder as SGLang sets it (``SGLANG_DG_CACHE_DIR``, default ~/.cache/deep_gemm)."""
    return os.environ.get("DG_JIT_CACHE_DIR") or os.environ.get("SGLANG_DG_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "deep_gemm")


def record_path(cache_dir: str | None = None) -> str:
    """Path of the record of warmed jobs."""
    return os.path.join(cache_dir or deepgemm_cache_dir(), RECORD_NAME)


def warmed_jobs(env: str, path: str | None = None) -> set[Job]:
    """Jobs a previous warm-up in this environment (GPU, versions) completed; empty if none or unreadable."""
    try:
        with open(path or record_path()) as f:
            data = json.load(f)
        if data.get("env") != env:
            return set()
        return {Job(*j) for j in data.get("jobs", [])}
    except (OSError, ValueError, TypeError, AttributeError):
        return set()


def record_warmed(env: str, jobs: Iterable[Job], path: str | None = None) -> None:
    """Add ``jobs`` to the record (atomic rewrite; a record of another environment is replaced)."""
    path = path or record_path()
    done = warmed_jobs(env, path) | set(jobs)
    write_json_atomic(path, {"env": env, "jobs": sorted((dataclasses.astuple(j) for j in done), key=_job_order)})


def _job_order(job: tuple) -> tuple:
    return tuple(-1 if v is None else v for v in job)


def warm_up(pool: WarmupPool, streams: dict[tuple[int, int, int | None], Iterable[int]], env: str) -> WarmupResult:
    """Run on ``pool`` every job of ``streams`` not yet recorded as warmed in ``env``; record what worked."""
    done = warmed_jobs(env)
    jobs = [j for j in plan_jobs(streams) if j not in done]
    result = pool.run(jobs)
    if result.succeeded:
        try:
            record_warmed(env, result.succeeded)
        except OSError as e:
            logger.warning("[fp8rl] jit warm-up: could not write %s (%s); the next start launches them again",
                           record_path(), e)
    return result


def worker_env() -> dict[str, str]:
    """The workers' environment: this process's, with ``SGLANG_JIT_DEEPGEMM_PRECOMPILE=0`` (each worker compiles
    only the launches it is given)."""
    return dict(os.environ, **{PRECOMPILE_ENV: "0"})
