"""KV-cache scales sent by a trainer in a weight update (the names vLLM and NeMo-RL use:
``model.layers.N.self_attn.k_scale`` / ``v_scale``; also ModelOpt's ``k_proj.k_scale`` and SGLang's ``attn.k_scale``).

They are taken out of the request before the model's ``load_weights`` (which would drop them on Qwen3), validated with
the rest of the request (finite, > 0; otherwise the whole update is rejected), rounded as calibrated scales are, and
written in place after the weights, by the same all-or-nothing writer the recalibration uses. Accepted only when the
engine manages its scales (``--fp8rl-kv-scales calibrate``); with ``static`` they are refused.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from sglang_fp8rl.kv_scales.calibrate import apply_scales
from sglang_fp8rl.kv_scales.engine import kv_state
from sglang_fp8rl.kv_scales.layers import (
    attention_layers,
    kv_scale_values,
    merge_scales,
    parse_kv_scale_name,
    read_scales,
)
from sglang_fp8rl.kv_scales.numerics import round_scales
from sglang_fp8rl.weight_sync.validate import UpdateRejected

KVScales = dict[int, tuple[float, float]]


def split_kv_scales(named: Sequence[tuple[Any, Any]]) -> tuple[list[tuple[Any, Any]], list[tuple[str, Any]]]:
    """The request's weight entries, and its KV-scale entries."""
    weights, scales = [], []
    for name, tensor in named:
        is_scale = False
        if isinstance(name, str):
            try:
                is_scale = parse_kv_scale_name(name) is not None
            except ValueError as e:
                raise UpdateRejected(f"{name}: {e}") from e
        (scales if is_scale else weights).append((name, tensor))
    return weights, scales


def prepare_kv_scales(model: torch.nn.Module, entries: Sequence[tuple[str, Any]]) -> Optional[KVScales]:
    """The per-layer (k, v) scales the entries set, validated and rounded; None without entries."""
    if not entries:
        return None
    state = kv_state()
    if not state.calibrating:
        raise UpdateRejected(f"{entries[0][0]}: KV-cache scales are accepted only with --fp8rl-kv-scales calibrate "
                             f"and --kv-cache-dtype fp8_e4m3 (this engine: {state.mode})")
    layers = attention_layers(model)
    try:
        merged = merge_scales(read_scales(layers), kv_scale_values(list(entries)))
        ids = sorted(merged)
        rounded = round_scales(torch.tensor([merged[i] for i in ids], dtype=torch.float64), state.policy)
    except ValueError as e:
        raise UpdateRejected(f"KV scales ({entries[0][0]} ...): {e}") from e
    return {i: tuple(row) for i, row in zip(ids, rounded.tolist())}


def write_kv_scales(model: torch.nn.Module, scales: KVScales) -> None:
    """Write validated trainer scales in place (after the weights of the same update)."""
    apply_scales(attention_layers(model), scales, source="trainer")
