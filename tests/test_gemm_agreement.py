"""One block-FP8 GEMM table for every TP rank (and for the next start that reads the cache).

Each rank measures its GEMM candidates apart, and where two are close (within noise, or with another process on the
GPU) ranks chose differently; the candidates do not all give the same bits (our decode kernel splits K). Seen on two
H100s with DP attention: DP rank 1 chose the split-K kernel at M 1 where DP rank 0 kept DeepGEMM, the cache kept the
last writer's table, and a cold start that read it served other bits than the running server (logprobs 1e-6 apart).
Now the ranks exchange their tables once at load (lowest rank wins per key; a rank that failed: SGLang's dispatch
everywhere) and the cache holds what was agreed.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from rank_pair import run_ranks
from test_gemm_select import clean_state, install_fake_tuning, request  # noqa: F401 - clean_state is autouse

from sglang_fp8rl.kernels import gemm_select as gs
from sglang_fp8rl.kernels.gemm_select import prepare as prepare_mod


def entry(choice: str) -> gs.Entry:
    return gs.Entry(candidates=["fast", "slow"], choice=choice)


def test_each_key_comes_from_the_lowest_rank_that_has_it():
    k1, k2, k3 = (gs.shape_key(256, 384, b) for b in (1, 2, 4))
    tables = [{k1: entry("fast")}, {k1: entry("slow"), k2: entry("slow")}, {k2: entry("fast"), k3: entry("fast")}]
    got = gs.agreed_entries(tables)
    assert {k: e.choice for k, e in got.items()} == {k1: "fast", k2: "slow", k3: "fast"}


def test_a_rank_that_could_not_prepare_makes_every_rank_keep_sglangs_dispatch():
    assert gs.agreed_entries([{gs.shape_key(256, 384, 1): entry("fast")}, None]) is None
    assert gs.agreed_entries([{}, {}]) == {}


def test_the_agreed_table_is_served_and_cached(monkeypatch, caplog):
    """A rank whose own measurement chose "fast" at M 2 serves, and caches, rank 0's choice there: SGLang's own."""
    calls: list = []
    cands, runtime = install_fake_tuning(monkeypatch, calls)
    key = gs.shape_key(256, 384, 2)
    seen: list = []

    def agree(table):
        seen.append({k: e.choice for k, e in table.items()})
        return {**table, key: gs.Entry(candidates=list(cands), choice=gs.DEFAULT)}  # rank 0's entry for this key

    with caplog.at_level("INFO", logger=prepare_mod.__name__):
        got = gs.prepare_shapes([(256, 384)], request("auto", max_m=4), runtime, agree)
    assert seen and seen[0][key] == "fast"  # this rank's own measurement went into the exchange
    assert got[key].choice == gs.DEFAULT and gs.select(2, 256, 384) == gs.DEFAULT
    assert gs.select(1, 256, 384) == "fast"  # the other buckets: the same choice on every rank
    assert gs.load_entries(runtime.info)[key].choice == gs.DEFAULT  # the next start reads what this one serves with
    assert "1 choices taken from a lower TP rank's measurement" in caplog.text


def test_a_failed_rank_elsewhere_leaves_this_rank_on_sglangs_dispatch(monkeypatch, caplog):
    calls: list = []
    _, runtime = install_fake_tuning(monkeypatch, calls)
    with caplog.at_level("WARNING", logger=prepare_mod.__name__):
        got = gs.prepare_shapes([(256, 384)], request("auto", max_m=4), runtime, lambda table: None)
    assert got == {} and gs.select(2, 256, 384) == gs.DEFAULT
    assert "a TP rank could not prepare its block-FP8 GEMMs" in caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# the hook at TP 2 over gloo: every rank takes part in the exchange exactly once, whatever happened to it before

RANK_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from sglang_fp8rl.cpu_runner import install_cpu_stubs
install_cpu_stubs()  # SGLang imports torchvision at module level (the tests' conftest does the same)
from sglang_fp8rl import parallel
from sglang_fp8rl.hooks import model_runner
from sglang_fp8rl.kernels import gemm_select as gs

rank, port, behaviour = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
parallel.tp_cpu_group = lambda: dist.group.WORLD
key = gs.shape_key(256, 384, 1)
got = []

def fake_prepare(runner, agree):
    if behaviour == "raise":
        raise RuntimeError("no memory for the warm-up workers")
    if behaviour == "no_shapes":
        return
    agreed = agree({key: gs.Entry(candidates=["a", "b"], choice=behaviour)})
    got.append(None if agreed is None else {k: e.choice for k, e in agreed.items()})

model_runner._prepare_gemms = fake_prepare
model_runner.prepare_gemms(object())
dist.barrier()  # a second collective: it pairs up only if both ranks made the same number of exchanges
print("RESULT " + json.dumps(got), flush=True)
dist.destroy_process_group()  # gloo's threads left running at exit can abort the interpreter (std::terminate)
"""


def run_pair(behaviours: tuple[str, str], timeout: int = 90) -> list:
    logs = run_ranks(lambda rank, port: [sys.executable, "-c", RANK_SCRIPT, str(rank), str(port), behaviours[rank]],
                     dict(os.environ), timeout)
    return [json.loads(next(ln for ln in log.splitlines() if ln.startswith("RESULT "))[7:]) for log in logs]


@pytest.mark.parametrize("behaviours, expect", [
    (("a", "b"), [["a"], ["a"]]),  # rank 1 serves rank 0's choice
    (("no_shapes", "b"), [[], ["b"]]),  # a rank without block shapes still takes part
    (("raise", "b"), [[], [None]]),  # a rank that failed: the other keeps SGLang's dispatch
])
def test_every_rank_exchanges_once_whatever_happened_before(behaviours, expect):
    """Per rank, the agreed choice of the one key its exchange returned (None: SGLang's dispatch everywhere)."""
    key = gs.shape_key(256, 384, 1)
    got = run_pair(behaviours)
    assert [[None if t is None else t[key] for t in rank] for rank in got] == expect
