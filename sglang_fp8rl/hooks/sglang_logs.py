"""SGLang's start-up warning that an unlisted quantization "is not fully optimized yet. The speed can be slower
than non-quantized models." is untrue for `fp8_online_blockwise` (docs/RESULTS.md measures it faster than BF16) and
its list of methods is a local variable, so the warning is filtered here; the plugin logs its own one-line summary
of the per-layer schemes instead (layers/config.py)."""

from __future__ import annotations

import logging

from sglang_fp8rl.server_args import QUANTIZATION_NAME

SGLANG_LOGGER = "sglang.srt.configs.model_config"


class NotOptimizedWarningFilter(logging.Filter):
    """Drops SGLang's 'not fully optimized yet' warning for our quantization only."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for that one warning about fp8_online_blockwise."""
        return not ("not fully optimized yet" in str(record.msg) and QUANTIZATION_NAME in map(str, record.args or ()))


def install_log_filter() -> None:
    """Attach the filter to SGLang's model-config logger (idempotent)."""
    logger = logging.getLogger(SGLANG_LOGGER)
    if not any(isinstance(f, NotOptimizedWarningFilter) for f in logger.filters):
        logger.addFilter(NotOptimizedWarningFilter())
