"""The test harness's subprocesses: tests/rank_pair.run_ranks retries a rendezvous port taken before the ranks bind it,
stops a hang at the timeout with every rank's log, names a failed rank; a hung tests/sgl_worker.py prints where it
hangs before it is killed."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import rank_pair

# rank 0 binds torch's TCPStore on the port (as a gloo rendezvous does); every rank prints the port it was given
RANK = ("import sys\nrank, port = int(sys.argv[1]), int(sys.argv[2])\n"
        "if rank == 0:\n"
        "    from torch.distributed import TCPStore\n"
        "    store = TCPStore('127.0.0.1', port, 1, True, wait_for_workers=False)\n"
        "print('rank', rank, 'port', port, flush=True)\n")


def command(rank: int, port: int) -> list[str]:
    return [sys.executable, "-c", RANK, str(rank), str(port)]


def test_a_taken_port_is_retried_on_another(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy, rank_pair.free_port()])
        monkeypatch.setattr(rank_pair, "free_port", lambda: next(ports))
        logs = rank_pair.run_ranks(command, dict(os.environ), timeout=120)
    port = int(logs[0].split()[-1])
    assert port != busy and logs == [f"rank 0 port {port}\n", f"rank 1 port {port}\n"]


def test_a_port_taken_on_every_attempt_fails_naming_the_rank(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(rank_pair, "free_port", lambda: busy)
        with pytest.raises(AssertionError, match=r"rank 0 failed \(rc=1\):\n(.|\n)*EADDRINUSE"):
            rank_pair.run_ranks(command, dict(os.environ), timeout=120)


def test_a_hang_is_stopped_at_the_timeout_with_every_ranks_log():
    def hanging(rank: int, port: int) -> list[str]:
        code = f"import time; print('rank %d waiting' % {rank}, flush=True); time.sleep(600 if {rank} else 0)"
        return [sys.executable, "-c", code]

    with pytest.raises(AssertionError, match=r"still ran after 5 s(.|\n)*rank 0:\nrank 0 waiting(.|\n)*"
                                             r"rank 1:\nrank 1 waiting"):
        rank_pair.run_ranks(hanging, dict(os.environ), timeout=5)


@pytest.mark.slow
def test_a_hung_worker_prints_where_it_hangs(tmp_path):
    from sgl_model import TINY, run_worker, write_checkpoint

    write_checkpoint(str(tmp_path / "w"), TINY, seed=1)
    with pytest.raises(AssertionError) as raised:
        run_worker("hang", str(tmp_path / "w"), str(tmp_path / "out.pt"), timeout=rank_pair.STACKS_MARGIN_S + 40,
                   extra={"seconds": 600})
    text = str(raised.value)
    assert "worker hang failed" in text and "Timeout (0:00:40)!" in text
    assert "in <lambda>" in text and "sgl_worker.py" in text
