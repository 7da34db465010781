"""Two rank processes of a test (gloo on CPU): a free rendezvous port, and their logs once both ended, or an
assertion that names the rank that failed or the collective that hung."""

from __future__ import annotations

import socket
import subprocess
from typing import Callable


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(command_of: Callable[[int], list[str]], env: dict, timeout: int, ranks: int = 2) -> list[str]:
    """Start ``command_of(rank)`` for every rank; their logs, each asserted to exit 0; all are killed past
    ``timeout``."""
    procs = [subprocess.Popen(command_of(rank), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in range(ranks)]
    logs = []
    try:
        for rank, proc in enumerate(procs):
            log, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {rank} failed (rc={proc.returncode}):\n{log[-8000:]}"
            logs.append(log)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the ranks still ran after {timeout} s (a hung collective?)") from None
    finally:
        for proc in procs:
            proc.kill()
    return logs
