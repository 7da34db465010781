#!/usr/bin/env python3
"""The client's preflight finiteness check on a push of many small tensors: per tensor (one host sync each, the
check before RESULTS 26d) against the batched check per bucket (``weight_sync.client.preflight``, one sync per
device and bucket), on one device, side by side in one run.

The tensors are views into one buffer of random BF16 values, ``--tensors`` of ``--shape`` (default: Qwen3-30B-A3B's
18,867 tensors, as its 3 MB experts), grouped into ``--bucket-mb`` buckets by the client's own ``buckets``. Needs
only torch and this checkout (the trainer side imports no SGLang).

  python3 scripts/gpu/bench_preflight.py                       # on the GPU (about 20 s on an H200)
  python3 scripts/gpu/bench_preflight.py --device cpu --tensors 300 --shape 64 64 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import torch  # noqa: E402

from sglang_fp8rl.quant import extremes, extremes_finite_in_bf16  # noqa: E402
from sglang_fp8rl.weight_sync.buckets import DEFAULT_BUCKET_BYTES, buckets  # noqa: E402
from sglang_fp8rl.weight_sync.client import preflight  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tensors", type=int, default=18867)
    p.add_argument("--shape", type=int, nargs=2, default=(768, 2048), metavar=("ROWS", "COLS"))
    p.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES >> 20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if min(args.tensors, *args.shape, args.bucket_mb, args.repeats) < 1:
        p.error("--tensors, --shape, --bucket-mb and --repeats must be positive")
    return args


def per_tensor(chunks: list) -> None:
    """The check before: each tensor's extremes and a host sync for each."""
    for bucket in chunks:
        for name, tensor in bucket:
            if not extremes_finite_in_bf16(extremes(tensor)):
                raise ValueError(f"{name}: contains NaN/Inf in BF16")


def batched(chunks: list) -> None:
    """The client's preflight, bucket by bucket."""
    for bucket in chunks:
        preflight(bucket, "bench")


def timed(fn: Callable[[list], None], chunks: list, device: torch.device, repeats: int) -> list[float]:
    """Seconds of each run of ``fn`` (after one warm-up)."""
    fn(chunks)
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(chunks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Build the tensors, time both checks, print the result as JSON."""
    args = parse_args(argv)
    device = torch.device(args.device)
    rows, cols = args.shape
    buffer = torch.empty(args.tensors, rows, cols, dtype=torch.bfloat16, device=device).normal_()
    weights = {f"model.layers.{i // 384}.mlp.experts.{i % 384}.w": buffer[i] for i in range(args.tensors)}
    chunks = list(buckets(weights, args.bucket_mb << 20))
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "tensors": args.tensors, "shape": [rows, cols], "buckets": len(chunks),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name, fn in (("per_tensor_s", per_tensor), ("batched_s", batched)):
        result[name] = timed(fn, chunks, device, args.repeats)
        print(json.dumps({name: result[name]}), flush=True)
    result["speedup"] = min(result["per_tensor_s"]) / min(result["batched_s"])
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
