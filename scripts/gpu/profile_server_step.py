#!/usr/bin/env python3
"""Profile a served decode step: where the server step's time goes beyond the kernels decode_roofline.py counts.

Per config (--configs, bench_rl_rollout.py's CONFIGS; default bf16 fp8_kv), one after another on one GPU: the stock
`python -m sglang.launch_server` with bench_rl_rollout.py's command line and environment (its COMMON_FLAGS: dummy
Qwen3-8B-shaped weights of scripts/gpu/make_models.py, --skip-tokenizer-init, --sampling-backend pytorch,
--decode-log-interval 1, ...; the plugin through its entry point). Then --batch requests at once, each --prompt-len
random token ids (or one request per --prompt-lens entry: ragged contexts, as a rollout's tail), --new-tokens tokens
at temperature 1 with ignore_eos (bench_rl_rollout's request body), sent from a thread. Once the server's decode log
lines show the whole batch running (--min-full-steps lines; at most --warmup-s seconds), POST /start_profile
{output_dir, num_steps: --steps, activities: CPU GPU, with_stack, record_shapes: false, profile_id: the config}
(SGLang 0.5.17's ProfileReq, sglang/srt/managers/io_struct.py:1973); the scheduler stops the torch profiler itself
after --steps forward steps and writes <config>-TP-0.trace.json.gz (scheduler_components/profiler_manager.py), then
logs "Profiling done". The server is stopped (the open requests end with it) and the trace analysed by
scripts/gpu/step_trace.py: step boundaries (SGLang's step[DECODE bs=N] annotation), per step wall / GPU busy / GPU
idle and GPU time by group, GPU idle gaps, top kernels and top host ops. The server's own decode log lines give the
step time without the profiler (before /start_profile) and under it.

Writes under --out: profile_server_step.json and .md, server_<config>.log, traces/<config>/*.trace.json.gz.
Every wait has a timeout and the whole run ends by --deadline-s (a config that cannot get --min-s is skipped; every
later config keeps --min-s of the deadline); servers are stopped in `finally`.

  python scripts/gpu/profile_server_step.py --out /tmp/prof --configs bf16 fp8_kv --gpu 0
  python scripts/gpu/profile_server_step.py --out /tmp/prof --configs fp8 --activities GPU   # no host markers
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
import _paths  # noqa: E402,F401  (scripts/gpu and the checkout on sys.path)
import bench_rl_rollout as RL  # noqa: E402  (scripts/bench_rl_rollout.py: configs, command lines)
import kernel_trace as KT  # noqa: E402  (scripts/kernel_trace.py: a profiler trace read)
import kv_measure as KV  # noqa: E402  (scripts/kv_measure.py: the FA3 import probe)
import rollout_regimes as RG  # noqa: E402  (scripts/rollout_regimes.py: step times of the decode log lines)
import rollout_server as SRV  # noqa: E402  (scripts/rollout_server.py: the batch submitted at once)
import rollout_workload as WL  # noqa: E402  (scripts/rollout_workload.py: random prompt ids)
import server_io  # noqa: E402  (scripts/gpu/server_io.py: health, URLs)
import step_trace as ST  # noqa: E402  (scripts/gpu/step_trace.py: the trace analysis)

REPO = RL.REPO
PROFILE_START, PROFILE_STOP, PROFILE_DONE = "Profiling starts", "Stop profiling", "Profiling done"


def say(msg: str) -> None:
    """One progress line on stdout."""
    print(f"[profile_server_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# the server's log
# ----------------------------------------------------------------------------------------------------------------

def log_windows(text: str) -> tuple[list[str], list[str]]:
    """The log lines before SGLang's 'Profiling starts' line and those between it and 'Stop profiling'."""
    before: list[str] = []
    during: list[str] = []
    state = 0
    for line in text.splitlines():
        if state == 0 and PROFILE_START in line:
            state = 1
        elif state == 1 and PROFILE_STOP in line:
            state = 2
        elif state < 2:
            (before if state == 0 else during).append(line)
    return before, during


def log_steps(lines: list[str], batch: int) -> dict:
    """Decode log lines: how many, running-request counts, and the step ms (median, mean) of those at the full batch."""
    steps = RG.decode_steps(lines)
    full = [1e3 * s for n, s in steps if n == batch]
    return {"decode_lines": len(steps), "running": sorted({n for n, _ in steps}), "full_batch_steps": len(full),
            "median_step_ms": statistics.median(full) if full else None,
            "mean_step_ms": statistics.fmean(full) if full else None}


def read_from(path: str, offset: int) -> str:
    """The file's text after byte offset ('' if it is not there)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def wait_for_full_batch(log_path: str, offset: int, batch: int, min_steps: int, timeout_s: float) -> int:
    """Poll the log until min_steps decode lines at #running-req == batch appeared after offset, or timeout_s passed;
    returns how many there were."""
    end, seen = time.time() + timeout_s, 0
    while True:
        seen = log_steps(read_from(log_path, offset).splitlines(), batch)["full_batch_steps"]
        if seen >= min_steps or time.time() >= end:
            return seen
        time.sleep(0.25)


def wait_for_trace(prof_dir: str, log_path: str, offset: int, timeout_s: float) -> Optional[str]:
    """The trace file once the log says 'Profiling done' (or its size held for 10 s); None after timeout_s."""
    return server_io.settled_file(os.path.join(prof_dir, "*.trace.json*"), timeout_s, 10.0,
                                  lambda: PROFILE_DONE in read_from(log_path, offset))


# ----------------------------------------------------------------------------------------------------------------
# one config
# ----------------------------------------------------------------------------------------------------------------

def server_plan(args: argparse.Namespace, model_path: str) -> list[dict]:
    """bench_rl_rollout's plan (name, flags, port, command, env) for the configs; on triton where FA3 does not import
    (as bench_rl_rollout does), on --gpu when given."""
    ns = argparse.Namespace(configs=args.configs, extra_args=args.extra_args, port_base=args.port_base,
                            seed=args.seed, mem_fraction_static=args.mem_fraction_static)
    plan = RL.build_plan(ns, model_path)
    if any(RL.attention_backend(p["flags"]) is None for p in plan):
        ok, why = KV.fa3_available(sys.executable, timeout_s=90)
        if not ok:
            say(f"FlashAttention-3 does not import here ({why}); configs without --attention-backend run on triton")
            plan = RL.build_plan(ns, model_path, fa3_fallback=True)
    for item in plan:
        if args.gpu is not None:
            item["env"]["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    return plan


def profile_body(prof_dir: str, args: argparse.Namespace, profile_id: str) -> dict:
    """The /start_profile body (SGLang 0.5.17 ProfileReq fields): stop by itself after args.steps forward steps."""
    return {"output_dir": prof_dir, "num_steps": args.steps, "activities": list(args.activities),
            "with_stack": bool(args.with_stack), "record_shapes": False, "profile_id": profile_id}


def prompt_lengths(args: argparse.Namespace) -> list[int]:
    """Each request's prompt length: --prompt-lens (ragged contexts, as a rollout's tail runs them) or --batch x
    --prompt-len."""
    return list(args.prompt_lens) if args.prompt_lens else [args.prompt_len] * args.batch


def batch_workload(args: argparse.Namespace) -> dict:
    """The request batch: random prompt ids of prompt_lengths, --new-tokens each."""
    lens = prompt_lengths(args)
    return {"input_ids": WL.prompt_ids(len(lens), lens, args.seed), "max_new_tokens": [args.new_tokens] * len(lens)}


def start_requests(base_url: str, args: argparse.Namespace, timeout_s: float) -> tuple[threading.Thread, dict]:
    """The batch in a thread (bench_rl_rollout.submit_all: one request thread each, temperature 1, ignore_eos); the
    dict gets 'requests' when they end."""
    workload = batch_workload(args)
    box: dict[str, Any] = {}

    def run() -> None:
        box["requests"], box["run_s"] = SRV.submit_all(base_url, workload, timeout_s)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def stop_server(proc: subprocess.Popen, deadline_at: float) -> None:
    """server_io.stop with its grace cut to the time left before deadline_at."""
    server_io.stop(proc, grace_s=max(5.0, min(60.0, deadline_at - time.time() - 15)))


def _left(deadline_at: float, reserve: float = 0.0, lo: float = 1.0, hi: float = float("inf")) -> float:
    """Seconds to deadline_at less reserve, kept within [lo, hi]."""
    return max(lo, min(hi, deadline_at - time.time() - reserve))


def profile_running_server(item: dict, args: argparse.Namespace, out: str, log_path: str, offset: int, rec: dict,
                           deadline_at: float) -> None:
    """With the batch sent (log from byte offset on): wait for it to decode, profile, analyse; fills rec (status 'ok'
    once a trace is analysed)."""
    import requests

    seen = wait_for_full_batch(log_path, offset, args.batch, args.min_full_steps,
                               _left(deadline_at, 30, lo=0.0, hi=args.warmup_s))
    rec["warmup_full_batch_steps"] = seen
    say(f"{item['name']}: {seen} decode steps at {args.batch} running; /start_profile for {args.steps} steps")
    prof_dir = os.path.join(out, "traces", item["name"])
    for old in glob.glob(os.path.join(prof_dir, "*.trace.json*")):
        os.remove(old)
    os.makedirs(prof_dir, exist_ok=True)
    r = requests.post(server_io.url(item["port"]) + "/start_profile", json=profile_body(prof_dir, args, item["name"]),
                      timeout=_left(deadline_at, 20, lo=5.0, hi=120.0))
    rec["start_profile"] = f"HTTP {r.status_code}: {r.text.strip()[:200]}"
    if r.status_code != 200:
        rec["status"] = f"/start_profile failed: {rec['start_profile']}"
        return
    path = wait_for_trace(prof_dir, log_path, offset, _left(deadline_at, 20, lo=5.0, hi=args.trace_timeout_s))
    before, during = log_windows(read_from(log_path, offset))
    rec["log"] = {"unprofiled": log_steps(before, args.batch), "profiled": log_steps(during, args.batch)}
    rec["log_lines"] = [ln.strip()[:300] for ln in during if RG.decode_steps([ln])]
    if path is None:
        rec["status"] = "no trace file before the timeout"
        return
    rec["trace"] = os.path.relpath(path, out)
    rec["analysis"] = ST.analyze(KT.load_trace(path), batch=args.batch, layers=args.layers, gap_us=args.gap_us,
                                 cluster_gap_us=args.cluster_gap_us, top=args.top)
    rec["status"] = "ok"


def run_config(item: dict, args: argparse.Namespace, out: str, deadline_at: float) -> dict:
    """Start one server, send the batch, profile its decode steps, stop it; the config's record."""
    rec: dict[str, Any] = {"flags": item["flags"], "cmd": " ".join(item["cmd"]), "status": "started",
                           "fa3_fallback": item["fa3_fallback"]}
    log_path = os.path.join(out, f"server_{item['name']}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(item["cmd"], stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **item["env"]),
                                cwd=REPO, start_new_session=True)
    th, box = None, {}
    try:
        rec["start_s"] = round(server_io.wait_healthy(item["port"], proc, _left(deadline_at, 60, lo=10.0,
                                                                                hi=args.start_timeout)), 1)
        say(f"{item['name']}: healthy after {rec['start_s']:.0f} s; sending {args.batch} requests")
        offset = os.path.getsize(log_path)
        th, box = start_requests(server_io.url(item["port"]), args, _left(deadline_at, lo=10.0))
        profile_running_server(item, args, out, log_path, offset, rec, deadline_at)
    except Exception as e:  # noqa: BLE001  (a failed config must not cost the others; the reason is recorded)
        rec["status"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        stop_server(proc, deadline_at)
    if th is not None:
        th.join(_left(deadline_at, 5, hi=30.0))
    reqs = box.get("requests") or []
    rec["requests"] = {"sent": args.batch if th else 0, "finished": sum(bool(q.get("ok")) for q in reqs)}
    if rec["status"] != "ok":
        rec["log_tail"] = [ln[:300] for ln in read_from(log_path, 0).splitlines() if ln.strip()][-25:]
        print("\n".join("    " + ln for ln in rec["log_tail"]), flush=True)
    return rec


# ----------------------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------------------

def write_outputs(out: str, records: dict[str, dict], meta: dict) -> str:
    """profile_server_step.json and .md under out; returns the report text."""
    text = ST.format_report(records, meta)
    with open(os.path.join(out, "profile_server_step.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "profile_server_step.json"), "w") as f:
        json.dump({"meta": meta, "configs": records}, f, indent=1, default=str)
    return text


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--configs", nargs="+", default=["bf16", "fp8_kv"], choices=list(RL.CONFIGS), metavar="CONFIG",
                   help=f"bench_rl_rollout.py's configs, run in this order: {', '.join(RL.CONFIGS)} "
                        "(default: %(default)s)")
    p.add_argument("--model", choices=RL.MODELS, default="qwen3-8b")
    p.add_argument("--model-dir", default="/tmp/fp8rl_models", help="dummy model folders (made if missing)")
    p.add_argument("--out", default="/tmp/fp8rl_profile_server_step")
    p.add_argument("--gpu", type=int, default=None, help="CUDA_VISIBLE_DEVICES of the servers (default: inherited)")
    p.add_argument("--batch", type=int, default=8, help="requests sent at once")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None, metavar="N",
                   help="one prompt length per request (ragged contexts); sets --batch to their count")
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30, help="forward steps the profiler records")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="longest wait for --min-full-steps decode lines at the full batch (the wait ends as soon as "
                        "they are there, ~2-3 s on a warm server; a prefill that JIT-compiles kernels takes longer); "
                        "the profile starts then even without them")
    p.add_argument("--min-full-steps", type=int, default=20,
                   help="decode log lines at the full batch to see before profiling (the unprofiled step time)")
    p.add_argument("--activities", nargs="+", default=["CPU", "GPU"], choices=["CPU", "GPU"])
    p.add_argument("--with-stack", action="store_true", help="Python frames in the trace (more profiler overhead)")
    p.add_argument("--gap-us", type=float, default=50.0, help="GPU idle gaps longer than this are listed")
    p.add_argument("--cluster-gap-us", type=float, default=100.0,
                   help="fallback step boundaries: GPU idle gaps at least this long")
    p.add_argument("--top", type=int, default=20, help="rows of the top kernels / host ops tables")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (lm_head rule; default: the config.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-args", nargs="+", action="extend", default=[], metavar="CONFIG=FLAGS",
                   help="extra launch_server flags, as bench_rl_rollout.py's")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--port-base", type=int, default=30400)
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--trace-timeout-s", type=float, default=120, help="longest wait for the trace file")
    p.add_argument("--deadline-s", type=float, default=400, help="wall budget of the whole run")
    p.add_argument("--min-s", type=float, default=150, help="skip a config with less than this left")
    a = p.parse_args(argv)
    if min(a.batch, a.prompt_len, a.new_tokens, a.steps) < 1:
        p.error("--batch, --prompt-len, --new-tokens and --steps must be positive")
    if a.prompt_lens:
        if min(a.prompt_lens) < 1:
            p.error(f"--prompt-lens must be positive, got {a.prompt_lens}")
        a.batch = len(a.prompt_lens)
    try:
        RL.parse_extra_args(a.extra_args, RL.CONFIGS)
    except ValueError as e:
        p.error(str(e))
    return a


def prompt_desc(args: argparse.Namespace) -> str:
    """'8 requests x 4096' or '4 requests of 16000, 2000, 2000, 1000'."""
    if args.prompt_lens:
        return f"{args.batch} requests of {', '.join(map(str, args.prompt_lens))}"
    return f"{args.batch} requests x {args.prompt_len}"


def model_layers(model_path: str) -> int:
    """num_hidden_layers of the model folder's config.json (36 if unreadable)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return int(json.load(f)["num_hidden_layers"])
    except (OSError, ValueError, KeyError):
        return 36


def main(argv: Optional[list[str]] = None) -> int:
    """Profile each config in turn; write the report."""
    args = parse_args(argv)
    deadline_at = time.time() + args.deadline_s
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    import make_models  # scripts/gpu/make_models.py

    model_path = make_models.ensure(os.path.abspath(args.model_dir), [args.model])[0]
    args.layers = args.layers or model_layers(model_path)
    meta = {"model": f"{args.model}-shaped dummy weights ({args.layers} layers)", "argv": sys.argv,
            "workload": f"{prompt_desc(args)} random prompt ids, {args.new_tokens} new tokens, "
                        f"temperature 1, ignore_eos; {args.steps} profiled steps ({' '.join(args.activities)})",
            **RL.BR._env_info()}
    plan = server_plan(args, model_path)
    records: dict[str, dict] = {}
    for k, item in enumerate(plan):
        cfg_deadline = deadline_at - args.min_s * (len(plan) - 1 - k)
        if cfg_deadline - time.time() < args.min_s:
            say(f"SKIP {item['name']}: only {cfg_deadline - time.time():.0f} s left")
            records[item["name"]] = {"flags": item["flags"], "status": "skipped (deadline)"}
            continue
        say(f"run {item['name']}: {' '.join(item['cmd'][3:])}")
        records[item["name"]] = run_config(item, args, out, cfg_deadline)
        say(f"{item['name']}: {records[item['name']]['status']}")
        write_outputs(out, records, meta)
    text = write_outputs(out, records, meta)
    print("\n" + text, flush=True)
    return 0 if all(r.get("status") == "ok" for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
