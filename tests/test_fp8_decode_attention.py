"""CPU checks of the split-KV FP8 decode-attention kernel (sglang_fp8rl.kernels.fp8_decode_attention).

The kernel runs under the Triton interpreter, one subprocess per test (Triton picks the interpreter at import time),
on the operands of tests/decode_attention_case.py: an E4M3 query and paged cache, pages shuffled, every slot no
sequence owns poisoned with NaN. The reference is float64 on the same E4M3 values and descales. What the interpreter
cannot show: speed, and the GPU's BF16 output rounding (the interpreter truncates FP32 -> BF16).

Tolerance (decode_attention_case.ROW_TOLERANCE): the kernel widens q/K/V to FP16 (exact for E4M3), accumulates in
float32 and rounds P to FP16, which moves each softmax weight by at most 2**-11 of itself: so each output row may be
off by 2**-11 (4.9e-4) of the largest |V * v_descale| it reads. The check allows 1e-3 of it; measured over ~500
random cases of this file's strategy: at most 1.3e-4 (at most 2.3e-4 of max|ref|). A tolerance relative to max|ref|
(2e-3 * max|ref| + 1e-3) would be too tight for a row whose output cancels to ~0 while its V is large.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from decode_attention_case import paged_case
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import run_under_interpreter

from sglang_fp8rl.kernels import fp8_decode_attention as fda  # imports Triton; no kernel is launched in this process

PREAMBLE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import torch
    from decode_attention_case import ROW_TOLERANCE, paged_case, reference
    from sglang_fp8rl.kernels.fp8_decode_attention import DEFAULT_BLOCK_N, MAX_SPLITS, fp8_decode_attention

    def run(case, **kw):
        return fp8_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["page_table"],
                                    case["cache_seqlens"], case["softmax_scale"], case["k_descale"],
                                    case["v_descale"], **kw)

    def worst_ratio(out, case):
        ref, vmax = reference(case)
        return ((out.double() - ref).abs() / vmax).max().item()
    """
)

PROPERTY_CHECK = PREAMBLE + textwrap.dedent(
    """
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    worst = [0.0]

    @st.composite
    def shapes(draw):
        batch, kv_heads = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        # the interpreter runs a program in ~4 ms: at most 256 split programs per example
        splits = draw(st.integers(1, max(1, min(MAX_SPLITS, 256 // (batch * kv_heads)))))
        block_n = draw(st.sampled_from([32, 64, DEFAULT_BLOCK_N]))  # tokens per step: the split boundaries move
        return dict(batch=batch, kv_heads=kv_heads, group=draw(st.sampled_from([1, 2, 4, 8])),
                    dim=draw(st.sampled_from([64, 128])), page=draw(st.sampled_from([1, 4, 16])),
                    lens=draw(st.lists(st.integers(1, 300), min_size=batch, max_size=batch)),
                    amp=draw(st.sampled_from([0.25, 2.0, 16.0])), scalar_descale=draw(st.booleans()),
                    splits=splits, block_n=block_n, seed=draw(st.integers(0, 2**31 - 1)))

    @settings(max_examples=12, deadline=None, database=None)
    @given(shapes())
    # fixed corners: one 1-token sequence over MAX_SPLITS splits (all but one empty); lengths at and across
    # tile and page boundaries, 10 tiles of 32 shared unevenly by 3 splits; groups of 8 query heads with peaked
    # scores (amp 16)
    @example(dict(batch=1, kv_heads=1, group=1, dim=64, page=1, lens=[1], amp=2.0, scalar_descale=True,
                  splits=64, block_n=DEFAULT_BLOCK_N, seed=1))
    @example(dict(batch=3, kv_heads=2, group=4, dim=128, page=16, lens=[128, 300, 129], amp=2.0,
                  scalar_descale=False, splits=3, block_n=32, seed=2))
    @example(dict(batch=2, kv_heads=4, group=8, dim=64, page=4, lens=[300, 2], amp=16.0, scalar_descale=False,
                  splits=8, block_n=DEFAULT_BLOCK_N, seed=3))
    def matches_the_float64_reference(shape):
        splits, block_n = shape.pop("splits"), shape.pop("block_n")
        case = paged_case(**shape)
        out = torch.full(case["q"].shape, float("nan"))  # float32: the output's rounding does not hide errors
        assert run(case, out=out, splits=splits, block_n=block_n) is out
        ratio = worst_ratio(out, case)
        assert ratio <= ROW_TOLERANCE, (shape, splits, block_n, ratio)
        worst[0] = max(worst[0], ratio)

    matches_the_float64_reference()
    print("decode property ok, worst error / max|V*v_descale| of its row:", worst[0])
    """
)

BF16_CHECK = PREAMBLE + textwrap.dedent(
    """
    for seed, (batch, kv_heads, group, dim, page, lens, splits) in enumerate([
            (2, 2, 4, 128, 1, [300, 3], 5), (1, 4, 2, 64, 16, [97], 2), (3, 1, 8, 64, 4, [1, 250, 64], None)]):
        case = paged_case(seed, batch, kv_heads, group, dim, page, lens, scalar_descale=seed % 2 == 0)
        out = run(case, splits=splits)
        assert out.dtype == torch.bfloat16 and out.shape == case["q"].shape, (out.dtype, out.shape)
        ref, vmax = reference(case)
        f32_tol = ROW_TOLERANCE * vmax
        # one BF16 ulp (2**-7 relative: the interpreter truncates; a GPU rounds, half that) of the output
        err = (out.double() - ref).abs()
        assert (err <= f32_tol + 2**-7 * (ref.abs() + f32_tol)).all(), (seed, (err - f32_tol).max().item())
        f32 = run(case, out=torch.empty(case["q"].shape), splits=splits)
        assert ((out.float() - f32).abs() <= 2**-7 * f32.abs()).all(), seed  # the same values, only narrowed
        given = torch.full(case["q"].shape, float("nan"), dtype=torch.bfloat16)
        assert run(case, out=given, splits=splits) is given and torch.equal(given, out)
    print("decode bf16 ok")
    """
)

DETERMINISM_CHECK = PREAMBLE + textwrap.dedent(
    """
    case = paged_case(7, 3, 1, 8, 128, 16, [300, 1, 65])
    for splits in (None, 1, 6, 64):  # None: the CPU default (8 "SMs"), 64: most splits empty
        first = run(case, splits=splits)
        run(paged_case(8, 2, 1, 2, 64, 1, [200, 30]), splits=splits)  # leaves other values in freed buffers
        again = run(case, splits=splits)
        assert torch.equal(first, again), ("bf16 not reproducible", splits)
        a = run(case, out=torch.full(case["q"].shape, float("nan")), splits=splits)
        b = run(case, out=torch.randn(case["q"].shape), splits=splits)
        assert torch.equal(a, b), ("float32 not reproducible", splits)
    print("decode determinism ok")
    """
)


@pytest.mark.parametrize("check, marker", [(PROPERTY_CHECK, "decode property ok"), (BF16_CHECK, "decode bf16 ok"),
                                           (DETERMINISM_CHECK, "decode determinism ok")],
                         ids=["float32-vs-float64-property", "bf16-output", "determinism"])
def test_under_the_triton_interpreter(check, marker) -> None:
    result = run_under_interpreter(check)
    assert result.returncode == 0, result.stdout + result.stderr
    assert marker in result.stdout, result.stdout


def _operands(**change):
    case = paged_case(0, 2, 2, 4, 64, 1, [5, 3])
    case.update(change)
    return case


def _bf16_caches():
    case = _operands()
    return dict(k_cache=case["k_cache"].to(torch.bfloat16), v_cache=case["v_cache"].to(torch.bfloat16))


def _non_contiguous_dim():
    k = _operands()["k_cache"]
    return k.transpose(2, 3).contiguous().transpose(2, 3)  # same shape and values, head dim stride 2


@pytest.mark.parametrize("change, reason", [
    (_bf16_caches(), "KV cache torch.bfloat16 / torch.bfloat16, not float8_e4m3fn"),
    (dict(v_cache=_operands()["v_cache"][:, :, :1]), "caches differ"),
    (dict(q=torch.zeros(2, 8, 96, dtype=torch.float8_e4m3fn),
          k_cache=torch.zeros(9, 1, 2, 96, dtype=torch.float8_e4m3fn),
          v_cache=torch.zeros(9, 1, 2, 96, dtype=torch.float8_e4m3fn)), "head dim 96"),
    (dict(q=torch.zeros(2, 7, 64, dtype=torch.float8_e4m3fn)), "7 query heads over 2 KV heads"),
    (dict(q=torch.zeros(2, 8, 64, dtype=torch.float8_e4m3fn), cache_seqlens=torch.tensor([5], dtype=torch.int32)),
     "2 query tokens for 1 sequences"),
    (dict(k_cache=_non_contiguous_dim()), "non-contiguous head dimension"),
    (dict(q=torch.zeros(2, 64, 8, dtype=torch.float8_e4m3fn).transpose(1, 2)), "non-contiguous head dimension"),
], ids=["bf16-cache", "kv-shapes", "head-dim-96", "heads-not-multiple", "tokens-vs-sequences", "strided-cache",
        "strided-q"])
def test_cannot_run_names_the_problem_and_the_call_refuses(change, reason) -> None:
    case = _operands(**change)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens")]
    assert reason in (fda.cannot_run(*args) or "")
    with pytest.raises(ValueError, match="fp8_decode_attention: .*" + reason):
        fda.fp8_decode_attention(*args, case["softmax_scale"], case["k_descale"], case["v_descale"])


def test_cannot_run_takes_sglangs_call() -> None:
    case = _operands()
    assert fda.cannot_run(*[case[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens")]) is None


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 1024), kv_heads=st.integers(1, 64), sms=st.integers(1, 264), per_sm=st.integers(1, 8))
def test_num_splits_fills_one_wave_within_bounds(batch, kv_heads, sms, per_sm) -> None:
    splits = fda.num_splits(batch, kv_heads, sms, per_sm)
    wave = sms * per_sm  # programs resident at once
    assert 1 <= splits <= fda.MAX_SPLITS
    if splits > 1:
        assert splits * batch * kv_heads <= wave  # never a second, partly empty wave ...
    if splits < fda.MAX_SPLITS:
        assert (splits + 1) * batch * kv_heads > wave  # ... and as many splits as the first one holds


def test_num_splits_examples() -> None:
    # an H100 (132 SMs) holding 2 programs per SM, 8 KV heads: the module's own numbers (33 at batch 1, 1 from 32 on)
    assert [fda.num_splits(b, 8, 132, per_sm=2) for b in (1, 4, 8, 32, 33, 512)] == [33, 8, 4, 1, 1, 1]
    assert fda.num_splits(1, 1, 132, per_sm=2) == fda.MAX_SPLITS and fda.num_splits(0, 0, 1, per_sm=1) == 1
