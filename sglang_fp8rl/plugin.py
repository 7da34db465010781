"""SGLang plugin entry point: makes `--quantization fp8_online_blockwise` exist in every SGLang process.

SGLang's plugin loader (`sglang.srt.plugins.load_plugins`, entry-point group `sglang.srt.plugins`) runs
:func:`register` in the launcher, in `sglang.Engine` and in every scheduler process. It logs and swallows plugin
exceptions, so a failure here also logs an ERROR line that names this package and the fix.
"""

from __future__ import annotations

import logging

from sglang_fp8rl.compat.versions import PRIMARY_SGLANG, SUPPORTED_SGLANG, check_sglang_version
from sglang_fp8rl.server_args import QUANTIZATION_NAME

logger = logging.getLogger(__name__)


def _add_quantization_choice() -> None:
    from sglang.srt import server_args

    if QUANTIZATION_NAME not in server_args.QUANTIZATION_CHOICES:
        server_args.add_quantization_method_choices([QUANTIZATION_NAME])


def _add_quantization_method() -> None:
    from sglang.srt.layers import quantization

    from sglang_fp8rl.layers.config import Fp8OnlineBlockwiseConfig

    quantization.QUANTIZATION_METHODS[QUANTIZATION_NAME] = Fp8OnlineBlockwiseConfig


def _register() -> None:
    check_sglang_version()  # first: an unsupported SGLang must fail here, not at an internal import below
    from sglang_fp8rl.hooks import install_hooks

    _add_quantization_choice()
    _add_quantization_method()
    install_hooks()


def register() -> None:
    """Register `fp8_online_blockwise` with SGLang (idempotent)."""
    try:
        _register()
    except (ImportError, AttributeError, RuntimeError, TypeError, ValueError) as e:
        logger.error(
            "sglang-fp8rl: registering --quantization %s FAILED: %s. The server will not accept that flag. "
            "Fix: install a supported SGLang (%s; pip install 'sglang==%s'), "
            "or unset SGLANG_PLUGINS if it excludes 'fp8_online_blockwise'.",
            QUANTIZATION_NAME,
            e,
            ", ".join(SUPPORTED_SGLANG),
            PRIMARY_SGLANG,
        )
        raise
