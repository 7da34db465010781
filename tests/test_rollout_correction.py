"""Tests of ``sglang_fp8rl.rollout_correction`` against float64 references written here in plain Python (math)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sglang_fp8rl import rollout_correction as rc

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
LOGP = st.floats(min_value=-12.0, max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw, min_rows: int = 1):
    """(logp_train, logp_rollout, mask) as nested lists [B][T]; every batch has at least one masked-in token."""
    b = draw(st.integers(min_rows, 5))
    t = draw(st.integers(1, 9))
    a = [[draw(LOGP) for _ in range(t)] for _ in range(b)]
    # the rollout log-prob is the trainer's plus a perturbation: small (quantization-like) or large (outliers)
    d = [[draw(st.one_of(st.floats(-1e-3, 1e-3), st.floats(-3.0, 3.0))) for _ in range(t)] for _ in range(b)]
    r = [[a[i][j] + d[i][j] for j in range(t)] for i in range(b)]
    m = [[draw(st.sampled_from([0.0, 1.0])) for _ in range(t)] for _ in range(b)]
    i, j = draw(st.integers(0, b - 1)), draw(st.integers(0, t - 1))
    m[i][j] = 1.0
    return a, r, m


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def flat(x):
    return [v for row in x for v in row]


def ref_masked_mean(vals, mask) -> float:
    return math.fsum(v * w for v, w in zip(vals, mask)) / math.fsum(mask)


def ref_k3(d: float) -> float:
    """(e^d - 1) - d in float64 to its last digits: the sum of d^n / n! (n >= 2), whose terms below |d| = 0.1 fall
    past float64's precision by n = 17; expm1(d) - d (which cancels) only above that."""
    if abs(d) >= 0.1:
        return math.expm1(d) - d
    return math.fsum(d ** n / math.factorial(n) for n in range(2, 18))


def ref_k(est: str, a: float, r: float) -> float:
    d = a - r
    return {"k1": -d, "k2": 0.5 * d * d, "k3": ref_k3(d)}[est]


# ---------------------------------------------------------------------------------------------------------------------
# property tests against float64 references


@settings(**SETTINGS)
@given(batches(), st.floats(0.5, 5.0))
def test_tis_weights_match_reference(data, cap):
    a, r, _ = data
    w = rc.tis_weights(t64(a), t64(r), cap)
    want = [min(math.exp(x - y), cap) for x, y in zip(flat(a), flat(r))]
    assert w.dtype == torch.float64 and w.shape == (len(a), len(a[0]))
    assert w.flatten().tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert float(w.max()) <= cap


@settings(**SETTINGS)
@given(batches())
def test_token_mult_prob_error_matches_reference(data):
    a, r, m = data
    got = float(rc.token_mult_prob_error(t64(a), t64(r), t64(m)))
    want = ref_masked_mean([math.exp(abs(x - y)) for x, y in zip(flat(a), flat(r))], flat(m))
    assert got == pytest.approx(want, rel=1e-12)
    assert got >= 1.0
    assert float(rc.token_mult_prob_error(t64(r), t64(a), t64(m))) == pytest.approx(got, rel=1e-15)


@settings(**SETTINGS)
@given(batches(), st.sampled_from(rc.KL_ESTIMATORS))
# a log-ratio of 2**-7 (inside the series' range): the series to d^4 was 8e-9 off there
@example(([[0.0] * 6, [0.0] * 6, [0.0] * 6], [[0.0] * 6, [0.0, 0.0078125] + [0.0] * 4, [0.0] * 6],
          [[1.0] + [0.0] * 5, [0.0, 1.0] + [0.0] * 4, [0.0] * 6]), "k3")
def test_kl_estimators_match_reference(data, est):
    a, r, m = data
    got = float(rc.rollout_kl(t64(a), t64(r), t64(m), est))
    want = ref_masked_mean([ref_k(est, x, y) for x, y in zip(flat(a), flat(r))], flat(m))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    if est in ("k2", "k3"):
        assert got >= 0.0


@settings(**SETTINGS)
@given(batches(), st.floats(1.0, 4.0), st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_clip_fraction_matches_reference(data, cap, lo):
    a, r, m = data
    got = float(rc.clip_fraction(t64(a), t64(r), t64(m), cap, lo))
    out = [math.exp(x - y) > cap or (lo is not None and math.exp(x - y) < lo) for x, y in zip(flat(a), flat(r))]
    # a ratio within 1 ulp of a bound may land on either side in log space vs linear space: skip those draws
    near = [abs(math.exp(x - y) - b) < 1e-12 for x, y in zip(flat(a), flat(r)) for b in (cap, lo or -1.0)]
    if not any(near):
        assert got == pytest.approx(ref_masked_mean([float(o) for o in out], flat(m)), rel=1e-12, abs=0)


@settings(**SETTINGS)
@given(batches(), st.sampled_from(rc.SEQUENCE_MODES), st.floats(0.0, 1.0), st.floats(1.0, 3.0))
def test_sequence_ratio_and_mask_match_reference(data, mode, lo, hi):
    a, r, m = data
    s = rc.sequence_log_ratio(t64(a), t64(r), t64(m), mode)
    keep = rc.sequence_mask(t64(a), t64(r), t64(m), lo, hi, mode)
    assert s.shape == (len(a),) and keep.dtype == torch.bool
    for i in range(len(a)):
        ds = [(x - y) * w for x, y, w in zip(a[i], r[i], m[i])]
        n = math.fsum(m[i])
        want = math.fsum(ds) if mode == "product" else (math.fsum(ds) / n if n > 0 else 0.0)
        assert float(s[i]) == pytest.approx(want, rel=1e-12, abs=1e-12)
        ratio = math.exp(want)
        if min(abs(ratio - lo), abs(ratio - hi)) > 1e-9:
            assert bool(keep[i]) == (lo <= ratio <= hi)


@settings(**SETTINGS)
@given(batches())
def test_mismatch_metrics_agree_with_the_single_functions(data):
    a, r, m = data
    got = rc.mismatch_metrics(t64(a), t64(r), t64(m), cap=2.0)
    assert got["token_mult_prob_error"] == pytest.approx(float(rc.token_mult_prob_error(t64(a), t64(r), t64(m))))
    for est in rc.KL_ESTIMATORS:
        assert got[f"kl_{est}"] == pytest.approx(float(rc.rollout_kl(t64(a), t64(r), t64(m), est)), abs=1e-15)
    assert got["tis_clip_fraction"] == pytest.approx(float(rc.clip_fraction(t64(a), t64(r), t64(m), 2.0)))
    deltas = [abs(x - y) for x, y, w in zip(flat(a), flat(r), flat(m)) if w > 0]
    assert got["max_abs_log_ratio"] == pytest.approx(max(deltas), rel=1e-12)
    assert got["is_ratio_mean"] == pytest.approx(
        ref_masked_mean([math.exp(x - y) for x, y in zip(flat(a), flat(r))], flat(m)), rel=1e-12)
    assert got["tokens"] == sum(flat(m))
    geo = rc.sequence_log_ratio(t64(a), t64(r), t64(m)).abs()
    rows = [i for i in range(len(a)) if sum(m[i]) > 0]
    assert got["seq_geo_log_ratio_abs_max"] == pytest.approx(max(float(geo[i]) for i in rows))


# ---------------------------------------------------------------------------------------------------------------------
# hand-computed cases and exact identities


def test_hand_computed_values():
    a = torch.tensor([[-0.1, -2.0, -0.3]], dtype=torch.float64)
    r = torch.tensor([[-0.2, -1.5, -0.3]], dtype=torch.float64)
    m = torch.ones_like(a)
    assert float(rc.token_mult_prob_error(a, r, m)) == pytest.approx((math.exp(0.1) + math.exp(0.5) + 1) / 3)
    assert rc.tis_weights(a, r, cap=1.05)[0].tolist() == pytest.approx([1.05, math.exp(-0.5), 1.0])
    assert float(rc.rollout_kl(a, r, m, "k1")) == pytest.approx((-0.1 + 0.5 + 0.0) / 3)
    assert float(rc.clip_fraction(a, r, m, cap=1.05)) == pytest.approx(1 / 3)
    assert float(rc.clip_fraction(a, r, m, cap=1.05, lo=0.9)) == pytest.approx(2 / 3)
    assert float(rc.sequence_log_ratio(a, r, m, "product")[0]) == pytest.approx(0.1 - 0.5)
    assert float(rc.sequence_log_ratio(a, r, m, "geometric")[0]) == pytest.approx((0.1 - 0.5) / 3)


def test_identical_logprobs_give_neutral_metrics():
    a = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]], dtype=torch.float64))
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    got = rc.mismatch_metrics(a, a.clone(), m)
    assert got["token_mult_prob_error"] == 1.0
    assert got["kl_k1"] == got["kl_k2"] == got["kl_k3"] == 0.0
    assert got["tis_clip_fraction"] == 0.0 and got["is_ratio_mean"] == 1.0 and got["max_abs_log_ratio"] == 0.0
    assert rc.tis_weights(a, a).tolist() == [[1.0] * 3] * 2
    assert rc.sequence_mask(a, a, m, lo=1.0, hi=1.0).tolist() == [True, True]


def test_k1_and_k3_are_unbiased_for_kl_rollout_to_train():
    """Weighting every vocabulary entry by its rollout probability turns the sample mean into the expectation under
    pi_rollout, which for k1 and k3 equals KL(pi_rollout || pi_train) exactly; k2 does not (it is biased)."""
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)  # rollout
    p = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)  # trainer
    exact = float((q * (q.log() - p.log())).sum())
    for est in ("k1", "k3"):
        assert float(rc.rollout_kl(p.log(), q.log(), q, est)) == pytest.approx(exact, rel=1e-10)
    assert float(rc.rollout_kl(p.log(), q.log(), q, "k2")) != pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("d", [1e-7, -3e-6, 1e-4, 9.9e-3, -1.01e-2, 0.3])
def test_k3_is_accurate_for_tiny_mismatch_in_float32(d):
    """A BF16/FP8-sized mismatch must not cancel in float32: exp(d) - 1 - d would give 0 or noise at |d| ~ 1e-6."""
    a = torch.zeros(4, dtype=torch.float32)
    r = torch.full((4,), -d, dtype=torch.float32)
    dd = float(a[0] - r[0])  # the float32 value actually used
    want = math.expm1(dd) - dd if abs(dd) > 1e-3 else dd * dd / 2 * (1 + dd / 3 + dd * dd / 12)
    assert float(rc.rollout_kl(a, r, torch.ones(4), "k3")) == pytest.approx(want, rel=1e-4)
    assert rc.mismatch_metrics(a, r, torch.ones(4))["kl_k3"] == pytest.approx(want, rel=1e-9)


def test_mismatch_metrics_resolve_bf16_sized_mismatch():
    """token_mult_prob_error - 1 at ~1e-9 survives (float64 inside), where float32 would round it to exactly 1."""
    a = torch.zeros(3, dtype=torch.float32)
    r = torch.tensor([-2**-30, 0.0, 2**-30], dtype=torch.float32)
    got = rc.mismatch_metrics(a, r, torch.ones(3))
    assert got["token_mult_prob_error"] - 1 == pytest.approx(2 * math.expm1(2**-30) / 3, rel=1e-6)


def test_geometric_mode_is_length_invariant_and_product_is_not():
    a1 = torch.tensor([[-0.1, -0.2]], dtype=torch.float64)
    r1 = torch.tensor([[-0.3, -0.1]], dtype=torch.float64)
    a2, r2 = a1.repeat(1, 4), r1.repeat(1, 4)  # the same tokens four times over
    m1, m2 = torch.ones_like(a1), torch.ones_like(a2)
    assert float(rc.sequence_log_ratio(a2, r2, m2)[0]) == pytest.approx(float(rc.sequence_log_ratio(a1, r1, m1)[0]))
    assert float(rc.sequence_log_ratio(a2, r2, m2, "product")[0]) == pytest.approx(
        4 * float(rc.sequence_log_ratio(a1, r1, m1, "product")[0]))
    # same per-token mismatch: the geometric band keeps both lengths, the product band drops the longer one
    hi = math.exp(0.1 * 1.5)
    assert rc.sequence_mask(a1, r1, m1, 0.0, hi, "product").tolist() == [True]
    assert rc.sequence_mask(a2, r2, m2, 0.0, hi, "product").tolist() == [False]
    assert rc.sequence_mask(a2, r2, m2, 0.0, hi, "geometric").tolist() == [True]


def test_sequence_mask_bounds_are_inclusive_and_empty_rows_count_as_ratio_one():
    a = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    r = torch.tensor([[-math.log(2.0), 0.0], [math.log(2.0), 0.0], [5.0, 5.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0], [1, 0], [0, 0]], dtype=torch.float64)
    assert rc.sequence_mask(a, r, m, 0.5, 2.0).tolist() == [True, True, True]
    assert rc.sequence_mask(a, r, m, 0.6, 1.9).tolist() == [False, False, True]
    assert float(rc.sequence_log_ratio(a, r, m)[2]) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masks_exclude_padding_whatever_its_values(dtype):
    """Padding may hold -inf (a pad token's log-prob), +inf or NaN: masked out, it must change nothing."""
    a = torch.tensor([[-0.5, 0.0, float("-inf"), float("nan")], [-0.1, float("inf"), 0.0, 0.0]], dtype=dtype)
    r = torch.tensor([[-0.5, -30.0, 0.0, 0.0], [-0.2, 0.0, float("nan"), 0.0]], dtype=dtype)
    m = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    got = rc.mismatch_metrics(a, r, m)
    assert all(math.isfinite(v) for v in got.values()), got
    assert got["token_mult_prob_error"] == pytest.approx((1 + math.exp(0.1)) / 2, rel=1e-6)
    assert got["max_abs_log_ratio"] == pytest.approx(0.1, rel=1e-6)
    assert got["tokens"] == 2
    for est in rc.KL_ESTIMATORS:
        assert math.isfinite(float(rc.rollout_kl(a, r, m, est)))
    assert float(rc.clip_fraction(a, r, m)) == 0.0
    assert rc.sequence_log_ratio(a, r, m).tolist() == pytest.approx([0.0, 0.1], rel=1e-6)
    assert rc.sequence_mask(a, r, m, 0.5, 2.0).tolist() == [True, True]


def test_fractional_mask_weights_tokens():
    a = torch.tensor([0.0, 0.0], dtype=torch.float64)
    r = torch.tensor([0.0, -1.0], dtype=torch.float64)
    got = float(rc.token_mult_prob_error(a, r, torch.tensor([0.75, 0.25], dtype=torch.float64)))
    assert got == pytest.approx(0.75 + 0.25 * math.e)


# ---------------------------------------------------------------------------------------------------------------------
# gradients, dtypes, validation


def test_outputs_are_detached_and_inputs_untouched():
    a = torch.tensor([[-0.2, -1.0]], requires_grad=True)
    r = torch.tensor([[-0.4, -0.9]])
    m = torch.ones(1, 2)
    before = a.detach().clone()
    outs = [rc.tis_weights(a, r), rc.token_mult_prob_error(a, r, m), rc.rollout_kl(a, r, m),
            rc.clip_fraction(a, r, m), rc.sequence_log_ratio(a, r, m), rc.log_ratio(a, r),
            rc.kl_per_token(a, r, "k1")]
    assert all(not o.requires_grad and o.grad_fn is None for o in outs)
    assert torch.equal(a.detach(), before)
    # a loss weighted by TIS still differentiates only through the policy term
    loss = (rc.tis_weights(a, r) * a).sum()
    loss.backward()
    assert torch.equal(a.grad, rc.tis_weights(a, r))


def test_bf16_inputs_are_computed_in_float32():
    a = torch.tensor([[-0.5, -0.25]], dtype=torch.bfloat16)
    r = torch.tensor([[-0.5078125, -0.25]], dtype=torch.bfloat16)
    w = rc.tis_weights(a, r)
    assert w.dtype == torch.float32
    assert float(w[0, 0]) == pytest.approx(math.exp(0.0078125), rel=1e-7)
    got = rc.mismatch_metrics(a, r, torch.ones(1, 2, dtype=torch.bool))
    assert got["token_mult_prob_error"] == pytest.approx((math.exp(0.0078125) + 1) / 2, rel=1e-7)


@pytest.mark.parametrize("call", [
    lambda: rc.tis_weights(torch.zeros(2, 3), torch.zeros(2, 4)),
    lambda: rc.token_mult_prob_error(torch.zeros(3), torch.zeros(3), torch.ones(4)),
    lambda: rc.mismatch_metrics(torch.zeros(2, 3), torch.zeros(3, 2), torch.ones(2, 3)),
    lambda: rc.sequence_mask(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2), 0.5, 2.0),
])
def test_shape_mismatch_is_a_clear_error(call):
    with pytest.raises(ValueError, match="shape"):
        call()


@pytest.mark.parametrize("call", [
    lambda: rc.token_mult_prob_error(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)),
    lambda: rc.rollout_kl(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool)),
    lambda: rc.clip_fraction(torch.zeros(3), torch.zeros(3), torch.zeros(3)),
    lambda: rc.mismatch_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2)),
])
def test_empty_mask_is_a_clear_error(call):
    with pytest.raises(ValueError, match="selects no token"):
        call()


def test_bad_arguments_are_refused():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cap"):
        rc.tis_weights(z, z, cap=0.0)
    with pytest.raises(ValueError, match="estimator"):
        rc.kl_per_token(z, z, "k4")
    with pytest.raises(ValueError, match="mode"):
        rc.sequence_log_ratio(z, z, torch.ones(1, 2), "arithmetic")
    with pytest.raises(ValueError, match="lo"):
        rc.sequence_mask(z, z, torch.ones(1, 2), 2.0, 1.0)
    with pytest.raises(ValueError, match="lo"):
        rc.clip_fraction(z, z, torch.ones(1, 2), cap=2.0, lo=3.0)
    with pytest.raises(TypeError, match="floating-point"):
        rc.tis_weights(torch.zeros(2, dtype=torch.long), torch.zeros(2))
    with pytest.raises(TypeError, match="torch.Tensor"):
        rc.tis_weights([0.0], torch.zeros(1))
    with pytest.raises(TypeError, match="mask"):
        rc.token_mult_prob_error(z, z, [[1, 1]])


def test_module_imports_without_sglang():
    code = ("import sys; import sglang_fp8rl.rollout_correction as m; "
            "assert not any(k == 'sglang' or k.startswith('sglang.') for k in sys.modules), 'sglang imported'; "
            "print(m.DEFAULT_TIS_CAP)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"
