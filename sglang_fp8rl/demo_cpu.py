"""The CPU version of ``python -m sglang_fp8rl.demo``: SGLang's own ModelRunner in this process, no server.

Same story as the GPU version (see :mod:`sglang_fp8rl.demo`): the plugin is found through SGLang's entry point,
the model is loaded by SGLang's loader into our FP8 layers, and W1 goes through SGLang's
``WeightUpdater.update_weights_from_tensor`` (what ``/update_weights_from_tensor`` calls after deserializing), which
ends in the model's ``load_weights`` guarded by this package. SGLang's HTTP server itself needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import Iterator

from sglang_fp8rl.compat.updates import updater_of
from sglang_fp8rl.demo_common import (
    DEMO_DIMS,
    NEW_TOKENS,
    PROMPT,
    SEED_AFTER,
    SEED_BEFORE,
    random_state_dict,
    report,
    say,
    work_dir,
    write_checkpoint,
)
from sglang_fp8rl.server_args import QUANTIZATION_NAME

SUMMARY_MARK = "linear layers"  # in the one [fp8rl] scheme-summary line of a load


class _LineCollector(logging.Handler):
    """Keeps the messages of [fp8rl] scheme-summary log records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("[fp8rl]") and SUMMARY_MARK in message:
            self.lines.append(message)


class _DropMessage(logging.Filter):
    """Drops the log records of one message."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


@contextlib.contextmanager
def fp8rl_summary_lines() -> Iterator[list[str]]:
    """The [fp8rl] scheme-summary lines this package logs inside the block (what the server's log shows)."""
    collector = _LineCollector()
    package_logger = logging.getLogger("sglang_fp8rl")
    package_logger.addHandler(collector)
    try:
        yield collector.lines
    finally:
        package_logger.removeHandler(collector)


def run_cpu(args: argparse.Namespace, started: float | None = None) -> int:
    """Load, generate, update, generate again on CPU; 0 when the update was applied. ``started``: the
    ``time.perf_counter()`` the reported total counts from (default: now), so that it includes the imports."""
    t_start = time.perf_counter() if started is None else started
    from sglang_fp8rl.cpu_runner import build_runner, greedy_generate, install_cpu_stubs

    install_cpu_stubs()  # before anything imports SGLang
    import torch

    from sglang_fp8rl.hooks import server_args as server_args_hooks
    from sglang_fp8rl.hooks.scheduler import telemetry

    say(f"torch and SGLang imported ({time.perf_counter() - t_start:.0f} s since the demo started)")
    t0 = time.perf_counter()
    # the engine warns at start that decode runs without CUDA graphs; a CPU has none, so the advice is for GPUs only
    gpu_only = _DropMessage(server_args_hooks.EAGER_DECODE_WARNING)
    server_args_hooks.logger.addFilter(gpu_only)
    with work_dir(args.keep) as work:
        model_dir = os.path.join(work, "model")
        say(f"CPU version: SGLang's ModelRunner in this process. Writing a random Qwen3 ({DEMO_DIMS}) to {model_dir}")
        write_checkpoint(model_dir, DEMO_DIMS, seed=SEED_BEFORE)
        say(f"loading it with --quantization {QUANTIZATION_NAME} (SGLang's loader, our FP8 layers)")
        try:
            with fp8rl_summary_lines() as log_lines:
                runner = build_runner(model_dir, ["--quantization", QUANTIZATION_NAME])
        finally:
            server_args_hooks.logger.removeFilter(gpu_only)
        model = runner.torch_runner.model
        say(f"loaded in {time.perf_counter() - t0:.0f} s; generating {NEW_TOKENS} greedy tokens")
        with torch.no_grad():
            before = greedy_generate(runner, PROMPT, NEW_TOKENS)
            state_before = telemetry(model)
            w1 = list(random_state_dict(DEMO_DIMS, seed=SEED_AFTER).items())
            say(f"pushing W1 ({len(w1)} BF16 tensors) through SGLang's WeightUpdater.update_weights_from_tensor")
            t = time.perf_counter()
            ok, message = updater_of(runner.torch_runner).update_weights_from_tensor(w1)
            push_s = time.perf_counter() - t
            after = greedy_generate(runner, PROMPT, NEW_TOKENS)
            state_after = telemetry(model)
    pushed = (f"pushed {len(w1)} tensors in 1 request through WeightUpdater.update_weights_from_tensor: "
              f"success={ok} ({message}), {push_s * 1e3:.0f} ms wall")
    applied = report(before, after, state_before, state_after, pushed, log_lines)
    say(f"done in {time.perf_counter() - t_start:.0f} s since the demo started (imports included)")
    return 0 if applied and ok else 1
