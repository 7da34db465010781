"""Arrival checks for an FP8 half that a request leaves held for its partner (the step keeps it, :mod:`.step`).

A held half is written only when its partner comes; one that nothing could ever pair would sit in the step until it
ends and then be dropped, while the rest of its request was written. So a half is refused at arrival, with nothing of
its request written, unless its weight is a name the model's ``load_weights`` takes (a checkpoint name: engine-fused
names such as ``qkv_proj`` are not), that name reaches one of our FP8 layers (a layer kept in BF16 takes only BF16
or a whole pair, which is dequantized), and its shape fits that layer's weight (codes: the full weight; scale: one
float32 per 128x128 block of it). Which parameter a name reaches is found once per name, by running the model's own
``load_weights`` with every loader replaced by a recorder that writes nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

from sglang_fp8rl.layers.fp8_storage import layer_state
from sglang_fp8rl.layers.moe import EXPERT_WEIGHTS, unquantized_expert_shape
from sglang_fp8rl.layers.placement import placement_for_layer
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE, blockwise_scale_shape
from sglang_fp8rl.weight_sync.fp8_payload import weight_of
from sglang_fp8rl.weight_sync.protocol import SCALE_SUFFIX
from sglang_fp8rl.weight_sync.validate import (
    DRY_RUN_ERRORS,
    UpdateRejected,
    param_owners,
    replaced_loaders,
    shard_id_of,
)

Target = tuple[torch.nn.Module, str, Any]  # (owning module, parameter attribute, shard id)
_PROBE = torch.zeros((), dtype=torch.bfloat16).expand(1, 1)  # no loader runs: its shape is never read


def check_held_halves(model: torch.nn.Module, load_weights: Callable, hold: Mapping[str, torch.Tensor]) -> None:
    """UpdateRejected, naming the half, for the first half of ``hold`` that could never pair (module doc)."""
    for name in sorted(hold):
        check_half(model, load_weights, name, hold[name])


def check_half(model: torch.nn.Module, load_weights: Callable, name: str, tensor: torch.Tensor) -> None:
    """One half's arrival check (module doc)."""
    weight = weight_of(name)
    targets = weight_targets(model, load_weights, weight)
    if isinstance(targets, str):
        raise UpdateRejected(f"{name}: cannot be held for its partner: {weight} {targets}")
    for module, param_name, shard_id in targets:
        if layer_state(module) is None:
            raise UpdateRejected(f"{name}: {weight} belongs to a module kept in BF16 ({type(module).__name__}), "
                                 "which takes BF16 or the codes with their scale in one request, not a half")
        expected = expected_half_shape(module, param_name, shard_id, scale=name.endswith(SCALE_SUFFIX))
        if expected is not None and tuple(tensor.shape) not in expected:
            raise UpdateRejected(f"{name}: shape {tuple(tensor.shape)} does not fit {weight} (expected "
                                 f"{' or '.join(map(str, sorted(expected)))})")


def expected_half_shape(module: torch.nn.Module, param_name: str, shard_id: Any, scale: bool
                        ) -> Optional[set[tuple[int, ...]]]:
    """The shapes a half may have for this module's weight (a scale of one column block may also come 1-D), or None
    when the module's full weight shape is not known here."""
    full = full_weight_shape(module, param_name, shard_id)
    if full is None:
        return None
    if not scale:
        return {full}
    blocks = blockwise_scale_shape(full, DEFAULT_BLOCK_SIZE)
    return {blocks, (blocks[0],)} if blocks[1] == 1 else {blocks}


def full_weight_shape(module: torch.nn.Module, param_name: str, shard_id: Any) -> Optional[tuple[int, int]]:
    """The full (checkpoint) shape of the weight a name reaches, where our placement rules know it."""
    if isinstance(module, FusedMoE) and param_name in EXPERT_WEIGHTS:
        return tuple(unquantized_expert_shape(module, param_name, shard_id))
    if isinstance(module, LinearBase) and param_name == "weight":
        return tuple(placement_for_layer(module, shard_id).full_shape)
    return None


def weight_targets(model: torch.nn.Module, load_weights: Callable, weight: str) -> list[Target] | str:
    """Where ``load_weights`` sends a tensor named ``weight`` (remembered per name), or why it sends it nowhere."""
    cache = model.__dict__.setdefault("_fp8rl_half_targets", {})
    if weight not in cache:
        cache[weight] = _probe(model, load_weights, weight)
    return cache[weight]


def _probe(model: torch.nn.Module, load_weights: Callable, weight: str) -> list[Target] | str:
    owners = param_owners(model)
    calls: list[Target] = []

    def make_recorder(param: torch.nn.Parameter, real: Callable) -> Callable:
        def recorder(p: torch.nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> None:
            owner, param_name = owners.get(id(p), (None, ""))
            calls.append((owner, param_name, shard_id_of(owner, args, kwargs)))
        return recorder

    hint = ("send checkpoint names, e.g. q_proj/k_proj/v_proj and gate_proj/up_proj, not the engine's fused "
            "qkv_proj/gate_up_proj")
    try:
        with replaced_loaders(model, make_recorder):
            load_weights([(weight, _PROBE)])
    except DRY_RUN_ERRORS as e:
        return f"is not a weight name {type(model).__name__}.load_weights takes ({type(e).__name__}: {e}); {hint}"
    if not calls:
        return f"is not a weight name {type(model).__name__}.load_weights takes; {hint}"
    try:
        for module, param_name, shard_id in calls:
            full_weight_shape(module, param_name, shard_id)  # a fused name is refused by our placement rules here
    except (ValueError, TypeError) as e:
        return f"cannot be placed: {e}"
    return calls
