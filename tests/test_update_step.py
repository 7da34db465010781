"""The weight-update step as one object: its transitions and what its end decides (pure, no SGLang)."""

from __future__ import annotations

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


def test_an_atomic_step_refused_after_a_write_breaks_once():
    step = UpdateStep()
    step.validated()
    step.validated()
    assert step.refused("bucket 1 refused") == ()  # nothing written yet: nothing to mark
    step.applied(["a", "b"])
    assert step.refused("bucket 2 refused") == ("a", "b")
    assert step.refused("bucket 3 refused") == ()  # reported once
    assert step.broken == "bucket 2 refused"


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
                      "written": 1, "broken": "", "trainer_kv_layers": 1}
