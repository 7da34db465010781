"""A tensor's version counter, where it has one (Triton-free).

PyTorch moves a tensor's version counter (shared by its views) on every in-place write; this package uses it to tell
that a tensor still holds what it held when something was derived from it (kernels/producers.py: handed-over codes;
kernels/step_plan.py: a step's plan). Tensors made under ``torch.inference_mode()`` have no counter and raise on
``_version``; SGLang makes its forward's tensors so when ``SGLANG_ENABLE_TORCH_INFERENCE_MODE`` is set. For them the
answer is None: nothing derived from them can be proven current, so nothing is reused.
"""

from __future__ import annotations

import torch


def version_counter(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for an inference tensor (which has none)."""
    return None if t.is_inference() else t._version
