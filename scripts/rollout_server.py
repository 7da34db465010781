"""One config of scripts/bench_rl_rollout.py on a live server: start it, submit the whole batch at once (one thread
per request, each one's completion time recorded), stop it, keep the log lines the report reads."""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout_report import keep_lines, say
from rollout_workload import request_body

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def submit_all(base_url: str, workload: dict, timeout_s: float, on_timeout: Callable[[], None] | None = None,
               progress_s: float = 15.0) -> tuple[list[dict], float]:
    """Every request at once (one thread each); per request its completion time from submit; (requests, run s).

    After timeout_s, on_timeout() is called (stopping the server ends the requests still open)."""
    import requests

    ids, max_new = workload["input_ids"], workload["max_new_tokens"]
    n = len(ids)
    out: list[dict | None] = [None] * n
    gate = threading.Event()
    clock = {"t0": 0.0}

    def one(i: int) -> None:
        gate.wait()
        rec: dict[str, Any] = {"i": i, "max_new_tokens": max_new[i], "ok": False}
        try:
            r = requests.post(base_url + "/generate", json=request_body(ids[i], max_new[i]), timeout=timeout_s + 120)
            rec["done_s"] = time.perf_counter() - clock["t0"]
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                ans = r.json()
                meta = ans.get("meta_info") or {}
                rec["output_tokens"] = int(meta.get("completion_tokens") or len(ans.get("output_ids") or []))
                rec["finish"] = (meta.get("finish_reason") or {}).get("type")
                rec["ok"] = True
        except (requests.RequestException, ValueError) as e:
            rec["done_s"] = time.perf_counter() - clock["t0"]
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[i] = rec

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    clock["t0"] = time.perf_counter()
    gate.set()
    end, next_say = clock["t0"] + timeout_s, clock["t0"] + progress_s
    for th in threads:
        while th.is_alive() and time.perf_counter() < end:
            th.join(max(0.01, min(end, next_say) - time.perf_counter()))
            if time.perf_counter() >= next_say:
                say(f"  {sum(r is not None for r in out)}/{n} requests done after "
                    f"{time.perf_counter() - clock['t0']:.0f} s")
                next_say = time.perf_counter() + progress_s
    run_s = time.perf_counter() - clock["t0"]
    if any(th.is_alive() for th in threads):
        say(f"  run timeout after {timeout_s:.0f} s: {sum(r is not None for r in out)}/{n} done; stopping the server")
        if on_timeout:
            on_timeout()
        grace_end = time.perf_counter() + 30
        for th in threads:
            th.join(max(0.01, grace_end - time.perf_counter()))
    recs = [r if r is not None else {"i": i, "max_new_tokens": max_new[i], "ok": False,
                                     "error": f"not done within the run timeout ({timeout_s:.0f} s)"}
            for i, r in enumerate(out)]
    return recs, run_s


def fetch_server_info(base_url: str) -> dict:
    """/server_info (or the older /get_server_info) without internal_states; {} if neither answers."""
    import requests

    for route in ("/server_info", "/get_server_info"):
        try:
            r = requests.get(base_url + route, timeout=30)
            if r.status_code == 200:
                info = r.json()
                info.pop("internal_states", None)
                return info
        except (requests.RequestException, ValueError):
            continue
    return {}


def run_config(item: dict, log_path: str, workload: dict, start_timeout: float, run_timeout: float,
               deadline_at: float = math.inf) -> dict:
    """Start one server, wait until healthy, submit the batch, stop it; the config's record (see answers.json).

    The batch gets run_timeout seconds, fewer when deadline_at (time.time()) comes first."""
    from server_io import stop, url, wait_healthy  # scripts/gpu/server_io.py

    rec: dict[str, Any] = {"flags": item["flags"], "cmd": " ".join(item["cmd"]), "fa3_fallback": item["fa3_fallback"],
                           "requests": [], "status": "ok"}
    t0 = time.time()
    env = dict(os.environ, **item["env"])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(item["cmd"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    offset = 0
    try:
        rec["start_s"] = round(wait_healthy(item["port"], proc, start_timeout), 1)
        rec["server_info"] = fetch_server_info(url(item["port"]))
        offset = os.path.getsize(log_path)
        budget = max(10.0, min(run_timeout, deadline_at - time.time() - 20))
        say(f"{item['name']}: healthy after {rec['start_s']:.0f} s; submitting {len(workload['input_ids'])} requests "
            f"(run timeout {budget:.0f} s)")
        reqs, run_s = submit_all(url(item["port"]), workload, budget, on_timeout=lambda: stop(proc))
        rec["requests"], rec["run_s"] = reqs, round(run_s, 1)
        if not all(r["ok"] for r in reqs):
            rec["status"] = f"{sum(not r['ok'] for r in reqs)} requests failed or timed out"
    except (RuntimeError, TimeoutError) as e:
        rec["status"] = f"server did not start: {e}"
    finally:
        stop(proc)
    rec["wall_s"] = round(time.time() - t0, 1)
    with open(log_path, "rb") as f:
        raw = f.read()
    startup, run = raw[:offset].decode(errors="replace"), raw[offset:].decode(errors="replace")
    if not offset:
        startup, run = run, ""
    rec["startup_log"], rec["run_log"] = keep_lines(startup), keep_lines(run)
    if rec.get("start_s") is None:
        rec["log_tail"] = [ln[:300] for ln in startup.splitlines() if ln.strip()][-25:]
    return rec


def skipped_record(item: dict) -> dict:
    """The record of a config the deadline left no time for."""
    return {"flags": item["flags"], "status": "skipped (deadline)", "requests": []}
