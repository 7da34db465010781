"""``ServerArgs`` patches: our ``--fp8rl-*`` options on SGLang's own parser, validated with the rest of the command
line, and setups we cannot serve refused before SGLang starts any work."""

from __future__ import annotations

import argparse
from typing import Any

from sglang_fp8rl.layers.config import refuse_unsupported_setup
from sglang_fp8rl.server_args import (
    QUANTIZATION_NAME,
    add_cli_args,
    lazy_deepgemm_compile,
    options_from_namespace,
    set_options,
)

_MARK = "_fp8rl_options_added"


def install_server_args_hooks() -> None:
    """Extend SGLang's `ServerArgs.add_cli_args` / `from_cli_args` with our options (idempotent)."""
    from sglang.srt.server_args import ServerArgs

    if getattr(ServerArgs, _MARK, False):
        return
    original_add = ServerArgs.add_cli_args
    original_from = ServerArgs.from_cli_args.__func__

    def add_cli_args_with_fp8rl(parser: argparse.ArgumentParser) -> None:
        original_add(parser)
        add_cli_args(parser)

    def from_cli_args_with_fp8rl(cls: Any, args: argparse.Namespace) -> Any:
        options = options_from_namespace(args)  # validate before SGLang starts any work
        server_args = original_from(cls, args)
        set_options(options)
        if getattr(server_args, "quantization", None) == QUANTIZATION_NAME:
            refuse_unsupported_setup(server_args)
            lazy_deepgemm_compile()
        return server_args

    ServerArgs.add_cli_args = staticmethod(add_cli_args_with_fp8rl)
    ServerArgs.from_cli_args = classmethod(from_cli_args_with_fp8rl)
    setattr(ServerArgs, _MARK, True)
