"""A trainer's payload in buckets: (name, tensor) pairs from a state_dict, grouped within a byte budget, each bucket
of one device and in the payload's order within it, a pre-quantized weight always with its scale; and a bucket as
SGLang's flattened bucket (one buffer, so one CUDA IPC handle). Trainer side: imports SGLang only to build a
flattened bucket."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence, Union

import torch

from sglang_fp8rl.weight_sync.errors import WeightPushError
from sglang_fp8rl.weight_sync.protocol import SCALE_SUFFIX, is_scale_name

DEFAULT_BUCKET_BYTES = 512 << 20
NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def named_items(weights: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a state_dict, ``named_parameters()`` or a list; parameters are detached."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    for name, tensor in items:
        yield name, tensor.detach()


def _units(weights: NamedTensors) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Tensors in order, each pre-quantized weight together with its scale (they must travel in one request)."""
    items = list(named_items(weights))
    names = {name for name, _ in items}
    scales = {name: t for name, t in items if is_scale_name(name)}
    paired = {name[: -len(SCALE_SUFFIX)] for name in scales} & names
    for name, tensor in items:
        if name in scales and name[: -len(SCALE_SUFFIX)] in names:
            continue  # sent with its weight
        if name in paired:
            yield [(name, tensor), (name + SCALE_SUFFIX, scales[name + SCALE_SUFFIX])]
        else:
            yield [(name, tensor)]


def buckets(weights: NamedTensors,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups of at most ``bucket_bytes``, each of one device, in the weights' order within a device (a larger
    single tensor travels alone; a pre-quantized weight and its scale stay together). One bucket is open per device,
    so a payload whose tensors alternate between devices still fills whole buckets; with one device the groups are
    consecutive."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    # a flattened bucket is one buffer on one device: a bucket that straddled two could not travel
    open_buckets: dict[torch.device, tuple[list[tuple[str, torch.Tensor]], int]] = {}
    for unit in _units(weights):
        device = unit[0][1].device
        nbytes = sum(t.numel() * t.element_size() for _, t in unit)
        bucket, size = open_buckets.get(device, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(unit)
        open_buckets[device] = (bucket, size + nbytes)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


def check_flattenable(bucket: Sequence[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise WeightPushError if ``bucket`` cannot travel as one flattened buffer (checked before anything is sent)."""
    try:
        import sglang.srt.weight_sync.tensor_bucket  # noqa: F401
    except ImportError as e:  # its metadata unpickles on the engine as SGLang's class: the trainer needs SGLang
        raise WeightPushError(f"{what} not sent: flatten=True builds SGLang's FlattenedTensorBucket, and SGLang "
                              f"does not import here ({e})") from e
    devices = {str(t.device) for _, t in bucket}
    if len(devices) > 1:
        raise WeightPushError(f"{what} not sent: flatten=True needs one device per bucket, got {sorted(devices)} "
                              f"({bucket[0][0]} ...): move the tensors, or push with flatten=False")


def flattened_bucket(bucket: Sequence[tuple[str, torch.Tensor]], what: str) -> dict[str, Any]:
    """SGLang's flattened bucket of ``bucket`` (one uint8 buffer and its metadata, built by SGLang's own class),
    the widest dtypes first: every tensor then starts aligned to its element size, as the engine requires."""
    check_flattenable(bucket, what)
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    ordered = sorted(bucket, key=lambda item: -item[1].element_size())  # stable: same-width tensors keep their order
    packed = FlattenedTensorBucket(named_tensors=[(name, t.contiguous()) for name, t in ordered])
    return {"flattened_tensor": packed.get_flattened_tensor(), "metadata": packed.get_metadata()}
