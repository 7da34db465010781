"""Trainer-side client: push a policy's weights into an SGLang engine served with `fp8_online_blockwise`.

The engine quantizes on its side, so the client sends plain HF-named BF16/FP32 tensors, in buckets of a given byte
size, by one of three transports:

* ``push_state_dict(target, state_dict)``: `/update_weights_from_tensor` (CUDA IPC handles when the tensors are on a
  GPU and the engine is colocated; the bytes themselves otherwise);
* ``push_distributed(target, state_dict, group, group_name)``: `/update_weights_from_distributed`, rank 0 of an NCCL
  group made by ``init_update_group`` broadcasting each bucket;
* ``push_from_disk(target, path)``: `/update_weights_from_disk` of a checkpoint folder.

``target`` is a server URL (``"http://127.0.0.1:30000"``) or an ``sglang.Engine``. Every failed request raises
:class:`WeightPushError` with the engine's message, which names the tensor and the reason.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Iterator, Mapping, Sequence, Union

import torch

DEFAULT_BUCKET_BYTES = 512 << 20
NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


class WeightPushError(RuntimeError):
    """The engine refused or failed a weight update."""


def named_items(weights: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a state_dict, ``named_parameters()`` or a list; parameters are detached."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    for name, tensor in items:
        yield name, tensor.detach()


def buckets(weights: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger single tensor travels alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_items(weights):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _check_answer(answer: Any, what: str) -> Any:
    """Raise WeightPushError unless the engine answered success."""
    if isinstance(answer, dict):
        ok, message = answer.get("success"), answer.get("message", "")
    else:
        ok, message = answer[0], answer[1]
    if not ok:
        raise WeightPushError(f"{what} failed: {message}")
    return answer


def _post(url: str, route: str, payload: dict, timeout: float) -> dict:
    import requests

    response = requests.post(url.rstrip("/") + route, json=payload, timeout=timeout)
    if response.status_code != 200:
        raise WeightPushError(f"{route} answered HTTP {response.status_code}: {response.text[:2000]}")
    return response.json()


def _tp_size(url: str, timeout: float) -> int:
    import requests

    return int(requests.get(url.rstrip("/") + "/get_server_info", timeout=timeout).json().get("tp_size", 1))


def serialize_for_ranks(named: Sequence[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """One serialized payload per TP rank (SGLang's format; CUDA tensors travel as IPC handles)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    if any(t.is_cuda for _, t in named):
        # CUDA tensors travel as IPC handles keyed by device UUID (what SGLang's receiving TP worker expects); the
        # patch is for CUDA storages only and breaks the pickling of CPU tensors
        monkey_patch_torch_reductions()
    return [MultiprocessingSerializer.serialize(list(named), output_str=True) for _ in range(tp_size)]


def push_state_dict(target: Any, weights: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    timeout: float = 600.0) -> list:
    """Push weights by tensor, bucket by bucket; the KV cache is flushed once, after the last bucket."""
    answers = []
    chunks = list(buckets(weights, bucket_bytes))
    tp_size = _tp_size(target, timeout) if isinstance(target, str) else None
    for i, bucket in enumerate(chunks):
        last = i == len(chunks) - 1
        what = f"update_weights_from_tensor (bucket {i + 1}/{len(chunks)}: {bucket[0][0]} ...)"
        if isinstance(target, str):
            payload = {"serialized_named_tensors": serialize_for_ranks(bucket, tp_size), "flush_cache": last}
            answers.append(_check_answer(_post(target, "/update_weights_from_tensor", payload, timeout), what))
        else:
            answers.append(_check_answer(target.update_weights_from_tensor(bucket, flush_cache=last), what))
    return answers


def init_update_group(target: Any, master_address: str, master_port: int, world_size: int,
                      group_name: str = "fp8rl", backend: str = "nccl") -> Any:
    """Ask the engine to join an update group (engine ranks 1..world_size-1); the trainer is rank 0.

    Call this, then create the trainer's side with SGLang's ``init_custom_process_group`` (rank 0) concurrently.
    """
    args = dict(master_address=master_address, master_port=master_port, rank_offset=1, world_size=world_size,
                group_name=group_name, backend=backend)
    if isinstance(target, str):
        return _check_answer(_post(target, "/init_weights_update_group", args, 600.0), "init_weights_update_group")
    return _check_answer(target.init_weights_update_group(**args), "init_weights_update_group")


def push_distributed(target: Any, weights: NamedTensors, group: Any, group_name: str = "fp8rl",
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 600.0) -> list:
    """Push weights over an NCCL group: the engine's request and our broadcasts run concurrently, bucket by bucket."""
    answers = []
    for bucket in buckets(weights, bucket_bytes):
        meta = dict(names=[n for n, _ in bucket], dtypes=[str(t.dtype).replace("torch.", "") for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket], group_name=group_name)
        result: dict = {}

        def request(meta=meta, result=result) -> None:
            if isinstance(target, str):
                result["answer"] = _post(target, "/update_weights_from_distributed", meta, timeout)
            else:
                result["answer"] = target.update_weights_from_distributed(**meta)

        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        for _, tensor in bucket:
            torch.distributed.broadcast(tensor.contiguous(), src=0, group=group)
        thread.join(timeout)
        if "answer" not in result:
            raise WeightPushError(f"update_weights_from_distributed did not answer within {timeout} s")
        answers.append(_check_answer(result["answer"], f"update_weights_from_distributed ({meta['names'][0]} ...)"))
    return answers


def push_from_disk(target: Any, path: str, load_format: str = "auto", timeout: float = 1800.0) -> Any:
    """Make the engine load a checkpoint folder (validated in full before anything is written)."""
    if isinstance(target, str):
        answer = _post(target, "/update_weights_from_disk", {"model_path": path, "load_format": load_format}, timeout)
    else:
        answer = target.update_weights_from_disk(path, load_format=load_format)
    return _check_answer(answer, f"update_weights_from_disk({path!r})")
