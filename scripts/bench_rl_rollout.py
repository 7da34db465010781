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
                 the default auto, takes it up to 8 sequences and FA3 above)
  fp8_kv_triton  fp8_kv + --attention-backend triton
  fp8_kv_flashinfer  fp8_kv + --attention-backend flashinfer (its first start JIT-compiles FlashInfer's kernels)
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
import gzip
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import bench_rollout as BR  # scripts/bench_rollout.py: startup-log parsing, the FP8 flag lists
import kv_measure as KV  # scripts/kv_measure.py: attention backends, FA3 probe, backend env
import rollout_regimes as RG  # scripts/rollout_regimes.py: decode steps by running requests
from accuracy_regression import percentile  # numpy-style linear-interpolation percentile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS: dict[str, list[str]] = {
    "bf16": [],
    # the plugin's FP8 capture (FP8_DECODE_GRAPH_MAX_BS) for BF16; --cuda-graph-max-bs is the flag of every supported
    # release (from 0.5.15 an alias of --cuda-graph-max-bs-decode, the field the plugin raises)
    "bf16_graphs512": ["--cuda-graph-max-bs", "512"],
    "bf16_triton": ["--attention-backend", "triton"],
    "fp8": list(BR._ONLINE),
    "fp8_triton": [*BR._ONLINE, "--attention-backend", "triton"],
    "fp8_kv": [*BR._ONLINE, *BR._FP8_KV],
    "fp8_kv_fa3": [*BR._ONLINE, *BR._FP8_KV, BR.DECODE_ATTENTION_FLAG, "fa3"],
    "fp8_kv_splitkv": [*BR._ONLINE, *BR._FP8_KV, BR.DECODE_ATTENTION_FLAG, "split_kv"],
    "fp8_kv_triton": [*BR._ONLINE, *BR._FP8_KV, "--attention-backend", "triton"],
    "fp8_kv_flashinfer": [*BR._ONLINE, *BR._FP8_KV, "--attention-backend", "flashinfer"],
}
DEFAULT_CONFIGS = ["bf16", "fp8"]
MODELS = ("qwen3-8b", "qwen3-30b-a3b")  # scripts/gpu/make_models.py names
COMMON_FLAGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--sampling-backend", "pytorch",
                "--grammar-backend", "none", "--dtype", "bfloat16", "--decode-log-interval", "1", "--host", "127.0.0.1"]
# a workload flag left unset takes its scale's value, else its WORKLOAD_DEFAULTS value
SCALES = {"full": {"num_prompts": 384, "output_median": 1500, "output_cap": 8192},
          "short": {"num_prompts": 256, "output_median": 1000, "output_cap": 4096},
          "long": {"num_prompts": 192, "input_dist": "lognormal", "input_len": 2048, "input_sigma": 0.5,
                   "input_lo": 256, "input_hi": 8192, "output_median": 1500, "output_sigma": 1.2,
                   "output_cap": 16384}}
WORKLOAD_DEFAULTS = {"input_dist": "fixed", "input_len": 512, "input_sigma": 0.5, "input_lo": 1, "input_hi": None,
                     "output_sigma": 1.0}
DISTRIBUTIONS = ("lognormal", "uniform", "fixed")
BF16_BASELINES = ("bf16", "bf16_graphs512")  # the ratios' denominator: the faster of these that ran
TOKEN_RANGE = (100, 151000)  # prompt ids: below Qwen3's special tokens (151643+)
DEFAULT_RECORDED = os.path.join(REPO, "tests", "data", "rl_rollout_recorded.json")
ATTN_FLAG = "--attention-backend"

_DECODE_RE = re.compile(RG.DECODE_LINE + r".*?\b(?:cuda|cpu|npu|musa) graph: (True|False)(?:.*?#queue-req: (\d+))?")
_MAX_RUNNING_RE = re.compile(r"max_total_num_tokens=\d+.*?max_running_requests=(\d+)")
_RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
_KEEP_RE = re.compile(r"Decode batch|Prefill batch|max_total_num_tokens=|KV [Cc]ache (?:is )?allocated|"
                      r"Retract requests|Load weight end|\[fp8rl\]|Traceback|Error")


def say(msg: str) -> None:
    """One progress line on stdout."""
    print(f"[bench_rl_rollout {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# the workload
# ----------------------------------------------------------------------------------------------------------------

def output_lengths(n: int, dist: str, cap: int, seed: int, median: float = 1500, sigma: float = 1.0,
                   lo: int = 1, hi: int | None = None, fixed: int | None = None) -> list[int]:
    """n max_new_tokens values from the distribution (lognormal / uniform / fixed), each in [1, cap]."""
    rng = random.Random(seed * 1_000_003 + 1)
    if dist == "lognormal":
        raw = [rng.lognormvariate(math.log(median), sigma) for _ in range(n)]
    elif dist == "uniform":
        raw = [rng.randint(lo, cap if hi is None else hi) for _ in range(n)]
    elif dist == "fixed":
        raw = [median if fixed is None else fixed] * n
    else:
        raise ValueError(f"unknown output-length distribution {dist!r}; choose from {DISTRIBUTIONS}")
    return [max(1, min(int(cap), round(x))) for x in raw]


def input_lengths(n: int, dist: str, seed: int, length: int = 512, sigma: float = 0.5, lo: int = 1,
                  hi: int | None = None) -> list[int]:
    """n prompt lengths: fixed `length`, lognormal (median `length`) kept within [lo, hi], or uniform in [lo, hi]."""
    if dist == "fixed":
        return [int(length)] * n
    # a stream of its own: the prompt ids (seed) and the output lengths stay what they were with fixed prompts
    rng = random.Random(seed * 1_000_003 + 2)
    if dist == "lognormal":
        raw = [round(rng.lognormvariate(math.log(length), sigma)) for _ in range(n)]
    elif dist == "uniform":
        if hi is None:
            raise ValueError("uniform prompt lengths need an upper bound (--input-hi)")
        raw = [rng.randint(lo, hi) for _ in range(n)]
    else:
        raise ValueError(f"unknown prompt-length distribution {dist!r}; choose from {DISTRIBUTIONS}")
    return [max(lo, 1, x if hi is None else min(hi, x)) for x in raw]


def prompt_ids(n: int, length: int | list[int], seed: int) -> list[list[int]]:
    """n prompts of random token ids (seeded), each `length` long or as long as its entry of the list."""
    lens = [length] * n if isinstance(length, int) else list(length)
    if len(lens) != n:
        raise ValueError(f"{len(lens)} prompt lengths for {n} prompts")
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(k)] for k in lens]


def make_workload(args: argparse.Namespace) -> dict:
    """The rollout batch of the parsed arguments: prompts, max_new_tokens per request, and its description."""
    lens = output_lengths(args.num_prompts, args.output_dist, args.output_cap, args.seed, median=args.output_median,
                          sigma=args.output_sigma, lo=args.output_lo, hi=args.output_hi, fixed=args.output_len)
    in_lens = input_lengths(args.num_prompts, args.input_dist, args.seed, length=args.input_len,
                            sigma=args.input_sigma, lo=args.input_lo, hi=args.input_hi)
    spec = {"num_prompts": args.num_prompts, "input_dist": args.input_dist, "input_len": args.input_len,
            "input_sigma": args.input_sigma, "input_lo": args.input_lo, "input_hi": args.input_hi,
            "output_dist": args.output_dist, "output_median": args.output_median, "output_sigma": args.output_sigma,
            "output_lo": args.output_lo, "output_hi": args.output_hi, "output_len": args.output_len,
            "output_cap": args.output_cap, "seed": args.seed, "scale": args.scale, "temperature": 1.0,
            "ignore_eos": True}
    return {"input_ids": prompt_ids(args.num_prompts, in_lens, args.seed), "max_new_tokens": lens,
            "spec": spec, "stats": length_stats(lens, args.output_cap),
            "input_stats": length_stats(in_lens, args.input_hi or max(in_lens, default=0))}


def length_stats(lens: list[int], cap: int) -> dict:
    """Median, p90, mean, max, total of the output lengths and how many sit at the cap."""
    return {"n": len(lens), "total": sum(lens), "mean": sum(lens) / max(1, len(lens)), "median": percentile(lens, 50),
            "p90": percentile(lens, 90), "max": max(lens, default=0), "at_cap": sum(x >= cap for x in lens)}


def describe_prompts(spec: dict) -> str:
    """The prompt-length part of the workload line (a spec recorded before prompt distributions: fixed)."""
    d = spec.get("input_dist", "fixed")
    if d == "lognormal":
        lo, hi = spec.get("input_lo", 1), spec.get("input_hi")
        bounds = f"at least {lo}" if hi is None else f"within [{lo}, {hi}]"
        return f"lognormal(median {spec['input_len']:g}, sigma {spec['input_sigma']:g}) {bounds}"
    if d == "uniform":
        return f"uniform({spec['input_lo']}, {spec['input_hi']})"
    return str(spec["input_len"])


def describe_workload(spec: dict) -> str:
    """One line: prompts, input length, output distribution."""
    d = spec["output_dist"]
    if d == "lognormal":
        dist = f"lognormal(median {spec['output_median']:g}, sigma {spec['output_sigma']:g})"
    elif d == "uniform":
        dist = f"uniform({spec['output_lo']}, {spec['output_hi'] or spec['output_cap']})"
    else:
        dist = f"fixed {spec['output_len'] or spec['output_median']:g}"
    return (f"{spec['num_prompts']} prompts x {describe_prompts(spec)} random token ids, output {dist} capped at "
            f"{spec['output_cap']}, temperature 1.0, ignore_eos, seed {spec['seed']}")


def request_body(ids: list[int], max_new: int) -> dict:
    """One /generate body: input ids, sampled at temperature 1.0 for exactly max_new tokens."""
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": int(max_new), "temperature": 1.0,
                                                  "ignore_eos": True}}


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
    val = None
    for i, f in enumerate(flags):
        if f == ATTN_FLAG and i + 1 < len(flags):
            val = flags[i + 1]
        elif f.startswith(ATTN_FLAG + "="):
            val = f.split("=", 1)[1]
    return val


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
# log parsing
# ----------------------------------------------------------------------------------------------------------------

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
    info = BR.parse_log(text)
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


# ----------------------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------------------

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


def summarize_config(name: str, rec: dict, n_planned: int) -> dict:
    """Every metric of one config from its record (requests, start-up log lines, run log lines)."""
    startup = "\n".join(rec.get("startup_log") or [])
    run = "\n".join(rec.get("run_log") or [])
    res = {"config": name, "flags": rec.get("flags", CONFIGS.get(name, [])), "status": rec.get("status", "ok"),
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


def build_report(records: dict[str, dict], n_planned: int) -> dict[str, dict]:
    """config -> metrics + `vs_base` ratios against the baseline of pick_baseline (in each config's `baseline`)."""
    results = {name: summarize_config(name, rec, n_planned) for name, rec in records.items()}
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


def format_summary(results: dict[str, dict], meta: dict) -> str:
    """summary.md: the table (ratios vs the baseline of pick_baseline), workload, definitions, per-config notes."""
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
    results = build_report(records, meta["workload"]["num_prompts"])
    text = format_summary(results, meta)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "baseline": pick_baseline(results), "results": results,
                   "curves": {n: completion_curve(rec.get("requests") or []) for n, rec in records.items()}},
                  f, indent=1, default=str)
    if not meta.get("dry_run"):
        with open(os.path.join(out, "answers.json"), "w") as f:
            json.dump({"workload": meta["workload"], "max_new_tokens": workload["max_new_tokens"],
                       "configs": records}, f, default=str)
    try:
        why = plot_curves(records, results, os.path.join(out, "completion.png"),
                          f"{meta.get('model_desc', '')}: {meta.get('workload_desc', '')}")
    except Exception as e:  # noqa: BLE001  (a picture must never cost the numbers)
        why = f"plotting failed: {e!r}"
    if why:
        say(f"no completion.png: {why}")
    return text


# ----------------------------------------------------------------------------------------------------------------
# recorded answers (--dry-run)
# ----------------------------------------------------------------------------------------------------------------

def load_recorded(paths: list[str] | str, configs: list[str]) -> dict:
    """The recorded answers of the named configs, in the order given, each from the first file that has it (several
    files: runs made one after another, e.g. one config per GPU call; ``.gz`` files are read as gzip); SystemExit if
    one is missing."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    have, workload, source = {}, {}, {}
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
    missing = [c for c in configs if c not in have]
    if missing:
        raise SystemExit(f"--recorded {' '.join(paths)} has no answers for {missing} (it has {list(have)})")
    return {"workload": workload, "configs": {c: have[c] for c in dict.fromkeys(configs)},
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


# ----------------------------------------------------------------------------------------------------------------
# the GPU run
# ----------------------------------------------------------------------------------------------------------------

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
