"""The worker side of the DeepGEMM JIT warm-up: a process that launches DeepGEMM's block-FP8 GEMM for each job it
reads, so that DeepGEMM compiles (and caches on disk) the kernel of that launch.

Protocol (one JSON object per line): the worker answers ``{"ready": true}`` once started, then one line per job line
it reads: ``{"s": seconds}`` or ``{"error": text}``; it exits at the end of its input. The parent side is
:mod:`sglang_fp8rl.kernels.jit_pool`. Started as ``python -m sglang_fp8rl.kernels.jit_worker``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO

import torch

from sglang_fp8rl.kernels.deepgemm import K_MULTIPLE, candidate_errors

DEFAULT_RUNNER = "sglang_fp8rl.kernels.jit_worker:deepgemm_job"
READY = "ready"
ERROR_TAIL = 600  # characters of an error (or of a dead worker's stderr) kept for the report


@dataclasses.dataclass(frozen=True)
class Job:
    """One launch of DeepGEMM's block-FP8 GEMM on [m, k] x [n, k]^T, under ``num_sms`` SMs (None: DeepGEMM's own)."""

    n: int
    k: int
    m: int
    num_sms: int | None = None


def deepgemm_job(job: Job, state: dict) -> None:
    """Launch DeepGEMM's block-FP8 GEMM once for ``job`` exactly as SGLang's DeepGEMM linear does.

    SGLang (``deepgemm_w8a8_block_fp8_linear_with_fallback``) calls ``deep_gemm.fp8_gemm_nt((xq, xs), (w, ws), out)``
    with defaults: xq [M, K] e4m3, xs [M, K/128] float32 column-major with rows padded to 4 (TMA), w [N, K] e4m3,
    ws [N/128, K/128] float32, out [M, N] bf16. The worker builds those operands itself instead of importing SGLang,
    whose import takes 25-35 s per process on an H100 machine; tests/gpu/test_jit_warmup_gpu.py checks that SGLang's
    own call then finds the kernels compiled."""
    import deep_gemm  # CUDA-only; a worker imports it at its first job

    block = K_MULTIPLE
    if "default_sms" not in state:
        state["default_sms"] = deep_gemm.get_num_sms()
    if (job.n, job.k) not in state:
        weight = torch.zeros(job.n, job.k, device="cuda", dtype=torch.float8_e4m3fn)
        scale = torch.ones(-(-job.n // block), -(-job.k // block), device="cuda")
        state[(job.n, job.k)] = (weight, scale)
    weight, scale = state[(job.n, job.k)]
    x = torch.zeros(job.m, job.k, device="cuda", dtype=torch.float8_e4m3fn)
    groups, padded_m = -(-job.k // block), -(-job.m // 4) * 4
    x_scale = torch.ones(groups, padded_m, device="cuda").t()[: job.m]
    out = torch.empty(job.m, job.n, device="cuda", dtype=torch.bfloat16)
    deep_gemm.set_num_sms(job.num_sms or state["default_sms"])
    try:
        deep_gemm.fp8_gemm_nt((x, x_scale), (weight, scale), out)
    finally:
        deep_gemm.set_num_sms(state["default_sms"])
    torch.cuda.synchronize()


def load_runner(spec: str) -> Callable[[Job, dict], None]:
    """``module:function`` -> the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--runner must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def worker_loop(runner: Callable[[Job, dict], None], lines: Iterable[str], out: TextIO,
                errors: tuple[type[BaseException], ...]) -> None:
    """Answer ``ready``, then one JSON line per job line: its seconds, or the error it raised."""
    state: dict = {}
    _reply(out, {READY: True})
    for line in lines:
        if not line.strip():
            continue
        job = Job(**json.loads(line))
        t = time.monotonic()
        try:
            runner(job, state)
        except errors as e:
            _reply(out, {"error": f"{job}: {type(e).__name__}: {e}"[:ERROR_TAIL]})
            continue
        _reply(out, {"s": round(time.monotonic() - t, 4)})


def _reply(out: TextIO, msg: dict) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of a worker process."""
    p = argparse.ArgumentParser(description="sglang-fp8rl JIT warm-up worker (started by WarmupPool)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--runner", default=DEFAULT_RUNNER)
    args = p.parse_args(argv)
    runner = load_runner(args.runner)
    # pinned by index, not by "runner is deepgemm_job": run as a script this module is __main__, and load_runner
    # imports a second copy of it, so that identity never holds (the workers of every rank then used GPU 0)
    if torch.cuda.is_available():
        torch.cuda.set_device(args.device)
    # the real stdout carries our protocol; anything libraries print goes to stderr (the worker's log file)
    out, sys.stdout = sys.stdout, sys.stderr
    worker_loop(runner, sys.stdin, out, candidate_errors())


if __name__ == "__main__":
    main()
