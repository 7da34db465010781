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
from hypothesis import example, given, settings
from hypothesis import strategies as st
from triton_interpreter import BF16_RNE_PREAMBLE, E4M3_RNE_PREAMBLE, QUANTIZER_PREAMBLE, run_under_interpreter

from sglang_fp8rl.kernels import fp8_decode_attention as fda  # imports Triton; no kernel is launched in this process

PREAMBLE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import torch
    from decode_attention_case import ROW_TOLERANCE, paged_case, reference
    from sglang_fp8rl.kernels.fp8_decode_attention import DEFAULT_BLOCK_N, MAX_SPLITS, fp8_decode_attention, plan_splits

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
        # the interpreter runs a program in ~4 ms: at most 256 split programs per example ((budget + batch) x heads)
        budget = draw(st.integers(1, max(1, 256 // kv_heads - batch)))
        block_n = draw(st.sampled_from([32, 64, DEFAULT_BLOCK_N]))  # tokens per step: the split boundaries move
        return dict(batch=batch, kv_heads=kv_heads, group=draw(st.sampled_from([1, 2, 4, 8])),
                    dim=draw(st.sampled_from([64, 128])), page=draw(st.sampled_from([1, 4, 16])),
                    lens=draw(st.lists(st.integers(1, 300), min_size=batch, max_size=batch)),
                    amp=draw(st.sampled_from([0.25, 2.0, 16.0])), scalar_descale=draw(st.booleans()),
                    budget=budget, block_n=block_n, seed=draw(st.integers(0, 2**31 - 1)),
                    preplan=draw(st.booleans()))

    @settings(max_examples=12, deadline=None, database=None)
    @given(shapes())
    # fixed corners: one 1-token sequence with a budget of 64 programs (all but one idle); lengths at and across
    # tile and page boundaries, 10 tiles of 32 shared by 4 splits of 3 tiles (the last one short); groups of 8
    # query heads with peaked scores (amp 16); a long sequence among short ones split 10 ways, the rest one each;
    # more splits asked for than MAX_SPLITS allows
    @example(dict(batch=1, kv_heads=1, group=1, dim=64, page=1, lens=[1], amp=2.0, scalar_descale=True,
                  budget=64, block_n=DEFAULT_BLOCK_N, seed=1))
    @example(dict(batch=3, kv_heads=2, group=4, dim=128, page=16, lens=[128, 300, 129], amp=2.0,
                  scalar_descale=False, budget=7, block_n=32, seed=2))
    @example(dict(batch=2, kv_heads=4, group=8, dim=64, page=4, lens=[300, 2], amp=16.0, scalar_descale=False,
                  budget=8, block_n=DEFAULT_BLOCK_N, seed=3))
    @example(dict(batch=4, kv_heads=1, group=4, dim=64, page=1, lens=[3, 300, 9, 1], amp=2.0, scalar_descale=True,
                  budget=12, block_n=32, seed=4))
    @example(dict(batch=1, kv_heads=2, group=2, dim=64, page=1, lens=[300], amp=2.0, scalar_descale=False,
                  budget=100, block_n=4, seed=5))
    def matches_the_float64_reference(shape):
        budget, block_n, preplan = shape.pop("budget"), shape.pop("block_n"), shape.pop("preplan", False)
        case = paged_case(**shape)
        out = torch.full(case["q"].shape, float("nan"))  # float32: the output's rounding does not hide errors
        assert run(case, out=out, budget=budget, block_n=block_n, preplan=preplan) is out
        ratio = worst_ratio(out, case)
        assert ratio <= ROW_TOLERANCE, (shape, budget, block_n, ratio)
        worst[0] = max(worst[0], ratio)

    matches_the_float64_reference()
    print("decode property ok, worst error / max|V*v_descale| of its row:", worst[0])
    """
)

BF16_CHECK = PREAMBLE + textwrap.dedent(
    """
    for seed, (batch, kv_heads, group, dim, page, lens, budget) in enumerate([
            (2, 2, 4, 128, 1, [300, 3], 5), (1, 4, 2, 64, 16, [97], 2), (3, 1, 8, 64, 4, [1, 250, 64], None)]):
        case = paged_case(seed, batch, kv_heads, group, dim, page, lens, scalar_descale=seed % 2 == 0)
        out = run(case, budget=budget)
        assert out.dtype == torch.bfloat16 and out.shape == case["q"].shape, (out.dtype, out.shape)
        ref, vmax = reference(case)
        f32_tol = ROW_TOLERANCE * vmax
        # one BF16 ulp (2**-7 relative: the interpreter truncates; a GPU rounds, half that) of the output
        err = (out.double() - ref).abs()
        assert (err <= f32_tol + 2**-7 * (ref.abs() + f32_tol)).all(), (seed, (err - f32_tol).max().item())
        f32 = run(case, out=torch.empty(case["q"].shape), budget=budget)
        assert ((out.float() - f32).abs() <= 2**-7 * f32.abs()).all(), seed  # the same values, only narrowed
        given = torch.full(case["q"].shape, float("nan"), dtype=torch.bfloat16)
        assert run(case, out=given, budget=budget) is given and torch.equal(given, out)
    print("decode bf16 ok")
    """
)

# single_plan: one sequence planned in closed form inside both kernels (no plan launch) gives the default's bits, with
# and without the output codes, at lengths around the tile and split edges and budgets that idle most programs; a batch
# of two is left to the default plan
SINGLE_PLAN_CHECK = PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels.norm_quant import empty_scales

    for seed, (dim, page, length, budget, block_n) in enumerate([(128, 1, 300, None, 128), (64, 16, 1, 64, 32),
                                                                  (128, 4, 129, 7, 32), (64, 1, 250, 3, 64)]):
        case = paged_case(seed, 1, 2, 4, dim, page, [length], scalar_descale=seed % 2 == 0)
        for kw in (dict(budget=budget, block_n=block_n), dict(budget=budget, block_n=block_n, preplan=False)):
            assert torch.equal(run(case, single_plan=True, **kw), run(case, single_plan=False, **kw)), (seed, kw)
        if dim == 128:
            codes = [(torch.zeros(1, 8 * 128).to(torch.float8_e4m3fn), empty_scales(1, 8 * 128, torch.device("cpu"),
                                                                                     "row")) for _ in range(2)]
            outs = [run(case, single_plan=flag, out_codes=c, budget=budget) for flag, c in zip((True, False), codes)]
            assert torch.equal(outs[0], outs[1]) and torch.equal(codes[0][1], codes[1][1]), seed
            assert torch.equal(codes[0][0].view(torch.uint8), codes[1][0].view(torch.uint8)), seed
    two = paged_case(9, 2, 2, 4, 64, 1, [300, 3])
    assert torch.equal(run(two, single_plan=True, budget=5), run(two, single_plan=False, budget=5))
    for bad in ("yes", 1):
        try:
            run(two, single_plan=bad)
        except ValueError as e:
            assert "single_plan must be a bool" in str(e), e
        else:
            raise AssertionError(f"single_plan={bad!r} accepted")
    print("decode single plan ok")
    """
)

# fused_merge: each (sequence, KV head)'s last split merges its query heads, no merge launch: the default's bits with
# each plan form, with the output codes, at idle programs and lengths of 0; the counts are back at 0 after every call
FUSED_MERGE_CHECK = PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels.norm_quant import empty_scales
    from sglang_fp8rl.kernels.split_kv_plan_kernel import merge_counts

    for seed, (batch, kv_heads, group, dim, page, lens, budget) in enumerate([
            (3, 2, 4, 128, 1, [300, 3, 129], 5), (1, 2, 4, 128, 1, [300], None), (4, 1, 8, 64, 4, [0, 250, 64, 1], 3),
            (2, 4, 2, 64, 16, [97, 0], 64)]):
        case = paged_case(seed, batch, kv_heads, group, dim, page, lens)
        for kw in (dict(single_plan=False), dict(preplan=False), dict(single_plan=True),
                   dict(out=torch.empty(case["q"].shape))):
            want = run(case, budget=budget, **{k: (v.clone() if k == "out" else v) for k, v in kw.items()})
            got = run(case, budget=budget, fused_merge=True, **kw)
            assert torch.equal(got, want), (seed, kw)
            assert not merge_counts(torch.device("cpu"), 1).any(), (seed, kw)
        if dim == 128:
            heads = kv_heads * group
            codes = [(torch.zeros(batch, heads * 128).to(torch.float8_e4m3fn),
                      empty_scales(batch, heads * 128, torch.device("cpu"), "row")) for _ in range(2)]
            outs = [run(case, budget=budget, fused_merge=flag, out_codes=c) for flag, c in zip((True, False), codes)]
            assert torch.equal(outs[0], outs[1]) and torch.equal(codes[0][1], codes[1][1]), seed
            assert torch.equal(codes[0][0].view(torch.uint8), codes[1][0].view(torch.uint8)), seed
    try:
        run(case, fused_merge=1)
    except ValueError as e:
        assert "fused_merge must be a bool" in str(e), e
    else:
        raise AssertionError("fused_merge=1 accepted")
    print("decode fused merge ok")
    """
)

# a BF16 query (--fp8rl-decode-query bf16: the query as the model made it, not cast to E4M3 first) is read as such:
# within the tolerance of the float64 attention of that query, where the E4M3-cast query is far off it
BF16_QUERY_CHECK = PREAMBLE + textwrap.dedent(
    """
    for seed, (batch, kv_heads, group, dim, page, lens) in enumerate([(2, 2, 4, 128, 1, [300, 3]),
                                                                      (3, 1, 8, 64, 4, [1, 250, 64])]):
        case = paged_case(seed, batch, kv_heads, group, dim, page, lens)
        gen = torch.Generator().manual_seed(seed)
        q = (torch.randn(case["q"].shape, generator=gen) * 2.0).to(torch.bfloat16)
        bf16 = dict(case, q=q)
        out = run(bf16, out=torch.empty(q.shape))
        assert worst_ratio(out, bf16) <= ROW_TOLERANCE, (seed, worst_ratio(out, bf16))
        cast = run(dict(case, q=q.to(torch.float8_e4m3fn)), out=torch.empty(q.shape))
        assert worst_ratio(cast, bf16) > 4 * max(worst_ratio(out, bf16), ROW_TOLERANCE / 4), seed
        # read where the model wrote it (kernels/query_placeholder.py): a column slice of qkv, NaN in K's and V's
        heads = kv_heads * group
        qkv = torch.full((batch, (heads + 2 * kv_heads) * dim), float("nan"), dtype=torch.bfloat16)
        qkv[:, :heads * dim] = q.reshape(batch, heads * dim)
        in_qkv = run(dict(case, q=qkv[:, :heads * dim].view(batch, heads, dim)), out=torch.empty(q.shape))
        assert torch.equal(in_qkv, out), seed
    print("decode bf16 query ok")
    """
)

DETERMINISM_CHECK = PREAMBLE + textwrap.dedent(
    """
    case = paged_case(7, 3, 1, 8, 128, 16, [300, 1, 65])
    for budget in (None, 1, 6, 64):  # None: the CPU default (8 "SMs"), 64: most programs idle
        first = run(case, budget=budget)
        run(paged_case(8, 2, 1, 2, 64, 1, [200, 30]), budget=budget)  # leaves other values in freed buffers
        again = run(case, budget=budget)
        assert torch.equal(first, again), ("bf16 not reproducible", budget)
        a = run(case, out=torch.full(case["q"].shape, float("nan")), budget=budget)
        b = run(case, out=torch.randn(case["q"].shape), budget=budget)
        assert torch.equal(a, b), ("float32 not reproducible", budget)
    # a smaller grid (fine 1: no several-wave plans) with the same plan does the same arithmetic: the same bits
    lens = case["cache_seqlens"].tolist()
    for budget in (1, 6):
        assert plan_splits(lens, budget, fine=1) == plan_splits(lens, budget), budget
        assert torch.equal(run(case, budget=budget, fine=1), run(case, budget=budget)), ("fine 1", budget)
    # the plan written once by its own launch (preplan): the same plan, so the same bits, idle programs included
    for budget in (None, 1, 6, 64):
        assert torch.equal(run(case, budget=budget, preplan=True), run(case, budget=budget, preplan=False)), \
            ("preplan", budget)
    # a plan that fine changes (a long sequence among short ones, 39 tiles of 32 over a budget of 5: one wave
    # would need 18 tiles a program): both within the tolerance of the float64 reference
    ragged = paged_case(9, 4, 1, 4, 64, 1, [1100, 20, 30, 40])
    assert plan_splits([1100, 20, 30, 40], 5, 32, fine=1) != plan_splits([1100, 20, 30, 40], 5, 32)
    for fine in (1, 3):
        out = run(ragged, out=torch.empty(ragged["q"].shape), budget=5, block_n=32, fine=fine, preplan=False)
        assert worst_ratio(out, ragged) <= ROW_TOLERANCE, fine
        planned = run(ragged, out=torch.empty(ragged["q"].shape), budget=5, block_n=32, fine=fine, preplan=True)
        assert torch.equal(planned, out), ("preplan", fine)
    for bad in ({"fine": 0}, {"fine": 1.5}, {"preplan": 1}):
        try:
            run(case, **bad)
        except ValueError as e:
            assert f"{next(iter(bad))} must be" in str(e), e
        else:
            raise AssertionError(f"{bad} accepted")
    print("decode determinism ok")
    """
)


# out_codes: the merge writes the BF16 output's 1x128 quantization too (one head a group), in both scale layouts; the
# output itself is the plain call's; a head dim of 64 or wrong buffers are refused by name
OUT_CODES_CHECK = QUANTIZER_PREAMBLE + E4M3_RNE_PREAMBLE + BF16_RNE_PREAMBLE + PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels.norm_quant import empty_scales

    for seed, (batch, kv_heads, group, lens) in enumerate([(2, 2, 4, [300, 3]), (3, 1, 8, [1, 250, 64]),
                                                          (1, 4, 2, [97])]):
        case = paged_case(seed, batch, kv_heads, group, 128, 1, lens, amp=16.0 if seed == 1 else 2.0)
        heads = kv_heads * group
        plain = run(case)
        for layout in ("row", "tma"):
            codes = torch.full((batch, heads * 128), float("nan")).to(torch.float8_e4m3fn)
            scales = empty_scales(batch, heads * 128, torch.device("cpu"), layout).fill_(float("nan"))
            out = run(case, out_codes=(codes, scales))
            assert torch.equal(out, plain), (seed, layout)
            ref_q, ref_s = quant.quantize_activation_groups(out.reshape(batch, heads * 128), 128)
            assert torch.equal(scales.contiguous(), ref_s), (seed, layout)
            assert torch.equal(codes.view(torch.uint8), ref_q.view(torch.uint8)), (seed, layout)
    small = paged_case(0, 2, 2, 4, 64, 1, [5, 3])
    for bad, name in [((torch.empty(2, 512, dtype=torch.float8_e4m3fn), torch.empty(2, 8)), "head dim of 128")]:
        try:
            run(small, out_codes=bad)
        except ValueError as e:
            assert name in str(e), e
        else:
            raise AssertionError("a head dim of 64 accepted")
    case = paged_case(0, 2, 2, 4, 128, 1, [5, 3])
    for bad, name in [((torch.empty(2, 1024, dtype=torch.bfloat16), torch.empty(2, 8)), "out_codes[0]"),
                      ((torch.empty(2, 1024, dtype=torch.float8_e4m3fn), torch.empty(2, 4)), "out_codes[1]")]:
        try:
            run(case, out_codes=bad)
        except ValueError as e:
            assert name in str(e), e
        else:
            raise AssertionError(f"{name} accepted")
    print("decode out codes ok")
    """
)


@pytest.mark.parametrize("check, marker", [(PROPERTY_CHECK, "decode property ok"), (BF16_CHECK, "decode bf16 ok"),
                                           (DETERMINISM_CHECK, "decode determinism ok"),
                                           (OUT_CODES_CHECK, "decode out codes ok"),
                                           (BF16_QUERY_CHECK, "decode bf16 query ok"),
                                           (SINGLE_PLAN_CHECK, "decode single plan ok"),
                                           (FUSED_MERGE_CHECK, "decode fused merge ok")],
                         ids=["float32-vs-float64-property", "bf16-output", "determinism", "out-codes", "bf16-query",
                              "single-plan", "fused-merge"])
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


@pytest.mark.parametrize("keyword, value", [("fine", 0), ("preplan", 1), ("v_widen_tile", "yes")])
def test_bad_options_are_refused_by_name(keyword, value) -> None:
    case = _operands()
    args = [case[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "softmax_scale", "k_descale",
                              "v_descale")]
    with pytest.raises(ValueError, match=f"fp8_decode_attention: {keyword} must be"):
        fda.fp8_decode_attention(*args, **{keyword: value})


def test_cannot_run_takes_sglangs_call() -> None:
    case = _operands()
    assert fda.cannot_run(*[case[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens")]) is None


PLAN_CHECK = textwrap.dedent(
    """
    import random
    import torch
    import triton
    import triton.language as tl
    from sglang_fp8rl.kernels.fp8_decode_attention import FINE, MAX_SPLITS, _plan, plan_splits

    @triton.jit
    def plan_kernel(seqlens_ptr, splits_ptr, ends_ptr, batch, budget, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                    MAX_SPLITS: tl.constexpr, FINE: tl.constexpr):
        offs_b, tiles, splits, ends = _plan(seqlens_ptr, batch, budget, BLOCK_B, BLOCK_N, MAX_SPLITS, FINE)
        tl.store(splits_ptr + offs_b, splits, mask=offs_b < batch)
        tl.store(ends_ptr + offs_b, ends, mask=offs_b < batch)

    rng = random.Random(0)
    for trial in range(80):
        batch = rng.randint(1, 40)
        lens = [rng.choice([0, 1, rng.randint(1, 600), rng.randint(1, 40000)]) for _ in range(batch)]
        budget, block_n = rng.randint(1, 300), rng.choice([16, 64, 128])
        seqlens = torch.tensor(lens, dtype=torch.int32)
        splits = torch.zeros(batch, dtype=torch.int32)
        ends = torch.zeros(batch, dtype=torch.int32)
        fine = (FINE, 1, 2)[trial % 3]
        plan_kernel[(1,)](seqlens, splits, ends, batch, budget, BLOCK_B=triton.next_power_of_2(batch),
                          BLOCK_N=block_n, MAX_SPLITS=MAX_SPLITS, FINE=fine)
        want = plan_splits(lens, budget, block_n, fine)
        assert splits.tolist() == want, (lens, budget, block_n, fine, splits.tolist(), want)
        assert ends.tolist() == [sum(want[: i + 1]) for i in range(batch)], (lens, budget)
    print("decode plan ok")
    """
)


def test_the_kernels_plan_is_plan_splits() -> None:
    """The host's mirror (plan_splits, which the benchmark reports) and the kernels' _plan agree split for split."""
    result = run_under_interpreter(PLAN_CHECK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decode plan ok" in result.stdout, result.stdout


@settings(max_examples=400, deadline=None)
@given(lens=st.lists(st.integers(0, 200_000), min_size=1, max_size=300), budget=st.integers(1, 264),
       block_n=st.sampled_from([32, 64, 128]), fine=st.sampled_from([fda.FINE, 1, 2]))
# found by this test in CI: a batch of exactly one wave (2 sequences, budget 2) fits with one split each
@example(lens=[1, 385], budget=2, block_n=128, fine=3)
def test_the_plan_fits_one_wave_or_shares_finely_within_the_grid(lens, budget, block_n, fine) -> None:
    splits = fda.plan_splits(lens, budget, block_n, fine)
    tiles = [-(-n // block_n) for n in lens]
    even = max(1, -(-sum(tiles) // budget))  # tiles per program if they divided evenly over the budget
    assert len(splits) == len(lens) and all(1 <= s <= fda.MAX_SPLITS for s in splits)
    assert sum(splits) <= fda.grid_programs(len(lens), budget, fine)  # every program of the plan has a grid slot
    per_split = [-(-t // s) for t, s in zip(tiles, splits)]
    capped = any(s == fda.MAX_SPLITS for s in splits)
    one_wave = sum(splits) <= budget and 3 * max(per_split) <= 4 * even
    finer = max(per_split) <= max(1, -(-even // fine))
    full = len(lens) >= budget and max(per_split) <= even  # the batch alone fills a wave: the even share
    assert one_wave or finer or full or capped, (splits, per_split, even)
    # one wave is taken whenever a per-program share within 4/3 of the even one fits it
    share = next((p for p in range(even, even * 4 // 3 + 1)
                  if sum(max(1, -(-t // p)) for t in tiles) <= budget), None)
    if share is not None and not capped:
        assert sum(splits) <= budget and max(per_split) <= share, (splits, share)


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 1 << 21), budget=st.integers(1, 400), block_n=st.sampled_from([4, 32, 64, 128]),
       fine=st.sampled_from([fda.FINE, 1, 2]))
@example(length=0, budget=33, block_n=128, fine=3)
@example(length=1 << 20, budget=1000, block_n=128, fine=3)  # more splits than MAX_SPLITS
def test_one_sequences_plan_in_closed_form_is_plan_splits(length, budget, block_n, fine) -> None:
    """single_plan's closed form (``_single_plan``: the even share of the tiles a program) is the general plan's
    answer for a batch of one, at any length, budget, tile and FINE: the same splits, so the same bits."""
    tiles = -(-length // block_n)
    per_program = max(-(-tiles // budget), 1)
    closed = min(max(-(-tiles // per_program), 1), fda.MAX_SPLITS)
    assert fda.plan_splits([length], budget, block_n, fine) == [closed]


def test_plan_examples() -> None:
    # an H100 (132 SMs, 2 programs each) over 8 KV heads: 33 programs per head; at equal lengths the splits of the
    # recorded sweep's best (32 at batch 1, 1 from batch 32 on)
    budget = fda.work_budget(8, 132, per_sm=2)
    assert budget == 33 and fda.work_budget(0, 1, per_sm=1) == 1
    assert [fda.plan_splits([4096] * b, budget)[0] for b in (1, 4, 8, 32, 33, 512)] == [32, 8, 4, 1, 1, 1]
    # one 16k sequence among 31 of 1k: 376 tiles, 12 per program if even, but one wave holds them only at 64 per
    # program (the long one in 2 splits): so programs of 4 tiles over about three waves, the long one in 32 splits
    # (a split per sequence, as at equal lengths, would leave 128 tiles to one program)
    assert fda.plan_splits([16384] + [1024] * 31, budget) == [32] + [2] * 31
    # ragged but few: 8 sequences of 69, 40, 32, 24, 16, 8, 4, 1 tiles (194, 6 a program if even; at 6 their splits
    # would need 37 programs, a second wave): 7 tiles a program, 32 splits, one wave
    ragged = [8817, 5000, 4000, 3000, 2000, 1000, 500, 100]
    assert fda.plan_splits(ragged, budget) == [10, 6, 5, 4, 3, 2, 1, 1]
    assert fda.plan_splits([0, 0], budget) == [1, 1]  # an empty (padding) sequence still gets its program
    assert fda.plan_splits([1 << 20], 1000) == [fda.MAX_SPLITS]
