"""Linear method of `fp8_online_blockwise`: final-layout FP8 storage, per-rank scheme, quantize-on-load, apply.

Storage follows SGLang's own `Fp8LinearMethod` so its GEMM dispatch runs unchanged on GPU:

* block layers: ``weight`` [N_local, K_local] float8_e4m3fn and ``weight_scale_inv`` [ceil(N_local/128),
  ceil(K_local/128)] float32 (the dequantization multiplier, see :mod:`sglang_fp8rl.quant`);
* per-channel layers (per-rank shapes that do not fit 128-blocks): ``weight`` as above and ``weight_scale`` [N_local]
  float32, one multiplier per output row.

Both are allocated once in ``create_weights`` and only ever written in place (``copy_`` into row slices), so their
``data_ptr`` never changes: captured CUDA graphs and the weight-update path rely on it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.layers.linear import QKVParallelLinear
from sglang.srt.layers.parameter import (
    BlockQuantScaleParameter,
    ChannelQuantScaleParameter,
    ModelWeightParameter,
)
from sglang.srt.layers.quantization.base_config import LinearMethodBase

from sglang_fp8rl.kernels import gemm_select, producers
from sglang_fp8rl.layers.fp8_storage import (
    CHECK_ATTR,
    Fp8LayerState,
    IncomingWrite,
    check_incoming,
    check_incoming_dtype,
    dummy_bf16,
    layer_state,
    refuse_scale,
    write_incoming,
    write_rows,
)
from sglang_fp8rl.layers.placement import ShardId, ShardPlacement, placement_for_layer
from sglang_fp8rl.layers.scheme import Scheme, choose_scheme
from sglang_fp8rl.quant import (
    DEFAULT_GROUP_SIZE,
    FP8_DTYPE,
    blockwise_scale_shape,
    dequantize_activation_groups,
    dequantize_blockwise,
    dequantize_per_channel,
    quantize_activation_groups,
)

if TYPE_CHECKING:
    from sglang_fp8rl.layers.config import Fp8OnlineBlockwiseConfig


@dataclasses.dataclass
class LayerState(Fp8LayerState):
    """State of one quantized linear layer: rows written so far (0 means never loaded: dummy fill)."""

    rows_loaded: int = 0


def shard_names(layer: torch.nn.Module, n_shards: int) -> list[str]:
    """Human names of a fused layer's logical output shards, for reports."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if n_shards == 2:
        return ["gate", "up"]
    return [str(i) for i in range(n_shards)]


def block_shapes(model: torch.nn.Module, device_type: str = "cuda") -> list[tuple[int, int]]:
    """(N, K) of every 128x128-block FP8 linear of ``model`` on this rank whose weight lives on ``device_type``."""
    shapes = set()
    for module in model.modules():
        state = layer_state(module)
        if (isinstance(state, LayerState) and state.is_block and tuple(state.block_size) == gemm_select.BLOCK
                and module.weight.device.type == device_type):
            shapes.add((int(module.weight.shape[0]), int(module.weight.shape[1])))
    return sorted(shapes)


# ---------------------------------------------------------------------------------------------------------------------
# loading


def quantize_rows_into_layer(layer: torch.nn.Module, w: torch.Tensor, dst_rows: slice) -> None:
    """Quantize ``w`` (rows ``dst_rows`` of the local weight, full K_local) straight into the FP8 weight and scale."""
    state: LayerState = layer._fp8rl
    write_rows(state, w, layer.weight.data, _scale(layer).data, dst_rows)
    state.rows_loaded += dst_rows.stop - dst_rows.start


def _scale(layer: torch.nn.Module) -> torch.nn.Parameter:
    return layer.weight_scale_inv if layer._fp8rl.is_block else layer.weight_scale


def placement_for_incoming(layer: torch.nn.Module, loaded_weight: torch.Tensor,
                           loaded_shard_id: ShardId) -> ShardPlacement:
    """This rank's placement of an incoming tensor, after checking its dtype and full shape."""
    check_incoming_dtype(f"{layer._fp8rl.prefix}.weight", loaded_weight)
    placement = placement_for_layer(layer, loaded_shard_id)
    if tuple(loaded_weight.shape) != tuple(placement.full_shape):
        shard = "" if loaded_shard_id is None else f" shard {loaded_shard_id!r}"
        raise ValueError(f"{layer._fp8rl.prefix}.weight{shard}: expected an unsharded tensor of shape "
                         f"{tuple(placement.full_shape)}, got {tuple(loaded_weight.shape)}")
    return placement


def check_weight_shard(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                       loaded_shard_id: ShardId = None) -> IncomingWrite:
    """Everything :func:`load_weight_shard` checks, without writing; returns where it would write."""
    p = placement_for_incoming(layer, loaded_weight, loaded_shard_id)
    check_incoming(layer._fp8rl, loaded_weight, p.src_rows, p.src_cols, p.dst_rows, layer.weight.shape[0])
    return IncomingWrite(layer._fp8rl, layer.weight.data, _scale(layer).data, p.src_rows, p.src_cols, p.dst_rows)


def load_weight_shard(layer: torch.nn.Module, param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: ShardId = None) -> None:
    """Weight loader of our FP8 ``weight``: take this rank's slice of a full HF tensor and write it in place
    (quantized from BF16/FP16/FP32, or pre-quantized codes with their scales).

    Placement (TP narrowing, KV-head replication, q/k/v and gate/up offsets) comes from
    :mod:`sglang_fp8rl.layers.placement`, whose helpers are tested against SGLang's own loaders.
    """
    p = placement_for_incoming(layer, loaded_weight, loaded_shard_id)
    write_incoming(layer._fp8rl, loaded_weight, p.src_rows, p.src_cols, layer.weight.data, _scale(layer).data,
                   p.dst_rows)
    layer._fp8rl.rows_loaded += p.dst_rows.stop - p.dst_rows.start


def fill_dummy(layer: torch.nn.Module) -> None:
    """Quantize dummy BF16 values into a never-loaded layer (``--load-format dummy``)."""
    weight = layer.weight.data
    quantize_rows_into_layer(layer, dummy_bf16(tuple(weight.shape), weight.device, layer._fp8rl.prefix),
                             slice(0, weight.shape[0]))


# ---------------------------------------------------------------------------------------------------------------------
# forward


def reference_linear(layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Torch reference of the FP8 GEMM (CPU path): quantized activations x dequantized weights, fp32 accumulation."""
    state = layer._fp8rl
    group = state.block_size[1] if state.is_block else x.shape[-1]  # per-channel layers use per-token activations
    handed = producers.quantized_input(x) if group == DEFAULT_GROUP_SIZE else None
    if handed is not None:
        producers.note_taken()
    xq, xs = handed if handed is not None else quantize_activation_groups(x, group)
    x_deq = dequantize_activation_groups(xq, xs, group)
    if state.is_block:
        w_deq = dequantize_blockwise(layer.weight.data, layer.weight_scale_inv.data, state.block_size)
    else:
        w_deq = dequantize_per_channel(layer.weight.data, layer.weight_scale.data)
    out = (x_deq @ w_deq.t()).to(x.dtype)
    return out + bias if bias is not None else out


class Fp8OnlineBlockwiseLinearMethod(LinearMethodBase):
    """Blockwise (or per-rank per-channel fallback) FP8 linear layer quantized online from BF16 weights."""

    def __init__(self, quant_config: Fp8OnlineBlockwiseConfig, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix
        self._block_linear = None  # SGLang's block-FP8 GEMM, resolved on the first CUDA call

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        config = self.quant_config
        decision = choose_scheme(
            input_size_per_partition,
            output_partition_sizes,
            config.block_size,
            shard_names=shard_names(layer, len(output_partition_sizes)),
        )
        layer._fp8rl = LayerState(self.prefix, decision, config.block_size, config.options.scale_format)
        n_local, k_local = sum(output_partition_sizes), input_size_per_partition
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = k_local
        layer.output_size_per_partition = n_local
        layer.orig_dtype = params_dtype

        weight = ModelWeightParameter(
            data=torch.empty(n_local, k_local, dtype=FP8_DTYPE),
            input_dim=1,
            output_dim=0,
            weight_loader=functools.partial(load_weight_shard, layer),
        )
        setattr(weight, CHECK_ATTR, functools.partial(check_weight_shard, layer))
        layer.register_parameter("weight", weight)
        if decision.scheme is Scheme.BLOCK:
            scale = BlockQuantScaleParameter(
                data=torch.ones(blockwise_scale_shape((n_local, k_local), config.block_size), dtype=torch.float32),
                input_dim=1,
                output_dim=0,
                weight_loader=functools.partial(refuse_scale, self.prefix, "weight_scale_inv"),
            )
            setattr(scale, CHECK_ATTR, scale.weight_loader)
            layer.register_parameter("weight_scale_inv", scale)
        else:
            scale = ChannelQuantScaleParameter(
                data=torch.ones(n_local, dtype=torch.float32),
                output_dim=0,
                weight_loader=functools.partial(refuse_scale, self.prefix, "weight_scale"),
            )
            setattr(scale, CHECK_ATTR, scale.weight_loader)
            layer.register_parameter("weight_scale", scale)
        layer.input_scale = None
        config.report.record(self.prefix, decision)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Idempotent and pointer-stable: never rebinds ``.data``; fills never-loaded (dummy) layers."""
        if layer._fp8rl.rows_loaded == 0:
            fill_dummy(layer)
            self.quant_config.report.record_dummy_fill(self.prefix)
        self.quant_config.report.mark_processed(self.prefix)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not x.is_cuda:
            return reference_linear(layer, x, bias)
        if layer._fp8rl.is_block:
            return self._apply_block_cuda(layer, x, bias)
        return self._apply_channel_cuda(layer, x, bias)

    def _apply_block_cuda(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self._block_linear is None:
            from sglang.srt.layers.quantization.fp8_utils import dispatch_w8a8_block_fp8_linear

            self._block_linear = dispatch_w8a8_block_fp8_linear()
        # the per-shape choice installed at load (gemm_select.prepare_model); SGLang's own call where none is
        return gemm_select.apply_selected(
            x, layer.weight, layer.weight_scale_inv, bias, self._block_linear, layer._fp8rl.block_size
        )

    @staticmethod
    def _apply_channel_cuda(layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        from sglang.srt.layers.quantization.fp8_utils import apply_fp8_linear, cutlass_fp8_supported

        # the same call and layouts as SGLang's online per-channel Fp8LinearMethod: weight [K, N] (a view), scale [1, N]
        return apply_fp8_linear(
            input=x,
            weight=layer.weight.t(),
            weight_scale=layer.weight_scale.view(1, -1),
            input_scale=None,
            bias=bias,
            cutlass_fp8_supported=cutlass_fp8_supported(),
        )
