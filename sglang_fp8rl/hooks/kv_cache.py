"""FP8 KV-cache scales on the engine (``--fp8rl-kv-scales calibrate``): set up after load, made CUDA-graph safe before
capture, calibrated after capture, and recalibrated after every complete weight update while the engine is idle.

* ``ModelRunner.load_model`` (via :mod:`.model_runner`): resolve the mode, choose the calibration batch.
* ``ModelRunner.init_attention_backends``: on a backend where recalibration was verified (FlashAttention-3, Triton,
  FlashInfer; torch-native on CPU), scale tensors on every attention layer, and the decode fold
  (kv_scales/decode_fold.py) where the backend passes Python-float scales to its decode kernels, before any graph is
  captured. Elsewhere ``auto`` falls back to static scales and an explicit ``calibrate`` is refused at start. The
  scales in force then are the ones every calibration runs under. Then the FP8-KV decode attention
  (:mod:`.attention`).
* ``ModelRunner.init_cuda_graphs``: the load-time calibration (the pools are still empty); if it fails on any TP
  rank, the start fails on every rank.
* ``MHATokenToKVPool.set_kv_buffer``: K/V saturated at +-448 after the division by their scales (an overflowing E4M3
  cast gives NaN on CUDA); with ``--fp8rl-kv-write fused`` (the default), on CUDA, one kernel per layer does the
  division, clamp, cast and store.
* ``SchedulerWeightUpdaterManager.update_weights_from_*``: after SGLang answered and flushed, if the update completed a
  step, the TP ranks agree that each is idle with enough free KV slots, then recalibrate together, agreeing again
  after every stage; otherwise, or if any stage failed on any rank, every rank keeps its previous scales and the skip
  is counted (``deferred`` in the telemetry).
* ``flush_cache_after_weight_update`` (up to 0.5.21) and ``Scheduler.on_idle``: a flush refused while requests run is
  remembered (:class:`CacheState`) and run when the engine is idle.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, Optional

import torch

from sglang_fp8rl.compat import updates
from sglang_fp8rl.compat.kv_pool import (
    kv_pool_layout,
    kv_pool_quantized,
    kv_write_location,
    kv_write_overrides,
    stores_kv_like_mha,
)
from sglang_fp8rl.compat.runtime import ready_for_forward
from sglang_fp8rl.engine import OWNERS, declare
from sglang_fp8rl.hooks.attention import install_decode_attention
from sglang_fp8rl.kv_scales import resolve_kv_scale_mode
from sglang_fp8rl.kv_scales.calibrate import recalibrate
from sglang_fp8rl.kv_scales.decode_fold import decode_backend, install_decode_fold, unverified_reason
from sglang_fp8rl.kv_scales.engine import batch_within, calibration_batch, kv_state, mark_calibrated, set_up
from sglang_fp8rl.kv_scales.forward import TPStages
from sglang_fp8rl.kv_scales.layers import attach_scales, read_scales
from sglang_fp8rl.kv_scales.numerics import saturating_scale_
from sglang_fp8rl.parallel import Verdict, agree, tp_device_group
from sglang_fp8rl.server_args import get_options
from sglang_fp8rl.weight_sync.engine_state import EVERYTHING, engine_state
from sglang_fp8rl.weight_sync.load_guard import is_attached

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CacheState:
    """This hook's own state in this process, ``OWNERS.kv_cache`` (:mod:`sglang_fp8rl.engine`)."""

    flush_due: bool = False  # an update's cache flush was refused while requests ran: flushed when idle
    logged_write_paths: set[Optional[str]] = dataclasses.field(default_factory=set)  # K/V write paths logged once


declare("kv_cache", CacheState)


def cache_state() -> CacheState:
    """This process's cache-hook state: ``OWNERS.kv_cache``."""
    return OWNERS.kv_cache


def set_up_kv_scales(runner: Any) -> None:
    """After load: the mode in force and, when calibrating, the calibration batch."""
    args = runner.server_args
    option = get_options().kv_scales
    mode = resolve_kv_scale_mode(option, str(getattr(args, "kv_cache_dtype", "auto")),
                                 getattr(args, "quantization", None))
    if mode != "calibrate":
        set_up(mode, [], "")
        return
    tokenizer = None if getattr(args, "skip_tokenizer_init", False) and not args.tokenizer_path else \
        (args.tokenizer_path or args.model_path)
    ids, source = calibration_batch(get_options().kv_calibration, tokenizer, runner.model_config.vocab_size,
                                    runner.model_config.context_len)
    set_up(mode, ids, source, explicit=option == "calibrate", fused_write=get_options().kv_write == "fused")


def calibrate_now(runner: Any) -> None:
    """Measure and write the KV scales (every TP rank together; the batch fits the free KV slots). A failure on any
    rank raises on every rank, each with its previous scales in force (kv_scales/forward.TPStages)."""
    state = kv_state()
    group = tp_device_group()
    ids = TPStages(tp=group is not None).run("while fitting the batch to the free KV slots", _fitted_batch, runner)
    recalibrate(runner, ids, state.policy, group, under=state.calibrated_under or None)


def _fitted_batch(runner: Any) -> list[list[int]]:
    ids = batch_within(kv_state().token_ids, runner.token_to_kv_pool_allocator.available_size(),
                       runner.req_to_token_pool.available_size())
    ready_for_forward(runner)
    return ids


def unsupported_setup(args: Any) -> Optional[str]:
    """Why this server's setup cannot use calibrated scales (paths the decode fold and the calibration do not cover)."""
    if getattr(args, "speculative_algorithm", None):
        return "speculative decoding (its captured target-verify passes float scales)"
    if getattr(args, "enable_torch_compile", False):
        return "--enable-torch-compile (the fold inside a compiled decode is untested)"
    if getattr(args, "enable_dp_attention", False):
        return "DP attention (not covered by the calibration forward)"
    if getattr(args, "quantization_param_path", None):
        return "--quantization-param-path (SGLang's own KV scales)"
    return None


def use_backend(runner: Any) -> None:
    """Calibrated scales on a verified backend: scale tensors on every attention layer and, where the backend passes
    float scales to its decode kernels, the fold. Elsewhere: an error if the user asked for calibrate, else static."""
    state = kv_state()
    reason = unsupported_setup(runner.server_args) or unverified_reason(runner.attn_backend)
    if reason is not None:
        if state.explicit:
            raise ValueError(f"--fp8rl-kv-scales calibrate: {reason}")
        state.mode = "static"
        logger.warning("[fp8rl] KV scales: static (SGLang's), not calibrated: %s", reason)
        return
    state.calibrated_under = read_scales(attach_scales(runner.model, torch.device(runner.device)))
    install_decode_fold(runner.attn_backend)  # before any CUDA graph is captured
    logger.info("[fp8rl] KV scales: calibrated on the engine (%d tokens of %s), attention backend %s",
                sum(map(len, state.token_ids)), state.batch_source, type(decode_backend(runner.attn_backend)).__name__)


def wrap_init_attention_backends(original: Callable) -> Callable:
    """ModelRunner.init_attention_backends, then the KV scales on the backend (use_backend) and the FP8-KV decode
    attention kernel (hooks/attention.py)."""
    def init_attention_backends(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if kv_state().calibrating:
            use_backend(self)
        install_decode_attention(self)
        return result

    return init_attention_backends


def wrap_init_cuda_graphs(original: Callable) -> Callable:
    """ModelRunner.init_cuda_graphs, then the load-time calibration."""
    def init_cuda_graphs(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if kv_state().calibrating:
            calibrate_now(self)
        return result

    return init_cuda_graphs


def ready_to_calibrate(manager: Any, runner: Any) -> Verdict:
    """This rank is idle with its cache flushed and enough free KV slots for the calibration batch."""
    if not manager.flush_cache():
        return Verdict(False, "requests are running")
    try:
        batch_within(kv_state().token_ids, runner.token_to_kv_pool_allocator.available_size(),
                     runner.req_to_token_pool.available_size())
    except ValueError as e:
        return Verdict(False, str(e))
    return Verdict(True)


def recalibrate_if_due(manager: Any) -> None:
    """Recalibrate when a step that needs new scales ended and every rank is ready (idle, cache flushed, enough free
    KV slots). Otherwise the previous scales stay and the recalibration stays due: it is retried after the next
    update answer and whenever the scheduler is idle (:func:`wrap_on_idle`). It also waits while SGLang's memory
    saver holds any GPU memory released, or the weights were resumed without their bytes (hooks/memory.py): the
    calibration forward reads every weight and writes the KV pool (every rank knows both alike). Never raises: this
    runs in SGLang's scheduler loop."""
    state = kv_state()
    if not (state.calibrating and state.due) or engine_state().released or EVERYTHING in engine_state().dirty:
        return
    try:
        calibrated = _recalibrate_when_ready(manager)
    except Exception as e:  # noqa: BLE001 - the boundary to SGLang's scheduler: nothing may escape
        state.deferred += 1
        logger.warning("[fp8rl] KV recalibration failed, the previous scales stay: %s: %s", type(e).__name__, e)
        return
    if calibrated:
        mark_calibrated()


def _recalibrate_when_ready(manager: Any) -> bool:
    """Recalibrate if every rank is ready; False (the skip counted and logged) if one is not. Every rank makes the
    same agreements whatever fails where: a rank that failed its readiness check still answers the others."""
    state = kv_state()
    runner = manager.tp_worker.model_runner
    try:
        local = ready_to_calibrate(manager, runner)
    except Exception as e:  # noqa: BLE001 - a rank-local failure must still reach the agreement below
        local = Verdict(False, f"checking that the engine is idle failed: {type(e).__name__}: {e}")
    verdict = agree(local)
    if not verdict.ok:
        state.deferred += 1
        logger.warning("[fp8rl] KV scales not recalibrated yet (%s); the previous scales stay until the engine is "
                       "idle", verdict.message)
        return False
    calibrate_now(runner)
    return True


def fused_write_reason(pool: Any, layer_index: int, k: Any, v: Any, k_scale: Any, v_scale: Any, loc: Any,
                       extra: dict) -> Optional[str]:
    """Why this K/V write cannot take the one-launch kernel (kernels/kv_store.py); None when it can."""
    if not kv_state().fused_write:
        return "--fp8rl-kv-write sglang"
    if kv_state().policy.scale_format != "pow2":
        return "KV scale format is not pow2 (the kernel is bit-exact for power-of-two scales)"
    if any(value is not None for value in extra.values()) or kv_pool_quantized(pool):
        return "a DCP mask, a layer override or an FP4 cache"
    if kv_pool_layout(pool) != "nhd":
        return f"KV cache layout {kv_pool_layout(pool)!r} (the kernel writes NHD rows)"
    if not stores_kv_like_mha(pool):
        return f"{type(pool).__name__} stores its layers its own way"
    if _async_asserts_on():
        return "SGLANG_ENABLE_ASYNC_ASSERT (SGLang's out-of-range slot check runs only on its own path)"
    from sglang_fp8rl.kernels.kv_store import cannot_store  # Triton: imported only when the option asks for it

    return cannot_store(k, v, k_scale, v_scale, pool.k_buffer[layer_index], pool.v_buffer[layer_index], loc)


def _async_asserts_on() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_ENABLE_ASYNC_ASSERT.get())


def _log_write_path(reason: Optional[str]) -> None:
    logged = OWNERS.kv_cache.logged_write_paths  # every K/V write asks: no accessor call on this path
    if reason not in logged:
        logged.add(reason)
        if reason is None:
            logger.info("[fp8rl] FP8 KV writes: one fused kernel per layer (scale, saturate, cast, store)")
        else:
            logger.info("[fp8rl] FP8 KV writes: SGLang's path with a saturating division (%s)", reason)


def write_fused(pool: Any, arguments: dict) -> bool:
    """Write a call's K/V with the one-launch kernel where it can run; False, with nothing written, where not."""
    layer, loc = arguments.get("layer"), kv_write_location(arguments)
    if layer is None or loc is None:
        _log_write_path("a call without a layer object or write location")
        return False
    index = layer.layer_id - pool.start_layer
    k, v, k_scale, v_scale = (arguments[name] for name in ("cache_k", "cache_v", "k_scale", "v_scale"))
    reason = fused_write_reason(pool, index, k, v, k_scale, v_scale, loc, kv_write_overrides(arguments))
    _log_write_path(reason)
    if reason is not None:
        return False
    from sglang_fp8rl.kernels.kv_store import store_scaled_fp8

    store_scaled_fp8(k, v, k_scale, v_scale, pool.k_buffer[index], pool.v_buffer[index], loc)
    return True


def wrap_set_kv_buffer(original: Callable) -> Callable:
    """MHATokenToKVPool.set_kv_buffer with calibrated scales: K/V divided by their scale tensors in place, as SGLang
    does, and saturated at +-448 before SGLang's own cast and store (an overflowing E4M3 cast gives NaN on CUDA); with
    ``--fp8rl-kv-write fused``, all of it in one kernel where it can run (:func:`write_fused`)."""
    signature = inspect.signature(original)

    def set_kv_buffer(self, *args, **kwargs):
        if not (kv_state().calibrating and self.dtype == torch.float8_e4m3fn):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        cache_k, cache_v = arguments["cache_k"], arguments["cache_v"]
        k_scale, v_scale = arguments.get("k_scale"), arguments.get("v_scale")
        if cache_k.dtype == self.dtype or not (isinstance(k_scale, torch.Tensor) and isinstance(v_scale, torch.Tensor)):
            return original(*bound.args, **bound.kwargs)
        if kv_state().fused_write and write_fused(self, arguments):
            return None
        saturating_scale_(cache_k, k_scale)
        saturating_scale_(cache_v, v_scale)
        arguments["k_scale"] = arguments["v_scale"] = None  # divided already
        return original(*bound.args, **bound.kwargs)

    return set_kv_buffer


def wrap_scheduler_update(original: Callable) -> Callable:
    """SchedulerWeightUpdaterManager.update_weights_from_*: SGLang's answer (and flush), then a due recalibration."""
    def update(self, recv_req):
        output = original(self, recv_req)
        if getattr(output, "success", False):
            recalibrate_if_due(self)
        return output

    return update


def wrap_flush_after_update(original: Callable) -> Callable:
    """flush_cache_after_weight_update up to 0.5.21 (which asserts the flush): a flush refused because requests run
    (SGLang's in-place pause) no longer kills the scheduler; it is logged and retried when the engine is idle (the
    running requests keep their own KV; a due recalibration waits for the same idle moment)."""
    def flush_cache_after_weight_update(self, recv_req, *args, **kwargs):
        if not is_attached(self.tp_worker.model_runner.model):
            return original(self, recv_req, *args, **kwargs)
        empty_cache = getattr(recv_req, "torch_empty_cache", False)  # SGLang's own call passes it
        if getattr(recv_req, "flush_cache", False) and not self.flush_cache(empty_cache=empty_cache):
            cache_state().flush_due = True
            logger.warning("[fp8rl] the cache was not flushed after this update (requests are running); it is "
                           "flushed as soon as the engine is idle")
        return None

    return flush_cache_after_weight_update


def wrap_on_idle(original: Callable) -> Callable:
    """Scheduler.on_idle: SGLang's idle housekeeping, then a cache flush and a recalibration left due because requests
    were running (every TP rank polls this in step; it costs two flag checks when nothing is due)."""
    def on_idle(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = cache_state()
        if (state.flush_due or kv_state().due) and self.is_fully_idle():
            manager = updates.scheduler_update_manager(self)
            if state.flush_due and manager.flush_cache():
                state.flush_due = False
            recalibrate_if_due(manager)
        return result

    return on_idle
