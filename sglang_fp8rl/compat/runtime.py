"""SGLang's model runner, server args, requests and layers, as each supported release lays them out.

One function per difference: the release where it starts and what it hides. Adapters look for the feature itself
(a module, a method, an attribute), so a post-release that backports a change is handled too.
"""

from __future__ import annotations

import functools
import importlib
from array import array
from typing import Any, Sequence


def server_args() -> Any:
    """The ServerArgs in force in this process: ``runtime_context.get_server_args()`` from 0.5.20 (where
    ``get_global_server_args`` was retired: it raises from 0.5.21), ``server_args.get_global_server_args()`` before."""
    try:
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        get_server_args = None
    if get_server_args is not None:
        try:
            args = get_server_args()
        except (AttributeError, RuntimeError, ValueError):  # 0.5.15-0.5.19: the context exists but is not filled
            args = None
        if args is not None:
            return args
    from sglang.srt.server_args import get_global_server_args

    return get_global_server_args()


@functools.cache
def one_batch() -> Any:
    """SGLang's single-batch benchmark module (``load_model``, ``extend``, ``decode``): ``sglang.benchmark.one_batch``
    from 0.5.15, ``sglang.bench_one_batch`` before."""
    try:
        return importlib.import_module("sglang.benchmark.one_batch")
    except ModuleNotFoundError:
        return importlib.import_module("sglang.bench_one_batch")


def prefill_request(rid: str, ids: Sequence[int], max_new_tokens: int) -> Any:
    """A greedy ``Req`` for ``ids``, ready for a prefill of the whole prompt, as SGLang's one_batch builds it: the
    extend range is ``set_extend_input_len`` up to 0.5.13, ``set_extend_range`` in 0.5.14-0.5.21, ``extend_end``
    from 0.5.22."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    if hasattr(Req, "set_extend_input_len"):  # 0.5.12-0.5.13
        req = Req(rid=rid, origin_input_text="", origin_input_ids=list(ids), sampling_params=params)
        req.fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.set_extend_input_len(len(req.fill_ids))
        return req
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids), sampling_params=params)
    req.full_untruncated_fill_ids = req.origin_input_ids
    req.logprob_start_len = -1
    if hasattr(Req, "set_extend_range"):  # 0.5.14-0.5.21
        req.set_extend_range(0, len(ids))
    else:
        req.extend_end = len(ids)
    return req


def req_pool_index(req: Any) -> Any:
    """The request's row of ``req_to_token``: ``req.req_pool_idx`` up to 0.5.20, ``req.kv.req_pool_idx`` after
    (where ``req.kv`` holds the request's KV registers)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv.req_pool_idx
    return getattr(req, "req_pool_idx", None)


def allocated_kv_len(req: Any) -> int:
    """How many KV slots the allocation handed the request: ``req.kv.kv_allocated_len`` from 0.5.15,
    ``req.kv_allocated_len`` before."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "kv_allocated_len"):
        return int(kv.kv_allocated_len)
    return int(getattr(req, "kv_allocated_len", 0) or 0)


def attention_backend_init() -> str:
    """The ModelRunner method that creates the attention backends: ``init_attention_backends`` from 0.5.14,
    ``init_attention_backend`` before."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    return "init_attention_backends" if hasattr(ModelRunner, "init_attention_backends") else "init_attention_backend"


def graph_capture_init() -> str:
    """The ModelRunner method that captures the CUDA graphs: ``init_cuda_graphs`` from 0.5.14, ``init_device_graphs``
    before."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    return "init_cuda_graphs" if hasattr(ModelRunner, "init_cuda_graphs") else "init_device_graphs"


def linear_tp(layer: Any) -> tuple[int, int]:
    """(rank, size) of a linear layer's tensor-parallel split: ``tp_rank`` / ``tp_size`` attributes up to 0.5.21,
    read from the layer's ``tp_group`` from 0.5.22 (None there means unsharded)."""
    if hasattr(layer, "tp_rank") and hasattr(layer, "tp_size"):
        return int(layer.tp_rank), int(layer.tp_size)
    group = getattr(layer, "tp_group", None)
    return (0, 1) if group is None else (int(group.rank_in_group), int(group.world_size))


def load_bench_model(args: Any, port_args: Any, tp_rank: int) -> tuple[Any, Any]:
    """SGLang's ``one_batch.load_model`` for this rank (``(bench_runner, tokenizer)``). From 0.5.21 the process's
    runtime context must be published first (role ``scheduler``, this rank's placement), as one_batch's own entry
    points do; before, the server args were global and nothing was published."""
    module = one_batch()
    if hasattr(module, "publish") and hasattr(module, "SpawnRanks"):
        ranks = module.SpawnRanks(world_rank=module.spawn_world_rank(args, tp_rank=tp_rank, pp_rank=0), gpu_id=tp_rank)
        module.publish(args, role="scheduler", ranks=ranks)
        init_configs = getattr(module, "_init_process_global_configs", None)
        if init_configs is not None:
            init_configs()
    return module.load_model(args, port_args, tp_rank, tp_rank)


def decode_graph_limit_fields(namespace: Any) -> tuple[str, str]:
    """(max batch, batch list) fields of the decode CUDA-graph capture on a parsed command line:
    ``cuda_graph_max_bs_decode`` / ``cuda_graph_bs_decode`` from 0.5.15 (``--cuda-graph-max-bs`` kept as an alias),
    ``cuda_graph_max_bs`` / ``cuda_graph_bs`` before (one setting for decode and prefill)."""
    if hasattr(namespace, "cuda_graph_max_bs_decode"):
        return "cuda_graph_max_bs_decode", "cuda_graph_bs_decode"
    return "cuda_graph_max_bs", "cuda_graph_bs"
