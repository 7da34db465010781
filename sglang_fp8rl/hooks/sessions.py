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
from sglang_fp8rl.weight_sync.fp8_payload import without_partners
from sglang_fp8rl.weight_sync.load_guard import is_attached
from sglang_fp8rl.weight_sync.step import apply_commit, current_step, end_step

logger = logging.getLogger(__name__)


def served_model(manager: Any) -> Any:
    """The model the manager's TP worker serves."""
    return manager.tp_worker.model_runner.model


def wrap_begin(original: Callable) -> Callable:
    """begin_weight_update: SGLang's, then our step opens (as a session: only the session's end ends it); a step
    still open (halves held, an apply round left half-way) is abandoned first, and the answer says what it left."""
    def begin_weight_update(self, recv_req):
        output = original(self, recv_req)
        if getattr(output, "success", False):
            _guarded("opening the weight-update step", lambda: _begin(self, output))
        return output

    return begin_weight_update


def _begin(manager: Any, output: Any) -> None:
    if not is_attached(served_model(manager)):
        return
    abandoned = apply_commit(current_step().begin(session=True))
    answer = guard.end_answer(abandoned) if abandoned is not None else None
    if answer is not None:
        output.message = f"{getattr(output, 'message', '') or ''} (the previous step: {answer})".strip()


def wrap_end(original: Callable) -> Callable:
    """end_weight_update: SGLang's, then our step ends (its commit applied) and a due recalibration runs; a step that
    did not complete is answered as refused, saying what it dropped and what is dirty."""
    def end_weight_update(self, recv_req):
        output = original(self, recv_req)
        if getattr(output, "success", False):
            _guarded("ending the weight-update step", lambda: _end(self, output))
        return output

    return end_weight_update


def _end(manager: Any, output: Any) -> None:
    model = served_model(manager)
    if not is_attached(model):
        return
    commit = end_step(model)
    recalibrate_if_due(manager)
    answer = guard.end_answer(commit) if commit is not None else None
    if answer is not None:
        output.success, output.message = False, guard.with_state(answer)
    else:  # a clean end that left the engine inconsistent (an earlier step's tensors not yet rewritten) says so
        output.message = guard.with_state(getattr(output, "message", "") or "")


def _guarded(what: str, call: Callable[[], None]) -> None:
    """Run our part of a session call; nothing may escape into SGLang's scheduler loop."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the boundary to SGLang's scheduler: nothing may escape
        logger.exception("[fp8rl] %s failed: %s: %s", what, type(e).__name__, e)


def end_step_on_flush(handler_owner: Any) -> None:
    """After a successful ``/flush_cache`` answered by ``handler_owner``: end the step if the flush ends it
    (:attr:`UpdateStep.ends_on_flush`), then run a due recalibration (the engine is idle: SGLang flushes only then).
    Never raises: this runs in SGLang's scheduler loop."""
    try:
        manager = updates.scheduler_update_manager(updates.flush_handler_scheduler(handler_owner))
        model = served_model(manager)
        if not is_attached(model):
            return
        step = current_step()
        if step.held and not step.session:
            logger.warning("[fp8rl] /flush_cache does not end the weight-update step: FP8 halves are still held for "
                           "their partner (%s)", without_partners(sorted(step.held)))
        if not step.ends_on_flush:
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
