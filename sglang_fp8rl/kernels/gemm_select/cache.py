"""The on-disk cache of measurements, keyed by environment, and the choice it holds for an (M, N, K).

File (JSON, ``FP8RL_GEMM_SELECT_CACHE``, default ~/.cache/sglang_fp8rl/gemm_select.json)::

    {"schema": 3, "envs": {env_key: {"info": {field: value}, "entries": {"N=..,K=..,M=..": entry}}}}

An environment is what a measurement depends on (:func:`env_info`): GPU, SM count, DeepGEMM's state in SGLang, the
versions of torch / triton / sglang / sgl-kernel / deep_gemm / this package, and the schema; any change gives a new
key, so old measurements are never applied to another setup. An entry is an :class:`Entry` as JSON (its fields).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

import torch

from sglang_fp8rl.kernels import deepgemm
from sglang_fp8rl.kernels.atomic_json import write_json_atomic
from sglang_fp8rl.kernels.deepgemm import DeepGemmFacts
from sglang_fp8rl.kernels.gemm_select.buckets import m_bucket, parse_shape_key, shape_key
from sglang_fp8rl.kernels.gemm_select.candidates import DEFAULT

ENV_CACHE = "FP8RL_GEMM_SELECT_CACHE"  # path of the JSON cache
# 3: DeepGEMM's state in SGLang ("deepgemm": off / ue8m0 / fp32) joined the environment; entry field copy_gbs
SCHEMA = 3


@dataclasses.dataclass
class Entry:
    """The measurement of one (N, K, M bucket): the choice and everything it was chosen from."""

    candidates: list[str]  # the registry it was measured against (stale when the registry changes)
    choice: str = DEFAULT
    points: list[int] = dataclasses.field(default_factory=list)  # the M values measured
    us: dict[str, float] = dataclasses.field(default_factory=dict)  # per candidate, summed over the points
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)  # candidate -> why (error, check, support)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # candidate -> why it was not measured
    first_call_s: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time of the first call (JIT)
    rel_err: dict[str, float] = dataclasses.field(default_factory=dict)  # vs the float64 block-scaled product
    default_frac_copy_bw: float | None = None  # the default's bytes / time / copy bandwidth
    copy_gbs: float | None = None  # the copy bandwidth it was compared with (GB/s)
    time: int = dataclasses.field(default_factory=lambda: round(time.time()))

    def valid_choice(self, names: Iterable[str]) -> str | None:
        """The choice if this entry was measured against exactly the candidate set ``names``, else None (stale)."""
        names = list(names)
        if sorted(self.candidates) != sorted(names):
            return None
        return self.choice if self.choice in names else None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this entry."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Entry | None:
        """The entry of a JSON object; None if it is not one (a hand-edited or foreign file)."""
        if not isinstance(data, dict) or not isinstance(data.get("candidates"), list):
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            entry = cls(**{key: value for key, value in data.items() if key in known})
        except TypeError:
            return None
        return entry if isinstance(entry.choice, str) else None


def cache_path() -> str:
    """The cache file: ``FP8RL_GEMM_SELECT_CACHE`` or ~/.cache/sglang_fp8rl/gemm_select.json."""
    return os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "sglang_fp8rl",
                                                     "gemm_select.json")


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def env_info(facts: DeepGemmFacts | None = None, device: torch.device | int | None = None) -> dict[str, str]:
    """What a measurement depends on: GPU name, capability, SM count, DeepGEMM's state in SGLang (``facts``,
    detected if not given), torch/triton/sglang/deep_gemm versions, the schema."""
    facts = deepgemm.detect(device) if facts is None else facts
    info = {"gpu": "cpu", "capability": "none", "sms": "0"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        info = {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
                "sms": str(props.multi_processor_count)}
    info.update({
        "deepgemm": facts.label,
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "sglang": _dist_version("sglang"),
        "sgl_kernel": _dist_version("sgl-kernel", "sgl_kernel"),
        "deep_gemm": _dist_version("sgl-deep-gemm", "deep_gemm", "deep-gemm"),
        "sglang_fp8rl": _dist_version("sglang-fp8rl"),
        "schema": str(SCHEMA),
    })
    return info


def env_key(info: Mapping[str, str]) -> str:
    """Stable string of an ``env_info`` dict: any change (GPU, versions, schema) gives a new key."""
    return "|".join(f"{k}={info[k]}" for k in sorted(info))


def _empty() -> dict[str, Any]:
    return {"schema": SCHEMA, "envs": {}}


def load_cache(path: str | None = None) -> dict[str, Any]:
    """The whole cache file; an empty cache if missing, unreadable or of another schema."""
    try:
        with open(path or cache_path()) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return _empty()
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("envs"), dict):
        return _empty()
    return data


def save_cache(data: Mapping[str, Any], path: str | None = None) -> str:
    """Atomic write of the whole cache."""
    return write_json_atomic(path or cache_path(), data)


def env_entries(data: Mapping[str, Any], info: Mapping[str, str]) -> dict[str, Entry]:
    """The entries of one environment of a loaded cache (malformed ones left out)."""
    env = data.get("envs", {}).get(env_key(info))
    raw = env.get("entries") if isinstance(env, dict) else None
    if not isinstance(raw, dict):
        return {}
    entries = {key: Entry.from_json(value) for key, value in raw.items()}
    return {key: e for key, e in entries.items() if e is not None}


def load_entries(info: Mapping[str, str], path: str | None = None) -> dict[str, Entry]:
    """The entries of environment ``info`` in the cache file."""
    return env_entries(load_cache(path), info)


def merge_entries(path: str | None, info: Mapping[str, str], entries: Mapping[str, Entry]) -> str:
    """Re-read the file, add/replace ``entries`` of this environment, write it back."""
    data = load_cache(path)
    env = data["envs"].setdefault(env_key(info), {"info": dict(info), "entries": {}})
    env.setdefault("entries", {}).update({key: e.to_json() for key, e in entries.items()})
    return save_cache(data, path)


def cached_choice(m: int, n: int, k: int, entries: Mapping[str, Entry], names: Iterable[str]) -> str:
    """Candidate name for (m, n, k) in ``entries``: the valid choice of m's bucket, else ``deepgemm_default``."""
    entry = entries.get(shape_key(n, k, m_bucket(m)))
    return (entry.valid_choice(names) if entry is not None else None) or DEFAULT


def format_table(entries: Mapping[str, Entry]) -> str:
    """Markdown table of a set of entries (one row per (N, K, M bucket)), for the one-time log."""
    rows = sorted(entries.items(), key=lambda kv: parse_shape_key(kv[0]))
    names: list[str] = []
    for _, e in rows:
        for c in list(e.us) + list(e.rejected):
            if c not in names:
                names.append(c)
    names.sort(key=lambda c: (c != DEFAULT, c))
    head = "| N | K | M bucket | choice | gain vs default | " + " | ".join(f"{c} us" for c in names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, e in rows:
        n, k, b = parse_shape_key(key)
        base, pick = e.us.get(DEFAULT), e.us.get(e.choice)
        gain = f"x{base / pick:.2f}" if base and pick else "-"
        cells = ["REJ" if c in e.rejected else (f"{e.us[c]:.1f}" if e.us.get(c) is not None else "-") for c in names]
        lines.append(f"| {n} | {k} | {b} | {e.choice} | {gain} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
