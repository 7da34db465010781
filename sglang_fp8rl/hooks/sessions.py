"""Step boundaries that SGLang signals (:mod:`sglang_fp8rl.weight_sync.step`).

* Weight-update sessions (0.5.21+), on ``SchedulerWeightUpdaterManager``: ``begin_weight_update`` opens the step and
  ``end_weight_update`` ends it, after SGLang has finalized the weights (its ``process_weights_after_loading`` re-run,
  which our FP8 methods make a no-op that keeps every pointer).
* An explicit ``/flush_cache`` answered with success (every release): it ends an open step outside a session that
  wrote weights. verl 0.9.1 ends each weight sync that way, with no step marker and no session.

A due KV-scale recalibration then runs as after any update answer."""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang_fp8rl.compat import updates
from sglang_fp8rl.hooks.kv_cache import recalibrate_if_due
from sglang_fp8rl.weight_sync import guard
from sglang_fp8rl.weight_sync.step import current_step, end_step
from sglang_fp8rl.weight_sync.update import is_attached

logger = logging.getLogger(__name__)


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


def end_step_on_flush(handler_owner: Any) -> None:
    """After a successful ``/flush_cache`` answered by ``handler_owner``: end the step if the flush ends it
    (:attr:`UpdateStep.ends_on_flush`), then run a due recalibration (the engine is idle: SGLang flushes only then).
    Never raises: this runs in SGLang's scheduler loop."""
    try:
        manager = updates.scheduler_update_manager(updates.flush_handler_scheduler(handler_owner))
        model = served_model(manager)
        if not (is_attached(model) and current_step().ends_on_flush):
            return
        commit = end_step(model)
        logger.info("[fp8rl] step %d ended by /flush_cache (a weight sync without a step marker or session)",
                    commit.index)
        recalibrate_if_due(manager)
    except Exception as e:  # noqa: BLE001 - the boundary to SGLang's scheduler: nothing may escape
        logger.warning("[fp8rl] ending the weight-update step on /flush_cache failed; the step stays open: %s: %s",
                       type(e).__name__, e)


def wrap_flush_request(original: Callable) -> Callable:
    """The answer to ``/flush_cache`` (``compat.updates.flush_request_handler``): SGLang's, then, if it flushed,
    :func:`end_step_on_flush`. A flush left pending (its ``timeout_s`` while requests run) ends nothing."""
    def handle(self, recv_req):
        output = original(self, recv_req)
        if getattr(output, "success", False):
            end_step_on_flush(self)
        return output

    return handle
