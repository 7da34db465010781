"""Trainer-side client: push a policy's weights into an SGLang engine served with `fp8_online_blockwise`.

The engine quantizes on its side, so the client sends plain HF-named BF16/FP32 tensors, in buckets of a given byte
size, by one of three transports:

* ``push_state_dict(target, state_dict)``: `/update_weights_from_tensor` (CUDA IPC handles when the tensors are on a
  GPU and the engine is colocated; the bytes themselves otherwise);
* ``push_distributed(target, state_dict, group)``: `/update_weights_from_distributed`, the trainer being rank 0 of
  the group that ``init_update_group`` returns, broadcasting each bucket;
* ``push_from_disk(target, path)``: `/update_weights_from_disk` of a checkpoint folder.

``target`` is a server URL (``"http://127.0.0.1:30000"``) or an ``sglang.Engine``. Every failed request raises
:class:`WeightPushError` with the engine's message, which names the tensor and the reason. Each bucket is checked
here first (names, dtypes, finite values): a bad tensor fails before anything is sent, which matters most for the
broadcast, where the engine waits for every announced tensor.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.multiprocessing import reductions  # importing it registers torch's reducers with ForkingPickler

from sglang_fp8rl.compat.updates import reduce_host_tensor
from sglang_fp8rl.quant import FP8_DTYPE, UNQUANTIZED_DTYPES, extremes, extremes_finite_in_bf16
from sglang_fp8rl.weight_sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    NamedTensors,
    buckets,
    check_flattenable,
    flattened_bucket,
)
from sglang_fp8rl.weight_sync.errors import WeightPushError
from sglang_fp8rl.weight_sync.finite import all_finite_in_bf16
from sglang_fp8rl.weight_sync.protocol import (
    FLATTENED_BUCKET,
    STEP_COMPLETE,
    VALIDATE_ONLY,
    VALIDATE_ONLY_FLATTENED,
    is_scale_name,
)
from sglang_fp8rl.weight_sync.session import step_session

logger = logging.getLogger(__name__)

# NCCL settings SGLang's engine processes run with (entrypoints/engine.py `_set_envs_and_config`: NCCL_CUMEM_ENABLE=0
# unless --enable-symm-mem); the trainer's end of the update group must match them (verl sets the same on its side)
ENGINE_NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0"}

DEFAULT_TIMEOUT_S = 600.0
# torch's reduce_tensor argument that holds a CUDA tensor's device index (SGLang sends the device UUID there)
_DEVICE_ARG = 6


def preflight(bucket: Sequence[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise WeightPushError for what the engine would refuse on content alone: names, dtypes, NaN/Inf in BF16."""
    seen: set[str] = set()
    plain = []
    for name, tensor in bucket:
        if not isinstance(name, str) or not name or name in seen:
            raise WeightPushError(f"{what} not sent: {name!r}: names must be unique non-empty strings")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            raise WeightPushError(f"{what} not sent: {name}: {type(tensor).__name__} is not a tensor")
        if tensor.dtype == FP8_DTYPE or is_scale_name(name):
            continue  # pre-quantized: the engine checks codes and scales together
        if tensor.dtype not in UNQUANTIZED_DTYPES:
            raise WeightPushError(f"{what} not sent: {name}: {tensor.dtype} is not accepted (send bf16, fp16 or "
                                  "fp32, or float8_e4m3fn codes with their weight_scale_inv)")
        if tensor.numel():
            plain.append((name, tensor))
    # one batched check for the bucket (a host sync per tensor cost a GPU trainer 18,867 of them a 30B-A3B push),
    # then the exact one per tensor only to name the culprit, or to clear the batched check's false alarm
    if plain and not all_finite_in_bf16([t for _, t in plain]):
        bad = next((name for name, t in plain if not extremes_finite_in_bf16(extremes(t))), None)
        if bad is not None:
            raise WeightPushError(f"{what} not sent: {bad}: contains NaN/Inf in BF16")


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


# ---------------------------------------------------------------------------------------------------------------------
# payload (SGLang's format, without patching torch for the whole process)


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    """A CUDA tensor: torch's IPC reduction with the device index replaced by the device's UUID. Any other tensor:
    its bytes, in the form every supported release's unpickler takes (:func:`compat.updates.reduce_host_tensor`)."""
    if not tensor.is_cuda:
        return reduce_host_tensor(tensor)
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)  # SGLang may have patched it
    rebuild, args = reduce(tensor)
    uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
    return rebuild, (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])


class _IpcPickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors carry their device UUID (what SGLang's receiving TP worker expects) and whose
    CPU tensors carry their bytes.

    SGLang's own client patches torch's reductions for the whole process and for good; after that, CPU tensors no
    longer pickle. This pickler has its own dispatch table instead: nothing global changes, and a bucket may mix CPU
    and CUDA tensors."""

    _extra_reducers = {
        **ForkingPickler._extra_reducers,
        **{cls: _reduce_tensor for cls in ForkingPickler._extra_reducers if issubclass(cls, torch.Tensor)},
    }


def serialize(obj: Any) -> str:
    """SGLang's MultiprocessingSerializer format (base64 of a ForkingPickler dump), CUDA tensors by device UUID."""
    buf = io.BytesIO()
    _IpcPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_for_ranks(named: Union[Sequence[tuple[str, torch.Tensor]], dict], tp_size: int) -> list[str]:
    """One serialized payload per TP rank (SGLang's format; CUDA tensors travel as IPC handles): a list of pairs,
    or a flattened bucket's dict."""
    obj = named if isinstance(named, dict) else list(named)
    return [serialize(obj) for _ in range(tp_size)]


# ---------------------------------------------------------------------------------------------------------------------
# transports


def _send_tensors(target: Any, bucket: Union[list, dict], tp_size: Optional[int], load_format: Optional[str],
                  flush_cache: bool, what: str, timeout: float) -> Any:
    if isinstance(target, str):
        payload = {"serialized_named_tensors": serialize_for_ranks(bucket, tp_size), "flush_cache": flush_cache,
                   "load_format": load_format}
        return _check_answer(_post(target, "/update_weights_from_tensor", payload, timeout), what)
    if load_format == FLATTENED_BUCKET:  # sglang.Engine takes this format's payloads serialized per rank already
        bucket = serialize_for_ranks(bucket, target.server_args.tp_size)
    return _check_answer(target.update_weights_from_tensor(bucket, load_format=load_format, flush_cache=flush_cache),
                         what)


def _send_bucket(target: Any, bucket: list, tp_size: Optional[int], flatten: bool, validate: bool, flush_cache: bool,
                 what: str, timeout: float) -> Any:
    """One bucket, as pairs or flattened, to be validated only or written."""
    if not flatten:
        return _send_tensors(target, bucket, tp_size, VALIDATE_ONLY if validate else None, flush_cache, what, timeout)
    return _send_tensors(target, flattened_bucket(bucket, what), tp_size,
                         VALIDATE_ONLY_FLATTENED if validate else FLATTENED_BUCKET, flush_cache, what, timeout)


def push_state_dict(target: Any, weights: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    timeout: float = DEFAULT_TIMEOUT_S, atomic: bool = True, complete: bool = True,
                    flatten: bool = False) -> list:
    """Push one trainer step by tensor, bucket by bucket; the KV cache is flushed once, after the last bucket.

    ``atomic`` (default): every bucket is first validated by the engine (requests that write nothing), and only if
    all pass are they applied, so a refused bucket leaves every weight as it was. With ``complete`` (default) the
    last bucket carries the step-complete marker (an engine with calibrated FP8 KV scales then recalibrates).
    ``weights`` may mix BF16/FP16/FP32 tensors and pre-quantized FP8 (``<name>`` as float8_e4m3fn codes with
    ``<name>_scale_inv``). With ``flatten`` each bucket travels as SGLang's flattened bucket (load_format
    ``flattened_bucket``): one buffer, so one CUDA IPC handle, instead of one per tensor; for models of many small
    tensors (MoE experts). It needs SGLang importable here (checked before the first request; each bucket holds
    one device's tensors), and copies each bucket once into its buffer, which is freed when the engine has answered (the
    engine synchronizes its device before it answers). Returns the engine's answers to the writing requests (with
    ``flatten``, the step-complete marker's request last)."""
    chunks = list(buckets(weights, bucket_bytes))
    for bucket in chunks:
        preflight(bucket, "update_weights_from_tensor")
        if flatten:  # before the first request: a bucket refused here must not follow written ones
            check_flattenable(bucket, "update_weights_from_tensor")
    if not chunks:
        return []
    tp_size = _tp_size(target, timeout) if isinstance(target, str) else None
    with step_session(target, timeout) as in_session:
        if atomic:
            for i, bucket in enumerate(chunks):
                what = f"step validation (bucket {i + 1}/{len(chunks)}: {bucket[0][0]} ...), nothing of the step " \
                       "written"
                _send_bucket(target, bucket, tp_size, flatten, True, False, what, timeout)
        marker = complete and not in_session  # in a session, its end completes the step
        if marker and not flatten:
            chunks[-1] = chunks[-1] + [(STEP_COMPLETE, torch.zeros(()))]
        answers = []
        for i, bucket in enumerate(chunks):
            last = i == len(chunks) - 1
            what = f"update_weights_from_tensor (bucket {i + 1}/{len(chunks)}: {bucket[0][0]} ...)"
            if i:
                what += f"; buckets 1-{i} of this step were written before it"
            flush = last and not (marker and flatten)  # the cache is flushed once, by the step's last request
            answers.append(_send_bucket(target, bucket, tp_size, flatten, False, flush, what, timeout))
        if marker and flatten:  # its own list request: an engine without this package drops it there, not in a bucket
            answers.append(_send_tensors(target, [(STEP_COMPLETE, torch.zeros(()))], tp_size, None, True,
                                         f"update_weights_from_tensor (the step-complete marker, after all "
                                         f"{len(chunks)} buckets were written)", timeout))
    return answers


def recalibrate_kv_scales(target: Any, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """Ask an engine with ``--fp8rl-kv-scales calibrate`` to recalibrate its KV scales now (an empty step: a session
    opened and closed where the engine has sessions, else a request that carries only the step-complete marker; the
    engine measures once it is idle)."""
    with step_session(target, timeout) as in_session:
        if in_session:
            return {"success": True, "message": "recalibration requested by an empty weight-update session"}
        tp_size = _tp_size(target, timeout) if isinstance(target, str) else None
        return _send_tensors(target, [(STEP_COMPLETE, torch.zeros(()))], tp_size, None, True,
                             "recalibrate_kv_scales", timeout)



def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    """Run ``call`` in a daemon thread; its result or exception lands in the returned dict."""
    result: dict = {}

    def run() -> None:
        try:
            result["answer"] = call()
        except Exception as e:  # noqa: BLE001 - handed to the calling thread, which raises it with context
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _join(thread: threading.Thread, result: dict, what: str, timeout: float) -> Any:
    thread.join(timeout)
    if "error" in result:
        error = result["error"]
        if isinstance(error, WeightPushError):
            raise error
        raise WeightPushError(f"{what} failed: {type(error).__name__}: {error}") from error
    if "answer" not in result:
        raise WeightPushError(f"{what} did not answer within {timeout} s")
    return _check_answer(result["answer"], what)


def init_update_group(target: Any, master_address: str, master_port: int, world_size: int,
                      group_name: str = "fp8rl", backend: str = "nccl", timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """Create the update group between the trainer (rank 0, this process) and the engine's ranks (1..world_size-1);
    returns the trainer's process group for :func:`push_distributed`.

    Both sides block until every rank has joined, so the engine's request runs in a thread while this process
    joins as rank 0."""
    from sglang.srt.utils import init_custom_process_group

    if backend == "nccl":
        match_engine_nccl_env()
    args = dict(master_address=master_address, master_port=master_port, rank_offset=1, world_size=world_size,
                group_name=group_name, backend=backend)
    if isinstance(target, str):
        thread, result = _in_thread(lambda: _post(target, "/init_weights_update_group", args, timeout))
    else:
        thread, result = _in_thread(lambda: target.init_weights_update_group(**args))
    group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                      world_size=world_size, rank=0, group_name=group_name)
    _join(thread, result, "init_weights_update_group", timeout)
    return group


def match_engine_nccl_env(environ: Any = os.environ) -> None:
    """Set the NCCL variables the engine runs with where this process left them unset (before NCCL's first
    communicator here, which reads them); warn about one set to another value."""
    for name, value in ENGINE_NCCL_ENV.items():
        current = environ.setdefault(name, value)
        if current != value:
            logger.warning("[fp8rl] %s=%s here, but SGLang's engine runs NCCL with %s=%s: the update group's "
                           "broadcasts may fail (set %s=%s in the trainer)", name, current, name, value, name, value)


def push_distributed(target: Any, weights: NamedTensors, group: Any, group_name: str = "fp8rl",
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = DEFAULT_TIMEOUT_S,
                     complete: bool = True) -> list:
    """Push one trainer step over the update group: per bucket, the engine's request (in a thread) and our
    broadcasts. With ``complete`` (default) the step ends complete (an engine with calibrated FP8 KV scales then
    recalibrates): the session's end, or a marker request after the last bucket on engines without sessions.

    Every bucket passes :func:`preflight` before the first request, so no broadcast stops half-way on our side."""
    chunks = list(buckets(weights, bucket_bytes))
    for bucket in chunks:
        preflight(bucket, "update_weights_from_distributed")
    with step_session(target, timeout) as in_session:
        answers = [_broadcast_bucket(target, bucket, group, group_name, timeout) for bucket in chunks]
        if complete and not in_session:  # in a session, its end completes the step
            tp_size = _tp_size(target, timeout) if isinstance(target, str) else None
            _send_tensors(target, [(STEP_COMPLETE, torch.zeros(()))], tp_size, None, False,
                          "update_weights_from_distributed (step complete)", timeout)
    return answers


def _broadcast_bucket(target: Any, bucket: list, group: Any, group_name: str, timeout: float) -> Any:
    """One bucket over the update group: the engine's request in a thread, our broadcasts here."""
    meta = dict(names=[n for n, _ in bucket], dtypes=[str(t.dtype).replace("torch.", "") for _, t in bucket],
                shapes=[list(t.shape) for _, t in bucket], group_name=group_name)
    if isinstance(target, str):
        thread, result = _in_thread(lambda meta=meta: _post(target, "/update_weights_from_distributed", meta,
                                                            timeout))
    else:
        thread, result = _in_thread(lambda meta=meta: target.update_weights_from_distributed(**meta))
    for _, tensor in bucket:
        torch.distributed.broadcast(tensor.contiguous(), src=0, group=group)
    return _join(thread, result, f"update_weights_from_distributed ({meta['names'][0]} ...)", timeout)


def push_from_disk(target: Any, path: str, load_format: str = "auto", timeout: float = 1800.0) -> Any:
    """Make the engine load a checkpoint folder (validated in full before anything is written)."""
    if isinstance(target, str):
        answer = _post(target, "/update_weights_from_disk", {"model_path": path, "load_format": load_format}, timeout)
    else:
        answer = target.update_weights_from_disk(path, load_format=load_format)
    return _check_answer(answer, f"update_weights_from_disk({path!r})")
