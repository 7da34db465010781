"""The report of scripts/bench_rollout.py: what a bench_one_batch log says (result rows, weight memory, KV pool, the
plugin's lines), the ratios between configs and the targets they are held to, and summary.md's tables."""

from __future__ import annotations

import re

import kv_measure as KV  # scripts/kv_measure.py: the FP8-KV tables and log parsing
import tail_table as TAIL  # scripts/tail_table.py: decode at small batch over long contexts

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
    "fp8_online_blockwise_kv_bf16q": "fp8_online_blockwise_kv + --fp8rl-decode-query bf16 (the kernel reads BF16 q)",
    "fp8_online_blockwise_kv_forms": "fp8_online_blockwise_kv + --fp8rl-split-kv-forms (all: fewer launches)",
    "fp8_online_blockwise_kv_noforms": "fp8_online_blockwise_kv + --fp8rl-split-kv-forms none (no launch saved)",
    "fp8_online_blockwise_kv_lean": "fp8_online_blockwise_kv + --fp8rl-decode-query bf16 --fp8rl-producer-quant on",
    "bf16_kv": "BF16 weights + --kv-cache-dtype fp8_e4m3 (SGLang's static scale 1.0)",
}
SHORT = {"bf16": "bf16", "fp8_online_blockwise": "online", "block_prequant": "block_prequant",
         "fp8_channel": "fp8_channel", "fp8_online_noselect": "online_noselect"}


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
            "kv_recal_ms": KV.recalibration_times(text), "kv_option_missing": KV.KV_OPTION_MISSING in text}
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
