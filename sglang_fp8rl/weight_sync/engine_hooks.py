"""Patches that connect :mod:`sglang_fp8rl.weight_sync.update` to SGLang's engine (installed by the plugin).

* ``ModelRunner.load_model``: after loading, guard ``model.load_weights`` of models served with
  `fp8_online_blockwise` (all update paths end there).
* ``WeightUpdater`` (the ModelRunner component behind every update endpoint): turn our rejections into
  ``(False, message)`` answers with an accurate message, validate flattened-bucket metadata before SGLang slices the
  buffer, and validate a disk checkpoint in a first streaming pass before SGLang's own pass writes anything.
* ``Scheduler.get_internal_state``: add our telemetry under ``"fp8rl"`` (so it appears in ``/get_server_info``).
* ``Scheduler.handle_generate_request``: while an update failed after writing started (weights are a mix), every
  generation request is finished with an error and health-check requests get no answer (so ``/health`` and
  ``/health_generate`` report 503) until a complete update succeeds.

Every patch is idempotent and leaves models that do not use this package untouched.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable, Optional

import torch

from sglang_fp8rl.kernels import gemm_select, jit_warmup
from sglang_fp8rl.weight_sync.update import (
    GuardedLoadWeights,
    PartialUpdateError,
    UpdateRejected,
    attach,
    engine_state,
    is_attached,
    last_update_stats,
    validate_stream,
)

logger = logging.getLogger(__name__)

_MARK = "_fp8rl_patched"


def _patch(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


# ---------------------------------------------------------------------------------------------------------------------
# ModelRunner


def ranks_on_node(server_args: Any) -> int:
    """Model ranks sharing this node's CPUs (tensor x pipeline parallel over the nodes)."""
    tp, pp = getattr(server_args, "tp_size", 1) or 1, getattr(server_args, "pp_size", 1) or 1
    return max(1, tp * pp // max(1, getattr(server_args, "nnodes", 1) or 1))


def _wrap_load_model(original: Callable) -> Callable:
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if attach(self.model):
            logger.info("[fp8rl] weight updates of this model are validated and re-quantized in place")
            server_args = getattr(self, "server_args", None)
            gemm_select.prepare_model(  # before CUDA graphs are captured
                self.model,
                capture_ms=jit_warmup.capture_token_counts(server_args),
                ranks_on_node=ranks_on_node(server_args),
            )
        return result

    return load_model


# ---------------------------------------------------------------------------------------------------------------------
# WeightUpdater


def answer_rejection(error: Exception) -> tuple[bool, str]:
    """The (success, message) answer for an update we refused or that failed part-way."""
    if isinstance(error, UpdateRejected):
        return False, f"[fp8rl] update rejected, nothing was written, previous weights kept: {error}"
    return False, f"[fp8rl] {error}"


def _wrap_update(original: Callable) -> Callable:
    def update(self, *args, **kwargs):
        updates_before = engine_state().updates
        try:
            success, message = original(self, *args, **kwargs)
        except (UpdateRejected, PartialUpdateError) as e:
            return answer_rejection(e)
        if not success and engine_state().updates > updates_before:
            # SGLang's distributed path catches every exception and says "partially updated"; say what happened
            last = engine_state().last
            if last is not None and not last.ok:
                rejected = UpdateRejected(last.message) if engine_state().consistent else PartialUpdateError(last.message)
                return answer_rejection(rejected)
        return success, message

    return update


def check_bucket_metadata(flattened: torch.Tensor, metadata: list) -> None:
    """Reject a flattened bucket whose metadata does not fit its buffer (e.g. a truncated bucket)."""
    size = flattened.numel() * flattened.element_size()
    for meta in metadata:
        nbytes = int(torch.Size(meta.shape).numel()) * torch.empty((), dtype=meta.dtype).element_size()
        if not 0 <= meta.start_idx <= meta.end_idx <= size:
            raise UpdateRejected(
                f"{meta.name}: bucket bytes [{meta.start_idx}, {meta.end_idx}) lie outside the {size}-byte buffer "
                "(truncated bucket?)"
            )
        if meta.end_idx - meta.start_idx != nbytes:
            raise UpdateRejected(
                f"{meta.name}: bucket holds {meta.end_idx - meta.start_idx} bytes but shape {tuple(meta.shape)} "
                f"of {meta.dtype} needs {nbytes}"
            )


def _wrap_flattened_bucket(original: Callable) -> Callable:
    def update_from_bucket(self, flattened_tensor_bucket_dict, *args, **kwargs):
        if is_attached(self.get_model()):
            check_bucket_metadata(
                flattened_tensor_bucket_dict["flattened_tensor"], list(flattened_tensor_bucket_dict["metadata"])
            )
        return original(self, flattened_tensor_bucket_dict, *args, **kwargs)

    return update_from_bucket


def validate_checkpoint_on_disk(updater, model_path: str, load_format: str,
                                weight_name_filter: Optional[Callable[[str], bool]]) -> int:
    """Stream a checkpoint through validation with SGLang's own loader and weight iterator; nothing is written."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    model_config = copy.copy(updater.model_config)
    model_config.model_path = model_path
    loader = get_model_loader(LoadConfig(load_format=load_format), model_config)
    if not isinstance(loader, DefaultModelLoader):
        return 0  # SGLang itself refuses this case with a clear message
    model = updater.get_model()
    weights = loader._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, model))
    if weight_name_filter is not None:
        weights = ((name, w) for name, w in weights if weight_name_filter(name))
    return validate_stream(model, weights)


def _wrap_update_from_disk(original: Callable) -> Callable:
    def update_from_disk(self, model_path, load_format, *args, **kwargs):
        weight_name_filter = kwargs.get("weight_name_filter", args[0] if args else None)
        if is_attached(self.get_model()):
            try:
                count = validate_checkpoint_on_disk(self, model_path, load_format, weight_name_filter)
            except UpdateRejected as e:
                return answer_rejection(e)
            except (OSError, RuntimeError, ValueError) as e:
                return False, f"[fp8rl] cannot read checkpoint {model_path!r}, nothing was written: {e}"
            logger.info("[fp8rl] disk checkpoint %s validated (%d tensors); loading", model_path, count)
        return original(self, model_path, load_format, *args, **kwargs)

    return update_from_disk


# ---------------------------------------------------------------------------------------------------------------------
# Scheduler telemetry


def telemetry(model: Optional[torch.nn.Module]) -> dict[str, Any]:
    """Our state for /get_server_info: update count, last update, consistency, per-scheme layer counts."""
    state = engine_state()
    report = None
    if model is not None:
        for module in model.modules():
            config = getattr(getattr(module, "quant_method", None), "quant_config", None)
            if config is not None and hasattr(config, "report"):
                report = config.report.as_dict()
                break
    fp8_ptrs = [p.data_ptr() for p in model.parameters() if p.dtype == torch.float8_e4m3fn] if model else []
    return {
        "fp8_param_ptr_digest": hash(tuple(fp8_ptrs)),
        "updates": state.updates,
        "consistent": state.consistent,
        "inconsistent_reason": state.inconsistent_reason,
        "last_update": last_update_stats(),
        "schemes": report,
    }


def _wrap_internal_state(original: Callable) -> Callable:
    def get_internal_state(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        model = getattr(getattr(getattr(self, "tp_worker", None), "model_runner", None), "model", None)
        if model is not None and is_attached(model):
            # 0.5.17 returns GetInternalStateReqOutput(internal_state=dict); older versions a plain dict
            state = result.internal_state if hasattr(result, "internal_state") else result
            state["fp8rl"] = telemetry(model)
        return result

    return get_internal_state


def refusal_message() -> str:
    """What a generation request gets while the weights are a mix of two updates."""
    return (
        "[fp8rl] refusing to serve: the engine holds a partially applied weight update "
        f"({engine_state().inconsistent_reason}); send a complete weight update first"
    )


def _wrap_generate(original: Callable) -> Callable:
    def handle_generate_request(self, recv_req):
        if engine_state().consistent:
            return original(self, recv_req)
        from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

        if str(recv_req.rid).startswith(HEALTH_CHECK_RID_PREFIX):
            return None  # no answer: /health and /health_generate time out and report 503
        result = original(self, recv_req)
        abort_queued_request(self.waiting_queue, recv_req.rid, refusal_message())
        return result

    return handle_generate_request


def abort_queued_request(queue: list, rid: str, message: str) -> bool:
    """Finish a just-queued request with an error instead of running it (SGLang's own abort path)."""
    for req in reversed(queue):
        if req.rid == rid:
            req.set_finish_with_abort(message)
            return True
    return False


def install_weight_update_hooks() -> None:
    """Install all engine patches (idempotent)."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    _patch(ModelRunner, "load_model", _wrap_load_model)
    for name in ("update_weights_from_tensor", "update_weights_from_distributed"):
        _patch(WeightUpdater, name, _wrap_update)
    _patch(WeightUpdater, "_update_weights_from_flattened_bucket", _wrap_flattened_bucket)
    _patch(WeightUpdater, "update_weights_from_disk", _wrap_update_from_disk)
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError as e:  # the scheduler module needs CUDA-only deps on some installs; telemetry is optional
        logger.warning("[fp8rl] /get_server_info telemetry unavailable: %s", e)
        return
    _patch(Scheduler, "get_internal_state", _wrap_internal_state)
    _patch(Scheduler, "handle_generate_request", _wrap_generate)


__all__ = ["install_weight_update_hooks", "telemetry", "check_bucket_metadata", "GuardedLoadWeights"]
