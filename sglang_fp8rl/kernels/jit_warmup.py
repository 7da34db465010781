"""Parallel DeepGEMM JIT warm-up: compile the kernels that CUDA-graph capture and the GEMM autotune will launch, in
worker processes, before either runs.

Why: DeepGEMM compiles one kernel per tile configuration (tile sizes, stages, multicast, num_sms; M, N and K are
runtime arguments) with nvcc on its first launch, 2.5-5.5 s each on the H100 machine, one after the other in the
launching process, and keeps the cubin in its disk cache (``DG_JIT_CACHE_DIR``). SGLang 0.5.17's prefill CUDA-graph
capture (58 token counts) made a cold ``fp8_online_blockwise`` start 111 s slower than BF16 that way
(session 2, docs/RESULTS.md sec. 8). Here worker processes first launch DeepGEMM exactly as SGLang's DeepGEMM linear
does, for the same (M, N, K, num_sms), so the compiles run side by side and capture and autotune only load cubins
(measured: +18 s over a cold BF16 start instead of +142 s).

Jobs go one at a time to whichever worker is idle, ordered coarse-to-fine in M (:func:`spread_order`): neighbouring
M usually share a configuration, and one that two workers compile at the same time is compiled twice. A failed job,
a dead worker or the timeout costs only the warm-up: what was not compiled is compiled lazily at its first launch,
exactly as without warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self, TextIO

from sglang_fp8rl.server_args import DEEPGEMM_PRECOMPILE_ENV

logger = logging.getLogger(__name__)

DEFAULT_RUNNER = "sglang_fp8rl.kernels.jit_warmup:deepgemm_job"
MAX_WORKERS = 12  # nvcc is one core per compile; more workers than this mostly duplicate compiles
WORKER_GPU_BYTES = 2 << 30  # per worker: CUDA context, weights of every shape, the largest activation and output
TIMEOUT_S = 300.0
RECORD_NAME = "fp8rl_jit_warmed.json"
CLOSE_WAIT_S = 5.0  # idle workers get this long, together, to exit on their own
READY = "ready"
_ERROR_TAIL = 600  # characters of a dead worker's stderr kept for the report


@dataclasses.dataclass(frozen=True)
class Job:
    """One launch of DeepGEMM's block-FP8 GEMM on [m, k] x [n, k]^T, under ``num_sms`` SMs (None: DeepGEMM's own)."""

    n: int
    k: int
    m: int
    num_sms: int | None = None


@dataclasses.dataclass
class WarmupResult:
    """What a warm-up did: jobs done / failed, the first errors, wall and summed job seconds, workers used."""

    jobs: int = 0
    done: int = 0
    failed: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    job_s: float = 0.0
    workers: int = 0
    timed_out: bool = False
    succeeded: list[Job] = dataclasses.field(default_factory=list, repr=False)

    def summary(self) -> str:
        text = (f"{self.done}/{self.jobs} launches by {self.workers} workers in {self.wall_s:.1f} s "
                f"(worker time {self.job_s:.1f} s)")
        if self.failed:
            text += f", {self.failed} failed (first: {self.errors[0] if self.errors else '?'})"
        if self.timed_out:
            text += ", stopped at the timeout"
        return text


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
    config = getattr(server_args, "cuda_graph_config", None)
    counts: set[int] = set()
    for phase in ("decode", "prefill"):
        phase_config = getattr(config, phase, None)
        if phase_config is None or getattr(phase_config, "backend", "disabled") == "disabled":
            continue
        counts.update(int(b) for b in (getattr(phase_config, "bs", None) or ()) if int(b) > 0)
    return sorted(counts)


def default_workers(ranks_on_node: int = 1, cpus: int | None = None) -> int:
    """Workers per rank: the node's CPUs shared by its ranks, one left for the rank itself, at most MAX_WORKERS."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cpus // max(1, ranks_on_node) - 1))


# ---------------------------------------------------------------------------------------------------------------------
# pool (parent side)


class _Worker:
    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.log = tempfile.TemporaryFile(mode="w+", prefix="fp8rl_jit_")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     text=True, bufsize=1)
        self.ready = False
        self.job: Job | None = None

    def send(self, job: Job) -> None:
        self.job = job
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(dataclasses.asdict(job)) + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-_ERROR_TAIL:].strip()

    def finish_input(self) -> None:
        """Close an idle worker's input: it exits at end of input (a busy one is killed by :meth:`stop`)."""
        if self.proc.poll() is None and self.proc.stdin is not None and self.job is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass

    def stop(self, wait_s: float = 0.0) -> None:
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
        self.log.close()


def worker_command(device_index: int, runner: str = DEFAULT_RUNNER) -> list[str]:
    return [sys.executable, "-m", "sglang_fp8rl.kernels.jit_warmup", "--device", str(device_index),
            "--runner", runner]


class WarmupPool:
    """Worker processes that run rounds of jobs (each job to the next idle worker) until :meth:`close`.

    Started at the first round that has jobs, with at most that round's number of workers; ``timeout_s`` counts from
    the start for all rounds together. Never raises for a failed job, a dead worker or the timeout: they are counted
    in each round's result."""

    def __init__(self, workers: int, device_index: int = 0, timeout_s: float = TIMEOUT_S,
                 runner: str = DEFAULT_RUNNER, env: dict[str, str] | None = None):
        self.workers, self.timeout_s = workers, timeout_s
        self.cmd = worker_command(device_index, runner)
        self.env = dict(os.environ if env is None else env)
        self.pool: list[_Worker] = []
        self.sel = selectors.DefaultSelector()
        self.t0: float | None = None
        self.timed_out = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, jobs: Sequence[Job]) -> WarmupResult:
        """Run one round: returns when every job is done or failed, every worker died, or at the timeout."""
        result = WarmupResult(jobs=len(jobs))
        if not jobs or self.workers < 1 or self.timed_out:
            result.failed = result.jobs if self.timed_out else 0
            result.done = result.jobs - result.failed
            return result
        t1 = time.monotonic()
        self._start(min(self.workers, len(jobs)))
        result.workers = len(self.pool)
        queue = deque(jobs)
        for w in self.pool:
            if w.ready and w.job is None and queue:
                w.send(queue.popleft())
        while self.sel.get_map() and (queue or any(w.job is not None for w in self.pool)):
            left = self.timeout_s - (time.monotonic() - (self.t0 or t1))
            if left <= 0:
                self.timed_out = result.timed_out = True
                break
            for key, _ in self.sel.select(timeout=left):
                _on_line(key.data, key.fileobj, self.sel, queue, result)
        result.failed += len(queue) + sum(1 for w in self.pool if w.job is not None)
        if self.timed_out:
            self.close()  # kills the workers still compiling
        result.done = result.jobs - result.failed
        result.wall_s = time.monotonic() - t1
        return result

    def _start(self, count: int) -> None:
        if self.t0 is not None:
            return
        self.t0 = time.monotonic()
        for _ in range(count):
            w = _Worker(self.cmd, self.env)
            assert w.proc.stdout is not None
            self.sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            self.pool.append(w)

    def close(self) -> None:
        for w in self.pool:  # all at once: each worker's exit (CUDA context teardown) takes ~0.5 s
            w.finish_input()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for w in self.pool:
            if w.proc.stdout is not None and w.proc.stdout in self.sel.get_map():
                self.sel.unregister(w.proc.stdout)
            w.stop(max(0.0, deadline - time.monotonic()))
        self.pool = []
        self.sel.close()
        self.sel = selectors.DefaultSelector()


def _on_line(w: _Worker, stream: TextIO, sel: selectors.BaseSelector, queue: deque, result: WarmupResult) -> None:
    """Handle one line of a worker: ready or a job's result (then hand it the next job), or its death."""
    line = stream.readline()
    if not line:  # the worker exited: its job (if any) failed
        sel.unregister(stream)
        w.proc.wait()
        if w.job is not None or w.proc.returncode:
            result.errors.append(f"worker exit {w.proc.returncode}: {w.stderr_tail()}"[:_ERROR_TAIL])
        if w.job is not None:
            result.failed += 1
            w.job = None
        return
    try:
        msg = json.loads(line)
    except json.JSONDecodeError:
        return  # a library printed to stdout; only our JSON lines count
    if not isinstance(msg, dict):
        return
    if "error" in msg and w.job is not None:
        result.failed += 1
        result.errors.append(str(msg["error"]))
    elif "s" in msg and w.job is not None:
        result.job_s += float(msg["s"])
        result.succeeded.append(w.job)
    elif msg.get(READY) is True:
        w.ready = True
    else:
        return
    w.job = None
    if queue:
        w.send(queue.popleft())


# ---------------------------------------------------------------------------------------------------------------------
# record of what was warmed: a file inside DeepGEMM's cache folder, so it goes wherever the cubins go


def deepgemm_cache_dir() -> str:
    """DeepGEMM's JIT cache folder as SGLang sets it (``SGLANG_DG_CACHE_DIR``, default ~/.cache/deep_gemm)."""
    return os.environ.get("DG_JIT_CACHE_DIR") or os.environ.get("SGLANG_DG_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "deep_gemm")


def record_path(cache_dir: str | None = None) -> str:
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
    from sglang_fp8rl.kernels.gemm_select import write_json_atomic

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
    return dict(os.environ, **{DEEPGEMM_PRECOMPILE_ENV: "0"})


# ---------------------------------------------------------------------------------------------------------------------
# worker side


def deepgemm_job(job: Job, state: dict) -> None:
    """Launch DeepGEMM's block-FP8 GEMM once for ``job`` exactly as SGLang's DeepGEMM linear does.

    SGLang (``deepgemm_w8a8_block_fp8_linear_with_fallback``) calls ``deep_gemm.fp8_gemm_nt((xq, xs), (w, ws), out)``
    with defaults: xq [M, K] e4m3, xs [M, K/128] float32 column-major with rows padded to 4 (TMA), w [N, K] e4m3,
    ws [N/128, K/128] float32, out [M, N] bf16. The worker builds those operands itself instead of importing SGLang,
    whose import takes 25-35 s per process on the GPU machine; tests/gpu/test_jit_warmup_gpu.py checks that SGLang's
    own call then finds the kernels compiled."""
    import deep_gemm
    import torch

    block = 128
    if "default_sms" not in state:
        state["default_sms"] = deep_gemm.get_num_sms()
    if (job.n, job.k) not in state:
        weight = torch.zeros(job.n, job.k, device="cuda", dtype=torch.float8_e4m3fn)
        scale = torch.ones(-(-job.n // block), -(-job.k // block), device="cuda")
        state[(job.n, job.k)] = (weight, scale)
    weight, scale = state[(job.n, job.k)]
    x = torch.zeros(job.m, job.k, device="cuda", dtype=torch.float8_e4m3fn)
    groups, padded_m = -(-job.k // block), -(-job.m // 4) * 4
    x_scale = torch.ones(groups, padded_m, device="cuda").t()[: job.m]
    out = torch.empty(job.m, job.n, device="cuda", dtype=torch.bfloat16)
    deep_gemm.set_num_sms(job.num_sms or state["default_sms"])
    try:
        deep_gemm.fp8_gemm_nt((x, x_scale), (weight, scale), out)
    finally:
        deep_gemm.set_num_sms(state["default_sms"])
    torch.cuda.synchronize()


def load_runner(spec: str) -> Callable[[Job, dict], None]:
    """``module:function`` -> the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--runner must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def worker_loop(runner: Callable[[Job, dict], None], lines: Iterable[str], out: TextIO,
                errors: tuple[type[BaseException], ...]) -> None:
    """Answer ``ready``, then one JSON line per job line: its seconds, or the error it raised."""
    state: dict = {}
    _reply(out, {READY: True})
    for line in lines:
        if not line.strip():
            continue
        job = Job(**json.loads(line))
        t = time.monotonic()
        try:
            runner(job, state)
        except errors as e:
            _reply(out, {"error": f"{job}: {type(e).__name__}: {e}"[:_ERROR_TAIL]})
            continue
        _reply(out, {"s": round(time.monotonic() - t, 4)})


def _reply(out: TextIO, msg: dict) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="sglang-fp8rl JIT warm-up worker (started by WarmupPool)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--runner", default=DEFAULT_RUNNER)
    args = p.parse_args(argv)
    runner = load_runner(args.runner)
    if runner is deepgemm_job:
        import torch

        torch.cuda.set_device(args.device)
    from sglang_fp8rl.kernels.gemm_select import candidate_errors

    # the real stdout carries our protocol; anything libraries print goes to stderr (the worker's log file)
    out, sys.stdout = sys.stdout, sys.stderr
    worker_loop(runner, sys.stdin, out, candidate_errors())


if __name__ == "__main__":
    main()
