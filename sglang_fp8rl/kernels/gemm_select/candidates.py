"""The candidates: named block-FP8 linears ``(x [.., K] bf16, weight [N, K] fp8, weight_scale_inv [N/128, K/128]
fp32, bias | None) -> [.., N]``, what each can run (and why not), and the one chooser.

* ``deepgemm_default``: SGLang's ``dispatch_w8a8_block_fp8_linear()`` (DeepGEMM ``sm90_fp8_gemm_1d2d`` on an H100),
  i.e. exactly SGLang's path; also the fallback whenever nothing valid is cached;
* ``deepgemm_sms_{n}``: the same call inside SGLang's ``deep_gemm_wrapper.configure_deep_gemm_num_sms(n)``. DeepGEMM's
  heuristic then picks another tile: for gate_up (N=24576, K=4096) at M 96-128 its own choice is a register-spilling
  128x192 tile without multicast (101 us), while with ``num_sms <= 124`` it picks 128x112 / 128x128 (42 us).
  ``num_sms`` is host state read when the launch is built, so a captured CUDA graph keeps the launch it recorded;
* ``fp8rl_n64_sk4``: our decode kernel (:mod:`sglang_fp8rl.kernels.block_gemm`, swap-AB, deterministic split-K)
  after SGLang's 1x128 activation quantization, tried at M <= 16 only; ``fp8rl_n64_sk4_pdl``, the same kernel as a
  programmatic dependent launch (its programs start while the quantizer drains; the same bits);
* ``triton_default`` (SGLang's ``triton_w8a8_block_fp8_linear``) and our other kernel configurations are candidates
  of ``scripts/bench_gemm.py`` but not of the server: on an H100 they never won a bucket (docs/RESULTS.md, sec. 7b).
  So are two forms of our kernel: ``fp8rl_fused_n64_sk4``, quantizing the BF16 activation itself
  (``block_fp8_linear``: one launch a linear; its activation codes are ``quant.quantize_activation_groups``', which
  may differ from SGLang's quantizer's by one step, so it is checked against the float64 product like every
  candidate; a non-BF16 activation takes the unfused path), no faster on an H100 (sec. 31a); and ``fp8rl_*_pf`` /
  ``_pfpdl``, the weight slice prefetched to L2 first, slower on an H100 (sec. 31c); ``fp8rl_*_qpdl``, our own
  activation quantizer then our kernel, both dependent launches (its codes are ``quantize_activation_groups``', so
  it is checked like the fused form).

``--fp8rl-gemm-exclude`` leaves named candidates out of the server's set (:func:`server_candidates`). Our kernel's
forms also run on codes a producer handed over (``Candidate.prequantized``, ``--fp8rl-producer-quant``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from sglang_fp8rl.kernels.deepgemm import (
    DeepGemmFacts,
    deepgemm_takes_shape,
    prequantized_default,
    sglang_deep_gemm_wrapper,
    sglang_fp8_kernel,
    sglang_fp8_utils,
)
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE

BLOCK = DEFAULT_BLOCK_SIZE  # the candidates, the measurement and the cache are for 128x128 weight blocks
DEFAULT = "deepgemm_default"
TRITON = "triton_default"
SMS_PREFIX = "deepgemm_sms_"
OURS_PREFIX = "fp8rl_"
DEFAULT_SMS = (124, 112)  # num_sms variants: 124 / 112 fix gate_up at M 80-128 (x2.3); fewer SMs never won
# (block_n, split_k) of block_gemm kept as candidates, and the largest M they are tried at: on an H100
# (docs/RESULTS.md, bench_gemm) split-K 4 beat DeepGEMM only at M <= 8 (o_proj / down / qkv at M=1: x1.16 / x1.16 /
# x1.05) and every config lost above M=16, so the others are left out of the load-time measurement
OURS_CONFIGS = ((64, 4),)
ALL_OURS_CONFIGS = ((64, 1), (64, 2), (64, 4), (128, 1))
OURS_MAX_M = 16
# (block_n, split_k) of block_gemm's fused form (the activation quantized in the kernel): no server candidate, since
# on an H100 it was within 2 % of the unfused kernel on the narrow linears and 6-15 % slower on the wide ones
# (docs/RESULTS.md sec. 31a); scripts/bench_gemm.py measures it
FUSED_CONFIGS = ()
FUSED_FORMS = ((64, 4),)
FUSED_PREFIX = OURS_PREFIX + "fused_"
# (block_n, split_k, prefetch, pdl) of block_gemm with its weight slice prefetched to L2 first and / or launched as a
# programmatic dependent launch: scripts/bench_gemm.py --prefetch measures them
PREFETCH_FORMS = ((64, 4, True, False), (64, 4, True, True), (64, 4, False, True), (64, 1, False, True))
# (block_n, split_k) of block_gemm launched as a programmatic dependent launch (no prefetch), server candidates
# beside the plain launch of OURS_CONFIGS: its programs start while SGLang's activation quantizer drains
PDL_CONFIGS = ((64, 4),)
# (block_n, split_k) of block_gemm after our own activation quantizer (block_gemm.quantize_activation), both launched
# as programmatic dependent launches (the quantizer's launch overlaps the norm before it, the GEMM's the quantizer):
# scripts/bench_gemm.py --prefetch measures them. No server candidate: on an H100 split-K 4 was 0.2-0.3 us under
# fp8rl_n64_sk4_pdl at M 1 (the spread of two runs) and up to 0.8 us over it at M 8-16 (docs/RESULTS.md sec. 33a)
OWN_QUANT_FORMS = ((64, 4), (64, 1))
OWN_QUANT_CONFIGS = ()
MIN_GAIN = 0.03  # a non-default candidate must beat the default by this fraction

GemmFn = Callable[[Any, Any, Any, Any], Any]
PrequantizedFn = Callable[[Any, Any, Any, Any, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One named block-FP8 linear and what it needs."""

    name: str
    fn: GemmFn
    needs_deepgemm: bool = False
    num_sms: int | None = None
    max_m: int | None = None  # largest M it is measured / used for
    k_multiple: int | None = None  # K must be a multiple of this
    # the same GEMM on an activation a producer quantized already (kernels/producers.py): (codes, multipliers, x,
    # weight, weight_scale_inv, bias) -> out; None: the candidate quantizes x itself
    prequantized: PrequantizedFn | None = None

    def can_implement(self, n: int, k: int, facts: DeepGemmFacts, m: int | None = None) -> str | None:
        """Why this candidate cannot run (m, n, k) as itself here, or None. DeepGEMM variants need SGLang's
        DeepGEMM path to be enabled and taken (N % 64 == 0, K % 128 == 0; otherwise SGLang silently runs Triton),
        float32 scales, and a ``num_sms`` below the device's."""
        if self.max_m is not None and m is not None and m > self.max_m:
            return f"M {m} above this candidate's {self.max_m}"
        if self.k_multiple and k % self.k_multiple:
            return f"K {k} not a multiple of {self.k_multiple}"
        if not self.needs_deepgemm:
            return None
        blocker = facts.variant_blocker()
        if blocker:
            return blocker
        if not deepgemm_takes_shape(n, k):
            return "shape not supported by DeepGEMM (SGLang falls back to Triton)"
        if self.num_sms is not None and not 0 < self.num_sms < facts.sms:
            return f"num_sms {self.num_sms} not below the device's {facts.sms}"
        return None


def sglang_block_call(fn: Callable, x: Any, weight: Any, scale: Any, bias: Any,
                      block_size: Sequence[int] = BLOCK) -> Any:
    """Call one of SGLang's block-FP8 linears with the keywords its linear method uses."""
    return fn(input=x, weight=weight, block_size=list(block_size), weight_scale=scale, input_scale=None, bias=bias)


@functools.cache
def default_linear() -> Callable:
    """SGLang's dispatched block-FP8 linear, resolved once per process as SGLang's own linear method does
    (``default_linear.cache_clear()`` resolves it again)."""
    return sglang_fp8_utils().dispatch_w8a8_block_fp8_linear()


def _default_fn(x: Any, weight: Any, scale: Any, bias: Any) -> Any:
    return sglang_block_call(default_linear(), x, weight, scale, bias)


def _sms_fn(num_sms: int) -> GemmFn:
    def fn(x: Any, weight: Any, scale: Any, bias: Any) -> Any:
        with sglang_deep_gemm_wrapper().configure_deep_gemm_num_sms(num_sms):  # set, call, restore (host-side only)
            return sglang_block_call(sglang_fp8_utils().deepgemm_w8a8_block_fp8_linear_with_fallback, x, weight,
                                     scale, bias)

    fn.__name__ = f"{SMS_PREFIX}{num_sms}"
    return fn


def _sms_prequantized(num_sms: int) -> PrequantizedFn:
    def fn(codes: Any, scales: Any, x: Any, weight: Any, scale: Any, bias: Any) -> Any:
        with sglang_deep_gemm_wrapper().configure_deep_gemm_num_sms(num_sms):  # the GEMM launch of _sms_fn's linear
            return prequantized_default(codes, scales, x, weight, scale, bias)

    return fn


def _triton_fn(x: Any, weight: Any, scale: Any, bias: Any) -> Any:
    return sglang_block_call(sglang_fp8_utils().triton_w8a8_block_fp8_linear, x, weight, scale, bias)


def _ours_prequantized(block_n: int, split_k: int, prefetch: bool = False, pdl: bool = False) -> PrequantizedFn:
    def fn(codes: Any, scales: Any, x: Any, weight: Any, scale: Any, bias: Any) -> Any:
        # imported at the first call: it imports Triton, which not every platform that builds a registry has
        from sglang_fp8rl.kernels.block_gemm import block_fp8_gemm

        out = block_fp8_gemm(codes, scales, weight, scale, x.dtype, bias, block_n=block_n, split_k=split_k,
                             prefetch=prefetch, pdl=pdl)
        return out.view(*x.shape[:-1], weight.shape[0])

    return fn


def _ours_fn(block_n: int, split_k: int, prefetch: bool = False, pdl: bool = False,
             own_quant: bool = False) -> GemmFn:
    gemm = _ours_prequantized(block_n, split_k, prefetch, pdl)

    def fn(x: Any, weight: Any, scale: Any, bias: Any) -> Any:
        # imported at the first call: it imports Triton, which not every platform that builds a registry has
        from sglang_fp8rl.kernels.block_gemm import quantize_activation

        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        if own_quant and x2d.dtype == torch.bfloat16:  # our quantizer reads BF16 bits
            xq, xs = quantize_activation(x2d, pdl=pdl)
        else:  # row-major [M, K/128] scales
            xq, xs = sglang_fp8_kernel().sglang_per_token_group_quant_fp8(x2d, BLOCK[1])
        return gemm(xq, xs, x, weight, scale, bias)

    fn.__name__ = ours_name(block_n, split_k, prefetch, pdl, own_quant)
    return fn


def ours_name(block_n: int, split_k: int, prefetch: bool = False, pdl: bool = False, own_quant: bool = False) -> str:
    """A candidate name of block_gemm's kernel: ``fp8rl_n64_sk4``, suffixed ``_pf``, ``_pfpdl``, ``_pdl`` or, with
    our own activation quantizer, ``_q`` / ``_qpdl``."""
    form = "q" * own_quant + "pf" * prefetch + "pdl" * pdl
    return f"{OURS_PREFIX}n{block_n}_sk{split_k}" + (f"_{form}" if form else "")


def _fused_fn(block_n: int, split_k: int) -> GemmFn:
    unfused = _ours_fn(block_n, split_k)

    def fn(x: Any, weight: Any, scale: Any, bias: Any) -> Any:
        from sglang_fp8rl.kernels.block_gemm import block_fp8_linear  # Triton, at the first call (as _ours_fn)

        x2d = x.reshape(-1, x.shape[-1])
        if x2d.dtype != torch.bfloat16:  # the in-kernel quantizer reads BF16 bits
            return unfused(x, weight, scale, bias)
        out = block_fp8_linear(x2d.contiguous(), weight, scale, x.dtype, bias, block_n=block_n, split_k=split_k)
        return out.view(*x.shape[:-1], weight.shape[0])

    fn.__name__ = f"{FUSED_PREFIX}n{block_n}_sk{split_k}"
    return fn


def make_candidates(sms: Sequence[int] = DEFAULT_SMS, triton: bool = False,
                    ours: Sequence[tuple[int, int]] = OURS_CONFIGS,
                    fused: Sequence[tuple[int, int]] = FUSED_CONFIGS,
                    pdl: Sequence[tuple[int, int]] = PDL_CONFIGS,
                    prefetch: Sequence[tuple[int, int, bool, bool]] = (),
                    own_quant: Sequence[tuple[int, int]] = OWN_QUANT_CONFIGS) -> dict[str, Candidate]:
    """The registry: default first (the autotune relies on that order), num_sms variants, Triton (off by default:
    SGLang's untuned Triton block GEMM never won a bucket on an H100), ours, ours as a dependent launch, its
    prefetch forms, ours after our own quantizer (both dependent launches), ours with the activation quantized in
    the kernel."""
    reg = {DEFAULT: Candidate(DEFAULT, _default_fn)}
    for n in sms:
        reg[f"{SMS_PREFIX}{n}"] = Candidate(f"{SMS_PREFIX}{n}", _sms_fn(int(n)), needs_deepgemm=True, num_sms=int(n),
                                            prequantized=_sms_prequantized(int(n)))
    if triton:
        reg[TRITON] = Candidate(TRITON, _triton_fn)
    forms = ([(*c, False, False, False) for c in ours] + [(*c, False, True, False) for c in pdl]
             + [(*c, False) for c in prefetch] + [(*c, False, True, True) for c in own_quant])
    for block_n, split_k, pf, dependent, own in forms:
        name = ours_name(block_n, split_k, pf, dependent, own)
        reg[name] = Candidate(name, _ours_fn(block_n, split_k, pf, dependent, own), max_m=OURS_MAX_M,
                              k_multiple=BLOCK[1], prequantized=_ours_prequantized(block_n, split_k, pf, dependent))
    for block_n, split_k in fused:
        name = f"{FUSED_PREFIX}n{block_n}_sk{split_k}"
        reg[name] = Candidate(name, _fused_fn(block_n, split_k), max_m=OURS_MAX_M, k_multiple=BLOCK[1])
    return reg


def candidate_names() -> list[str]:
    """Names of the server's candidates, default first."""
    return list(make_candidates())


def check_excluded(names: Iterable[str], known: Sequence[str] | None = None) -> tuple[str, ...]:
    """``names`` as a tuple if each is a server candidate (``known``: the registry's names, built if not given) other
    than the default (the fallback), else ValueError."""
    names, known = tuple(names), candidate_names() if known is None else list(known)
    for name in names:
        if name == DEFAULT:
            raise ValueError(f"{DEFAULT} cannot be excluded: it runs wherever nothing else is chosen")
        if name not in known:
            raise ValueError(f"{name!r} is not a GEMM candidate of the server; they are {', '.join(known[1:])}")
    return names


def server_candidates(exclude: Iterable[str] = ()) -> dict[str, Candidate]:
    """The server's registry without the candidates named in ``exclude`` (checked by :func:`check_excluded`)."""
    reg = make_candidates()
    left_out = set(check_excluded(exclude, list(reg)))
    return {name: c for name, c in reg.items() if name not in left_out}


def choose(us: Mapping[str, float | None], rejected: Mapping[str, str], min_gain: float = MIN_GAIN) -> str:
    """Fastest non-rejected candidate; a non-default one must beat the default by ``min_gain`` (fraction)."""
    ok = {c: t for c, t in us.items() if c not in rejected and t is not None and math.isfinite(t)}
    if not ok:
        return DEFAULT
    best = min(ok, key=ok.__getitem__)
    base = ok.get(DEFAULT)
    if best != DEFAULT and base is not None and ok[best] > base * (1.0 - min_gain):
        return DEFAULT
    return best
