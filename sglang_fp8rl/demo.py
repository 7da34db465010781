"""End-to-end demo: a small random Qwen3 in online blockwise FP8, one weight update, greedy tokens before and after.

    python -m sglang_fp8rl.demo            # GPU if CUDA is available, else the CPU version
    python -m sglang_fp8rl.demo --cpu      # the CPU version on any machine

Both versions tell the same story on a Qwen3 with random BF16 weights (4 layers, hidden 256; config.json,
model.safetensors and a word-level tokenizer, written to a temporary folder):

1. load it with ``--quantization fp8_online_blockwise`` and print the per-layer scheme summary;
2. generate greedy tokens for a fixed prompt;
3. push new random weights (W1) through SGLang's weight-update path, which validates them and re-quantizes them
   into the existing FP8 storage;
4. generate again; print the tokens before and after, and the update's statistics.

GPU: the stock server (``python -m sglang.launch_server ... --quantization fp8_online_blockwise``), W1 pushed as CUDA
IPC handles by :func:`sglang_fp8rl.trainer.push_state_dict`. While the server starts, the demo reports
what it is doing (from its log); at the end it prints how long each start-up phase took.

CPU: SGLang's own ModelRunner in this process (SGLang's HTTP server needs CUDA), W1 through SGLang's
``WeightUpdater.update_weights_from_tensor``, the method behind ``/update_weights_from_tensor``. 15-35 s on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time

from sglang_fp8rl.demo_common import say
from sglang_fp8rl.weight_sync.buckets import DEFAULT_BUCKET_BYTES

_STARTED = time.perf_counter()  # the CPU version's total counts its imports, most of a cold run


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of ``python -m sglang_fp8rl.demo``."""
    p = argparse.ArgumentParser(prog="python -m sglang_fp8rl.demo", description=__doc__.split("\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run the CPU version even where CUDA is available")
    p.add_argument("--keep", metavar="DIR", default=None, help="work in DIR and keep the checkpoint (and server log)")
    gpu = p.add_argument_group("GPU version")
    gpu.add_argument("--port", type=int, default=30030)
    gpu.add_argument("--mem", type=float, default=0.2, help="--mem-fraction-static (default 0.2)")
    gpu.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES >> 20)
    gpu.add_argument("--timeout", type=float, default=420, help="seconds to wait for the server (default 420)")
    gpu.add_argument("--fresh-caches", action="store_true",
                     help="start the server with empty JIT caches (Triton, DeepGEMM, inductor, tvm-ffi) under the work "
                          "folder: the compile work of a cold machine, on a warm one")
    gpu.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], metavar="ARG",
                     help="the rest of the command line goes to launch_server, after the demo's own flags (later ones "
                          "win), e.g. --server-args --fp8rl-jit-workers 0")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the GPU version where CUDA is available, else (or with --cpu) the CPU version; 0 when the update went in."""
    args = parse_args(argv)
    if args.cpu or not cuda_available():
        if not args.cpu:
            say("no CUDA GPU here (torch.cuda.is_available() is False): running the CPU version")
        from sglang_fp8rl.demo_cpu import run_cpu

        return run_cpu(args, started=_STARTED)
    from sglang_fp8rl.demo_gpu import run_gpu

    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
