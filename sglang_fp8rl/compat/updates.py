"""SGLang's weight-update entry points, as each supported release lays them out.

Each function is one difference between releases: the release where it starts, and what it hides. Adapters look
for the feature itself (a module, a method) rather than compare version strings, so a post-release that backports a
change is handled too; the release named in each docstring is where the supported list first has it.
"""

from __future__ import annotations

import collections
import functools
import importlib
import io
from typing import Any, Callable, Optional

import torch


@functools.cache
def _updater_module() -> Any:
    """0.5.16+: ``model_runner_components.weight_updater``; before: the same functions in ``model_runner``."""
    try:
        return importlib.import_module("sglang.srt.model_executor.model_runner_components.weight_updater")
    except ModuleNotFoundError:
        return importlib.import_module("sglang.srt.model_executor.model_runner")


def updater_class() -> type:
    """The class whose ``update_weights_*`` methods SGLang calls: ``WeightUpdater`` from 0.5.16, ``ModelRunner``
    before (one object then held both the model and its update methods)."""
    module = _updater_module()
    return getattr(module, "WeightUpdater", None) or module.ModelRunner


def updater_model(updater: Any) -> torch.nn.Module:
    """The served model: ``WeightUpdater.get_model()`` from 0.5.16, ``ModelRunner.model`` before."""
    get_model = getattr(updater, "get_model", None)
    return get_model() if callable(get_model) else updater.model


def updater_tp_rank(updater: Any) -> int:
    """This rank's TP index: the updater's ``tp_rank`` up to 0.5.23 (``get_parallel().tp_rank`` is what 0.5.21+
    reads itself; both agree outside draft-model scopes, which this package does not serve)."""
    return int(updater.tp_rank)


def local_serialized_tensor_type() -> type:
    """``LocalSerializedTensor`` (one payload per TP rank): defined beside the update methods in every release."""
    return _updater_module().LocalSerializedTensor


def unwrap_tensor(updater: Any, tensor: Any) -> torch.Tensor:
    """This rank's tensor of a request item, on the updater's device, as SGLang's own method obtains it."""
    device = torch.get_device_module(updater.device).current_device()
    return _updater_module()._unwrap_tensor(tensor, tp_rank=updater_tp_rank(updater), device=device)


def derived_weight_cache_error(updater: Any) -> Optional[str]:
    """SGLang's refusal of updates that a derived-weight cache would not follow: none before 0.5.17; no argument in
    0.5.17-0.5.20; the model as argument from 0.5.21 (model-owned caches declare it)."""
    check = getattr(_updater_module(), "_unsupported_derived_weight_cache_error", None)
    if check is None:
        return None
    try:
        return check(updater_model(updater))
    except TypeError:  # 0.5.17-0.5.20: takes no argument
        return check()


def assert_weight_cache_inactive(updater: Any, op: str) -> None:
    """SGLang's refusal while its CUDA IPC weight cache is active (``--weight-cache-mode``): from 0.5.17."""
    check = getattr(updater, "_assert_weight_cache_inactive", None)
    if check is not None:
        check(op)


def has_update_sessions() -> bool:
    """0.5.21+: tensor and distributed updates run only between ``begin_weight_update`` and ``end_weight_update``."""
    return hasattr(updater_class(), "begin_weight_update")


def splits_distributed_update() -> bool:
    """0.5.21+: ``update_weights_from_distributed`` is split into ``receive_weights_from_distributed`` (the
    broadcast) and ``load_weights_from_distributed`` (the write), called by the scheduler one after the other."""
    return hasattr(updater_class(), "receive_weights_from_distributed")


def deserialize_method_name() -> Optional[str]:
    """``TpModelWorker``'s per-rank payload decoding: inline in ``update_weights_from_tensor`` up to 0.5.15 (None),
    ``_deserialize_own_rank`` in 0.5.16-0.5.20, ``deserialize_own_rank`` from 0.5.21."""
    from sglang.srt.managers.tp_worker import TpModelWorker

    for name in ("deserialize_own_rank", "_deserialize_own_rank"):
        if hasattr(TpModelWorker, name):
            return name
    return None


def scheduler_update_owner() -> type:
    """The scheduler-side class whose ``update_weights_from_*`` methods answer the HTTP requests (and flush the
    cache): ``SchedulerWeightUpdaterManager`` from 0.5.15, the ``Scheduler`` itself (a mixin) before."""
    try:
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    except ImportError:
        from sglang.srt.managers.scheduler import Scheduler

        return Scheduler
    return SchedulerWeightUpdaterManager


def memory_occupation_owner() -> type:
    """The scheduler-side class whose ``release_memory_occupation`` / ``resume_memory_occupation`` pause and resume
    SGLang's memory-saver regions and keep the released tags in ``offload_tags``: ``SchedulerWeightUpdaterManager``
    from 0.5.15, the ``Scheduler`` itself (``SchedulerUpdateWeightsMixin``) before; the same owner as the update
    answers (:func:`scheduler_update_owner`)."""
    return scheduler_update_owner()


def decode_own_rank(payloads: Any, tp_rank: int) -> Any:
    """This rank's entry of a per-rank serialized payload, decoded as SGLang decodes it (torch's reductions patched
    first, so CUDA IPC handles resolve by device UUID). Up to 0.5.15 ``TpModelWorker`` did this inline."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.deserialize(payloads[tp_rank])


def scheduler_update_manager(scheduler: Any) -> Any:
    """The scheduler's object of :func:`scheduler_update_owner` (it holds ``tp_worker`` and ``flush_cache``):
    ``scheduler.weight_updater`` from 0.5.15, the scheduler itself before."""
    manager = getattr(scheduler, "weight_updater", None)
    return manager if isinstance(manager, scheduler_update_owner()) else scheduler


def updater_of(model_runner: Any) -> Any:
    """The object with the ``update_weights_*`` methods of a ModelRunner: its ``weight_updater`` from 0.5.16, the
    ModelRunner itself before."""
    return getattr(model_runner, "weight_updater", None) or model_runner


def update_from_distributed(updater: Any, **request: Any) -> tuple[bool, str]:
    """One ``update_weights_from_distributed`` as SGLang's scheduler runs it on a rank: one updater call up to
    0.5.20; from 0.5.21 a receive and then a load (a failed receive answered, as the scheduler does). For in-process
    callers (the CPU demo and tests): the server's own path calls the same methods."""
    if not splits_distributed_update():
        return updater.update_weights_from_distributed(**request)
    try:
        weights = updater.receive_weights_from_distributed(**request)
    except Exception as e:  # noqa: BLE001 - SGLang's scheduler answers a failed receive the same way
        return False, f"Failed to receive weights: {e}"
    return updater.load_weights_from_distributed(weights)


def flush_after_update_asserts() -> bool:
    """Up to 0.5.21, ``flush_cache_after_weight_update(recv_req)`` asserts that the cache flushed, so an update
    answered while requests run (SGLang's in-place pause) kills the scheduler; from 0.5.22 it takes the answer and
    turns a failed flush into ``success=False``."""
    import inspect

    method = getattr(scheduler_update_owner(), "flush_cache_after_weight_update", None)
    return method is not None and len(inspect.signature(method).parameters) == 2  # (self, recv_req)


def flush_request_handler() -> tuple[type, str]:
    """The scheduler-side method that answers an explicit ``/flush_cache`` (``FlushCacheReqInput``):
    ``SchedulerFlushWrapper.handle`` from 0.5.15, ``Scheduler.flush_cache_wrapped`` before."""
    try:
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
    except ImportError:
        from sglang.srt.managers.scheduler import Scheduler

        return Scheduler, "flush_cache_wrapped"
    return SchedulerFlushWrapper, "handle"


def flush_handler_scheduler(handler_owner: Any) -> Any:
    """The scheduler behind the object that answered a ``/flush_cache``: the scheduler itself up to 0.5.14; from
    0.5.15 the ``SchedulerFlushWrapper``, which keeps no reference to it but holds its bound ``flush_cache``."""
    flush = getattr(handler_owner, "_flush_cache", None)
    return getattr(flush, "__self__", handler_owner)


# ---------------------------------------------------------------------------------------------------------------------
# the trainer's side (imports no SGLang module: the client runs in the trainer's process)


def engine_session_call(engine: Any, name: str) -> Optional[Callable[[], Any]]:
    """An ``sglang.Engine``'s weight-update session method ``name`` (``begin_weight_update`` /
    ``end_weight_update``): from 0.5.21; None before, where engines have no sessions (a server answers 404 on the
    route instead)."""
    return getattr(engine, name, None)


class _StorageBytes:
    """A host storage pickled as its bytes (``torch.storage._load_from_bytes``)."""

    def __init__(self, storage: torch.TypedStorage):
        self.storage = storage

    def __reduce__(self) -> tuple[Callable, tuple]:
        buf = io.BytesIO()
        torch.save(self.storage, buf)
        return torch.storage._load_from_bytes, (buf.getvalue(),)


def reduce_host_tensor(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    """A host tensor in an update payload, as every supported release's receiving side takes it: its bytes as a
    storage (:class:`_StorageBytes`), rebuilt by torch's plain ``_rebuild_tensor_v3``. From 0.5.21 SGLang's safe
    unpickler refuses a whole pickled tensor; older releases take this form too. (torch's shared-memory reduction
    passes a file descriptor that only processes of the sender's multiprocessing family may fetch, which an engine
    started on its own is not.)"""
    t = tensor.detach().contiguous()
    if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # send only this tensor's bytes, not the rest of a larger storage it views
    # bytes as a uint8 storage (torch cannot save an FP8 storage), typed again on arrival by _rebuild_tensor_v3
    storage = torch.TypedStorage(wrap_storage=t.untyped_storage(), dtype=torch.uint8, _internal=True)
    return torch._utils._rebuild_tensor_v3, (_StorageBytes(storage), 0, tuple(t.shape), t.stride(), False,
                                             collections.OrderedDict(), t.dtype)
