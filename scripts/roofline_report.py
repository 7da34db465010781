"""decode_roofline.py's report: rebuilt from the raw measurements a run saves (roofline.json), no GPU needed.

Pure Python (no torch, no SGLang), unit-tested in tests/test_decode_roofline.py with a recorded fixture. Input:
``data = {"meta": ..., "runs": {config: {..., "records": [...]}}, "profiles": {config: {"BxC": ...}}}`` as the child
processes wrote it (decode_roofline.py's docstring gives the record kinds). Output: per config a table of every (batch,
context) cell with the measured step, its floor and efficiency; step speed-ups over BF16; the issue's targets, each
met / missed / n/a; the kernel-time breakdown of the profiled cells.
"""
from __future__ import annotations

import re
import statistics

import kernel_trace as KT  # scripts/kernel_trace.py: the kernel classes of a profiler trace
import roofline_model as RM  # scripts/roofline_model.py: bytes, FLOPs, floor

BASE = "bf16"
NAMES = {"bf16": "BF16", "fp8_online_blockwise": "FP8 weights", "fp8_online_blockwise_kv": "FP8 + FP8 KV",
         "fp8_online_blockwise_kv_fa3": "FP8 + FP8 KV, FA3 decode",
         "fp8_online_blockwise_kv_splitkv": "FP8 + FP8 KV, split-KV decode",
         "fp8_online_blockwise_kv_bf16q": "FP8 + FP8 KV, BF16 query",
         "fp8_online_blockwise_kv_forms": "FP8 + FP8 KV, split-KV forms",
         "fp8_online_blockwise_kv_noforms": "FP8 + FP8 KV, no split-KV form",
         "fp8_online_blockwise_kv_lean": "FP8 + FP8 KV, BF16 query, producers quantize", "bf16_kv": "BF16 + FP8 KV"}
# issue 35's per-step targets: (config, kind, batch range, context range, threshold); kind "speedup" is the BF16
# step over the config's, "efficiency" floor over step
TARGETS = [
    ("fp8_online_blockwise_kv", "speedup", (1, 32), (4096, None), 1.6),
    ("fp8_online_blockwise_kv", "speedup", (128, 384), (None, None), 1.4),
    ("fp8_online_blockwise", "speedup", (1, 8), (None, None), 1.3),
    ("fp8_online_blockwise_kv", "efficiency", (8, 8), (4096, 12288), 0.75),
]
GROUPS = ["GEMMs", "activation quantization", "attention", "norms/rotary", "logits/sampling", "other"]
_GROUP_OF_CLASS = {"fp8 gemm": "GEMMs", "gemm (bf16)": "GEMMs", "moe gemm": "GEMMs",
                   "act quant": "activation quantization", "attention": "attention", "norm/rope/act": "norms/rotary",
                   "moe routing/align": "other", "other": "other"}
_SAMPLING_RE = re.compile(r"argmax|softmax|sampl|multinomial|logit|top_?k_?top_?p|gumbel", re.IGNORECASE)


def cell_key(bs: int, ctx: int) -> str:
    """'8x4096': a cell's name in records, profiles and the command line."""
    return f"{int(bs)}x{int(ctx)}"


# ----------------------------------------------------------------------------------------------------------------
# measurements of one cell
# ----------------------------------------------------------------------------------------------------------------

def bench_steps(record: dict) -> list[float]:
    """The bench loop's decode-step seconds of a cell, without the steps the profiler or the back-to-back timing
    ran in."""
    excluded = set(record.get("excluded_steps") or [])
    return [s for i, s in enumerate(record.get("steps_s") or []) if i not in excluded]


def step_seconds(record: dict) -> dict[str, float | None]:
    """A cell's step times: ``b2b`` (back-to-back forward + sample calls, median of the timings), ``bench`` (median
    of the bench loop's steps), and ``step``, the one the report uses (b2b when measured)."""
    b2b = [t for t in record.get("b2b_s") or [] if t]
    steps = bench_steps(record)
    out = {"b2b": statistics.median(b2b) if b2b else None,
           "bench": statistics.median(steps) if steps else record.get("bench_median_s")}
    out["step"] = out["b2b"] if out["b2b"] is not None else out["bench"]
    return out


def mean_context(record: dict) -> float:
    """Mean tokens a measured step attends over: decode step i of a prompt of C tokens reads C + i + 1."""
    n = len(record.get("steps_s") or []) or max(1, int(record.get("output_len", 1)) - 1)
    return int(record["input_len"]) + (n + 1) / 2


def cells_of(run: dict) -> dict[str, dict]:
    """'BxC' -> the cell's grid record: its first run (after the skipped prefill, or the reason it did not run)."""
    return {cell_key(r["bs"], r["input_len"]): r for r in run.get("records", [])
            if r.get("kind") == "cell" and r.get("occurrence") == 1}


def check_records(run: dict) -> dict[str, dict]:
    """'BxC' -> the check cell's second run, after bench_one_batch's real prefill."""
    return {cell_key(r["bs"], r["input_len"]): r for r in run.get("records", [])
            if r.get("kind") == "cell" and (r.get("occurrence") or 0) > 1 and r.get("prefill") == "real"
            and not r.get("skipped")}


def _by_cell(keys) -> list[str]:
    return sorted(keys, key=lambda k: tuple(int(x) for x in k.split("x")))


def bandwidth(data: dict) -> dict | None:
    """The copy bandwidth the floors use: the override in meta, else the best measurement of any config's process."""
    meta = data.get("meta", {})
    if meta.get("bandwidth_gbps"):
        return {"gbps": float(meta["bandwidth_gbps"]), "source": "--bandwidth-gbps"}
    best = None
    for cfg, run in data.get("runs", {}).items():
        for r in run.get("records", []):
            if r.get("kind") == "bandwidth" and r.get("gbps") and (best is None or r["gbps"] > best["gbps"]):
                best = {**r, "source": f"measured in the {cfg} process"}
    return best


def peaks(meta: dict) -> tuple[str | None, dict | None]:
    """(card, {'bf16': TFLOP/s, 'fp8': TFLOP/s}) of the run's device: meta's override, else the table, else None."""
    if meta.get("peak_tflops"):
        return "override", dict(meta["peak_tflops"])
    card = RM.card_of(meta.get("device", ""))
    return card, (dict(RM.PEAK_TFLOPS[card]) if card else None)


# ----------------------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------------------

def cell_row(shape: RM.Shape, cfg: str, record: dict | None, bw: dict | None, pk: dict | None) -> dict:
    """One table cell: its step times, and with a bandwidth its floor, efficiency and bytes."""
    if record is None or record.get("skipped"):
        return {"status": "skipped", "why": (record or {}).get("skipped", "not run")}
    times = step_seconds(record)
    row = {"status": "measured", **{f"{k}_ms": (None if v is None else 1e3 * v) for k, v in times.items()},
           "step_from": "b2b" if times["b2b"] is not None else "bench"}
    weights, kv = RM.PRECISION.get(cfg, ("bf16", "bf16"))
    if bw and times["step"]:
        m = RM.step_model(shape, weights, kv, int(record["bs"]), mean_context(record), bw["gbps"], pk)
        row.update({"floor_ms": 1e3 * m["floor_s"], "memory_ms": 1e3 * m["memory_s"],
                    "compute_ms": None if m["compute_s"] is None else 1e3 * m["compute_s"],
                    "efficiency": m["floor_s"] / times["step"], "bytes_gb": m["bytes_total"] / 1e9,
                    "weights_gb": (m["bytes_total"] - m["bytes"]["kv_read"] - m["bytes"]["kv_write"]) / 1e9,
                    "kv_gb": (m["bytes"]["kv_read"] + m["bytes"]["kv_write"]) / 1e9,
                    "tflop": m["flops_total"] / 1e12, "bound": m["bound"]})
    return row


def config_rows(data: dict, shape: RM.Shape, cfg: str, bw, pk) -> dict[str, dict]:
    """'BxC' -> cell_row for every cell of the run's grid."""
    meta, cells = data["meta"], cells_of(data["runs"].get(cfg, {}))
    status = data["runs"].get(cfg, {}).get("status", "not run")
    rows = {}
    for bs in meta["batch_sizes"]:
        for ctx in meta["contexts"]:
            key = cell_key(bs, ctx)
            rec = cells.get(key) or {"skipped": f"not measured (config {status})"}
            rows[key] = cell_row(shape, cfg, rec, bw, pk)
    return rows


def speedups(tables: dict, meta: dict) -> dict[str, dict[str, float | None]]:
    """'BxC' -> {config: BF16 step / config step} for every config but BF16."""
    out = {}
    base = tables.get(BASE, {})
    for key in (cell_key(b, c) for b in meta["batch_sizes"] for c in meta["contexts"]):
        b = base.get(key, {}).get("step_ms")
        out[key] = {cfg: (b / t[key]["step_ms"] if b and t.get(key, {}).get("step_ms") else None)
                    for cfg, t in tables.items() if cfg != BASE}
    return out


def _in(value: int, lo: int | None, hi: int | None) -> bool:
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def needed_efficiency(tables: dict, cfg: str, key: str, threshold: float) -> float | None:
    """The efficiency ``cfg``'s step needs at a cell for ``threshold`` x BF16's measured step: its floor over the step
    BF16's step / threshold. At BF16's own efficiency the speed-up is the ratio of the two floors."""
    floor = tables.get(cfg, {}).get(key, {}).get("floor_ms")
    base = tables.get(BASE, {}).get(key, {}).get("step_ms")
    return threshold * floor / base if floor and base else None


def evaluate_targets(tables: dict, ups: dict, meta: dict) -> list[dict]:
    """Each target over the cells of its range: met (every measured cell passes), missed, or n/a (none measured);
    a speed-up's cells below it with the efficiency they would need (``needed_efficiency``) and the one they have."""
    out = []
    for cfg, kind, (blo, bhi), (clo, chi), threshold in TARGETS:
        keys = [cell_key(b, c) for b in meta["batch_sizes"] for c in meta["contexts"]
                if _in(int(b), blo, bhi) and _in(int(c), clo, chi)]
        values = {k: (ups.get(k, {}).get(cfg) if kind == "speedup"
                      else tables.get(cfg, {}).get(k, {}).get("efficiency")) for k in keys}
        measured = {k: v for k, v in values.items() if v is not None}
        below = _by_cell(k for k, v in measured.items() if v < threshold)
        status = "n/a" if not measured else ("missed" if below else "met")
        needs = {k: [needed_efficiency(tables, cfg, k, threshold), tables.get(cfg, {}).get(k, {}).get("efficiency")]
                 for k in below} if kind == "speedup" else {}
        out.append({"config": cfg, "kind": kind, "batch": [blo, bhi], "context": [clo, chi], "threshold": threshold,
                    "status": status, "min": min(measured.values()) if measured else None, "values": measured,
                    "below": below, "not_measured": _by_cell(set(keys) - set(measured)), "needs": needs})
    return out


def kernel_groups(kernels: dict, steps: int, layers: int) -> dict[str, float]:
    """Microseconds per step by group. lm_head is the GEMM a step launches once where layer GEMMs launch once per
    layer: of a GEMM kernel launched layers x n + 1 times per step, the ``steps`` longest launches are logits."""
    groups = dict.fromkeys(GROUPS, 0.0)
    steps = max(1, int(steps))
    for name, k in kernels.items():
        group = _GROUP_OF_CLASS.get(KT.classify_kernel(name), "other")
        if group == "other" and _SAMPLING_RE.search(name):
            group = "logits/sampling"
        us = float(k["us"])
        if group == "GEMMs" and round(k["n"] / steps) % max(1, layers) == 1:
            lm = sum(sorted(k.get("top_us") or [], reverse=True)[:steps])
            groups["logits/sampling"] += lm
            us -= lm
        groups[group] += us
    return {g: us / steps for g, us in groups.items()}


def breakdown(data: dict, shape: RM.Shape, tables: dict, bw: dict | None = None, pk: dict | None = None
              ) -> list[dict]:
    """One row per profiled (config, cell): ms per step by group, kernel total, the cell's measured steps; with a
    bandwidth, each group's floor (``roofline_model.group_floors``) as well."""
    rows = []
    for cfg, cells in data.get("profiles", {}).items():
        records = cells_of(data.get("runs", {}).get(cfg, {}))
        for key, prof in cells.items():
            g = kernel_groups(prof.get("kernels", {}), prof.get("steps", 1), shape.layers)
            row = tables.get(cfg, {}).get(key, {})
            rows.append({"config": cfg, "cell": key, "groups_ms": {k: v / 1e3 for k, v in g.items()},
                         "kernels_ms": sum(g.values()) / 1e3, "step_ms": row.get("step_ms"),
                         "bench_ms": row.get("bench_ms"), "trace": prof.get("trace")})
            record = records.get(key)
            if bw and record and not record.get("skipped"):
                weights, kv = RM.PRECISION.get(cfg, ("bf16", "bf16"))
                floors = RM.group_floors(shape, weights, kv, int(record["bs"]), mean_context(record), bw["gbps"], pk)
                rows[-1]["floors_ms"] = {k: 1e3 * v for k, v in floors.items()}
    return rows


def prefill_checks(data: dict) -> list[dict]:
    """Check cells: the decode step after a real prefill against the same cell after the skipped one."""
    out = []
    for cfg, run in data.get("runs", {}).items():
        skipped = cells_of(run)
        for key, real in check_records(run).items():
            a, b = step_seconds(real), step_seconds(skipped.get(key, {}))
            ratio = {k: (a[k] / b[k] if a[k] and b[k] else None) for k in ("step", "bench")}
            out.append({"config": cfg, "cell": key, "real_ms": a["step"] and 1e3 * a["step"],
                        "skipped_ms": b["step"] and 1e3 * b["step"], "ratio": ratio["step"],
                        "bench_ratio": ratio["bench"]})
    return out


def build_report(data: dict) -> dict:
    """Everything the tables show, from the raw measurements."""
    meta = data["meta"]
    shape = RM.Shape.from_config(meta["model_config"])
    bw = bandwidth(data)
    card, pk = peaks(meta)
    configs = [c for c in meta.get("configs", list(data["runs"])) if c in data["runs"]]
    tables = {cfg: config_rows(data, shape, cfg, bw, pk) for cfg in configs}
    ups = speedups(tables, meta)
    return {"bandwidth": bw, "card": card, "peak_tflops": pk, "tables": tables, "speedups": ups,
            "targets": evaluate_targets(tables, ups, meta), "breakdown": breakdown(data, shape, tables, bw, pk),
            "checks": prefill_checks(data)}


# ----------------------------------------------------------------------------------------------------------------
# markdown
# ----------------------------------------------------------------------------------------------------------------

def _f(v, fmt="{:.2f}", none="—") -> str:
    return none if v is None else fmt.format(v)


def _ctx(c: int) -> str:
    return f"{c // 1024}k" if c % 1024 == 0 else str(c)


def _cell_name(key: str) -> str:
    bs, ctx = key.split("x")
    return f"{bs} x {_ctx(int(ctx))}"


def _header(data: dict, report: dict) -> list[str]:
    meta, bw, pk = data["meta"], report["bandwidth"], report["peak_tflops"]
    title = (f"## Decode roofline: {meta.get('model_desc', '')}, decode steps of bench_one_batch under CUDA graphs, "
             f"attention {meta.get('attention_backend', '?')}")
    lines = [title]
    if meta.get("synthetic"):
        lines.append("**SYNTHETIC TEST FIXTURE: these numbers were not measured.**")
    lines.append(f"device: {meta.get('device', '?')}; {meta.get('versions', '')}; {meta.get('date', '')}")
    lines.append("copy bandwidth: " + ("not measured (no floor)" if not bw else
                                       f"{bw['gbps']:,.0f} GB/s ({bw.get('source', '')}; device-to-device copy_ of "
                                       f"{_f(bw.get('bytes') and bw['bytes'] / 2**30, '{:.1f}', '?')} GiB, read + "
                                       "write counted, best of its repeats)"))
    lines.append("dense peaks: " + ("unknown card: the floors are bytes / bandwidth only" if not pk else
                                    f"BF16 {pk['bf16']:,.0f}, FP8 {pk['fp8']:,.0f} TFLOP/s ({report['card']}; "
                                    f"{RM.PEAK_SOURCE})"))
    lines.append(f"step: {meta.get('b2b_calls', '?')} forward + sample calls of the decode batch launched back to "
                 f"back (host work overlapping the GPU, as the server's overlap scheduler runs), CUDA events, median "
                 f"of {meta.get('b2b_timings', '?')} timings; bench step: the median of bench_one_batch's "
                 f"{meta.get('steps', '?')} decode steps (host preparation and a sync included). Prefill: "
                 f"{meta.get('prefill', 'skip')} (see decode_roofline.py).")
    return lines


def _config_table(cfg: str, rows: dict) -> list[str]:
    head = ("| bs | context | step ms | bench step ms | floor ms | efficiency | GB moved (weights + KV) | TFLOP "
            "| bound |")
    lines = [f"### {NAMES.get(cfg, cfg)} (`{cfg}`)", "", head,
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    skipped = []
    for key, r in rows.items():
        bs, ctx = key.split("x")
        if r["status"] != "measured":
            skipped.append(f"- {_cell_name(key)}: {r['why']}")
            continue
        gb = (f"{r['bytes_gb']:.2f} ({r['weights_gb']:.2f} + {r['kv_gb']:.2f})" if r.get("bytes_gb") is not None
              else "—")
        step = _f(r["step_ms"]) + ("" if r.get("step_from") == "b2b" else " (bench)")
        lines.append(f"| {bs} | {_ctx(int(ctx))} | {step} | {_f(r['bench_ms'])} | "
                     f"{_f(r.get('floor_ms'))} | {_f(r.get('efficiency') and 100 * r['efficiency'], '{:.0f} %')} | "
                     f"{gb} | {_f(r.get('tflop'), '{:.2f}')} | {r.get('bound', '—')} |")
    if skipped:
        lines += ["", "Cells not measured:", *skipped]
    return lines


def _speedup_table(report: dict, meta: dict) -> list[str]:
    others = [c for c in report["tables"] if c != BASE]
    if BASE not in report["tables"] or not others:
        return []
    head = ["bs", "context", *[f"{NAMES.get(c, c)} / BF16" for c in others]]
    lines = ["### Step speed-up over BF16 (BF16 step / config step)", "", "| " + " | ".join(head) + " |",
             "|" + " ---: |" * len(head)]
    for key, ups in report["speedups"].items():
        if any(v is not None for v in ups.values()):
            bs, ctx = key.split("x")
            lines.append(f"| {bs} | {_ctx(int(ctx))} | " + " | ".join(_f(ups.get(c), "{:.2f}x") for c in others) +
                         " |")
    return lines


def _needs(t: dict, key: str) -> str:
    need, has = t.get("needs", {}).get(key, (None, None))
    return f" (needs {100 * need:.0f} % efficiency, has {100 * has:.0f} %)" if need and has else ""


def _target_line(t: dict) -> str:
    b = t["batch"][0] if t["batch"][0] == t["batch"][1] else f"{t['batch'][0]}-{t['batch'][1]}"
    lo, hi = t["context"]
    ctx = "any context" if lo is None and hi is None else (f"contexts >= {_ctx(lo)}" if hi is None else
                                                             f"contexts {_ctx(lo)}-{_ctx(hi)}")
    what = (f"{NAMES.get(t['config'], t['config'])} vs BF16 per step >= {t['threshold']:.1f}x" if t["kind"] == "speedup"
            else f"efficiency of {NAMES.get(t['config'], t['config'])} >= {100 * t['threshold']:.0f} %")
    scale = (lambda v: f"{v:.2f}x") if t["kind"] == "speedup" else (lambda v: f"{100 * v:.0f} %")
    detail = "no cell measured" if t["min"] is None else f"lowest {scale(t['min'])}"
    if t["below"]:
        detail += "; below: " + ", ".join(f"{_cell_name(k)} {scale(t['values'][k])}{_needs(t, k)}" for k in t["below"])
    if t["not_measured"]:
        detail += "; not measured: " + ", ".join(_cell_name(k) for k in t["not_measured"])
    return f"- {what}, {b} running, {ctx}: **{t['status']}** ({detail})"


def _breakdown_table(report: dict) -> list[str]:
    if not report["breakdown"]:
        return []
    head = ["config", "cell", *GROUPS, "kernels", "step", "bench step"]
    lines = ["### Where a step goes (torch profiler, GPU kernel time per step, ms)", "",
             "lm_head is counted as logits/sampling; SiLU-and-mul as norms/rotary; the K/V write as attention.", "",
             "| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for r in report["breakdown"]:
        lines.append(f"| {NAMES.get(r['config'], r['config'])} | {_cell_name(r['cell'])} | " +
                     " | ".join(_f(r["groups_ms"][g], "{:.3f}") for g in GROUPS) +
                     f" | {_f(r['kernels_ms'], '{:.3f}')} | {_f(r['step_ms'])} | {_f(r['bench_ms'])} |")
    return lines


def _floor_table(report: dict) -> list[str]:
    """Each group's kernel time against its floor: where the step's distance from its own floor lies."""
    rows = [r for r in report["breakdown"] if r.get("floors_ms")]
    if not rows:
        return []
    lines = ["", "Each group against its floor (bytes at the copy bandwidth, or FLOPs at peak; ms a step, the floor's "
             "share of the time, and the time above the floor):", "",
             "| config | cell | " + " | ".join(GROUPS) + " | above the floors |",
             "| --- | --- |" + " ---: |" * (len(GROUPS) + 1)]
    for r in rows:
        t, fl = r["groups_ms"], r["floors_ms"]
        cells = [f"{t[g]:.3f} ({_f(fl[g] / t[g] if t[g] else None, '{:.0%}')}, +{t[g] - fl[g]:.3f})" for g in GROUPS]
        above = sum(t[g] - fl[g] for g in GROUPS)
        lines.append(f"| {NAMES.get(r['config'], r['config'])} | {_cell_name(r['cell'])} | " + " | ".join(cells) +
                     f" | {above:.3f} |")
    return lines


def _check_lines(report: dict) -> list[str]:
    return [f"- prefill check, {NAMES.get(c['config'], c['config'])} {_cell_name(c['cell'])}: step after a real "
            f"prefill {_f(c['real_ms'])} ms, after the skipped one {_f(c['skipped_ms'])} ms (ratio "
            f"{_f(c['ratio'], '{:.3f}')}; bench steps {_f(c['bench_ratio'], '{:.3f}')})" for c in report["checks"]]


def _run_lines(data: dict) -> list[str]:
    return [f"- {cfg}: {run.get('status', '?')}, {_f(run.get('wall_s'), '{:.0f}')} s, KV pool "
            f"{_f(run.get('kv_tokens'), '{:,}')} tokens ({run.get('kv_dtype') or '?'}), weights "
            f"{_f(run.get('weight_gib'))} GiB{' TIMEOUT' if run.get('timed_out') else ''}"
            f"{' (from ' + run['merged_from'] + ')' if run.get('merged_from') else ''}"
            for cfg, run in data["runs"].items()]


def format_report(data: dict, report: dict) -> str:
    """roofline.md: the sections above, each after a blank line (empty ones left out)."""
    sections = [_header(data, report), *[_config_table(cfg, rows) for cfg, rows in report["tables"].items()],
                _speedup_table(report, data["meta"]),
                ["### Targets (issue 35, per decode step)", "", *[_target_line(t) for t in report["targets"]]],
                _check_lines(report), _breakdown_table(report) + _floor_table(report), _run_lines(data)]
    return "\n\n".join("\n".join(s) for s in sections if s)
