"""The decode query handed to the split-KV kernel without SGLang's copy of it (``--fp8rl-decode-query bf16``).

SGLang's FA3 decode passes FA3 ``q.contiguous().view(-1, heads, head_dim)`` (every supported release:
tests/test_decode_query.py reads their sources). The model's query is a column slice of the qkv projection's output,
its rows as far apart as qkv's, so that ``contiguous()`` is a copy kernel in every layer: with the E4M3 query it is
the cast itself, with the BF16 query a launch of its own (2.3 us a layer at 8 x 4k on an H100, docs/RESULTS.md
38a). The split-KV kernel reads a query with any row and head strides, so it needs no copy.

So the backend's decode gets a *placeholder*: a contiguous tensor of the query's shape and dtype that nothing
writes, which ``contiguous()`` and ``view`` leave in place (no kernel; under a CUDA graph capture it comes from the
graph's pool like any other tensor). The dispatcher (kernels/attention_select), the function through which the
backend reaches FA3, takes the model's query back (:func:`real_query`) before anything reads it: the kernel reads
it as it lies in qkv, FA3 gets it cast or copied as SGLang would have. That SGLang's decode reads the query nowhere else
(outside MLA, which keeps SGLang's cast) is what tests/test_decode_query.py checks in each supported release's
source. A decode that returns without its placeholder taken back whole (it handed FA3 a part of it, or computed
without FA3) is run again on the model's query by :func:`reading_the_model_query`, and that function uses no
placeholder again (one warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_MARK = "_fp8rl_reads_the_model_query"  # on a forward_decode wrapped by reading_the_model_query


@dataclass
class _Standing:
    """What a placeholder stands for, and what the dispatcher made of it during the decode call."""

    query: torch.Tensor
    taken_back: bool = False  # the dispatcher took the model's query back from it, whole
    misread: bool = False  # something looked up a part of it, or its bytes as another dtype


# a placeholder's first byte -> its entry; one entry per decode call in flight, removed when it returns
_STANDING: dict[int, _Standing] = {}


def placeholder(q: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``q``'s shape and dtype, registered as standing for ``q`` until :func:`release`; ``q``
    itself where it is empty or contiguous (its ``contiguous()`` copies nothing anyway), and while torch.compile
    traces."""
    if q.numel() == 0 or q.is_contiguous() or torch.compiler.is_compiling():  # a traced tensor has no data pointer
        return q
    stand = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _STANDING[stand.data_ptr()] = _Standing(q)
    return stand


def release(stand: torch.Tensor) -> bool:
    """Unregister ``stand``; whether the dispatcher took the model's query back from it, and only whole (True for no
    placeholder)."""
    entry = _STANDING.pop(stand.data_ptr(), None) if _STANDING and stand.numel() else None
    return entry is None or (entry.taken_back and not entry.misread)


def real_query(q: Any) -> Any:
    """The model's query, shaped as ``q``, where ``q`` is a placeholder or a view of one; else ``q`` itself."""
    if not isinstance(q, torch.Tensor) or not q.numel() or not _STANDING or torch.compiler.is_compiling():
        return q
    entry = _STANDING.get(q.data_ptr())
    if entry is None:
        return q
    if entry.query.numel() != q.numel() or entry.query.dtype != q.dtype:
        entry.misread = True  # not the query: the decode is run again
        return q
    entry.taken_back = True
    return entry.query.reshape(q.shape)  # a view: the query's last dim is contiguous, its rows are split into heads


def reading_the_model_query(forward_decode: Callable) -> Callable:
    """``forward_decode`` (a backend's bound method) given a placeholder for its query (its first argument, or
    ``q=``), and run again on the query itself if the placeholder was not taken back; a function it already wraps is
    returned as it is."""
    if getattr(forward_decode, _MARK, False):
        return forward_decode
    copying = False  # a decode did not take its placeholder back: no placeholder from then on

    def decode(*args: Any, **kwargs: Any) -> Any:
        nonlocal copying
        q = args[0] if args else kwargs.get("q")
        if copying or not isinstance(q, torch.Tensor):
            return forward_decode(*args, **kwargs)
        stand = placeholder(q)
        swapped = (stand, *args[1:]) if args else {**kwargs, "q": stand}
        try:
            out = forward_decode(*swapped, **kwargs) if args else forward_decode(*args, **swapped)
        finally:
            taken = release(stand)
        if taken:
            return out
        copying = True
        logger.warning("[fp8rl] decode attention: the BF16 query is copied as SGLang copies it from now on (the "
                       "decode did not hand its placeholder to FA3's function whole); this call runs again on the "
                       "query itself")
        return forward_decode(*args, **kwargs)

    setattr(decode, _MARK, True)
    return decode
