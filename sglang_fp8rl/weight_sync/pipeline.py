"""The engine side of one weight update, from the tensors a hook obtained to SGLang's answer.

Each SGLang entry point's hook (hooks/weight_updater.py, hooks/distributed.py) decodes its transport
(hooks/transport.py) and hands the rest to one function here, which runs :func:`sglang_fp8rl.weight_sync.guard.run`
with this module's prepare and write:

* :func:`run`, a request of named tensors (``update_weights_from_tensor``, ``update_weights_from_distributed``):
  SGLang's own refusals first (:func:`check_sglang_preconditions`), the hook's ``obtain``, then
  :func:`prepared_request` (nothing is written); the write is :func:`writer`'s;
* :func:`run_checkpoint`, a checkpoint on disk: streamed through validation, then written by SGLang's own second pass
  straight through the model's guard (:func:`~sglang_fp8rl.weight_sync.load_guard.validated_stream`);
* :func:`run_ipc`, checkpoint-engine IPC: SGLang's method runs, its ``load_weights`` calls are validated by the
  model's guard (load_guard.py) and the ranks agree at the end (:func:`guard.run_unvalidated`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS as WEIGHTS

from sglang_fp8rl.compat.updates import assert_weight_cache_inactive, derived_weight_cache_error
from sglang_fp8rl.weight_sync import guard
from sglang_fp8rl.weight_sync.engine_state import engine_state
from sglang_fp8rl.weight_sync.fp8_payload import attach_scales, pair_stream, split_control
from sglang_fp8rl.weight_sync.halves import check_held_halves
from sglang_fp8rl.weight_sync.kv_updates import prepare_kv_scales, split_kv_scales, write_kv_scales
from sglang_fp8rl.weight_sync.load_guard import is_attached, original_load_weights, validated_stream
from sglang_fp8rl.weight_sync.protocol import STEP_COMPLETE
from sglang_fp8rl.weight_sync.request import validate_request, validate_stream
from sglang_fp8rl.weight_sync.step import current_step
from sglang_fp8rl.weight_sync.validate import NamedTensors, UpdateRejected, request_bytes
from sglang_fp8rl.weight_sync.write import apply_validated

logger = logging.getLogger(__name__)

Weights = Iterator[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------------------------------
# SGLang's preconditions


def weights_released_error() -> Optional[str]:
    """Why a weight update cannot be written now (SGLang's memory saver released the weights), or None."""
    if WEIGHTS not in engine_state().released:
        return None
    return ("the model's weights are released (/release_memory_occupation): their GPU memory is not mapped, so "
            "nothing can be written to it; resume them first (/resume_memory_occupation with tags [\"weights\"]), "
            "then send the update")


def check_sglang_preconditions(updater: Any, op: str) -> None:
    """SGLang's own refusals of online updates (weight cache, derived-weight caches), as rejections; and weights
    released by SGLang's memory saver, which SGLang itself would write to (hooks/memory.py)."""
    error = weights_released_error() or derived_weight_cache_error(updater)
    if error is not None:
        raise UpdateRejected(error)
    assert_weight_cache_inactive(updater, op)


def refuse_fp8_for_stock(named: NamedTensors) -> None:
    """A model this package does not serve takes SGLang's own updates: no pre-quantized FP8 for it."""
    for name, tensor in named:
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float8_e4m3fn:
            raise UpdateRejected(f"{name}: pre-quantized FP8 updates need a model served with "
                                 "--quantization fp8_online_blockwise")


# ---------------------------------------------------------------------------------------------------------------------
# a request of named tensors


def prepared_request(model: torch.nn.Module, named: NamedTensors, validate_only: bool = False) -> guard.Prepared:
    """Validate a request of named tensors, pre-quantized FP8, KV scales and control entries included (nothing is
    written)."""
    weights, control = split_control(named)
    weights, kv_entries = split_kv_scales(weights)
    step = current_step()
    ends_step = STEP_COMPLETE in control and not step.session  # in a session a marker is only noted: its end ends it
    pairing = step.pairing(weights, validate_only=validate_only, ends_step=ends_step)
    load_weights = original_load_weights(model)
    check_held_halves(model, load_weights, pairing.hold)
    validated = validate_request(model, load_weights, attach_scales(pairing.named))
    return guard.Prepared(validated, tensors=len(weights), bytes=request_bytes(weights), validate_only=validate_only,
                          step_complete=STEP_COMPLETE in control, kv_scales=prepare_kv_scales(model, kv_entries),
                          pairing=pairing)


def writer(model: torch.nn.Module) -> Callable[[guard.Prepared], None]:
    """Write a prepared request through the model's own loaders, then its KV scales (the guard then ends the step if
    the request completed it)."""
    def write(prepared: guard.Prepared) -> None:
        apply_validated(model, original_load_weights(model), prepared.validated)
        if prepared.kv_scales:
            write_kv_scales(model, prepared.kv_scales)

    return write


def run(model: torch.nn.Module, source: str, updater: Any, op: str, obtain: Callable[[], NamedTensors],
        validate_only: bool = False, refused: Optional[str] = None) -> tuple[bool, str]:
    """One request of named tensors through the guard; SGLang's ``(success, message)``. ``obtain``: the request's
    tensors from their transport (it raises UpdateRejected for a payload it cannot decode); ``refused``: the
    transport's own refusal, known before anything else (a broadcast received and dropped)."""
    served = is_attached(model)  # a model we do not serve gets here only with a validate-only request

    def prepare() -> guard.Prepared:
        if refused is not None:
            raise UpdateRejected(refused)
        check_sglang_preconditions(updater, op)
        named = obtain()
        if not served:
            refuse_fp8_for_stock(named)
        return prepared_request(model, named, validate_only=validate_only)

    return guard.run(model, source, prepare, writer(model), validate_only=validate_only)


# ---------------------------------------------------------------------------------------------------------------------
# a checkpoint on disk, and checkpoint-engine IPC


def run_checkpoint(model: torch.nn.Module, updater: Any, model_path: str,
                   weights: Callable[[], ContextManager[Weights]], load: Callable[[], tuple[bool, str]],
                   filtered: bool) -> tuple[bool, str]:
    """A checkpoint update through the guard: a full validating pass over ``weights()`` (the checkpoint's tensors,
    read as SGLang reads them: hooks/transport.py), then SGLang's own loading pass (``load``) straight through the
    model's guard; SGLang's ``(success, message)``. ``filtered``: the update names only some of its tensors."""
    def prepare() -> guard.Prepared:
        check_sglang_preconditions(updater, "update_weights_from_disk")
        with weights() as stream:
            validated = validate_stream(model, original_load_weights(model), pair_stream(stream))
        logger.info("[fp8rl] disk checkpoint %s validated (%d tensors); loading", model_path, len(validated.names))
        # the step ends with any unfiltered checkpoint; only one that reaches every parameter clears what a failed
        # update left dirty (a one-tensor checkpoint would otherwise mark a half-written model consistent)
        return guard.Prepared(validated, tensors=len(validated.names), full=validated.complete,
                              step_complete=not filtered)

    def write(prepared: guard.Prepared) -> None:
        with validated_stream(model):
            ok, message = load()
        if not ok:
            raise RuntimeError(message)

    return guard.run(model, "disk", prepare, write, context=f"checkpoint {model_path!r}")


def run_ipc(model: torch.nn.Module, load: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """A checkpoint-engine IPC update: SGLang's method (``load``) drives ``load_weights`` itself; the model's guard
    validates each call rank-locally and the ranks agree on the outcome. Refused while the weights are released."""
    def call() -> tuple[bool, str]:
        released = weights_released_error()
        return (False, released) if released else load()

    return guard.run_unvalidated(model, "ipc", call)
