"""Where a served decode step's time goes, from the torch-profiler Chrome trace of SGLang's /start_profile, and the
markdown report: pure Python (no torch, no SGLang), used by scripts/gpu/profile_server_step.py and unit-tested in
tests/test_profile_server_step.py.

Input: the trace dict (``traceEvents``); only complete events (``ph: "X"``, ``ts`` / ``dur`` in microseconds) count.
GPU work: categories kernel / gpu_memcpy / gpu_memset (each stream on its own pid / tid; their union is the GPU's busy
time). Host work: cpu_op / python_function / user_annotation / cuda_runtime / cuda_driver.

Step boundaries, the first kind of marker the trace holds at least two of:
  1. ``step[DECODE bs=N]`` (``step[EXTEND bs=N toks=T]`` for a prefill) user annotations: SGLang 0.5.17 wraps every
     ModelRunner.forward in ``profile_range(build_step_span_name(forward_batch))``
     (sglang/srt/model_executor/model_runner.py:1405; the name from sglang/srt/utils/profile_utils.py:437), a
     torch.profiler.record_function emitted whenever the profiler records CPU activity;
  2. ``scheduler.run_batch`` user annotations (sglang/srt/managers/scheduler.py:3527, @scheduler_nvtx_method);
  3. ``cudaGraphLaunch`` runtime calls (one per decode step replayed from its CUDA graph; GPU-only traces);
  4. none of these: the start of each GPU busy cluster, clusters split at idle gaps of at least cluster_gap_us.
Step k runs from its marker to the next (the wall time: one scheduler iteration, the overlap scheduler's host work and
the GPU work it launched); the events after the last marker are a partial step, left out. A GPU event belongs to the
step whose window holds the runtime call that launched it (``args.correlation``, the same id on the kernel and on its
cudaLaunchKernel / cudaGraphLaunch / cuLaunchKernel), else the one that holds its own start. With markers of kind 1,
the DECODE steps are summarized (those at bs == batch when there are any).

Per step: wall, the GPU's first start, the GPU period (to the next step's first GPU start), GPU busy (union of its
events), GPU idle (period - busy) and its GPU time by group: decode_roofline.py's grouping (roofline_report.
kernel_groups: GEMMs, activation quantization, attention, norms/rotary, logits/sampling with lm_head's launch, other)
with torch sampling's RNG / sort / cumsum kernels moved from other to logits/sampling, plus memcpy/memset.
"""
from __future__ import annotations

import bisect
import functools
import re
import statistics
from typing import Callable, Optional

import roofline_report as RP  # scripts/roofline_report.py: decode_roofline.py's kernel groups

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
COPY_GROUP = "memcpy/memset"
GROUPS = [*RP.GROUPS, COPY_GROUP]
SAMPLING = "logits/sampling"
STEP_ANNOTATION = "step annotation"
CLUSTERS = "GPU busy clusters"
# torch.multinomial draws exponentials (distribution_elementwise_grid_stride_kernel<..., exponential_kernel ...>);
# top-p / top-k sort and cumsum: roofline_report's logits/sampling pattern does not name them
_MORE_SAMPLING_RE = re.compile(r"distribution_|exponential|radix_?sort|cumsum", re.IGNORECASE)
MARKERS: list[tuple[str, Callable[[dict], bool]]] = [
    (STEP_ANNOTATION, lambda e: e["cat"] == "user_annotation" and e["name"].startswith("step[")),
    ("scheduler.run_batch", lambda e: e["cat"] == "user_annotation" and e["name"] == "scheduler.run_batch"),
    ("cudaGraphLaunch", lambda e: e["cat"] in LAUNCH_CATS and e["name"].startswith("cudaGraphLaunch")),
]


# ----------------------------------------------------------------------------------------------------------------
# events and intervals
# ----------------------------------------------------------------------------------------------------------------

def complete_events(trace: dict) -> list[dict]:
    """The trace's complete events as {name, cat, ts, dur, end, pid, tid, corr}, sorted by start (longest first)."""
    out = []
    for ev in trace.get("traceEvents") or []:
        if ev.get("ph") != "X" or ev.get("ts") is None:
            continue
        ts, dur = float(ev["ts"]), float(ev.get("dur") or 0.0)
        out.append({"name": str(ev.get("name", "?")), "cat": str(ev.get("cat", "")).lower(), "ts": ts, "dur": dur,
                    "end": ts + dur, "pid": ev.get("pid"), "tid": ev.get("tid"),
                    "corr": (ev.get("args") or {}).get("correlation")})
    return sorted(out, key=lambda e: (e["ts"], -e["dur"]))


def merge_intervals(spans) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted disjoint intervals (touching ones joined)."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def busy_us(events: list[dict]) -> float:
    """Length of the union of the events' intervals."""
    return sum(b - a for a, b in merge_intervals((e["ts"], e["end"]) for e in events))


def gap_stats(gaps: list[float], gap_us: float) -> dict:
    """Idle gaps: how many and how long in all, and of those longer than gap_us count, total, median, longest."""
    long = sorted(g for g in gaps if g > gap_us)
    return {"threshold_us": gap_us, "all_count": len(gaps), "all_us": sum(gaps), "count": len(long),
            "total_us": sum(long), "median_us": statistics.median(long) if long else None,
            "longest_us": long[-1] if long else None}


def gpu_timeline(gpu: list[dict], window: Optional[tuple[float, float]] = None, gap_us: float = 50.0) -> dict:
    """Busy and idle time of the GPU events' union inside window (default: first start to last end), and its gaps."""
    busy = merge_intervals((e["ts"], e["end"]) for e in gpu)
    if window is None and not busy:
        return {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "idle_fraction": None, "gaps": gap_stats([], gap_us)}
    lo, hi = window or (busy[0][0], busy[-1][1])
    busy = [(max(a, lo), min(b, hi)) for a, b in busy if b > lo and a < hi]
    edges = [lo, *(x for span in busy for x in span), hi]
    gaps = [edges[i + 1] - edges[i] for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]
    span, used = hi - lo, sum(b - a for a, b in busy)
    return {"window_us": span, "busy_us": used, "idle_us": span - used,
            "idle_fraction": (span - used) / span if span > 0 else None, "gaps": gap_stats(gaps, gap_us)}


# ----------------------------------------------------------------------------------------------------------------
# step boundaries
# ----------------------------------------------------------------------------------------------------------------

def find_markers(events: list[dict]) -> tuple[Optional[str], list[dict]]:
    """(kind, marker events by start) of the first kind in MARKERS with at least two; (None, []) if none has."""
    for kind, is_marker in MARKERS:
        found = [e for e in events if is_marker(e)]
        if len(found) >= 2:
            return kind, found
    return None, []


def cluster_markers(gpu: list[dict], cluster_gap_us: float) -> list[dict]:
    """Fallback markers: the start of each GPU busy cluster, clusters split at idle gaps >= cluster_gap_us."""
    starts, last_end = [], None
    for a, b in merge_intervals((e["ts"], e["end"]) for e in gpu):
        if last_end is None or a - last_end >= cluster_gap_us:
            starts.append(a)
        last_end = b
    return [{"name": CLUSTERS, "cat": "gpu", "ts": a, "dur": 0.0, "end": a} for a in starts]


def launch_times(events: list[dict]) -> dict:
    """correlation id -> start of the runtime / driver call that launched the GPU work with that id."""
    return {e["corr"]: e["ts"] for e in events if e["cat"] in LAUNCH_CATS and e["corr"] is not None}


def assign_to_steps(gpu: list[dict], starts: list[float], launch: dict) -> list[list[dict]]:
    """GPU events per marker: bucket k holds those launched in [starts[k], starts[k + 1]), the last bucket those
    launched after the last marker; events launched before the first marker are left out."""
    buckets: list[list[dict]] = [[] for _ in starts]
    for e in gpu:
        k = bisect.bisect_right(starts, launch.get(e["corr"], e["ts"])) - 1
        if k >= 0:
            buckets[k].append(e)
    return buckets


# ----------------------------------------------------------------------------------------------------------------
# kernel groups
# ----------------------------------------------------------------------------------------------------------------

@functools.cache
def _roofline_group(name: str) -> str:
    groups = RP.kernel_groups({name: {"us": 1.0, "n": 1}}, 1, 1)  # one launch at layers 1: lm_head's rule is off
    return max(groups, key=groups.get)


def kernel_group(name: str, cat: str = "kernel") -> str:
    """The group of one GPU event: memcpy/memset by category, else roofline_report's group of the kernel name, with
    torch sampling's RNG / sort / cumsum kernels in logits/sampling."""
    if cat != "kernel":
        return COPY_GROUP
    group = _roofline_group(name)
    return SAMPLING if group == "other" and _MORE_SAMPLING_RE.search(name) else group


def step_groups(events: list[dict], layers: int) -> dict[str, float]:
    """GPU microseconds of one step by group (GROUPS order); the longest launch of a GEMM kernel launched layers x n + 1
    times in the step is lm_head's (logits/sampling), as in roofline_report.kernel_groups."""
    kernels: dict[str, dict] = {}
    for e in events:
        if e["cat"] == "kernel":
            k = kernels.setdefault(e["name"], {"us": 0.0, "n": 0, "top_us": []})
            k["us"] += e["dur"]
            k["n"] += 1
            k["top_us"].append(e["dur"])
    groups = RP.kernel_groups(kernels, 1, layers)
    moved = sum(k["us"] for n, k in kernels.items() if kernel_group(n) == SAMPLING and _roofline_group(n) == "other")
    groups["other"] -= moved
    groups[SAMPLING] += moved
    groups[COPY_GROUP] = sum(e["dur"] for e in events if e["cat"] != "kernel")
    return {g: groups[g] for g in GROUPS}


# ----------------------------------------------------------------------------------------------------------------
# steps
# ----------------------------------------------------------------------------------------------------------------

def step_records(markers: list[dict], buckets: list[list[dict]], layers: int) -> list[dict]:
    """One record per complete step (marker k to marker k + 1) with its GPU events' timing and groups."""
    firsts = [min((e["ts"] for e in b), default=None) for b in buckets]
    out = []
    for k in range(len(markers) - 1):
        start, nxt = firsts[k], firsts[k + 1]
        period = nxt - start if start is not None and nxt is not None else None
        busy = busy_us(buckets[k])
        out.append({"label": markers[k]["name"], "start_us": markers[k]["ts"],
                    "wall_us": markers[k + 1]["ts"] - markers[k]["ts"], "gpu_start_us": start,
                    "gpu_end_us": max((e["end"] for e in buckets[k]), default=None), "gpu_period_us": period,
                    "gpu_busy_us": busy, "gpu_idle_us": None if period is None else period - busy,
                    "gpu_events": len(buckets[k]), "groups_us": step_groups(buckets[k], layers)})
    return out


def select_steps(records: list[dict], kind: Optional[str], batch: Optional[int] = None) -> list[dict]:
    """The steps to summarize: with SGLang's step annotations the DECODE ones, and of those the ones at bs == batch
    when there are any; every step for the other marker kinds."""
    if kind != STEP_ANNOTATION:
        return list(records)
    decode = [r for r in records if r["label"].startswith("step[DECODE")]
    full = [r for r in decode if batch is not None and r["label"] == f"step[DECODE bs={batch}]"]
    return full or decode


def _stat(values: list, fn) -> Optional[float]:
    values = [v for v in values if v is not None]
    return fn(values) if values else None


def summarize_steps(steps: list[dict]) -> dict:
    """Medians and means of wall, GPU period, busy, idle; GPU idle share of the periods; mean GPU us per group."""
    out: dict = {"n": len(steps)}
    for key in ("wall_us", "gpu_period_us", "gpu_busy_us", "gpu_idle_us"):
        vals = [s[key] for s in steps]
        out[f"median_{key}"], out[f"mean_{key}"] = _stat(vals, statistics.median), _stat(vals, statistics.fmean)
    timed = [s for s in steps if s["gpu_period_us"]]
    period = sum(s["gpu_period_us"] for s in timed)
    out["idle_share"] = sum(s["gpu_idle_us"] for s in timed) / period if period else None
    out["groups_us"] = {g: statistics.fmean(s["groups_us"][g] for s in steps) if steps else 0.0 for g in GROUPS}
    return out


def step_window(steps: list[dict]) -> Optional[tuple[float, float]]:
    """The GPU window of the steps: first step's first GPU start to the last one's period end (else its last end)."""
    starts = [s["gpu_start_us"] for s in steps if s["gpu_start_us"] is not None]
    if not starts:
        return None
    last = steps[-1]
    end = last["gpu_start_us"] + last["gpu_period_us"] if last["gpu_period_us"] is not None else last["gpu_end_us"]
    return (min(starts), end) if end is not None else None


# ----------------------------------------------------------------------------------------------------------------
# top kernels, top host ops
# ----------------------------------------------------------------------------------------------------------------

def top_kernels(gpu: list[dict], n: int = 20) -> list[dict]:
    """The n GPU kernels (and copies) of most total time: name, group, calls, total us, share of all GPU event time."""
    agg: dict[str, dict] = {}
    for e in gpu:
        k = agg.setdefault(e["name"], {"name": e["name"], "group": kernel_group(e["name"], e["cat"]), "calls": 0,
                                       "total_us": 0.0})
        k["calls"] += 1
        k["total_us"] += e["dur"]
    total = sum(k["total_us"] for k in agg.values())
    rows = sorted(agg.values(), key=lambda k: (-k["total_us"], k["name"]))[:n]
    return [dict(k, share=k["total_us"] / total if total else None) for k in rows]


def host_self_us(host: list[dict]) -> list[tuple[dict, float]]:
    """(event, self us) per host event: its duration less that of the events nested in it on its pid / tid (the
    events sorted by start, longest first)."""
    stacks: dict[tuple, list[list]] = {}
    out: list[list] = []
    for e in host:
        stack = stacks.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1][0]["end"] <= e["ts"]:
            stack.pop()
        if stack:
            stack[-1][1] -= min(e["end"], stack[-1][0]["end"]) - e["ts"]
        rec = [e, e["dur"]]
        stack.append(rec)
        out.append(rec)
    return [(e, s) for e, s in out]


def top_host_ops(events: list[dict], window: Optional[tuple[float, float]], n: int = 20) -> list[dict]:
    """The n host ops of most self time among those starting inside window: name, category, calls, self us, total us."""
    if window is None:
        return []
    agg: dict[tuple, dict] = {}
    for e, self_us in host_self_us([e for e in events if e["cat"] in HOST_CATS]):
        if window[0] <= e["ts"] < window[1]:
            k = agg.setdefault((e["name"], e["cat"]), {"name": e["name"], "cat": e["cat"], "calls": 0, "self_us": 0.0,
                                                       "total_us": 0.0})
            k["calls"] += 1
            k["self_us"] += self_us
            k["total_us"] += e["dur"]
    return sorted(agg.values(), key=lambda k: (-k["self_us"], k["name"]))[:n]


# ----------------------------------------------------------------------------------------------------------------
# the whole analysis
# ----------------------------------------------------------------------------------------------------------------

def analyze(trace: dict, batch: Optional[int] = None, layers: int = 36, gap_us: float = 50.0,
            cluster_gap_us: float = 100.0, top: int = 20) -> dict:
    """Steps, GPU timeline over the summarized steps, top kernels and top host ops of one trace (see the module)."""
    events = complete_events(trace)
    gpu = [e for e in events if e["cat"] in GPU_CATS]
    kind, markers = find_markers(events)
    launch = launch_times(events)
    if kind is None:
        kind, markers, launch = CLUSTERS, cluster_markers(gpu, cluster_gap_us), {}
    buckets = assign_to_steps(gpu, [m["ts"] for m in markers], launch)
    records = step_records(markers, buckets, layers)
    steps = select_steps(records, kind, batch)
    window = step_window(steps)
    in_window = [e for e in gpu if window and e["end"] > window[0] and e["ts"] < window[1]]
    host_window = (steps[0]["start_us"], steps[-1]["start_us"] + steps[-1]["wall_us"]) if steps else None
    return {"marker": kind, "markers": len(markers), "steps_found": len(records),
            "labels": sorted({r["label"] for r in records}), "gpu_events": len(gpu),
            "summary": summarize_steps(steps),
            "timeline": gpu_timeline(in_window, window, gap_us) if window else gpu_timeline([], None, gap_us),
            "top_kernels": top_kernels(in_window, top), "top_host_ops": top_host_ops(events, host_window, top),
            "steps": steps}


# ----------------------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------------------

def _ms(us: Optional[float], fmt: str = "{:.2f}") -> str:
    return "—" if us is None else fmt.format(us / 1e3)


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def side_by_side(records: dict[str, dict]) -> list[str]:
    """One table row per config: step wall, GPU period / busy / idle, server log steps, GPU ms per group."""
    head = ["config", "steps", "step wall ms", "GPU period ms", "GPU busy ms", "GPU idle ms", "GPU idle share",
            "server log step ms (unprofiled / profiled)", *(f"{g} ms" for g in GROUPS)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, rec in records.items():
        s = (rec.get("analysis") or {}).get("summary")
        if not s:
            lines.append(f"| {name} | {rec.get('status')} |" + " — |" * (len(head) - 2))
            continue
        log = rec.get("log") or {}
        logs = " / ".join("—" if (log.get(k) or {}).get("median_step_ms") is None else
                          f"{log[k]['median_step_ms']:.2f}" for k in ("unprofiled", "profiled"))
        lines.append(f"| {name} | {s['n']} | {_ms(s['median_wall_us'])} | {_ms(s['median_gpu_period_us'])} | "
                     f"{_ms(s['median_gpu_busy_us'])} | {_ms(s['median_gpu_idle_us'])} | {_pct(s['idle_share'])} | "
                     f"{logs} | " + " | ".join(_ms(s["groups_us"][g], "{:.3f}") for g in GROUPS) + " |")
    return lines


def config_section(name: str, rec: dict) -> list[str]:
    """One config: markers, timeline and gaps, groups per step, top kernels, top host ops."""
    a = rec.get("analysis")
    lines = [f"### {name}", f"`{' '.join(rec.get('flags') or []) or '(SGLang defaults)'}`; {rec.get('status')}; "
             f"start {rec.get('start_s', '—')} s; trace {rec.get('trace', '—')}"]
    if not a:
        return lines
    s, t, g = a["summary"], a["timeline"], a["timeline"]["gaps"]
    n = max(1, s["n"])
    lines += [f"steps: {s['n']} summarized of {a['steps_found']} between {a['markers']} markers ({a['marker']}; "
              f"labels {', '.join(a['labels'][:4])}); median step wall {_ms(s['median_wall_us'])} ms, GPU busy "
              f"{_ms(s['median_gpu_busy_us'])} ms, GPU idle {_ms(s['median_gpu_idle_us'])} ms "
              f"({_pct(s['idle_share'])} of the GPU periods)",
              f"GPU timeline over the steps: {_ms(t['window_us'])} ms, busy {_ms(t['busy_us'])} ms, idle "
              f"{_ms(t['idle_us'])} ms ({_pct(t['idle_fraction'])}); gaps > {g['threshold_us']:g} us: {g['count']} "
              f"({g['count'] / n:.1f} per step), {_ms(g['total_us'])} ms in all ({_ms(g['total_us'] / n, '{:.3f}')} "
              f"ms per step), median {_ms(g['median_us'], '{:.3f}')} ms, longest {_ms(g['longest_us'], '{:.3f}')} ms",
              "", "| group | ms per step (mean) | share of the step's GPU event time |", "| --- | --- | --- |"]
    total = sum(s["groups_us"].values())
    lines += [f"| {grp} | {_ms(us, '{:.3f}')} | {_pct(us / total if total else None)} |"
              for grp, us in s["groups_us"].items()]
    return lines + top_tables(a) + [""]


def top_tables(a: dict) -> list[str]:
    """The top GPU kernels table and, when the trace has host events, the top host ops table."""
    lines = ["", "| # | GPU kernel | group | calls | ms in all | share |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {i} | `{k['name'][:110]}` | {k['group']} | {k['calls']} | {_ms(k['total_us'], '{:.3f}')} | "
              f"{_pct(k['share'])} |" for i, k in enumerate(a["top_kernels"], 1)]
    if a["top_host_ops"]:
        lines += ["", "| host op | category | calls | self ms | total ms |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{h['name'][:110]}` | {h['cat']} | {h['calls']} | {_ms(h['self_us'], '{:.3f}')} | "
                  f"{_ms(h['total_us'], '{:.3f}')} |" for h in a["top_host_ops"]]
    return lines


def format_report(records: dict[str, dict], meta: dict) -> str:
    """The .md: header, the side-by-side table, one section per config."""
    lines = [f"## Served decode step profile: {meta.get('model', '')}, {meta.get('workload', '')}",
             f"device: {meta.get('device', '?')}; {meta.get('versions', '')}", ""]
    lines += side_by_side(records)
    lines += ["", "step wall: marker to marker (one scheduler iteration); GPU period: the step's first GPU start to "
              "the next one's; GPU busy: union of its GPU events; GPU idle = period - busy; groups: mean GPU event "
              "time per step (streams may overlap, so they can sum above busy). Server log step ms: median of the "
              "scheduler's decode lines at the full batch before /start_profile and while it recorded.", ""]
    for name, rec in records.items():
        lines += config_section(name, rec)
    return "\n".join(lines)
