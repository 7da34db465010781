"""SGLang plugin entry point: makes `--quantization fp8_online_blockwise` exist in every SGLang process.

SGLang's plugin loader (`sglang.srt.plugins.load_plugins`, entry-point group `sglang.srt.plugins`) runs
:func:`register` in the launcher, in `sglang.Engine` and in every scheduler process. It logs and swallows plugin
exceptions, so a failure here also logs an ERROR line that names this package and the fix.
"""

from __future__ import annotations

import logging
from typing import Any

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


class _Unavailable(type):
    """Metaclass of the stand-in method registered when registration failed: any use names the reason."""

    reason = ""

    def __getattr__(cls, name: str):
        raise RuntimeError(f"--quantization {QUANTIZATION_NAME} is unavailable: {cls.reason}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"--quantization {QUANTIZATION_NAME} is unavailable: {cls.reason}")


def _not_this_method(cls: _Unavailable, hf_quant_cfg: Any, user_quant: str | None) -> None:
    """SGLang asks every registered method whether it claims a checkpoint that has a quantization_config
    (``ModelConfig._verify_quantization``, with or without --quantization): the stand-in claims none, and fails only
    a server that asked for it."""
    if user_quant == QUANTIZATION_NAME:
        raise RuntimeError(f"--quantization {QUANTIZATION_NAME} is unavailable: {cls.reason}")


def unavailable_method(reason: str) -> _Unavailable:
    """The stand-in for our method when registration failed: a server that uses it stops with ``reason``; the
    queries SGLang makes of every registered method answer "not me", so other models are served as without us."""
    return _Unavailable("Fp8OnlineBlockwiseUnavailable", (), {
        "reason": reason, "override_quantization_method": classmethod(_not_this_method)})


def _refuse_at_start(reason: str) -> None:
    """Keep the flag, but make a server that uses it stop at start with ``reason`` (SGLang only logs a plugin's
    exception: without this the flag would be an argparse "invalid choice", or a server without our method)."""
    try:
        from sglang.srt.layers import quantization

        _add_quantization_choice()
        quantization.QUANTIZATION_METHODS[QUANTIZATION_NAME] = unavailable_method(reason)
    except Exception:  # noqa: BLE001 - SGLang itself does not import: nothing to register with; the log says why
        logger.exception("[fp8rl] could not register the refusal of --quantization %s", QUANTIZATION_NAME)


def register() -> None:
    """Register `fp8_online_blockwise` with SGLang (idempotent)."""
    try:
        _register()
    except (ImportError, AttributeError, RuntimeError, TypeError, ValueError) as e:
        reason = (f"registering it FAILED: {e}. Fix: install a supported SGLang ({', '.join(SUPPORTED_SGLANG)}; "
                  f"pip install 'sglang=={PRIMARY_SGLANG}'), or unset SGLANG_PLUGINS if it excludes "
                  f"'{QUANTIZATION_NAME}'")
        logger.error("sglang-fp8rl: --quantization %s: %s", QUANTIZATION_NAME, reason)
        _refuse_at_start(reason)
        raise
