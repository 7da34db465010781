"""Whether the tensors of an update request are finite once rounded to BF16: the fast, batched check that
validation (:mod:`sglang_fp8rl.weight_sync.validate`) runs on every request before the exact per-tensor check, which
runs only when this one flags something (to name the culprit, or clear a false alarm).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Sequence

import torch

from sglang_fp8rl.quant import extremes_finite_in_bf16

HOST_CHECK_THREADS = min(8, os.cpu_count() or 1)  # threads checking host tensors (see _host_finite_in_bf16)
HOST_CHECK_CHUNK_BYTES = 4 << 20  # host bytes one pool task checks (~0.3 ms of aminmax; MoE experts come by dozens)


def all_finite_in_bf16(tensors: Sequence[torch.Tensor]) -> bool:
    """Conservative: True only if every tensor is finite in BF16 (the exact per-tensor check names the culprit)."""
    on_host = [t for t in tensors if t.device.type == "cpu"]
    return _host_finite_in_bf16(on_host) and _device_finite_in_bf16([t for t in tensors if t.device.type != "cpu"])


def _device_finite_in_bf16(tensors: Sequence[torch.Tensor]) -> bool:
    """One multi-tensor L1 norm per (device, dtype): the L1 norm propagates NaN and Inf (a max-based reduction may
    drop NaN), and an FP32 value past BF16's range makes it Inf in BF16 too; it can also overflow for huge finite
    tensors, which the exact check then clears."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    norms: dict[torch.device, list[torch.Tensor]] = {}
    for (device, _), group in groups.items():
        norms.setdefault(device, []).append(torch.stack(torch._foreach_norm(group, 1)).float())
    return all(extremes_finite_in_bf16(torch.cat(parts)) for parts in norms.values())


def _host_finite_in_bf16(tensors: Sequence[torch.Tensor]) -> bool:
    """Host tensors (a checkpoint read from disk): min and max of each, in a small thread pool. SGLang runs a GPU
    worker with one intra-op thread, where an L1 norm reads BF16 at ~2 GB/s and aminmax (read-only, NaN propagates
    into both ends) at ~15 GB/s; the pool's threads run ATen kernels without the GIL. The pool takes chunks of about
    :data:`HOST_CHECK_CHUNK_BYTES` (a future per small tensor costs more than its check); a request of one chunk is
    checked on the calling thread."""
    if not tensors:
        return True
    chunks = _host_chunks(tensors)
    if len(chunks) == 1:
        return extremes_finite_in_bf16(_chunk_extremes(chunks[0]))
    return extremes_finite_in_bf16(torch.cat(list(_host_pool().map(_chunk_extremes, chunks))))


def _host_chunks(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors in groups of at most HOST_CHECK_CHUNK_BYTES (a larger tensor alone)."""
    chunks: list[list[torch.Tensor]] = []
    chunk: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > HOST_CHECK_CHUNK_BYTES:
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(tensor)
        size += nbytes
    if chunk:
        chunks.append(chunk)
    return chunks


def _chunk_extremes(chunk: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`~sglang_fp8rl.quant.extremes` of every tensor of a chunk, in one float32 tensor (in another order: only
    their finiteness is read), with one stack per dtype instead of one per tensor."""
    ends: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in chunk:
        ends.setdefault(tensor.dtype, []).extend(torch.aminmax(tensor))
    return torch.cat([torch.stack(group).float() for group in ends.values()])


@functools.lru_cache(maxsize=1)
def _host_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(HOST_CHECK_THREADS, thread_name_prefix="fp8rl-check")
