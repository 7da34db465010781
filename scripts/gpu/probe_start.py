#!/usr/bin/env python3
"""Does a server of this layout start? One stock `launch_server` with the check scripts' flags, BF16 or FP8, and a
time limit; on a start that never ends, the Python stacks of every process in its log (server_io.wait_healthy).

Used to tell a hang of SGLang's from one of the plugin's: the same layout started BF16 (no --quantization) and
with fp8_online_blockwise, side by side.
  python3 scripts/gpu/probe_start.py --model-dir M --out O --moe --engine bf16 -- --tp-size 2 --ep-size 2
Prints one line `probe ENGINE FLAGS: healthy after S s` or `... NOT healthy ...` with the last lines of the log;
exit code 0 when healthy, 1 otherwise, 2 without CUDA.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import server_io
from server_io import stop, wait_healthy


def launch(model: str, port: int, log: str, engine: str, flags: list[str]) -> subprocess.Popen:
    """server_io.launch of a dummy-weight server: BF16 (no --quantization) or with our method."""
    return server_io.launch(model, port, log, "--load-format", "dummy", *flags, mem=0.2,
                            quantization="fp8_online_blockwise" if engine == "fp8" else None)


def main(argv: list[str] | None = None) -> int:
    """Start, wait, report, stop."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--moe", action="store_true", help="the small Qwen3-MoE of check_server.py")
    p.add_argument("--engine", choices=["bf16", "fp8"], default="fp8")
    p.add_argument("--port", type=int, default=32010)
    p.add_argument("--timeout-s", type=float, default=180.0)
    p.add_argument("flags", nargs="*", help="launch flags after --, e.g. -- --tp-size 2 --ep-size 2")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("probe_start.py needs CUDA", file=sys.stderr)
        return 2
    from check_server import model_folder

    os.makedirs(args.out, exist_ok=True)
    model = model_folder(args.model_dir, args.moe)
    log = os.path.join(args.out, f"probe_{args.engine}.log")
    proc = launch(model, args.port, log, args.engine, args.flags)
    what = f"probe {args.engine} {' '.join(args.flags)}"
    try:
        print(f"{what}: healthy after {wait_healthy(args.port, proc, args.timeout_s):.0f} s", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:  # a timeout has dumped the stacks already (wait_healthy)
        tail = open(log, errors="replace").read().splitlines()[-40:]
        print(f"{what}: NOT healthy: {e}\n" + "\n".join(ln[:300] for ln in tail), flush=True)
        return 1
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
