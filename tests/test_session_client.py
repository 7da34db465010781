"""The trainer side of SGLang's weight-update sessions (0.5.21+): one session per step, closed on every exit."""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.weight_sync.client import WeightPushError, push_state_dict, recalibrate_kv_scales
from sglang_fp8rl.weight_sync.session import step_session


class Engine:
    """An ``sglang.Engine`` stand-in that records calls and enforces SGLang's session rules."""

    def __init__(self, sessions: bool = True, refuse: str = "") -> None:
        self.calls: list[str] = []
        self.open = False
        self.refuse = refuse
        if not sessions:
            self.begin_weight_update = self.end_weight_update = None  # an older SGLang: no such methods

    def begin_weight_update(self):
        self.calls.append("begin")
        if self.open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.open = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end")
        if not self.open:
            return False, "no weight-update session is open"
        self.open = False
        return True, "Success"

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        names = [n for n, _ in named]
        self.calls.append(f"{load_format or 'apply'}:{','.join(names)}")
        if self.begin_weight_update is not None and not self.open:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if self.refuse and self.refuse in names and load_format != "fp8rl.validate":
            return False, f"{self.refuse}: refused"
        return True, "Success"


WEIGHTS = {"a": torch.ones(4), "b": torch.ones(4)}


def test_a_step_is_one_session_and_the_session_end_completes_it():
    engine = Engine()
    push_state_dict(engine, WEIGHTS, bucket_bytes=16)
    assert engine.calls == ["begin", "fp8rl.validate:a", "fp8rl.validate:b", "apply:a", "apply:b", "end"]


def test_without_sessions_the_last_bucket_carries_the_marker():
    engine = Engine(sessions=False)
    push_state_dict(engine, WEIGHTS, bucket_bytes=16)
    assert engine.calls == ["fp8rl.validate:a", "fp8rl.validate:b", "apply:a", "apply:b,fp8rl.step_complete"]


def test_a_refused_bucket_still_closes_the_session():
    engine = Engine(refuse="b")
    with pytest.raises(WeightPushError, match="b: refused"):
        push_state_dict(engine, WEIGHTS, bucket_bytes=16)
    assert engine.calls[-1] == "end" and not engine.open


def test_a_trainer_error_inside_the_session_closes_it_and_is_the_error_raised():
    engine = Engine()
    with pytest.raises(KeyError, match="trainer"), step_session(engine, timeout=1):
        raise KeyError("trainer")
    assert engine.calls == ["begin", "end"] and not engine.open


def test_a_session_left_open_by_a_dead_trainer_is_closed_and_reopened():
    engine = Engine()
    engine.open = True  # a previous trainer process died mid-step
    push_state_dict(engine, {"a": torch.ones(4)}, atomic=False)
    assert engine.calls == ["begin", "end", "begin", "apply:a", "end"]


def test_recalibration_is_an_empty_session_where_the_engine_has_sessions():
    engine = Engine()
    recalibrate_kv_scales(engine)
    assert engine.calls == ["begin", "end"]
    old = Engine(sessions=False)
    recalibrate_kv_scales(old)
    assert old.calls == ["apply:fp8rl.step_complete"]
