"""``ServerArgs`` patches: our ``--fp8rl-*`` options on SGLang's own parser, validated with the rest of the command
line, and setups we cannot serve refused before SGLang starts any work."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from sglang_fp8rl.compat.runtime import decode_graph_max_to_fill, decode_graphs_off
from sglang_fp8rl.layers.config import refuse_unsupported_setup
from sglang_fp8rl.server_args import (
    FP8_DECODE_GRAPH_MAX_BS,
    OPTIONS_MARK,
    QUANTIZATION_NAME,
    add_cli_args,
    lazy_deepgemm_compile,
    options_from_namespace,
    set_options,
)

logger = logging.getLogger(__name__)


def fit_decode_graphs_to_capacity(args: argparse.Namespace) -> None:
    """Capture decode CUDA graphs up to :data:`FP8_DECODE_GRAPH_MAX_BS` unless the command line sets the capture.

    FP8 weights and an FP8 KV cache leave room for more requests than BF16 (a 1.11x / 2.22x KV pool on an H100 with
    Qwen3-8B shapes, docs/RESULTS.md 17a), so a whole RL rollout batch can run at once, past SGLang's default capture
    (256 on an 80 GB GPU below TP 4), where decode runs eagerly. SGLang sizes its memory reserve from this limit, so
    the larger graphs are accounted for."""
    max_field = decode_graph_max_to_fill(args)
    if max_field is None:
        return
    setattr(args, max_field, FP8_DECODE_GRAPH_MAX_BS)
    logger.info("[fp8rl] decode CUDA graphs captured up to batch %d (FP8 weights/KV admit more running requests than "
                "SGLang's default capture; --%s overrides)", FP8_DECODE_GRAPH_MAX_BS,
                max_field.replace("_", "-"))


EAGER_DECODE_WARNING = (
    "[fp8rl] decode runs without CUDA graphs: a block-FP8 linear launches two kernels (activation quantization, "
    "GEMM) where BF16 launches one, and without graphs the host time of those launches sets the step. Measured on an "
    "H100 (Qwen3-8B shapes, bs 64-384) FP8 decoded at 0.59-0.71x BF16's tokens/s without graphs; with them, faster "
    "than BF16 at every batch size (docs/RESULTS.md 19, 20). Keep decode CUDA graphs on for FP8 rollout.")


def warn_if_decode_is_eager(server_args: Any) -> None:
    """One warning at start when decode CUDA graphs are off (verl's enforce_eager, --disable-cuda-graph, ...)."""
    if decode_graphs_off(server_args):
        logger.warning(EAGER_DECODE_WARNING)


def install_server_args_hooks() -> None:
    """Extend SGLang's `ServerArgs.add_cli_args` / `from_cli_args` with our options (idempotent)."""
    from sglang.srt.server_args import ServerArgs

    if getattr(ServerArgs, OPTIONS_MARK, False):
        return
    original_add = ServerArgs.add_cli_args
    original_from = ServerArgs.from_cli_args.__func__

    def add_cli_args_with_fp8rl(parser: argparse.ArgumentParser) -> None:
        original_add(parser)
        add_cli_args(parser)

    def from_cli_args_with_fp8rl(cls: Any, args: argparse.Namespace) -> Any:
        options = options_from_namespace(args)  # validate before SGLang starts any work
        if getattr(args, "quantization", None) == QUANTIZATION_NAME:
            fit_decode_graphs_to_capacity(args)
        server_args = original_from(cls, args)
        set_options(options)
        if getattr(server_args, "quantization", None) == QUANTIZATION_NAME:
            refuse_unsupported_setup(server_args)
            lazy_deepgemm_compile()
            warn_if_decode_is_eager(server_args)
        return server_args

    ServerArgs.add_cli_args = staticmethod(add_cli_args_with_fp8rl)
    ServerArgs.from_cli_args = classmethod(from_cli_args_with_fp8rl)
    setattr(ServerArgs, OPTIONS_MARK, True)
