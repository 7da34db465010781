"""What one decode step must move and compute, and the floor that sets (decode_roofline.py's model).

Pure Python (no torch), unit-tested in tests/test_decode_roofline.py. A step of B running requests with a context of
C tokens each:

- weights, read once per step: every linear of every layer at its dtype (BF16: 2 bytes per element; block FP8: one
  byte per code plus a float32 scale per 128 x 128 block), lm_head [vocab x hidden] in BF16 (the plugin keeps it BF16),
  the norms' weights, and the B rows of the embedding gather;
- KV: read B x C x layers x 2 x kv_heads x head_dim x bytes per element, written B tokens (the new one);
- FLOPs: 2 x params x B for the linears (lm_head included), attention 4 x B x C x heads x head_dim x layers;
- floor = max(bytes / bandwidth, sum of FLOPs / peak of the dtype each runs in).

Not counted, so the floor stays a lower bound: activations between kernels (B x hidden-sized tensors, gate_up's
output, logits; small against the weights below batch 128, and a fused kernel keeps them on chip), the per-layer
scalar K/V scales, and the page tables. MoE (Qwen3-30B-A3B shapes): the experts read per layer are the expected
number of distinct experts B tokens route to when each picks k of E uniformly, E x (1 - (1 - k/E)^B); the router
gate is BF16 (the plugin keeps replicated linears BF16). Dummy weights route close to uniformly; a trained model's
router does not, so for MoE the weight bytes are an estimate, not a bound.
"""
from __future__ import annotations

import dataclasses
import math
import re

BLOCK = 128  # the block-FP8 weight scale's tile (128 x 128), one float32 each
BYTES = {"bf16": 2, "fp8": 1}

# Dense tensor-core peaks (TFLOP/s), from NVIDIA's H100 and H200 datasheets: the datasheets print the sparse
# figures, the dense ones are half (H100 SXM5: BF16 1,979 / FP8 3,958 sparse). H200 has H100's compute.
PEAK_SOURCE = ("NVIDIA H100 / H200 Tensor Core GPU datasheets, dense = the datasheets' 'with sparsity' figures "
               "halved")
PEAK_TFLOPS = {
    "H100 SXM": {"bf16": 989.4, "fp8": 1978.9},
    "H100 PCIe": {"bf16": 756.0, "fp8": 1513.0},
    "H100 NVL": {"bf16": 835.5, "fp8": 1670.5},
    "H200 SXM": {"bf16": 989.4, "fp8": 1978.9},
    "H200 NVL": {"bf16": 835.5, "fp8": 1670.5},
}
# nvidia-smi / torch device names -> table row (first match wins; "H100 80GB HBM3" is the SXM part)
_CARD_PATTERNS = [(r"H200.*NVL", "H200 NVL"), (r"H200", "H200 SXM"), (r"H100.*NVL", "H100 NVL"),
                  (r"H100.*PCIe", "H100 PCIe"), (r"H100", "H100 SXM")]

# the configs of the roofline: (weights dtype, KV dtype)
PRECISION = {
    "bf16": ("bf16", "bf16"),
    "fp8_online_blockwise": ("fp8", "bf16"),
    "fp8_online_blockwise_kv": ("fp8", "fp8"),
    "fp8_online_blockwise_kv_fa3": ("fp8", "fp8"),
    "fp8_online_blockwise_kv_splitkv": ("fp8", "fp8"),
    "fp8_online_blockwise_kv_bf16q": ("fp8", "fp8"),
    "fp8_online_blockwise_kv_forms": ("fp8", "fp8"),
    "fp8_online_blockwise_kv_noforms": ("fp8", "fp8"),
    "fp8_online_blockwise_kv_lean": ("fp8", "fp8"),
    "bf16_kv": ("bf16", "fp8"),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model dimensions a decode step's bytes and FLOPs depend on (from a HF config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    qk_norm: bool = True
    experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    moe_intermediate: int = 0

    @classmethod
    def from_config(cls, cfg: dict) -> Shape:
        """Shape of a Qwen3 / Qwen3-MoE config.json (make_models.py writes them)."""
        heads = int(cfg["num_attention_heads"])
        experts = int(cfg.get("num_experts") or 0)
        return cls(hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                   intermediate=int(cfg.get("intermediate_size") or 0), vocab=int(cfg["vocab_size"]),
                   qk_norm="qwen3" in str(cfg.get("model_type", "qwen3")).lower(), experts=experts,
                   experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
                   moe_intermediate=int(cfg.get("moe_intermediate_size") or 0) if experts else 0)


def attention_linears(s: Shape) -> list[tuple[str, int, int]]:
    """(name, N, K) of one layer's attention projections (qkv fused, as SGLang runs them)."""
    return [("qkv", (s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), ("o", s.hidden, s.heads * s.head_dim)]


def mlp_linears(s: Shape) -> list[tuple[str, int, int]]:
    """(name, N, K) of one dense MLP, or of one expert for MoE (gate_up fused)."""
    inter = s.moe_intermediate if s.experts else s.intermediate
    return [("gate_up", 2 * inter, s.hidden), ("down", s.hidden, inter)]


def matrix_bytes(n: int, k: int, dtype: str) -> int:
    """Bytes of an N x K weight: BF16, or FP8 codes plus one float32 scale per 128 x 128 block."""
    if dtype == "fp8":
        return n * k + 4 * math.ceil(n / BLOCK) * math.ceil(k / BLOCK)
    return n * k * BYTES[dtype]


def experts_touched(s: Shape, batch: int) -> float:
    """Expected distinct experts per layer that ``batch`` tokens route to (uniform top-k routing)."""
    if not s.experts:
        return 0.0
    return s.experts * (1.0 - (1.0 - s.experts_per_token / s.experts) ** batch)


def weight_bytes(s: Shape, weights: str, batch: int) -> dict[str, float]:
    """Bytes of weights one decode step reads, by part: layers (linears), router (MoE), lm_head, norms, embedding."""
    attn = sum(matrix_bytes(n, k, weights) for _, n, k in attention_linears(s))
    mlp = sum(matrix_bytes(n, k, weights) for _, n, k in mlp_linears(s))
    if s.experts:
        mlp *= experts_touched(s, batch)
    router = s.layers * s.experts * s.hidden * BYTES["bf16"]
    norm_elems = s.layers * (2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)) + s.hidden
    return {"layers": float(s.layers * (attn + mlp)), "router": float(router),
            "lm_head": float(s.vocab * s.hidden * BYTES["bf16"]), "norms": float(norm_elems * BYTES["bf16"]),
            "embedding": float(batch * s.hidden * BYTES["bf16"])}


def kv_bytes_per_token(s: Shape, kv: str) -> int:
    """KV-cache bytes of one token over all layers (K and V)."""
    return s.layers * 2 * s.kv_heads * s.head_dim * BYTES[kv]


def kv_bytes(s: Shape, kv: str, batch: int, context: float) -> dict[str, float]:
    """KV bytes a step reads (every context token of every request) and writes (one token per request)."""
    per_token = kv_bytes_per_token(s, kv)
    return {"kv_read": float(batch * context * per_token), "kv_write": float(batch * per_token)}


def linear_params_per_token(s: Shape) -> int:
    """Weights one token multiplies through in the layers (MoE: its k experts and the router)."""
    attn = sum(n * k for _, n, k in attention_linears(s))
    mlp = sum(n * k for _, n, k in mlp_linears(s))
    if s.experts:
        mlp = mlp * s.experts_per_token + s.experts * s.hidden
    return s.layers * (attn + mlp)


def step_flops(s: Shape, batch: int, context: float) -> dict[str, float]:
    """FLOPs of one decode step by part: layer linears, lm_head, attention (QK^T and PV)."""
    return {"linears": 2.0 * linear_params_per_token(s) * batch, "lm_head": 2.0 * s.vocab * s.hidden * batch,
            "attention": 4.0 * batch * context * s.heads * s.head_dim * s.layers}


def card_of(device: str) -> str | None:
    """The PEAK_TFLOPS row of a device name (e.g. 'NVIDIA H100 80GB HBM3' -> 'H100 SXM'), or None."""
    for pattern, card in _CARD_PATTERNS:
        if re.search(pattern, device or "", re.IGNORECASE):
            return card
    return None


def flop_seconds(flops: dict[str, float], weights: str, kv: str, peaks: dict[str, float]) -> dict[str, float]:
    """Each part's FLOPs at peak: linears at the weights' dtype, lm_head in BF16, attention at the KV dtype (FA3
    runs attention in FP8 over an FP8 cache)."""
    dtype = {"linears": weights, "lm_head": "bf16", "attention": kv}
    return {part: f / (peaks[dtype[part]] * 1e12) for part, f in flops.items()}


def compute_seconds(flops: dict[str, float], weights: str, kv: str, peaks: dict[str, float]) -> float:
    """Time of all the step's FLOPs at peak (``flop_seconds`` summed)."""
    return sum(flop_seconds(flops, weights, kv, peaks).values())


def step_model(s: Shape, weights: str, kv: str, batch: int, context: float, bandwidth_gbps: float,
               peaks: dict[str, float] | None) -> dict:
    """Bytes, FLOPs and the floor of one decode step; ``peaks`` None leaves the compute side out of the floor."""
    parts = {**weight_bytes(s, weights, batch), **kv_bytes(s, kv, batch, context)}
    flops = step_flops(s, batch, context)
    total = sum(parts.values())
    memory_s = total / (bandwidth_gbps * 1e9)
    compute_s = compute_seconds(flops, weights, kv, peaks) if peaks else None
    floor_s = memory_s if compute_s is None else max(memory_s, compute_s)
    return {"bytes": parts, "bytes_total": total, "flops": flops, "flops_total": sum(flops.values()),
            "memory_s": memory_s, "compute_s": compute_s, "floor_s": floor_s,
            "bound": "memory" if compute_s is None or memory_s >= compute_s else "compute"}


def group_floors(s: Shape, weights: str, kv: str, batch: int, context: float, bandwidth_gbps: float,
                 peaks: dict[str, float] | None) -> dict[str, float]:
    """Seconds each kernel group of a step needs at least (its bytes at the copy bandwidth, or its FLOPs at peak):
    GEMMs (layer linears, router), attention (K/V read and write), logits/sampling (lm_head), norms/rotary (their
    weights), other (the embedding rows); activation quantization has none (a producer can write the codes)."""
    b = {**weight_bytes(s, weights, batch), **kv_bytes(s, kv, batch, context)}
    f = flop_seconds(step_flops(s, batch, context), weights, kv, peaks) if peaks else {}
    bw = bandwidth_gbps * 1e9
    return {"GEMMs": max((b["layers"] + b["router"]) / bw, f.get("linears", 0.0)),
            "activation quantization": 0.0,
            "attention": max((b["kv_read"] + b["kv_write"]) / bw, f.get("attention", 0.0)),
            "norms/rotary": b["norms"] / bw,
            "logits/sampling": max(b["lm_head"] / bw, f.get("lm_head", 0.0)),
            "other": b["embedding"] / bw}


def fits(pool_tokens: int | None, batch: int, input_len: int, output_len: int) -> bool:
    """Whether bench_one_batch runs the cell: its KV pool holds batch x (input + output) tokens."""
    return pool_tokens is None or batch * (input_len + output_len) <= pool_tokens
