"""SGLang's weight-update sessions (0.5.21+), on ``SchedulerWeightUpdaterManager``: ``begin_weight_update`` opens the
step (:mod:`sglang_fp8rl.weight_sync.step`) and ``end_weight_update`` ends it, after SGLang has finalized the weights
(its ``process_weights_after_loading`` re-run, which our FP8 methods make a no-op that keeps every pointer); a due
KV-scale recalibration then runs as after any update answer."""

from __future__ import annotations

from typing import Any, Callable

from sglang_fp8rl.hooks.kv_cache import recalibrate_if_due
from sglang_fp8rl.weight_sync import guard
from sglang_fp8rl.weight_sync.step import current_step, end_step
from sglang_fp8rl.weight_sync.update import is_attached


def served_model(manager: Any) -> Any:
    """The model the manager's TP worker serves."""
    return manager.tp_worker.model_runner.model


def wrap_begin(original: Callable) -> Callable:
    """begin_weight_update: SGLang's, then our step opens (as a session: only the session's end ends it)."""
    def begin_weight_update(self, recv_req):
        output = original(self, recv_req)
        if getattr(output, "success", False) and is_attached(served_model(self)):
            current_step().begin(session=True)
        return output

    return begin_weight_update


def wrap_end(original: Callable) -> Callable:
    """end_weight_update: SGLang's, then our step ends (its commit applied) and a due recalibration runs."""
    def end_weight_update(self, recv_req):
        output = original(self, recv_req)
        model = served_model(self)
        if getattr(output, "success", False) and is_attached(model):
            commit = end_step(model)
            recalibrate_if_due(self)
            if commit is not None and commit.unpaired:
                output.success, output.message = False, guard.with_state(guard.unpaired_answer(commit))
        return output

    return end_weight_update
