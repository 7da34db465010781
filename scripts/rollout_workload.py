"""The RL-shaped rollout batch of scripts/bench_rl_rollout.py: prompt and output lengths drawn from seeded
distributions, random prompt token ids, the /generate body of one request, and the workload's one-line description."""

from __future__ import annotations

import argparse
import math
import random

from accuracy_metrics import percentile  # numpy-style linear-interpolation percentile

# a workload flag left unset takes its scale's value, else its WORKLOAD_DEFAULTS value
SCALES = {"full": {"num_prompts": 384, "output_median": 1500, "output_cap": 8192},
          "short": {"num_prompts": 256, "output_median": 1000, "output_cap": 4096},
          "long": {"num_prompts": 192, "input_dist": "lognormal", "input_len": 2048, "input_sigma": 0.5,
                   "input_lo": 256, "input_hi": 8192, "output_median": 1500, "output_sigma": 1.2,
                   "output_cap": 16384}}
WORKLOAD_DEFAULTS = {"input_dist": "fixed", "input_len": 512, "input_sigma": 0.5, "input_lo": 1, "input_hi": None,
                     "output_sigma": 1.0}
DISTRIBUTIONS = ("lognormal", "uniform", "fixed")
TOKEN_RANGE = (100, 151000)  # prompt ids: below Qwen3's special tokens (151643+)


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
