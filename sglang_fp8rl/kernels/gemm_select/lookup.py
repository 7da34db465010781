"""Apply-time lookup: the choices load-time preparation installed for this process, and the linear apply using them.

Nothing installed (selection off, ``--fp8-gemm-backend`` named, nothing measured, or preparation not run) means
SGLang's own dispatched linear for every call, with exactly the arguments SGLang's linear method passes. Where
preparation installed ``direct``, the default's calls that SGLang would run on DeepGEMM and that no CUDA graph is
capturing are made as SGLang's two launches directly (:func:`sglang_fp8rl.kernels.deepgemm.linear_direct`: the same
kernels, less host time: decode without CUDA graphs pays it every step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sglang_fp8rl.engine import OWNERS, declare, reset
from sglang_fp8rl.kernels.deepgemm import direct_takes, linear_direct, prequantized_default
from sglang_fp8rl.kernels.gemm_select.buckets import m_bucket, shape_key
from sglang_fp8rl.kernels.gemm_select.candidates import BLOCK, DEFAULT, Candidate, default_linear, sglang_block_call
from sglang_fp8rl.kernels.producers import note_taken, quantized_input


@dataclasses.dataclass
class Selection:
    """This process's choices: shape key -> candidate name (never the default), and the candidates by name. One per
    process, ``OWNERS.gemm_table`` (:mod:`sglang_fp8rl.engine`), read by every linear apply."""

    choices: dict[str, str] = dataclasses.field(default_factory=dict)
    candidates: dict[str, Candidate] = dataclasses.field(default_factory=dict)
    direct: bool = False  # the default's DeepGEMM calls made as SGLang's two launches (linear_direct)


declare("gemm_table", Selection)


def install(choices: Mapping[str, str], candidates: Mapping[str, Candidate], direct: bool = False) -> None:
    """Make ``choices`` this process's selection (entries choosing the default are dropped: it is the fallback);
    ``direct``: make the default's DeepGEMM calls directly (only where ``deepgemm.direct_reason`` found no reason
    against it)."""
    missing = {name for name in choices.values() if name != DEFAULT and name not in candidates}
    if missing:
        raise ValueError(f"gemm_select: choices name unknown candidates {sorted(missing)}")
    table = OWNERS.gemm_table
    table.choices = {key: name for key, name in choices.items() if name != DEFAULT}
    table.candidates = dict(candidates)
    table.direct = direct


def installed() -> Selection:
    """A copy of this process's selection."""
    table = OWNERS.gemm_table
    return Selection(dict(table.choices), dict(table.candidates), table.direct)


def reset_state() -> None:
    """Forget the selection and SGLang's resolved dispatch (tests, or a process that prepares another model)."""
    reset("gemm_table")
    default_linear.cache_clear()


def select(m: int, n: int, k: int) -> str:
    """Candidate name for (m, n, k) in this process: the installed choice of m's bucket, else the default."""
    return OWNERS.gemm_table.choices.get(shape_key(n, k, m_bucket(m)), DEFAULT)


def selected(x: Any, weight: Any) -> str:
    """The candidate name for a linear call on ``x`` (its rows are M) with ``weight`` [N, K]."""
    if not OWNERS.gemm_table.choices:
        return DEFAULT
    k = x.shape[-1]
    return select(x.numel() // k if x.numel() else 1, weight.shape[0], k)


def capturing(x: Any) -> bool:
    """Whether this launch is being captured into a CUDA graph or traced by torch.compile (SGLang's piecewise prefill
    graphs trace the model with Dynamo, which can follow SGLang's custom ops but not a raw DeepGEMM call). Those stay
    SGLang's own calls: a replay has no host time to save, and the graph-mode speeds in docs/RESULTS.md were measured
    through SGLang's call."""
    return torch.compiler.is_compiling() or (bool(x.is_cuda) and torch.cuda.is_current_stream_capturing())


def apply_selected(x: Any, weight: Any, weight_scale_inv: Any, bias: Any, default_fn: Callable,
                   block_size: Sequence[int] = BLOCK) -> Any:
    """The linear apply with selection: ``default_fn`` is SGLang's dispatched block linear (keyword signature).
    Blocks other than 128x128 always take ``default_fn`` (the candidates and the cache assume 128x128)."""
    if tuple(block_size) != BLOCK:
        return sglang_block_call(default_fn, x, weight, weight_scale_inv, bias, block_size)
    handed = quantized_input(x)
    if handed is not None:
        out = apply_prequantized(handed, x, weight, weight_scale_inv, bias)
        if out is not None:
            note_taken()
            return out
    table = OWNERS.gemm_table
    name = selected(x, weight)
    if name != DEFAULT:
        return table.candidates[name].fn(x, weight, weight_scale_inv, bias)
    if table.direct and not capturing(x) and direct_takes(x, weight):
        return linear_direct(x, weight, weight_scale_inv, bias)
    return sglang_block_call(default_fn, x, weight, weight_scale_inv, bias, block_size)


def apply_prequantized(handed: tuple[Any, Any], x: Any, weight: Any, weight_scale_inv: Any, bias: Any) -> Any:
    """The selected GEMM on the codes and multipliers a producer handed over with ``x``, or None where that GEMM
    quantizes for itself (the caller then quantizes ``x`` as usual)."""
    name = selected(x, weight)
    if name == DEFAULT:
        return prequantized_default(*handed, x, weight, weight_scale_inv, bias)
    fn = OWNERS.gemm_table.candidates[name].prequantized
    return fn(*handed, x, weight, weight_scale_inv, bias) if fn is not None else None
