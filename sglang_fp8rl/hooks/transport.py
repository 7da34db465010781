"""What SGLang's update transports deliver, decoded and checked before the update pipeline sees it (a helper of the
update hooks: it patches nothing).

* ``update_weights_from_tensor``: (name, tensor) pairs, CUDA IPC handles unwrapped as SGLang does, or a flattened
  bucket whose metadata must fit its buffer (:func:`tensors_of_request`); a payload that does not even deserialize on
  this rank becomes an :class:`UndecodablePayload` (:func:`decoded_or_refused`), refused on every rank by the guard;
* ``update_weights_from_disk``: a local checkpoint's safetensors headers, then its tensors through SGLang's own loader
  (:func:`checkpoint_weights`);
* ``update_weights_from_distributed``: the trainer's broadcast, received in full before it is judged
  (:func:`receive_checked`; hooks/distributed.py says why).

Formats whose writes cannot be validated (``load_format="direct"``, custom loader functions, unknown names) are refused
with a message. Every refusal is an :class:`~sglang_fp8rl.weight_sync.validate.UpdateRejected` or a refused payload the
pipeline turns into one.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import math
import os
from typing import Any, Callable, Iterator, Optional

import safetensors
import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader
from sglang.srt.model_loader.utils import set_default_torch_dtype
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

from sglang_fp8rl.compat.updates import local_serialized_tensor_type, unwrap_tensor, updater_model
from sglang_fp8rl.weight_sync.protocol import CONTROL_PREFIX, FLATTENED_BUCKET, FLATTENED_FORMATS, VALIDATE_FORMATS
from sglang_fp8rl.weight_sync.validate import WIRE_DTYPES, UpdateRejected, check_name

TENSOR_FORMATS = (None, FLATTENED_BUCKET, *VALIDATE_FORMATS)  # VALIDATE_FORMATS: checked on every rank, nothing written
Announced = list[tuple[Any, torch.dtype, list[int]]]
NamedTensor = tuple[str, torch.Tensor]


class UndecodablePayload(list):
    """What ``TpModelWorker`` hands on when its rank's payload does not deserialize: rejected by the guard."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message


def decoded_or_refused(decode: Callable[[], Any]) -> Any:
    """This rank's decoded payload, or an :class:`UndecodablePayload` the guard rejects on every rank (unpickling
    runs the payload's own code: anything may come out of it)."""
    try:
        return decode()
    except Exception as e:  # noqa: BLE001 - unpickling runs arbitrary payload code; nothing may reach the scheduler
        return UndecodablePayload(f"the update payload of this rank does not deserialize: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------------------------------
# tensors and flattened buckets


def check_pairs(named_tensors: Any) -> list:
    """A request must be a list of (name, tensor) pairs."""
    if isinstance(named_tensors, UndecodablePayload):
        raise UpdateRejected(named_tensors.message)
    if not isinstance(named_tensors, (list, tuple)):
        raise UpdateRejected(f"expected a list of (name, tensor) pairs, got {type(named_tensors).__name__}")
    for item in named_tensors:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise UpdateRejected(f"expected (name, tensor) pairs, got an item {type(item).__name__} {item!r:.80}")
    return list(named_tensors)


def is_count(value: Any) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_shape(shape: Any) -> bool:
    """A list, tuple or torch.Size of non-negative ints."""
    return isinstance(shape, (list, tuple, torch.Size)) and all(is_count(d) for d in shape)


def check_bucket_metadata(flattened: Any, metadata: Any) -> list[FlattenedTensorMetadata]:
    """Reject a flattened bucket whose metadata does not fit its buffer (truncated, misaligned, unknown dtype)."""
    if not isinstance(flattened, torch.Tensor) or flattened.dim() != 1 or flattened.dtype != torch.uint8:
        got = f"{flattened.dtype} of shape {tuple(flattened.shape)}" if isinstance(flattened, torch.Tensor) \
            else type(flattened).__name__
        raise UpdateRejected(f"flattened_tensor must be a 1-D uint8 tensor, got {got}")
    if not isinstance(metadata, (list, tuple)):
        raise UpdateRejected(f"a flattened bucket's metadata must be a list, got {type(metadata).__name__}")
    size = flattened.numel()
    if not metadata and size:  # an empty bucket (slime pads ranks without tensors with one) is a no-op; bytes are not
        raise UpdateRejected(f"a flattened bucket with no metadata holds {size} bytes: nothing says what they are")
    checked, offset = [], flattened.storage_offset()
    for meta in metadata:  # per tensor, and MoE buckets hold ~160: plain Python here, no tensor made
        name = check_name(getattr(meta, "name", None))
        dtype, shape = getattr(meta, "dtype", None), getattr(meta, "shape", None)
        start, end = getattr(meta, "start_idx", None), getattr(meta, "end_idx", None)
        if dtype not in WIRE_DTYPES:
            raise UpdateRejected(f"{name}: bucket dtype {dtype!r} is not accepted (send bf16, fp16 or fp32 weights)")
        if not is_shape(shape):
            raise UpdateRejected(f"{name}: bucket shape {shape!r} is not a list of non-negative ints")
        if not (is_count(start) and is_count(end) and start <= end <= size):
            raise UpdateRejected(f"{name}: bucket bytes [{start}, {end}) lie outside the {size}-byte buffer "
                                 "(truncated bucket?)")
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        if end - start != nbytes:
            raise UpdateRejected(f"{name}: bucket holds {end - start} bytes but shape {tuple(shape)} of {dtype} "
                                 f"needs {nbytes}")
        if (offset + start) % itemsize:
            raise UpdateRejected(f"{name}: bucket offset {start} is not aligned to {dtype} ({itemsize} bytes)")
        checked.append(FlattenedTensorMetadata(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start,
                                               end_idx=end, numel=end - start))
    return checked


def tensors_of_bucket(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket (views into its buffer), after checking its metadata."""
    if isinstance(bucket, UndecodablePayload):
        raise UpdateRejected(bucket.message)
    if not isinstance(bucket, dict) or "flattened_tensor" not in bucket or "metadata" not in bucket:
        raise UpdateRejected("a flattened bucket must be a dict with 'flattened_tensor' and 'metadata'")
    flattened = bucket["flattened_tensor"]
    metadata = check_bucket_metadata(flattened, bucket["metadata"])
    return FlattenedTensorBucket(flattened_tensor=flattened, metadata=metadata).reconstruct_tensors()


def tensors_of_request(updater: Any, named_tensors: Any, load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of an update_weights_from_tensor request, as SGLang's own method obtains them."""
    if load_format not in TENSOR_FORMATS:
        raise UpdateRejected(
            f"load_format={load_format!r} is not accepted for a model served with fp8_online_blockwise: only "
            f"{TENSOR_FORMATS} are validated before writing ('direct' and custom loaders write unchecked)"
        )
    monkey_patch_torch_reductions()  # what SGLang does first: CUDA IPC handles unpickle through it
    if load_format in FLATTENED_FORMATS:
        return tensors_of_bucket(named_tensors)
    named = []
    for name, tensor in check_pairs(named_tensors):
        if not isinstance(tensor, (torch.Tensor, local_serialized_tensor_type())):
            raise UpdateRejected(f"{check_name(name)}: expected a torch.Tensor, got {type(tensor).__name__}")
        named.append((name, unwrap_tensor(updater, tensor)))
    return named


def stock_request(named_tensors: Any, load_format: Optional[str]) -> Any:
    """A request for a model this package does not serve: our control entries dropped (the trainer client sends the
    same steps to BF16 engines), the rest untouched."""
    if load_format is not None or not isinstance(named_tensors, (list, tuple)):
        return named_tensors
    return [item for item in named_tensors if not (isinstance(item, (list, tuple)) and len(item) == 2 and
                                                   isinstance(item[0], str) and item[0].startswith(CONTROL_PREFIX))]


# ---------------------------------------------------------------------------------------------------------------------
# a checkpoint on disk


def check_checkpoint_files(model_path: str) -> None:
    """A local checkpoint folder exists and every safetensors file in it has a readable, complete header (a
    truncated or corrupted file is named here, before SGLang's iterator fails somewhere inside it)."""
    if os.path.isabs(model_path) and not os.path.isdir(model_path):
        raise UpdateRejected(f"{model_path}: no such folder")
    if not os.path.isdir(model_path):
        return  # a model-hub id: SGLang downloads it first
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        try:
            with safetensors.safe_open(path, framework="pt"):
                pass
        except (safetensors.SafetensorError, OSError) as e:
            raise UpdateRejected(f"{path}: not a complete safetensors file: {e}") from e


@contextlib.contextmanager
def checkpoint_weights(updater: Any, model_path: str, load_format: str,
                       weight_name_filter: Optional[Callable[[str], bool]]) -> Iterator[Iterator[NamedTensor]]:
    """The tensors of a checkpoint, read with SGLang's own loader and weight iterator (under the model's default
    dtype, as SGLang reads them), after checking its files; UpdateRejected for a loader other than SGLang's default."""
    check_checkpoint_files(model_path)
    model_config = copy.copy(updater.model_config)
    model_config.model_path = model_path
    loader = get_model_loader(LoadConfig(load_format=load_format), model_config)
    if not isinstance(loader, DefaultModelLoader):
        raise UpdateRejected(f"load_format={load_format!r} gives SGLang's {type(loader).__name__}; disk updates "
                             "support only its default loader")
    with set_default_torch_dtype(model_config.dtype):
        weights = loader._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, updater_model(updater)))
        if weight_name_filter is not None:
            weights = ((name, w) for name, w in weights if weight_name_filter(name))
        yield weights


# ---------------------------------------------------------------------------------------------------------------------
# the trainer's broadcast


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
