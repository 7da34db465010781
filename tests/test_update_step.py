"""The weight-update step as one object: its transitions and what its end decides (pure, no SGLang)."""

from __future__ import annotations

import torch

from sglang_fp8rl.weight_sync.step import Phase, UpdateStep

LAYERS = 4


def test_a_step_opens_on_its_first_request_and_ends_on_the_marker():
    step = UpdateStep()
    assert step.phase is Phase.IDLE
    step.applied(["a", "b"])
    assert step.open and step.requests == 1
    commit = step.end(LAYERS, marker=True)
    assert commit is not None and commit.index == 1 and commit.recalibrate
    assert step.phase is Phase.IDLE and step.written == set() and step.index == 1


def test_trainer_scales_of_every_layer_across_buckets_skip_the_recalibration():
    """Scales sent for every layer in an early bucket still count when the step ends in a later one."""
    step = UpdateStep()
    step.applied(["w1"], kv_layers=range(LAYERS))
    step.applied(["w2"])
    step.applied(["w3"])
    assert not step.end(LAYERS, marker=True).recalibrate
    step.applied(["w1"], kv_layers=[0, 1])  # next step: only some layers
    assert step.end(LAYERS, marker=True).recalibrate


def test_a_marker_inside_a_session_is_only_noted():
    step = UpdateStep()
    step.begin(session=True)
    step.applied(["a"])
    assert step.end(LAYERS, marker=True) is None and step.open and step.complete_requested
    commit = step.end(LAYERS)
    assert commit is not None and commit.index == 1 and not step.open and not step.session


def test_an_explicit_flush_ends_only_an_open_written_step_outside_a_session():
    """What ends_on_flush says (verl's sync ends with /flush_cache, no marker, no session); a query."""
    step = UpdateStep()
    assert not step.ends_on_flush  # idle
    step.refused("nothing written")
    assert step.open and not step.ends_on_flush  # open, nothing written
    step.applied(["a"])
    assert step.ends_on_flush and step.open  # the query changed nothing
    session = UpdateStep()
    session.begin(session=True)
    session.applied(["a"])
    assert not session.ends_on_flush  # only the session's end ends it
    atomic = UpdateStep()
    atomic.validated()
    atomic.applied(["a"])
    assert not atomic.ends_on_flush  # all-or-nothing: its applying round may still come
    held = UpdateStep()
    held.held["w.weight"] = torch.zeros(1)
    held.applied(["a"])
    assert not held.ends_on_flush  # a half waits for its partner


def test_an_atomic_step_refused_after_a_write_marks_everything_it_wrote_at_every_refusal():
    """Issue 34 item 1: a second refusal must not hide the first; writes after the break are dirty too."""
    step = UpdateStep()
    step.validated(["a", "b", "c"])
    assert step.refused("bucket 1 refused") == ()  # nothing written yet: nothing to mark
    step.applied(["a", "b"])
    assert step.refused("bucket 2 refused") == ("a", "b")
    assert step.refused("bucket 3 refused") == ("a", "b")  # cumulative, not once
    assert step.broken == "bucket 2 refused"
    assert step.applied(["c"]) == ("c",)  # written after the break: dirty at once
    commit = step.end(LAYERS, marker=True)
    assert commit.clean == () and commit.dirty == ("a", "b", "c") and "bucket 2 refused" in commit.incomplete


def test_the_next_all_or_nothing_push_abandons_a_broken_step():
    """A validate-only request after the apply round began opens a new step; the old one's writes stay dirty, and
    the new step clears them only when it completes."""
    step = UpdateStep()
    step.validated(["a", "b"])
    step.applied(["a"])
    step.refused("b refused")
    assert step.starts_new_step(validate_only=True) and not step.starts_new_step(validate_only=False)
    abandoned = step.validated(["a", "b"])
    assert abandoned is not None and abandoned.abandoned and abandoned.dirty == ("a",) and abandoned.clean == ()
    assert step.validated(["a", "b"]) is None  # the same validation round
    assert step.applied(["a"]) == () and step.refused("b refused again") == ("a",)  # broken again: marked again
    assert step.validated(["a", "b"]).dirty == ("a",)
    step.applied(["a"])
    step.applied(["b"])
    commit = step.end(LAYERS, marker=True)
    assert commit.clean == ("a", "b") and commit.dirty == () and commit.incomplete == ""


def test_an_atomic_step_that_did_not_write_its_validated_names_is_incomplete():
    """A trainer that died in the apply round (its session closed by the next trainer): written names stay dirty."""
    step = UpdateStep()
    step.begin(session=True)
    step.validated(["a", "b", "c"])
    step.applied(["a"])
    commit = step.end(LAYERS)
    assert commit.dirty == ("a",) and commit.clean == () and "2 of the 3 tensors" in commit.incomplete


def test_a_sessions_begin_abandons_an_open_step_and_drops_its_halves():
    step = UpdateStep()
    step.applied([], pairing=step.pairing([(W, _codes())]))
    abandoned = step.begin(session=True)
    assert abandoned.unpaired == (W,) and abandoned.dirty == ()  # nothing else was written: old weights everywhere
    assert step.session and step.open and step.held == {}


def test_a_plain_step_clears_nothing_at_its_end_and_marks_a_dropped_halfs_weight():
    step = UpdateStep()
    step.applied(["model.norm.weight"], pairing=step.pairing([(W, _codes())]))
    commit = step.abandon()
    assert commit.clean == () and commit.dirty == (W,) and commit.unpaired == (W,)


def test_a_non_atomic_step_refusal_leaves_written_requests_alone():
    step = UpdateStep()
    step.applied(["a"])
    assert step.refused("refused") == ()


def test_queries_do_not_change_state():
    step = UpdateStep()
    step.applied(["a"], kv_layers=[1])
    before = step.describe()
    assert step.describe() == before and step.open
    assert before == {"steps_ended": 0, "phase": "open", "session": False, "atomic": False, "requests": 1,
                      "written": 1, "validated": 0, "broken": "", "trainer_kv_layers": 1, "held_halves": [],
                      "held_bytes": 0}


# ---------------------------------------------------------------------------------------------------------------------
# FP8 halves held across the requests of a step

W = "model.layers.0.mlp.down_proj.weight"


def _codes(rows: int = 256, cols: int = 256):
    import torch

    return torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)


def _scale():
    import torch

    return torch.ones(2, 2)


def test_a_half_is_held_copied_and_taken_by_its_partner():
    step = UpdateStep()
    codes = _codes()
    first = step.pairing([(W, codes)])
    assert first.hold.keys() == {W} and first.named == [] and first.taken == ()
    assert step.held == {}  # a query: nothing held until the request is applied
    step.applied([], pairing=first)
    assert step.held.keys() == {W} and step.held[W] is not codes  # a copy: the sender may reuse its buffer
    assert step.held_bytes == 256 * 256 and step.describe()["held_halves"] == [W]
    second = step.pairing([(W + "_scale_inv", _scale())])
    assert second.taken == (W,) and [name for name, _ in second.named] == [W + "_scale_inv", W]
    step.applied([W], pairing=second)
    assert step.held == {} and step.end(LAYERS, marker=True).unpaired == ()


def test_whole_pairs_in_one_request_hold_nothing():
    pairing = UpdateStep().pairing([(W, _codes()), (W + "_scale_inv", _scale()), ("model.norm.weight", None)])
    assert pairing.hold == {} and pairing.taken == ()


def test_refusals_for_halves_that_cannot_be_held():
    import pytest

    from sglang_fp8rl.weight_sync import step as step_module
    from sglang_fp8rl.weight_sync.validate import UpdateRejected

    step = UpdateStep()
    with pytest.raises(UpdateRejected, match="validate-only"):
        step.pairing([(W, _codes())], validate_only=True)
    with pytest.raises(UpdateRejected, match=f"ends the step.*{W} without {W}_scale_inv"):
        step.pairing([(W, _codes())], ends_step=True)
    step.applied([], pairing=step.pairing([(W, _codes())]))
    with pytest.raises(UpdateRejected, match=f"{W} without {W}_scale_inv"):  # held from before, not completed here
        step.pairing([("model.norm.weight", None)], ends_step=True)
    limit = step_module.MAX_HELD_BYTES
    try:
        step_module.MAX_HELD_BYTES = 256 * 256 + 10
        with pytest.raises(UpdateRejected, match="more than"):
            step.pairing([("model.layers.1.mlp.down_proj.weight", _codes(16, 16))])
    finally:
        step_module.MAX_HELD_BYTES = limit


def test_a_session_end_with_a_half_held_reports_it_unpaired_and_drops_it():
    step = UpdateStep()
    step.begin(session=True)
    step.applied([], pairing=step.pairing([(W + "_scale_inv", _scale())]))
    commit = step.end(LAYERS)
    assert commit.unpaired == (W + "_scale_inv",) and commit.unpaired_weights == (W,)
    assert commit.unpaired_message() == f"{W}_scale_inv without {W}"
    assert step.held == {}


def test_a_later_tensor_of_the_same_weight_supersedes_a_held_half():
    """Issue 34 item 2: BF16, a whole pair or the same half again replaces the held half (never paired with it)."""
    for later in ([(W, torch.zeros(256, 256, dtype=torch.bfloat16))],
                  [(W, _codes()), (W + "_scale_inv", _scale())],
                  [(W, _codes())]):
        step = UpdateStep()
        step.applied([], pairing=step.pairing([(W, _codes())]))
        pairing = step.pairing(later, ends_step=len(later) > 1 or later[0][1].dtype == torch.bfloat16)
        assert pairing.superseded == (W,) and pairing.taken == ()
        step.applied([W], pairing=pairing)
        assert list(step.held) == ([W] if pairing.hold else [])


def test_a_new_all_or_nothing_push_sees_no_half_of_the_step_it_abandons():
    step = UpdateStep()
    step.applied([], pairing=step.pairing([(W + "_scale_inv", _scale())]))
    fresh = step.pairing([(W, _codes()), (W + "_scale_inv", _scale())], validate_only=True)
    assert fresh.taken == () and fresh.hold == {}
    abandoned = step.validated([W])
    assert abandoned.unpaired == (W + "_scale_inv",) and step.held == {}
