"""SGLang plugin entry point: makes `--quantization fp8_online_blockwise` exist in every SGLang process.

SGLang's plugin loader (`sglang.srt.plugins.load_plugins`, entry-point group `sglang.srt.plugins`) runs
:func:`register` in the launcher, in `sglang.Engine` and in every scheduler process. It logs and swallows plugin
exceptions, so a failure here also logs an ERROR line that names this package and the fix.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from sglang_fp8rl.server_args import QUANTIZATION_NAME

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = ((0, 5, 17), (0, 6, 0))  # [min, max)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_sglang_version(installed: str | None = None) -> str:
    """Return the installed SGLang version; raise RuntimeError if this package does not support it."""
    if installed is None:
        try:
            installed = version("sglang")
        except PackageNotFoundError as e:
            raise RuntimeError("SGLang is not installed") from e
    low, high = SUPPORTED_SGLANG
    if not low <= _version_tuple(installed) < high:
        supported = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise RuntimeError(f"SGLang {installed} is not supported (sglang-fp8rl needs sglang{supported})")
    return installed


def _add_quantization_choice() -> None:
    from sglang.srt import server_args

    if QUANTIZATION_NAME not in server_args.QUANTIZATION_CHOICES:
        server_args.add_quantization_method_choices([QUANTIZATION_NAME])


def _add_quantization_method() -> None:
    from sglang.srt.layers import quantization

    from sglang_fp8rl.layers.config import Fp8OnlineBlockwiseConfig

    quantization.QUANTIZATION_METHODS[QUANTIZATION_NAME] = Fp8OnlineBlockwiseConfig


def _register() -> None:
    from sglang_fp8rl.hooks import install_hooks

    check_sglang_version()
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
            "Fix: install sglang-fp8rl into an environment with sglang>=0.5.17,<0.6 "
            "(pip install sglang-fp8rl), or unset SGLANG_PLUGINS if it excludes 'fp8_online_blockwise'.",
            QUANTIZATION_NAME,
            e,
        )
        raise
