"""Every runtime patch of SGLang, installed by the plugin in each SGLang process (idempotent).

One module per patched SGLang component:

* :mod:`.server_args`: our options on SGLang's parser, unsupported setups refused at start;
* :mod:`.model_runner`: after load, guard the model's updates and prepare its GEMMs;
* :mod:`.weight_updater`: every update entry point;
* :mod:`.kv_cache`: FP8 KV-cache scales set up, made graph-safe, calibrated at load and after complete updates;
* :mod:`.scheduler`: telemetry, and refusal to serve while inconsistent;
* :mod:`.tokenizer`: ``/health`` while inconsistent;
* :mod:`.sglang_logs`: SGLang's "not fully optimized" warning, untrue for this method, filtered.

Every patch leaves models that do not use this package untouched.
"""

from __future__ import annotations

import logging

from sglang_fp8rl.hooks import kv_cache, model_runner, scheduler, tokenizer, weight_updater
from sglang_fp8rl.hooks.patching import patch
from sglang_fp8rl.hooks.server_args import install_server_args_hooks
from sglang_fp8rl.hooks.sglang_logs import install_log_filter

logger = logging.getLogger(__name__)

UPDATE_ENTRY_POINTS = {
    "update_weights_from_tensor": weight_updater.wrap_update_from_tensor,
    "update_weights_from_distributed": weight_updater.wrap_update_from_distributed,
    "update_weights_from_disk": weight_updater.wrap_update_from_disk,
    "update_weights_from_ipc": weight_updater.wrap_update_from_ipc,
}


def install_hooks() -> None:
    """Install all engine patches (idempotent)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    install_server_args_hooks()
    install_log_filter()
    patch(ModelRunner, "load_model", model_runner.wrap_load_model)
    patch(ModelRunner, "init_attention_backends", kv_cache.wrap_init_attention_backends)
    patch(ModelRunner, "init_cuda_graphs", kv_cache.wrap_init_cuda_graphs)
    patch(MHATokenToKVPool, "set_kv_buffer", kv_cache.wrap_set_kv_buffer)
    for name, wrap in UPDATE_ENTRY_POINTS.items():
        patch(WeightUpdater, name, wrap)
    try:
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.managers.tp_worker import TpModelWorker
    except ImportError as e:  # these modules need CUDA-only deps on some installs; the guards above still hold
        logger.warning("[fp8rl] scheduler/tokenizer patches unavailable (telemetry, refusal while inconsistent): %s", e)
        return
    patch(TpModelWorker, "_deserialize_own_rank", weight_updater.wrap_deserialize_own_rank)
    for name in ("update_weights_from_tensor", "update_weights_from_disk", "update_weights_from_distributed"):
        patch(SchedulerWeightUpdaterManager, name, kv_cache.wrap_scheduler_update)
    patch(Scheduler, "get_internal_state", scheduler.wrap_internal_state)
    patch(Scheduler, "handle_generate_request", scheduler.wrap_generate)
    for name in tokenizer.UPDATE_METHODS:
        patch(TokenizerManager, name, tokenizer.wrap_update_answer)
