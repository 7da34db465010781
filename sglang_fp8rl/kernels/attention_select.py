"""Which kernel runs a decode step's attention over an FP8 KV cache: SGLang's FlashAttention-3 call, or this package's
split-KV kernel (:mod:`sglang_fp8rl.kernels.fp8_decode_attention`).

SGLang's FA3 backend calls its module's ``flash_attn_with_kvcache`` for every attention call (prefill, decode, cascade,
cross attention); :func:`dispatching` wraps that function (hooks/attention.py installs it before any CUDA graph is
captured). Each call is judged by its keywords alone, on the host, so a captured graph replays the kernel its capture
chose: a call that is a plain one-token-per-sequence decode over an E4M3 cache with its descales, that the split-KV
kernel can take, goes to it under ``--fp8rl-decode-attention split_kv``, and under ``auto`` (the default) when the batch
holds at most ``--fp8rl-split-kv-max-batch`` sequences (``AUTO_MAX_BATCH`` unless set); every other call, and every call
under ``fa3``, goes to FA3 unchanged. Each decision is logged once, with its reason. Under ``--fp8rl-decode-query bf16``
the backend's decode hands the query on uncast (compat/fa3_query.py) and in place of SGLang's copy of it
(kernels/query_placeholder.py): the kernel reads it as it lies in qkv, and the calls that go to FA3 get SGLang's E4M3
cast here (:func:`for_fa3`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from sglang_fp8rl.kernels import producers
from sglang_fp8rl.kernels.query_placeholder import real_query
from sglang_fp8rl.kernels.split_kv_plan import DEFAULT_FORMS, FORMS
from sglang_fp8rl.kernels.step_plan import StepPlan
from sglang_fp8rl.quant import DEFAULT_GROUP_SIZE

logger = logging.getLogger(__name__)

FA3 = "fa3"
SPLIT_KV = "split_kv"
MODES = ("auto", FA3, SPLIT_KV)  # --fp8rl-decode-attention
# --fp8rl-decode-query: fp8 = SGLang casts every decode query to E4M3 before the call; bf16 = decode queries arrive
# uncast (compat/fa3_query.py), the split-KV kernel reads them so, and the calls that go to FA3 get SGLang's cast here
CAST_QUERY, UNCAST_QUERY = "fp8", "bf16"
QUERY_MODES = (CAST_QUERY, UNCAST_QUERY)
MAX_FP8_HEAD_DIM = 256  # SGLang casts the query to an FP8 cache's dtype for head dims up to this (FA3's FP8 limit)
# auto takes the split-KV kernel up to this many sequences in a decode batch (the captured batch size), FA3 above.
# Measured (docs/RESULTS.md sec. 41, H100): with 32 against 8, the longer-tailed RL rollout ran the same schedule in
# 189.4 s against 194.3 (its steps at 9-16 / 17-32 running 8.98 / 11.42 ms against FA3's 9.92 / 12.96, every other
# band the same), and the served step at 16-32 running over 4k-12k contexts was 1.04-1.15x faster. Above 32 it stays
# FA3: at ragged contexts over many sequences the kernel's programs are short (a few tiles each), and each pays a start
# the programs of long contexts amortize (sec. 36d, per call: 0.79x / 0.71x FA3 at 64 / 128 ragged sequences, 1.00x
# at 32).
AUTO_MAX_BATCH = 32  # the default of --fp8rl-split-kv-max-batch
_MARK = "_fp8rl_decode_attention"

# FA3 keywords a plain decode call may carry with any value (the call's operands and settings we honour or that do
# not change the result of a one-token decode: causal masking of a single last query is no masking)
_OPERANDS = frozenset({"q", "k_cache", "v_cache", "page_table", "cache_seqlens", "cu_seqlens_q", "max_seqlen_q",
                       "softmax_scale", "causal", "k_descale", "v_descale", "out", "scheduler_metadata",
                       "num_splits", "window_size", "softcap", "return_softmax_lse", "ver"})
# keywords that must be absent or hold their neutral value
_NEUTRAL = {"k": None, "v": None, "qv": None, "rotary_cos": None, "rotary_sin": None, "cache_batch_idx": None,
            "cache_leftpad": None, "cu_seqlens_k_new": None, "rotary_seqlens": None, "q_descale": None,
            "sinks": None, "attention_chunk": 0, "pack_gqa": None, "sm_margin": 0, "score_mod": None,
            "aux_tensors": None, "rel_bias": None, "rel_bias_prep_cache": None, "sfq": None, "sfk": None,
            "sfv": None, "rotary_interleaved": True}


def not_plain_decode(kwargs: Mapping[str, Any]) -> str | None:
    """Why an FA3 call is not a plain one-token decode over an E4M3 cache with descales, or None."""
    unknown = sorted(set(kwargs) - _OPERANDS - set(_NEUTRAL))
    if unknown:
        return f"FA3 keywords this kernel does not implement: {unknown}"
    for key, neutral in _NEUTRAL.items():
        value = kwargs.get(key)
        if value is not None and (neutral is None or not isinstance(value, (bool, int, float)) or value != neutral):
            return f"{key} is set"
    if kwargs.get("max_seqlen_q") != 1:
        return "not a decode (more than one query token per sequence)"
    if kwargs.get("page_table") is None or kwargs.get("cache_seqlens") is None:
        return "no page table or cache lengths"
    if kwargs.get("window_size") not in (None, (-1, -1), [-1, -1]):
        return "sliding-window attention"
    if kwargs.get("softcap") not in (None, 0, 0.0):
        return "logit soft-capping"
    if kwargs.get("return_softmax_lse"):
        return "the log-sum-exp is asked for (cascade attention)"
    if kwargs.get("ver", 3) != 3:
        return f"FlashAttention version {kwargs.get('ver')}"
    if kwargs.get("num_splits") == 1:
        return "one split asked for (deterministic inference: results independent of the batch)"
    if kwargs.get("k_descale") is None or kwargs.get("v_descale") is None:
        return "no K/V descales (not an FP8 cache with scales)"
    return None


def split_kv_blocker(kwargs: Mapping[str, Any]) -> str | None:
    """Why the split-KV kernel cannot run this FA3 call, or None."""
    reason = not_plain_decode(kwargs)
    if reason:
        return reason
    from sglang_fp8rl.kernels.fp8_decode_attention import cannot_run  # Triton: imported on the first decode call

    return cannot_run(kwargs["q"], kwargs["k_cache"], kwargs["v_cache"], kwargs["page_table"],
                      kwargs["cache_seqlens"])


def check_max_batch(max_batch: Any) -> int:
    """``--fp8rl-split-kv-max-batch``: a whole number of sequences >= 1, or ValueError."""
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"--fp8rl-split-kv-max-batch must be an integer >= 1, got {max_batch!r}")
    return max_batch


def choose(mode: str, kwargs: Mapping[str, Any], max_batch: int = AUTO_MAX_BATCH) -> tuple[str, str]:
    """(kernel, why) for one FA3 call under ``--fp8rl-decode-attention mode``; ``auto`` sends batches of at most
    ``max_batch`` sequences to the split-KV kernel."""
    if mode not in MODES:
        raise ValueError(f"--fp8rl-decode-attention must be one of {MODES}, got {mode!r}")
    if mode == FA3:
        return FA3, "--fp8rl-decode-attention fa3"
    reason = split_kv_blocker(kwargs)
    if reason:
        return FA3, reason
    if mode == "auto" and kwargs["q"].shape[0] > max_batch:
        return FA3, f"decode batches above {max_batch} sequences (auto; split_kv takes them)"
    if mode == "auto":
        return SPLIT_KV, f"plain decode over an E4M3 cache, batches up to {max_batch} sequences"
    return SPLIT_KV, "plain decode over an E4M3 cache (split_kv)"


def run_split_kv(kwargs: Mapping[str, Any], hand_over: bool = False, plans: StepPlan | None = None,
                 forms: tuple[str, ...] = DEFAULT_FORMS) -> Any:
    """The split-KV kernel on an FA3 call's operands (FA3's output layout: [tokens, heads, head_dim]). ``hand_over``
    (``--fp8rl-producer-quant on``): the kernel also writes its output's 1x128 codes, attached for o_proj
    (kernels/producers.py), where it allocates that output itself (a buffer the caller passes may be written by
    another kernel next, which would leave the codes stale) and the head dim is one group. ``plans``: the step's
    plan, written by its first call and read by the others (kernels/step_plan.py); ``forms``: the kernel's forms in
    force (split_kv_plan.FORMS)."""
    from sglang_fp8rl.kernels.fp8_decode_attention import PREPLAN, fp8_decode_attention

    q = kwargs["q"]
    single = "single_plan" in forms
    plan = None
    # the kernel plans nothing for an empty batch (a DP-attention rank with no request) nor where it plans inside
    if plans is not None and PREPLAN and q.shape[0] > 0 and not (single and q.shape[0] == 1):
        plan = plans.plan(q, kwargs["k_cache"], kwargs["cache_seqlens"])
    out_codes = None
    if hand_over and kwargs.get("out") is None and q.dim() == 3 and q.shape[2] == DEFAULT_GROUP_SIZE:
        from sglang_fp8rl.kernels.norm_quant import empty_codes

        # the scale layout SGLang hands DeepGEMM
        out_codes = empty_codes(q.shape[0], q.shape[1] * q.shape[2], q.device, "tma")
    out = fp8_decode_attention(q, kwargs["k_cache"], kwargs["v_cache"], kwargs["page_table"],
                               kwargs["cache_seqlens"], kwargs["softmax_scale"], kwargs["k_descale"],
                               kwargs["v_descale"], out=kwargs.get("out"), out_codes=out_codes, plan=plan,
                               single_plan=single, fused_merge="fused_merge" in forms)
    return producers.attach(out, *out_codes) if out_codes is not None else out


def cast_query(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's keywords with an uncast query cast to the FP8 cache's dtype, as SGLang casts it for FA3 (FA3's FP8
    path takes an E4M3 query): where the cache is E4M3, the query is not and its head dim is at most 256."""
    q, cache = kwargs.get("q"), kwargs.get("k_cache")
    if q is None or cache is None or cache.dtype != torch.float8_e4m3fn or q.dtype == cache.dtype \
            or q.shape[-1] > MAX_FP8_HEAD_DIM:
        return kwargs
    return {**kwargs, "q": q.to(cache.dtype)}


def for_fa3(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords of a call from a decode that hands its query on uncast, as FA3 takes them: the query cast
    (:func:`cast_query`) and contiguous, as SGLang's own ``q.contiguous()`` leaves it."""
    kwargs = cast_query(kwargs)
    q = kwargs.get("q")
    return {**kwargs, "q": q.contiguous()} if isinstance(q, torch.Tensor) and not q.is_contiguous() else kwargs


def with_real_query(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The call's arguments with the model's query in place of a placeholder (kernels/query_placeholder.py); a
    positional query, which FA3 alone takes, also contiguous."""
    if args:
        q = real_query(args[0])
        return (q.contiguous() if isinstance(q, torch.Tensor) else q, *args[1:]), kwargs
    return args, ({**kwargs, "q": real_query(kwargs["q"])} if "q" in kwargs else kwargs)


def dispatching(original: Callable, mode: str, hand_over: bool = False, query: str = CAST_QUERY,
                forms: tuple[str, ...] = DEFAULT_FORMS, max_batch: int = AUTO_MAX_BATCH) -> Callable:
    """``original`` (FA3's ``flash_attn_with_kvcache``) with plain FP8 decode calls sent to the split-KV kernel
    (``hand_over``: see :func:`run_split_kv`; ``query`` "bf16": decode queries arrive uncast, and the calls that go to
    FA3 are cast here first, see :func:`cast_query`; ``forms``: the kernel's forms, split_kv_plan.FORMS;
    ``max_batch``: the largest batch ``auto`` gives the kernel)."""
    check_max_batch(max_batch)
    if query not in QUERY_MODES:
        raise ValueError(f"--fp8rl-decode-query must be one of {QUERY_MODES}, got {query!r}")
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise ValueError(f"--fp8rl-split-kv-forms: unknown form(s) {unknown}; the forms are {FORMS}")
    original = original_of(original) or original  # a dispatcher is replaced, never wrapped
    plans = StepPlan() if "step_plan" in forms else None
    logged: set[tuple[str, str]] = set()
    unbuildable: list[str] = []  # the kernel failed to build here once: FA3 from then on

    def decide(args: tuple, kwargs: dict) -> tuple[str, str]:
        if args:
            return FA3, "positional arguments"
        if unbuildable:
            return FA3, unbuildable[0]
        return choose(mode, kwargs, max_batch)

    def flash_attn_with_kvcache(*args: Any, **kwargs: Any) -> Any:
        if query == UNCAST_QUERY:  # the model's query back in place of the decode's placeholder, before any read
            args, kwargs = with_real_query(args, kwargs)
        kernel, why = decide(args, kwargs)
        if (kernel, why) not in logged:
            logged.add((kernel, why))
            logger.info("[fp8rl] decode attention: %s for %s calls (%s)", kernel,
                        "decode" if kernel == SPLIT_KV else "these", why)
        if kernel == SPLIT_KV:
            from sglang_fp8rl.kernels.fp8_decode_attention import BUILD_ERRORS

            try:
                return run_split_kv(kwargs, hand_over, plans, forms)
            except BUILD_ERRORS as e:  # its outputs are unwritten: FA3 computes this call from the same operands
                unbuildable.append(f"the split-KV kernel does not build on this GPU: {type(e).__name__}: {e}")
                logger.warning("[fp8rl] decode attention: FA3 for every call from now on (%s)", unbuildable[0])
        return original(*args, **(for_fa3(kwargs) if query == UNCAST_QUERY else kwargs))

    setattr(flash_attn_with_kvcache, _MARK, original)
    return flash_attn_with_kvcache


def original_of(fn: Callable) -> Callable | None:
    """The FA3 function a dispatcher wraps, or None if ``fn`` is not one."""
    return getattr(fn, _MARK, None)
