#!/usr/bin/env python3
"""Rollout throughput: online blockwise FP8 (this plugin) vs BF16, SGLang's pre-quantized block-FP8 and online
per-channel FP8.

One command, one run, one table. Each config is one subprocess of `sglang.benchmark.one_batch` (what
`python -m sglang.bench_one_batch` runs: a static batch, prefill then greedy decode, no server) on a dummy-weight
Qwen3-8B-shaped model (`--moe`: Qwen3-30B-A3B-shaped), with in-process hooks (see `_child`):

  bf16                  qwen3-8b, no quantization (cuBLAS BF16 GEMMs)
  fp8_online_blockwise  qwen3-8b, --quantization fp8_online_blockwise (this plugin: 128x128 FP32-scaled weight blocks
                        quantized at load, dynamic 1x128 activation groups). Its dummy weights are left alone: the
                        plugin quantizes SGLang's BF16 dummy values itself.
  block_prequant        qwen3-8b-block (config.json quantization_config fp8/e4m3/dynamic/[128,128]): SGLang's own
                        pre-quantized block-FP8 path (DeepGEMM on sm90), SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
  fp8_channel           qwen3-8b, --quantization fp8 (online per-output-channel weight scales, per-token activations)
Opt-in (--configs), the FP8 KV cache of issue 15:
  fp8_online_blockwise_kv         fp8_online_blockwise + --kv-cache-dtype fp8_e4m3 (K/V scales calibrated at load:
                                  the plugin's default for this pair of flags)
  fp8_online_blockwise_kv_static  the same + --fp8rl-kv-scales static (SGLang's scale 1.0, no decode fold)
  fp8_online_blockwise_kv_sglang_write  fp8_online_blockwise_kv + --fp8rl-kv-write sglang (SGLang's K/V write and a
                                  clamp, instead of the default one-kernel write)
  fp8_online_blockwise_kv_fa3     fp8_online_blockwise_kv + --fp8rl-decode-attention fa3 (FlashAttention-3's FP8
                                  decode at every batch size)
  fp8_online_blockwise_kv_splitkv fp8_online_blockwise_kv + --fp8rl-decode-attention split_kv (the plugin's split-KV
                                  decode at every batch size; the default, auto, takes it up to 8 sequences)
  bf16_kv                         BF16 weights + --kv-cache-dtype fp8_e4m3 (SGLang's static scale 1.0)
  fp8_online_noselect             the plugin with SGLang's GEMM dispatch only (--fp8rl-gemm-select off)

For block_prequant and fp8_channel the FP8 dummy weights found at dummy init are refilled with U(-2,2) in e4m3 and
weight_scale_inv := 5e-4 (SGLang's dummy init casts U(-1e-3,1e-3) to e4m3, which leaves ~98 % zeros and negative
scales). fp8_channel quantizes after dummy init, so there the hook finds nothing to refill.

Common flags: --load-format dummy --attention-backend triton (or
--attention-backend flashinfer / fa3; fa3 only where sglang-kernel's FlashAttention-3 imports) --sampling-backend
pytorch --grammar-backend none --dtype bfloat16 --disable-prefill-cuda-graph --cuda-graph-bs-decode <the batch sizes>
--mem-fraction-static 0.7, input 512, output 1024 (--output-len takes several lengths: one process runs them all).
With flashinfer, FP8-KV configs run with SGLANG_FLASHINFER_USE_PAGED=1 (its ragged prefix path ignores KV scales).
--bf16-backend B runs BF16 once more on backend B (label bf16@B), so that "BF16 on its fastest backend" is measured
in the same run; --merge RESULTS.json adds the entries of an earlier run (labels config@backend) to the tables.
bench_one_batch warms up once at the first batch size (32 decode steps), then runs each (batch size, output length)
once (--repeat N runs the whole list N times; the table uses the last pass). Decode tok/s is bs / median step latency.
Batch sizes whose (input+output) x bs exceed the KV pool are skipped by bench_one_batch ("skipped (KV)").
FP8-KV configs get a second table (scripts/kv_measure.py): decode ratios over BF16 on the same backend and on BF16's
fastest backend at outputs 256 / 1024 and bs 64 / 128, issue 15's targets with margins, and the load-time K/V-scale
recalibration time (parsed from the engine's log) against a 1024-token rollout at bs 128.

The tail (--input-len with several lengths): every (batch size, prompt length) runs in one process per config; the
main tables keep the first length, and a second table (scripts/tail_table.py) gives each config's decode step at
every (context, bs) and its speed-up over the first config, with the batch-1 8k-context target (>= 1.4x).

Writes under --out: results.json (everything parsed), summary.md (the table), logs.tgz (per-config logs, jsonl,
env, profiler traces), and with --profile-decode profile_top_kernels.txt.

  python scripts/bench_rollout.py --out /tmp/rollout                      # 4 configs, bs 64 128, ~5-6 min warm
  python scripts/bench_rollout.py --batch-sizes 1 8 32 64 128 256 --out /tmp/r2
  python scripts/bench_rollout.py --moe --out /tmp/moe                    # Qwen3-30B-A3B shape (bs 32 64, out 512)
  python scripts/bench_rollout.py --configs fp8_online_blockwise --profile-decode --batch-sizes 128 --output-len 256
  # the tail on FA3: decode at bs 1 4 16 after 4k and 8k-token prompts, BF16 first (the baseline)
  python scripts/bench_rollout.py --attention-backend fa3 --configs bf16 fp8_online_blockwise \\
      fp8_online_blockwise_kv --batch-sizes 1 4 16 --input-len 4096 8192 --output-len 64 --out /tmp/tail
  # FP8 KV on triton (~5 min warm), then on FlashInfer with the triton results merged (BF16 best of both):
  python scripts/bench_rollout.py --configs bf16 fp8_online_blockwise_kv fp8_online_blockwise_kv_static \\
      --output-len 256 1024 --out /tmp/kv
  python scripts/bench_rollout.py --attention-backend flashinfer --configs bf16 fp8_online_blockwise_kv \\
      --output-len 256 1024 --merge /tmp/kv/results.json --out /tmp/kv_fi
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import kv_measure as KV  # scripts/kv_measure.py: the FP8-KV tables and log parsing
import tail_table as TAIL  # scripts/tail_table.py: decode at small batch over long contexts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ["bf16", "fp8_online_blockwise", "block_prequant", "fp8_channel"]
# opt-in: FP8 KV cache
KV_CONFIGS = ["fp8_online_blockwise_kv", "fp8_online_blockwise_kv_static", "fp8_online_blockwise_kv_sglang_write",
              "fp8_online_blockwise_kv_fa3", "fp8_online_blockwise_kv_splitkv", "bf16_kv"]
EXTRA_CONFIGS = ["fp8_online_noselect", *KV_CONFIGS]  # opt-in (--configs)
DESC = {
    "bf16": "BF16, no quantization",
    "fp8_online_blockwise": "--quantization fp8_online_blockwise (this plugin, GEMM per shape measured at load)",
    "fp8_online_noselect": "--quantization fp8_online_blockwise --fp8rl-gemm-select off (SGLang's GEMM dispatch)",
    "block_prequant": "pre-quantized block-FP8 checkpoint (SGLang, DeepGEMM)",
    "fp8_channel": "--quantization fp8 (online per-channel W, per-token A)",
    "fp8_online_blockwise_kv": "fp8_online_blockwise + --kv-cache-dtype fp8_e4m3 (K/V scales calibrated at load)",
    "fp8_online_blockwise_kv_static": "fp8_online_blockwise + --kv-cache-dtype fp8_e4m3 --fp8rl-kv-scales static",
    "fp8_online_blockwise_kv_sglang_write": "fp8_online_blockwise_kv + --fp8rl-kv-write sglang",
    "fp8_online_blockwise_kv_fa3": "fp8_online_blockwise_kv + --fp8rl-decode-attention fa3 (FA3's FP8 decode)",
    "fp8_online_blockwise_kv_splitkv": "fp8_online_blockwise_kv + --fp8rl-decode-attention split_kv (every batch)",
    "bf16_kv": "BF16 weights + --kv-cache-dtype fp8_e4m3 (SGLang's static scale 1.0)",
}
SHORT = {"bf16": "bf16", "fp8_online_blockwise": "online", "block_prequant": "block_prequant",
         "fp8_channel": "fp8_channel", "fp8_online_noselect": "online_noselect"}
_FP8_KV = ["--kv-cache-dtype", "fp8_e4m3"]
DECODE_ATTENTION_FLAG = "--fp8rl-decode-attention"
_ONLINE = ["--quantization", "fp8_online_blockwise"]
# (numerator, denominator, metric, batch size or None for every bs, threshold)
TARGETS = [
    ("fp8_online_blockwise", "bf16", "decode", 64, 1.40),
    ("fp8_online_blockwise", "bf16", "decode", 128, 1.40),
    ("fp8_online_blockwise", "fp8_channel", "decode", None, 1.00),
    ("fp8_online_blockwise", "bf16", "prefill", None, 1.45),
    ("fp8_online_blockwise", "block_prequant", "decode", None, 0.98),
    ("fp8_online_blockwise", "block_prequant", "prefill", None, 0.98),
]
RATIO_PAIRS = [
    ("fp8_online_blockwise", "bf16"),
    ("fp8_online_blockwise", "block_prequant"),
    ("fp8_online_blockwise", "fp8_channel"),
    ("block_prequant", "bf16"),
    ("fp8_channel", "bf16"),
    ("fp8_online_blockwise", "fp8_online_noselect"),
]
METRIC_KEY = {"prefill": "prefill_throughput", "decode": "median_decode_throughput", "total": "overall_throughput"}
ECHO_RE = re.compile(
    r"\[fp8rl\]|\[bench_rollout\]|Load weight end|max_total_num_tokens=|Prefill\. latency|Decode\.  median|"
    r"Total\. latency|skipping \(|Traceback|Error|error:|CUDA out of memory")


# ----------------------------------------------------------------------------------------------------------------
# pure helpers (unit-tested in tests/test_scripts_metrics.py)
# ----------------------------------------------------------------------------------------------------------------

def model_names(moe: bool) -> tuple[str, str]:
    return ("qwen3-30b-a3b", "qwen3-30b-a3b-block") if moe else ("qwen3-8b", "qwen3-8b-block")


def _base_spec(cfg: str, moe: bool) -> dict:
    plain, block = model_names(moe)
    specs = {
        "bf16": (plain, [], "0"),
        "fp8_online_blockwise": (plain, _ONLINE, "0"),
        "block_prequant": (block, [], "1"),
        "fp8_channel": (plain, ["--quantization", "fp8"], "1"),
        "fp8_online_noselect": (plain, [*_ONLINE, "--fp8rl-gemm-select", "off"], "0"),
        "fp8_online_blockwise_kv": (plain, [*_ONLINE, *_FP8_KV], "0"),
        "fp8_online_blockwise_kv_static": (plain, [*_ONLINE, *_FP8_KV, KV.KV_SCALES_FLAG, "static"], "0"),
        "fp8_online_blockwise_kv_sglang_write": (plain, [*_ONLINE, *_FP8_KV, KV.KV_WRITE_FLAG, "sglang"], "0"),
        "fp8_online_blockwise_kv_fa3": (plain, [*_ONLINE, *_FP8_KV, DECODE_ATTENTION_FLAG, "fa3"], "0"),
        "fp8_online_blockwise_kv_splitkv": (plain, [*_ONLINE, *_FP8_KV, DECODE_ATTENTION_FLAG, "split_kv"], "0"),
        "bf16_kv": (plain, _FP8_KV, "0"),
    }
    if cfg not in specs:
        raise ValueError(f"unknown config {cfg!r}; choose from {CONFIGS + EXTRA_CONFIGS}")
    model, flags, refill = specs[cfg]
    return {"model": model, "flags": list(flags), "env": {"FP8RL_BENCH_REFILL": refill}}


def config_spec(cfg: str, moe: bool = False, backend: str = KV.DEFAULT_ATTENTION_BACKEND) -> dict:
    """model folder name, extra bench flags, extra env for one config on one attention backend."""
    spec = _base_spec(cfg, moe)
    spec["env"].update(KV.backend_env(spec["flags"], backend))
    return spec


def run_label(cfg: str, backend: str, main_backend: str) -> str:
    """Result label: the config's name on the run's backend, `config@backend` on another one."""
    return cfg if backend == main_backend else f"{cfg}@{backend}"


def plan_runs(configs, main_backend: str, bf16_backends=()) -> list[tuple[str, str, str]]:
    """(label, config, backend) in run order; BF16 on each extra backend runs right after BF16 (or first)."""
    extra = [b for b in dict.fromkeys(bf16_backends) if b != main_backend]
    runs = []
    for cfg in dict.fromkeys(configs):
        runs.append((run_label(cfg, main_backend, main_backend), cfg, main_backend))
        if cfg == "bf16":
            runs += [(run_label(cfg, b, main_backend), cfg, b) for b in extra]
    if "bf16" not in configs:
        runs = [(run_label("bf16", b, main_backend), "bf16", b) for b in extra] + runs
    return runs


def _lens(output_len) -> list[int]:
    return [int(output_len)] if isinstance(output_len, int) else [int(x) for x in output_len]


def bench_flags(model_path: str, batch_sizes, input_len, output_len, mem_fraction: float,
                result_file: str, run_name: str, repeat: int = 1, prefill_graph: bool = False,
                attention_backend: str = KV.DEFAULT_ATTENTION_BACKEND) -> list[str]:
    """bench_one_batch flags of one config; input_len and output_len are each one length or a list (one process runs
    every combination)."""
    bs_sweep = [str(b) for b in list(batch_sizes) * max(1, repeat)]
    graph_bs = [str(b) for b in sorted({int(b) for b in batch_sizes})]
    prefill = [] if prefill_graph else ["--disable-prefill-cuda-graph"]
    return ["--model-path", model_path, "--load-format", "dummy", "--attention-backend", attention_backend,
            "--sampling-backend", "pytorch", "--grammar-backend", "none", "--dtype", "bfloat16",
            "--batch-size", *bs_sweep, "--input-len", *[str(x) for x in _lens(input_len)],
            "--output-len", *[str(x) for x in _lens(output_len)],
            *prefill, "--cuda-graph-bs-decode", *graph_bs,
            "--mem-fraction-static", str(mem_fraction), "--result-filename", result_file, "--run-name", run_name]


def sweep_order(batch_sizes, output_len, repeat: int = 1) -> list[tuple[int, int]]:
    """(bs, output_len) in the order bench_one_batch runs them (itertools.product over bs, input, output)."""
    return [(int(b), ol) for b in list(batch_sizes) * max(1, repeat) for ol in _lens(output_len)]


def profile_flags(prefix: str, output_len, steps: int) -> list[str]:
    start = max(1, min(64, min(_lens(output_len)) // 2))
    return ["--profile", "--profile-stage", "decode", "--profile-start-step", str(start), "--profile-steps",
            str(steps), "--profile-activities", "GPU", "--profile-prefix", prefix]


_SKIP_RE = re.compile(r"skipping \((\d+), (\d+), (\d+)\) due to max batch size limit")


def _next_in_sweep(sweep, pos: int, bs: int, output_len=None):
    """Index of the next sweep entry at or after pos with this bs (and output length), or None."""
    for i in range(pos, len(sweep)):
        if sweep[i][0] == bs and (output_len is None or sweep[i][1] == output_len):
            return i
    return None


def parse_rows_from_log(text: str, sweep=None) -> list[dict]:
    """bench_one_batch's printed results after 'Benchmark ...' (fallback when it died before writing its jsonl).

    The log does not print a row's output length; with `sweep` (sweep_order()) each row gets the next planned
    (bs, output_len) of its batch size, and skip lines consume theirs."""
    rows, cur, on, pos = [], None, False, 0
    for line in text.splitlines():
        if "Benchmark ..." in line:
            on = True
            continue
        if not on:
            continue
        m = _SKIP_RE.search(line)
        if m and sweep:
            i = _next_in_sweep(sweep, pos, int(m[1]), int(m[3]))
            pos = pos if i is None else i + 1
            continue
        m = re.search(r"Prefill\. latency: *([0-9.]+) s, throughput: *([0-9.]+)", line)
        if m:
            cur = {"prefill_latency": float(m[1]), "prefill_throughput": float(m[2])}
            continue
        m = re.search(r"Decode 0\. Batch size: *(\d+)", line)
        if m and cur is not None:
            cur["batch_size"] = int(m[1])
        m = re.search(r"Decode\.  median latency: *([0-9.]+) s, median throughput: *([0-9.]+)", line)
        if m and cur is not None:
            cur["median_decode_latency"], cur["median_decode_throughput"] = float(m[1]), float(m[2])
        m = re.search(r"Total\. latency: *([0-9.]+) s, throughput: *([0-9.]+)", line)
        if m and cur is not None and "batch_size" in cur:
            cur["total_latency"], cur["overall_throughput"] = float(m[1]), float(m[2])
            i = _next_in_sweep(sweep, pos, cur["batch_size"]) if sweep else None
            if i is not None:
                cur["output_len"], pos = sweep[i][1], i + 1
            rows.append(cur)
            cur = None
    return rows


def parse_log(text: str) -> dict:
    """Facts from one bench log: weight memory (GiB; SGLang prints GiB as 'GB'), KV-cache tokens, [fp8rl] lines..."""
    info = {"weight_gib": None, "kv_tokens": None, "kv_dtype": None, "load_line": None, "fp8rl": [],
            "quant_methods": [], "gemm_calls": None, "skipped_bs": [], "skipped": [], "error_tail": [],
            "kv_recal_ms": KV.recalibration_times(text), "kv_option_missing": KV_OPTION_MISSING in text}
    for line in text.splitlines():
        m = re.search(r"Load weight end\..*mem usage=([0-9.]+) GB", line)
        if m:
            info["weight_gib"] = float(m[1])
            info["load_line"] = line[line.index("Load weight end"):].strip()[:300]
        m = re.search(r"max_total_num_tokens=(\d+)", line)
        if m:
            info["kv_tokens"] = int(m[1])
        m = re.search(r"KV [Cc]ache (?:is )?allocated\. dtype: ([^,]+), #tokens: (\d+)", line)
        if m:
            info["kv_dtype"] = m[1].strip()
            if info["kv_tokens"] is None or "Post-capture" in line:
                info["kv_tokens_pool"] = int(m[2])
        if "[fp8rl]" in line and len(info["fp8rl"]) < 20:
            info["fp8rl"].append(line[line.index("[fp8rl]"):].strip()[:400])
        if "[bench_rollout] quant methods:" in line:
            info["quant_methods"].append(line[line.index("quant methods:"):].strip()[:600])
        if "[bench_rollout] gemm calls" in line:
            info["gemm_calls"] = line[line.index("gemm calls"):].strip()[:600]
        m = _SKIP_RE.search(line)
        if m:
            info["skipped_bs"].append(int(m[1]))
            info["skipped"].append([int(m[1]), int(m[3])])
    if info["kv_tokens"] is None and info.get("kv_tokens_pool") is not None:
        info["kv_tokens"] = info["kv_tokens_pool"]
    lines = [ln for ln in text.splitlines() if ln.strip() and not re.fullmatch(r"\[ *[0-9.]+\] *", ln)]
    tb = [i for i, ln in enumerate(lines) if "Traceback" in ln]
    if tb:
        info["error_tail"] = [ln[:300] for ln in lines[tb[-1]:][-25:]]
    return info


def _row_len_matches(row: dict, output_len) -> bool:
    return output_len is None or "output_len" not in row or int(row["output_len"]) == int(output_len)


def last_pass(results: dict, output_len=None) -> dict:
    """(config, bs) -> the last row of that bs (the clean one when --repeat > 1), of one output length if given."""
    best = {}
    for cfg, res in results.items():
        for r in res.get("rows", []):
            if _row_len_matches(r, output_len):
                best[(cfg, int(r["batch_size"]))] = r
    return best


def ratio(best: dict, num: str, den: str, bs: int, metric: str):
    a, b = best.get((num, bs)), best.get((den, bs))
    k = METRIC_KEY[metric]
    if not a or not b or not a.get(k) or not b.get(k):
        return None
    return a[k] / b[k]


def compute_ratios(best: dict) -> list[dict]:
    out = []
    bss = sorted({bs for (_, bs) in best})
    for num, den in RATIO_PAIRS:
        for bs in bss:
            vals = {m: ratio(best, num, den, bs, m) for m in ("prefill", "decode", "total")}
            if any(v is not None for v in vals.values()):
                out.append({"num": num, "den": den, "bs": bs, **vals})
    return out


def check_targets(best: dict) -> list[dict]:
    out = []
    bss = sorted({bs for (_, bs) in best})
    for num, den, metric, tbs, thr in TARGETS:
        for bs in ([tbs] if tbs is not None else bss):
            v = ratio(best, num, den, bs, metric)
            out.append({"num": num, "den": den, "metric": metric, "bs": bs, "threshold": thr, "value": v,
                        "status": "n/a" if v is None else ("PASS" if v >= thr else "FAIL")})
    return out


def _f(v, fmt="{:,.0f}", none="—"):
    return none if v is None else fmt.format(v)


def _skipped(res: dict, bs: int, output_len, several_lens: bool) -> bool:
    if several_lens and res.get("skipped") is not None:
        return [bs, output_len] in [list(x) for x in res["skipped"]]
    return bs in res.get("skipped_bs", [])


def _throughput_table(results: dict, meta: dict, output_len, several_lens: bool) -> list[str]:
    lines = ["| config | bs | prefill tok/s | decode tok/s | decode ms/step | total tok/s | weight GiB | KV tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cfg, res in results.items():
        rows = {int(r["batch_size"]): r for r in res.get("rows", []) if _row_len_matches(r, output_len)}
        bss = meta.get("batch_sizes") or sorted(rows)
        for bs in bss:
            r = rows.get(int(bs))
            w, kv = _f(res.get("weight_gib"), "{:.2f}"), _f(res.get("kv_tokens"))
            if r is None:
                why = "skipped (KV)" if _skipped(res, int(bs), output_len, several_lens) else \
                    res.get("status", "no result")
                lines.append(f"| {cfg} | {bs} | {why} | | | | {w} | {kv} |")
                continue
            lat = r.get("median_decode_latency")
            lines.append(f"| {cfg} | {bs} | {_f(r.get('prefill_throughput'))} | "
                         f"{_f(r.get('median_decode_throughput'))} | "
                         f"{_f(None if lat is None else lat * 1e3, '{:.2f}')} | {_f(r.get('overall_throughput'))} | "
                         f"{w} | {kv} |")
    return lines


def input_lens_of(meta: dict) -> list:
    """The run's prompt lengths, the primary (first) one first."""
    return meta.get("input_lens") or [meta.get("input_len")]


def of_input_len(results: dict, input_len) -> dict:
    """``results`` with only the rows of one prompt length (rows without ``input_len``, parsed from a log, stay)."""
    return {cfg: {**res, "rows": [r for r in res.get("rows", []) if int(r.get("input_len", input_len)) == input_len]}
            for cfg, res in results.items()}


def format_summary(results: dict, meta: dict) -> str:
    inputs = input_lens_of(meta)
    if len(inputs) > 1:
        tail = TAIL.format_tail(results, inputs, meta.get("batch_sizes") or [])
        return format_summary(of_input_len(results, inputs[0]), {**meta, "input_lens": inputs[:1]}) + "\n\n" + tail
    lens = meta.get("output_lens") or [meta.get("output_len")]
    primary = meta.get("output_len")
    best = last_pass(results, primary if len(lens) > 1 else None)
    lines = []
    backend = meta.get("attention_backend", KV.DEFAULT_ATTENTION_BACKEND)
    lines.append(f"## Rollout throughput: {meta.get('model_desc', '')}, input {meta.get('input_len')}, "
                 f"output {', '.join(str(x) for x in lens)}, bench_one_batch (one static batch, greedy)"
                 f"{'' if backend == KV.DEFAULT_ATTENTION_BACKEND else f', attention backend {backend}'}")
    if meta.get("device"):
        lines.append(f"device: {meta['device']}; {meta.get('versions', '')}; {meta.get('date', '')}")
    for ol in lens:
        lines.append("")
        if len(lens) > 1:
            lines += [f"output {ol}:", ""]
        lines += _throughput_table(results, meta, ol, len(lens) > 1)
    lines.append("")
    ratios = compute_ratios(best)
    if len(lens) > 1 and ratios:
        lines += [f"ratios and targets below: output {primary}", ""]
    if ratios:
        lines.append("| ratio (throughput) | bs | prefill | decode | total |")
        lines.append("| --- | --- | --- | --- | --- |")
    for r in ratios:
        lines.append(f"| {SHORT[r['num']]} / {SHORT[r['den']]} | {r['bs']} | {_f(r['prefill'], '{:.3f}')} | "
                     f"{_f(r['decode'], '{:.3f}')} | {_f(r['total'], '{:.3f}')} |")
    if ratios:
        lines.append("")
    targets = check_targets(best)
    if all(t["status"] == "n/a" for t in targets):
        lines.append("targets: the weight-only targets need fp8_online_blockwise and its references (not run here)")
        targets = []
    else:
        lines.append("targets:")
    for t in targets:
        lines.append(f"  {SHORT[t['num']]}/{SHORT[t['den']]} {t['metric']} @bs{t['bs']} >= {t['threshold']:.2f}: "
                     f"{_f(t['value'], '{:.3f}')} {t['status']}")
    kv_section = KV.format_kv_section(results)
    if kv_section:
        lines += ["", kv_section]
    lines.append("")
    for cfg, res in results.items():
        extra = ""
        if res.get("fp8rl"):
            extra = f"; {res['fp8rl'][0][:160]}"
        where = f" [{res['backend']}]" if res.get("backend") else ""
        merged = f" (from {res['merged_from']})" if res.get("merged_from") else ""
        lines.append(f"- {cfg}{where}: {DESC.get(KV.entry_config(cfg, res), '')}; rc={res.get('rc')} "
                     f"wall={_f(res.get('wall_s'), '{:.0f}')}s{' TIMEOUT' if res.get('timed_out') else ''}{merged}"
                     f"{extra}")
    return "\n".join(lines)


# --- profiler traces --------------------------------------------------------------------------------------------

# First match wins. The quantizer and attention come before the FP8 GEMM: their template arguments name e4m3 too
# (per_token_group_quant<..., __nv_fp8_e4m3>, FA3's FP8 kernel over an FP8 KV cache). The K/V write counts as attention.
_KERNEL_CLASSES = [
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


# ----------------------------------------------------------------------------------------------------------------
# the per-config subprocess: bench_one_batch with hooks
# ----------------------------------------------------------------------------------------------------------------

def _clog(*a):
    print("[bench_rollout]", *a, flush=True)


def _after_dummy_init(model):
    import torch

    methods = collections.Counter()
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        key = f"{type(m).__name__}:{type(qm).__name__}"
        if getattr(qm, "block_quant", False):
            f = getattr(qm, "w8a8_block_fp8_linear", None)
            key += f" block={getattr(qm, 'weight_block_size', None)} fn={getattr(f, '__name__', f)}"
        methods[key] += 1
    _clog("quant methods:", dict(methods))
    fp8 = [(n, p) for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    scales = [(n, p) for n, p in model.named_parameters() if n.endswith("weight_scale_inv")]
    if not fp8:
        _clog("no fp8 parameters at dummy init")
        return

    def nonzero(p):
        return (p.data.view(torch.uint8) & 0x7F).ne(0).float().mean().item()

    n0, p0 = fp8[0]
    _clog(f"{len(fp8)} fp8 params, {len(scales)} weight_scale_inv at dummy init; {n0} {tuple(p0.shape)} "
          f"nonzero fraction {nonzero(p0):.4f}")
    if os.environ.get("FP8RL_BENCH_REFILL", "0") != "1":
        _clog("FP8 dummy weights left as they are (FP8RL_BENCH_REFILL != 1)")
        return
    g = torch.Generator(device=p0.device)
    for i, (_, p) in enumerate(fp8):
        g.manual_seed(1234 + i)
        tmp = torch.empty(p.shape, dtype=torch.float16, device=p.device).uniform_(-2.0, 2.0, generator=g)
        p.data.copy_(tmp.to(p.dtype))
        del tmp
    for _, p in scales:
        p.data.fill_(5e-4)
    torch.cuda.synchronize()
    _clog(f"refilled fp8 weights with U(-2,2) in e4m3 (nonzero fraction {nonzero(p0):.4f}), weight_scale_inv := 5e-4")


KV_OPTION_MISSING = "this sglang-fp8rl has no --fp8rl-kv-scales option"


def _check_kv_scales_option(argv: list[str]) -> None:
    """With an FP8 KV cache: say once whether the plugin calibrates K/V scales; stop a config that needs the option."""
    if "--kv-cache-dtype" not in argv:
        return
    try:
        supported = KV.kv_scales_supported()
    except ImportError as e:
        _clog(f"cannot read the plugin's options: {e!r}")
        supported = False
    if supported:
        return
    if KV.KV_SCALES_FLAG in argv:
        _clog(f"ERROR {KV_OPTION_MISSING}; this config passes {KV.KV_SCALES_FLAG} and cannot run")
        sys.exit(3)
    _clog(f"WARNING {KV_OPTION_MISSING}: the FP8 KV cache runs with SGLang's static scale 1.0")


def child_main(argv: list[str]) -> None:
    # bench_one_batch never calls load_plugins(); without it `--quantization fp8_online_blockwise` is not an
    # argparse choice and the plugin's layers are not registered.
    from sglang.srt.plugins import load_plugins

    load_plugins()
    _check_kv_scales_option(argv)
    import sglang.benchmark.one_batch as OB

    counts = collections.Counter()

    def counted(mod, name, label):
        fn = getattr(mod, name, None)
        if fn is None:
            return

        def wrapper(*a, **k):
            counts[label] += 1
            return fn(*a, **k)

        setattr(mod, name, wrapper)

    try:
        import sglang.srt.layers.quantization.fp8 as F8
        import sglang.srt.layers.quantization.fp8_utils as FU

        counted(FU, "w8a8_block_fp8_matmul_deepgemm", "deepgemm block")
        counted(FU, "w8a8_block_fp8_matmul_triton", "triton block")
        counted(FU, "fp8_scaled_mm", "cutlass fp8_scaled_mm")
        counted(FU, "triton_scaled_mm", "triton_scaled_mm")
        counted(F8, "apply_fp8_linear", "apply_fp8_linear (non-block)")
        counted(FU, "sglang_per_token_group_quant_fp8", "sglang_per_token_group_quant_fp8")
        counted(FU, "per_token_group_quant_fp8", "per_token_group_quant_fp8")
    except (ImportError, AttributeError) as e:  # bookkeeping must never break the bench
        _clog(f"GEMM call counting not installed: {e!r}")
    try:
        import sglang.srt.model_loader.loader as L

        orig = L.initialize_dummy_weights

        def init(model, *a, **k):
            orig(model, *a, **k)
            try:
                _after_dummy_init(model)
            except (RuntimeError, ValueError, AttributeError, TypeError) as e:
                _clog(f"after-dummy-init hook failed: {e!r}")

        L.initialize_dummy_weights = init
    except (ImportError, AttributeError) as e:
        _clog(f"dummy-init hook not installed: {e!r}")

    sys.argv = ["sglang.benchmark.one_batch"] + list(argv)
    try:
        OB.cli_main()
    finally:
        _clog("gemm calls (eager + CUDA-graph capture; replays run no Python):", dict(counts) if counts else "none")


# ----------------------------------------------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"[bench_rollout {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _env_info() -> dict:
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
        info["device"] = out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError) as e:  # CPU machine / no driver
        info["device"] = f"unknown ({type(e).__name__})"
    from importlib.metadata import PackageNotFoundError, version

    vs = []
    for p in ["sglang", "sglang-kernel", "sgl-deep-gemm", "torch", "triton", "transformers", "sglang-fp8rl"]:
        try:
            vs.append(f"{p} {version(p)}")
        except PackageNotFoundError:
            pass
    info["versions"] = ", ".join(vs)
    return info


def run_config(cfg: str, cmd: list[str], env: dict, log_path: str, timeout_s: float) -> dict:
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("# " + " ".join(cmd) + "\n# env: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())
                                                                  if k.startswith(("SGLANG", "FP8RL", "DG_"))) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        echoed = collections.Counter()

        def pump():
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(f"[{time.time() - t0:7.1f}] {line}\n")
                log.flush()
                m = ECHO_RE.search(line)
                if m:
                    key = m.group(0)
                    echoed[key] += 1
                    if echoed[key] <= (6 if key == "[fp8rl]" else 3):
                        print(f"  {cfg} +{time.time() - t0:4.0f}s| {line.strip()[:220]}", flush=True)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _say(f"{cfg}: timeout after {timeout_s:.0f} s, stopping it (process group {proc.pid})")
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # the group of the process started above (start_new_session)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode if proc.returncode is not None else -9
        th.join(timeout=10)
    return {"rc": rc, "timed_out": timed_out, "wall_s": time.time() - t0}


def _write_summary(out_dir, results, meta) -> str:
    text = format_summary(results, meta)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text + "\n")
    inputs = input_lens_of(meta)
    tail = TAIL.tail_rows(results, inputs, meta.get("batch_sizes") or []) if len(inputs) > 1 else []
    primary = of_input_len(results, inputs[0])  # the main tables' rows
    best = last_pass(primary, meta.get("output_len") if len(meta.get("output_lens") or []) > 1 else None)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "tail": tail, "ratios": compute_ratios(best),
                   "targets": check_targets(best), "kv_ratios": KV.kv_ratio_rows(primary),
                   "kv_targets": KV.kv_targets(primary), "kv_recalibration": KV.recal_report(results)},
                  f, indent=1, default=str)
    return text


def load_merged(paths, main_backend: str) -> collections.OrderedDict:
    """Entries of earlier runs' results.json, relabelled config@backend (they never replace this run's entries)."""
    merged = collections.OrderedDict()
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--merge {path}: cannot read it ({e})") from e
        their_backend = (data.get("meta") or {}).get("attention_backend", KV.DEFAULT_ATTENTION_BACKEND)
        for label, res in (data.get("results") or {}).items():
            cfg = KV.entry_config(label, res)
            backend = KV.entry_backend(res, their_backend)
            merged[f"{cfg}@{backend}"] = {**res, "config": cfg, "backend": backend, "merged_from": path}
    return merged


def check_backends(args) -> None:
    """Refuse FlashAttention-3 where sglang-kernel's FA3 does not import (our GPU wheelhouse drops it)."""
    if KV.FA3 not in [args.attention_backend, *args.bf16_backend]:
        return
    ok, why = KV.fa3_available(sys.executable)
    if not ok:
        raise SystemExit(f"--attention-backend fa3: FlashAttention-3 does not import here ({why}). sglang-kernel's "
                         "flash_ops (FA3) is missing from this installation (the trimmed GPU wheelhouse drops it); use "
                         "triton or flashinfer, or install the complete sglang-kernel wheel.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS + EXTRA_CONFIGS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="default 64 128 (--moe: 32 64)")
    p.add_argument("--input-len", type=int, nargs="+", default=[512],
                   help="prompt length(s); several add the tail table (decode per context length and bs; the main "
                        "tables use the first length)")
    p.add_argument("--output-len", type=int, nargs="+", default=None,
                   help="one or more output lengths, run by one process per config (default 1024; --moe: 512)")
    p.add_argument("--attention-backend", choices=KV.ATTENTION_BACKENDS, default=KV.DEFAULT_ATTENTION_BACKEND,
                   help="attention backend of every config (fa3 only where sglang-kernel's FlashAttention-3 imports)")
    p.add_argument("--bf16-backend", nargs="+", default=[], choices=KV.ATTENTION_BACKENDS, metavar="BACKEND",
                   help="also run BF16 on these backends (labels bf16@BACKEND): the FP8-KV table divides by BF16 on "
                        "its fastest backend")
    p.add_argument("--merge", nargs="+", action="extend", default=[], metavar="RESULTS_JSON",
                   help="add the entries of earlier runs (their results.json) to the tables, e.g. another backend "
                        "(repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="run the batch-size list N times in one process")
    p.add_argument("--prefill-graph", action="store_true",
                   help="keep SGLang's prefill CUDA graphs (the server default; off by default here: eager prefill)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="default 0.7 (--moe: 0.88)")
    p.add_argument("--model-dir", default="/tmp/fp8rl_models", help="dummy model folders (made if missing)")
    p.add_argument("--out", default="/tmp/fp8rl_bench_rollout")
    p.add_argument("--budget-s", type=float, default=300, help="timeout per config (s)")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="total wall budget (s) for all configs; a config that cannot get --min-s is skipped (0: none)")
    p.add_argument("--min-s", type=float, default=75, help="skip a config when less than this is left")
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B shape (qwen3-30b-a3b / qwen3-30b-a3b-block)")
    p.add_argument("--profile-decode", action="store_true",
                   help="torch-profile a few decode steps (bench_one_batch --profile, in process) of --profile-configs "
                        "and write the top kernels by CUDA time to profile_top_kernels.txt")
    p.add_argument("--profile-configs", nargs="+", default=["fp8_online_blockwise"], choices=CONFIGS + EXTRA_CONFIGS)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--extra-args", default="", help="extra bench_one_batch flags for every config (one string)")
    p.add_argument("--keep-raw", action="store_true", help="keep OUT/raw/ next to logs.tgz")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    a = p.parse_args(argv)
    if a.batch_sizes is None:
        a.batch_sizes = [32, 64] if a.moe else [64, 128]
    a.input_lens = list(dict.fromkeys(a.input_len))
    a.input_len = a.input_lens[0]  # the primary length: the main tables
    a.output_lens = sorted(set(a.output_len)) if a.output_len else [512 if a.moe else 1024]
    a.output_len = max(a.output_lens)  # the primary length: the old ratio / target tables, profiling
    if a.mem_fraction_static is None:
        a.mem_fraction_static = 0.88 if a.moe else 0.7
    return a


def combine(results: dict, merged: dict) -> collections.OrderedDict:
    """This run's entries, then the merged ones whose (config, backend) this run did not measure."""
    mine = {(KV.entry_config(k, v), KV.entry_backend(v)) for k, v in results.items()}
    out = collections.OrderedDict(results)
    for label, res in merged.items():
        if (KV.entry_config(label, res), KV.entry_backend(res)) not in mine and label not in out:
            out[label] = res
    return out


def build_plan(args, raw: str, prof_dir: str, model_dir: str, script: str = __file__) -> list[tuple]:
    """(label, config, backend, spec, cmd, env) per run; each cmd is ``script _child <bench_one_batch flags>`` (another
    script's child may wrap this one's, as decode_roofline.py does)."""
    plan = []
    for label, cfg, backend in plan_runs(args.configs, args.attention_backend, args.bf16_backend):
        spec = config_spec(cfg, args.moe, backend)
        mpath = os.path.join(model_dir, spec["model"])
        cmd = [sys.executable, os.path.abspath(script), "_child",
               *bench_flags(mpath, args.batch_sizes, args.input_lens, args.output_lens, args.mem_fraction_static,
                            os.path.join(raw, f"{label}.jsonl"), label, args.repeat, args.prefill_graph, backend),
               *spec["flags"]]
        profiled = args.profile_decode and cfg in args.profile_configs
        if profiled:
            cmd += profile_flags(label, args.output_lens, args.profile_steps)
        if args.extra_args:
            cmd += args.extra_args.split()
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", **spec["env"]})
        env.setdefault("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")
        env.setdefault("SGLANG_DG_CACHE_DIR", "/tmp/dg_cache")
        if profiled:
            env["SGLANG_TORCH_PROFILER_DIR"] = prof_dir
        plan.append((label, cfg, backend, spec, cmd, env))
    return plan


def main(argv=None) -> int:
    args = parse_args(argv)
    check_backends(args)
    out = os.path.abspath(args.out)
    raw = os.path.join(out, "raw")
    prof_dir = os.path.join(raw, "profile")
    model_dir = os.path.abspath(args.model_dir)
    plan = build_plan(args, raw, prof_dir, model_dir)
    merged = load_merged(args.merge, args.attention_backend)
    if args.dry_run:
        for label, _, _, _, cmd, env in plan:
            shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith(("SGLANG", "FP8RL")))
            print(f"# {label}: env {shown}")
            print(" ".join(cmd))
        for label in merged:
            print(f"# merged: {label} from {merged[label]['merged_from']}")
        return 0

    if os.path.isdir(raw):
        shutil.rmtree(raw)  # a stale raw/ from an earlier run would be packed with this one
    os.makedirs(raw)
    import make_models  # scripts/gpu/make_models.py

    needed = sorted({p[3]["model"] for p in plan})
    make_models.ensure(model_dir, needed)
    meta = {"model_desc": ("Qwen3-30B-A3B-shaped" if args.moe else "Qwen3-8B-shaped") + " dummy weights",
            "models": needed, "input_len": args.input_len, "input_lens": args.input_lens, "output_len": args.output_len,
            "output_lens": args.output_lens, "attention_backend": args.attention_backend,
            "batch_sizes": args.batch_sizes, "repeat": args.repeat, "mem_fraction_static": args.mem_fraction_static,
            "merged": list(args.merge), "argv": sys.argv, **_env_info()}
    with open(os.path.join(raw, "env.txt"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    _say(f"{meta['device']} | {meta['versions']}")
    _say(f"runs {[p[0] for p in plan]}, bs {args.batch_sizes} x{args.repeat}, in {args.input_lens}, "
         f"out {args.output_lens}, attention {args.attention_backend}, mem {args.mem_fraction_static}, "
         f"models in {model_dir}{f', merged {list(merged)}' if merged else ''}")

    t_start = time.time()
    results = collections.OrderedDict()
    for label, cfg, backend, spec, cmd, env in plan:
        base = {"config": cfg, "backend": backend, "flags": spec["flags"], "env": spec["env"]}
        timeout = args.budget_s
        if args.deadline_s > 0:
            left = args.deadline_s - (time.time() - t_start)
            timeout = min(timeout, left - 5)
            if timeout < args.min_s:
                _say(f"SKIP {label}: only {left:.0f} s left of --deadline-s {args.deadline_s:.0f}")
                results[label] = {**base, "status": "skipped (deadline)", "rc": None, "rows": []}
                continue
        _say(f"run {label} ({DESC[cfg]}), attention {backend}, model {spec['model']}, timeout {timeout:.0f} s")
        log_path = os.path.join(raw, f"{label}.log")
        run = run_config(label, cmd, env, log_path, timeout)
        with open(log_path, errors="replace") as f:
            text = f.read()
        info = parse_log(text)
        jl = os.path.join(raw, f"{label}.jsonl")
        rows = []
        if os.path.exists(jl):
            with open(jl) as f:
                rows = [json.loads(ln) for ln in f if ln.strip()]
        if not rows:
            rows = parse_rows_from_log(text, sweep_order(args.batch_sizes, args.output_lens, args.repeat))
        res = {"model": spec["model"], **base, **run, **info, "rows": rows,
               "status": "ok" if run["rc"] == 0 else ("timeout" if run["timed_out"] else f"failed rc={run['rc']}")}
        results[label] = res
        recal = f", KV-scale recalibration {info['kv_recal_ms']} ms" if info["kv_recal_ms"] else ""
        _say(f"{label}: {res['status']}, {run['wall_s']:.0f} s, weights {_f(info['weight_gib'], '{:.2f}')} GiB, "
             f"KV {_f(info['kv_tokens'])} tokens ({info['kv_dtype'] or '?'}), {len(rows)} result rows{recal}")
        if run["rc"] != 0 and info["error_tail"]:
            print("\n".join("    " + ln for ln in info["error_tail"][-12:]), flush=True)
        _write_summary(out, combine(results, merged), meta)  # partial results survive a killed call

    if args.profile_decode:
        parts = []
        for tr in sorted(glob.glob(os.path.join(prof_dir, "*decode*.trace.json*"))):
            try:
                parts.append(format_kernel_summary(kernel_totals(load_trace(tr)), os.path.basename(tr),
                                                   steps=args.profile_steps))
            except (OSError, ValueError, KeyError, TypeError) as e:  # a truncated or foreign trace
                parts.append(f"### {os.path.basename(tr)}: could not summarize: {e!r}")
        if not parts:
            parts.append("no decode trace found (the profiled config failed, or the bench skipped profiling)")
        with open(os.path.join(out, "profile_top_kernels.txt"), "w") as f:
            f.write("\n\n".join(parts) + "\n")
        _say(f"profile summary -> {os.path.join(out, 'profile_top_kernels.txt')}")

    text = _write_summary(out, combine(results, merged), meta)
    with tarfile.open(os.path.join(out, "logs.tgz"), "w:gz") as tf:
        tf.add(raw, arcname="raw")
    if not args.keep_raw:
        shutil.rmtree(raw, ignore_errors=True)
    print("\n" + text, flush=True)
    if args.profile_decode and os.path.exists(os.path.join(out, "profile_top_kernels.txt")):
        with open(os.path.join(out, "profile_top_kernels.txt")) as f:
            print("\n" + "\n".join(f.read().splitlines()[:40]))
    ok = all(r.get("rc") == 0 for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child_main(sys.argv[2:])
    else:
        sys.exit(main())
