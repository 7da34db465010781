"""What the block-FP8 GEMM code knows about SGLang's DeepGEMM path, in one place (GEMM selection and JIT warm-up).

SGLang 0.5.17 dispatches a block-FP8 linear with ``--fp8-gemm-backend auto`` (its default) to its DeepGEMM linear
(``deepgemm_w8a8_block_fp8_linear_with_fallback``) when DeepGEMM is enabled (``SGLANG_ENABLE_JIT_DEEPGEMM``, on by
default on Hopper and Blackwell with deep_gemm installed). That linear runs DeepGEMM only for weights with
N % 64 == 0 and K % 128 == 0 and silently runs SGLang's Triton block GEMM otherwise. Where DeepGEMM wants UE8M0
scales (Blackwell) the float32-scale launches of this package do not apply.

SGLang is imported on first use only, here and nowhere else in ``kernels/``: its import takes seconds (25-35 s on an
H100 machine), and the JIT warm-up workers and the scripts import these modules without it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from types import ModuleType

import torch

from sglang_fp8rl.compat.runtime import deepgemm_linear_is_quant_then_gemm, fp8_kernel_module
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE

PRECOMPILE_ENV = "SGLANG_JIT_DEEPGEMM_PRECOMPILE"  # SGLang's "compile every M at the first call" switch
AUTO_BACKEND = "auto"  # SGLang's --fp8-gemm-backend default; any other value is a backend the user named
N_MULTIPLE = 64
K_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class DeepGemmFacts:
    """SGLang's DeepGEMM decisions in this process, and the device's SM count (the bound of a ``num_sms``)."""

    enabled: bool = False  # SGLang's ENABLE_JIT_DEEPGEMM
    ue8m0: bool = False  # DeepGEMM wants UE8M0 scales on this GPU
    dispatch_is_deepgemm: bool = False  # SGLang's block-FP8 dispatch resolved to its DeepGEMM linear
    sms: int = 0

    def variant_blocker(self) -> str | None:
        """Why a DeepGEMM variant of this package cannot run here, or None."""
        if not self.enabled:
            return "DeepGEMM disabled or missing"
        if self.ue8m0:
            return "DeepGEMM wants UE8M0 scales on this GPU"
        return None

    @property
    def label(self) -> str:
        """Short form for cache keys: off, ue8m0 or fp32 (measurements differ between the three)."""
        return "off" if not self.enabled else ("ue8m0" if self.ue8m0 else "fp32")

    @property
    def default_is_fp32_deepgemm(self) -> bool:
        """Whether SGLang's default block linear is DeepGEMM with float32 scales (what the JIT warm-up launches)."""
        return self.dispatch_is_deepgemm and self.variant_blocker() is None


def deepgemm_takes_shape(n: int, k: int) -> bool:
    """Whether SGLang runs DeepGEMM for an [N, K] block weight (else it silently runs its Triton block GEMM)."""
    return n % N_MULTIPLE == 0 and k % K_MULTIPLE == 0


@functools.cache
def sglang_fp8_utils() -> ModuleType:
    """SGLang's ``fp8_utils`` (its block-FP8 linears and their dispatch), imported once on first use."""
    from sglang.srt.layers.quantization import fp8_utils

    return fp8_utils


@functools.cache
def sglang_deep_gemm_wrapper() -> ModuleType:
    """SGLang's ``deep_gemm_wrapper`` (DeepGEMM flags, ``configure_deep_gemm_num_sms``), imported once on first use."""
    from sglang.srt.layers import deep_gemm_wrapper

    return deep_gemm_wrapper


@functools.cache
def sglang_fp8_kernel() -> ModuleType:
    """SGLang's FP8 quantization kernels (its 1x128 activation quantizer), imported once on first use."""
    return fp8_kernel_module()


def device_sms(device: torch.device | int | None = None) -> int:
    """SM count of a CUDA device (the current one by default); 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    index = torch.cuda.current_device() if device is None else device
    return torch.cuda.get_device_properties(index).multi_processor_count


def detect(device: torch.device | int | None = None) -> DeepGemmFacts:
    """The facts as SGLang decided them in this process (all off where SGLang's DeepGEMM layer does not import)."""
    sms = device_sms(device)
    try:
        wrapper = sglang_deep_gemm_wrapper()
    except ImportError:
        return DeepGemmFacts(sms=sms)
    enabled = bool(getattr(wrapper, "ENABLE_JIT_DEEPGEMM", False))
    ue8m0 = bool(getattr(wrapper, "DEEPGEMM_SCALE_UE8M0", False))
    dispatch = False
    if enabled:
        utils = sglang_fp8_utils()
        dispatch = utils.dispatch_w8a8_block_fp8_linear() is utils.deepgemm_w8a8_block_fp8_linear_with_fallback
    return DeepGemmFacts(enabled=enabled, ue8m0=ue8m0, dispatch_is_deepgemm=dispatch, sms=sms)


@functools.cache
def deep_gemm_module() -> ModuleType:
    """DeepGEMM itself (the module SGLang's wrapper launches from), imported once on first use."""
    import deep_gemm

    return deep_gemm


def precompile_on() -> bool:
    """SGLang's reading of SGLANG_JIT_DEEPGEMM_PRECOMPILE (on unless set to something other than true / 1)."""
    return os.environ.get(PRECOMPILE_ENV, "true").lower() in ("true", "1")


def direct_reason(facts: DeepGemmFacts) -> str | None:
    """Why SGLang's default block linear cannot be made here as the two launches of :func:`linear_direct`, or None."""
    if not facts.default_is_fp32_deepgemm:
        return "SGLang's block-FP8 linear is not DeepGEMM with float32 scales here"
    if not deepgemm_linear_is_quant_then_gemm(sglang_fp8_utils().deepgemm_w8a8_block_fp8_linear_with_fallback):
        return "this SGLang release's DeepGEMM linear is not the two launches this package makes (0.5.12-0.5.21)"
    if precompile_on():
        return f"{PRECOMPILE_ENV} is on: SGLang's linear compiles every M of a shape at its first call"
    return None


def direct_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether SGLang's DeepGEMM linear would run this call on DeepGEMM (else it takes another path of its own)."""
    return (x.dtype == torch.bfloat16 and x.numel() > 0 and x.is_contiguous()
            and deepgemm_takes_shape(weight.shape[0], weight.shape[1]))


def quantize_for_deepgemm(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's 1x128 activation quantizer as its DeepGEMM linear calls it with float32 scales: (e4m3 codes,
    multipliers column-major with M padded to 4, TMA-aligned)."""
    return sglang_fp8_kernel().sglang_per_token_group_quant_fp8(
        x2d, DEFAULT_BLOCK_SIZE[1], column_major_scales=True, scale_tma_aligned=True, scale_ue8m0=False)


def linear_direct(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """SGLang's DeepGEMM block linear (0.5.12-0.5.21) as its two launches: the same activation quantizer call and
    the same ``deep_gemm.fp8_gemm_nt`` launch, so the same kernels and bits, without the Python layers between them
    (custom-op dispatch, JIT hook, checks): host time that decode without CUDA graphs pays per call (RESULTS 20)."""
    x2d = x.view(-1, x.shape[-1])
    xq, xs = quantize_for_deepgemm(x2d)
    out = xq.new_empty((x2d.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    deep_gemm_module().fp8_gemm_nt((xq, xs), (weight, weight_scale_inv), out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def prequantized_default_reason() -> str | None:
    """Why SGLang's default block linear cannot take an activation quantized beforehand here, or None: it must be
    its DeepGEMM linear with float32 scales, made as the quantizer then ``w8a8_block_fp8_matmul_deepgemm``
    (0.5.12-0.5.21), whose second launch then runs on the handed-over codes and multipliers (the same layout)."""
    if not detect().default_is_fp32_deepgemm:
        return "SGLang's block-FP8 linear is not DeepGEMM with float32 scales here"
    if not deepgemm_linear_is_quant_then_gemm(sglang_fp8_utils().deepgemm_w8a8_block_fp8_linear_with_fallback):
        return "this SGLang release's DeepGEMM linear is not the quantizer then one GEMM launch (0.5.12-0.5.21)"
    return None


def prequantized_default(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         weight_scale_inv: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """SGLang's default block linear on an activation quantized beforehand: its own GEMM launch on (codes, scales),
    or None where it would not run DeepGEMM (the caller quantizes ``x`` as usual)."""
    if prequantized_default_reason() or not direct_takes(x, weight):
        return None
    out = sglang_fp8_utils().w8a8_block_fp8_matmul_deepgemm(codes, weight, scales, weight_scale_inv,
                                                           list(DEFAULT_BLOCK_SIZE), output_dtype=torch.bfloat16)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def candidate_errors() -> tuple[type[BaseException], ...]:
    """What a failing GEMM launch raises (JIT/compile failures, bad launches, shape asserts): the caller counts it as
    that launch's failure instead of stopping."""
    errors: list[type[BaseException]] = [RuntimeError, ValueError, AssertionError, TypeError, NotImplementedError]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:  # no Triton on this platform: nothing of it can fail
        return tuple(errors)
    return (*errors, CompilationError, OutOfResources)
