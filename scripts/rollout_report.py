"""The report of scripts/bench_rl_rollout.py: the server-log lines it reads, per-config metrics, ratios against the
faster BF16 baseline, summary.md / results.json / answers.json / completion.png, and the recorded answers a --dry-run
replays."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import time

import bench_rollout_report as BRR  # scripts/bench_rollout_report.py: start-up log parsing
import rollout_floor as RF  # scripts/rollout_floor.py: each decode step against its floor
import rollout_regimes as RG  # scripts/rollout_regimes.py: decode steps by running requests
from accuracy_metrics import percentile  # numpy-style linear-interpolation percentile

BF16_BASELINES = ("bf16", "bf16_graphs512")  # the ratios' denominator: the faster of these that ran
_DECODE_RE = re.compile(RG.DECODE_LINE + r".*?\b(?:cuda|cpu|npu|musa) graph: (True|False)(?:.*?#queue-req: (\d+))?")
_MAX_RUNNING_RE = re.compile(r"max_total_num_tokens=\d+.*?max_running_requests=(\d+)")
_RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
_KEEP_RE = re.compile(r"Decode batch|Prefill batch|max_total_num_tokens=|KV [Cc]ache (?:is )?allocated|"
                      r"Retract requests|Load weight end|\[fp8rl\]|Traceback|Error")


def say(msg: str) -> None:
    """One progress line on stdout."""
    print(f"[bench_rl_rollout {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_decode_log(text: str) -> dict:
    """Decode batches of a log window: count, without CUDA graph, shares (of batches, of tokens), peak running."""
    batches = no_graph = tokens = no_graph_tokens = peak = 0
    peak_queue = 0
    for line in text.splitlines():
        m = _DECODE_RE.search(line)
        if not m:
            continue
        running, graph = int(m[1]), m[2] == "True"
        batches += 1
        tokens += running
        peak = max(peak, running)
        peak_queue = max(peak_queue, int(m[3] or 0))
        if not graph:
            no_graph += 1
            no_graph_tokens += running
    return {"decode_batches": batches, "no_graph_batches": no_graph, "decode_tokens": tokens,
            "no_graph_tokens": no_graph_tokens, "no_graph_share": no_graph / batches if batches else None,
            "no_graph_token_share": no_graph_tokens / tokens if tokens else None,
            "peak_running": peak if batches else None, "peak_queue": peak_queue if batches else None}


def parse_startup_log(text: str) -> dict:
    """KV pool (tokens, dtype), max running requests and weight memory from a server's start-up log."""
    info = BRR.parse_log(text)
    m = _MAX_RUNNING_RE.search(text)
    return {"kv_tokens": info["kv_tokens"], "kv_dtype": info["kv_dtype"], "weight_gib": info["weight_gib"],
            "max_running_requests": int(m[1]) if m else None, "fp8rl": info["fp8rl"][:4]}


def parse_retractions(text: str) -> dict:
    """KV-full retractions during the run: events and retracted requests."""
    n = [int(m[1]) for m in _RETRACT_RE.finditer(text)]
    return {"retract_events": len(n), "retracted_reqs": sum(n)}


def keep_lines(text: str) -> list[str]:
    """The log lines the report reads (answers.json keeps only these)."""
    return [ln for ln in text.splitlines() if _KEEP_RE.search(ln)]


def graph_max_bs(server_info: dict) -> int | None:
    """The largest decode CUDA-graph batch size from /server_info (None when it is not there)."""
    cg = server_info.get("cuda_graph_config")
    if isinstance(cg, dict) and isinstance(cg.get("decode"), dict) and cg["decode"].get("max_bs"):
        return int(cg["decode"]["max_bs"])
    v = server_info.get("cuda_graph_max_bs_decode") or server_info.get("cuda_graph_max_bs")
    return int(v) if v else None


def summarize_requests(requests_: list[dict], n_planned: int) -> dict:
    """Makespan, p50/p90 completion time, output tokens and tok/s of one config's requests."""
    done = sorted(r["done_s"] for r in requests_ if r.get("ok"))
    tokens = sum(int(r.get("output_tokens") or 0) for r in requests_ if r.get("ok"))
    makespan = done[-1] if done else None
    return {"n": n_planned, "done": len(done), "failed": n_planned - len(done), "complete": len(done) == n_planned,
            "makespan_s": makespan, "p50_s": completion_percentile(done, n_planned, 50),
            "p90_s": completion_percentile(done, n_planned, 90), "output_tokens": tokens,
            "output_tok_s": tokens / makespan if makespan else None}


def completion_percentile(done: list[float], n_planned: int, q: float) -> float | None:
    """The q-th percentile of all planned requests' completion times; requests that never finished count as later
    than every finished one, so a percentile that lands on them is unknown (None), never one of the finished."""
    if not done:
        return None
    value = percentile(done + [math.inf] * max(0, n_planned - len(done)), q)
    return value if math.isfinite(value) else None


def summarize_config(name: str, rec: dict, n_planned: int, floor: dict | None = None) -> dict:
    """Every metric of one config from its record (requests, start-up log lines, run log lines); with ``floor``
    (rollout_floor.context) each band's decode steps against their floor too."""
    startup = "\n".join(rec.get("startup_log") or [])
    run = "\n".join(rec.get("run_log") or [])
    res = {"config": name, "flags": rec.get("flags", []), "status": rec.get("status", "ok"),
           "start_s": rec.get("start_s"), "run_s": rec.get("run_s"), "wall_s": rec.get("wall_s"),
           "fa3_fallback": bool(rec.get("fa3_fallback")),
           **summarize_requests(rec.get("requests") or [], n_planned), **parse_startup_log(startup),
           **parse_decode_log(run), **parse_retractions(run)}
    info = rec.get("server_info") or {}
    res["graph_max_bs"] = graph_max_bs(info)
    if res["kv_tokens"] is None and info.get("max_total_num_tokens"):
        res["kv_tokens"] = int(info["max_total_num_tokens"])
    if res["max_running_requests"] is None and info.get("max_running_requests"):
        res["max_running_requests"] = int(info["max_running_requests"])
    res["errors"] = sorted({str(r.get("error"))[:200] for r in rec.get("requests") or [] if r.get("error")})[:5]
    res["regimes"] = RG.regimes(rec.get("run_log") or [])
    if floor:
        res["floors"] = RF.band_floors(rec.get("run_log") or [], res["flags"], floor["shape"], floor["gbps"],
                                       floor["peaks"])
    return res


def _div(a, b) -> float | None:
    return a / b if a is not None and b else None


def ratios(res: dict, base: dict) -> dict:
    """Against the baseline: speed-up (its makespan / this one), tok/s, p50, p90, KV pool, peak running (this / it)."""
    return {"speedup": _div(base.get("makespan_s"), res.get("makespan_s")),
            "output_tok_s": _div(res.get("output_tok_s"), base.get("output_tok_s")),
            "p50": _div(res.get("p50_s"), base.get("p50_s")), "p90": _div(res.get("p90_s"), base.get("p90_s")),
            "kv_tokens": _div(res.get("kv_tokens"), base.get("kv_tokens")),
            "peak_running": _div(res.get("peak_running"), base.get("peak_running"))}


def pick_baseline(results: dict[str, dict]) -> dict:
    """The ratios' denominator: the faster of the BF16 baselines that ran (bf16 at SGLang's defaults, bf16_graphs512),
    else the first config; {"config", "candidates": {name: makespan or None}, "why"}."""
    cands = {n: r.get("makespan_s") if r.get("complete") else None for n, r in results.items()
             if n in BF16_BASELINES}
    if not cands:
        first = next(iter(results), None)
        return {"config": first, "candidates": {}, "why": "the first config (no BF16 baseline config ran)"}
    done = {n: ms for n, ms in cands.items() if ms is not None}
    if not done:  # none finished: no ratio is known, the first of them names the column
        return {"config": next(iter(cands)), "candidates": cands, "why": "no BF16 baseline finished every request"}
    base = min(done, key=done.get)  # a tie keeps the earlier config
    if len(cands) == 1:
        why = f"the only one of {' / '.join(BF16_BASELINES)} that ran"
    else:
        why = "the faster BF16: " + ", ".join(
            f"{n} {'did not finish' if ms is None else f'{ms:.1f} s'}" for n, ms in cands.items())
    return {"config": base, "candidates": cands, "why": why}


def build_report(records: dict[str, dict], n_planned: int, floor: dict | None = None) -> dict[str, dict]:
    """config -> metrics + `vs_base` ratios against the baseline of pick_baseline (in each config's `baseline`)."""
    results = {name: summarize_config(name, rec, n_planned, floor) for name, rec in records.items()}
    pick = pick_baseline(results)
    base = results.get(pick["config"]) or {}
    for res in results.values():
        res["vs_base"] = ratios(res, base)
        res["baseline"] = pick["config"]
    return results


def completion_curve(requests_: list[dict]) -> tuple[list[float], list[int]]:
    """(completion times sorted, requests done by then) of the completed requests."""
    times = sorted(r["done_s"] for r in requests_ if r.get("ok"))
    return times, list(range(1, len(times) + 1))


def _f(v, fmt: str = "{:,.0f}") -> str:
    return "—" if v is None else fmt.format(v)


def _graph_cell(r: dict) -> str:
    if not r.get("decode_batches"):
        return "—"
    return (f"{100 * r['no_graph_share']:.1f} % ({r['no_graph_batches']}/{r['decode_batches']}); "
            f"{100 * r['no_graph_token_share']:.1f} % of tokens")


def format_summary(results: dict[str, dict], meta: dict, floor: dict | None = None) -> str:
    """summary.md: the table (ratios vs the baseline of pick_baseline), workload, definitions, per-config notes; with
    ``floor`` (rollout_floor.context, as build_report had it) the decode steps against their floor."""
    pick = pick_baseline(results)
    base = pick["config"] or "?"
    inp = meta.get("input_lengths")
    prompts = "" if not inp else (f"; prompt lengths: median {_f(inp['median'])}, p90 {_f(inp['p90'])}, max "
                                  f"{_f(inp['max'])}, {_f(inp['total'])} tokens in all")
    lines = [f"## RL-shaped rollout, stock SGLang server: {meta.get('model_desc', '')}",
             (f"workload: {meta.get('workload_desc', '')}; output lengths: median {_f(meta['lengths']['median'])}, "
              f"p90 {_f(meta['lengths']['p90'])}, max {_f(meta['lengths']['max'])}, {meta['lengths']['at_cap']} at "
              f"the cap, {_f(meta['lengths']['total'])} tokens in all{prompts}"),
             f"ratios against {base}: {pick['why']}"]
    if meta.get("device"):
        lines.append(f"device: {meta['device']}; {meta.get('versions', '')}; {meta.get('date', '')}")
    sources = meta.get("recorded_sources") or {}
    if meta.get("dry_run") and len(set(sources.values())) > 1:
        lines.append("joined from the recorded answers of runs made one after another (no server ran for this "
                     "report): " + "; ".join(f"{c} from {os.path.basename(p)}" for c, p in sources.items()))
    elif meta.get("dry_run"):
        lines.append(f"DRY RUN: recorded answers from {meta.get('recorded')}, no server ran")
    lines += ["", (f"| config | done | makespan s | p50 s | p90 s | output tok/s | KV pool tokens | peak running | "
                   f"decode batches without CUDA graph | speed-up vs {base} | tok/s vs {base} | p50 vs {base} | "
                   f"p90 vs {base} | KV pool vs {base} |"),
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        v = r["vs_base"]
        done = f"{r['done']}/{r['n']}" + ("" if r["complete"] else f" ({r['status']})")
        ms = _f(r["makespan_s"], "{:.1f}")
        if r["makespan_s"] is not None and not r["complete"]:
            ms = "> " + _f(r.get("run_s") or r["makespan_s"], "{:.1f}")
        label = name + (" (triton: no FA3)" if r.get("fa3_fallback") else "")
        lines.append(f"| {label} | {done} | {ms} | {_f(r['p50_s'], '{:.1f}')} | {_f(r['p90_s'], '{:.1f}')} | "
                     f"{_f(r['output_tok_s'])} | {_f(r['kv_tokens'])} | {_f(r['peak_running'])} | {_graph_cell(r)} | "
                     f"{_f(v['speedup'], '{:.3f}')} | {_f(v['output_tok_s'], '{:.3f}')} | {_f(v['p50'], '{:.3f}')} | "
                     f"{_f(v['p90'], '{:.3f}')} | {_f(v['kv_tokens'], '{:.3f}')} |")
    lines += ["", ("makespan: submit of the whole batch -> last request done; p50 / p90: of the requests' "
                   "completion times (from the same submit); output tok/s: completion tokens / makespan. speed-up = "
                   f"the baseline's ({base}) makespan / this one's; the other ratio columns are this / the baseline. "
                   "Decode batches without CUDA graph: of the scheduler's `Decode batch` log lines during the run "
                   "(one per decode step, --decode-log-interval 1), those with `cuda graph: False`, and the share of "
                   "decode tokens (sum of #running-req) they produced."), ""]
    # the baseline's column first: format_regimes takes the step speed-ups against its first config
    order = [base, *(n for n in results if n != base)] if base in results else list(results)
    regimes = RG.format_regimes({name: results[name].get("regimes") or {} for name in order})
    if regimes:
        lines += [regimes, ""]
    floors = floor and RF.format_floors({name: results[name].get("floors") or {} for name in order}, floor["gbps"],
                                        floor["card"] if floor["peaks"] else None)
    if floors:
        lines += [floors, ""]
    elif meta.get("bandwidth_source"):
        lines += [f"No floors: {meta['bandwidth_source']}.", ""]
    for name, r in results.items():
        t = (f"start {_f(r['start_s'], '{:.0f}')} s, run {_f(r['run_s'], '{:.0f}')} s, wall "
             f"{_f(r['wall_s'], '{:.0f}')} s")
        lines.append(f"- {name}: `{' '.join(r['flags']) or '(SGLang defaults)'}`; {r['status']}; {t}; KV "
                     f"{r['kv_dtype'] or '?'}, max running {_f(r['max_running_requests'])}, decode graphs up to bs "
                     f"{_f(r['graph_max_bs'])}, peak queue {_f(r['peak_queue'])}, KV-full retractions "
                     f"{r['retract_events']} ({r['retracted_reqs']} requests)"
                     + (f"; errors: {'; '.join(r['errors'])}" if r["errors"] else ""))
    return "\n".join(lines)


def plot_curves(records: dict[str, dict], results: dict[str, dict], path: str, title: str) -> str | None:
    """completion.png (requests done vs seconds since submit, one line per config); None, or why not written."""
    os.environ.setdefault("MPLBACKEND", "Agg")  # no display where this runs
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); the numbers are in results.json"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, rec in records.items():
        xs, ys = completion_curve(rec.get("requests") or [])
        r = results[name]
        ax.step([0.0, *xs], [0, *ys], where="post",
                label=f"{name}: makespan {_f(r['makespan_s'], '{:.0f}')} s, p50 {_f(r['p50_s'], '{:.0f}')} s")
    ax.set_xlabel("seconds since the batch was submitted")
    ax.set_ylabel("requests done")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_outputs(out: str, records: dict[str, dict], meta: dict, workload: dict) -> str:
    """results.json, summary.md, answers.json and completion.png into out; returns the summary text."""
    os.makedirs(out, exist_ok=True)
    floor = RF.context(meta)
    results = build_report(records, meta["workload"]["num_prompts"], floor)
    text = format_summary(results, meta, floor)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "baseline": pick_baseline(results), "results": results,
                   "curves": {n: completion_curve(rec.get("requests") or []) for n, rec in records.items()}},
                  f, indent=1, default=str)
    if not meta.get("dry_run"):
        with open(os.path.join(out, "answers.json"), "w") as f:
            json.dump({"workload": meta["workload"], "max_new_tokens": workload["max_new_tokens"],
                       "device": meta.get("device"), "bandwidth_gbps": meta.get("bandwidth_gbps"),
                       "configs": records}, f, default=str)
    try:
        why = plot_curves(records, results, os.path.join(out, "completion.png"),
                          f"{meta.get('model_desc', '')}: {meta.get('workload_desc', '')}")
    except Exception as e:  # noqa: BLE001  (a picture must never cost the numbers)
        why = f"plotting failed: {e!r}"
    if why:
        say(f"no completion.png: {why}")
    return text


def load_recorded(paths: list[str] | str, configs: list[str]) -> dict:
    """The recorded answers of the named configs, in the order given, each from the first file that has it (several
    files: runs made one after another, e.g. one config per GPU call; ``.gz`` files are read as gzip); SystemExit if
    one is missing."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    have, workload, source, machine = {}, {}, {}, {}
    for path in paths:
        try:
            with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--recorded {path}: cannot read it ({e})") from e
        for name, rec in (data.get("configs") or {}).items():
            if name not in have:
                have[name], source[name] = rec, path
        workload = workload or data.get("workload") or {}
        for key in ("device", "bandwidth_gbps"):  # of the first file that recorded them
            machine[key] = machine.get(key) or data.get(key)
    missing = [c for c in configs if c not in have]
    if missing:
        raise SystemExit(f"--recorded {' '.join(paths)} has no answers for {missing} (it has {list(have)})")
    return {"workload": workload, "machine": machine, "configs": {c: have[c] for c in dict.fromkeys(configs)},
            "sources": {c: source[c] for c in dict.fromkeys(configs)}}


def recorded_mismatches(records: dict[str, dict], max_new: list[int]) -> list[str]:
    """Recorded requests whose token count differs from this workload's max_new_tokens (ignore_eos: must be equal)."""
    bad = []
    for name, rec in records.items():
        for r in rec.get("requests") or []:
            i = int(r["i"])
            if i >= len(max_new) or (r.get("ok") and int(r.get("output_tokens") or 0) != max_new[i]):
                bad.append(f"{name} request {i}")
        if len(rec.get("requests") or []) != len(max_new):
            bad.append(f"{name}: {len(rec.get('requests') or [])} requests recorded, {len(max_new)} planned")
    return bad
