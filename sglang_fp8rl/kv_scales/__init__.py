"""FP8 KV-cache scales that follow the policy: measured on the engine, written in place, read by every backend.

* :mod:`.numerics`: K/V amax -> per-layer dequantization scale (margin, power-of-two rounding, floor, validation);
  pure torch, no SGLang.
* :mod:`.layers`: SGLang's ``RadixAttention`` objects: attach scale tensors, write them in place, parse trainer names.
* :mod:`.observer`: per-layer, per-KV-head amax of K and V recorded at the attention backend during a forward.
* :mod:`.decode_fold`: decode on backends that read Python-float scales (Triton, FlashInfer) made CUDA-graph safe.
* :mod:`.calibrate`: the calibration batch, one forward through SGLang's ModelRunner, and the recalibration step.

docs/KV_SCALES.md gives the design, the SGLang 0.5.17 facts it rests on, and what was measured.
"""

from __future__ import annotations

from typing import Optional

from sglang_fp8rl.server_args import QUANTIZATION_NAME

KV_SCALE_MODES = ("static", "calibrate")  # --fp8rl-kv-scales
CALIBRATED_KV_DTYPES = ("fp8_e4m3",)  # --kv-cache-dtype values whose scales this package recalibrates


def default_kv_scale_mode(kv_cache_dtype: str, quantization: Optional[str]) -> str:
    """``calibrate`` when the KV cache is FP8 E4M3 and our quantization serves the model, else ``static``."""
    if kv_cache_dtype in CALIBRATED_KV_DTYPES and quantization == QUANTIZATION_NAME:
        return "calibrate"
    return "static"


def resolve_kv_scale_mode(option: str, kv_cache_dtype: str, quantization: Optional[str]) -> str:
    """The mode in force for ``--fp8rl-kv-scales option``; ValueError for ``calibrate`` without an FP8 E4M3 cache."""
    if option == "auto":
        return default_kv_scale_mode(kv_cache_dtype, quantization)
    if option == "calibrate" and kv_cache_dtype not in CALIBRATED_KV_DTYPES:
        raise ValueError(f"--fp8rl-kv-scales calibrate needs --kv-cache-dtype in {CALIBRATED_KV_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    if option not in KV_SCALE_MODES:
        raise ValueError(f"--fp8rl-kv-scales must be auto or one of {KV_SCALE_MODES}, got {option!r}")
    return option
