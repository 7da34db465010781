"""Layers a trainer keeps in BF16 (verl's ``ignored_layers``), matched the way the trainer matches them.

verl's FP8 rollout mode quantizes on the trainer side and sends BF16 for every parameter whose name matches one of
its ignored layers (``quantization_config.ignored_layers`` / ``modules_to_not_convert`` and the environment variable
``SGLANG_FP8_IGNORED_LAYERS``, comma-separated). The engine must keep exactly those modules in BF16, so the rule
here is verl 0.9.1's ``_matches_ignored_layer`` (verl/utils/sglang/sglang_fp8_utils.py), applied to the checkpoint
names of each SGLang module: the shards of a fused module (``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up) and each
expert's projections of a fused MoE layer. A fused module some of whose shards match is refused at start, as SGLang's
own ``is_layer_skipped`` refuses it: the trainer would send one half in BF16 and the other in FP8.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from sglang_fp8rl.layers.scheme import SHARD_NAMES

IGNORED_LAYERS_ENV = "SGLANG_FP8_IGNORED_LAYERS"  # verl reads it on the trainer side, SGLang's fp8 on the engine side
CONFIG_KEYS = ("ignored_layers", "modules_to_not_convert")
# the checkpoint modules a fused SGLang module is loaded from: qkv_proj <- q_proj, k_proj, v_proj, ...
FUSED_SHARDS = {module: tuple(f"{shard}_proj" for shard in shards) for module, shards in SHARD_NAMES.items()
                if len(shards) > 1}
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
REGEX_PREFIX = "re:"


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    elif not isinstance(value, Iterable):
        value = [value]
    return [str(item).strip() for item in value if str(item).strip()]


def ignored_layers_from(quant_config: Optional[Mapping[str, Any]], environ: Mapping[str, str] = os.environ
                        ) -> tuple[str, ...]:
    """The trainer's ignored layers: the config's two keys, then the environment variable; case-insensitive dedup."""
    names = [name for key in CONFIG_KEYS for name in _as_list((quant_config or {}).get(key))]
    names += _as_list(environ.get(IGNORED_LAYERS_ENV))
    seen: set[str] = set()
    unique = []
    for name in names:
        if name.lower() not in seen:
            seen.add(name.lower())
            unique.append(name)
    for name in unique:
        if name.startswith(REGEX_PREFIX):
            try:
                re.compile(name[len(REGEX_PREFIX):])
            except re.error as e:
                raise ValueError(f"ignored layer {name!r} is not a valid regular expression: {e}") from e
    return tuple(unique)


def matches_ignored_layer(param_name: str, ignored_layer: str) -> bool:
    """verl's rule: ``re:`` + a regex matched at the start, else a dotted, case-insensitive name prefix, suffix or
    infix of the parameter name or of its module name (the name without ``.weight``)."""
    ignored_layer = ignored_layer.strip()
    if not ignored_layer:
        return False
    name = param_name.strip(".")
    module_name = name[: -len(".weight")] if name.lower().endswith(".weight") else name
    if ignored_layer.startswith(REGEX_PREFIX):
        pattern = ignored_layer[len(REGEX_PREFIX):]
        return any(re.match(pattern, candidate) for candidate in (name, module_name))
    ignored_layer = ignored_layer.lower().strip(".")
    for candidate in (name.lower(), module_name.lower()):
        if (candidate == ignored_layer or candidate.startswith(f"{ignored_layer}.")
                or candidate.endswith(f".{ignored_layer}") or f".{ignored_layer}." in f".{candidate}."):
            return True
    return False


def checkpoint_names(prefix: str, num_experts: Optional[int] = None) -> list[str]:
    """The checkpoint weight names an SGLang module is loaded from: its fused shards, or each expert's projections."""
    if num_experts is not None:
        return [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts) for proj in EXPERT_PROJECTIONS]
    head, _, last = prefix.rpartition(".")
    shards = FUSED_SHARDS.get(last)
    if shards is None:
        return [f"{prefix}.weight"]
    return [f"{head}.{shard}.weight" if head else f"{shard}.weight" for shard in shards]


def ignored_match(prefix: str, ignored_layers: Iterable[str], num_experts: Optional[int] = None) -> Optional[str]:
    """The ignored layer that keeps this module in BF16, or None; ValueError if it matches only some of the
    module's checkpoint names (one fused parameter cannot hold BF16 and FP8 halves)."""
    ignored_layers = tuple(ignored_layers)
    if not ignored_layers:
        return None
    names = checkpoint_names(prefix, num_experts)
    hits = {name: next((ig for ig in ignored_layers if matches_ignored_layer(name, ig)), None) for name in names}
    matched = [name for name, hit in hits.items() if hit is not None]
    if not matched:
        return None
    if len(matched) < len(names):
        missed = [name for name in names if hits[name] is None]
        raise ValueError(
            f"ignored layers {list(ignored_layers)} match only some of the weights that module {prefix} is fused "
            f"from ({matched[:3]} but not {missed[:3]}); list all of them or none (one fused parameter cannot be "
            "half BF16, half FP8)")
    return hits[matched[0]]
