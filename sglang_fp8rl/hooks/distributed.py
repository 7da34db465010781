"""``update_weights_from_distributed``: the trainer's broadcast, received in full before anything is refused.

The trainer (rank 0 of the update group) broadcasts every tensor it announced, whatever the engine thinks of them.
An engine that refused from the announcement alone would leave those bytes in flight, and the next update would
receive them (gloo aborts, NCCL hangs or delivers wrong bytes). So every announced tensor that can be sized is
received first (into tensors of the announced dtype, which are dropped if refused), and only then judged. An
announcement that cannot be sized (unknown dtype, malformed shape) cannot be received: it is refused with a message
saying the group is out of step and must be re-created.

Up to 0.5.20 SGLang calls one method (``update_weights_from_distributed``); from 0.5.21 it calls
``receive_weights_from_distributed`` and then ``load_weights_from_distributed`` (:mod:`sglang_fp8rl.compat.updates`).
The receive never raises here: a refusal travels to the load as a :class:`RefusedBroadcast`, so every TP rank
reaches the guard's agreement (a rank that returned early would leave the others waiting in it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

from sglang_fp8rl.compat.updates import updater_model
from sglang_fp8rl.hooks.weight_updater import (
    FLATTENED_BUCKET,
    TENSOR_FORMATS,
    check_sglang_preconditions,
    is_shape,
    prepared_request,
    writer,
)
from sglang_fp8rl.weight_sync import guard
from sglang_fp8rl.weight_sync.update import is_attached
from sglang_fp8rl.weight_sync.validate import WIRE_DTYPES, UpdateRejected, check_name

OP = "update_weights_from_distributed"
Announced = list[tuple[Any, torch.dtype, list[int]]]


class RefusedBroadcast(list):
    """A broadcast that was received (the group stays in step) but is refused: rejected by the guard on every rank."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message


def announced_tensors(names: Any, dtypes: Any, shapes: Any) -> Announced:
    """(name, dtype, shape) of every announced tensor; UpdateRejected when the bytes cannot be sized, in which case
    nothing can be received and the group is out of step."""
    out_of_step = ("; the trainer's broadcast cannot be received, so the update group is out of step: destroy and "
                   "re-create it (destroy_weights_update_group, init_weights_update_group)")
    if not all(isinstance(x, (list, tuple)) for x in (names, dtypes, shapes)) or not (
            len(names) == len(dtypes) == len(shapes)):
        raise UpdateRejected("names, dtypes and shapes must be lists of the same length" + out_of_step)
    announced = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
        if not isinstance(resolved, torch.dtype):
            raise UpdateRejected(f"{name!r}: dtype {dtype!r} is not a torch dtype" + out_of_step)
        if not is_shape(shape):
            raise UpdateRejected(f"{name!r}: shape {shape!r} is not a list of non-negative ints" + out_of_step)
        announced.append((name, resolved, list(shape)))
    return announced


def receive(updater: Any, announced: Announced, group_name: str, bucketed: bool) -> list[tuple[Any, torch.Tensor]]:
    """Receive the trainer's broadcast of ``announced`` into fresh tensors, as SGLang does (one flattened broadcast
    for a bucket, one broadcast per tensor otherwise)."""
    group = updater._model_update_group[group_name]
    named = [(name, torch.empty(shape, dtype=dtype, device=updater.device)) for name, dtype, shape in announced]
    if bucketed:
        bucket = FlattenedTensorBucket(named_tensors=named)
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        return bucket.reconstruct_tensors()
    handles = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for _, t in named]
    for handle in handles:
        handle.wait()
    return named


def refusal(announced: Announced, load_format: Optional[str]) -> Optional[str]:
    """Why a received broadcast is refused (names, dtypes, format), or None."""
    if load_format not in TENSOR_FORMATS:
        return f"load_format={load_format!r} is not accepted; use one of {TENSOR_FORMATS}"
    if not announced:
        return "names, dtypes and shapes must be non-empty lists"
    for name, dtype, _ in announced:
        try:
            name = check_name(name)
        except UpdateRejected as e:
            return str(e)
        if dtype not in WIRE_DTYPES:
            return f"{name}: dtype {dtype} is not accepted (send bf16, fp16 or fp32 weights, or float8_e4m3fn codes " \
                   "with their weight_scale_inv)"
    return None


def receive_checked(updater: Any, names: Any, dtypes: Any, shapes: Any, group_name: Any,
                    load_format: Optional[str]) -> list[tuple[Any, torch.Tensor]]:
    """Every announced tensor received, then judged: the tensors, or a :class:`RefusedBroadcast`. Never raises."""
    try:
        if group_name not in updater._model_update_group:
            raise UpdateRejected(f"update group {group_name!r} does not exist (known: "
                                 f"{sorted(updater._model_update_group)}); call init_weights_update_group first")
        announced = announced_tensors(names, dtypes, shapes)
        named = receive(updater, announced, group_name, load_format == FLATTENED_BUCKET)
    except UpdateRejected as e:
        return RefusedBroadcast(str(e))
    except Exception as e:  # noqa: BLE001 - the boundary to SGLang's scheduler: a failed receive is answered
        return RefusedBroadcast(f"receiving the broadcast failed: {type(e).__name__}: {e}")
    reason = refusal(announced, load_format)
    return RefusedBroadcast(reason + " (the broadcast was received and dropped)") if reason else named


def prepare_received(updater: Any, named: Any) -> guard.Prepared:
    """Validate a received broadcast (nothing is written)."""
    if isinstance(named, RefusedBroadcast):
        raise UpdateRejected(named.message)
    check_sglang_preconditions(updater, OP)
    return prepared_request(updater_model(updater), named)


def wrap_update_from_distributed(original: Callable) -> Callable:
    """``update_weights_from_distributed`` (up to 0.5.20): receive everything, then validate, agree and write."""
    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        model = updater_model(self)
        if not is_attached(model):
            return original(self, names, dtypes, shapes, group_name, load_format)
        named = receive_checked(self, names, dtypes, shapes, group_name, load_format)
        return guard.run(model, f"distributed/{load_format or 'list'}", lambda: prepare_received(self, named),
                         writer(model))

    return update_weights_from_distributed


def wrap_receive_from_distributed(original: Callable) -> Callable:
    """``receive_weights_from_distributed`` (0.5.21+): receive everything; a refusal travels to the load."""
    def receive_weights_from_distributed(self, *, names, dtypes, shapes, group_name, load_format=None):
        if not is_attached(updater_model(self)):
            return original(self, names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                            load_format=load_format)
        return receive_checked(self, names, dtypes, shapes, group_name, load_format)

    return receive_weights_from_distributed


def wrap_load_from_distributed(original: Callable) -> Callable:
    """``load_weights_from_distributed`` (0.5.21+): validate, agree and write what was received."""
    def load_weights_from_distributed(self, named_tensors):
        model = updater_model(self)
        if not is_attached(model):
            return original(self, named_tensors)
        return guard.run(model, "distributed", lambda: prepare_received(self, named_tensors), writer(model))

    return load_weights_from_distributed
