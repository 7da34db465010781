"""FP8 KV-cache measurements for bench_rollout.py (issue 15): log parsing, decode ratios vs BF16, targets, report.

Pure Python (no torch, no SGLang at import), unit-tested in tests/test_kv_measure_scripts.py.

Results handled here are bench_rollout's ``results`` mapping, label -> entry, where an entry holds ``config`` (the
config name, e.g. ``bf16``), ``backend`` (the attention backend it ran on), ``rows`` (bench_one_batch's result rows,
each with ``batch_size``, ``output_len``, ``median_decode_throughput``, ``median_decode_latency``, ``total_latency``)
and ``kv_recal_ms`` (the recalibration times parsed from its log).
"""
from __future__ import annotations

import re
import statistics
import subprocess

# ----------------------------------------------------------------------------------------------------------------
# the recalibration log line
# ----------------------------------------------------------------------------------------------------------------

# The line the engine logs once per recalibration. The parser below takes any `[fp8rl]` line that names KV scales and
# ends its timing with "in <number> <ms|s|us>" (the last such phrase of the line), so this example and the format of
# Calibration.summary() ("[fp8rl] KV scales from calibration on 2048 tokens in 41.0 ms: 36 layers, ...") both parse.
# Lines about trainer-supplied scales, deferred, failed or rejected recalibrations are not recalibration times.
KV_RECAL_LOG_EXAMPLE = "[fp8rl] KV scales recalibrated (36 layers, 2048 tokens, 3 changed) in 41.0 ms"
_RECAL_LINE_RE = re.compile(r"\[fp8rl\].*?\bKV[ _-]?scales?\b", re.IGNORECASE)
_DURATION_RE = re.compile(r"\b(?:in|took)\s+(?P<value>[0-9][0-9,]*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)\s*"
                          r"(?P<unit>ms|s|us|µs)(?![A-Za-z])")
_NOT_A_RECAL_RE = re.compile(r"\b(?:trainer|deferred|not\s+recalibrated|fail(?:ed|s|ure)?|skipp(?:ed|ing)|"
                             r"reject(?:ed|s)?)\b", re.IGNORECASE)
_RANK_RE = re.compile(r"\bTP(\d+)\b")
_UNIT_MS = {"ms": 1.0, "s": 1e3, "us": 1e-3, "µs": 1e-3}


def parse_recalibration_ms(line: str):
    """Milliseconds of one recalibration from its log line, or None if the line is not a recalibration time."""
    m = _RECAL_LINE_RE.search(line)
    if not m:
        return None
    rest = line[m.start():]
    if _NOT_A_RECAL_RE.search(rest):
        return None
    durations = list(_DURATION_RE.finditer(rest))
    if not durations:
        return None
    d = durations[-1]
    return float(d["value"].replace(",", "")) * _UNIT_MS[d["unit"]]


def recalibration_times(text: str) -> list[float]:
    """Recalibration times (ms) in a log, in order; with several TP ranks logging, only rank 0's lines count."""
    found = []
    for line in text.splitlines():
        ms = parse_recalibration_ms(line)
        if ms is not None:
            rank = _RANK_RE.search(line[:line.find("[fp8rl]")])
            found.append((int(rank[1]) if rank else None, ms))
    ranks = {r for r, _ in found if r is not None}
    keep = min(ranks) if ranks else None
    return [ms for r, ms in found if r is None or r == keep]


# ----------------------------------------------------------------------------------------------------------------
# backends and the plugin's options
# ----------------------------------------------------------------------------------------------------------------

FA3 = "fa3"
ATTENTION_BACKENDS = ("triton", "flashinfer", FA3)
DEFAULT_ATTENTION_BACKEND = "triton"
# FlashInfer's ragged prefill path passes no KV scales for the cached prefix; the paged path does (design note sec. 2).
FLASHINFER_PAGED_ENV = {"SGLANG_FLASHINFER_USE_PAGED": "1"}
KV_SCALES_FIELD = "kv_scales"  # Fp8rlOptions field of --fp8rl-kv-scales
KV_SCALES_FLAG = "--fp8rl-kv-scales"
# what bench_rollout's child says, and its parent looks for, when the installed plugin predates that option
KV_OPTION_MISSING = f"this sglang-fp8rl has no {KV_SCALES_FLAG} option"
KV_WRITE_FLAG = "--fp8rl-kv-write"
_FA3_PROBE = "import sgl_kernel.flash_attn; from sgl_kernel import flash_ops"


def backend_env(flags: list[str], backend: str) -> dict:
    """Extra environment of one config on one attention backend (FlashInfer's paged prefix path with an FP8 cache)."""
    if backend == "flashinfer" and "--kv-cache-dtype" in flags:
        return dict(FLASHINFER_PAGED_ENV)
    return {}


def fa3_available(python: str, timeout_s: float = 180) -> tuple[bool, str]:
    """Whether FlashAttention-3 (sglang-kernel's flash_ops) imports with `python`; (ok, reason if not)."""
    try:
        r = subprocess.run([python, "-c", _FA3_PROBE], capture_output=True, text=True, timeout=timeout_s,
                           check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"the import check did not run: {e!r}"
    if r.returncode == 0:
        return True, ""
    tail = [ln for ln in (r.stderr or "").strip().splitlines() if ln.strip()]
    return False, tail[-1][:300] if tail else f"exit code {r.returncode}"


def kv_scales_supported() -> bool:
    """Whether the installed sglang-fp8rl has the --fp8rl-kv-scales option (an Fp8rlOptions field)."""
    import dataclasses

    from sglang_fp8rl.server_args import Fp8rlOptions

    return KV_SCALES_FIELD in {f.name for f in dataclasses.fields(Fp8rlOptions)}


# ----------------------------------------------------------------------------------------------------------------
# decode ratios vs BF16, targets (issue 15)
# ----------------------------------------------------------------------------------------------------------------

BF16 = "bf16"
CALIBRATED_KV = "fp8_online_blockwise_kv"
CALIBRATED_KV_CONFIGS = (CALIBRATED_KV, "fp8_online_blockwise_kv_sglang_write")  # the targets apply to both writes
KV_GRID_BATCH_SIZES = (64, 128)
KV_GRID_OUTPUT_LENS = (256, 1024)
# decode tok/s of FP8 weights + FP8 KV (calibrated) over BF16 on its fastest backend, at input 512, bs 64 and 128
KV_TARGETS = {1024: 1.60, 256: 1.55}
RECAL_ROLLOUT = (128, 1024)  # (batch size, output length) of the rollout the recalibration is compared with
RECAL_MAX_FRACTION = 0.02
_DECODE = "median_decode_throughput"


def entry_config(label: str, entry: dict) -> str:
    return entry.get("config") or label.split("@")[0]


def entry_backend(entry: dict, default: str = DEFAULT_ATTENTION_BACKEND) -> str:
    return entry.get("backend") or default


def find_row(entry: dict, bs: int, output_len: int):
    """The last result row of (bs, output_len) in one entry (rows without output_len count for any length)."""
    found = None
    for r in entry.get("rows", []):
        if int(r.get("batch_size", -1)) == bs and int(r.get("output_len", output_len)) == output_len:
            found = r
    return found


def decode_tps(entry: dict, bs: int, output_len: int):
    r = find_row(entry, bs, output_len)
    return r.get(_DECODE) if r else None


def bf16_best(results: dict, bs: int, output_len: int):
    """(decode tok/s, label) of the fastest BF16 entry at (bs, output_len), over every backend; (None, None) if none."""
    best = (None, None)
    for label, e in results.items():
        if entry_config(label, e) != BF16:
            continue
        v = decode_tps(e, bs, output_len)
        if v and (best[0] is None or v > best[0]):
            best = (v, label)
    return best


def bf16_same_backend(results: dict, backend: str, bs: int, output_len: int):
    """(decode tok/s, label) of BF16 on `backend` at (bs, output_len); (None, None) if not measured."""
    for label, e in results.items():
        if entry_config(label, e) == BF16 and entry_backend(e) == backend:
            v = decode_tps(e, bs, output_len)
            if v:
                return v, label
    return None, None


def kv_ratio_rows(results: dict, batch_sizes=KV_GRID_BATCH_SIZES, output_lens=KV_GRID_OUTPUT_LENS) -> list[dict]:
    """Decode tok/s of every non-BF16 entry over BF16 on the same backend and over BF16 on its best backend."""
    out = []
    for label, e in results.items():
        if entry_config(label, e) == BF16:
            continue
        for ol in output_lens:
            for bs in batch_sizes:
                v = decode_tps(e, bs, ol)
                same, same_label = bf16_same_backend(results, entry_backend(e), bs, ol)
                best, best_label = bf16_best(results, bs, ol)
                out.append({"label": label, "config": entry_config(label, e), "backend": entry_backend(e),
                            "bs": bs, "output_len": ol, "decode": v,
                            "vs_same": v / same if v and same else None, "same_label": same_label,
                            "vs_best": v / best if v and best else None, "best_label": best_label,
                            "best_backend": entry_backend(results[best_label]) if best_label else None})
    return out


def _status(value, threshold) -> str:
    return "n/a" if value is None else ("PASS" if value >= threshold else "MISS")


def kv_targets(results: dict, batch_sizes=KV_GRID_BATCH_SIZES) -> list[dict]:
    """The issue's decode targets for every calibrated-FP8-KV entry: PASS/MISS and margin against BF16's best backend
    (the target) and against BF16 on the same backend (for reference)."""
    out = []
    for row in kv_ratio_rows(results, batch_sizes, tuple(sorted(KV_TARGETS))):
        if row["config"] not in CALIBRATED_KV_CONFIGS:
            continue
        thr = KV_TARGETS[row["output_len"]]
        v, s = row["vs_best"], row["vs_same"]
        out.append({**row, "threshold": thr, "status": _status(v, thr), "margin": None if v is None else v - thr,
                    "status_same": _status(s, thr), "margin_same": None if s is None else s - thr})
    return out


def recal_report(results: dict, rollout=RECAL_ROLLOUT, max_fraction=RECAL_MAX_FRACTION) -> list[dict]:
    """Per entry with logged recalibrations: their time against the decode step and the whole rollout at `rollout`.

    The rollout time is bench_one_batch's total latency of that (bs, output_len) row: one prefill of the batch plus
    output_len - 1 decode steps, i.e. the generation phase of one RL step."""
    bs, ol = rollout
    out = []
    for label, e in results.items():
        times = e.get("kv_recal_ms") or []
        if not times:
            continue
        r = find_row(e, bs, ol)
        step_ms = r["median_decode_latency"] * 1e3 if r and r.get("median_decode_latency") else None
        rollout_s = r.get("total_latency") if r else None
        worst = max(times)
        frac = worst / 1e3 / rollout_s if rollout_s else None
        out.append({"label": label, "count": len(times), "median_ms": statistics.median(times), "max_ms": worst,
                    "step_ms": step_ms, "rollout_s": rollout_s, "bs": bs, "output_len": ol,
                    "steps_equivalent": worst / step_ms if step_ms else None, "fraction": frac,
                    "threshold": max_fraction,
                    "status": "n/a" if frac is None else ("PASS" if frac <= max_fraction else "MISS")})
    return out


def kv_warnings(results: dict) -> list[str]:
    """Facts that make an FP8-KV row mean something else than its name says."""
    out = []
    for label, e in results.items():
        flags = e.get("flags") or []
        if "--kv-cache-dtype" not in flags or e.get("status") not in (None, "ok"):
            continue
        dtype = e.get("kv_dtype")
        if dtype and "float8" not in dtype and "fp8" not in dtype:
            out.append(f"{label}: the KV cache was allocated as {dtype}, not FP8")
        if entry_config(label, e) == CALIBRATED_KV and not e.get("kv_recal_ms"):
            out.append(f"{label}: no KV-scale recalibration line in its log (expected like {KV_RECAL_LOG_EXAMPLE!r}): "
                       "the cache ran with SGLang's static scale 1.0, or the line's format changed "
                       "(align scripts/kv_measure.py)")
    return out


def _f(v, fmt="{:.3f}", none="—"):
    return none if v is None else fmt.format(v)


def format_kv_section(results: dict) -> str:
    """The FP8-KV part of bench_rollout's summary: ratio grid, targets with margins, recalibration time."""
    if not any("--kv-cache-dtype" in (e.get("flags") or []) for e in results.values()):
        return ""  # no FP8-KV entry: the run's own tables say everything
    rows = [r for r in kv_ratio_rows(results) if r["decode"] is not None]
    if not rows:
        return ""
    lines = ["### FP8 KV cache (issue 15): decode tok/s over BF16, input 512", "",
             "| config | backend | output | bs | decode tok/s | / BF16 same backend | / BF16 fastest (its backend) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['backend']} | {r['output_len']} | {r['bs']} | "
                     f"{_f(r['decode'], '{:,.0f}')} | "
                     f"{_f(r['vs_same'])} | {_f(r['vs_best'])} ({r['best_backend'] or '—'}) |")
    targets = kv_targets(results)
    if targets:
        lines += ["", ("targets (FP8 weights + FP8 KV, calibrated, over BF16 on its fastest backend; same-backend "
                       "ratio for reference):")]
        for t in targets:
            lines.append(f"  {t['label']} decode @bs{t['bs']} out{t['output_len']} >= {t['threshold']:.2f}: "
                         f"{_f(t['vs_best'])} {t['status']} (margin {_f(t['margin'], '{:+.3f}')}); same backend "
                         f"{_f(t['vs_same'])} {t['status_same']} ({_f(t['margin_same'], '{:+.3f}')})")
    recal = recal_report(results)
    if recal:
        lines += ["", (f"recalibration time (max of the logged ones) vs a rollout at bs {RECAL_ROLLOUT[0]}, output "
                       f"{RECAL_ROLLOUT[1]} (prefill + decode, same config), target <= {RECAL_MAX_FRACTION:.0%}:")]
        for r in recal:
            lines.append(f"  {r['label']}: {r['count']} recalibration(s), median {r['median_ms']:.1f} ms, max "
                         f"{r['max_ms']:.1f} ms = {_f(r['steps_equivalent'], '{:.1f}')} decode steps of "
                         f"{_f(r['step_ms'], '{:.2f}')} ms; rollout {_f(r['rollout_s'], '{:.2f}')} s -> "
                         f"{_f(None if r['fraction'] is None else 100 * r['fraction'], '{:.2f}')} % {r['status']}")
    warnings = kv_warnings(results)
    if warnings:
        lines += [""] + [f"WARNING {w}" for w in warnings]
    return "\n".join(lines)
