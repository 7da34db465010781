#!/usr/bin/env python3
"""Decode roofline (issue 35, item 1): each decode step of a (running batch, context) grid, measured under CUDA graphs
as served, against the floor its bytes and FLOPs set on this card.

Configs (bench_rollout.py's): bf16 (SGLang, no quantization), fp8_online_blockwise (--quantization
fp8_online_blockwise), fp8_online_blockwise_kv (+ --kv-cache-dtype fp8_e4m3, scales calibrated at load); Qwen3-8B
shapes with dummy weights (scripts/gpu/make_models.py; --moe: Qwen3-30B-A3B shapes), attention FA3 (SGLang's default
on Hopper), decode CUDA graphs captured for the grid's batch sizes. Grid: batch 1 8 32 128 384 x context 1k 4k 12k.

How a step at (B, C) is obtained. One process per config: SGLang's `bench_one_batch` (bench_rollout.py's child, with
its plugin loading and dummy-init hooks) over --batch-size B... --input-len C... --output-len 33, which runs every
(B, C) of the product after one model load. This script's child adds hooks to bench_one_batch's module:
- the prefill is skipped: `extend` runs as written (ScheduleBatch.prepare_for_extend allocates the B x C KV slots and
  req_to_token rows exactly as for a real prefill; the child checks per cell that the B x C slots are distinct, so no
  two requests share a KV line in L2), but the model forward and the sampling of those B x C tokens are replaced by
  random next tokens. Once per process the whole KV pool is filled with random values (BF16 N(0, 1); FP8 codes of
  0..240, no NaN), so the cache holds what a cache holds, not zeros. The decode steps then run bench_one_batch's own
  `decode`: prepare_for_decode, ForwardBatch, ModelRunner.forward (the captured CUDA graph), sample. A decode step's
  kernels depend on the shapes, the slots and the sequence lengths, not on the values in the cache, so this is the step
  a server runs at B requests of C tokens, without a prefill of B x C tokens (393k tokens at 384 x 1k: neither the
  memory nor the seconds of one call have room for it). Check cells (default 8 x 4k) run a second time after
  bench_one_batch's real prefill; the report prints both steps (the claim, measured on the GPU).
- every step is timed (`steps_s`): the bench step (median over the steps, bench_one_batch's loop: host preparation,
  the graph replay, sampling and a sync). At 3 steps per cell (`b2b_s`) the child also calls ModelRunner.forward +
  sample 8 times back to back on that step's batch and times them with CUDA events: host work of one call overlaps
  the GPU work of the one before, as SGLang's overlap scheduler runs a server. That is the report's "step" (efficiency,
  speed-ups, targets); re-running a step rewrites the same KV slot and reads the same cache. Those steps and the
  profiled ones are left out of the bench median.
- the device-to-device copy bandwidth is measured at the first prefill of each process (torch copy_ of 1 GiB, 10
  copies x 5 repeats, CUDA events, read + write counted, best repeat); the floors use the best of the processes.
- profiled cells (default 8 x 4k and 128 x 1k, every config): bench_one_batch's --profile of decode steps 16-18
  (torch profiler, GPU activity, graph replays included), grouped by roofline_report.py.
A cell whose B x (C + 33) tokens exceed the KV pool is skipped with the numbers (e.g. 384 x 12k: BF16 KV for Qwen3-8B
is 36 x 8 x 128 x 2 x 2 B = 147 kB per token).

Time on one H100 (measured, docs/RESULTS.md 38-39): a config's process starts in 40-50 s (SGLang's import, the
dummy load, graph capture), the first FP8 process of a machine in about 86 s (DeepGEMM's JIT warm-up and the GEMM
table); the whole grid with two profiled cells took 383 s for five configs, four cells of three configs 125 s.
Deadline: a config starts only with --min-s left (the later configs' --min-s are kept for them; the default 120 s
covers a start and a few cells); inside a process a cell starts only before the process's stop time (its timeout
minus 30 s), so a late cell is skipped with the reason and everything measured stays (roofline.json is rewritten after
every config). A config given less than about 120 s may measure nothing (RESULTS 39: configs given 65-108 s, none
measured a cell).

Output under --out: roofline.json (meta, the raw records of every process, the profiled kernels, the report) and
roofline.md (roofline_report.py: a table per config, speed-ups over BF16, the issue's targets met / missed, the kernel
breakdown); raw/ holds the logs, the records and the traces. `--dry-run --recorded roofline.json` rebuilds both from a
saved run without a GPU.

  python scripts/decode_roofline.py --out /tmp/roofline                 # the grid, 3 configs (~4-7.5 min)
  python scripts/decode_roofline.py --configs fp8_online_blockwise_kv --merge /tmp/roofline/roofline.json --out /tmp/r2
  python scripts/decode_roofline.py --dry-run --recorded tests/data/roofline_recorded.json --out /tmp/r
  python scripts/decode_roofline.py --dry-run --recorded A/roofline.json --merge B/roofline.json --out /tmp/r  # A + B's
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import sys
import time

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import bench_rollout as BR  # scripts/bench_rollout.py: configs, bench flags
import bench_rollout_report as BRR  # scripts/bench_rollout_report.py: a bench log's facts
import kernel_trace as KT  # scripts/kernel_trace.py: a profiler trace's kernels
import roofline_report as RP  # scripts/roofline_report.py: the report from the raw records
from decode_roofline_child import ENV  # scripts/decode_roofline_child.py: the child's settings variable

CONFIGS = ["bf16", "fp8_online_blockwise", "fp8_online_blockwise_kv"]
BATCH_SIZES = [1, 8, 32, 128, 384]
CONTEXTS = [1024, 4096, 12288]
PROFILE_CELLS = [(8, 4096), (128, 1024)]  # a small-batch step and a large one
CHECK_CELLS = [(8, 4096)]
STOP_MARGIN_S = 30  # a child starts no cell in the last seconds of its timeout: trace export, jsonl, exit
SHAPE_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size")
_TRACE_RE = re.compile(r"^(?P<label>.+)_batch(?P<bs>\d+)_input(?P<il>\d+)_output\d+_decode\.trace\.json(?:\.gz)?$")


def parse_cell(text: str) -> tuple[int, int]:
    """'8x4096' -> (8, 4096)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"a cell is BATCHxCONTEXT, e.g. 8x4096, not {text!r}")
    return int(m[1]), int(m[2])


def _cells(cells: list[tuple[int, int]]) -> str:
    """[(8, 4096)] -> '8x4096'."""
    return " ".join(f"{b}x{c}" for b, c in cells)


# ----------------------------------------------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"[roofline {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sweep_batch_sizes(batch_sizes: list[int], check_cells: list[tuple[int, int]]) -> list[int]:
    """bench_one_batch's --batch-size list: the grid's, then each check cell's batch once more (its repeat runs after
    a real prefill; the repeat's other contexts are skipped by the child)."""
    return [int(b) for b in batch_sizes] + sorted({int(b) for b, _ in check_cells})


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace bench_rollout.build_plan reads, for this script's grid."""
    return argparse.Namespace(
        configs=args.configs, attention_backend=args.attention_backend, bf16_backend=[], moe=args.moe,
        batch_sizes=sweep_batch_sizes(args.batch_sizes, args.check_cells), input_lens=args.contexts,
        output_lens=[args.steps + 1], mem_fraction_static=args.mem_fraction_static, repeat=1, prefill_graph=False,
        profile_decode=bool(args.profile_cells), profile_configs=args.configs, profile_steps=args.profile_steps,
        extra_args=args.extra_args)


def build_plan(args: argparse.Namespace, raw: str, prof_dir: str, model_dir: str) -> list[tuple]:
    """(label, config, backend, spec, cmd, env) per config: bench_rollout's plan with this script's child."""
    return BR.build_plan(bench_args(args), raw, prof_dir, model_dir, script=__file__)


def child_settings(args: argparse.Namespace, raw: str, label: str, stop_at) -> dict:
    """$FP8RL_ROOFLINE of one config's process."""
    return {"records": os.path.join(raw, f"{label}.records.jsonl"), "prefill": args.prefill, "stop_at": stop_at,
            "profile_cells": [list(c) for c in args.profile_cells], "check_cells": [list(c) for c in args.check_cells],
            "fill_kv": not args.no_kv_fill, "bandwidth_bytes": args.bandwidth_bytes, "b2b_calls": args.b2b_calls,
            "b2b_timings": args.b2b_timings}


def config_timeout(args: argparse.Namespace, t_start: float, configs_after: int) -> float:
    """This config's timeout: --budget-s, less what the deadline leaves after keeping --min-s for each later one."""
    if args.deadline_s <= 0:
        return args.budget_s
    left = args.deadline_s - (time.time() - t_start) - 5
    return min(args.budget_s, left - args.min_s * configs_after)


def read_jsonl(path: str) -> list[dict]:
    """The records a child wrote (a line cut short by a kill is dropped)."""
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
    return out


def collect_run(cfg: str, spec: dict, run: dict, log_text: str, records: list[dict]) -> dict:
    """One config's entry of roofline.json: how its process ended, facts from its log, its records."""
    info = BRR.parse_log(log_text)
    status = "ok" if run["rc"] == 0 else ("timeout" if run["timed_out"] else f"failed rc={run['rc']}")
    return {"config": cfg, "model": spec["model"], "flags": spec["flags"], **run, "status": status,
            "kv_tokens": info["kv_tokens"], "kv_dtype": info["kv_dtype"], "weight_gib": info["weight_gib"],
            "fp8rl": info["fp8rl"][:6], "error_tail": info["error_tail"], "records": records}


def summarize_trace(path: str, steps: int) -> dict:
    """A decode trace's kernels: name -> total us, launches, and its ``steps`` longest launches (lm_head's rule)."""
    kernels: dict[str, dict] = {}
    for name, dur in KT.kernel_events(KT.load_trace(path)):
        k = kernels.setdefault(name, {"us": 0.0, "n": 0, "top_us": []})
        k["us"] += dur
        k["n"] += 1
        k["top_us"] = sorted(k["top_us"] + [dur], reverse=True)[:steps]
    return {"trace": os.path.basename(path), "steps": steps, "kernels": kernels}


def collect_profiles(prof_dir: str, steps: int) -> dict:
    """config -> 'BxC' -> summarize_trace of every decode trace in ``prof_dir``."""
    out: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(prof_dir, "*decode.trace.json*"))):
        m = _TRACE_RE.match(os.path.basename(path))
        if not m:
            continue
        try:
            out.setdefault(m["label"], {})[RP.cell_key(m["bs"], m["il"])] = summarize_trace(path, steps)
        except (OSError, ValueError, KeyError, TypeError) as e:  # a truncated trace of a killed process
            _say(f"trace {path}: cannot read it ({e!r})")
    return out


def model_config(model_dir: str, model: str) -> dict:
    """The shape keys of a dummy model's config.json."""
    with open(os.path.join(model_dir, model, "config.json")) as f:
        cfg = json.load(f)
    return {k: cfg[k] for k in SHAPE_KEYS if k in cfg}


def merge_runs(data: dict, paths: list[str], measured: list[str]) -> None:
    """Add the configs of earlier roofline.json files that this run does not measure (the same card, please)."""
    for path in paths:
        with open(path) as f:
            old = json.load(f)
        for cfg, run in old.get("runs", {}).items():
            if cfg not in data["runs"] and cfg not in measured:
                data["runs"][cfg] = {**run, "merged_from": path}
                data["profiles"].update({cfg: old.get("profiles", {}).get(cfg, {})})
                data["meta"]["configs"].append(cfg)


def write_report(out: str, data: dict) -> str:
    """roofline.json (the raw data and the report) and roofline.md under ``out``; returns the markdown."""
    report = RP.build_report(data)
    text = RP.format_report(data, report)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "roofline.json"), "w") as f:
        json.dump({**data, "report": report}, f, indent=1, default=str)
    with open(os.path.join(out, "roofline.md"), "w") as f:
        f.write(text + "\n")
    return text


def overrides(args: argparse.Namespace) -> dict:
    """Meta fields the report reads instead of the measurement / the card table."""
    out = {}
    if args.bandwidth_gbps:
        out["bandwidth_gbps"] = args.bandwidth_gbps
    if args.peak_tflops:
        out["peak_tflops"] = {"bf16": args.peak_tflops[0], "fp8": args.peak_tflops[1]}
    return out


def make_meta(args: argparse.Namespace, model_dir: str, model: str) -> dict:
    """Everything about the run that the report needs besides the records."""
    return {"model_desc": ("Qwen3-30B-A3B" if args.moe else "Qwen3-8B") + "-shaped dummy weights", "model": model,
            "model_config": model_config(model_dir, model), "configs": list(args.configs),
            "attention_backend": args.attention_backend, "batch_sizes": args.batch_sizes, "contexts": args.contexts,
            "steps": args.steps, "output_len": args.steps + 1, "mem_fraction_static": args.mem_fraction_static,
            "profile_cells": [RP.cell_key(*c) for c in args.profile_cells], "profile_steps": args.profile_steps,
            "check_cells": [RP.cell_key(*c) for c in args.check_cells], "prefill": args.prefill,
            "b2b_calls": args.b2b_calls, "b2b_timings": args.b2b_timings, "argv": sys.argv, **BR._env_info(),
            **overrides(args)}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(RP.NAMES))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=list(BATCH_SIZES))
    p.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS), help="prompt lengths (tokens)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per cell (bench_one_batch --output-len N+1)")
    p.add_argument("--b2b-calls", type=int, default=8, help="forward + sample calls per back-to-back timing")
    p.add_argument("--b2b-timings", type=int, default=3, help="back-to-back timings per cell (the last steps)")
    p.add_argument("--profile-cells", nargs="*", type=parse_cell, default=None, metavar="BxC",
                   help=f"cells profiled (default: those of {_cells(PROFILE_CELLS)} in the grid)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--check-cells", nargs="*", type=parse_cell, default=None, metavar="BxC",
                   help=f"cells measured once more after a real prefill (default: those of {_cells(CHECK_CELLS)} in "
                   "the grid)")
    p.add_argument("--prefill", choices=["skip", "real"], default="skip", help="real: bench_one_batch's own prefill "
                   "in every cell (cells whose prefill does not fit in memory then fail)")
    p.add_argument("--no-kv-fill", action="store_true", help="leave the KV pool as SGLang allocated it (zeros)")
    p.add_argument("--attention-backend", choices=BR.KV.ATTENTION_BACKENDS, default=BR.KV.FA3)
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B shapes")
    p.add_argument("--model-dir", default="/tmp/fp8rl_models", help="dummy model folders (made if missing)")
    p.add_argument("--out", default="/tmp/fp8rl_roofline")
    p.add_argument("--budget-s", type=float, default=240, help="timeout per config (s)")
    p.add_argument("--deadline-s", type=float, default=0, help="wall budget of the whole run (s; 0: none)")
    p.add_argument("--min-s", type=float, default=120,
                   help="a config is not started with less time than this (a start takes 40-86 s)")
    p.add_argument("--bandwidth-bytes", type=int, default=1 << 30, help="bytes of the copy that measures bandwidth")
    p.add_argument("--bandwidth-gbps", type=float, default=None, help="report: use this bandwidth (GB/s)")
    p.add_argument("--peak-tflops", type=float, nargs=2, default=None, metavar=("BF16", "FP8"),
                   help="report: dense peaks for a card the table lacks")
    p.add_argument("--extra-args", default="", help="extra bench_one_batch flags for every config (one string)")
    p.add_argument("--merge", nargs="+", default=[], metavar="ROOFLINE_JSON", help="configs of earlier runs")
    p.add_argument("--recorded", default=None, metavar="ROOFLINE_JSON", help="with --dry-run: rebuild its report")
    p.add_argument("--dry-run", action="store_true", help="print the commands (and rebuild --recorded) and exit")
    a = p.parse_args(argv)
    for name, default in (("profile_cells", PROFILE_CELLS), ("check_cells", CHECK_CELLS)):
        if getattr(a, name) is None:  # a smaller grid keeps the default cells it holds, not an error
            setattr(a, name, [c for c in default if c[0] in a.batch_sizes and c[1] in a.contexts])
        for bs, ctx in getattr(a, name):
            if bs not in a.batch_sizes or ctx not in a.contexts:
                p.error(f"--{name.replace('_', '-')} {bs}x{ctx} is not in the grid")
    if a.recorded and not a.dry_run:
        p.error("--recorded goes with --dry-run")
    return a


def dry_run(args: argparse.Namespace, plan: list[tuple], out: str) -> int:
    """Print each config's command (and its child's settings); with --recorded rebuild that run's report (with the
    configs of --merge's files it lacks)."""
    for label, _, _, _, cmd, env in plan:
        shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith(("SGLANG", "FP8RL")))
        print(f"# {label}: env {shown} {ENV}='{json.dumps(child_settings(args, '<out>/raw', label, '<stop>'))}'")
        print(" ".join(cmd))
    if args.recorded:
        with open(args.recorded) as f:
            data = json.load(f)
        data.pop("report", None)
        data["meta"].update(overrides(args))
        merge_runs(data, args.merge, list(data["runs"]))
        print("\n" + write_report(out, data))
    return 0


def run_configs(args: argparse.Namespace, plan: list[tuple], raw: str, out: str, data: dict) -> None:
    """Each config's process in turn, within the deadline; roofline.json / .md rewritten after each."""
    t_start = time.time()
    for n, (label, cfg, backend, spec, cmd, env) in enumerate(plan):
        timeout = config_timeout(args, t_start, len(plan) - n - 1)
        if timeout < args.min_s:
            _say(f"SKIP {label}: {timeout:.0f} s left for it (needs --min-s {args.min_s:.0f})")
            data["runs"][label] = {"config": cfg, "status": "skipped (deadline)", "records": []}
            continue
        env[ENV] = json.dumps(child_settings(args, raw, label, time.time() + timeout - STOP_MARGIN_S))
        _say(f"run {label} ({RP.NAMES.get(cfg, cfg)}), attention {backend}, timeout {timeout:.0f} s")
        log_path = os.path.join(raw, f"{label}.log")
        run = BR.run_config(label, cmd, env, log_path, timeout)
        with open(log_path, errors="replace") as f:
            text = f.read()
        data["runs"][label] = collect_run(cfg, spec, run, text, read_jsonl(os.path.join(raw, f"{label}.records.jsonl")))
        _say(f"{label}: {data['runs'][label]['status']}, {run['wall_s']:.0f} s")
        data["profiles"].update(collect_profiles(os.path.join(raw, "profile"), args.profile_steps))
        write_report(out, data)


def main(argv=None) -> int:
    """The run (or --dry-run); 0 when every config's process ended well."""
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    raw, model_dir = os.path.join(out, "raw"), os.path.abspath(args.model_dir)
    prof_dir = os.path.join(raw, "profile")
    plan = build_plan(args, raw, prof_dir, model_dir)
    if args.dry_run:
        return dry_run(args, plan, out)
    BR.check_backends(argparse.Namespace(attention_backend=args.attention_backend, bf16_backend=[]))
    if os.path.isdir(raw):
        shutil.rmtree(raw)  # an earlier run's records and traces would join this one's
    os.makedirs(prof_dir)
    import make_models  # scripts/gpu/make_models.py

    model = plan[0][3]["model"]
    make_models.ensure(model_dir, [model])
    data = {"format": 1, "meta": make_meta(args, model_dir, model), "runs": {}, "profiles": {}}
    merge_runs(data, args.merge, args.configs)
    _say(f"{data['meta']['device']} | {data['meta']['versions']}")
    run_configs(args, plan, raw, out, data)
    print("\n" + write_report(out, data), flush=True)
    return 0 if all(r.get("status") == "ok" for r in data["runs"].values() if not r.get("merged_from")) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        from decode_roofline_child import child_main

        child_main(sys.argv[2:])
    else:
        sys.exit(main())
