"""SGLang's model runner, server args, requests and layers, as each supported release lays them out.

One function per difference: the release where it starts and what it hides. Adapters look for the feature itself
(a module, a method, an attribute), so a post-release that backports a change is handled too.
"""

from __future__ import annotations

import functools
import importlib
import sys
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


def extend_forward_batch(reqs: Sequence[Any], model_runner: Any) -> Any:
    """The ``ForwardBatch`` of one prefill of ``reqs`` over the runner's live pools, built as one_batch's ``extend``
    builds it before its forward: the release's own stand-in prefix cache, ``ScheduleBatch.init_new`` and
    ``prepare_for_extend`` (which take the request and KV slots), then ``ForwardBatch.init_new``. The page size is
    ``get_schedule().page_size`` from 0.5.21, ``server_args.page_size`` before; ``ForwardBatch.init_new`` takes
    ``get_model_worker_batch()`` in 0.5.12 and the ScheduleBatch itself from 0.5.15 (its prefill input ids moved to
    the device first), with ``return_hidden_states_before_norm`` required from 0.5.17. one_batch's MLP-sync step is
    left out: it is a TP collective only under DP attention, which the callers refuse."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    module = one_batch()
    schedule = getattr(module, "get_schedule", None)
    page_size = schedule().page_size if schedule is not None else model_runner.server_args.page_size
    tree_cache = module.TreeCacheNamespace(page_size=page_size, device=model_runner.device,
                                           token_to_kv_pool_allocator=model_runner.token_to_kv_pool_allocator)
    batch = ScheduleBatch.init_new(reqs=list(reqs), req_to_token_pool=model_runner.req_to_token_pool,
                                   token_to_kv_pool_allocator=model_runner.token_to_kv_pool_allocator,
                                   tree_cache=tree_cache, model_config=model_runner.model_config,
                                   enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    if hasattr(batch, "get_model_worker_batch"):  # 0.5.12
        return ForwardBatch.init_new(batch.get_model_worker_batch(), model_runner)
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        batch.prefill_input_ids_cpu = None
    return ForwardBatch.init_new(batch, model_runner, **_forward_batch_options())


@functools.cache
def _forward_batch_options() -> dict[str, Any]:
    import inspect

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    parameters = inspect.signature(ForwardBatch.init_new).parameters
    return {"return_hidden_states_before_norm": False} if "return_hidden_states_before_norm" in parameters else {}


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
    """The ModelRunner method after which every CUDA graph is captured (the load-time KV calibration runs right after
    it): ``init_cuda_graphs`` from 0.5.14; before, ``init_piecewise_cuda_graphs``, which those releases run after
    ``init_device_graphs`` (a forward reads the piecewise runner it sets)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    return "init_cuda_graphs" if hasattr(ModelRunner, "init_cuda_graphs") else "init_piecewise_cuda_graphs"


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


def decode_graph_max_to_fill(namespace: Any) -> str | None:
    """The decode CUDA-graph max-batch field of a parsed command line that is ours to set, or None where the command
    line sets the decode capture itself or has no such field. What sets it, by release: the max batch and the batch
    list (:func:`decode_graph_limit_fields`) and ``disable_cuda_graph`` in every release; ``cuda_graph_config``,
    ``cuda_graph_backend_decode`` and ``disable_decode_cuda_graph`` from 0.5.15 (one setting per phase)."""
    max_field, list_field = decode_graph_limit_fields(namespace)
    user_set = any(getattr(namespace, name, None) not in (None, False) for name in (
        max_field, list_field, "cuda_graph_config", "cuda_graph_backend_decode", "disable_cuda_graph",
        "disable_decode_cuda_graph"))
    return None if user_set or not hasattr(namespace, max_field) else max_field


def decode_graph_flags(batch_sizes: Sequence[int] | None = None, max_bs: int | None = None) -> list[str]:
    """launch_server flags that capture decode CUDA graphs for ``batch_sizes`` (or SGLang's sizes up to ``max_bs``;
    its defaults when both are None) and turn the prefill CUDA graph off, named after the installed ServerArgs'
    fields: ``--cuda-graph-bs-decode`` / ``--cuda-graph-max-bs-decode`` and ``--cuda-graph-backend-prefill disabled``
    from 0.5.15 (one setting per phase; the older flags became deprecated aliases there), ``--cuda-graph-bs`` /
    ``--cuda-graph-max-bs`` and ``--disable-piecewise-cuda-graph`` before (prefill graphs were the piecewise ones).
    The fields are a dataclass's up to 0.5.20 and a msgspec Struct's from 0.5.21."""
    if batch_sizes is not None and max_bs is not None:
        # before 0.5.15 an explicit list overrides the max (SGLang sets max = max(list)): one of the two is the request
        raise ValueError("decode_graph_flags takes batch_sizes or max_bs, not both")
    fields = server_arg_fields()
    if "cuda_graph_bs_decode" in fields:
        bs_flag, max_flag = "--cuda-graph-bs-decode", "--cuda-graph-max-bs-decode"
    elif "cuda_graph_bs" in fields:
        bs_flag, max_flag = "--cuda-graph-bs", "--cuda-graph-max-bs"
    else:
        raise RuntimeError("this SGLang's ServerArgs has neither cuda_graph_bs_decode nor cuda_graph_bs")
    if "cuda_graph_backend_prefill" in fields:
        prefill_off = ["--cuda-graph-backend-prefill", "disabled"]
    elif "disable_piecewise_cuda_graph" in fields:
        prefill_off = ["--disable-piecewise-cuda-graph"]
    else:
        raise RuntimeError("this SGLang's ServerArgs has neither cuda_graph_backend_prefill nor "
                           "disable_piecewise_cuda_graph")
    flags: list[str] = []
    if batch_sizes is not None:
        sizes = [int(b) for b in batch_sizes]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"decode graph batch sizes must be positive, got {list(batch_sizes)}")
        flags += [bs_flag, *(str(b) for b in sizes)]
    if max_bs is not None:
        if int(max_bs) < 1:
            raise ValueError(f"decode graph max batch size must be positive, got {max_bs}")
        flags += [max_flag, str(int(max_bs))]
    return flags + prefill_off


def cuda_graph_config(args: Any) -> Any:
    """The resolved CUDA-graph capture configuration (``.decode`` / ``.prefill``, each with ``backend`` and ``bs``):
    a ServerArgs field up to 0.5.20; from 0.5.21 a resolution declared over the arguments, read through
    ``arg_groups.overrides.resolved_view`` (the field itself keeps the user's raw input). None before 0.5.14, whose
    ServerArgs had flat ``cuda_graph_bs`` / ``disable_cuda_graph`` fields instead."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view
    except ImportError:
        return getattr(args, "cuda_graph_config", None)
    return getattr(resolved_view(args), "cuda_graph_config", None)


def decode_graphs_off(args: Any) -> bool:
    """Whether decode runs without CUDA graphs: the resolved decode backend is ``disabled`` (0.5.15-0.5.20, and later
    ones once the launch has resolved it), else the raw ``cuda_graph_backend_decode`` (0.5.21+ before resolution, as
    ``from_cli_args`` leaves it on a machine without a GPU), else ``disable_cuda_graph`` (before 0.5.15)."""
    decode = getattr(cuda_graph_config(args), "decode", None)
    if getattr(decode, "backend", None) is not None:
        return decode.backend == "disabled"
    if getattr(args, "cuda_graph_backend_decode", None) is not None:
        return args.cuda_graph_backend_decode == "disabled"
    return bool(getattr(args, "disable_cuda_graph", False))


def captured_token_counts(args: Any) -> list[int]:
    """Token counts SGLang captures CUDA graphs for: decode batch sizes and prefill token counts of every phase whose
    backend is not ``disabled`` (from the resolved configuration, :func:`cuda_graph_config`); before 0.5.14 the flat
    ``cuda_graph_bs`` list unless ``disable_cuda_graph`` (decode only: those releases capture no prefill graph
    through it)."""
    config = cuda_graph_config(args)
    if config is None:
        if getattr(args, "disable_cuda_graph", False):
            return []
        return sorted({int(b) for b in (getattr(args, "cuda_graph_bs", None) or ()) if int(b) > 0})
    counts: set[int] = set()
    for phase in ("decode", "prefill"):
        phase_config = getattr(config, phase, None)
        if phase_config is None or getattr(phase_config, "backend", "disabled") == "disabled":
            continue
        counts.update(int(b) for b in (getattr(phase_config, "bs", None) or ()) if int(b) > 0)
    return sorted(counts)


def server_arg_fields() -> set[str]:
    """The names of SGLang's ServerArgs fields: a dataclass's up to 0.5.20, a msgspec Struct's from 0.5.21."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    if dataclasses.is_dataclass(ServerArgs):
        return {f.name for f in dataclasses.fields(ServerArgs)}
    return set(getattr(ServerArgs, "__struct_fields__", ()))


def no_graph_flags() -> list[str]:
    """Command-line flags that turn every CUDA/CPU graph capture off: ``--cuda-graph-backend-{decode,prefill}
    disabled`` from 0.5.15, ``--disable-cuda-graph`` before (and ``--disable-piecewise-cuda-graph`` where it exists,
    which those releases use for prefill)."""
    fields = server_arg_fields()
    if "cuda_graph_backend_decode" in fields:
        return ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]
    return ["--disable-cuda-graph"] + (["--disable-piecewise-cuda-graph"]
                                       if "disable_piecewise_cuda_graph" in fields else [])


def fp8_kernel_module() -> Any:
    """SGLang's FP8 quantization kernels (``sglang_per_token_group_quant_fp8``): ``sglang.kernels.ops.quantization
    .fp8_kernel`` from 0.5.17, ``sglang.srt.layers.quantization.fp8_kernel`` before (the module moved)."""
    try:
        return importlib.import_module("sglang.kernels.ops.quantization.fp8_kernel")
    except ModuleNotFoundError:
        return importlib.import_module("sglang.srt.layers.quantization.fp8_kernel")


# The parameters of SGLang's DeepGEMM block linear in the releases whose body is "1x128 activation quantization in
# DeepGEMM's layout, then deep_gemm.fp8_gemm_nt" (0.5.12-0.5.21); 0.5.23 adds act_scale_ue8m0 / weight_bf16 paths.
DEEPGEMM_LINEAR_PARAMS = ("input", "weight", "block_size", "weight_scale", "input_scale", "bias")


def deepgemm_linear_is_quant_then_gemm(fn: Any) -> bool:
    """Whether SGLang's DeepGEMM block linear ``fn`` is the two launches that :func:`sglang_fp8rl.kernels.deepgemm
    .linear_direct` makes: its parameters are exactly those of 0.5.12-0.5.21 (0.5.23 adds more and is not)."""
    import inspect

    try:
        return tuple(inspect.signature(fn).parameters) == DEEPGEMM_LINEAR_PARAMS
    except (TypeError, ValueError):
        return False


def internal_state_dict(answer: Any) -> dict:
    """The state dict in ``Scheduler.get_internal_state``'s answer (one entry of ``/get_server_info``'s
    ``internal_states``): ``GetInternalStateReqOutput.internal_state`` in every supported release (0.5.12+); the answer
    itself, a plain dict, in the releases before."""
    return answer.internal_state if hasattr(answer, "internal_state") else answer


def ready_for_forward(runner: Any) -> None:
    """Let the load-time calibration run a forward inside ``ModelRunner.initialize``: up to 0.5.13 the runner sets
    ``support_pp`` (read by every forward) only after ``initialize`` returns, where graphs are already captured. It
    is set here the way SGLang sets it (SGLang sets it again, to the same value, right after)."""
    if not hasattr(runner, "support_pp"):
        import inspect

        runner.support_pp = "pp_proxy_tensors" in inspect.signature(runner.model.forward).parameters


# FlashAttention-3's entry point as SGLang's FA3 backend calls it: its module binds ``flash_attn_with_kvcache`` at
# module level and its ``forward_decode`` calls that global (every supported release: tests/test_decode_attention.py
# reads their sources), so the module attribute is where a decode call can be redirected
FA3_BACKEND_CLASS = "FlashAttentionBackend"
FA3_DECODE_FUNCTION = "flash_attn_with_kvcache"


def fa3_kernel_module(backend: Any) -> Any:
    """The module whose ``flash_attn_with_kvcache`` the FA3 backend class ``backend`` is or derives from calls, or
    None if ``backend`` is no FA3 backend."""
    for cls in type(backend).__mro__:
        if cls.__name__ == FA3_BACKEND_CLASS:
            module = sys.modules.get(cls.__module__)
            return module if module is not None and hasattr(module, FA3_DECODE_FUNCTION) else None
    return None


def rmsnorm_blocker(norm: Any) -> str | None:
    """Why an SGLang RMSNorm is not the plain ``x * rsqrt(mean(x^2) + eps) * weight`` (a BF16 residual added first)
    that kernels/norm_quant computes, or None. Its options came over the releases (0.5.12's has fewer of them)."""
    if getattr(norm, "variance_size_override", None) is not None:
        return "its variance is taken over part of the width"
    if getattr(norm, "cast_x_before_out_mul", False):
        return "it rounds to BF16 before the weight multiply"
    if getattr(norm, "fp32_residual", False):
        return "its residual is float32"
    if getattr(norm, "override_orig_dtype", None) is not None:
        return "its output dtype is overridden"
    if not getattr(norm, "has_weight", True):
        return "it has no weight"
    return None
