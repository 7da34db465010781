"""KV scales on SGLang's ``RadixAttention`` objects: attach device tensors once, then write them in place.

SGLang 0.5.17 reads two representations of one scale (docs/KV_SCALES.md, sec. 1):

* ``layer.k_scale`` / ``layer.v_scale``: float32 tensors. The MHA pool divides K/V by them when it writes the cache
  (memory_pool.py:2340-2343) and FlashAttention-3 expands them as its descale (flashattention_backend.py:1245-1248).
  Writing them in place is CUDA-graph safe: a graph reads the same storage at replay.
* ``layer.k_scale_float`` / ``layer.v_scale_float``: Python floats passed by Triton and FlashInfer to their kernels.
  A captured graph keeps the value it was captured with; decode_fold.py makes those graphs read the tensors.

Qwen3 and Qwen3-MoE build ``RadixAttention`` without ``quant_config`` (qwen3.py:149-156, qwen3_moe.py:534-540), so no
quantization method can give them scale tensors: :func:`attach_scales` adds them after loading, for every model.
They are plain attributes, not parameters: ``model.named_parameters()`` and SGLang's ``load_weights`` never see them;
trainer-supplied scales are routed by :func:`parse_kv_scale_name` instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch

from sglang_fp8rl.kv_scales.numerics import KV_NAMES, check_scales

UNIT_SCALE = 1.0  # SGLang's "no scaling factors provided" default (load_model_utils.py:118-123)

# model.layers.<i>.self_attn.[k_proj.|v_proj.|attn.](k|v|kv)_scale; see parse_kv_scale_name
_KV_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\.(?:(?P<proj>[kv])_proj\.|attn\.)?(?P<which>k|v|kv)_scale$"
)


def attention_layers(model: torch.nn.Module) -> list[Any]:
    """The model's ``RadixAttention`` modules ordered by ``layer_id`` (one per layer; MLA's pairs are refused)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layers = sorted((m for m in model.modules() if isinstance(m, RadixAttention)), key=lambda m: m.layer_id)
    ids = [layer.layer_id for layer in layers]
    if len(set(ids)) != len(ids):
        raise ValueError("several attention modules share a layer_id (MLA?): per-layer KV scales are not supported")
    return layers


def layer_labels(layers: Sequence[Any]) -> list[str]:
    """``"layer <id>"`` per attention layer, for messages."""
    return [f"layer {layer.layer_id}" for layer in layers]


def _same_device(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def _as_scale_tensor(value: Any, device: torch.device, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} has {value.numel()} elements; only per-tensor FP8 KV scales are supported")
        if value.dtype == torch.float32 and value.dim() == 0 and _same_device(value, device):
            return value  # adopted as is (a BaseKVCacheMethod parameter): its storage stays the one graphs read
        if isinstance(value, torch.nn.Parameter):
            raise ValueError(f"{what} is a {value.dtype} parameter of shape {tuple(value.shape)} on {value.device}; "
                             "cannot adopt it as a 0-d float32 scale on " + str(device))
        value = value.detach().float().item()
    return torch.full((), float(value), dtype=torch.float32, device=device)


def attach_scales(model: torch.nn.Module, device: torch.device | str) -> list[Any]:
    """Give every attention layer 0-d float32 scale tensors on ``device`` (idempotent) and consistent floats.

    A layer without scales gets 1.0, SGLang's default. Existing ones are kept: a ``BaseKVCacheMethod`` parameter
    is adopted in place, and a Python float (SGLang's ``load_kv_cache_scales`` assigns floats) becomes a tensor."""
    device = torch.device(device)
    layers = attention_layers(model)
    for layer in layers:
        for name in KV_NAMES:
            current = getattr(layer, f"{name}_scale")
            tensor = _as_scale_tensor(UNIT_SCALE if current is None else current, device,
                                      f"layer {layer.layer_id} {name}_scale")
            if tensor is not current:
                setattr(layer, f"{name}_scale", tensor)
            setattr(layer, f"{name}_scale_float", float(tensor.item()))
    return layers


def _check_attached(layer: Any) -> None:
    for name in KV_NAMES:
        tensor = getattr(layer, f"{name}_scale", None)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 0 or tensor.dtype != torch.float32:
            raise ValueError(f"layer {layer.layer_id} has no 0-d float32 {name}_scale tensor: call attach_scales first")


def write_scales(layers: Sequence[Any], scales: Mapping[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """Write ``{layer_id: (k, v)}`` into the layers' scale tensors in place and their floats; all or nothing.

    Every value is validated (finite float32 > 0, layer known, tensors attached) before anything is written. Returns
    the values written (rounded to float32), for telemetry. No host sync: ``fill_`` takes the host value."""
    by_id = {layer.layer_id: layer for layer in layers}
    unknown = sorted(set(scales) - set(by_id))
    if unknown:
        raise ValueError(f"KV scales for unknown attention layer(s) {unknown}; this rank has {sorted(by_id)}")
    ids = sorted(scales)
    table = torch.tensor([scales[i] for i in ids], dtype=torch.float64).reshape(len(ids), len(KV_NAMES))
    check_scales(table, [f"layer {i}" for i in ids])
    for i in ids:
        _check_attached(by_id[i])
    written = {}
    for i, row in zip(ids, table.to(torch.float32).tolist()):
        layer = by_id[i]
        for name, value in zip(KV_NAMES, row):
            getattr(layer, f"{name}_scale").fill_(value)
            setattr(layer, f"{name}_scale_float", value)
        written[i] = (row[0], row[1])
    return written


def read_scales(layers: Iterable[Any]) -> dict[int, tuple[float, float]]:
    """``{layer_id: (k, v)}`` from the layers' floats (no device sync)."""
    return {layer.layer_id: (layer.k_scale_float, layer.v_scale_float) for layer in layers}


def tensors_match_floats(layers: Iterable[Any]) -> bool:
    """Whether every scale tensor holds exactly its float (one device sync)."""
    layers = list(layers)
    if not layers:
        return True
    tensors = torch.stack([getattr(layer, f"{n}_scale") for layer in layers for n in KV_NAMES]).cpu().tolist()
    floats = [getattr(layer, f"{n}_scale_float") for layer in layers for n in KV_NAMES]
    return tensors == floats


# ---------------------------------------------------------------------------------------------------------------------
# trainer-supplied scales


@dataclasses.dataclass(frozen=True)
class KVScaleName:
    """Where a trainer's KV-scale tensor goes: decoder layer index and ``"k"``, ``"v"`` or ``"kv"`` (both)."""

    layer: int
    which: str


def parse_kv_scale_name(name: str) -> Optional[KVScaleName]:
    """The target of a KV-scale tensor name, or None if ``name`` is not one (raises for a contradictory one).

    Accepted, with any prefix before ``layers.<i>``: ``self_attn.k_scale`` / ``v_scale`` (vLLM, NeMo-RL),
    ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` (ModelOpt), ``self_attn.attn.k_scale`` (SGLang's module path)
    and the deprecated ``self_attn.kv_scale`` (both). SGLang's own ``maybe_remap_kv_scale_name`` turns the
    ``attn.`` form into ``attn.attn.`` and drops it with a warning (weight_utils.py:1586-1614); here it is accepted."""
    match = _KV_SCALE_NAME.search(name)
    if match is None:
        return None
    proj, which = match.group("proj"), match.group("which")
    if proj is not None and proj != which:
        raise ValueError(f"{name}: a {proj}_proj cannot carry a {which}_scale")
    return KVScaleName(int(match.group("layer")), which)


def kv_scale_values(named: Sequence[tuple[str, torch.Tensor]]) -> dict[int, dict[str, float]]:
    """``{layer: {"k": s, "v": s}}`` from trainer tensors already known to be KV scales; one host sync.

    Each tensor must be floating point with one element; its value is checked by :func:`write_scales` later."""
    targets, values = [], []
    for name, tensor in named:
        target = parse_kv_scale_name(name)
        if target is None:
            raise ValueError(f"{name}: not a KV-scale name")
        if not torch.is_tensor(tensor) or not tensor.is_floating_point() or tensor.numel() != 1:
            raise ValueError(f"{name}: a KV scale must be a floating-point tensor with one element")
        targets.append((name, target))
        values.append(tensor.detach().reshape(()).to(torch.float64))
    host = torch.stack([v.to(values[0].device) for v in values]).cpu().tolist() if values else []
    out: dict[int, dict[str, float]] = {}
    for (name, target), value in zip(targets, host):
        entry = out.setdefault(target.layer, {})
        for which in (KV_NAMES if target.which == "kv" else (target.which,)):
            if which in entry:
                raise ValueError(f"{name}: layer {target.layer} {which}_scale is given twice in one request")
            entry[which] = value
    return out


def merge_scales(current: Mapping[int, tuple[float, float]],
                 updates: Mapping[int, Mapping[str, float]]) -> dict[int, tuple[float, float]]:
    """``{layer: (k, v)}`` for every updated layer: the update's values, the current ones where a side is missing."""
    unknown = sorted(set(updates) - set(current))
    if unknown:
        raise ValueError(f"KV scales for unknown attention layer(s) {unknown}")
    merged = {}
    for i in sorted(updates):
        k, v = current[i]
        merged[i] = (updates[i].get("k", k), updates[i].get("v", v))
    return merged
