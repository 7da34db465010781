"""``ModelConfig`` patch: where a quantization_config under our method comes from is judged when SGLang verifies the
model's quantization, in every process that builds a ModelConfig (the launcher's ServerArgs, each scheduler), before
any weight is read. The quantization methods themselves cannot tell: SGLang hands them the config with the
``--json-model-override-args`` override already applied, and the launcher has published no ServerArgs yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_fp8rl.layers.quant_source import check_quantization_source
from sglang_fp8rl.server_args import QUANTIZATION_NAME


def wrap_verify_quantization(original: Callable) -> Callable:
    """``ModelConfig._verify_quantization``: with our method, refuse a checkpoint quantized on disk and an injected
    quantization_config of another scheme first (layers/quant_source.py)."""

    def verify_quantization(self: Any) -> None:
        if str(getattr(self, "quantization", None) or "").lower() == QUANTIZATION_NAME:
            check_quantization_source(self.model_path, getattr(self, "revision", None),
                                      getattr(self, "model_override_args", None))
        return original(self)

    return verify_quantization
