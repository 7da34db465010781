"""Decode attention over an FP8 KV cache on SGLang's FlashAttention-3 backend (``--fp8rl-decode-attention``).

After ``ModelRunner.init_attention_backends`` (before any CUDA graph is captured), for a model served with this
package's quantization and an ``fp8_e4m3`` KV cache whose decode backend is FA3: the FA3 backend module's
``flash_attn_with_kvcache``, which its ``forward_decode`` calls (on every supported release:
tests/test_decode_attention.py reads their sources), becomes the dispatcher of :mod:`sglang_fp8rl.kernels.
attention_select`. Other servers are left untouched.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang_fp8rl.compat.fa3_query import keep_decode_query, keep_query_blocker, keeps_decode_query
from sglang_fp8rl.compat.runtime import FA3_DECODE_FUNCTION, fa3_kernel_module
from sglang_fp8rl.hooks import producers
from sglang_fp8rl.kernels.attention_select import CAST_QUERY, FA3, SPLIT_KV, UNCAST_QUERY, dispatching
from sglang_fp8rl.kernels.query_placeholder import reading_the_model_query
from sglang_fp8rl.kv_scales.decode_fold import decode_backend
from sglang_fp8rl.server_args import QUANTIZATION_NAME, get_options

logger = logging.getLogger(__name__)

FP8_KV_DTYPES = ("fp8_e4m3",)


def fa3_module(backend: Any) -> Optional[Any]:
    """The FA3 module whose kernel entry point the decode side of ``backend`` calls, or None (not FA3)."""
    return fa3_kernel_module(decode_backend(backend))


def not_served_here(args: Any) -> Optional[str]:
    """Why this server's decode attention is not ours to choose, or None."""
    if getattr(args, "quantization", None) != QUANTIZATION_NAME:
        return f"--quantization is not {QUANTIZATION_NAME}"
    if str(getattr(args, "kv_cache_dtype", "auto")) not in FP8_KV_DTYPES:
        return "the KV cache is not fp8_e4m3"
    return None


def install_decode_attention(runner: Any) -> str:
    """Send the FA3 backend's plain FP8 decode calls to the split-KV kernel, per the option; returns what was done.

    Raises ValueError when ``--fp8rl-decode-attention split_kv`` was asked for where it cannot apply."""
    options = get_options()
    mode, uncast = options.decode_attention, options.decode_query == UNCAST_QUERY
    unserved = not_served_here(runner.server_args)
    if mode == FA3 or unserved:
        if uncast:  # a query option that cannot apply says so (with fa3 it is refused earlier)
            logger.info("[fp8rl] decode attention: --fp8rl-decode-query bf16 changes nothing here (%s)", unserved)
        return "untouched"
    module = fa3_module(runner.attn_backend)
    if module is None:
        name = type(decode_backend(runner.attn_backend)).__name__
        if mode == SPLIT_KV:
            raise ValueError(f"--fp8rl-decode-attention split_kv: the decode attention backend is {name}, not "
                             "FlashAttention-3 (--attention-backend fa3, or --decode-attention-backend fa3)")
        logger.info("[fp8rl] decode attention: %s's own (the split-KV kernel replaces FlashAttention-3 only%s)", name,
                    "; --fp8rl-decode-query bf16 changes nothing" if uncast else "")
        return "not fa3"
    # the split-KV kernel writes its output's codes for o_proj too where the norms and SiLUs hand theirs over
    hand_over = options.producer_quant == "on" and producers.off_reason(runner.server_args) is None
    backend = decode_backend(runner.attn_backend)
    query = query_form(backend, options.decode_query)
    # a dispatcher already there (a second install) is replaced, not wrapped: dispatching unwraps it
    forms = options.split_kv_forms
    setattr(module, FA3_DECODE_FUNCTION, dispatching(getattr(module, FA3_DECODE_FUNCTION), mode, hand_over, query,
                                                     forms, options.split_kv_max_batch))
    if query == UNCAST_QUERY:  # only once the dispatcher that casts for FA3 is in place
        keep_decode_query(backend)
        # and hands over no copy of the query either (a second install finds it wrapped and keeps it)
        backend.forward_decode = reading_the_model_query(backend.forward_decode)
    logger.info("[fp8rl] decode attention: plain FP8-KV decode calls of %s go to the split-KV kernel (%s; forms: "
                "%s)%s%s", module.__name__, f"auto: batches up to {options.split_kv_max_batch} sequences"
                if mode == "auto" else mode, ", ".join(forms) or "none", "; its output's 1x128 codes go to "
                "o_proj (--fp8rl-producer-quant on)" if hand_over else "", "; it reads the BF16 query, FA3's calls "
                "get it in E4M3 (--fp8rl-decode-query bf16)" if query == UNCAST_QUERY else "")
    return "installed"


def query_form(backend: Any, asked: str) -> str:
    """The query the dispatcher will see from ``backend``'s decode: ``UNCAST_QUERY`` where asked and possible, or
    where an earlier install already made it so; else ``CAST_QUERY`` (SGLang's cast), with one log line saying why."""
    if keeps_decode_query(backend):
        return UNCAST_QUERY
    if asked != UNCAST_QUERY:
        return asked
    reason = keep_query_blocker(backend)
    if reason:
        logger.info("[fp8rl] decode attention: the query stays SGLang's E4M3 cast (%s)", reason)
        return CAST_QUERY
    return asked
