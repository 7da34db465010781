"""The guard on ``model.load_weights``, for callers that bypass SGLang's update entry points.

SGLang's entry points validate and write through the pipeline (:mod:`sglang_fp8rl.weight_sync.pipeline`) and read the
model's own ``load_weights`` behind this guard (:func:`original_load_weights`). Everything else that calls
``load_weights`` (checkpoint-engine IPC, user code) gets :class:`GuardedLoadWeights`: the request is collected,
validated and written here, rank-locally. A failure *after* writing started is a device error (the content was
validated), reported as :class:`PartialUpdateError`, and the names it was writing stay dirty (engine_state.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch

from sglang_fp8rl.layers.fp8_storage import layer_state
from sglang_fp8rl.weight_sync.engine_state import engine_state
from sglang_fp8rl.weight_sync.fp8_payload import attach_scales, pair_stream
from sglang_fp8rl.weight_sync.request import validate_request
from sglang_fp8rl.weight_sync.telemetry import new_stats, record
from sglang_fp8rl.weight_sync.validate import UpdateRejected
from sglang_fp8rl.weight_sync.write import apply_validated

WRITE_ERRORS = (RuntimeError, ValueError, AssertionError, TypeError, IndexError, KeyError, torch.cuda.OutOfMemoryError)


class PartialUpdateError(RuntimeError):
    """A weight update failed after writing started: the engine holds a mix of old and new weights."""


@contextlib.contextmanager
def validated_stream(model: torch.nn.Module) -> Iterator[None]:
    """Inside this block, the model's guarded ``load_weights`` streams its input straight through: the caller (the
    disk path's second pass) validated all of it beforehand."""
    guard = model.__dict__["load_weights"]
    guard.streaming_validated = True
    try:
        yield
    finally:
        guard.streaming_validated = False


class GuardedLoadWeights:
    """Replacement for ``model.load_weights`` once the model is loaded.

    SGLang's update entry points validate and write through :mod:`sglang_fp8rl.weight_sync.pipeline`; this guard is
    for everything else that calls ``load_weights`` (checkpoint-engine IPC, user code): the request is collected,
    validated and written here, rank-locally, raising :class:`UpdateRejected` or :class:`PartialUpdateError`."""

    def __init__(self, model: torch.nn.Module, original: Callable):
        self.model = model
        self.original = original
        self.streaming_validated = False  # set by validated_stream() around a pass it validated itself

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        if self.streaming_validated:
            return self.original(pair_stream(weights))
        return self.update(list(weights))

    def update(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Validate, then write one request (rank-local)."""
        stats = new_stats("load_weights")
        stats.count(named_tensors)
        try:
            validated = validate_request(self.model, self.original, attach_scales(named_tensors))
        except UpdateRejected as e:
            stats.message = str(e)
            record(stats)
            raise
        stats.add(validated)
        names = validated.names
        try:
            apply_validated(self.model, self.original, validated)
        except WRITE_ERRORS as e:
            reason = f"update #{stats.index} failed after writing started: {type(e).__name__}: {e}"
            engine_state().mark_dirty(names, reason)
            stats.message = reason
            record(stats)
            raise PartialUpdateError(f"{reason}. The engine holds a mix of old and new weights; "
                                     "re-send those tensors before serving again.") from e
        engine_state().mark_written(names, agreed=False)  # rank-local: the caller's agreement comes after (guard)
        stats.ok, stats.message = True, "ok"
        record(stats)


def is_attached(model: torch.nn.Module) -> bool:
    """Whether the model's load_weights is guarded."""
    return isinstance(model.__dict__.get("load_weights"), GuardedLoadWeights)


def original_load_weights(model: torch.nn.Module) -> Callable:
    """The model's own load_weights, behind our guard."""
    guard = model.__dict__.get("load_weights")
    return guard.original if isinstance(guard, GuardedLoadWeights) else model.load_weights


def attach(model: torch.nn.Module) -> bool:
    """Guard ``model.load_weights`` if the model has layers quantized by this package; returns whether it did."""
    if is_attached(model):
        return True
    if not any(layer_state(m) is not None for m in model.modules()):
        return False
    model.load_weights = GuardedLoadWeights(model, model.load_weights)
    return True
