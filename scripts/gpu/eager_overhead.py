"""Host (CPU) time of one block-FP8 linear call without CUDA graphs, against BF16's F.linear, on Qwen3-8B shapes.

Decode without CUDA graphs (verl's enforce_eager, or a batch past the capture) is bound by the host: each linear's
Python and launch work, not its kernels. This script times the launch loop alone (the GPU is kept busy by a long
sleep kernel queued first, so the loop never waits for it) for each piece of the FP8 path:

  bf16            torch.nn.functional.linear
  act_quant       SGLang's 1x128 activation quantization in DeepGEMM's layout (column-major, TMA-aligned scales)
  deepgemm_mm     SGLang's DeepGEMM matmul on already-quantized input (its custom op, JIT hook, checks)
  deepgemm_direct deep_gemm.fp8_gemm_nt on the same operands, called directly
  sglang_linear   SGLang's dispatched block-FP8 linear (act_quant + deepgemm_mm + reshapes): SGLang's own path
  fp8rl_direct    this package's direct call of the same two launches (kernels.deepgemm.linear_direct)
  fp8rl_apply     this package's apply path (gemm_select.apply_selected, no choices, the direct call installed
                  where kernels.deepgemm.direct_reason allows it, as the server's load does)
  fp8rl_n64_sk4   this package's decode kernel after SGLang's row-major activation quantization (M <= 16)

and prints a table of microseconds per call, whether fp8rl_direct's outputs equal sglang_linear's bit for bit,
and a cProfile of sglang_linear's Python functions.

  python scripts/gpu/eager_overhead.py --json /tmp/eager_overhead.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

os.environ.setdefault("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")  # as the plugin sets it: no compile-every-M at import

import torch
import torch.nn.functional as F

from sglang_fp8rl.kernels import deepgemm, gemm_select
from sglang_fp8rl.quant import quantize_blockwise

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # (N, K)
SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU sleep: the launch loop never waits for the device


def host_us(fn, calls: int) -> float:
    """Microseconds of host time per call of fn, with the GPU busy so that no call waits for it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def pieces(n: int, k: int, m: int) -> dict:
    """name -> zero-argument callable of one (m, n, k) linear, for every piece this script times."""
    from sglang.srt.layers.quantization import fp8_utils

    from sglang_fp8rl.kernels.deepgemm import sglang_fp8_kernel

    dev = "cuda"
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_blockwise(w)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    default = fp8_utils.dispatch_w8a8_block_fp8_linear()
    fk = sglang_fp8_kernel()
    xq, xs = fk.sglang_per_token_group_quant_fp8(x, 128, column_major_scales=True, scale_tma_aligned=True)
    import deep_gemm

    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    out = {
        "bf16": lambda: F.linear(x, w),
        "act_quant": lambda: fk.sglang_per_token_group_quant_fp8(x, 128, column_major_scales=True,
                                                                 scale_tma_aligned=True),
        "deepgemm_mm": lambda: fk.w8a8_block_fp8_matmul_deepgemm(xq, wq, xs, ws, [128, 128],
                                                                 output_dtype=torch.bfloat16),
        "deepgemm_direct": lambda: deep_gemm.fp8_gemm_nt((xq, xs), (wq, ws), c),
        "sglang_linear": lambda: gemm_select.candidates.sglang_block_call(default, x, wq, ws, None),
        "fp8rl_direct": lambda: deepgemm.linear_direct(x, wq, ws, None),
        "fp8rl_apply": lambda: gemm_select.apply_selected(x, wq, ws, None, default),
    }
    if m <= gemm_select.OURS_MAX_M:
        ours = gemm_select.make_candidates()[f"{gemm_select.OURS_PREFIX}n64_sk4"].fn
        out["fp8rl_n64_sk4"] = lambda: ours(x, wq, ws, None)
    return out


def profile_top(fn, calls: int, top: int) -> str:
    """cProfile of `calls` calls of fn: the top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    why_not = deepgemm.direct_reason(deepgemm.detect())
    gemm_select.install({}, {}, direct=why_not is None)
    print(f"direct DeepGEMM call: {'installed' if why_not is None else 'not installed: ' + why_not}")
    rows, exact = [], []
    for name, (n, k) in SHAPES.items():
        for m in a.m:
            fns = pieces(n, k, m)
            exact.append({"shape": name, "m": m, "equal": bool(torch.equal(fns["fp8rl_direct"](),
                                                                          fns["sglang_linear"]()))})
            for piece, fn in fns.items():
                us = host_us(fn, a.calls)
                rows.append({"shape": name, "n": n, "k": k, "m": m, "piece": piece, "host_us": round(us, 1)})
    print("fp8rl_direct == sglang_linear bit for bit: "
          + ", ".join(f"{e['shape']} M {e['m']}: {e['equal']}" for e in exact))
    names = list(dict.fromkeys(r["piece"] for r in rows))
    print("| shape | M | " + " | ".join(names) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in names) + " |")
    for name in SHAPES:
        for m in a.m:
            got = {r["piece"]: r["host_us"] for r in rows if r["shape"] == name and r["m"] == m}
            print(f"| {name} | {m} | " + " | ".join(f"{got[c]:.1f}" if c in got else "-" for c in names) + " |")
    n, k = SHAPES["gate_up"]
    prof = profile_top(pieces(n, k, 64)["sglang_linear"], a.calls, a.profile_top)
    print("\ncProfile of sglang_linear, gate_up, M 64:\n" + prof)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "bit_exact": exact, "direct_reason": why_not, "profile": prof,
                       "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
