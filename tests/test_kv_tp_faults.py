"""Issue 34 item 9: a rank-local failure at any stage of a KV recalibration under TP returns on every rank, within
seconds, with the previous scales on every rank; SGLang's real CPU ModelRunner at TP 2 over gloo, one pair of worker
processes (tests/sgl_worker_kv_tp.py) for every stage in turn.

A hang fails fast: each worker's watchdog ends it after ``WATCHDOG_S`` in one call, and both are killed past the
test's own timeout.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from rank_pair import run_ranks as run_rank_pair
from sgl_model import TINY, write_checkpoint

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "sgl_worker_kv_tp.py")
ARGS = ("--quantization", "fp8_online_blockwise", "--kv-cache-dtype", "fp8_e4m3")
# the failure each injected fault must be reported as, on both ranks
STAGE_MESSAGES = {
    "prepare_for_extend": ("while building the calibration batch", "OutOfMemoryError"),
    "kv_alloc": ("while building the calibration batch", "TP rank 1"),
    "forward_batch": ("while building the calibration batch", "ForwardBatch.init_new"),
    "forward": ("in the calibration forward", "illegal memory access"),
    "scales": ("while deriving the scales", "OutOfMemoryError"),
    "under": ("while writing the start-up scales", "start-up scales"),
    "write": ("while writing the scales", "new scales"),
}
SECONDS = 30  # one recalibration of 512 tokens takes about a second here; a hang is stopped at the watchdog (45 s)


def run_ranks(model_dir: str, out_prefix: str, timeout: int = 420) -> list[dict]:
    """The kv_tp_faults scenario as two TP ranks (gloo on CPU); both are killed past ``timeout``."""
    env = dict(os.environ, SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r % os.cpu_count()) for r in range(2)))
    env.pop("FP8RL_OPTIONS", None)
    run_rank_pair(lambda rank, port: [sys.executable, WORKER, "kv_tp_faults", model_dir, f"{out_prefix}.rank{rank}.pt",
                                json.dumps({"tp_rank": rank}), *ARGS, "--tp-size", "2", "--nccl-port", str(port)],
                  env, timeout)
    return [torch.load(f"{out_prefix}.rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv_tp")
    write_checkpoint(str(d / "w"), dict(TINY, num_key_value_heads=2), seed=34)
    return run_ranks(str(d / "w"), str(d / "out"))


def test_a_fault_at_any_stage_returns_on_every_rank_with_the_previous_scales(ranks):
    """Rank 1 fails at one stage per recalibration: building the batch (prepare_for_extend out of memory, SGLang's
    own KV allocation failure, ForwardBatch.init_new), after the forward, deriving the scales, writing the start-up
    scales, writing the new scales. Each call returns on both ranks within seconds; both log the same failure naming
    rank 1 and the stage; both keep the scales they served, stay due, and give back every KV and request slot."""
    for out in ranks:
        assert out["mode"] == "calibrate" and out["load"]["writes"] == 1
        assert out["served"] != out["under"]  # a restore to the start-up scales would show
    for stage, (where, detail) in STAGE_MESSAGES.items():
        calls = [next(c for c in out["faults"] if c["stage"] == stage) for out in ranks]
        for rank, (out, call) in enumerate(zip(ranks, calls, strict=True)):
            assert call["seconds"] < SECONDS, (stage, rank, call)
            failures = [m for m in call["warnings"] if "KV recalibration failed" in m]
            assert len(failures) == 1, (stage, rank, call["warnings"])
            assert where in failures[0] and "TP rank 1" in failures[0] and detail in failures[0], (stage, failures)
            assert "TP rank 0" not in failures[0], (stage, failures)
            assert call["scales"] == out["served"] and call["floats_match"], (stage, rank, call["scales"])
            assert call["due"] and call["writes"] == 1, (stage, rank)
            assert call["free_after"] == call["free_before"], (stage, rank)
        assert calls[0]["warnings"] == calls[1]["warnings"], stage


def test_a_fault_in_the_load_time_calibration_raises_on_every_rank(ranks):
    """The load-time calibration (the same call as at start) with rank 1 out of memory while building the batch:
    both ranks raise the same failure at once, with their scales as they were."""
    errors = [out["load_time"]["error"] for out in ranks]
    assert errors[0] == errors[1] and "CalibrationFailed" in errors[0] and "TP rank 1" in errors[0], errors
    for out in ranks:
        call = out["load_time"]
        assert call["seconds"] < SECONDS and call["scales"] == out["served"]
        assert call["free_after"] == call["free_before"]


def test_a_healthy_recalibration_after_the_faults_succeeds_on_both_ranks(ranks):
    """After every fault, a recalibration without one writes the same scales on both ranks: the load-time ones (the
    weights did not change)."""
    for out in ranks:
        call = out["healthy"]
        assert call["error"] is None and not call["warnings"] and not call["due"] and call["writes"] == 2
        assert call["scales"] == {int(i): tuple(s) for i, s in out["load"]["scales"].items()}
        assert call["free_after"] == call["free_before"]
    assert ranks[0]["healthy"]["scales"] == ranks[1]["healthy"]["scales"]
