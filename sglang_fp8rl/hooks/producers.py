"""``--fp8rl-producer-quant on``: the RMSNorm before qkv / gate_up and the SiLU-and-multiply before down write their
output's 1x128 FP8 quantization, so those block-FP8 linears launch no quantizer of their own.

After load (``hooks/model_runner``), each decoder layer's producer whose consumer is a block-FP8 linear of ours gets
an instance ``forward`` that computes its output with :mod:`sglang_fp8rl.kernels.producers` and attaches the codes;
the consumer's apply takes them (``gemm_select.lookup.apply_selected``, ``layers/linear.reference_linear``). A call
the fused kernel does not take (another signature, dtype or layout, a Dynamo trace, a norm or SiLU over more than
``kernels.producers.FUSED_MAX_ROWS`` rows, where it was measured slower) runs SGLang's own forward, as
does every call once the kernel failed to build; a tensor without codes is quantized by its linear as before. Not
installed under deterministic inference, whose kernels are SGLang's batch-invariant ones. The split-KV decode
attention kernel hands o_proj its output's codes the same way (``hooks/attention``, ``attention_select``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from sglang_fp8rl.compat.runtime import rmsnorm_blocker
from sglang_fp8rl.kernels import producers
from sglang_fp8rl.kernels.deepgemm import candidate_errors
from sglang_fp8rl.quant import DEFAULT_GROUP_SIZE

logger = logging.getLogger(__name__)

# (producer, its consumer), module names relative to a decoder layer (Llama, Qwen2, Qwen3 and their kin)
PAIRS = (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"),
         ("mlp.act_fn", "mlp.down_proj"))


def consumer_blocker(consumer: Any) -> str | None:
    """Why a module is not a block-FP8 linear of ours reading 1x128 groups, or None."""
    from sglang_fp8rl.layers.linear import Fp8OnlineBlockwiseLinearMethod

    if not isinstance(getattr(consumer, "quant_method", None), Fp8OnlineBlockwiseLinearMethod):
        return "its linear is not block-FP8 (a BF16 layer)"
    if not consumer._fp8rl.is_block:
        return "its linear fell back to per-channel FP8"
    if consumer.weight.shape[1] % DEFAULT_GROUP_SIZE:
        return f"its input width {consumer.weight.shape[1]} is not a multiple of {DEFAULT_GROUP_SIZE}"
    return None


def producer_kind(producer: Any) -> str | None:
    """"norm" for SGLang's RMSNorm, "silu" for its SiluAndMul (exactly those classes), else None."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    return {RMSNorm: "norm", SiluAndMul: "silu"}.get(type(producer))


def producer_blocker(producer: Any, consumer: Any) -> str | None:
    """Why a producer module cannot hand its consumer a quantized input, or None."""
    kind, width = producer_kind(producer), consumer.weight.shape[1]
    if kind is None:
        return f"{type(producer).__name__} is not SGLang's RMSNorm or SiluAndMul"
    if kind == "silu":
        return None
    from sglang_fp8rl.kernels.norm_quant import MAX_NORM_WIDTH  # Triton: imported where an RMSNorm is judged

    if width > MAX_NORM_WIDTH:
        return f"its width {width} is above {MAX_NORM_WIDTH}"
    return rmsnorm_blocker(producer)


def takes(x: torch.Tensor, width: int) -> bool:
    """Whether the fused kernel computes this call: BF16, 2-D rows of ``width`` values, contiguous, not empty, not
    inside a Dynamo trace (SGLang's piecewise graphs trace SGLang's own ops). On CPU the torch reference computes it."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == width and x.shape[0] > 0
            and x.is_contiguous() and not torch.compiler.is_compiling())


def fused_norm(norm: Any, original: Callable, failed: list[str]) -> Callable:
    """``norm``'s forward computing ``(out, residual)`` / ``out`` with the quantization attached."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs.get("x")
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        rest = [*args[2:], *(v for key, v in kwargs.items() if key not in ("x", "residual"))]
        width = norm.weight.shape[0]
        if failed or any(v is not None for v in rest) or not isinstance(x, torch.Tensor) or not takes(x, width) \
                or x.shape[0] > producers.FUSED_MAX_ROWS \
                or not (residual is None or (takes(residual, width) and residual.shape == x.shape)):
            return original(*args, **kwargs)
        try:
            out, codes, scales = producers.add_rmsnorm_quant(x, norm.weight.data, norm.variance_epsilon, residual)
        except candidate_errors() as e:  # before anything was written: SGLang's own norm computes this call
            return fall_back(failed, e, original, args, kwargs)
        producers.attach(out, codes, scales)
        return out if residual is None else (out, residual)

    return forward


def fused_silu(original: Callable, failed: list[str]) -> Callable:
    """SiluAndMul's forward computing ``silu(gate) * up`` with the quantization attached."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        if failed or not isinstance(x, torch.Tensor) or x.shape[-1] % (2 * DEFAULT_GROUP_SIZE) \
                or not takes(x, x.shape[-1]) or x.shape[0] > producers.FUSED_MAX_ROWS:
            return original(*args, **kwargs)
        try:
            out, codes, scales = producers.silu_mul_quant(x)
        except candidate_errors() as e:
            return fall_back(failed, e, original, args, kwargs)
        return producers.attach(out, codes, scales)

    return forward


def fall_back(failed: list[str], error: BaseException, original: Callable, args: tuple, kwargs: dict) -> Any:
    """The first failure of a fused kernel: logged once, SGLang's forward from then on (this call included)."""
    if not failed:
        failed.append(f"{type(error).__name__}: {error}")
        logger.warning("[fp8rl] producer quantization: SGLang's norm and SiLU from now on; the fused kernel "
                       "failed (%s)", failed[0])
    return original(*args, **kwargs)


def plan(model: torch.nn.Module) -> tuple[list[tuple[str, Any, str]], dict[str, str]]:
    """(producer name, producer, its kind) to wire, and the producers left as they are with why."""
    modules = dict(model.named_modules())
    wire, left = [], {}
    for name, module in modules.items():
        for producer_suffix, consumer_suffix in PAIRS:
            if not name.endswith("." + producer_suffix):
                continue
            consumer = modules.get(name[: -len(producer_suffix)] + consumer_suffix)
            if consumer is None:
                continue
            why = consumer_blocker(consumer) or producer_blocker(module, consumer)
            if why:
                left[name] = why
            else:
                wire.append((name, module, producer_kind(module)))
    return wire, left


def off_reason(server_args: Any) -> str | None:
    """Why no kernel of a step hands its output's codes over under ``--fp8rl-producer-quant on``, or None."""
    if getattr(server_args, "enable_deterministic_inference", False) or getattr(server_args, "rl_on_policy_target",
                                                                                 None):
        return "off under deterministic inference (SGLang's batch-invariant norm and SiLU kernels)"
    return None


def install(model: torch.nn.Module, server_args: Any) -> int:
    """Wire the producers of ``model`` (one log line for the decision); the number wired."""
    why = off_reason(server_args)
    if why:
        logger.info("[fp8rl] producer quantization: %s", why)
        return 0
    wire, left = plan(model)
    failed: list[str] = []  # shared: a kernel that does not build here does not build for any producer
    for _, producer, kind in wire:
        original = producer.forward
        producer.forward = fused_silu(original, failed) if kind == "silu" else fused_norm(producer, original, failed)
    reasons = sorted(set(left.values()))
    logger.info("[fp8rl] producer quantization: %d producers quantize their output for a block-FP8 linear; %d left "
                "as they are%s", len(wire), len(left), f" ({'; '.join(reasons)})" if reasons else "")
    return len(wire)
