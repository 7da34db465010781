"""Issue 34's step defects through SGLang's real WeightUpdater (every supported release) and, from 0.5.21, its real
SchedulerWeightUpdaterManager: never "consistent" over a mix of two policies, never wedged on a stale FP8 half, halves
that could never pair refused at arrival, held halves named in the answer. Items of the issue in brackets."""

from __future__ import annotations

import pytest
import torch
from sgl_model import random_state_dict, run_worker, write_w0_w1
from test_sessions import requires_sessions

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")
HALF = "model.layers.1.mlp.down_proj.weight"
BUCKET_BYTES = 1 << 16  # the tiny model in several buckets


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("step_truth")
    _, w1 = write_w0_w1(d)
    torch.save(w1, d / "w1.pt")
    from sgl_model import TINY

    torch.save(random_state_dict(TINY, seed=12), d / "w2.pt")
    return d


@pytest.fixture(scope="module")
def truth(models):
    d = models
    extra = {"w1": str(d / "w1.pt"), "w2": str(d / "w2.pt"), "bucket_bytes": BUCKET_BYTES}
    # layer 0 kept in BF16: a half for it can never pair [4]
    return run_worker("step_truth", str(d / "w0"), str(d / "truth.pt"), *QUANT, "--fp8rl-bf16-first-layers", "1",
                      extra=extra)


def test_a_second_apply_round_refusal_does_not_hide_the_first(truth):
    """[1] The second push rewrites bucket 1 and is refused at bucket 2: bucket 1 now holds policy 2, the rest older,
    so the engine must stay inconsistent, and the refusal must say bucket 1 was written."""
    first, second = truth["after_push1"], truth["after_push2"]
    assert truth["push1"] is not None and not first["consistent"] and first["dirty"]
    assert truth["push2"] is not None and not second["consistent"], second
    assert set(first["dirty"]) <= set(second["dirty"])  # bucket 1's tensors, rewritten by policy 2, still dirty
    assert "nothing was written, previous weights kept" not in truth["push2"]
    assert "tensors were written" in truth["push2"] and "engine inconsistent" in truth["push2"], truth["push2"]
    # a complete step rewrites them: consistent again
    assert truth["push3"] is None and truth["after_push3"]["consistent"], truth["after_push3"]


def test_a_dead_trainers_half_is_dropped_by_the_next_atomic_push(truth):
    """[2] The next all-or-nothing push is not refused at its last bucket: its validation round drops the stale
    half, with one log line naming it, and the push completes."""
    assert truth["half"][0] and truth["after_half"]["step"]["held_halves"] == [HALF]
    assert truth["push_after_half"] is None, truth["push_after_half"]
    after = truth["after_push_after_half"]
    assert after["consistent"] and after["step"]["held_halves"] == [] and after["step"]["phase"] == "idle"
    dropped = [line for line in truth["log_after_half"] if "partner never came" in line]
    assert len(dropped) == 1 and HALF in dropped[0], truth["log_after_half"]


def test_a_later_bf16_tensor_supersedes_a_held_half(truth):
    """[2] A held scale whose weight then comes in BF16 is dropped, not paired with it."""
    assert truth["superseded"][0], truth["superseded"]
    assert truth["after_superseded"]["step"]["held_halves"] == []


def test_a_request_leaving_a_half_held_says_so(truth):
    """[5] The answer names the held half and its missing partner; the telemetry lists it."""
    ok, message = truth["half"]
    assert ok and f"held for their partner: {HALF} without {HALF}_scale_inv" in message, message
    assert truth["after_half"]["step"]["held_halves"] == [HALF]


@pytest.mark.parametrize("case, words", [
    ("fused_name", "not a weight name"),
    ("no_fp8_module", "kept in BF16"),
    ("unknown_name", "not a weight name"),
    ("bf16_layer", "kept in BF16"),
    ("wrong_shape", "does not fit"),
    ("contradicted", "float8_e4m3fn codes in the same update"),
])
def test_a_half_that_could_never_pair_is_refused_at_arrival(truth, case, words):
    """[4] Refused at once, naming it, with nothing of its request written (the norm sent beside the fused-name
    scale is not written)."""
    ok, message = truth["never_pair"][case]
    assert not ok and words in message, (case, message)
    assert truth["never_pair_changed"] == []
    assert truth["after_never_pair"]["step"]["held_halves"] == []


@requires_sessions
def test_a_dead_trainers_session_is_recovered_and_says_what_was_dropped(models):
    """[3] SGLang 0.5.21+: the next trainer's push closes the stale session and succeeds; the engine said what it
    dropped (the half) and kept the dead step's written tensors dirty until this step rewrote them."""
    d = models
    out = run_worker("session_recovery", str(d / "w0"), str(d / "recovery.pt"), *QUANT,
                     extra={"w1": str(d / "w1.pt"), "bucket_bytes": BUCKET_BYTES})
    assert out["begin"][0] and out["written"][0] and out["half"][0]
    assert out["dead_step"]["step"]["held_halves"] == [HALF]
    assert out["recovered"] is None, out["recovered"]
    after = out["after_recovery"]
    assert after["consistent"] and after["step"]["phase"] == "idle" and not out["session_open"], after
    closed = [line for line in out["log"] if "was left open" in line]
    assert len(closed) == 1 and f"{HALF} without {HALF}_scale_inv" in closed[0], out["log"]
    assert "never written" in closed[0], closed[0]
