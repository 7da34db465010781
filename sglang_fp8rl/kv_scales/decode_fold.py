"""Decode on attention backends that take Python-float KV scales, made to read the scale tensors instead.

Triton and FlashInfer pass ``layer.k_scale_float`` / ``v_scale_float`` to their kernels (triton_backend.py:1780-1782,
flashinfer_backend.py:1450-1451). A decode CUDA graph captures those floats as kernel arguments, so a scale written
after capture would reach the cache writer (which reads the tensor) but not the kernel: the cache would be
dequantized with the old scale. Extend runs eagerly (also under piecewise prefill graphs, whose split op calls the
backend outside the graph) and reads the floats at every call, so it only needs the floats kept current.

The fold: for the duration of ``forward_decode`` the layer's floats are the backends' "no scaling" value, the query
is multiplied by the ``k_scale`` tensor before the kernel and the output by the ``v_scale`` tensor after it:

    softmax(q . (code_k * s_k) * sm) (code_v * s_v)  ==  softmax((q * s_k) . code_k * sm) code_v * s_v

Both multiplications read the tensors at replay. With power-of-two scales they are exact, so the result equals the
unfolded kernel's where the kernel keeps q in BF16 (FlashInfer, Triton MHA). Triton's grouped (GQA) decode kernel casts
q to the cache dtype (decode_attention.py:487: ``q.to(K_Buffer.dtype)``); there the fold moves q's E4M3 window by
log2(s_k) binades, so results differ from the unfolded kernel where ``q * s_k`` leaves E4M3's normal range (below
2**-6 or above 448). Servers with the same scales fold identically, so they stay bit-identical to each other.
Cost: two elementwise kernels per layer and decode step (q and the output, ~1 MB each at batch 128 on Qwen3-8B).

FlashAttention-3 reads the tensors itself (flashattention_backend.py:1245-1248): nothing to fold. The CPU backend
(torch_native) ignores KV scales altogether (torch_native_backend.py:299-301, 367-369).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

FOLDED_BACKENDS = {"TritonAttnBackend": 1.0, "FlashInferAttnBackend": None}  # class -> its "no scaling" float
TENSOR_BACKENDS = ("FlashAttentionBackend",)
SCALE_FREE_BACKENDS = ("TorchNativeAttnBackend",)
HYBRID_BACKENDS = ("HybridAttnBackend",)
_FOLD_MARK = "_fp8rl_kv_fold"
# backends on which a recalibration was proven to take effect exactly (scripts/gpu/check_kv.py: recalibrated in place
# == a fresh server with the same weights and scales, bit for bit; FlashInfer with SGLANG_FLASHINFER_USE_PAGED=1, once
# the calibration ran under fixed scales; FlashAttention-3 with the K and V scale writes shown to reach its kernels,
# docs/RESULTS.md section 19); torch_native (CPU) ignores KV scales
VERIFIED_BACKENDS = ("TritonAttnBackend", "FlashInferAttnBackend", "FlashAttentionBackend", "TorchNativeAttnBackend")
# set to 1 to calibrate on a backend not verified yet: for running that verification (scripts/gpu/check_kv.py)
ALLOW_UNVERIFIED_ENV = "FP8RL_KV_ALLOW_UNVERIFIED_BACKEND"


class UnsupportedBackend(ValueError):
    """The attention backend's use of KV scales is unknown to this package."""


def _class_names(obj: Any) -> list[str]:
    return [cls.__name__ for cls in type(obj).__mro__]


def decode_backend(backend: Any) -> Any:
    """The backend object that runs decode (the inner decode backend of a prefill/decode hybrid)."""
    if any(name in HYBRID_BACKENDS for name in _class_names(backend)):
        return backend.decode_backend
    return backend


def scale_source(backend: Any) -> str:
    """How a backend's decode reads KV scales: ``"float"`` (needs the fold), ``"tensor"`` or ``"none"`` (ignores)."""
    names = _class_names(decode_backend(backend))
    if any(name in FOLDED_BACKENDS for name in names):
        return "float"
    if any(name in TENSOR_BACKENDS for name in names):
        return "tensor"
    if any(name in SCALE_FREE_BACKENDS for name in names):
        return "none"
    raise UnsupportedBackend(
        f"attention backend {names[0]} is not known to read FP8 KV scales graph-safely; recalibrated scales need "
        f"--attention-backend triton, flashinfer or fa3"
    )


def _unit_value(backend: Any) -> Optional[float]:
    return next(FOLDED_BACKENDS[name] for name in _class_names(backend) if name in FOLDED_BACKENDS)


def _folded(original: Any, unit: Optional[float]) -> Any:
    def forward_decode(q, k, v, layer, forward_batch, *args, **kwargs):
        k_scale, v_scale = layer.k_scale, layer.v_scale
        if not isinstance(k_scale, torch.Tensor) or not isinstance(v_scale, torch.Tensor):
            return original(q, k, v, layer, forward_batch, *args, **kwargs)
        floats = layer.k_scale_float, layer.v_scale_float
        layer.k_scale_float = layer.v_scale_float = unit
        try:
            out = original(q * k_scale, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            layer.k_scale_float, layer.v_scale_float = floats
        return out.mul_(v_scale)

    setattr(forward_decode, _FOLD_MARK, True)
    return forward_decode


def unverified_reason(backend: Any) -> Optional[str]:
    """Why recalibrated scales cannot be trusted on this backend, or None where they were verified."""
    names = _class_names(decode_backend(backend))
    if any(name in VERIFIED_BACKENDS for name in names) or os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
        return None
    return (f"attention backend {names[0]}: recalibrated FP8 KV scales are not verified on it "
            "(scripts/gpu/check_kv.py has not passed there); use --attention-backend fa3, triton or flashinfer, or "
            "--fp8rl-kv-scales static")


def install_decode_fold(backend: Any) -> bool:
    """Make ``backend``'s decode read the scale tensors (before CUDA graphs are captured); idempotent.

    Returns whether a fold was installed (False for backends that read tensors or ignore scales)."""
    if scale_source(backend) != "float":
        return False
    target = decode_backend(backend)
    if getattr(target.forward_decode, _FOLD_MARK, False):
        return True
    target.forward_decode = _folded(target.forward_decode, _unit_value(target))
    return True


def is_folded(backend: Any) -> bool:
    """Whether ``backend``'s decode carries the fold."""
    return bool(getattr(decode_backend(backend).forward_decode, _FOLD_MARK, False))
