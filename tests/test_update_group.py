"""tests/update_group.py: a trainer that never binds its port costs a bounded retry on a fresh port, through SGLang's
own init_custom_process_group (the call SGLang's WeightUpdater makes), not torch's 30-minute default."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from sgl_model import HERE
from update_group import join_update_group

from sglang_fp8rl.cpu_runner import install_cpu_stubs

pytestmark = pytest.mark.slow
# the join's bound per attempt: long enough for a live trainer's rendezvous on a loaded 2-core CI machine (its imports
# are done before the join starts: imported()), short enough that the bound is tested
SHORT = timedelta(seconds=15)
# two attempts: two SHORT rendezvous plus two trainer processes and SGLang's group set-up, 58-62 s on a loaded 2-core
# CI machine; with the default GROUP_TIMEOUT the same two attempts would take over 240 s
BOUND_S = 90


class Joiner:
    """The engine's end as SGLang's WeightUpdater builds it (its answer pair included), minus the model."""

    def __init__(self) -> None:
        self.groups: dict[str, object] = {}
        self.ports: list[int] = []

    def init_weights_update_group(self, address, port, rank_offset, world_size, group_name, backend):
        from sglang.srt.utils import init_custom_process_group

        self.ports.append(port)
        try:
            self.groups[group_name] = init_custom_process_group(
                backend=backend, init_method=f"tcp://{address}:{port}", world_size=world_size, rank=rank_offset,
                group_name=group_name)
        except Exception as e:  # noqa: BLE001 - SGLang answers (False, message) for any failure here
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."


def trainer(port: int, group_name: str) -> subprocess.Popen:
    """Rank 0: joins, broadcasts arange(4), exits."""
    code = (f"import os, sys; sys.path[:0] = [{HERE!r}]\n"
            "from sglang_fp8rl.cpu_runner import install_cpu_stubs; install_cpu_stubs()\n"
            "import torch\nfrom sglang.srt.utils import init_custom_process_group\n"
            "print('imported', flush=True)\n"
            f"g = init_custom_process_group(backend='gloo', init_method='tcp://127.0.0.1:{port}', world_size=2, "
            f"rank=0, group_name={group_name!r})\n"
            "torch.distributed.broadcast(torch.arange(4.0), src=0, group=g)\n"
            "print('sent', flush=True); sys.stdout.flush(); os._exit(0)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def imported(proc: subprocess.Popen) -> subprocess.Popen:
    """The trainer once its imports are done: the join's SHORT bound then covers the rendezvous, not a start that
    a loaded CI machine slows down (a CI run saw a live trainer importing SGLang miss a 15 s rendezvous)."""
    line = proc.stdout.readline()
    assert line.strip() == "imported", f"the trainer died while importing: {line}{proc.stdout.read()}"
    return proc


def dead_trainer(port: int) -> subprocess.Popen:
    """A trainer that exits before binding its port (as one whose port was taken, or that failed at import)."""
    return subprocess.Popen([sys.executable, "-c", "print('no port for me'); raise SystemExit(3)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_dead_trainer_costs_one_bounded_retry_on_a_fresh_port(monkeypatch):
    install_cpu_stubs()
    monkeypatch.setattr("update_group.GROUP_TIMEOUT", SHORT)
    starts = iter([dead_trainer, lambda port: imported(trainer(port, "ug_retry"))])
    joiner, t0 = Joiner(), time.monotonic()
    proc = join_update_group(joiner, lambda port: next(starts)(port), "ug_retry")
    received = torch.zeros(4)
    torch.distributed.broadcast(received, src=0, group=joiner.groups["ug_retry"])
    assert torch.equal(received, torch.arange(4.0))
    assert proc.communicate(timeout=60)[0].strip().endswith("sent") and proc.returncode == 0
    assert len(joiner.ports) == 2 and joiner.ports[0] != joiner.ports[1]
    assert time.monotonic() - t0 < BOUND_S, "the failed rendezvous waited past its bound"
    torch.distributed.destroy_process_group(joiner.groups["ug_retry"])


def test_no_group_after_every_attempt_says_why_for_each(monkeypatch):
    install_cpu_stubs()
    monkeypatch.setattr("update_group.GROUP_TIMEOUT", SHORT)
    joiner, t0 = Joiner(), time.monotonic()
    with pytest.raises(AssertionError) as raised:
        join_update_group(joiner, dead_trainer, "ug_never", attempts=2)
    text = str(raised.value)
    assert "no update group after 2 attempts" in text
    assert len(joiner.ports) == 2
    assert all(f"port {port}: Failed to initialize custom process group" in text for port in joiner.ports)
    assert text.count("trainer (rc=3)") == 2 and "no port for me" in text
    assert time.monotonic() - t0 < BOUND_S, "a failed rendezvous waited past its bound"
