"""A few buckets of a weight update under SGLang's profiler: where an engine's time goes, per tensor.

``bench_update.py --profile-buckets N`` calls :func:`profile_push` after the timed pushes of ``--profile-path`` on
each engine: ``POST /start_profile`` (CPU and GPU activities, Python stacks, so that this package's functions appear
as ``python_function`` events), the N buckets of the payload holding the most tensors (a model's first buckets
hold its largest tensors one by one: the embedding, the LM head) pushed in payload order as the telemetry push
sends them (``atomic=False``), ``POST /stop_profile``, then TP rank 0's trace read with
``scripts/gpu/step_trace.py``: the wall time and tensors of the pushed buckets, the GPU's busy time and top
kernels, the host events of most self time, and the inclusive time of the functions of ``sglang_fp8rl`` and of
SGLang's update handlers. The profiler slows the host down (Python stack tracing): the shares, not the absolute
times, are the result.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any, Optional

PACKAGE_MARK = "sglang_fp8rl/"  # python_function events of this package's files
SGLANG_UPDATE_MARK = "update_weights"  # SGLang's handlers on the update's way (tokenizer manager, scheduler, runner)
TOP = 25


def profile_body(prof_dir: str, profile_id: str) -> dict:
    """The /start_profile body (SGLang's ProfileReq fields, 0.5.12-0.5.23): recording until /stop_profile."""
    return {"output_dir": prof_dir, "activities": ["CPU", "GPU"], "with_stack": True, "record_shapes": False,
            "profile_id": profile_id}


def rank0_trace(prof_dir: str, timeout_s: float, settle_s: float = 5.0) -> Optional[str]:
    """TP rank 0's trace file once its size has held for settle_s (SGLang writes it after /stop_profile)."""
    from server_io import settled_file

    return settled_file(os.path.join(prof_dir, "*TP-0*.trace.json*"), timeout_s, settle_s)


def function_totals(events: list[dict], mark: str, n: int = TOP) -> list[dict]:
    """Calls and inclusive time of the python_function events whose name holds ``mark`` (recursion counted once: an
    event nested in one of the same name is skipped)."""
    agg: dict[str, dict] = {}
    open_until: dict[tuple, float] = {}
    for e in events:
        if e["cat"] != "python_function" or mark not in e["name"]:
            continue
        key = (e["pid"], e["tid"], e["name"])
        rec = agg.setdefault(e["name"], {"name": e["name"], "calls": 0, "total_us": 0.0})
        rec["calls"] += 1
        if e["ts"] >= open_until.get(key, float("-inf")):
            rec["total_us"] += e["dur"]
            open_until[key] = e["end"]
    return sorted(agg.values(), key=lambda r: (-r["total_us"], r["name"]))[:n]


def summarize(trace: dict, tensors: int, wall_s: float) -> dict:
    """Per-tensor reading of one profiled push (the events of the trace's whole span)."""
    import step_trace as ST

    events = ST.complete_events(trace)
    if not events:
        return {"error": "the trace holds no complete events"}
    window = (min(e["ts"] for e in events), max(e["end"] for e in events))
    gpu = [e for e in events if e["cat"] in ST.GPU_CATS]
    return {
        "tensors": tensors, "wall_s": wall_s, "wall_us_per_tensor": wall_s * 1e6 / max(tensors, 1),
        "trace_span_s": (window[1] - window[0]) / 1e6, "gpu_busy_s": ST.busy_us(gpu) / 1e6,
        "top_kernels": ST.top_kernels(gpu, 10),
        "top_host": ST.top_host_ops(events, (window[0], window[1] + 1), TOP),
        "package_functions": function_totals(events, PACKAGE_MARK),
        "sglang_update_functions": function_totals(events, SGLANG_UPDATE_MARK, 10),
    }


def most_tensors(all_buckets: list, n: int) -> list:
    """The n buckets holding the most tensors (the earlier of equal ones), in their payload order."""
    ranked = sorted(range(len(all_buckets)), key=lambda i: (-len(all_buckets[i]), i))[:n]
    return [all_buckets[i] for i in sorted(ranked)]


def profile_push(url: str, weights: dict, bucket_bytes: int, flatten: bool, n_buckets: int, prof_dir: str,
                 profile_id: str, timeout_s: float = 180.0) -> dict:
    """The n_buckets buckets of ``weights`` with the most tensors pushed under the profiler; :func:`summarize` of
    rank 0's trace."""
    import requests
    from kernel_trace import load_trace
    from update_bench_server import push_one_bucket

    from sglang_fp8rl.weight_sync.buckets import buckets

    os.makedirs(prof_dir, exist_ok=True)
    for old in glob.glob(os.path.join(prof_dir, "*.trace.json*")):
        os.remove(old)
    chosen = most_tensors(list(buckets(weights, bucket_bytes)), n_buckets)
    r = requests.post(url + "/start_profile", json=profile_body(prof_dir, profile_id), timeout=60)
    if r.status_code != 200:
        return {"error": f"/start_profile: HTTP {r.status_code}: {r.text.strip()[:200]}"}
    t0 = time.time()
    try:
        for bucket in chosen:
            push_one_bucket(url, bucket, flatten)
    finally:
        wall = time.time() - t0
        requests.post(url + "/stop_profile", timeout=timeout_s)
    path = rank0_trace(prof_dir, timeout_s)
    if path is None:
        return {"error": f"no TP-0 trace in {prof_dir} within {timeout_s:.0f} s", "wall_s": wall}
    rec = summarize(load_trace(path), sum(len(b) for b in chosen), wall)
    rec.update(buckets=len(chosen), trace=os.path.basename(path), flatten=flatten)
    return rec


def format_profile(eng: str, path: str, rec: dict) -> list[str]:
    """Markdown lines of one engine's profiled push."""
    head = f"### profiled push: {eng}, {path}"
    if "error" in rec:
        return [head, "", f"not analysed: {rec['error']}", ""]
    lines = [head, "", f"{rec['buckets']} buckets, {rec['tensors']} tensors, {rec['wall_s']:.2f} s under the profiler "
             f"({rec['wall_us_per_tensor']:.0f} us a tensor); trace span {rec['trace_span_s']:.2f} s, GPU busy "
             f"{rec['gpu_busy_s']:.3f} s", ""]
    per = max(rec["tensors"], 1)
    for title, rows, key in (("host events by self time", rec["top_host"], "self_us"),
                             ("sglang_fp8rl functions, inclusive", rec["package_functions"], "total_us"),
                             ("SGLang's update handlers, inclusive", rec["sglang_update_functions"], "total_us"),
                             ("GPU kernels", rec["top_kernels"], "total_us")):
        lines += [f"| {title} | calls | ms | us a tensor |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{r['name'][:110]}` | {r['calls']} | {r[key] / 1e3:.1f} | {r[key] / per:.1f} |" for r in rows]
        lines.append("")
    return lines


def attach(bench: Any, eng: str, e: dict, url: str, weights: dict, phase_end: float) -> None:
    """bench_update's hook: profile ``--profile-path`` on this engine if asked and if time allows."""
    a = bench.args
    if not a.profile_buckets or time.time() + 120 >= phase_end:
        return
    path = a.profile_path
    e[f"profile_{path}"] = profile_push(url, weights, a.bucket_mb << 20, path == "flattened", a.profile_buckets,
                                        os.path.join(a.out, f"profile_{eng}_{path}"), f"{eng}_{path}",
                                        timeout_s=max(30.0, min(180.0, phase_end - time.time() - 30)))
    bench.save()
