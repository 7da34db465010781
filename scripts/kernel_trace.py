"""GPU kernels of a torch.profiler chrome trace: each kernel's class (GEMM, activation quantization, attention, ...),
totals per kernel, and the top-kernels table of scripts/bench_rollout.py --profile-decode."""

from __future__ import annotations

import collections
import gzip
import json
import re

# First match wins. The quantizer and attention come before the FP8 GEMM: their template arguments name e4m3 too
# (per_token_group_quant<..., __nv_fp8_e4m3>, FA3's FP8 kernel over an FP8 KV cache). The K/V write counts as attention.
# The norm and SiLU that also quantize their output (--fp8rl-producer-quant) count as norms: the quantizer they replace
# leaves the activation-quantization group.
_KERNEL_CLASSES = [
    ("norm/rope/act", r"rmsnorm_quant|silu_mul_quant"),
    ("act quant", r"quant"),
    ("attention", r"attn|attention|decode_kernel|_fwd_kernel|_fwd_grouped|flash::|mha|paged|store_kv|scaled_store"),
    ("norm/rope/act", r"rmsnorm|rms_norm|layernorm|norm::|qknorm|rotary|rope|silu|act_and_mul|gelu"),
    ("fp8 gemm", r"deep_gemm|fp8_gemm|sm90_fp8|w8a8|scaled_mm|e4m3|fp8_blockwise|block_fp8|_fp8_matmul|cutlass.*fp8"),
    ("gemm (bf16)", r"nvjet|gemm|cublas|cutlass|xmma|sm90_|matmul|Kernel2"),
    ("moe routing/align", r"topk|moe_align|moe_sum|router|expert|count_and_sort"),
    ("moe gemm", r"fused_moe"),
]


def classify_kernel(name: str) -> str:
    n = name.lower()
    for label, pat in _KERNEL_CLASSES:
        if re.search(pat, n):
            return label
    return "other"


def kernel_events(trace: dict):
    """(name, duration us) of every GPU kernel event of a chrome trace (torch.profiler export), in trace order."""
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and str(ev.get("cat", "")).lower() == "kernel":
            yield ev.get("name", "?"), float(ev.get("dur", 0.0))


def kernel_totals(trace: dict) -> dict:
    """name -> [total_us, count] over the GPU kernel events of a chrome trace (torch.profiler export)."""
    tot = collections.defaultdict(lambda: [0.0, 0])
    for name, dur in kernel_events(trace):
        t = tot[name]
        t[0] += dur
        t[1] += 1
    return dict(tot)


def format_kernel_summary(tot: dict, title: str, steps: int = 1, top: int = 25) -> str:
    total = sum(v[0] for v in tot.values())
    lines = [(f"### {title}: {len(tot)} kernels, {total / 1e3 / max(1, steps):.3f} ms GPU kernel time per decode "
              f"step ({steps} steps profiled)")]
    if not tot:
        lines.append("(no GPU kernel events in the trace; CUDA-graph replays may not be visible to the profiler)")
        return "\n".join(lines)
    cats = collections.defaultdict(float)
    for name, (us, _) in tot.items():
        cats[classify_kernel(name)] += us
    lines.append("by class: " + ", ".join(f"{c} {100 * us / total:.1f}%" for c, us in
                                          sorted(cats.items(), key=lambda kv: -kv[1])))
    lines.append(f"{'%':>6} {'us/step':>10} {'calls/step':>10}  class            kernel")
    for name, (us, cnt) in sorted(tot.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{100 * us / total:6.2f} {us / max(1, steps):10.1f} {cnt / max(1, steps):10.1f}  "
                     f"{classify_kernel(name):16s} {name[:140]}")
    return "\n".join(lines)


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)
