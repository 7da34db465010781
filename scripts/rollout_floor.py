"""Each decode step of an RL rollout against its floor (bench_rl_rollout.py's report).

A served decode step's scheduler log line (``--decode-log-interval 1``) names its running requests and ``#token``, the
KV tokens those requests hold: every one of them is read by the step's attention. So each step of a real rollout, at
its own batch and contexts, gets the floor of decode_roofline.py's model (scripts/roofline_model.py: the weights once,
the KV of every held token, the new tokens' KV written; max of those bytes at the copy bandwidth and the FLOPs at the
card's dense peak). Per band of running requests (scripts/rollout_regimes.py's bands), over the steps with no prefill
logged since the previous step (a step's time is the time since that line, so a prefill in between is in it): the mean
context of a request, the floor's seconds against the measured ones, the efficiency (floor / measured) and the seconds
above the floor: where the makespan is lost, in the shape users run it; the seconds of the steps with a prefill in
them are counted apart. The bandwidth is measured on the GPU before the servers start (a copy in a child process, so
no CUDA context stays in the client) or given (--bandwidth-gbps: e.g. the roofline's measurement on the same machine,
for a --dry-run join of recorded answers).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import bench_rollout_configs as BRC  # scripts/bench_rollout_configs.py: a server flag's value
import rollout_regimes as RG  # scripts/rollout_regimes.py: the bands, the decode log line
import roofline_model as RM  # scripts/roofline_model.py: a decode step's bytes, FLOPs and floor

_PREFILL = re.compile(r"Prefill batch")
# the child process's copy: the roofline's measurement (decode_roofline_child.copy_bandwidth), one definition for all
_MEASURE = ("import json, sys; sys.path.insert(0, {scripts!r}); from decode_roofline_child import copy_bandwidth; "
            "print(json.dumps(copy_bandwidth(1 << 30)))")


def precision(flags: list[str]) -> tuple[str, str]:
    """(weights, KV) dtype of a server's flags, as roofline_model names them: FP8 where --quantization or
    --kv-cache-dtype names an FP8 format, else BF16."""
    quant, kv = BRC.flag_value(flags, "--quantization") or "", BRC.flag_value(flags, "--kv-cache-dtype") or ""
    return "fp8" if "fp8" in quant else "bf16", "fp8" if kv.startswith("fp8") else "bf16"


def steps_with_tokens(run_log: list[str]) -> list[tuple[int, float, int, bool]]:
    """(running requests, step seconds, KV tokens held, a prefill logged since the previous step) of each decode log
    line with requests running, a positive throughput and a ``#token`` count."""
    out, prefill = [], False
    for line in run_log:
        if _PREFILL.search(line):
            prefill = True
            continue
        m = RG.DECODE_STEP.search(line)
        if m and m[2] is not None and int(m[1]) > 0 and float(m[3]) > 0:
            out.append((int(m[1]), int(m[1]) / float(m[3]), int(m[2]), prefill))
        prefill = prefill and not m
    return out


def step_floor_s(shape: RM.Shape, weights: str, kv: str, running: int, tokens: int, bandwidth_gbps: float,
                 peaks: dict[str, float] | None) -> float:
    """The floor of one decode step of ``running`` requests holding ``tokens`` KV tokens in all."""
    return RM.step_model(shape, weights, kv, running, tokens / running, bandwidth_gbps, peaks)["floor_s"]


def band_floors(run_log: list[str], flags: list[str], shape: RM.Shape, bandwidth_gbps: float,
                peaks: dict[str, float] | None) -> dict[str, dict]:
    """band label (and "all") -> {steps, mean_context, seconds, floor_s, efficiency, above_s} of the steps without a
    prefill, and {prefill_steps, prefill_s} of those with one."""
    weights, kv = precision(flags)
    rows: dict[str, list] = {}
    mixed: dict[str, list] = {}
    for running, seconds, tokens, prefill in steps_with_tokens(run_log):
        label = next(lab for lab, lo, hi in RG.BANDS if lo <= running <= hi)
        for key in (label, "all"):
            if prefill:
                mixed.setdefault(key, []).append(seconds)
            else:
                floor = step_floor_s(shape, weights, kv, running, tokens, bandwidth_gbps, peaks)
                rows.setdefault(key, []).append((running, seconds, tokens, floor))
    out = {}
    for key in [lab for lab, _, _ in RG.BANDS] + ["all"]:
        r, m = rows.get(key) or [], mixed.get(key) or []
        if not (r or m):
            continue
        seconds, floor = sum(x[1] for x in r), sum(x[3] for x in r)
        out[key] = {"steps": len(r), "mean_context": sum(x[2] for x in r) / sum(x[0] for x in r) if r else None,
                    "seconds": seconds, "floor_s": floor, "efficiency": floor / seconds if r else None,
                    "above_s": seconds - floor, "prefill_steps": len(m), "prefill_s": sum(m)}
    return out


def format_floors(per_config: dict[str, dict[str, dict]], bandwidth_gbps: float, peaks_card: str | None) -> str:
    """Markdown: per band, each config's mean context, efficiency and seconds above the floor."""
    configs = [c for c, r in per_config.items() if r]
    if not configs:
        return ""
    compute = f"FLOPs at the {peaks_card} dense peak" if peaks_card else "FLOPs not counted (card unknown)"
    head = ["running requests"] + [f"{c}: context, floor s / s, efficiency, s above (+ s with a prefill)"
                                   for c in configs]
    lines = [f"Decode steps against their floor (each step: weights + the KV of its `#token` held tokens at "
             f"{bandwidth_gbps:,.0f} GB/s copy bandwidth, {compute}; context = mean tokens a request holds; over the "
             "steps with no prefill since the previous one, the seconds of the others in parentheses):", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label in [lab for lab, _, _ in RG.BANDS] + ["all"]:
        if not any(label in per_config[c] for c in configs):
            continue
        cells = ["all decode steps" if label == "all" else label]
        for c in configs:
            r = per_config[c].get(label)
            cells.append("—" if r is None else _cell(r))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(r: dict) -> str:
    mixed = f" (+ {r['prefill_s']:.1f})" if r["prefill_steps"] else ""
    if not r["steps"]:
        return "—" + mixed
    return (f"{r['mean_context']:,.0f}, {r['floor_s']:.1f} / {r['seconds']:.1f}, {r['efficiency']:.0%}, "
            f"{r['above_s']:.1f}{mixed}")


def measure_bandwidth_gbps(timeout_s: float = 120) -> tuple[float | None, str]:
    """(GB/s, how) of the roofline's device-to-device copy in a child process; (None, why) where it cannot run."""
    code = _MEASURE.format(scripts=os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"the copy did not run ({e!r})"
    if done.returncode != 0:
        return None, f"the copy failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    copy = json.loads(done.stdout.strip().splitlines()[-1])
    if "gbps" not in copy:
        return None, f"the copy failed: {copy.get('skipped', '?')}"
    return float(copy["gbps"]), "measured before the servers started (copy of 1 GiB)"


def set_bandwidth(meta: dict, given: float | None, recorded: float | None, measure: bool = False) -> None:
    """meta's copy bandwidth for the floors (GB/s) and where it came from: --bandwidth-gbps, else the recorded
    answers' (a --dry-run), else measured on this machine's GPU (a run), else none, said why."""
    if given:
        meta["bandwidth_gbps"], meta["bandwidth_source"] = given, "--bandwidth-gbps"
    elif recorded:
        meta["bandwidth_gbps"], meta["bandwidth_source"] = recorded, "recorded with the answers"
    elif measure:
        meta["bandwidth_gbps"], meta["bandwidth_source"] = measure_bandwidth_gbps()
    else:
        meta["bandwidth_gbps"], meta["bandwidth_source"] = None, "no copy bandwidth (pass --bandwidth-gbps)"


def model_shape(model: str) -> RM.Shape:
    """The Shape of a dummy model of scripts/gpu/make_models.py (bench_rl_rollout.py's --model)."""
    import make_models  # scripts/gpu/make_models.py

    if model in make_models.QWEN3_SHAPES:
        return RM.Shape.from_config({**make_models.QWEN3_COMMON, **make_models.QWEN3_SHAPES[model]})
    return RM.Shape.from_config(dict(make_models.QWEN3_MOE))


def context(meta: dict) -> dict | None:
    """What the floors need from a report's meta (model, bandwidth_gbps, device), or None without a bandwidth."""
    if not meta.get("bandwidth_gbps"):
        return None
    card = RM.card_of(meta.get("device") or meta.get("recorded_device") or "")
    return {"shape": model_shape(meta["model"]), "gbps": float(meta["bandwidth_gbps"]), "card": card,
            "peaks": RM.PEAK_TFLOPS.get(card) if card else None}
