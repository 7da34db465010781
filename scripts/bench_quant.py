#!/usr/bin/env python
"""Benchmark the FP8 weight quantizers on one CUDA GPU against a device-to-device copy measured in the same run.

For each Qwen3-8B layer shape (qkv 6144x4096, o_proj 4096x4096, gate_up 24576x4096, down 4096x12288; embed and
lm_head are not quantized) and for the whole model (36 layers, one call per tensor, as the update path does), for
BF16 and FP32 inputs, blockwise (128x128) and per channel:

* bytes = input read once + FP8 codes written once + float32 scales written once; predicted time = bytes / copy
  bandwidth, the copy counting read + write of a 1 GiB buffer;
* triton: the dispatch with a NaN/Inf flag (the update path: no pre-check, no host sync; the whole-model pass ends
  with its one flag check), eager launches; graph: the same launches replayed from a CUDA graph (GPU time alone);
  precheck: the dispatch's default mode (aminmax + one host sync per tensor before each launch);
  torch ref: sglang_fp8rl.quant on CUDA tensors.

Times are medians of triton.testing.do_bench (CUDA events; it also clears L2 before each run); per-shape runs
rotate over enough tensor sets to move >= 512 MiB, so no input is read from L2. The kernel is first checked bit for
bit against the CPU reference on a real shape. Usage: python scripts/bench_quant.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import _paths  # noqa: F401  (this checkout's sglang_fp8rl first on sys.path)
import torch
from triton.testing import do_bench

from sglang_fp8rl import quant
from sglang_fp8rl.kernels import dispatch

QWEN3_8B_LAYER = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (24576, 4096),
    "down_proj": (4096, 12288),
}
NUM_LAYERS = 36
COPY_BYTES = 1 << 30
ROTATION_BYTES = 512 << 20  # ten times the H100's 50 MB L2
TARGET_FRACTION = 0.85
INPUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("block", "channel")

TensorSet = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# primitives


def scale_shape(shape: tuple[int, int], mode: str) -> tuple[int, ...]:
    return quant.blockwise_scale_shape(shape) if mode == "block" else (shape[0],)


def bytes_moved(shape: tuple[int, int], dtype: torch.dtype, mode: str) -> int:
    """Fewest bytes through device memory: the input once, the codes once, the scales once."""
    n, k = shape
    n_scales = 1
    for d in scale_shape(shape, mode):
        n_scales *= d
    return n * k * dtype.itemsize + n * k + 4 * n_scales


def make_set(shape: tuple[int, int], dtype: torch.dtype, mode: str) -> TensorSet:
    """Random weights (never zeros: they hide unwritten outputs and can run faster) and empty outputs."""
    w = torch.randn(shape, device="cuda", dtype=dtype) * 0.02
    q = torch.empty(shape, device="cuda", dtype=quant.FP8_DTYPE)
    s = torch.empty(scale_shape(shape, mode), device="cuda", dtype=torch.float32)
    return w, q, s


def median_ms(fn: Callable[[], None]) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(fn: Callable[[], None]) -> float:
    """Median time of ``fn`` captured in a CUDA graph: the launches' GPU time without Python in between."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def copy_bandwidth() -> float:
    """Device-to-device copy of a 1 GiB buffer, bytes read + written per second."""
    src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------------------------------
# the three paths


def triton_pass(sets: list[TensorSet], mode: str, flag: torch.Tensor, check_flag: bool) -> Callable[[], None]:
    """The update path: one kernel call per tensor, a NaN/Inf flag, optionally its one check at the end."""
    quantize = dispatch.quantize_blockwise_into if mode == "block" else dispatch.quantize_per_channel_into

    def run() -> None:
        for w, q, s in sets:
            quantize(w, q, s, nonfinite_flag=flag)
        if check_flag:
            dispatch.check_nonfinite_flag(flag)

    return run


def precheck_pass(sets: list[TensorSet], mode: str) -> Callable[[], None]:
    quantize = dispatch.quantize_blockwise_into if mode == "block" else dispatch.quantize_per_channel_into

    def run() -> None:
        for w, q, s in sets:
            quantize(w, q, s)

    return run


def reference_pass(sets: list[TensorSet], mode: str) -> Callable[[], None]:
    quantize = quant.quantize_blockwise_into if mode == "block" else quant.quantize_per_channel_into

    def run() -> None:
        for w, q, s in sets:
            quantize(w, q, s)

    return run


# ---------------------------------------------------------------------------------------------------------------------
# checks before timing


def check_bit_exact(shape: tuple[int, int]) -> list[str]:
    """Kernel vs CPU reference on a real shape (must match), and quant.py on CUDA vs on CPU (informational)."""
    lines = []
    for dtype_name, dtype in INPUT_DTYPES.items():
        for mode in MODES:
            w, q, s = make_set(shape, dtype, mode)
            w.mul_(torch.exp(torch.randn(shape[0], 1, device="cuda") * 3))  # block amaxes over many binades
            ref = quant.quantize_blockwise if mode == "block" else quant.quantize_per_channel
            q_cpu, s_cpu = ref(w.cpu())
            triton_pass([(w, q, s)], mode, dispatch.new_nonfinite_flag("cuda"), True)()
            same = torch.equal(q.cpu().view(torch.uint8), q_cpu.view(torch.uint8)) and torch.equal(s.cpu(), s_cpu)
            if not same:
                raise SystemExit(f"kernel differs from the CPU reference: {dtype_name} {mode} {shape}")
            q_gpu, s_gpu = ref(w)
            s_diff = int((s_gpu.cpu() != s_cpu).sum())
            q_diff = int((q_gpu.cpu().view(torch.uint8) != q_cpu.view(torch.uint8)).sum())
            lines.append(
                f"{dtype_name} {mode}: kernel == CPU reference (bit-exact); quant.py on CUDA vs CPU: "
                f"{s_diff}/{s_cpu.numel()} scales and {q_diff}/{q_cpu.numel()} codes differ"
            )
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# measurements


def measure(name: str, sets: list[TensorSet], dtype_name: str, mode: str, per_call: int, copy_bps: float) -> dict:
    """Time the three paths over ``sets``; times are per ``per_call`` tensors (one pass over a model or one tensor)."""
    calls = len(sets) // per_call
    n_bytes = sum(bytes_moved(tuple(w.shape), w.dtype, mode) for w, _, _ in sets) // calls
    whole_model = per_call > 1
    flag = dispatch.new_nonfinite_flag("cuda")
    row = {
        "case": name,
        "input": dtype_name,
        "mode": mode,
        "tensors": per_call,
        "bytes": n_bytes,
        "predicted_us": n_bytes / copy_bps * 1e6,
    }
    eager = triton_pass(sets, mode, flag, check_flag=whole_model)
    row["triton_us"] = median_ms(eager) / calls * 1e3
    row["graph_us"] = graph_ms(triton_pass(sets, mode, flag, check_flag=False)) / calls * 1e3
    row["precheck_us"] = median_ms(precheck_pass(sets, mode)) / calls * 1e3
    row["torch_ref_us"] = median_ms(reference_pass(sets, mode)) / calls * 1e3
    dispatch.check_nonfinite_flag(flag)
    row["triton_gbps"] = n_bytes / row["triton_us"] / 1e3
    row["fraction_of_copy"] = row["predicted_us"] / row["triton_us"]
    row["graph_fraction_of_copy"] = row["predicted_us"] / row["graph_us"]
    row["speedup_vs_torch_ref"] = row["torch_ref_us"] / row["triton_us"]
    print(
        f"  {name:>13} {dtype_name} {mode:>7}: predicted {row['predicted_us']:9.1f} us, triton {row['triton_us']:9.1f} "
        f"us ({100 * row['fraction_of_copy']:5.1f}% of copy), graph {row['graph_us']:9.1f} us, precheck "
        f"{row['precheck_us']:9.1f} us, torch ref {row['torch_ref_us']:10.1f} us",
        flush=True,
    )
    return row


def per_shape_rows(copy_bps: float) -> list[dict]:
    rows = []
    for dtype_name, dtype in INPUT_DTYPES.items():
        for mode in MODES:
            for name, shape in QWEN3_8B_LAYER.items():
                n_sets = max(2, -(-ROTATION_BYTES // bytes_moved(shape, dtype, mode)))
                sets = [make_set(shape, dtype, mode) for _ in range(n_sets)]
                rows.append(measure(name, sets, dtype_name, mode, 1, copy_bps))
                del sets
                torch.cuda.empty_cache()
    return rows


def whole_model_rows(copy_bps: float) -> list[dict]:
    rows = []
    for dtype_name, dtype in INPUT_DTYPES.items():
        for mode in MODES:
            sets = [make_set(shape, dtype, mode) for _ in range(NUM_LAYERS) for shape in QWEN3_8B_LAYER.values()]
            rows.append(measure(f"Qwen3-8B x{NUM_LAYERS}", sets, dtype_name, mode, len(sets), copy_bps))
            del sets
            torch.cuda.empty_cache()
    return rows


def host_overhead_us(calls: int = 2000) -> dict[str, float]:
    """Host time per call, on a 128x128 tensor (GPU work negligible): what the eager update loop pays per tensor."""
    from sglang_fp8rl.kernels import triton_quant

    w, q, s = make_set((128, 128), torch.bfloat16, "block")
    flag = dispatch.new_nonfinite_flag("cuda")
    candidates = {
        "dispatch (flag)": lambda: dispatch.quantize_blockwise_into(w, q, s, nonfinite_flag=flag),
        "dispatch (pre-check)": lambda: dispatch.quantize_blockwise_into(w, q, s),
        "launcher only": lambda: triton_quant.quantize_blockwise_launch(w, q, s, quant.DEFAULT_BLOCK_SIZE, False, flag),
        "torch zero_ (baseline)": lambda: s.zero_(),
    }
    result = {}
    for name, fn in candidates.items():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        result[name] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    return result


# ---------------------------------------------------------------------------------------------------------------------
# report


def print_predictions(copy_bps: float) -> None:
    print(f"\nbytes and predicted time at the measured copy bandwidth ({copy_bps / 1e9:.0f} GB/s):")
    for dtype_name, dtype in INPUT_DTYPES.items():
        for mode in MODES:
            total = 0
            for name, shape in QWEN3_8B_LAYER.items():
                b = bytes_moved(shape, dtype, mode)
                total += NUM_LAYERS * b
                print(f"  {name:>13} {dtype_name} {mode:>7}: {b / 1e6:9.2f} MB -> {b / copy_bps * 1e6:8.1f} us")
            whole = f"{total / 1e9:9.3f} GB -> {total / copy_bps * 1e3:8.3f} ms"
            print(f"  {'whole model':>13} {dtype_name} {mode:>7}: {whole}")


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| case | input | mode | MB | predicted us | triton us | GB/s | % of copy | graph us | % of copy (graph) "
        "| precheck us | torch ref us | speedup |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['input']} | {r['mode']} | {r['bytes'] / 1e6:.1f} | {r['predicted_us']:.1f} | "
            f"{r['triton_us']:.1f} | {r['triton_gbps']:.0f} | {100 * r['fraction_of_copy']:.1f} | "
            f"{r['graph_us']:.1f} | {100 * r['graph_fraction_of_copy']:.1f} | {r['precheck_us']:.1f} | "
            f"{r['torch_ref_us']:.1f} | "
            f"{r['speedup_vs_torch_ref']:.1f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}")

    copy_bps = copy_bandwidth()
    print(f"device-to-device copy (1 GiB, read + write): {copy_bps / 1e9:.0f} GB/s")
    print_predictions(copy_bps)

    print("\nbit-exactness on o_proj (4096x4096), rows scaled over many binades:")
    consistency = check_bit_exact(QWEN3_8B_LAYER["o_proj"])
    for line in consistency:
        print(f"  {line}")

    print("\nhost time per call (128x128 input, so the GPU never limits it):")
    overhead = host_overhead_us()
    for name, us in overhead.items():
        print(f"  {name:>24}: {us:6.1f} us")

    print("\nper tensor (rotating buffers):")
    rows = per_shape_rows(copy_bps)
    print(f"\nwhole model ({NUM_LAYERS} layers x {len(QWEN3_8B_LAYER)} tensors, one call each):")
    model_rows = whole_model_rows(copy_bps)
    rows += model_rows

    target_row = next(r for r in model_rows if r["input"] == "bf16" and r["mode"] == "block")
    met = target_row["fraction_of_copy"] >= TARGET_FRACTION
    print(f"\ncopy bandwidth {copy_bps / 1e9:.0f} GB/s on {device}\n")
    print(markdown_table(rows))
    print(
        f"\ntarget: whole model, BF16, blockwise >= {100 * TARGET_FRACTION:.0f}% of copy bandwidth: "
        f"{100 * target_row['fraction_of_copy']:.1f}% -> {'MET' if met else 'NOT MET'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device,
                    "torch": torch.__version__,
                    "copy_gbps": copy_bps / 1e9,
                    "target_fraction": TARGET_FRACTION,
                    "target_met": met,
                    "consistency": consistency,
                    "host_overhead_us": overhead,
                    "rows": rows,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
