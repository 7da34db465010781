"""Rank processes of a test (gloo on CPU): a free rendezvous port (another one if it was taken before the ranks bound
it), and their logs once all ended, or an assertion that names the rank that failed or the collective that hung."""

from __future__ import annotations

import socket
import subprocess
from typing import Callable


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch's TCPStore when the rendezvous port was taken between choosing and binding it (another test's socket)
PORT_TAKEN = "EADDRINUSE"
PORT_ATTEMPTS = 3
STACKS_AFTER_ENV = "FP8RL_TEST_STACKS_AFTER_S"  # tests/sgl_worker.py prints every thread's stack when it expires
STACKS_MARGIN_S = 30


def stacks_env(timeout: float) -> dict[str, str]:
    """The environment that makes tests/sgl_worker.py print every thread's stack and exit shortly before ``timeout``."""
    return {STACKS_AFTER_ENV: str(max(timeout - STACKS_MARGIN_S, 1))}


def run_ranks(command_of: Callable[[int, int], list[str]], env: dict, timeout: int, ranks: int = 2) -> list[str]:
    """Start ``command_of(rank, port)`` for every rank on a fresh rendezvous port; their logs, each asserted to exit 0;
    all are killed past ``timeout``. A port found taken is retried on another."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        logs = _run_once(command_of, free_port(), env, timeout, ranks)
        taken = attempt < PORT_ATTEMPTS and any(PORT_TAKEN in log for log, _ in logs)
        if not taken:
            break
    for rank, (log, rc) in enumerate(logs):
        assert rc == 0, f"rank {rank} failed (rc={rc}):\n{log[-8000:]}"
    return [log for log, _ in logs]


def _run_once(command_of: Callable[[int, int], list[str]], port: int, env: dict, timeout: int,
              ranks: int) -> list[tuple[str, int]]:
    env = dict(env, **stacks_env(timeout))
    procs = [subprocess.Popen(command_of(rank, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for rank in range(ranks)]
    out = []
    try:
        for proc in procs:
            log, _ = proc.communicate(timeout=timeout)
            out.append((log, proc.returncode))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        logs = [log for log, _ in out] + [proc.communicate()[0] or "" for proc in procs[len(out):]]
        tails = "\n".join(f"rank {rank}:\n{log[-4000:]}" for rank, log in enumerate(logs))
        raise AssertionError(f"the ranks still ran after {timeout} s (a hung collective?)\n{tails}") from None
    finally:
        for proc in procs:
            proc.kill()
    return out
