"""``Scheduler`` patches: our telemetry in ``/get_server_info``, and no serving while the weights are a mix.

While an update failed after writing started (the weights are a mix of two policies), every generation request is
finished with an error and health-check requests get no answer (so ``/health`` and ``/health_generate`` report 503)
until a complete update succeeds. While SGLang's memory saver holds GPU memory released (hooks/memory.py), a generation
request is taken out of the queue and answered as aborted before it runs, and health checks get no answer.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

from sglang_fp8rl.compat.runtime import internal_state_dict
from sglang_fp8rl.hooks.memory import released_message
from sglang_fp8rl.kv_scales.engine import describe, kv_state
from sglang_fp8rl.layers.config import scheme_report
from sglang_fp8rl.weight_sync.engine_state import EVERYTHING, engine_state
from sglang_fp8rl.weight_sync.load_guard import is_attached
from sglang_fp8rl.weight_sync.step import current_step
from sglang_fp8rl.weight_sync.telemetry import last_update_stats

logger = logging.getLogger(__name__)


def telemetry(model: Optional[torch.nn.Module]) -> dict[str, Any]:
    """Our state for /get_server_info: update count, last update, consistency, per-scheme layer counts, the KV scales
    and the step (each read from its owner: sglang_fp8rl/engine.py)."""
    state, kv = engine_state(), kv_state()
    report = scheme_report(model) if model is not None else None
    fp8_ptrs = [p.data_ptr() for p in model.parameters() if p.dtype == torch.float8_e4m3fn] if model else []
    return {
        "fp8_param_ptr_digest": hash(tuple(fp8_ptrs)),
        "updates": state.updates,
        "consistent": state.consistent,
        "inconsistent_reason": state.inconsistent_reason,
        "released": sorted(state.released),  # SGLang's memory-saver tags released now (hooks/memory.py)
        # weights resumed without their bytes (or a failure of unknown extent): what no write has reached since
        "not_rewritten": state.unwritten_summary() if EVERYTHING in state.dirty else "",
        "last_update": last_update_stats(),
        "schemes": report.as_dict() if report is not None else None,
        "kv_scales": describe(kv, kv.record.as_dict()),
        "step": current_step().describe(),
    }


def wrap_internal_state(original: Callable) -> Callable:
    """Scheduler.get_internal_state, plus our telemetry under "fp8rl"."""
    def get_internal_state(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        model = getattr(getattr(getattr(self, "tp_worker", None), "model_runner", None), "model", None)
        if model is not None and is_attached(model):
            internal_state_dict(result)["fp8rl"] = telemetry(model)
        return result

    return get_internal_state


def refusal_message() -> str:
    """What a generation request gets while the weights are a mix of two updates."""
    return (
        "[fp8rl] refusing to serve: the engine holds a partially applied weight update "
        f"({engine_state().inconsistent_reason}); send a complete weight update first"
    )


def abort_queued_request(queues: list[list], rid: str, message: str) -> bool:
    """Finish a just-queued request with an error instead of running it (SGLang's own abort path)."""
    for queue in queues:
        for req in reversed(queue):
            if req.rid == rid:
                req.set_finish_with_abort(message)
                return True
    return False


def request_queues(scheduler: Any) -> list[list]:
    """Where a new request waits: the waiting queue, or the grammar queue while its grammar compiles."""
    grammar_queue = getattr(getattr(scheduler, "grammar_manager", None), "grammar_queue", None)
    return [scheduler.waiting_queue] + ([grammar_queue] if grammar_queue is not None else [])


def drop_queued_request(scheduler: Any, rid: str) -> None:
    """Take a just-queued request out of the queue and answer it as aborted, without running it: SGLang's
    ``abort_request`` for a waiting request (an aborted request that stays queued still runs a one-token prefill,
    which would read released weights and write a released KV pool)."""
    from sglang.srt.managers.io_struct import AbortReq

    logger.warning("%s (request %s aborted)", released_message(), rid)
    scheduler.abort_request(AbortReq(rid=rid))


def wrap_generate(original: Callable) -> Callable:
    """Scheduler.handle_generate_request, refusing while the engine is inconsistent or its memory released."""
    def handle_generate_request(self, recv_req):
        state = engine_state()
        if state.consistent and not state.released:
            return original(self, recv_req)
        if str(recv_req.rid).startswith(HEALTH_CHECK_RID_PREFIX):
            return None  # no answer: /health and /health_generate time out and report 503
        result = original(self, recv_req)
        if state.released:
            drop_queued_request(self, recv_req.rid)
        else:
            abort_queued_request(request_queues(self), recv_req.rid, refusal_message())
        return result

    return handle_generate_request
