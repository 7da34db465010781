"""Every runtime patch of SGLang, installed by the plugin in each SGLang process (idempotent).

One module per patched SGLang component:

* :mod:`.server_args`: our options on SGLang's parser, unsupported setups refused at start;
* :mod:`.model_config`: a checkpoint quantized on disk, or an injected quantization_config of another scheme, refused
  at start;
* :mod:`.model_runner`: after load, guard the model's updates and prepare its GEMMs;
* :mod:`.weight_updater`: every update entry point; :mod:`.distributed`: the trainer's broadcast; both decode their
  transport with :mod:`.transport` (which patches nothing) and run the update pipeline (weight_sync/pipeline.py);
* :mod:`.kv_cache`: FP8 KV-cache scales set up, made graph-safe, calibrated at load and after complete updates; a
  cache flush refused while requests ran, run when idle; :mod:`.attention` (called from its attention-backend hook):
  FP8-KV decode calls of SGLang's FA3 backend sent to the split-KV kernel (``--fp8rl-decode-attention``);
* :mod:`.sessions`: SGLang's weight-update sessions (0.5.21+) as the step's begin and end, and an explicit cache
  flush as the end of a step without a session (verl's);
* :mod:`.memory`: SGLang's release and resume of GPU memory (``--enable-memory-saver``, verl's colocated mode):
  updates refused while the weights are released, weights resumed without a CPU backup marked inconsistent;
* :mod:`.scheduler`: telemetry, and refusal to serve while inconsistent;
* :mod:`.tokenizer`: ``/health`` while inconsistent;
* :mod:`.sglang_logs`: SGLang's "not fully optimized" warning, untrue for this method, filtered.

Every patch leaves models that do not use this package untouched.
"""

from __future__ import annotations

import logging
from typing import Callable

from sglang_fp8rl.compat import runtime, updates
from sglang_fp8rl.hooks import (
    distributed,
    kv_cache,
    memory,
    model_config,
    model_runner,
    scheduler,
    sessions,
    tokenizer,
    weight_updater,
)
from sglang_fp8rl.hooks.patching import patch
from sglang_fp8rl.hooks.server_args import install_server_args_hooks
from sglang_fp8rl.hooks.sglang_logs import install_log_filter

logger = logging.getLogger(__name__)


def update_entry_points() -> dict[str, Callable]:
    """The updater methods SGLang calls for each update, with our wrapper: distributed updates are one method up to
    0.5.20 and a receive plus a load from 0.5.21 (:func:`sglang_fp8rl.compat.updates.splits_distributed_update`)."""
    entry_points = {
        "update_weights_from_tensor": weight_updater.wrap_update_from_tensor,
        "update_weights_from_disk": weight_updater.wrap_update_from_disk,
        "update_weights_from_ipc": weight_updater.wrap_update_from_ipc,
    }
    if updates.splits_distributed_update():
        entry_points["receive_weights_from_distributed"] = distributed.wrap_receive_from_distributed
        entry_points["load_weights_from_distributed"] = distributed.wrap_load_from_distributed
    else:
        entry_points["update_weights_from_distributed"] = distributed.wrap_update_from_distributed
    return entry_points


def install_hooks() -> None:
    """Install all engine patches (idempotent)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.model_runner import ModelRunner

    install_server_args_hooks()
    install_log_filter()
    patch(ModelConfig, "_verify_quantization", model_config.wrap_verify_quantization)
    patch(ModelRunner, "load_model", model_runner.wrap_load_model)
    patch(ModelRunner, runtime.attention_backend_init(), kv_cache.wrap_init_attention_backends)
    patch(ModelRunner, runtime.graph_capture_init(), kv_cache.wrap_init_cuda_graphs)
    patch(MHATokenToKVPool, "set_kv_buffer", kv_cache.wrap_set_kv_buffer)
    for name, wrap in update_entry_points().items():
        patch(updates.updater_class(), name, wrap)
    try:
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.managers.tp_worker import TpModelWorker
    except ImportError as e:  # these modules need CUDA-only deps on some installs; the guards above still hold
        logger.warning("[fp8rl] scheduler/tokenizer patches unavailable (telemetry, refusal while inconsistent): %s", e)
        return
    decode = updates.deserialize_method_name()
    if decode is None:
        patch(TpModelWorker, "update_weights_from_tensor", weight_updater.wrap_worker_update_from_tensor)
    else:
        patch(TpModelWorker, decode, weight_updater.wrap_deserialize_own_rank)
    for name in ("update_weights_from_tensor", "update_weights_from_disk", "update_weights_from_distributed"):
        patch(updates.scheduler_update_owner(), name, kv_cache.wrap_scheduler_update)
    if updates.has_update_sessions():
        patch(updates.scheduler_update_owner(), "begin_weight_update", sessions.wrap_begin)
        patch(updates.scheduler_update_owner(), "end_weight_update", sessions.wrap_end)
    patch(*updates.flush_request_handler(), sessions.wrap_flush_request)
    patch(updates.memory_occupation_owner(), "release_memory_occupation", memory.wrap_release)
    patch(updates.memory_occupation_owner(), "resume_memory_occupation", memory.wrap_resume)
    if updates.flush_after_update_asserts():
        patch(updates.scheduler_update_owner(), "flush_cache_after_weight_update", kv_cache.wrap_flush_after_update)
    patch(Scheduler, "on_idle", kv_cache.wrap_on_idle)
    patch(Scheduler, "get_internal_state", scheduler.wrap_internal_state)
    patch(Scheduler, "handle_generate_request", scheduler.wrap_generate)
    for name in tokenizer.UPDATE_METHODS:
        patch(TokenizerManager, name, tokenizer.wrap_update_answer)
