"""Every weight-update entry point of SGLang's ``WeightUpdater`` (and the payload decoding of ``TpModelWorker``),
routed through :func:`sglang_fp8rl.weight_sync.guard.run` for models served with `fp8_online_blockwise`.

Per entry point, ``prepare`` obtains the request's tensors the way SGLang's own method does (unwrap CUDA IPC
handles, slice a flattened bucket after checking its metadata, receive a broadcast, stream a checkpoint) and validates
them; ``write`` runs the model's own loaders on the validated tensors. Formats whose writes cannot be validated
(``load_format="direct"``, custom loader functions, unknown names) are refused with a message. Models that do not use
this package take SGLang's methods unchanged.
"""

from __future__ import annotations

import copy
import glob
import logging
import os
from typing import Any, Callable, Optional

import safetensors
import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader
from sglang.srt.model_loader.utils import set_default_torch_dtype
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

from sglang_fp8rl.compat.updates import (
    assert_weight_cache_inactive,
    decode_own_rank,
    derived_weight_cache_error,
    local_serialized_tensor_type,
    unwrap_tensor,
    updater_model,
)
from sglang_fp8rl.hooks.memory import weights_released_error
from sglang_fp8rl.weight_sync import guard
from sglang_fp8rl.weight_sync.fp8_payload import attach_scales, pair_stream, split_control
from sglang_fp8rl.weight_sync.halves import check_held_halves
from sglang_fp8rl.weight_sync.kv_updates import prepare_kv_scales, split_kv_scales, write_kv_scales
from sglang_fp8rl.weight_sync.protocol import CONTROL_PREFIX, STEP_COMPLETE, VALIDATE_ONLY
from sglang_fp8rl.weight_sync.request import validate_request, validate_stream
from sglang_fp8rl.weight_sync.step import current_step
from sglang_fp8rl.weight_sync.update import apply_validated, is_attached, original_load_weights, validated_stream
from sglang_fp8rl.weight_sync.validate import WIRE_DTYPES, NamedTensors, UpdateRejected, check_name, request_bytes

logger = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format of one flattened tensor with metadata (not ours)
TENSOR_FORMATS = (None, FLATTENED_BUCKET, VALIDATE_ONLY)  # VALIDATE_ONLY: validated on every rank, nothing written


class UndecodablePayload(list):
    """What ``TpModelWorker`` hands on when its rank's payload does not deserialize: rejected by the guard."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message


# ---------------------------------------------------------------------------------------------------------------------
# prepare and write, shared by the entry points


def check_sglang_preconditions(updater: Any, op: str) -> None:
    """SGLang's own refusals of online updates (weight cache, derived-weight caches), as rejections; and weights
    released by SGLang's memory saver, which SGLang itself would write to (hooks/memory.py)."""
    error = weights_released_error() or derived_weight_cache_error(updater)
    if error is not None:
        raise UpdateRejected(error)
    assert_weight_cache_inactive(updater, op)


def prepared_request(model: torch.nn.Module, named: NamedTensors, validate_only: bool = False) -> guard.Prepared:
    """Validate a request of named tensors, pre-quantized FP8, KV scales and control entries included (nothing is
    written)."""
    weights, control = split_control(named)
    weights, kv_entries = split_kv_scales(weights)
    step = current_step()
    ends_step = STEP_COMPLETE in control and not step.session  # in a session a marker is only noted: its end ends it
    pairing = step.pairing(weights, validate_only=validate_only, ends_step=ends_step)
    check_held_halves(model, original_load_weights(model), pairing.hold)
    validated = validate_request(model, original_load_weights(model), attach_scales(pairing.named))
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
    checked = []
    for meta in metadata:
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
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(torch.Size(shape).numel()) * itemsize
        if end - start != nbytes:
            raise UpdateRejected(f"{name}: bucket holds {end - start} bytes but shape {tuple(shape)} of {dtype} "
                                 f"needs {nbytes}")
        if (flattened.storage_offset() + start) % itemsize:
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
    if load_format == FLATTENED_BUCKET:
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


def refuse_fp8_for_stock(named: NamedTensors) -> None:
    """A model this package does not serve takes SGLang's own updates: no pre-quantized FP8 for it."""
    for name, tensor in named:
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float8_e4m3fn:
            raise UpdateRejected(f"{name}: pre-quantized FP8 updates need a model served with "
                                 "--quantization fp8_online_blockwise")


def wrap_update_from_tensor(original: Callable) -> Callable:
    """WeightUpdater.update_weights_from_tensor, guarded (validate-only requests are answered for any model, so
    the client's all-or-nothing steps work against BF16 engines too)."""
    def update_weights_from_tensor(self, named_tensors, load_format=None):
        model = updater_model(self)
        if not is_attached(model) and load_format != VALIDATE_ONLY:
            return original(self, stock_request(named_tensors, load_format), load_format)

        def prepare() -> guard.Prepared:
            check_sglang_preconditions(self, "update_weights_from_tensor")
            named = tensors_of_request(self, named_tensors, load_format)
            if not is_attached(model):
                refuse_fp8_for_stock(named)
            return prepared_request(model, named, validate_only=load_format == VALIDATE_ONLY)

        return guard.run(model, f"tensor/{load_format or 'list'}", prepare, writer(model),
                         validate_only=load_format == VALIDATE_ONLY)

    return update_weights_from_tensor


def decoded_or_refused(decode: Callable[[], Any]) -> Any:
    """This rank's decoded payload, or an :class:`UndecodablePayload` the guard rejects on every rank (unpickling
    runs the payload's own code: anything may come out of it)."""
    try:
        return decode()
    except Exception as e:  # noqa: BLE001 - unpickling runs arbitrary payload code; nothing may reach the scheduler
        return UndecodablePayload(f"the update payload of this rank does not deserialize: {type(e).__name__}: {e}")


def wrap_deserialize_own_rank(original: Callable) -> Callable:
    """TpModelWorker's per-rank payload decoding (0.5.17+): an undecodable payload becomes a rejection, not a
    crash."""
    def deserialize(self, serialized_named_tensors):
        if not is_attached(self.model_runner.model):
            return original(self, serialized_named_tensors)
        return decoded_or_refused(lambda: original(self, serialized_named_tensors))

    return deserialize


def wrap_worker_update_from_tensor(original: Callable) -> Callable:
    """TpModelWorker.update_weights_from_tensor where it decodes the payload inline (up to 0.5.15): the same call,
    with an undecodable payload handed on as a rejection."""
    def update_weights_from_tensor(self, recv_req):
        if not is_attached(self.model_runner.model):
            return original(self, recv_req)
        named = decoded_or_refused(lambda: decode_own_rank(recv_req.serialized_named_tensors, self.tp_rank))
        return self.model_runner.update_weights_from_tensor(named_tensors=named, load_format=recv_req.load_format)

    return update_weights_from_tensor


# ---------------------------------------------------------------------------------------------------------------------
# checkpoint on disk, and checkpoint-engine IPC


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


def validate_checkpoint_on_disk(updater: Any, model_path: str, load_format: str,
                                weight_name_filter: Optional[Callable[[str], bool]]) -> guard.Prepared:
    """Stream a checkpoint through validation with SGLang's own loader and weight iterator; nothing is written."""
    check_checkpoint_files(model_path)
    model_config = copy.copy(updater.model_config)
    model_config.model_path = model_path
    loader = get_model_loader(LoadConfig(load_format=load_format), model_config)
    if not isinstance(loader, DefaultModelLoader):
        raise UpdateRejected(f"load_format={load_format!r} gives SGLang's {type(loader).__name__}; disk updates "
                             "support only its default loader")
    model = updater_model(updater)
    with set_default_torch_dtype(model_config.dtype):
        weights = loader._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, model))
        if weight_name_filter is not None:
            weights = ((name, w) for name, w in weights if weight_name_filter(name))
        validated = validate_stream(model, original_load_weights(model), pair_stream(weights))
    logger.info("[fp8rl] disk checkpoint %s validated (%d tensors); loading", model_path, len(validated.names))
    # the step ends with any unfiltered checkpoint; only one that reaches every parameter clears what a failed update
    # left dirty (a one-tensor checkpoint would otherwise mark a half-written model consistent)
    return guard.Prepared(validated, tensors=len(validated.names), full=validated.complete,
                          step_complete=weight_name_filter is None)


def wrap_update_from_disk(original: Callable) -> Callable:
    """WeightUpdater.update_weights_from_disk, guarded: a full validating pass, then SGLang's own loading pass."""
    def update_weights_from_disk(self, model_path, load_format, weight_name_filter=None, recapture_cuda_graph=False):
        model = updater_model(self)
        if not is_attached(model):
            return original(self, model_path, load_format, weight_name_filter, recapture_cuda_graph)

        def prepare() -> guard.Prepared:
            check_sglang_preconditions(self, "update_weights_from_disk")
            return validate_checkpoint_on_disk(self, model_path, load_format, weight_name_filter)

        def write(prepared: guard.Prepared) -> None:
            with validated_stream(model):
                ok, message = original(self, model_path, load_format, weight_name_filter, recapture_cuda_graph)
            if not ok:
                raise RuntimeError(message)

        return guard.run(model, "disk", prepare, write, context=f"checkpoint {model_path!r}")

    return update_weights_from_disk


def wrap_update_from_ipc(original: Callable) -> Callable:
    """WeightUpdater.update_weights_from_ipc: checkpoint-engine drives ``load_weights`` itself; the model's guard
    validates each call rank-locally and the ranks agree on the outcome."""
    def update_weights_from_ipc(self, recv_req):
        model = updater_model(self)
        if not is_attached(model):
            return original(self, recv_req)
        def call() -> tuple[bool, str]:
            released = weights_released_error()
            return (False, released) if released else original(self, recv_req)

        return guard.run_unvalidated(model, "ipc", call)

    return update_weights_from_ipc
