"""The parent side of the DeepGEMM JIT warm-up: a pool of worker processes (:mod:`sglang_fp8rl.kernels.jit_worker`)
that runs rounds of jobs, each job to whichever worker is idle.

A failed job, a dead worker or the timeout costs only the warm-up: they are counted in the round's result, never
raised, and what was not compiled is compiled lazily at its first launch, exactly as without warm-up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from typing import Self, TextIO

from sglang_fp8rl.kernels.jit_worker import DEFAULT_RUNNER, ERROR_TAIL, READY, Job

TIMEOUT_S = 300.0
CLOSE_WAIT_S = 5.0  # idle workers get this long, together, to exit on their own


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
        """One line for the log (parsed by scripts/bench_startup.py)."""
        text = (f"{self.done}/{self.jobs} launches by {self.workers} workers in {self.wall_s:.1f} s "
                f"(worker time {self.job_s:.1f} s)")
        if self.failed:
            text += f", {self.failed} failed (first: {self.errors[0] if self.errors else '?'})"
        if self.timed_out:
            text += ", stopped at the timeout"
        return text


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
        return self.log.read()[-ERROR_TAIL:].strip()

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
    """The command line of one worker process on CUDA device ``device_index``."""
    return [sys.executable, "-m", "sglang_fp8rl.kernels.jit_worker", "--device", str(device_index),
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
        """End every worker: idle ones exit on their own (all at once), the others are killed."""
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
            result.errors.append(f"worker exit {w.proc.returncode}: {w.stderr_tail()}"[:ERROR_TAIL])
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
