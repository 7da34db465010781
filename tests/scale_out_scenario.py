"""Worker scenario (run by tests/sgl_worker.py) for scale-out setups on a tiny Qwen3-MoE through SGLang's real CPU
ModelRunner: expert parallelism (`--tp-size N --ep-size N`, each rank holding only its experts) and DP attention
(`--enable-dp-attention --dp-size N`, attention replicated within each DP group, experts split over every rank).

SGLang 0.5.17 on CPU with `--ep-size` and `--moe-a2a-backend none`: `FusedMoE` gives each rank
`num_experts / ep_size` whole experts (`fused_moe_triton/layer.py:300-302`, the map at :889-897) and
`moe_tp_size = tp_size / ep_size` (`distributed/parallel_state.py:2434`); `create_moe_dispatcher` picks the
`StandardDispatcher` (`fused_moe_triton/layer.py:139-151`), which turns the router's global expert ids into local
ones, -1 for another rank's expert (`token_dispatcher/standard.py:186-238`); the Qwen3-MoE block then all-reduces the
partial outputs over the EP group (`models/qwen3_moe.py:331-335`). Our method's CPU reference skips the -1 ids; on GPU
SGLang's Triton runner does (`moe_runner/triton.py:175`, "none"/"triton").

DP attention loads and updates on CPU, but its forward does not run there: the MLP sync pads the batch with the
attention backend's CUDA-graph fill value (`model_executor/forward_batch_info.py:1443`), which SGLang's torch-native
backend does not define (`layers/attention/base_attn_backend.py:161`, NotImplementedError); `forward: false` skips
the logits.
"""

from __future__ import annotations

import torch
from sgl_worker import logits_for, pointers, scheme_report, snapshot

from sglang_fp8rl.compat.updates import updater_of


def allow_cpu_expert_map() -> None:
    """Let the StandardDispatcher build its global->local expert map on CPU.

    It allocates the map on `get_device()` (`token_dispatcher/standard.py:192`), which names the CPU only when
    SGLANG_USE_CPU_ENGINE=1 (`utils/common.py:208-210`) and otherwise raises "No accelerator" (:915); that variable
    also switches SGLang to sgl_kernel's CPU operators, which this environment does not have. The map itself is
    SGLang's, built by its own code on the device every other tensor of this runner lives on."""
    from sglang.srt.layers.moe.token_dispatcher import standard

    standard.get_device = lambda device_id=None: "cpu"


def moe_layers(model) -> dict[str, torch.nn.Module]:
    """The quantized FusedMoE layers of the model, by module name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "_fp8rl") and hasattr(m, "w13_weight")}


def placement(model) -> dict[str, dict]:
    """Per MoE layer: this rank's EP/TP coordinates, and the local slot of every global expert as the loader maps it
    (FusedMoE._map_global_expert_id_to_local_expert_id, what our loader asks) and as the router's dispatcher maps it
    (after a forward has built that map)."""
    out = {}
    for name, layer in moe_layers(model).items():
        mapping = layer.dispatcher.local_expert_mapping
        out[name] = {"ep_rank": layer.moe_ep_rank, "ep_size": layer.moe_ep_size, "moe_tp_size": layer.moe_tp_size,
                     "num_local": layer.num_local_experts, "dispatcher": type(layer.dispatcher).__name__,
                     "loader_map": [layer._map_global_expert_id_to_local_expert_id(g)
                                    for g in range(layer.num_experts)],
                     "router_map": None if mapping is None else mapping.tolist()}
    return out


def attention_tp(model) -> dict[str, tuple[int, int]]:
    """(rank, size) of the tensor-parallel split of each attention projection, as the layer itself holds it."""
    from sglang_fp8rl.compat.runtime import linear_tp

    return {name: linear_tp(m) for name, m in model.named_modules()
            if name.endswith(("self_attn.qkv_proj", "self_attn.o_proj"))}


def _state() -> dict:
    from sglang_fp8rl.weight_sync.engine_state import engine_state

    return {"consistent": engine_state().consistent, "dirty": sorted(engine_state().dirty)}


def scenario_scale_out(runner, extra: dict) -> dict:
    """A cold start, then each saved request in order (by tensor, or from disk), with every rank's answer, parameters
    and engine state after each; logits where a request asks for them (unless ``forward`` is false); the expert
    placement and the attention split at the end."""
    allow_cpu_expert_map()
    model = runner.torch_runner.model
    updater = updater_of(runner.torch_runner)
    forward = extra.get("forward", True)
    out = {"report": scheme_report(model), "cold": snapshot(model), "ptrs_before": pointers(model), "steps": [],
           "cold_logits": logits_for(runner) if forward else []}
    for req in torch.load(extra["requests"], weights_only=False):
        if req.get("kind") == "disk":
            answer = updater.update_weights_from_disk(req["path"], "auto")
        else:
            answer = updater.update_weights_from_tensor(req["tensors"])
        step = {"name": req["name"], "answer": answer, "params": snapshot(model), **_state()}
        if req.get("logits") and forward:
            step["logits"] = logits_for(runner)
        out["steps"].append(step)
    out["ptrs_after"] = pointers(model)
    out["placement"] = placement(model)
    out["attention_tp"] = attention_tp(model)
    return out
