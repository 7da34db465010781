"""One split-KV plan per decode step, shared by its layers (the ``step_plan`` form of split_kv_plan.FORMS).

Every layer of a decode step attends over the same lengths: SGLang's FA3 backend hands each layer's call the same
``cache_seqlens`` tensor, its forward metadata's. The split-KV kernel's plan depends only on those lengths and on the
call's grid (batch, KV heads, device), so the step's first call writes it (one launch) and the step's other calls
read it, instead of one plan launch a layer (2.4-2.6 us each in a served step, docs/RESULTS.md sec. 27b, 36c).

A plan is the step's while it was written for the same tensor object (SGLang makes a new one for every eager step),
unchanged since (its version counter: SGLang refills a graph's static lengths in place; a tensor made under
``torch.inference_mode()`` has none, and gets a plan of its own at every call), for the same grid, under
the same CUDA-graph capture state. The last condition is the one a captured graph needs: SGLang runs a batch size's
forward eagerly before capturing it, on the tensor the capture uses; the captured forward must write its own plan
in its first layer, so that every replay writes it again for the lengths of that replay.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from sglang_fp8rl.kernels.tensor_version import version_counter


def capturing(device: torch.device) -> bool:
    """Whether work launched on ``device`` now is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class StepPlan:
    """The plan of the decode step in flight: written by its first split-KV call, read by the others."""

    def __init__(self) -> None:
        self._lengths: weakref.ref | None = None
        self._key: tuple[Any, ...] | None = None
        self._plan: torch.Tensor | None = None

    @staticmethod
    def key(q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor) -> tuple[Any, ...]:
        """What a plan for these operands depends on besides the tensor object of the lengths (first: the lengths'
        version counter, None where they have none)."""
        return (version_counter(cache_seqlens), capturing(q.device), q.shape[0], k_cache.shape[2], q.device)

    def kept(self, cache_seqlens: torch.Tensor, key: tuple[Any, ...]) -> torch.Tensor | None:
        """The plan an earlier call of this step wrote for these lengths and ``key``, or None (always for lengths
        without a version counter: an in-place refill could not be told)."""
        if self._lengths is None or self._lengths() is not cache_seqlens or key[0] is None or key != self._key:
            return None
        return self._plan

    def plan(self, q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor) -> torch.Tensor:
        """The step's plan for this call: the kept one, else one written now (one launch) and kept."""
        key = self.key(q, k_cache, cache_seqlens)
        kept = self.kept(cache_seqlens, key)
        if kept is not None:
            return kept
        from sglang_fp8rl.kernels.fp8_decode_attention import decode_plan  # Triton: on the first decode call

        plan = decode_plan(q, k_cache, cache_seqlens)
        self._lengths, self._key, self._plan = weakref.ref(cache_seqlens), key, plan
        return plan
