"""Where SGLang's FlashAttention-3 backend casts a decode query to the FP8 KV cache's dtype: the one difference between
releases that ``--fp8rl-decode-query bf16`` needs.

With an FP8 KV cache the backend casts the query to E4M3 before every FA3 call (FA3's FP8 path takes an E4M3 query):

* 0.5.12-0.5.17 (``INLINE``): in ``forward_decode`` itself, ``q = q.to(self.kv_cache_dtype)`` (with ``q_rope`` and
  ``k_rope``, which multi-head attention leaves None), the only reads of that attribute there;
* 0.5.21 on (``METHOD``): in ``prepare_paged_mha_query(q, q_rope, k_rope, layer, *, logical_batch_size, kv_head_num,
  is_prefill)``, which ``forward_decode`` calls with ``is_prefill=False`` and which also expands the K/V descales.

:func:`keep_decode_query` makes one backend's decode hand the query on as the model made it, on either form;
tests/test_decode_query.py reads each supported release's source for the form it has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

INLINE = "inline"
METHOD = "method"
QUERY_METHOD = "prepare_paged_mha_query"
_MARK = "_fp8rl_keeps_decode_query"


def query_cast_form(backend: Any) -> str:
    """``METHOD`` where the backend casts the query in ``prepare_paged_mha_query``, else ``INLINE``."""
    return METHOD if callable(getattr(type(backend), QUERY_METHOD, None)) else INLINE


def keep_query_blocker(backend: Any) -> str | None:
    """Why ``backend``'s decode query cannot be handed on uncast, or None: multi-head latent attention casts its rope
    parts with the query, and the split-KV kernel, which reads the uncast query, takes no MLA call."""
    return "multi-head latent attention (MLA)" if getattr(backend, "use_mla", False) else None


def keeps_decode_query(backend: Any) -> bool:
    """Whether :func:`keep_decode_query` has been applied to ``backend``."""
    return bool(getattr(backend, _MARK, False))


def keep_decode_query(backend: Any) -> None:
    """Make ``backend``'s decode calls hand FA3's function the query uncast; prefill calls are left as they are. The
    function then sees a BF16 query beside an E4M3 cache and its descales, and must cast for FA3 itself
    (``kernels.attention_select`` does). Applied once; a second call changes nothing."""
    if keeps_decode_query(backend):
        return
    if query_cast_form(backend) == METHOD:
        backend.prepare_paged_mha_query = _uncast_query_method(backend, backend.prepare_paged_mha_query)
    else:
        backend.forward_decode = _uncast_forward_decode(backend, backend.forward_decode)
    setattr(backend, _MARK, True)


def _uncast_query_method(backend: Any, original: Callable) -> Callable:
    def prepare_paged_mha_query(q: Any, q_rope: Any, k_rope: Any, layer: Any, *, is_prefill: bool,
                                **kwargs: Any) -> tuple:
        if is_prefill or q_rope is not None or k_rope is not None:
            return original(q, q_rope, k_rope, layer, is_prefill=is_prefill, **kwargs)
        # an empty tensor of the cache's dtype: its cast is no copy, and SGLang expands the descales as it does
        stand_in = q.new_empty(0, dtype=backend.kv_cache_dtype)
        _, q_rope, k_rope, k_descale, v_descale = original(stand_in, q_rope, k_rope, layer, is_prefill=False,
                                                           **kwargs)
        return q, q_rope, k_rope, k_descale, v_descale

    return prepare_paged_mha_query


def _uncast_forward_decode(backend: Any, original: Callable) -> Callable:
    def forward_decode(*args: Any, **kwargs: Any) -> Any:
        # during this call the cache's dtype reads as the query's, so ``q.to(self.kv_cache_dtype)`` is no copy
        q = args[0] if args else kwargs["q"]
        cache_dtype = backend.kv_cache_dtype
        backend.kv_cache_dtype = q.dtype
        try:
            return original(*args, **kwargs)
        finally:
            backend.kv_cache_dtype = cache_dtype

    return forward_decode
