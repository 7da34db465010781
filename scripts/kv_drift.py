"""A function-preserving drift of a policy's K/V range, for the FP8-KV accuracy arms (issue 15; docs/KV_SCALES.md
sections 3 and 10).

With a power of two c, every attention layer gets

* K side: ``k_norm.weight *= c`` and ``q_norm.weight /= c`` (Qwen3; q.k is unchanged). Models without QK-norm get
  ``k_proj *= c`` and ``q_proj /= c`` instead (RoPE is linear, so q.k is unchanged as well);
* V side: ``v_proj *= c`` and ``o_proj.weight /= c`` (the attention output is unchanged).

Scaling by a power of two is exact in BF16 and FP32, and commutes with rounding, so the policy computes the same
function bit for bit (in BF16 and with FP8 weights: the codes stay, the weight scales move by c), while the K and V
that reach the KV cache grow by exactly c. An FP8 E4M3 cache with SGLang's static scale 1.0 clips them above 448;
calibrated scales follow them. Pure torch + safetensors, imported lazily by accuracy_regression.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from fractions import Fraction

E4M3_MAX = 448.0
DRIFT_TARGET_AMAX = 4 * E4M3_MAX  # "auto": K/V amax at least this (RoPE may move K's amax by up to sqrt 2)
DEFAULT_MIN_FACTOR = {"k": 64, "v": 256}  # "auto" never goes below these
AUTO = "auto"
DRIFT_RECORD = "drift.json"
_ATTN_RE = re.compile(r"^(?P<prefix>.*\.self_attn)\.v_proj\.weight$")


def parse_factor(text) -> object:
    """'auto', or a power of two such as 64, 0.25 or 1/256 (as a Fraction); ValueError otherwise."""
    if isinstance(text, str) and text.strip().lower() == AUTO:
        return AUTO
    try:
        value = Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError) as e:
        raise ValueError(f"drift factor {text!r} is not a number or 'auto'") from e
    if not is_power_of_two(value):
        raise ValueError(f"drift factor {text!r} must be a power of two (exact scaling), e.g. 64, 256 or 1/256")
    return value


def is_power_of_two(value: Fraction) -> bool:
    """2^k for an integer k (positive or negative)."""
    if value <= 0:
        return False
    n, d = value.numerator, value.denominator
    return (d == 1 and n & (n - 1) == 0) or (n == 1 and d & (d - 1) == 0)


def auto_factor(amax: float, minimum: int, target: float = DRIFT_TARGET_AMAX) -> int:
    """The smallest power of two >= minimum that takes `amax` to at least `target`."""
    if not amax > 0:
        raise ValueError(f"cannot size a drift from amax {amax!r}")
    c = max(1, int(minimum))
    while amax * c < target:
        c *= 2
    return c


def attention_prefixes(names) -> list[str]:
    """`model.layers.N.self_attn` of every layer that has a v_proj weight, in layer order."""
    found = [m["prefix"] for m in map(_ATTN_RE.match, names) if m]
    return sorted(found, key=lambda p: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p)])


def _scale(tensor, factor: Fraction, name: str):
    """tensor * factor, checked exact (no overflow to inf, no underflow: dividing back restores every value)."""
    import torch

    out = (tensor.double() * float(factor)).to(tensor.dtype)
    back = (out.double() / float(factor)).to(tensor.dtype)
    if not torch.isfinite(out).all() or not torch.equal(back, tensor):
        raise ValueError(f"scaling {name} ({tensor.dtype}) by {factor} is not exact (overflow or underflow)")
    return out


def drift_plan(names, k_factor: Fraction, v_factor: Fraction) -> dict[str, Fraction]:
    """tensor name -> factor for every tensor the drift changes; ValueError if a layer lacks a needed tensor."""
    names = set(names)
    prefixes = attention_prefixes(names)
    if not prefixes:
        raise ValueError("no attention layer found (expected '<...>.self_attn.v_proj.weight' tensors)")
    plan = {}
    for p in prefixes:
        if f"{p}.k_norm.weight" in names:
            k_side = {f"{p}.k_norm.weight": k_factor, f"{p}.q_norm.weight": 1 / k_factor}
        else:
            k_side = {f"{p}.{proj}.{kind}": (k_factor if proj == "k_proj" else 1 / k_factor)
                      for proj in ("k_proj", "q_proj") for kind in ("weight", "bias")}
        v_side = {f"{p}.v_proj.weight": v_factor, f"{p}.v_proj.bias": v_factor, f"{p}.o_proj.weight": 1 / v_factor}
        for name, factor in {**k_side, **v_side}.items():
            if name in names:
                plan[name] = factor
            elif not name.endswith(".bias"):
                raise ValueError(f"{p}: no {name.rsplit('.', 2)[-2]} weight; cannot drift this layer's "
                                 f"{'K' if name in k_side else 'V'} range")
    return plan


def drift_state_dict(state_dict: dict, k_factor, v_factor) -> dict:
    """A new state dict whose K range is x k_factor and V range x v_factor, computing the same function."""
    k, v = parse_factor(k_factor), parse_factor(v_factor)
    if AUTO in (k, v):
        raise ValueError("resolve 'auto' drift factors (auto_factor) before drifting")
    plan = drift_plan(state_dict, k, v)
    return {name: _scale(t, plan[name], name) if name in plan else t for name, t in state_dict.items()}


def kv_amax(model, sequences) -> list[tuple[float, float]]:
    """Per attention layer (amax |K|, amax |V|) over `sequences` (token-id lists), from an HF causal LM.

    K is taken at k_norm's output (or k_proj's without QK-norm): before RoPE, which can move the amax by up to
    sqrt 2; V at v_proj's output."""
    import torch

    layers = [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "v_proj")]
    if not layers:
        raise ValueError("no attention layer with a v_proj in this model")
    amax = [[0.0, 0.0] for _ in layers]
    hooks = []
    for i, attn in enumerate(layers):
        k_mod = getattr(attn, "k_norm", None)
        k_mod = attn.k_proj if k_mod is None else k_mod
        for side, mod in ((0, k_mod), (1, attn.v_proj)):
            def hook(_m, _inp, out, i=i, side=side):
                amax[i][side] = max(amax[i][side], float(out.detach().abs().max()))

            hooks.append(mod.register_forward_hook(hook))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for seq in sequences:
                model(input_ids=torch.tensor([list(seq)], dtype=torch.long, device=device))
    finally:
        for h in hooks:
            h.remove()
    return [(a[0], a[1]) for a in amax]


def _weight_files(src: str) -> list[str]:
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{src}: no *.safetensors file (the drift needs a safetensors checkpoint)")
    return files


def read_drift_record(path: str):
    """The drift record of a drifted checkpoint folder, or None."""
    try:
        with open(os.path.join(path, DRIFT_RECORD)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def write_drifted_checkpoint(src: str, dst: str, k_factor, v_factor, extra: dict | None = None) -> dict:
    """Copy the checkpoint folder `src` to `dst` with drifted weights; returns (and writes) the drift record."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    k, v = parse_factor(k_factor), parse_factor(v_factor)
    files = _weight_files(src)
    names = []
    for fn in files:
        with safe_open(os.path.join(src, fn), framework="pt") as f:
            names += list(f.keys())
    plan = drift_plan(names, k, v)  # checks every layer before anything is written
    tmp = dst.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors", DRIFT_RECORD))
    for fn in files:
        with safe_open(os.path.join(src, fn), framework="pt") as f:
            meta = f.metadata() or {}
            keys = f.keys()  # a safetensors handle, not a dict
            tensors = {n: f.get_tensor(n) for n in keys}
        tensors = {n: _scale(t, plan[n], n) if n in plan else t for n, t in tensors.items()}
        save_file(tensors, os.path.join(tmp, fn), metadata={**meta, "format": meta.get("format", "pt")})
    record = {"source": os.path.abspath(src), "k_factor": str(k), "v_factor": str(v),
              "tensors_scaled": len(plan), "layers": len(attention_prefixes(names)), **(extra or {})}
    with open(os.path.join(tmp, DRIFT_RECORD), "w") as f:
        json.dump(record, f, indent=1)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return record
