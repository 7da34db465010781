"""FusedMoE method of `fp8_online_blockwise`: per-expert FP8 storage, quantize-on-load and on update, apply.

Storage follows SGLang's own FP8 MoE methods so its Triton MoE runner runs unchanged on GPU:

* block (``Fp8MoEMethod`` layout): ``w13_weight`` [E, 2*I, H] and ``w2_weight`` [E, H, I] float8_e4m3fn,
  ``w13_weight_scale_inv`` [E, 2*ceil(I/128), ceil(H/128)] and ``w2_weight_scale_inv`` [E, ceil(H/128), ceil(I/128)]
  float32 dequantization multipliers;
* per-channel fallback (``W8A8FP8MoEMethod`` layout, when the per-rank intermediate size ``I`` or ``H`` does not fit
  128-blocks): ``w13_weight_scale`` [E, 2*I, 1] and ``w2_weight_scale`` [E, H, 1].

``E`` is the number of local experts, ``I`` the per-rank intermediate size. Every tensor is allocated once in
``create_weights`` and only written in place, one expert slice at a time, so ``data_ptr`` never changes. The loader
takes HF-named per-expert tensors (``experts.{e}.gate_proj/up_proj/down_proj``, mapped by the model to ``w1``/``w3``/
``w2``), maps the global expert to this rank's local expert (expert parallelism) and takes this rank's part of it
(MoE tensor parallelism: rows of gate/up, columns of down).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Optional

import torch
from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend, MoeRunnerConfig
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput, StandardDispatchOutput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from sglang_fp8rl.compat.runtime import server_args as current_server_args
from sglang_fp8rl.layers.fp8_storage import (
    CHECK_ATTR,
    Fp8LayerState,
    IncomingWrite,
    check_incoming,
    check_incoming_dtype,
    dummy_bf16,
    refuse_scale,
    write_incoming,
    write_rows,
)
from sglang_fp8rl.layers.scheme import Scheme, SchemeDecision, choose_scheme
from sglang_fp8rl.quant import (
    FP8_DTYPE,
    ceil_div,
    dequantize_activation_groups,
    dequantize_blockwise,
    dequantize_per_channel,
    quantize_activation_groups,
)

if TYPE_CHECKING:
    from sglang_fp8rl.layers.config import Fp8OnlineBlockwiseConfig

SHARDS = ("w1", "w3", "w2")  # gate, up, down (SGLang's FusedMoE shard ids)
W13_SHARDS, W2_SHARDS = SHARDS[:2], SHARDS[2:]
EXPERT_WEIGHTS = ("w13_weight", "w2_weight")  # FusedMoE's parameters of every expert's gate/up and down


@dataclasses.dataclass
class MoeLayerState(Fp8LayerState):
    """State of one quantized FusedMoE layer: its sizes on this rank and the expert shards written so far."""

    num_local_experts: int = 0
    hidden_size: int = 0
    intermediate_local: int = 0
    loaded: set[tuple[int, str]] = dataclasses.field(default_factory=set)  # (local expert, shard id) written


def choose_moe_scheme(hidden: int, intermediate_local: int, block_size: tuple[int, int]) -> SchemeDecision:
    """One scheme for the whole layer: BLOCK if w13 and w2 both fit 128-blocks, else CHANNEL for both."""
    w13 = choose_scheme(hidden, [intermediate_local, intermediate_local], block_size, shard_names=["gate", "up"])
    w2 = choose_scheme(intermediate_local, [hidden], block_size, shard_names=["down"])
    if w13.scheme is Scheme.BLOCK and w2.scheme is Scheme.BLOCK:
        return w13
    reasons = [f"{name}: {d.reason}" for name, d in (("w13", w13), ("w2", w2)) if d.reason]
    return SchemeDecision(Scheme.CHANNEL, "; ".join(reasons))


# ---------------------------------------------------------------------------------------------------------------------
# placement and validation of one incoming expert tensor


@dataclasses.dataclass(frozen=True)
class ExpertTarget:
    """Where this rank's part of an incoming expert tensor goes."""

    local_expert: int
    shard_id: str
    src: tuple[slice, slice]  # of the full HF tensor
    dst_rows: slice  # rows of w13_weight[local] (w1/w3) or of w2_weight[local] (w2: all rows)


def expert_full_shape(shard_id: str, hidden: int, intermediate: int) -> tuple[int, int]:
    """The unsharded shape an expert tensor is sent in: gate/up (w1/w3) [I, H], down (w2) [H, I]."""
    return (hidden, intermediate) if shard_id in W2_SHARDS else (intermediate, hidden)


def unquantized_expert_shape(layer: torch.nn.Module, param_name: str, shard_id: Any) -> tuple[int, int]:
    """The shape an expert tensor for ``param_name`` of a FusedMoE kept in BF16 (SGLang's own loader) must have.

    That loader narrows this rank's 1/TP of the tensor's intermediate dimension into the expert's slice of the 3-D
    parameter; a smaller tensor would fill only its leading part and a broadcastable one all of it, so only the exact
    full shape is the slice's content."""
    expected = W2_SHARDS if param_name == EXPERT_WEIGHTS[1] else W13_SHARDS
    if shard_id not in expected:
        raise ValueError(f"shard id {shard_id!r} is not one of {expected}")
    return expert_full_shape(shard_id, layer.hidden_size, layer.intermediate_size_per_partition * layer.moe_tp_size)


def _param_name(layer: torch.nn.Module, param: torch.nn.Parameter) -> str:
    if param is layer.w13_weight:
        return "w13_weight"
    if param is layer.w2_weight:
        return "w2_weight"
    raise ValueError(f"{layer._fp8rl.prefix}: parameter of shape {tuple(param.shape)} is not w13_weight or w2_weight")


def expert_target(layer: torch.nn.Module, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: str,
                  expert_id: Optional[int]) -> Optional[ExpertTarget]:
    """Validate an incoming HF expert tensor (nothing is written); None if the expert lives on another rank."""
    state: MoeLayerState = layer._fp8rl
    name = f"{state.prefix}.{_param_name(layer, param)}"
    expected_shard = W13_SHARDS if param is layer.w13_weight else W2_SHARDS
    if shard_id not in expected_shard:
        raise ValueError(f"{name}: shard id {shard_id!r} is not one of {expected_shard}")
    if not isinstance(expert_id, int) or not 0 <= expert_id < layer.num_experts:
        raise ValueError(f"{name}: expert id {expert_id!r} is out of range [0, {layer.num_experts})")
    check_incoming_dtype(f"{name} expert {expert_id} {shard_id}", loaded)
    h, i_local, tp_rank = state.hidden_size, state.intermediate_local, layer.moe_tp_rank
    i_full = i_local * layer.moe_tp_size
    full_shape = expert_full_shape(shard_id, h, i_full)
    if tuple(loaded.shape) != full_shape:
        raise ValueError(f"{name} expert {expert_id} {shard_id}: expected an unsharded tensor of shape {full_shape}, "
                         f"got {tuple(loaded.shape)}")
    local = layer._map_global_expert_id_to_local_expert_id(expert_id)
    if local < 0 or local >= state.num_local_experts:
        return None
    part = slice(tp_rank * i_local, (tp_rank + 1) * i_local)
    if shard_id == "w2":
        return ExpertTarget(local, shard_id, (slice(0, h), part), slice(0, h))
    offset = 0 if shard_id == "w1" else i_local
    return ExpertTarget(local, shard_id, (part, slice(0, h)), slice(offset, offset + i_local))


def check_expert_weight(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                        weight_name: str = "", shard_id: str = "", expert_id: Optional[int] = None) -> IncomingWrite:
    """Everything :func:`load_expert_weight` checks, without writing; returns where it would write."""
    target = expert_target(layer, param, loaded_weight, shard_id, expert_id)
    if target is None:
        return IncomingWrite(layer._fp8rl)
    weight, scale = _expert_storage(layer, target.local_expert, shard_id)
    check_incoming(layer._fp8rl, loaded_weight, *target.src, target.dst_rows, weight.shape[0])
    return IncomingWrite(layer._fp8rl, weight, scale, *target.src, target.dst_rows)


# ---------------------------------------------------------------------------------------------------------------------
# writing


def _expert_storage(layer: torch.nn.Module, local: int, shard_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D FP8 weight of one local expert (w13 or w2) and its whole scale (2-D block, 1-D per row)."""
    state: MoeLayerState = layer._fp8rl
    is_w2 = shard_id == "w2"
    weight = (layer.w2_weight if is_w2 else layer.w13_weight).data[local]
    if state.is_block:
        scale = (layer.w2_weight_scale_inv if is_w2 else layer.w13_weight_scale_inv).data[local]
    else:
        scale = (layer.w2_weight_scale if is_w2 else layer.w13_weight_scale).data[local, :, 0]
    return weight, scale


def quantize_into_expert(layer: torch.nn.Module, w: torch.Tensor, local: int, shard_id: str,
                         dst_rows: slice) -> None:
    """Quantize ``w`` (this rank's 2-D part of one expert tensor) into its rows of the FP8 weight and scale."""
    weight, scale = _expert_storage(layer, local, shard_id)
    write_rows(layer._fp8rl, w, weight, scale, dst_rows)
    layer._fp8rl.loaded.add((local, shard_id))


def load_expert_weight(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                       weight_name: str = "", shard_id: str = "", expert_id: Optional[int] = None) -> None:
    """Weight loader of ``w13_weight``/``w2_weight`` (called as FusedMoE's: name, shard_id=, expert_id=)."""
    target = expert_target(layer, param, loaded_weight, shard_id, expert_id)
    if target is None:
        return
    weight, scale = _expert_storage(layer, target.local_expert, shard_id)
    write_incoming(layer._fp8rl, loaded_weight, *target.src, weight, scale, target.dst_rows)
    layer._fp8rl.loaded.add((target.local_expert, shard_id))


def fill_dummy_expert(layer: torch.nn.Module, local: int, shard_id: str) -> None:
    """Quantize dummy BF16 values into a never-loaded expert shard."""
    state: MoeLayerState = layer._fp8rl
    h, i = state.hidden_size, state.intermediate_local
    shape = (h, i) if shard_id == "w2" else (i, h)
    w = dummy_bf16(shape, layer.w13_weight.device, f"{state.prefix}.{local}.{shard_id}")
    rows = {"w1": slice(0, i), "w3": slice(i, 2 * i), "w2": slice(0, h)}[shard_id]
    quantize_into_expert(layer, w, local, shard_id, rows)


# ---------------------------------------------------------------------------------------------------------------------
# forward (CPU reference)


def _fake_quant_activations(x: torch.Tensor, state: MoeLayerState) -> torch.Tensor:
    """Activations as the FP8 kernel sees them: 1x128 groups (block) or one scale per token (channel)."""
    group = state.block_size[1] if state.is_block else x.shape[-1]
    q, s = quantize_activation_groups(x, group)
    return dequantize_activation_groups(q, s, group)


def _dequantized_expert(layer: torch.nn.Module, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (w13 [2I, H], w2 [H, I]) of one local expert."""
    state: MoeLayerState = layer._fp8rl
    if state.is_block:
        w13 = dequantize_blockwise(layer.w13_weight.data[local], layer.w13_weight_scale_inv.data[local],
                                   state.block_size)
        w2 = dequantize_blockwise(layer.w2_weight.data[local], layer.w2_weight_scale_inv.data[local], state.block_size)
    else:
        w13 = dequantize_per_channel(layer.w13_weight.data[local], layer.w13_weight_scale.data[local, :, 0])
        w2 = dequantize_per_channel(layer.w2_weight.data[local], layer.w2_weight_scale.data[local, :, 0])
    return w13, w2


def reference_moe(layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  routed_scaling_factor: Optional[float] = None) -> torch.Tensor:
    """Torch reference of the FP8 fused MoE (CPU path): silu(x W1^T) * (x W3^T) W2^T, weighted over the top-k."""
    state: MoeLayerState = layer._fp8rl
    i = state.intermediate_local
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for local in torch.unique(topk_ids).tolist():
        if local < 0 or local >= state.num_local_experts:
            continue  # routed to another rank (expert parallelism)
        tokens, slots = (topk_ids == local).nonzero(as_tuple=True)
        w13, w2 = _dequantized_expert(layer, local)
        gate_up = (_fake_quant_activations(x[tokens], state) @ w13.t()).to(x.dtype)
        act = (torch.nn.functional.silu(gate_up[:, :i].float()) * gate_up[:, i:].float()).to(x.dtype)
        y = _fake_quant_activations(act, state) @ w2.t()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float()[:, None])
    if routed_scaling_factor is not None:
        out *= routed_scaling_factor
    return out.to(x.dtype)


def refuse_expert_relocation(prefix: str) -> None:
    """Our loader writes each expert once, at its local index: EPLB's redundant/relocated copies would stay empty."""
    args = current_server_args()
    if args.enable_eplb or args.ep_num_redundant_experts or args.init_expert_location != "trivial":
        raise ValueError(
            f"{prefix}: fp8_online_blockwise does not support EPLB / redundant or relocated experts "
            "(--enable-eplb, --ep-num-redundant-experts, --init-expert-location); serve without them"
        )


class Fp8OnlineBlockwiseMoEMethod(FusedMoEMethodBase):
    """Blockwise (or per-rank per-channel fallback) FP8 fused MoE quantized online from BF16 expert weights."""

    def __init__(self, quant_config: Fp8OnlineBlockwiseConfig, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix
        self.moe_runner_config = None
        self.runner = None

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if extra_weight_attrs.get("with_bias"):
            raise ValueError(f"{self.prefix}: fp8_online_blockwise does not support MoE experts with biases")
        refuse_expert_relocation(self.prefix)
        config = self.quant_config
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        decision = choose_moe_scheme(h, i, config.block_size)
        layer._fp8rl = MoeLayerState(self.prefix, decision, config.block_size, config.options.scale_format, e, h, i)
        self._register_weight(layer, "w13_weight", torch.empty(e, 2 * i, h, dtype=FP8_DTYPE))
        self._register_weight(layer, "w2_weight", torch.empty(e, h, i, dtype=FP8_DTYPE))
        if decision.scheme is Scheme.BLOCK:
            bn, bk = config.block_size
            self._register_scale(layer, "w13_weight_scale_inv", (e, 2 * ceil_div(i, bn), ceil_div(h, bk)))
            self._register_scale(layer, "w2_weight_scale_inv", (e, ceil_div(h, bn), ceil_div(i, bk)))
        else:
            self._register_scale(layer, "w13_weight_scale", (e, 2 * i, 1))
            self._register_scale(layer, "w2_weight_scale", (e, h, 1))
        layer.w13_input_scale = None
        layer.w2_input_scale = None
        config.report.record(self.prefix, decision)

    @staticmethod
    def _register_weight(layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
        # our own loader, not FusedMoE.weight_loader (passed in extra_weight_attrs): it quantizes into the slice
        param = torch.nn.Parameter(data, requires_grad=False)
        param.weight_loader = functools.partial(load_expert_weight, layer)
        setattr(param, CHECK_ATTR, functools.partial(check_expert_weight, layer))
        layer.register_parameter(name, param)

    def _register_scale(self, layer: torch.nn.Module, name: str, shape: tuple[int, ...]) -> None:
        param = torch.nn.Parameter(torch.ones(shape, dtype=torch.float32), requires_grad=False)
        param.weight_loader = functools.partial(refuse_scale, self.prefix, name)
        setattr(param, CHECK_ATTR, param.weight_loader)  # the dry run refuses it too, before any shape rule
        layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Idempotent and pointer-stable: never rebinds ``.data``; fills never-loaded expert shards (dummy)."""
        state: MoeLayerState = layer._fp8rl
        for local in range(state.num_local_experts):
            for shard_id in SHARDS:
                if (local, shard_id) not in state.loaded:
                    fill_dummy_expert(layer, local, shard_id)
                    self.quant_config.report.record_dummy_fill(self.prefix)
        self.quant_config.report.mark_processed(self.prefix)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config: MoeRunnerConfig) -> None:
        self.moe_runner_config = moe_runner_config
        self.runner = MoeRunner(MoeRunnerBackend.TRITON, moe_runner_config)

    def get_triton_quant_info(self, layer: torch.nn.Module) -> TritonMoeQuantInfo:
        if layer._fp8rl.is_block:
            return TritonMoeQuantInfo(
                w13_weight=layer.w13_weight, w2_weight=layer.w2_weight, use_fp8_w8a8=True,
                w13_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
                block_shape=list(layer._fp8rl.block_size),
            )
        return TritonMoeQuantInfo(
            w13_weight=layer.w13_weight, w2_weight=layer.w2_weight, use_fp8_w8a8=True, per_channel_quant=True,
            w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
        )

    def apply(self, layer: torch.nn.Module, dispatch_output: StandardDispatchOutput) -> StandardCombineInput:
        x = dispatch_output.hidden_states
        if x.is_cuda:
            return self.runner.run(dispatch_output, self.get_triton_quant_info(layer))
        return self._apply_reference(layer, dispatch_output)

    def _apply_reference(self, layer: torch.nn.Module, dispatch_output: StandardDispatchOutput) -> StandardCombineInput:
        config = self.moe_runner_config
        if config.activation != "silu" or config.apply_router_weight_on_input:
            raise NotImplementedError(f"{self.prefix}: the CPU reference MoE supports silu and router weights "
                                      "applied on the output only")
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        out = reference_moe(layer, dispatch_output.hidden_states, topk_weights, topk_ids,
                            config.routed_scaling_factor)
        return StandardCombineInput(hidden_states=out)
