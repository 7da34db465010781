"""The engine's end of a gloo weight-update group with a trainer subprocess, for CPU tests.

SGLang's ``init_weights_update_group`` waits torch's default 30 minutes for a trainer that never binds its port (a
port taken between choosing it and binding it, a trainer that died at import). Here the rendezvous is bounded and a
failed one is retried on a fresh port with a fresh trainer, so such a flake costs one retry, not the CI run.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed.distributed_c10d as c10d
from rank_pair import free_port

# rendezvous and every collective of the group; a CPU test's whole update stream takes seconds
GROUP_TIMEOUT = timedelta(seconds=120)
ATTEMPTS = 3


@contextlib.contextmanager
def default_group_timeout(timeout: timedelta) -> Iterator[None]:
    """SGLang's init_custom_process_group reads torch's default timeout when it runs; lower it for that call."""
    saved = c10d.default_pg_timeout
    c10d.default_pg_timeout = timeout
    try:
        yield
    finally:
        c10d.default_pg_timeout = saved


def join_update_group(updater, start_trainer: Callable[[int], subprocess.Popen], group_name: str,
                      attempts: int = ATTEMPTS) -> subprocess.Popen:
    """Start a trainer (rank 0) on a fresh port and join its group as rank 1; the running trainer. Raises
    AssertionError with every attempt's answer and trainer log when none succeeds."""
    failures = []
    for _ in range(attempts):
        port = free_port()
        trainer = start_trainer(port)
        with default_group_timeout(GROUP_TIMEOUT):
            ok, message = updater.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, "gloo")
        if ok:
            return trainer
        trainer.kill()
        log = trainer.communicate()[0] or ""
        failures.append(f"port {port}: {message}\ntrainer (rc={trainer.returncode}):\n{log[-2000:]}")
    raise AssertionError(f"no update group after {attempts} attempts:\n" + "\n".join(failures))
