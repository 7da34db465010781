"""SGLang's KV pool (``MHATokenToKVPool``) and its ``set_kv_buffer`` call, as each supported release lays them out.

One function per difference: the release where it starts and what it hides. The one-launch K/V write
(``--fp8rl-kv-write fused``, hooks/kv_cache.py) asks these what a call writes and whether the pool stores as the kernel
does; where a release's pool does not, the write takes SGLang's own path.
"""

from __future__ import annotations

from typing import Any, Optional


def kv_write_location(arguments: dict[str, Any]) -> Optional[Any]:
    """The slots a ``set_kv_buffer`` call writes (its bound arguments): ``loc_info`` from 0.5.15 (a ``KVWriteLoc`` or a
    bare index tensor, unpacked by SGLang's ``unwrap_write_loc``), ``loc`` before; None if the call has neither."""
    if "loc_info" not in arguments:
        return arguments.get("loc")
    loc_info = arguments["loc_info"]
    if loc_info is None:
        return None
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    return unwrap_write_loc(loc_info)[0]


def kv_write_overrides(arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``set_kv_buffer`` call that change where or what it writes besides the location, K, V and
    their scales, by name (None where unset or absent): ``layer_id_override`` in every supported release,
    ``dcp_kv_mask`` (decode context parallelism) from 0.5.15."""
    return {name: arguments.get(name) for name in ("layer_id_override", "dcp_kv_mask")}


def kv_pool_quantized(pool: Any) -> bool:
    """Whether the pool quantizes K/V its own way (an FP4 cache): ``is_quantized_kv_cache`` from 0.5.17, none
    before."""
    return bool(getattr(pool, "is_quantized_kv_cache", False))


def kv_pool_layout(pool: Any) -> str:
    """The pool's K/V buffer layout (``"nhd"``: one row per token): ``kv_cache_layout`` from 0.5.15 (``use_hnd`` set
    with HND), always NHD before."""
    layout = getattr(pool, "kv_cache_layout", "nhd")
    return "hnd" if layout == "nhd" and getattr(pool, "use_hnd", False) else layout


def stores_kv_like_mha(pool: Any) -> bool:
    """Whether the pool stores a layer's K/V with ``MHATokenToKVPool._store_kv_layer`` itself (from 0.5.15; before,
    ``set_kv_buffer`` stored inline and there is no such method: False), not a subclass's own store."""
    store = getattr(type(pool), "_store_kv_layer", None)
    return getattr(store, "__qualname__", None) == "MHATokenToKVPool._store_kv_layer"
