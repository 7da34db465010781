#!/usr/bin/env python3
"""GPU check of verl's colocated weight sync (issue 36, item 6) on the stock server with `--quantization
fp8_online_blockwise --kv-cache-dtype fp8_e4m3 --enable-memory-saver`, once without and once with
`--enable-weights-cpu-backup` (verl 0.9.1's colocated default):

  python3 scripts/gpu/check_colocated.py --model-dir /tmp/fp8rl_suite/models --out /tmp/fp8rl_suite/colocated
  ... --passes backup        one pass only
  ... --dry-run              print the plan (servers, flags, steps) and exit; no GPU
  ... --report-from FILE     rebuild the verdicts and the report from a recorded check_colocated.json; no GPU

Per pass, server A starts on qwen3-small with dummy weights (W0) and runs verl's cycle, this process being the
trainer on the same GPU (CUDA IPC): generate -> /release_memory_occupation (kv_cache, weights) -> a push and a
generation, both refused -> /resume_memory_occupation (weights) -> W1 pushed by tensor in plain buckets and an
explicit /flush_cache (verl's sync) -> /resume_memory_occupation (kv_cache) -> generate. One cold server, started on
W1 from disk with A's flags and A's GEMM choices, is the reference. Checks per pass: each step's answer and the
engine's fp8rl state (/get_server_info: released tags, consistency, the KV recalibration waiting for the KV cache);
then every parameter and buffer bit-identical to the cold start (SGLang's /weights_checker checksums: raw bytes for
this method), the FP8 parameter pointers unchanged, the KV scales equal to the cold start's calibration, the greedy
tokens and logprobs equal to the cold start's.
Writes OUT/check_colocated.json (the observations and the checks, after every server) and OUT/summary.md; prints the
PASS/FAIL table last. Exit 0 when every check passed, 1 otherwise, 2 without CUDA. Three server starts for both
passes (first pass, the cold reference, second pass; --deadline-s skips what would not fit): estimated 3-4 minutes on
a warm H100 and 6-7 minutes on a fresh one, where the first start measures the GEMMs and compiles (check_server.py's
first start took 190-220 s there); not measured yet.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import time
from typing import Any, Optional

import requests
from colocated_checks import PASSES, RELEASED, pass_checks
from server_io import alive, common_flags, fp8rl_info, generate, launch, stop, url, wait_healthy
from server_report import Check, not_run, table
from server_report import write_report as write_checks

MODEL = "qwen3-small"
KV_FLAGS = ("--kv-cache-dtype", "fp8_e4m3", "--enable-memory-saver")
SAME_GEMMS = ("--fp8rl-gemm-select", "cache")  # the cold server takes the GEMM kernels server A measured
MIN_SERVER_S = 120  # a server start and its steps, warm (a first start on a fresh machine takes up to ~220 s)
STEPS = ["generate (W0)", "release kv_cache + weights", "push W1 (refused)", "generate (refused)",
         "resume weights", "push W1 by tensor + /flush_cache", "resume kv_cache", "generate", "/weights_checker"]


def plan(args: argparse.Namespace) -> dict:
    """The servers of a run: their launch flags and what runs on them."""
    servers = {f"A ({name})": {"flags": ["--load-format", "dummy", *KV_FLAGS, *PASSES[name]], "steps": STEPS}
               for name in args.passes}
    servers["cold (W1 from disk)"] = {"flags": [*KV_FLAGS, *SAME_GEMMS], "steps": ["generate", "/weights_checker"]}
    return {"model": MODEL, "common_flags": list(common_flags()), "passes": args.passes, "servers": servers}


# ---------------------------------------------------------------------------------------------------------------------
# HTTP


def memory(port: int, route: str, tags: list[str]) -> dict:
    """POST /release_memory_occupation or /resume_memory_occupation with ``tags``: its HTTP status and text."""
    r = requests.post(url(port) + f"/{route}_memory_occupation", json={"tags": tags}, timeout=300)
    return {"status": r.status_code, "text": r.text[:300]}


def raw_generate(port: int, timeout: float = 60) -> dict:
    """One small generation, answered or not: its HTTP status and text (status None when nothing came)."""
    try:
        r = requests.post(url(port) + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=timeout)
        return {"status": r.status_code, "text": r.text[:400]}
    except requests.RequestException as e:
        return {"status": None, "text": f"{type(e).__name__}: {e}"}


def checksums(port: int) -> Optional[dict]:
    """Every parameter's and buffer's checksum per TP rank (SGLang's /weights_checker), or None where it has none."""
    try:
        body = requests.post(url(port) + "/weights_checker", json={"action": "checksum"}, timeout=300).json()
    except (requests.RequestException, ValueError):
        return None
    ranks = body.get("ranks") if isinstance(body, dict) else None
    return {str(i): rank.get("checksums") for i, rank in enumerate(ranks)} if ranks else None


def push(port: int, weights: Any) -> dict:
    """verl's sync by tensor: plain buckets (no validation round, no step marker), then an explicit /flush_cache."""
    from server_io import flush_cache

    from sglang_fp8rl.trainer import WeightPushError, push_state_dict

    t0 = time.perf_counter()
    try:
        answers = push_state_dict(url(port), weights, bucket_bytes=512 << 20, atomic=False, complete=False)
    except WeightPushError as e:
        return {"ok": False, "message": str(e), "seconds": round(time.perf_counter() - t0, 3)}
    flush_cache(port)
    return {"ok": True, "message": f"{len(answers)} requests answered success, cache flushed",
            "seconds": round(time.perf_counter() - t0, 3)}


# ---------------------------------------------------------------------------------------------------------------------
# observing a pass on the GPU


def observe_pass(args: argparse.Namespace, name: str, model: str, w1: dict, port: int) -> dict:
    """Server A through one colocated cycle (the module doc), every answer and state recorded; always stopped."""
    obs: dict = {"pass": name, "flags": plan(args)["servers"][f"A ({name})"]["flags"]}
    proc = launch(model, port, os.path.join(args.out, f"server_{name}.log"), *obs["flags"], env_extra=args.env)
    try:
        obs["startup_s"] = round(wait_healthy(port, proc, args.startup_timeout_s), 1)
        obs["info_start"], obs["outputs_w0"] = fp8rl_info(port), generate(port)
        obs["release"] = memory(port, "release", RELEASED)
        obs["info_released"] = fp8rl_info(port)
        obs["push_released"] = push(port, w1)
        obs["generate_released"] = raw_generate(port)
        obs["info_refused"] = fp8rl_info(port)
        obs["resume_weights"] = memory(port, "resume", ["weights"])
        obs["info_resumed"] = fp8rl_info(port)
        obs["push_w1"] = push(port, w1)
        obs["info_pushed"] = fp8rl_info(port)
        obs["resume_kv"] = memory(port, "resume", ["kv_cache"])
        obs["info_end"], obs["alive_end"] = fp8rl_info(port), alive(port)
        obs["outputs_end"], obs["checksums_end"] = generate(port), checksums(port)
    except (OSError, ValueError, RuntimeError, KeyError, TimeoutError) as e:  # requests' errors are OSErrors
        obs["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop(proc)
    return obs


def observe_cold(args: argparse.Namespace, folder: str, port: int) -> dict:
    """The cold reference: a server started on W1 from disk; its outputs, KV scales and checksums; always stopped."""
    obs: dict = {"flags": plan(args)["servers"]["cold (W1 from disk)"]["flags"]}
    proc = launch(folder, port, os.path.join(args.out, "server_cold.log"), *obs["flags"], env_extra=args.env)
    try:
        obs["startup_s"] = round(wait_healthy(port, proc, args.startup_timeout_s), 1)
        obs["info"], obs["outputs"], obs["checksums"] = fp8rl_info(port), generate(port), checksums(port)
    except (OSError, ValueError, RuntimeError, KeyError, TimeoutError) as e:
        obs["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop(proc)
    return obs


# ---------------------------------------------------------------------------------------------------------------------
# report


def all_checks(observations: dict) -> list[Check]:
    """The checks of every recorded pass against the cold reference."""
    cold = observations.get("cold") or {}
    checks = []
    for name, obs in observations.get("passes", {}).items():
        checks += pass_checks(name, obs, cold)
    if not observations.get("passes"):
        checks.append(not_run("colocated", observations.get("error", "no pass ran")))
    return checks


def write_report(out: str, report: dict) -> list[Check]:
    """OUT/check_colocated.json (header, observations, checks, totals) and OUT/summary.md; returns the checks."""
    checks = all_checks(report.get("observations", {}))
    os.makedirs(out, exist_ok=True)
    write_checks(out, report, checks, "check_colocated.json", f"## colocated check (verl's release/resume cycle): "
                 f"{os.path.basename(report.get('model', MODEL))}, passes {', '.join(report.get('passes', []))}")
    return checks


def server_order(passes: list[str]) -> list[tuple[str, Optional[str]]]:
    """The first pass, then its cold reference, then the other pass: what a deadline cuts off matters least."""
    return [("pass", passes[0]), ("cold", None)] + [("pass", name) for name in passes[1:]]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Server A of each pass and the cold reference (server_order), within --deadline-s; the report after each."""
    import torch
    from check_server import versions
    from make_models import ensure
    from server_payloads import CHECK_EMBED_STD, W1_SEED, hf_shapes, make_weights, write_checkpoint

    os.makedirs(args.out, exist_ok=True)
    args.env = {"FP8RL_GEMM_SELECT_CACHE": os.path.join(args.out, "gemm_select.json")}  # A measures, cold reuses
    model = ensure(args.model_dir, [MODEL])[0]
    report: dict = {"command": " ".join(["python3 scripts/gpu/check_colocated.py", *argv]), "model": model,
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", "passes": args.passes,
                    "versions": versions(), "observations": {"passes": {}}}
    t0 = time.time()
    tmp = os.path.join(args.out, "tmp")
    try:
        with open(os.path.join(model, "config.json")) as f:
            w1 = make_weights(hf_shapes(json.load(f)), "cuda", W1_SEED, CHECK_EMBED_STD)
        write_checkpoint(os.path.join(tmp, "w1"), w1, model)
        for kind, name in server_order(args.passes):
            left = args.deadline_s - (time.time() - t0) if args.deadline_s else float("inf")
            if left < MIN_SERVER_S:
                error = f"not started: {left:.0f} s left of --deadline-s {args.deadline_s:.0f}"
                if kind == "cold":
                    report["observations"]["cold"] = {"error": error}
                else:
                    report["observations"]["passes"][name] = {"pass": name, "error": error}
            elif kind == "cold":
                report["observations"]["cold"] = observe_cold(args, os.path.join(tmp, "w1"), args.port + 1)
            else:
                report["observations"]["passes"][name] = observe_pass(args, name, model, w1, args.port)
            write_report(args.out, report)
    except (OSError, ValueError, RuntimeError) as e:
        report["observations"]["error"] = f"{type(e).__name__}: {e}"
    finally:
        report["elapsed_s"] = round(time.time() - t0, 1)
        shutil.rmtree(tmp, ignore_errors=True)
        checks = write_report(args.out, report)
        print("\n" + table(checks), flush=True)
    return 0 if checks and all(c.ok for c in checks) else 1


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", help=f"folder of dummy-weight models ({MODEL} is written there if missing)")
    p.add_argument("--passes", nargs="+", choices=list(PASSES), default=list(PASSES),
                   help="no_backup: --enable-memory-saver alone; backup: with --enable-weights-cpu-backup (default: "
                        "both)")
    p.add_argument("--port", type=int, default=30060, help="server A's port; the cold server uses PORT+1")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="limit per server start (default 300)")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help=f"start no server after this many seconds minus {MIN_SERVER_S} (0: no deadline)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
    p.add_argument("--report-from", metavar="FILE", help="rebuild the report from a recorded check_colocated.json")
    args = p.parse_args(argv)
    if not (args.dry_run or args.report_from or args.model_dir):
        p.error("--model-dir is required unless --dry-run or --report-from")
    args.passes = list(dict.fromkeys(args.passes))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Parse; the plan, a report rebuilt from a recorded file, or the GPU run."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(plan(args), indent=1))
        return 0
    if args.report_from:
        with open(args.report_from) as f:
            checks = write_report(args.out, json.load(f))
        print(table(checks))
        return 0 if checks and all(c.ok for c in checks) else 1
    import torch

    if not torch.cuda.is_available():
        print("check_colocated.py needs a CUDA GPU (it launches SGLang servers with the memory saver and pushes CUDA "
              "IPC handles)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a suite timeout still stops the servers (finally)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
