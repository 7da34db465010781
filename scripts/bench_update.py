#!/usr/bin/env python3
"""Full-model weight update, side by side: BF16 engine vs FP8-online engine, same payload, every update path.

Per engine (`bf16` = no --quantization, `fp8` = --quantization fp8_online_blockwise), one server at a time
(`python -m sglang.launch_server`, `--load-format dummy`, the flags of scripts/gpu/check_server.py), CUDA IPC,
``--bucket-mb`` buckets (default 512 MB). Paths (one warm-up push, then ``--repeats`` timed pushes each):
  tensor         by tensor, ``push_state_dict(..., atomic=False)``: one request per bucket (the old behaviour; the
                 only one a BF16 server takes)                                                     (both engines)
  atomic         by tensor, ``atomic=True``: every bucket validated first (requests that write nothing), then
                 applied                                                                                (fp8)
  validate_only  the validate-only phase of the atomic step alone (load_format "fp8rl.validate")       (fp8)
  prequant       pre-quantized FP8: every linear as float8_e4m3fn codes + power-of-two weight_scale_inv,
                 ``atomic=False``                                                                       (fp8)
  disk           ``push_from_disk`` of the BF16 payload saved as safetensors (``--disk-repeats``)       (both engines)
Measured per path:
  * wall time (client-side clock around the push);
  * peak extra GPU memory: a client thread samples device-wide used memory (``torch.cuda.mem_get_info``, every
    ``--poll-ms``) minus the level right before the push; and, on the FP8 engine, the server's own allocator peak
    (``last_update.peak_extra_bytes``);
  * FP8 engine: the validate / apply split from ``/get_server_info`` internal_states[0]["fp8rl"]["last_update"]
    (summed over the buckets of one extra push, read after each bucket; the disk path's last_update), the bytes the
    apply step moves (BF16 read + FP8 written + scales, or codes copied, plus BF16 params read + written), and that
    traffic per apply second as a fraction of a device-to-device copy measured in the client (1 GiB, read + write).
Targets (issue 16), FP8 engine against the BF16 engine: by tensor <= 1.10x BF16 by tensor; pre-quantized <= 0.80x
BF16 by tensor; disk <= 1.30x BF16 disk; peak extra memory <= the largest single BF16 tensor (rounded up to the
allocator's 2 MiB blocks); apply >= 50% of copy bandwidth. The atomic step's cost is reported against by tensor.

The payload (random BF16, every HF tensor of the shape) is generated once on the GPU in this process and reused for
both engines; it is also saved once as safetensors under OUT/tmp/w1 for the disk path (in a background thread while
the first server starts; deleted at the end unless --keep-tmp). The pre-quantized payload is built from it on the
GPU before the FP8 engine's prequant path and freed after it.

Scale-out (issue 36; scripts/update_scaleout.py): ``--tp-size N`` runs both engines at TP N on GPUs 0..N-1;
  broadcast      ``push_distributed`` from this process as the trainer (rank 0 of an update group over NCCL, on a GPU
                 outside the engine's: ``--trainer-gpu``), ``init_update_group`` once per engine       (both engines)
``--paths`` picks the paths, ``--kv-cache-dtype fp8_e4m3`` reports the FP8 engine's KV recalibration per step (its
kv_scales telemetry), ``--dry-run`` prints the plan (GPUs, payload per GPU, launch flags, targets) without a GPU.
Each path with engine telemetry gets a breakdown line: validate + quantize and write + transfer and the rest.
Targets (issue 36), Qwen3-30B-A3B shapes at TP 4: FP8 engine <= 1.0 s per full update by tensor and by broadcast, and
no slower than the BF16 engine's own update of that path in the same run.

Caveat on memory: the server's PyTorch caching allocator keeps what it once reserved, so device-wide polling sees
only *new* reservations; the first push after startup is the most informative polled number.

usage (GPU machine, after `source scripts/gpu/env.sh`):
  python3 scripts/bench_update.py --model-dir /tmp/fp8rl_suite/models --out /tmp/fp8rl_suite/update     (Qwen3-8B)
  python3 scripts/bench_update.py --model-dir ... --out ... --skip-disk --repeats 3
  python3 scripts/bench_update.py --model-dir ... --out ... --model qwen3-small                         (fast)
  python3 scripts/bench_update.py --model-dir ... --out ... --model qwen3-30b-a3b --tp-size 2 --paths tensor broadcast
  python3 scripts/bench_update.py --model-dir m --out o --model qwen3-30b-a3b --tp-size 4 --gpus 4 --dry-run   (CPU)
  python3 scripts/bench_update.py ... --paths flattened --bucket-mb 2048 --profile-buckets 1   (+ a profiled push)
Writes OUT/update_results.json (after every step) and OUT/summary.md; prints the table and the target lines.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Optional

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import update_scaleout
from update_bench_run import Bench
from update_bench_server import launch_command


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model-dir", required=True, help="folder of dummy-weight models (scripts/gpu/make_models.py; "
                                                      "the --model folder is written there if missing)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-8b",
                   choices=["qwen3-8b", "qwen3-small", "qwen3-30b-a3b", "qwen3-30b-a3b-24l"])
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--deadline-s", type=float, default=530.0, help="whole-run budget in seconds (default 530)")
    p.add_argument("--repeats", type=int, default=2, help="timed pushes per path other than disk (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up pushes per path other than disk (default 1)")
    p.add_argument("--disk-repeats", type=int, default=2, help="timed disk updates per engine (default 2)")
    p.add_argument("--disk-warmup", type=int, default=0,
                   help="warm-up disk updates per engine (default 0: the tensor path already warmed the kernels)")
    p.add_argument("--skip-disk", action="store_true", help="no safetensors copy, no disk path")
    p.add_argument("--keep-tmp", action="store_true", help="keep OUT/tmp/w1 (the 16 GB checkpoint)")
    p.add_argument("--engines", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--mem", type=float, default=0.5, help="--mem-fraction-static of the servers (default 0.5)")
    p.add_argument("--port", type=int, default=30020)
    p.add_argument("--poll-ms", type=float, default=5.0, help="memory sampling period (default 5 ms)")
    p.add_argument("--profile-buckets", type=int, default=0,
                   help="after --profile-path's timed pushes, push this many buckets under SGLang's profiler on each "
                        "engine and report where the time goes per tensor (scripts/update_bench_profile.py; 0: off)")
    p.add_argument("--profile-path", default="flattened", choices=["tensor", "flattened"])
    update_scaleout.add_args(p)
    return p.parse_args(argv)


def dry_run(args: argparse.Namespace) -> int:
    """Print the run's plan as JSON (no GPU, no server); 0, or 2 with the reason for a layout that cannot run."""
    from make_models import ensure
    from server_payloads import hf_shapes

    from sglang_fp8rl.cpu_runner import install_cpu_stubs

    install_cpu_stubs()  # SGLang's import (the launch flags) without a working torchvision, as on a CPU machine
    try:
        plan = update_scaleout.make_plan(args, args.gpus or args.tp_size)
    except ValueError as e:
        print(f"bench_update.py: {e}", file=sys.stderr)
        return 2
    model = ensure(args.model_dir, [args.model])[0]
    shapes = hf_shapes(json.load(open(os.path.join(model, "config.json"))))
    commands = {eng: " ".join(launch_command(model, args.port, eng, args.mem, plan.server_flags))
                for eng in args.engines}
    print(json.dumps(update_scaleout.dry_run(args, shapes, commands), indent=1))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_update.py needs a CUDA GPU (it launches SGLang servers and pushes CUDA IPC handles)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a suite timeout still stops the server (finally)
    try:
        plan = update_scaleout.make_plan(args, torch.cuda.device_count())
    except ValueError as e:  # a layout this machine cannot run (the message names the option)
        print(f"bench_update.py: {e}", file=sys.stderr)
        return 2
    return Bench(args, argv, plan).run()


if __name__ == "__main__":
    sys.exit(main())
