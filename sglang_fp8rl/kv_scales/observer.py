"""Per-layer, per-KV-head amax of K and V as the attention backend receives them (K after RoPE and K-norm).

The observation point is the attention backend's ``forward(q, k, v, layer, forward_batch, ...)``, patched on the one
backend instance for the duration of a calibration forward. ``RadixAttention.forward`` would be the obvious place,
but under a piecewise prefill CUDA graph it is traced and replayed (radix_attention.py:169-275), while the backend call
always runs eagerly: directly (radix_attention.py:279-287) or from the graph's split op with the padding already cut
off (radix_attention.py:312-371). K/V reach it before the pool divides them by the scale (memory_pool.py:2338-2343).

Amax stays on the device (one ``abs().amax`` and one ``maximum`` per layer and side); the host reads it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch


def valid_tokens(forward_batch: Any) -> Optional[int]:
    """Rows of K/V that are real tokens: ``extend_num_tokens`` in extend, ``batch_size`` in decode, else None."""
    mode = forward_batch.forward_mode
    if mode.is_extend():
        return getattr(forward_batch, "extend_num_tokens", None)
    if mode.is_decode():
        return forward_batch.batch_size
    return None


def head_amax(x: torch.Tensor, num_heads: int, num_valid: Optional[int] = None) -> torch.Tensor:
    """float32 ``[num_heads]`` amax over the first ``num_valid`` tokens of ``x`` ([tokens, heads * dim] or 3-D)."""
    rows = x if num_valid is None else x[:num_valid]
    rows = rows.reshape(rows.shape[0], num_heads, -1)
    if rows.shape[0] == 0:
        return torch.zeros(num_heads, dtype=torch.float32, device=x.device)
    return rows.abs().amax(dim=(0, 2)).float()


class KVAmaxObserver:
    """Running per-KV-head amax of K and V for each attention layer seen."""

    def __init__(self) -> None:
        self._amax: dict[int, list[torch.Tensor]] = {}  # layer_id -> [k [heads], v [heads]] (numerics.KV_NAMES)
        self.tokens: dict[int, int] = {}

    def observe(self, layer: Any, k: torch.Tensor, v: torch.Tensor, num_valid: Optional[int] = None) -> None:
        """Fold one layer call's K and V into the running amax (no host sync)."""
        new = [head_amax(k, layer.tp_k_head_num, num_valid), head_amax(v, layer.tp_v_head_num, num_valid)]
        old = self._amax.get(layer.layer_id)
        self._amax[layer.layer_id] = new if old is None else [torch.maximum(a, b) for a, b in zip(old, new)]
        rows = k.shape[0] if num_valid is None else min(num_valid, k.shape[0])
        self.tokens[layer.layer_id] = self.tokens.get(layer.layer_id, 0) + rows

    def _check_seen(self, layer_ids: Sequence[int]) -> None:
        missing = [i for i in layer_ids if i not in self._amax]
        if missing:
            raise ValueError(f"the calibration forward never reached attention layer(s) {missing}")

    def layer_ids(self) -> list[int]:
        """Layers observed so far."""
        return sorted(self._amax)

    def per_head(self, layer_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(k [heads], v [heads])]`` float64 on the CPU in ``layer_ids`` order (one host sync)."""
        self._check_seen(layer_ids)
        tensors = [t for i in layer_ids for t in self._amax[i]]
        host = torch.cat(tensors).to("cpu", torch.float64).split([t.numel() for t in tensors])
        return list(zip(host[0::2], host[1::2]))

    def table(self, layer_ids: Sequence[int]) -> torch.Tensor:
        """float32 ``[len(layer_ids), 2]`` per-tensor amax (K, V) on the observations' device (no host sync)."""
        self._check_seen(layer_ids)
        return torch.stack([torch.stack([t.amax() for t in self._amax[i]]) for i in layer_ids])


def _observing_forward(original: Any, observer: KVAmaxObserver) -> Any:
    def forward(q, k, v, layer, forward_batch, *args, **kwargs):
        if k is not None and v is not None:
            observer.observe(layer, k, v, valid_tokens(forward_batch))
        return original(q, k, v, layer, forward_batch, *args, **kwargs)

    return forward


@contextlib.contextmanager
def observing(backend: Any, observer: KVAmaxObserver) -> Iterator[KVAmaxObserver]:
    """Record K/V amax of every attention call that goes through ``backend.forward`` inside the block."""
    had_own = "forward" in vars(backend)
    own = vars(backend).get("forward")
    backend.forward = _observing_forward(backend.forward, observer)
    try:
        yield observer
    finally:
        if had_own:
            backend.forward = own
        else:
            del backend.forward
