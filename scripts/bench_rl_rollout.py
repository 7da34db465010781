#!/usr/bin/env python3
"""RL-shaped rollout through the stock SGLang server: BF16 vs FP8 configs, one command, one table.

Each config is its own `python -m sglang.launch_server` on a dummy-weight model (`--load-format dummy`, the
config.json-only folders of scripts/gpu/make_models.py: Qwen3-8B shapes, or Qwen3-30B-A3B with --model), started one
after another in the same run (or side by side with --gpus). The workload is one RL rollout step: --num-prompts prompts
of random token ids (seeded), each as long as the prompt-length distribution draws (--input-dist; fixed --input-len by
default), each `/generate` request with `temperature 1.0`, `ignore_eos`, and its own `max_new_tokens` drawn from the
output-length distribution (capped at --output-cap); the whole batch is submitted at once, one thread per request, and
each request's completion time is recorded.

Configs (--configs, run in the order given):
  bf16           SGLang's defaults (no --attention-backend flag: FA3 on Hopper)
  bf16_graphs512 bf16 + --cuda-graph-max-bs 512: BF16 with the decode CUDA-graph capture this plugin sets for FP8
                 (SGLang's default is 256 on an H100; a BF16 user can pass the same flag)
  bf16_triton    --attention-backend triton
  fp8            --quantization fp8_online_blockwise (this plugin, its defaults)
  fp8_triton     fp8 + --attention-backend triton
  fp8_kv         fp8 + --kv-cache-dtype fp8_e4m3 (the plugin calibrates the K/V scales at load)
  fp8_kv_fa3     fp8_kv + --fp8rl-decode-attention fa3 (FlashAttention-3's FP8 decode at every batch size)
  fp8_kv_splitkv fp8_kv + --fp8rl-decode-attention split_kv (the plugin's split-KV decode at every batch size; fp8_kv,
                 the default auto, takes it up to 32 sequences and FA3 above)
  fp8_kv_bf16q   fp8_kv + --fp8rl-decode-query bf16 (the split-KV kernel reads the BF16 query: no E4M3 cast launch)
  fp8_kv_forms   fp8_kv + --fp8rl-split-kv-forms single_plan,step_plan,fused_merge (fewer split-KV launches)
  fp8_kv_noforms fp8_kv + --fp8rl-split-kv-forms none (the split-KV kernel before the forms: their baseline)
  fp8_kv_lean    fp8_kv + --fp8rl-decode-query bf16 --fp8rl-producer-quant on (every launch-saving opt-in)
  fp8_kv_auto8   fp8_kv + --fp8rl-split-kv-max-batch 8 (auto's earlier limit: the split-KV kernel up to 8 sequences,
                 FA3 above; the baseline of the default 32)
  fp8_kv_auto32  fp8_kv + --fp8rl-split-kv-max-batch 32 (the default since docs/RESULTS.md sec. 41, spelled out)
  fp8_kv_triton  fp8_kv + --attention-backend triton
  fp8_kv_flashinfer  fp8_kv + --attention-backend flashinfer (its first start JIT-compiles FlashInfer's kernels)
  fp8_kv_fi_decode   fp8_kv + --decode-attention-backend flashinfer (prefill on FA3, decode on FlashInfer's FP8
                 kernel: SGLang's hybrid backend; the first start JIT-compiles FlashInfer's decode module)
The ratios' baseline is the faster (smaller makespan, all requests done) of bf16 and bf16_graphs512 among the configs
that ran, named in the table; with neither of them, the first config.
Every server also gets --load-format dummy --skip-tokenizer-init --sampling-backend pytorch --grammar-backend none
--dtype bfloat16 --decode-log-interval 1 --random-seed SEED (the proven flags of the GPU machine's trimmed
wheelhouse, plus one scheduler log line per decode step); --extra-args CONFIG="FLAGS" adds flags to one config
(CONFIG all: to every one; `fp8=--flag=value` needs no quotes, and a repeated CONFIG= adds more flags). Where
FlashAttention-3 does not import (the trimmed wheelhouse drops it), a config without an --attention-backend flag runs
on triton instead, said in the table (--fa3-missing run: launch it anyway).

Per config: makespan (submit -> last request done), median and 90th-percentile completion time, output tok/s
(completion tokens / makespan), the KV pool (tokens, from the scheduler's `max_total_num_tokens=` log line), peak
running requests (the largest `#running-req` of the decode log lines), and the share of decode batches run without a
CUDA graph: of the scheduler's `Decode batch, ... cuda graph: True|False` lines during the run (one per decode step
with --decode-log-interval 1), the fraction with `False` (SGLang replays a decode graph only up to its captured batch
size, 256 on an H100 by default), and the share of decode tokens (sum of #running-req) those batches produced.
Ratios against the baseline (above) in the same table; a second table gives each config's decode steps by the number
of requests running (scripts/rollout_regimes.py: steps, median step time and the run's seconds per band, and the step
speed-up over the baseline: where the makespan goes); a completion curve (requests done vs time, one line per
config) in completion.png when matplotlib imports (a failed plot does not end the run).

Workload size (--scale):
  full   384 prompts of 512 tokens, outputs lognormal median 1500, sigma 1, cap 8192 (the default)
  short  256 prompts of 512 tokens, median 1000, sigma 1, cap 4096 (two configs on Qwen3-8B shapes fit one 9-minute
         GPU call with server starts)
  long   the long-context tail: 192 prompts of lognormal length (median 2048, sigma 0.5, kept within 256..8192;
         449,778 tokens at seed 0), outputs lognormal median 1500, sigma 1.2, cap 16384 (533,836 tokens, 4 at the
         cap), so the last samples decode alone over contexts of up to 24k tokens. On an H100 at Qwen3-8B shapes the
         prompts alone exceed BF16's KV pool (362,891 tokens, docs/RESULTS.md 19a) and fit FP8 KV's (811,924); an
         H200's BF16 pool holds them. Sized for one BF16 config (or one wave of --gpus) per 600 s GPU call with its
         server start; not yet measured.
Each workload flag given overrides the scale's value. Prompt lengths (--input-dist): fixed (--input-len), lognormal
(median --input-len, --input-sigma) kept within --input-lo .. --input-hi, or uniform (--input-lo .. --input-hi).
Output lengths: lognormal (median, sigma: ln L ~ N(ln median, sigma)), uniform (--output-lo .. --output-hi) or fixed
(--output-len), each capped at --output-cap.

Side by side (--gpus G0 G1 ...): the configs run in waves of one config per GPU, in the order given, each wave's
configs at the same time on identical GPUs; with as many GPUs as configs, every config runs side by side.

Writes under --out: results.json (workload, per-config metrics, ratios), summary.md (the table), completion.png,
answers.json (the recorded answers: per-request completion times and the server log lines the report uses; a later
--dry-run --recorded OUT/answers.json rebuilds the report from it), server_<config>.log.

--dry-run (CPU, no server, no GPU): parses the arguments, generates the workload, prints each config's server command
line and builds the report from recorded answers (--recorded, default tests/data/rl_rollout_recorded.json; several
files, plain or .gz, join runs made one after another: each config from the first file that has it).

  python scripts/bench_rl_rollout.py --out /tmp/rl_rollout                          # bf16 vs fp8, full scale
  python scripts/bench_rl_rollout.py --scale short --configs bf16 fp8 fp8_kv --deadline-s 540 --out /tmp/r
  python scripts/bench_rl_rollout.py --model qwen3-30b-a3b --configs bf16 fp8 --extra-args fp8=--fp8rl-gemm-select=off
  python scripts/bench_rl_rollout.py --scale long --configs bf16 bf16_graphs512 fp8 fp8_kv --gpus 0 1 2 3 --out /tmp/r
  python scripts/bench_rl_rollout.py --dry-run --out /tmp/rl_dry --num-prompts 8 --input-len 16 --output-median 100 \\
      --output-cap 400 --configs bf16 fp8 fp8_kv
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import threading
import time

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import bench_rollout as BR  # scripts/bench_rollout.py: the device and versions
import bench_rollout_configs as BRC  # scripts/bench_rollout_configs.py: the FP8 flag lists
import kv_measure as KV  # scripts/kv_measure.py: attention backends, FA3 probe, backend env
import rollout_floor as RF  # scripts/rollout_floor.py: each decode step against its floor
from rollout_report import _f, load_recorded, recorded_mismatches, say, summarize_config, write_outputs
from rollout_server import REPO, run_config, skipped_record
from rollout_workload import DISTRIBUTIONS, SCALES, WORKLOAD_DEFAULTS, describe_workload, make_workload

CONFIGS: dict[str, list[str]] = {
    "bf16": [],
    # the plugin's FP8 capture (FP8_DECODE_GRAPH_MAX_BS) for BF16; --cuda-graph-max-bs is the flag of every supported
    # release (from 0.5.15 an alias of --cuda-graph-max-bs-decode, the field the plugin raises)
    "bf16_graphs512": ["--cuda-graph-max-bs", "512"],
    "bf16_triton": ["--attention-backend", "triton"],
    "fp8": list(BRC._ONLINE),
    "fp8_triton": [*BRC._ONLINE, "--attention-backend", "triton"],
    "fp8_kv": [*BRC._ONLINE, *BRC._FP8_KV],
    "fp8_kv_fa3": [*BRC._ONLINE, *BRC._FP8_KV, BRC.DECODE_ATTENTION_FLAG, "fa3"],
    "fp8_kv_splitkv": [*BRC._ONLINE, *BRC._FP8_KV, BRC.DECODE_ATTENTION_FLAG, "split_kv"],
    "fp8_kv_bf16q": [*BRC._ONLINE, *BRC._FP8_KV, BRC.DECODE_QUERY_FLAG, "bf16"],
    "fp8_kv_forms": [*BRC._ONLINE, *BRC._FP8_KV, *BRC.ALL_FORMS],
    "fp8_kv_noforms": [*BRC._ONLINE, *BRC._FP8_KV, *BRC.NO_FORMS],
    "fp8_kv_lean": [*BRC._ONLINE, *BRC._FP8_KV, *BRC.LEAN],
    "fp8_kv_auto8": [*BRC._ONLINE, *BRC._FP8_KV, BRC.MAX_BATCH_FLAG, "8"],
    "fp8_kv_auto32": [*BRC._ONLINE, *BRC._FP8_KV, BRC.MAX_BATCH_FLAG, "32"],
    "fp8_kv_triton": [*BRC._ONLINE, *BRC._FP8_KV, "--attention-backend", "triton"],
    "fp8_kv_flashinfer": [*BRC._ONLINE, *BRC._FP8_KV, "--attention-backend", "flashinfer"],
    "fp8_kv_fi_decode": [*BRC._ONLINE, *BRC._FP8_KV, "--decode-attention-backend", "flashinfer"],
}
DEFAULT_CONFIGS = ["bf16", "fp8"]
MODELS = ("qwen3-8b", "qwen3-30b-a3b")  # scripts/gpu/make_models.py names
COMMON_FLAGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--sampling-backend", "pytorch",
                "--grammar-backend", "none", "--dtype", "bfloat16", "--decode-log-interval", "1", "--host", "127.0.0.1"]
DEFAULT_RECORDED = os.path.join(REPO, "tests", "data", "rl_rollout_recorded.json")
ATTN_FLAG = "--attention-backend"


# ----------------------------------------------------------------------------------------------------------------
# configs and server command lines
# ----------------------------------------------------------------------------------------------------------------

def parse_extra_args(items: list[str], known) -> dict[str, list[str]]:
    """["CONFIG=FLAGS", ...] -> {config: [flag, ...]}; CONFIG `all` is every config; FLAGS are shell-split and a
    repeated config adds up (so `fp8=--a=1 fp8=--b=2` works where quotes do not survive, e.g. in an env var)."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or (name not in known and name != "all"):
            raise ValueError(f"--extra-args {item!r}: expected CONFIG=FLAGS with CONFIG in {sorted(known)} or all")
        out.setdefault(name, []).extend(shlex.split(flags))
    return out


def attention_backend(flags: list[str]) -> str | None:
    """The last --attention-backend value in flags (None: SGLang picks its default)."""
    return BRC.flag_value(flags, ATTN_FLAG)


def config_flags(name: str, extra: dict[str, list[str]]) -> list[str]:
    """The config's own flags, then --extra-args all=..., then its own --extra-args."""
    return [*CONFIGS[name], *extra.get("all", []), *extra.get(name, [])]


def server_command(model_path: str, port: int, flags: list[str], seed: int,
                   mem_fraction: float | None = None) -> list[str]:
    """`python -m sglang.launch_server` for one config."""
    mem = [] if mem_fraction is None else ["--mem-fraction-static", str(mem_fraction)]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(port),
            *COMMON_FLAGS, "--random-seed", str(seed), *mem, *flags]


def server_env(flags: list[str]) -> dict[str, str]:
    """The extra environment of one config (FlashInfer's paged prefix path with an FP8 KV cache; no DeepGEMM sweep)."""
    env = {"SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0", "PYTHONUNBUFFERED": "1"}
    env.update(KV.backend_env(flags, attention_backend(flags) or ""))
    return env


def build_plan(args: argparse.Namespace, model_path: str, fa3_fallback: bool = False) -> list[dict]:
    """Per config, in run order: name, flags, port, command line, extra env; with fa3_fallback, configs that leave
    the attention backend to SGLang get --attention-backend triton."""
    extra = parse_extra_args(args.extra_args, CONFIGS)
    plan = []
    for i, name in enumerate(dict.fromkeys(args.configs)):
        flags = config_flags(name, extra)
        fallback = fa3_fallback and attention_backend(flags) is None
        if fallback:
            flags += [ATTN_FLAG, "triton"]
        port = args.port_base + 10 * i
        plan.append({"name": name, "flags": flags, "port": port, "env": server_env(flags), "fa3_fallback": fallback,
                     "cmd": server_command(model_path, port, flags, args.seed, args.mem_fraction_static)})
    return plan


# ----------------------------------------------------------------------------------------------------------------
# the GPU run
# ----------------------------------------------------------------------------------------------------------------


def run_waves(plan: list[dict], args: argparse.Namespace, out: str, workload: dict, records: dict, meta: dict,
              deadline_at: float) -> None:
    """--gpus: the configs in waves of len(gpus), each config of a wave on its own GPU at the same time."""
    gpus = args.gpus
    waves = [plan[i:i + len(gpus)] for i in range(0, len(plan), len(gpus))]
    for w, wave in enumerate(waves):
        wave_deadline = deadline_at - args.min_s * (len(waves) - 1 - w)
        left = wave_deadline - time.time()
        if left < args.min_s:
            for item in wave:
                say(f"SKIP {item['name']}: only {left:.0f} s left of --deadline-s {args.deadline_s:.0f}")
                records[item["name"]] = skipped_record(item)
            continue
        threads = []
        for gpu, item in zip(gpus, wave):
            item = dict(item, env=dict(item["env"], CUDA_VISIBLE_DEVICES=str(gpu)))
            say(f"run {item['name']} on GPU {gpu}: {' '.join(item['cmd'][3:])}")

            def one(item=item, gpu=gpu, left=left, wave_deadline=wave_deadline) -> None:
                rec = run_config(item, os.path.join(out, f"server_{item['name']}.log"), workload,
                                 min(args.start_timeout, left - 45), args.run_timeout, wave_deadline)
                rec["gpu"] = gpu
                records[item["name"]] = rec
            threads.append(threading.Thread(target=one, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for item in wave:
            r = summarize_config(item["name"], records[item["name"]], args.num_prompts)
            say(f"{item['name']}: {records[item['name']]['status']}; makespan {_f(r['makespan_s'], '{:.1f}')} s, "
                f"p50 {_f(r['p50_s'], '{:.1f}')} s, KV pool {_f(r['kv_tokens'])}, peak running {_f(r['peak_running'])}")
        write_outputs(out, records, meta, workload)


def fa3_missing(plan: list[dict]) -> str | None:
    """Why FA3 cannot serve the configs that rely on SGLang's default backend (None: it imports, or none does)."""
    if all(attention_backend(p["flags"]) is not None for p in plan):
        return None
    ok, why = KV.fa3_available(sys.executable)
    return None if ok else why


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; --scale fills the workload flags not given (then WORKLOAD_DEFAULTS)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS),
                   help="run in this order; the first is the baseline of the ratios (default: %(default)s)")
    p.add_argument("--model", choices=MODELS, default="qwen3-8b",
                   help="dummy-weight shapes: Qwen3-8B (dense) or Qwen3-30B-A3B (MoE)")
    p.add_argument("--model-dir", default="/tmp/fp8rl_models", help="dummy model folders (made if missing)")
    p.add_argument("--out", default="/tmp/fp8rl_rl_rollout")
    p.add_argument("--scale", choices=list(SCALES), default="full",
                   help="workload size; each workload flag given overrides its value (see below)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-dist", choices=DISTRIBUTIONS, default=None,
                   help="prompt lengths (default: fixed; --scale long: lognormal)")
    p.add_argument("--input-len", type=int, default=None, help="fixed: the prompt length; lognormal: the median "
                   "(default 512; --scale long: 2048)")
    p.add_argument("--input-sigma", type=float, default=None, help="lognormal sigma of ln(prompt length) (0.5)")
    p.add_argument("--input-lo", type=int, default=None, help="shortest prompt (lognormal, uniform; default 1)")
    p.add_argument("--input-hi", type=int, default=None,
                   help="longest prompt (lognormal: none by default; uniform: required)")
    p.add_argument("--output-dist", choices=DISTRIBUTIONS, default="lognormal")
    p.add_argument("--output-median", type=float, default=None, help="lognormal median (fixed: the length)")
    p.add_argument("--output-sigma", type=float, default=None, help="lognormal sigma of ln(length) (default 1)")
    p.add_argument("--output-lo", type=int, default=1, help="uniform: lowest length")
    p.add_argument("--output-hi", type=int, default=None, help="uniform: highest length (default: the cap)")
    p.add_argument("--output-len", type=int, default=None, help="fixed: the length (default: the median)")
    p.add_argument("--output-cap", type=int, default=None, help="largest max_new_tokens")
    p.add_argument("--seed", type=int, default=0, help="prompts, output lengths and the servers' --random-seed")
    p.add_argument("--extra-args", nargs="+", action="extend", default=[], metavar="CONFIG=FLAGS",
                   help='extra launch_server flags for one config (all: every config), e.g. fp8="--fp8rl-gemm-select '
                        'off" or, without quotes, fp8=--fp8rl-gemm-select=off all=--cuda-graph-max-bs-decode=384')
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="default: SGLang's own choice (qwen3-30b-a3b: 0.88, its BF16 weights take 61 GB)")
    p.add_argument("--fa3-missing", choices=("triton", "run"), default="triton",
                   help="where FA3 does not import: run configs without --attention-backend on triton, or launch "
                        "them as they are (they fail)")
    p.add_argument("--gpus", type=int, nargs="+", default=[],
                   help="run the configs in waves, one per GPU at the same time (e.g. --gpus 0 1 on a two-GPU "
                        "host: the two configs of a wave run side by side on identical GPUs)")
    p.add_argument("--port-base", type=int, default=30200, help="config k listens on port-base + 10 k")
    p.add_argument("--start-timeout", type=float, default=420, help="seconds a server may take to become healthy")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds the batch may take per config")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="wall budget (s) for all configs; a config that cannot get --min-s is skipped (0: none)")
    p.add_argument("--min-s", type=float, default=150,
                   help="skip a config when less than this is left; every later config keeps this much of the deadline")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="copy bandwidth of the floors (GB/s; default: measured before the servers start, or the "
                        "recorded answers' in a --dry-run)")
    p.add_argument("--dry-run", action="store_true",
                   help="no server: print the command lines, build the report from --recorded answers")
    p.add_argument("--recorded", nargs="+", default=[DEFAULT_RECORDED],
                   help="answers.json of earlier run(s) (for --dry-run); with several, each config comes from the "
                        "first file that has it")
    a = p.parse_args(argv)
    for key, val in {**WORKLOAD_DEFAULTS, **SCALES[a.scale]}.items():
        if getattr(a, key) is None:
            setattr(a, key, val)
    if a.mem_fraction_static is None and a.model == "qwen3-30b-a3b":
        a.mem_fraction_static = 0.88
    if a.num_prompts < 1 or a.input_len < 1 or a.output_cap < 1 or a.output_median <= 0 or a.output_sigma < 0:
        p.error("--num-prompts, --input-len, --output-cap and --output-median must be positive, --output-sigma >= 0")
    if a.output_dist == "uniform" and not 1 <= a.output_lo <= (a.output_hi or a.output_cap):
        p.error("--output-lo must be between 1 and --output-hi (or the cap)")
    if a.input_sigma < 0 or a.input_lo < 1 or (a.input_hi is not None and a.input_hi < a.input_lo):
        p.error("--input-sigma must be >= 0, --input-lo >= 1 and --input-hi >= --input-lo")
    if a.input_dist == "uniform" and a.input_hi is None:
        p.error("--input-dist uniform needs --input-hi")
    try:
        parse_extra_args(a.extra_args, CONFIGS)
    except ValueError as e:
        p.error(str(e))
    return a


def _meta(args: argparse.Namespace, workload: dict) -> dict:
    shape = "Qwen3-30B-A3B-shaped (MoE)" if args.model == "qwen3-30b-a3b" else "Qwen3-8B-shaped"
    return {"model": args.model, "model_desc": f"{shape} dummy weights", "workload": workload["spec"],
            "workload_desc": describe_workload(workload["spec"]), "lengths": workload["stats"],
            "input_lengths": workload["input_stats"],
            "configs": list(dict.fromkeys(args.configs)), "argv": sys.argv, "dry_run": args.dry_run}


def main(argv: list[str] | None = None) -> int:
    """Run the configs (or, with --dry-run, replay recorded answers); write the report."""
    args = parse_args(argv)
    workload = make_workload(args)
    meta = _meta(args, workload)
    out = os.path.abspath(args.out)
    model_path = os.path.join(os.path.abspath(args.model_dir), args.model)
    say(f"workload: {meta['workload_desc']}; output lengths median {workload['stats']['median']:.0f}, p90 "
        f"{workload['stats']['p90']:.0f}, max {workload['stats']['max']}, {workload['stats']['total']:,} tokens; "
        f"prompts {workload['input_stats']['total']:,} tokens (longest {workload['input_stats']['max']})")
    if args.dry_run:
        for item in build_plan(args, model_path):
            env = " ".join(f"{k}={v}" for k, v in sorted(item["env"].items()))
            print(f"# {item['name']}: env {env}\n{' '.join(item['cmd'])}", flush=True)
        rec = load_recorded(args.recorded, meta["configs"])
        meta["recorded_device"] = rec["machine"].get("device")
        RF.set_bandwidth(meta, args.bandwidth_gbps, rec["machine"].get("bandwidth_gbps"))
        meta["recorded"] = " ".join(args.recorded)
        meta["recorded_sources"] = rec["sources"]
        meta["recorded_mismatch"] = recorded_mismatches(rec["configs"], workload["max_new_tokens"])
        if meta["recorded_mismatch"]:
            say(f"WARNING the recorded answers do not match this workload ({len(meta['recorded_mismatch'])}: "
                f"{meta['recorded_mismatch'][:3]}); recorded with {rec['workload']}")
        text = write_outputs(out, rec["configs"], meta, workload)
        print("\n" + text, flush=True)
        return 0

    plan = build_plan(args, model_path)
    why = fa3_missing(plan)
    if why and args.fa3_missing == "triton":
        say(f"FlashAttention-3 does not import here ({why}); configs without --attention-backend run on triton")
        plan = build_plan(args, model_path, fa3_fallback=True)
    meta.update(BR._env_info(), fa3_missing=why)
    import make_models  # scripts/gpu/make_models.py

    make_models.ensure(os.path.abspath(args.model_dir), [args.model])
    RF.set_bandwidth(meta, args.bandwidth_gbps, None, measure=True)
    os.makedirs(out, exist_ok=True)
    say(f"{meta.get('device')} | {meta.get('versions')} | configs {meta['configs']}, model {model_path}")
    t_start = time.time()
    deadline_at = t_start + args.deadline_s if args.deadline_s > 0 else math.inf
    records: dict[str, dict] = {}
    if args.gpus:
        run_waves(plan, args, out, workload, records, meta, deadline_at)
        text = write_outputs(out, records, meta, workload)
        print("\n" + text, flush=True)
        return 0 if all(r.get("status") == "ok" for r in records.values()) else 1
    for k, item in enumerate(plan):
        # each config after this one keeps --min-s of the deadline: a slow baseline cannot starve the others
        cfg_deadline = deadline_at - args.min_s * (len(plan) - 1 - k)
        name, left = item["name"], cfg_deadline - time.time()
        if left < args.min_s:
            say(f"SKIP {name}: only {left:.0f} s left of --deadline-s {args.deadline_s:.0f}")
            records[name] = skipped_record(item)
            continue
        say(f"run {name}: {' '.join(item['cmd'][3:])}")
        t0 = time.time()
        rec = run_config(item, os.path.join(out, f"server_{name}.log"), workload, min(args.start_timeout, left - 45),
                         args.run_timeout, cfg_deadline)
        records[name] = rec
        r = summarize_config(name, rec, args.num_prompts)
        say(f"{name}: {rec['status']}; elapsed {time.time() - t0:.0f} s (start {_f(rec.get('start_s'), '{:.0f}')} s, "
            f"run {_f(rec.get('run_s'), '{:.0f}')} s); makespan {_f(r['makespan_s'], '{:.1f}')} s, p50 "
            f"{_f(r['p50_s'], '{:.1f}')} s, {_f(r['output_tok_s'])} tok/s, KV pool {_f(r['kv_tokens'])}, peak running "
            f"{_f(r['peak_running'])}, no-graph decode batches {_f(r['no_graph_share'], '{:.1%}')}")
        if rec.get("log_tail"):
            print("\n".join("    " + ln for ln in rec["log_tail"]), flush=True)
        write_outputs(out, records, meta, workload)  # partial results survive a killed call
    text = write_outputs(out, records, meta, workload)
    print("\n" + text, flush=True)
    return 0 if all(r.get("status") == "ok" for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
