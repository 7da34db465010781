"""Exhaustive tests of the reference FP8 (E4M3) quantizers in ``sglang_fp8rl.quant``.

Every numeric check compares against a float64/numpy reference written independently in this file:

* BF16 rounding is done on the float32 bit pattern (round to nearest even), not with torch;
* a block's amax is the float64 max |x| over the block's *valid* elements (numpy slicing crops edge blocks, nothing
  is padded), clamped below at 1e-10;
* the fp32 scale is ``float32(amax / 448)`` computed in float64 and rounded once to float32; the pow2 scale is the
  smallest ``2**e`` with ``448 * 2**e >= amax`` found by exact float64 comparisons;
* ``x / scale`` is computed in float64 and rounded to float32: for float32 operands this double rounding equals the
  correctly rounded float32 division (53 >= 2 * 24 + 2), i.e. what torch's true division produces;
* the float32 quotient is encoded to E4M3 (bias 7, 3 mantissa bits, subnormals down to 2**-9, max 448, no inf) by a
  hand-written round-to-nearest-even encoder that saturates at 448 and keeps the sign of zero (0x80, as torch does).

FP8 codes are compared as bytes (``.view(torch.uint8)``) and scales as float32 bit patterns.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_fp8rl import quant

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-10
FLOOR_SCALE_FP32 = np.float32(AMAX_FLOOR / E4M3_MAX)  # the fp32 scale of an all-zero block
FLOOR_SCALE_POW2 = 2.0**-42  # smallest power of two >= 1e-10/448 (~2.232e-13): 2**-43 ~ 1.137e-13 < it <= 2**-42
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = ("fp32", "pow2")
NAN_CODES = (0x7F, 0xFF)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)


# =====================================================================================================================
# independent float64 reference


def bf16_round(a) -> np.ndarray:
    """float32 values -> BF16 (round to nearest even on the bit pattern) -> float64; overflow gives +-inf."""
    a32 = np.ascontiguousarray(a, dtype=np.float32)
    bits = a32.view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)


def e4m3_encode(y) -> np.ndarray:
    """float64 values (already float32-representable) -> E4M3FN byte codes: RNE, saturating at 448, signed zero."""
    y = np.asarray(y, dtype=np.float64)
    assert np.isfinite(y).all(), "the reference encoder only takes finite values"
    a = np.minimum(np.abs(y), E4M3_MAX)
    _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1); a in [2**(e-1), 2**e)
    binade = np.where(a < 2.0**-6, -6, e - 1)  # below the min normal the spacing is the subnormal one, 2**-9
    quantum = np.ldexp(1.0, binade - 3)  # 3 mantissa bits
    v = np.rint(a / quantum) * quantum  # a / quantum is exact; np.rint rounds half to even
    assert (v <= E4M3_MAX).all()  # 448 is on the grid, so a <= 448 never rounds above it
    sub = v < 2.0**-6
    _, ev = np.frexp(v)
    exp_field = np.where(sub, 0, ev - 1 + 7)
    with np.errstate(invalid="ignore"):
        mant = np.where(sub, v / 2.0**-9, (np.ldexp(v, -(ev - 1)) - 1.0) * 8.0)
    code = (exp_field.astype(np.int64) << 3) | mant.astype(np.int64)
    code = np.where(np.signbit(y), code | 0x80, code)
    return code.astype(np.uint8)


def e4m3_decode(codes) -> np.ndarray:
    """E4M3FN byte codes -> float64 values (NaN for 0x7F/0xFF)."""
    c = np.asarray(codes).astype(np.int64)
    exp_field, mant = (c >> 3) & 0xF, c & 0x7
    mag = np.where(exp_field == 0, mant * 2.0**-9, (1.0 + mant / 8.0) * np.ldexp(1.0, exp_field - 7))
    mag = np.where((exp_field == 15) & (mant == 7), np.nan, mag)
    return np.where(c >> 7 == 1, -mag, mag)


def e4m3_half_ulp(y_abs) -> np.ndarray:
    """Half the E4M3 spacing of the binade containing |y| (the subnormal spacing 2**-9 below 2**-6)."""
    y_abs = np.asarray(y_abs, dtype=np.float64)
    _, e = np.frexp(y_abs)
    binade = np.where(y_abs < 2.0**-6, -6, e - 1)
    return np.ldexp(0.5, binade - 3)


def ref_scale(amax: float, scale_format: str) -> float:
    """Dequant multiplier of a group (as a float64 holding a float32 value)."""
    amax = max(float(amax), AMAX_FLOOR)
    if scale_format == "fp32":
        return float(np.float32(amax / E4M3_MAX))
    e = math.ceil(math.log2(amax / E4M3_MAX))
    while E4M3_MAX * 2.0**e < amax:
        e += 1
    while E4M3_MAX * 2.0 ** (e - 1) >= amax:
        e -= 1
    return 2.0**e


def ref_quantize(x: np.ndarray, block: tuple[int, int], scale_format: str) -> tuple[np.ndarray, np.ndarray]:
    """Reference blockwise quantization of float64 values ``x`` [N, K] (already in the dtype that gets quantized).

    Returns (uint8 codes [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]).
    """
    n, k = x.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    absx = np.abs(x)
    scale = np.empty((nb, kb), dtype=np.float64)
    for i in range(nb):
        for j in range(kb):
            scale[i, j] = ref_scale(absx[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].max(), scale_format)
    s_el = np.repeat(np.repeat(scale, bn, axis=0)[:n], bk, axis=1)[:, :k]
    y = (x / s_el).astype(np.float32).astype(np.float64)  # == correctly rounded float32 division
    return e4m3_encode(y), scale.astype(np.float32)


def ref_weight_quantize(w: torch.Tensor, block, scale_format):
    """Reference for the weight quantizers: BF16-round the input, then :func:`ref_quantize`."""
    return ref_quantize(bf16_round(to_np32(w)), block, scale_format)


# =====================================================================================================================
# helpers


def to_np32(t: torch.Tensor) -> np.ndarray:
    """Exact float32 numpy copy of a bf16/fp16/fp32 tensor (widening is exact)."""
    return t.detach().to(torch.float32).cpu().numpy()


def codes_of(q: torch.Tensor) -> np.ndarray:
    assert q.dtype == FP8, q.dtype
    return q.view(torch.uint8).cpu().numpy()


def f32_bits(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        assert a.dtype == torch.float32, a.dtype
        return a.contiguous().view(torch.int32).cpu().numpy()
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def assert_codes_equal(q: torch.Tensor, want: np.ndarray, what: str = "q") -> None:
    got = codes_of(q)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = np.argwhere(got != want)
    if bad.size:
        first = tuple(int(i) for i in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {got.size} FP8 codes differ; first at {first}: "
            f"got 0x{got[first]:02X}, want 0x{want[first]:02X}"
        )


def assert_f32_equal(got: torch.Tensor, want: np.ndarray, what: str = "scale") -> None:
    assert tuple(got.shape) == tuple(want.shape), (what, tuple(got.shape), want.shape)
    g, w = f32_bits(got), f32_bits(want)
    bad = np.argwhere(g != w)
    if bad.size:
        first = tuple(int(i) for i in bad[0])
        gv, wv = got.cpu().numpy()[first], np.asarray(want, dtype=np.float32)[first]
        raise AssertionError(
            f"{what}: {len(bad)} of {g.size} float32 values differ; first at {first}: "
            f"got {float(gv).hex()}, want {float(wv).hex()}"
        )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (distinguishes -0.0 from 0.0, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(int_dtype), b.contiguous().view(int_dtype))


def expand(scale: np.ndarray, shape, block) -> np.ndarray:
    (n, k), (bn, bk) = shape, block
    return np.repeat(np.repeat(np.asarray(scale, np.float64), bn, axis=0)[:n], bk, axis=1)[:, :k]


def ref_block_amax(x: np.ndarray, block) -> np.ndarray:
    n, k = x.shape
    bn, bk = block
    out = np.empty((-(-n // bn), -(-k // bk)))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = np.abs(x[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]).max()
    return out


POS_RE = r"[\[(]{}[\])]"


def position_pattern(pos) -> str:
    """Regex matching an index like ``[3, 5]`` or ``(3, 5)`` in an error message."""
    return POS_RE.format(re.escape(", ".join(str(int(i)) for i in pos)))


# =====================================================================================================================
# input generation (hypothesis draws the recipe, numpy draws the bulk values from a seed)

SPECIAL_DIMS = (1, 2, 3, 64, 127, 128, 129, 255, 256, 257, 300, 383, 384, 385, 511, 512, 513, 639, 640, 641, 700)
KINDS = ("normal", "uniform", "wide", "tiny", "ties")


def dims(max_dim: int = 700):
    return st.one_of(st.sampled_from([d for d in SPECIAL_DIMS if d <= max_dim]), st.integers(1, max_dim))


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    k: int
    dtype: torch.dtype
    seed: int
    log_mag: float  # typical magnitude 10**log_mag, in [-6, 4]
    kind: str
    outliers: int  # single huge elements
    zero_blocks: int  # whole blocks of +0.0 or -0.0
    neg_zeros: bool  # sprinkle -0.0
    transpose: bool  # non-contiguous input


def cases(max_dim: int = 700, dtypes=DTYPES):
    return st.builds(
        Case,
        n=dims(max_dim),
        k=dims(max_dim),
        dtype=st.sampled_from(dtypes),
        seed=st.integers(0, 2**32 - 1),
        log_mag=st.floats(-6.0, 4.0),
        kind=st.sampled_from(KINDS),
        outliers=st.integers(0, 2),
        zero_blocks=st.integers(0, 2),
        neg_zeros=st.booleans(),
        transpose=st.booleans(),
    )


BLOCKS = st.one_of(st.just((128, 128)), st.sampled_from([(128, 128), (64, 128), (128, 64), (1, 128), (37, 50)]))


def make_values(case: Case, block) -> np.ndarray:
    """float64 values [n, k] following the case's recipe; finite in the case's dtype."""
    rng = np.random.default_rng(case.seed)
    n, k = case.n, case.k
    bn, bk = block
    mag = 10.0**case.log_mag
    if case.kind == "normal":
        a = rng.standard_normal((n, k)) * mag
    elif case.kind == "uniform":
        a = rng.uniform(-mag, mag, (n, k))
    elif case.kind == "wide":  # every element its own magnitude in [1e-6, 1e4]
        a = 10.0 ** rng.uniform(-6.0, 4.0, (n, k)) * rng.choice([-1.0, 1.0], (n, k))
    elif case.kind == "tiny":  # around and below the 1e-10 amax floor
        a = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-13.0, -9.0)
    elif case.kind == "ties":
        # each block holds +-448 (scale exactly 1.0) and otherwise exact midpoints of the E4M3 grid; fp32 inputs
        # also get exact midpoints of the BF16 grid (ties of the FP32 -> BF16 rounding)
        codes = rng.integers(0, 0x7E, (n, k))
        a = (e4m3_decode(codes) + e4m3_decode(codes + 1)) / 2.0 * rng.choice([-1.0, 1.0], (n, k))
        if case.dtype == torch.float32:
            u = rng.uniform(-400.0, 400.0, (n, k)).astype(np.float32)
            mids = ((u.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)).view(np.float32)
            a = np.where(rng.random((n, k)) < 0.5, mids.astype(np.float64), a)
        a[::bn, ::bk] = E4M3_MAX * rng.choice([-1.0, 1.0], a[::bn, ::bk].shape)
    else:  # pragma: no cover
        raise AssertionError(case.kind)
    nb, kb = -(-n // bn), -(-k // bk)
    for _ in range(case.zero_blocks):
        i, j = rng.integers(nb), rng.integers(kb)
        a[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = rng.choice([0.0, -0.0])
    if case.neg_zeros:
        a[rng.random((n, k)) < 0.02] = -0.0
    cap = 6.0e4 if case.dtype == torch.float16 else 1.0e38
    for _ in range(case.outliers):
        i, j = rng.integers(n), rng.integers(k)
        a[i, j] = rng.choice([-1.0, 1.0]) * min(10.0 ** (case.log_mag + rng.uniform(3.0, 8.0)), cap)
    return np.clip(a, -cap, cap)


def to_tensor(a: np.ndarray, dtype: torch.dtype, transpose: bool = False) -> torch.Tensor:
    """float64 values -> tensor of ``dtype`` (via float32); ``transpose`` gives a non-contiguous tensor."""
    if transpose:
        return torch.from_numpy(np.ascontiguousarray(a.T).astype(np.float32)).to(dtype).t()
    return torch.from_numpy(np.ascontiguousarray(a).astype(np.float32)).to(dtype)


def make_weight(case: Case, block=(128, 128)) -> torch.Tensor:
    w = to_tensor(make_values(case, block), case.dtype, case.transpose)
    assert bool(torch.isfinite(w).all()) and w.shape == (case.n, case.k)
    return w


# =====================================================================================================================
# the reference itself (validated against torch's own E4M3/BF16 casts so the comparisons below mean something)


def test_reference_codec_matches_torch_casts():
    """The hand-written E4M3 encoder/decoder and BF16 rounding agree with torch's casts on grid points, exact ties,
    tie +- one float32 ulp, subnormals, saturation and random float32 values."""
    codes = np.array([c for c in range(256) if c not in NAN_CODES], dtype=np.uint8)
    vals = e4m3_decode(codes)
    torch_vals = torch.from_numpy(codes).view(FP8).float().numpy().astype(np.float64)
    assert np.array_equal(vals, torch_vals) and np.array_equal(np.signbit(vals), np.signbit(torch_vals))
    assert np.array_equal(e4m3_encode(vals), codes)
    assert np.isnan(e4m3_decode(np.array(NAN_CODES))).all()

    pos = np.sort(vals[vals > 0])
    mids = np.concatenate([(pos[:-1] + pos[1:]) / 2.0, [2.0**-10]])
    mids32 = mids.astype(np.float32)
    probes = np.concatenate([mids32, np.nextafter(mids32, 0), np.nextafter(mids32, np.inf)])
    rng = np.random.default_rng(0)
    probes = np.concatenate(
        [probes, (10.0 ** rng.uniform(-12, 2.66, 20000)).astype(np.float32), np.float32([0.0, 448.0, 450.0, 1e-30])]
    )
    probes = np.concatenate([probes, -probes, np.float32([-0.0])])
    want = torch.from_numpy(probes).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(torch.uint8).numpy()
    assert np.array_equal(e4m3_encode(probes.astype(np.float64)), want)

    f32 = np.concatenate(
        [
            rng.standard_normal(20000).astype(np.float32) * np.float32(1e3),
            ((rng.integers(0, 2**31, 20000, dtype=np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)).view(
                np.float32
            ),
            np.float32([3.389e38, 3.3961e38, 3.4e38, -3.4e38, 1e-40, -0.0]),
        ]
    )
    f32 = f32[np.isfinite(f32)]
    want_bf16 = torch.from_numpy(f32).to(torch.bfloat16).float().numpy().astype(np.float64)
    got = bf16_round(f32)
    assert np.array_equal(got, want_bf16) and np.array_equal(np.signbit(got), np.signbit(want_bf16))


# =====================================================================================================================
# golden bytes


def test_golden_blockwise_bytes_and_scales():
    """Hand-computed FP8 bytes and scales of a 130x2 FP32 tensor spanning two row blocks, a pow2 row and a row whose
    quotient lands exactly on an E4M3 tie only under true division."""
    w = torch.zeros(130, 2, dtype=torch.float32)
    # --- row block 0 (rows 0..127): amax = 448 -> scale_inv = 448/448 = 1.0, so the codes are those of x itself.
    # E4M3 code = s eeee mmm, value = 2**(eeee-7) * 1.mmm (eeee = 0: 2**-6 * 0.mmm).
    w[0] = torch.tensor([448.0, 1.5])  # 448 = 2**8*1.75 -> 0 1111 110 = 0x7E;  1.5 = 2**0*1.5 -> 0 0111 100 = 0x3C
    w[1] = torch.tensor([-0.5, 2.0**-9])  # -0.5 = -2**-1 -> 1 0110 000 = 0xB0;  2**-9 = min subnormal -> 0x01
    # 2**-10 is the tie between 0 and 2**-9 -> even -> 0x00;  3*2**-10 = tie between 0x01 and 0x02 -> even -> 0x02
    w[2] = torch.tensor([2.0**-10, 3 * 2.0**-10])
    # 17.01 (fp32) -> BF16 17.0 (spacing 0.125 in [16, 32)); 17 is the E4M3 tie of 16 (0x58) and 18 (0x59) -> even
    # -> 16 = 2**4 -> 0 1011 000 = 0x58 (without the BF16 step 17.01 would give 0x59).  19 = tie of 18 (0x59) and
    # 20 (0x5A) -> even -> 20 = 2**4*1.25 -> 0 1011 010 = 0x5A
    w[3] = torch.tensor([17.01, 19.0])
    # -0.0 -> 0x80;  -1e-4 < 2**-10 (half the smallest subnormal) -> rounds to -0 -> 0x80
    w[4] = torch.tensor([-0.0, -1e-4])
    # -448 -> 0xFE;  0.1 -> BF16 0.10009765625 (0x3DCD); in [2**-4, 2**-3) the E4M3 spacing is 2**-7:
    # 0.10009765625 / 2**-7 = 12.8125 -> 13 -> 13*2**-7 = 0.1015625 = 2**-4*1.625 -> 0 0011 101 = 0x1D
    w[5] = torch.tensor([-448.0, 0.1])
    # --- row block 1 (rows 128, 129): amax = 7 -> scale_inv = 7/448 = 2**-6 exactly = 0.015625; q = x * 64
    # 7 -> 448 -> 0x7E;  1.0 -> 64 = 2**6 -> 0 1101 000 = 0x68
    w[128] = torch.tensor([7.0, 1.0])
    # -0.1 -> BF16 -0.10009765625 -> *64 = -6.40625; spacing 0.5 in [4, 8): 12.8125 -> 13*0.5 = 6.5 = 2**2*1.625
    # -> 1 1001 101 = 0xCD;  0.0 -> 0x00
    w[129] = torch.tensor([-0.1, 0.0])
    want = np.zeros((130, 2), dtype=np.uint8)
    want[:6] = [[0x7E, 0x3C], [0xB0, 0x01], [0x00, 0x02], [0x58, 0x5A], [0x80, 0x80], [0xFE, 0x1D]]
    want[128:] = [[0x7E, 0x68], [0xCD, 0x00]]
    for fmt in FORMATS:  # both scales are powers of two, so pow2 gives the same bytes
        q, s = quant.quantize_blockwise(w, scale_format=fmt)
        assert_codes_equal(q, want, f"golden q ({fmt})")
        assert s.dtype == torch.float32 and s.tolist() == [[1.0], [0.015625]]
    assert_codes_equal(quant.quantize_blockwise(w.bfloat16())[0], want, "golden q (bf16 input)")

    # pow2: [3, -1, 0.3, 0]: amax 3, 3/448 = 0.0066964 lies in (2**-8, 2**-7] -> scale_inv = 2**-7, q = x * 128:
    # 3 -> 384 = 2**8*1.5 -> 0 1111 100 = 0x7C;  -1 -> -128 = -2**7 -> 1 1110 000 = 0xF0;
    # 0.3 -> BF16 0.30078125 -> 38.5; spacing 4 in [32, 64): 9.625 -> 10*4 = 40 = 2**5*1.25 -> 0 1100 010 = 0x62
    row = torch.tensor([[3.0, -1.0, 0.3, 0.0]])
    q, s = quant.quantize_blockwise(row, scale_format="pow2")
    assert_codes_equal(q, np.array([[0x7C, 0xF0, 0x62, 0x00]], np.uint8), "golden pow2 q")
    assert s.tolist() == [[2.0**-7]]
    # fp32: scale_inv = float32(3/448) = 0x1.b6db6ep-8 (3/448 = 0x1.b6db6db6...p-8, rounded up), so
    # 3/s = 447.99997.. -> 448 -> 0x7E;  -1/s = -149.33: spacing 16 in [128, 256): 9.33 -> 9*16 = 144 = 2**7*1.125
    # -> 1 1110 001 = 0xF1;  0.30078125/s = 44.917: spacing 4 in [32, 64): 11.23 -> 44 = 2**5*1.375 -> 0x63
    q, s = quant.quantize_blockwise(row, scale_format="fp32")
    assert_codes_equal(q, np.array([[0x7E, 0xF1, 0x63, 0x00]], np.uint8), "golden fp32 q")
    assert float(s.item()).hex() == "0x1.b6db6e0000000p-8"

    # True division: amax 13, x = 39*2**-16.  x * 448/13 = 3*448*2**-16 = 21*2**-10 = 0.0205078125, exactly the tie
    # of 0x0A (20*2**-10 = 2**-6*1.25) and 0x0B (22*2**-10 = 2**-6*1.375).  scale_inv = float32(13/448) =
    # 0x1.db6db6p-6 is 13/448 rounded *down* (relative 2.7e-8), so x/scale_inv = tie*(1+2.7e-8), which float32
    # (half ulp 4.5e-8 relative there) rounds to exactly the tie -> RNE -> even -> 0x0A.  13/s = 448.00001 -> clamp
    # -> 0x7E.  Multiplying by the float32 reciprocal instead lands above the tie (0x0B; asserted below).
    row = torch.tensor([[13.0, 39 * 2.0**-16]])
    q, s = quant.quantize_blockwise(row)
    assert_codes_equal(q, np.array([[0x7E, 0x0A]], np.uint8), "golden true-division q")
    assert float(s.item()).hex() == "0x1.db6db60000000p-6"
    by_reciprocal = (row * torch.reciprocal(s)).clamp(-448, 448).to(FP8)
    assert codes_of(by_reciprocal)[0, 1] == 0x0B  # the literal above does discriminate division from reciprocal


def test_golden_per_channel_and_activation():
    """Hand-computed bytes/scales for the per-channel and the 1x128 activation-group quantizers."""
    w = torch.tensor([[448.0, -1.5, 0.25], [0.0, -0.0, 0.0], [7.0, 1.0, -3.0]])
    # row 0: amax 448 -> scale 1: 0x7E, -1.5 -> 1 0111 100 = 0xBC, 0.25 = 2**-2 -> 0 0101 000 = 0x28
    # row 1: all zero -> scale float32(1e-10/448), codes keep the sign of zero
    # row 2: amax 7 -> scale 2**-6 -> x*64: 448 -> 0x7E, 64 -> 0x68, -192 = -2**7*1.5 -> 1 1110 100 = 0xF4
    want = np.array([[0x7E, 0xBC, 0x28], [0x00, 0x80, 0x00], [0x7E, 0x68, 0xF4]], np.uint8)
    q, s = quant.quantize_per_channel(w)
    assert_codes_equal(q, want, "golden per-channel q")
    assert_f32_equal(s, np.float32([1.0, FLOOR_SCALE_FP32, 2.0**-6]))

    x = torch.zeros(1, 2, 130)  # token (0, 1): group 0 = cols 0..127 (amax 448), group 1 = cols 128, 129 (amax 7)
    x[0, 1, 0], x[0, 1, 5], x[0, 1, 128], x[0, 1, 129] = 448.0, 0.25, 7.0, -3.0
    q, s = quant.quantize_activation_groups(x)
    assert q.shape == (1, 2, 130) and s.shape == (1, 2, 2)
    c = codes_of(q)
    assert (c[0, 1, 0], c[0, 1, 5], c[0, 1, 128], c[0, 1, 129]) == (0x7E, 0x28, 0x7E, 0xF4)
    assert_f32_equal(s[0, 1], np.float32([1.0, 2.0**-6]))
    assert_f32_equal(s[0, 0], np.float32([FLOOR_SCALE_FP32, FLOOR_SCALE_FP32]))
    assert not c[0, 0].any()


# =====================================================================================================================
# blockwise: bit-exactness and numerical properties


@settings(max_examples=100, **SETTINGS)
@given(case=cases(), block=BLOCKS, fmt=st.sampled_from(FORMATS))
def test_blockwise_matches_float64_reference(case, block, fmt):
    """quantize_blockwise: FP8 bytes and float32 scales bit-identical to the float64 reference, output shapes and
    dtypes as specified, input left unmodified; all dtypes, shapes 1..700, any block size."""
    w = make_weight(case, block)
    w_before = w.clone()
    q, s = quant.quantize_blockwise(w, block, fmt)
    n, k = w.shape
    assert q.dtype == FP8 and tuple(q.shape) == (n, k)
    assert s.dtype == torch.float32 and tuple(s.shape) == (-(-n // block[0]), -(-k // block[1]))
    want_q, want_s = ref_weight_quantize(w, block, fmt)
    assert_f32_equal(s, want_s)
    assert_codes_equal(q, want_q)
    assert same_bits(w, w_before)


def test_blockwise_default_arguments():
    """The defaults are 128x128 blocks and fp32 scales."""
    w = make_weight(Case(300, 200, torch.bfloat16, 1, 0.0, "normal", 1, 0, False, False))
    q, s = quant.quantize_blockwise(w)
    q2, s2 = quant.quantize_blockwise(w, (128, 128), "fp32")
    assert s.shape == (3, 2) and same_bits(q, q2) and same_bits(s, s2)


@settings(max_examples=30, **SETTINGS)
@given(case=cases(), block=BLOCKS, fmt=st.sampled_from(FORMATS))
def test_blockwise_dequant_error_within_e4m3_bound(case, block, fmt):
    """|dequant - x| <= scale * (half an E4M3 ulp at |x|/scale; 2**-10 in the subnormal range) per element, with x
    the BF16-rounded input (slack: float32 rounding of the quotient and the product)."""
    w = make_weight(case, block)
    q, s = quant.quantize_blockwise(w, block, fmt)
    x = bf16_round(to_np32(w))
    deq = quant.dequantize_blockwise(q, s, block)
    assert deq.dtype == torch.float32
    deq = deq.numpy().astype(np.float64)
    assert np.isfinite(deq).all()
    s_el = expand(s.numpy(), x.shape, block)
    bound = s_el * e4m3_half_ulp(np.abs(x) / s_el) + 2.0**-22 * (np.abs(x) + np.abs(deq))
    err = np.abs(deq - x)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"at {worst}: x={x[worst]!r} deq={deq[worst]!r} scale={s_el[worst]!r}"


@settings(max_examples=30, **SETTINGS)
@given(case=cases(), block=BLOCKS)
def test_pow2_scales_are_tight_powers_of_two_and_never_overflow(case, block):
    """pow2: every scale is a power of two, >= amax/448, < 2*amax/448 when amax is above the floor (else the
    power-of-two floor 2**-42); dequantized values are finite with |q*scale| <= 448*scale and no NaN codes."""
    w = make_weight(case, block)
    q, s = quant.quantize_blockwise(w, block, "pow2")
    s64 = s.numpy().astype(np.float64)
    mant, _ = np.frexp(s64)
    assert (mant == 0.5).all(), "not a power of two"
    amax = ref_block_amax(bf16_round(to_np32(w)), block)
    assert (E4M3_MAX * s64 >= amax).all()
    above = amax > AMAX_FLOOR
    assert (E4M3_MAX * s64[above] < 2.0 * amax[above]).all()
    assert (s64[~above] == FLOOR_SCALE_POW2).all()
    codes = codes_of(q)
    assert not np.isin(codes, NAN_CODES).any()
    deq = quant.dequantize_blockwise(q, s, block).numpy().astype(np.float64)
    assert np.isfinite(deq).all()
    assert (np.abs(deq) <= E4M3_MAX * expand(s64, w.shape, block)).all()


@settings(max_examples=30, **SETTINGS)
@given(case=cases(dtypes=(torch.float32, torch.float16)), block=BLOCKS, fmt=st.sampled_from(FORMATS))
def test_fp32_fp16_input_equals_its_bf16_rounded_twin(case, block, fmt):
    """FP32/FP16 weights give exactly the bytes and scales of their BF16-rounded twin (rounded here on the bits)."""
    w = make_weight(case, block)
    twin = torch.from_numpy(bf16_round(to_np32(w)).astype(np.float32)).to(torch.bfloat16)
    q, s = quant.quantize_blockwise(w, block, fmt)
    q2, s2 = quant.quantize_blockwise(twin, block, fmt)
    assert same_bits(q, q2) and same_bits(s, s2)
    q, s = quant.quantize_per_channel(w, fmt)
    q2, s2 = quant.quantize_per_channel(twin, fmt)
    assert same_bits(q, q2) and same_bits(s, s2)


def test_float64_input_with_bf16_values_equals_bf16():
    """A float64 weight whose values are BF16-representable quantizes exactly like the BF16 tensor."""
    w = make_weight(Case(200, 300, torch.bfloat16, 7, 1.0, "wide", 1, 1, True, False))
    for fmt in FORMATS:
        q, s = quant.quantize_blockwise(w.double(), scale_format=fmt)
        q2, s2 = quant.quantize_blockwise(w, scale_format=fmt)
        assert same_bits(q, q2) and same_bits(s, s2)


def test_non_contiguous_input_equals_contiguous():
    """A transposed (non-contiguous) view quantizes exactly like its contiguous copy (all three quantizers)."""
    base = make_weight(Case(300, 200, torch.float32, 3, 2.0, "normal", 1, 1, True, False))
    w = base.t()
    assert not w.is_contiguous()
    for fn in (quant.quantize_blockwise, quant.quantize_per_channel, quant.quantize_activation_groups):
        (q, s), (q2, s2) = fn(w), fn(w.contiguous())
        assert same_bits(q, q2) and same_bits(s, s2), fn.__name__


def test_all_zero_blocks_get_the_floor_scale_and_zero_codes():
    """All-zero blocks (+0, -0, mixed, and a partial edge block): scale = float32(1e-10/448) (pow2: 2**-42), every
    code zero with the sign of the input zero; the other blocks are unaffected."""
    assert float(FLOOR_SCALE_FP32) == float(np.float32(np.float32(1e-10) / np.float32(448.0)))  # no ambiguity
    rng = np.random.default_rng(5)
    a = rng.standard_normal((300, 260))
    a[0:128, 128:256] = 0.0
    a[128:256, 0:128] = np.where(rng.random((128, 128)) < 0.5, 0.0, -0.0)
    a[256:300, 256:260] = -0.0  # edge block: 44 x 4 valid elements
    w = to_tensor(a, torch.bfloat16)
    zero_blocks = [(0, 1), (1, 0), (2, 2)]
    for fmt, floor in (("fp32", float(FLOOR_SCALE_FP32)), ("pow2", FLOOR_SCALE_POW2)):
        q, s = quant.quantize_blockwise(w, scale_format=fmt)
        for bi, bj in zero_blocks:
            assert s[bi, bj].item() == floor, (fmt, bi, bj)
        assert (s.numpy() != floor).sum() == s.numel() - len(zero_blocks)
        codes = codes_of(q)
        x = to_np32(w)
        regions = [(slice(0, 128), slice(128, 256)), (slice(128, 256), slice(0, 128))]
        regions.append((slice(256, 300), slice(256, 260)))
        for rows, cols in regions:
            want = np.where(np.signbit(x[rows, cols]), 0x80, 0x00)
            assert np.array_equal(codes[rows, cols], want)
        assert np.array_equal(quant.dequantize_blockwise(q, s)[128:256, :128].numpy(), np.zeros((128, 128)))
        want_q, want_s = ref_weight_quantize(w, (128, 128), fmt)
        assert_codes_equal(q, want_q)
        assert_f32_equal(s, want_s)


def test_edge_blocks_use_only_valid_elements():
    """Edge blocks of non-multiple-of-128 shapes take amax over their valid elements only: tiny, sub-floor and
    all-negative edge blocks get exactly the reference scale."""
    for n, k in ((129, 130), (1, 1), (200, 129), (257, 1), (700, 641)):
        rng = np.random.default_rng(n * 1000 + k)
        a = rng.uniform(-1.0, 1.0, (n, k)) * 1e-3
        a[256:, :] = -np.abs(a[256:, :]) * 1e-8  # last row blocks: all negative and below the amax floor
        a[:, 128:] *= 1e-4
        w = to_tensor(a, torch.float32)
        for fmt in FORMATS:
            q, s = quant.quantize_blockwise(w, scale_format=fmt)
            want_q, want_s = ref_weight_quantize(w, (128, 128), fmt)
            assert_f32_equal(s, want_s, f"scale {n}x{k} {fmt}")
            assert_codes_equal(q, want_q, f"q {n}x{k} {fmt}")


def test_negative_zero_follows_torch_sign_convention():
    """-0.0 and negative values that underflow to zero get code 0x80, +0.0 and positive underflows 0x00."""
    w = torch.tensor([[-0.0, 0.0, -1e-30, 1e-30, -1e-4, 1e-4, 448.0]], dtype=torch.bfloat16)
    q, s = quant.quantize_blockwise(w)
    assert s.item() == 1.0
    assert codes_of(q).tolist() == [[0x80, 0x00, 0x80, 0x00, 0x80, 0x00, 0x7E]]
    q, s = quant.quantize_per_channel(w)
    assert codes_of(q).tolist() == [[0x80, 0x00, 0x80, 0x00, 0x80, 0x00, 0x7E]]
    deq = quant.dequantize_blockwise(*quant.quantize_blockwise(w))
    assert torch.signbit(deq[0, :6]).tolist() == [True, False, True, False, True, False]


@settings(max_examples=20, **SETTINGS)
@given(
    case=cases(max_dim=520, dtypes=(torch.float32, torch.bfloat16)),
    fmt=st.sampled_from(FORMATS),
    exp10=st.floats(2.0, 30.0),
    data=st.data(),
)
def test_single_huge_outlier_only_affects_its_block(case, fmt, exp10, data):
    """A single huge outlier sets its block's scale to |outlier|/448 (code 0x7E/0xFE) and crushes that block's
    other codes per the reference, while every other block's bytes and scale stay exactly the same."""
    case = dataclasses.replace(case, outliers=0, kind="normal", log_mag=0.0, zero_blocks=0)
    w = make_weight(case)
    i = data.draw(st.integers(0, case.n - 1), label="row")
    j = data.draw(st.integers(0, case.k - 1), label="col")
    sign = data.draw(st.sampled_from([-1.0, 1.0]), label="sign")
    w2 = w.clone()
    w2[i, j] = sign * 10.0**exp10
    q, s = quant.quantize_blockwise(w, scale_format=fmt)
    q2, s2 = quant.quantize_blockwise(w2, scale_format=fmt)
    bi, bj = i // 128, j // 128
    outlier = abs(bf16_round(np.float32([sign * 10.0**exp10]))[0])
    assert s2[bi, bj].item() == ref_scale(outlier, fmt)
    if fmt == "fp32":
        assert codes_of(q2)[i, j] == (0x7E if sign > 0 else 0xFE)
    keep = torch.ones_like(s, dtype=torch.bool)
    keep[bi, bj] = False
    assert same_bits(s[keep], s2[keep])
    rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
    c, c2 = codes_of(q).copy(), codes_of(q2).copy()
    c[rows, cols] = c2[rows, cols] = 0
    assert np.array_equal(c, c2)
    want_q, want_s = ref_weight_quantize(w2, (128, 128), fmt)
    assert_codes_equal(q2, want_q)
    assert_f32_equal(s2, want_s)


# =====================================================================================================================
# non-finite inputs

BAD_VALUES = {
    "nan": float("nan"),
    "inf": float("inf"),
    "-inf": float("-inf"),
    "bf16_overflow": 3.4e38,  # finite in fp32, rounds to +inf in bf16 (bf16 max is 3.3895e38)
    "-bf16_overflow": -3.4e38,
}


@settings(max_examples=40, **SETTINGS)
@given(
    n=dims(300),
    k=dims(300),
    dtype=st.sampled_from(DTYPES),
    transpose=st.booleans(),
    data=st.data(),
)
def test_non_finite_raises_naming_first_position(n, k, dtype, transpose, data):
    """NaN/Inf (and, for FP32, values overflowing to Inf in BF16) raise ValueError naming the first offending element
    in row-major order, from every weight quantizer; the *_into variants leave their outputs untouched."""
    kinds = ["nan", "inf", "-inf"] + (["bf16_overflow", "-bf16_overflow"] if dtype == torch.float32 else [])
    element = st.tuples(st.integers(0, n - 1), st.integers(0, k - 1), st.sampled_from(kinds))
    bad = data.draw(st.lists(element, min_size=1, max_size=4), label="bad")
    a = np.random.default_rng(n * 7 + k).standard_normal((n, k))
    w = to_tensor(a, dtype, transpose)
    for i, j, kind in bad:
        w[i, j] = BAD_VALUES[kind]
    first = min((i, j) for i, j, _ in bad)
    pattern = position_pattern(first)
    with pytest.raises(ValueError, match=pattern):
        quant.quantize_blockwise(w)
    with pytest.raises(ValueError, match=pattern):
        quant.quantize_blockwise(w, scale_format="pow2")
    with pytest.raises(ValueError, match=pattern):
        quant.quantize_per_channel(w)
    q_out = torch.full((n, k), 0x5A, dtype=torch.uint8).view(FP8)
    s_out = torch.full(quant.blockwise_scale_shape((n, k)), -7.0)
    with pytest.raises(ValueError, match=pattern):
        quant.quantize_blockwise_into(w, q_out, s_out)
    assert (codes_of(q_out) == 0x5A).all() and (s_out == -7.0).all()
    sc_out = torch.full((n,), -7.0)
    with pytest.raises(ValueError, match=pattern):
        quant.quantize_per_channel_into(w, q_out, sc_out)
    assert (codes_of(q_out) == 0x5A).all() and (sc_out == -7.0).all()


def test_fp32_values_just_below_bf16_overflow_are_accepted():
    """The largest FP32 values that round to a finite BF16 (<= 3.3895e38 + just under half a BF16 ulp) quantize."""
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    below_tie = np.nextafter(np.float32(2.0**128 * (1 - 2.0**-9)), np.float32(0))  # just under the rounding tie
    w = torch.tensor([[bf16_max, float(below_tie), -float(below_tie), 1.0]], dtype=torch.float32)
    q, s = quant.quantize_blockwise(w)
    assert s.item() == float(np.float32(bf16_max / 448.0))
    assert codes_of(q).tolist() == [[0x7E, 0x7E, 0xFE, 0x00]]
    with pytest.raises(ValueError, match=position_pattern((0, 1))):
        quant.quantize_blockwise(torch.tensor([[1.0, 2.0**128 * (1 - 2.0**-9)]]))  # the tie itself rounds to inf


def test_activation_non_finite_raises_naming_position():
    """quantize_activation_groups rejects NaN/Inf naming the first (row-major, batch dims included) position."""
    x = torch.randn(2, 3, 200, generator=torch.Generator().manual_seed(0))
    x[1, 2, 150] = float("inf")
    x[1, 0, 199] = float("nan")
    with pytest.raises(ValueError, match=position_pattern((1, 0, 199))):
        quant.quantize_activation_groups(x)
    x16 = x.to(torch.float16)
    with pytest.raises(ValueError, match=position_pattern((1, 0, 199))):
        quant.quantize_activation_groups(x16)


# =====================================================================================================================
# in-place variants


@settings(max_examples=25, **SETTINGS)
@given(
    case=cases(max_dim=640),
    blocks_before=st.integers(0, 2),
    rows_after=st.sampled_from([0, 1, 128, 300]),
    fmt=st.sampled_from(FORMATS),
)
def test_blockwise_into_writes_only_its_row_slice(case, blocks_before, rows_after, fmt):
    """quantize_blockwise_into on a block-aligned row slice of a larger (sentinel-filled) q/scale parameter writes
    exactly quantize_blockwise's bytes/scales inside the slice and touches nothing outside it."""
    w = make_weight(case)
    n, k = w.shape
    r0 = blocks_before * 128
    total = r0 + n + rows_after
    q_big = torch.full((total, k), 0xA5, dtype=torch.uint8).view(FP8)
    s_big = torch.full((-(-total // 128), -(-k // 128)), -3.0)
    nb = -(-n // 128)
    quant.quantize_blockwise_into(w, q_big[r0 : r0 + n], s_big[blocks_before : blocks_before + nb], scale_format=fmt)
    q, s = quant.quantize_blockwise(w, scale_format=fmt)
    assert same_bits(q_big[r0 : r0 + n], q)
    assert same_bits(s_big[blocks_before : blocks_before + nb], s)
    codes = codes_of(q_big)
    assert (codes[:r0] == 0xA5).all() and (codes[r0 + n :] == 0xA5).all()
    s_np = s_big.numpy()
    assert (s_np[:blocks_before] == -3.0).all() and (s_np[blocks_before + nb :] == -3.0).all()


@settings(max_examples=20, **SETTINGS)
@given(
    case=cases(max_dim=500),
    rows_before=st.integers(0, 200),
    rows_after=st.integers(0, 50),
    fmt=st.sampled_from(FORMATS),
)
def test_per_channel_into_writes_only_its_row_slice(case, rows_before, rows_after, fmt):
    """quantize_per_channel_into on a row slice (any offset) of a larger sentinel-filled parameter writes exactly
    quantize_per_channel's output inside and nothing outside."""
    w = make_weight(case)
    n, k = w.shape
    total = rows_before + n + rows_after
    q_big = torch.full((total, k), 0xA5, dtype=torch.uint8).view(FP8)
    s_big = torch.full((total,), -3.0)
    quant.quantize_per_channel_into(w, q_big[rows_before : rows_before + n], s_big[rows_before : rows_before + n], fmt)
    q, s = quant.quantize_per_channel(w, fmt)
    assert same_bits(q_big[rows_before : rows_before + n], q)
    assert same_bits(s_big[rows_before : rows_before + n], s)
    codes = codes_of(q_big)
    assert (codes[:rows_before] == 0xA5).all() and (codes[rows_before + n :] == 0xA5).all()
    assert (s_big[:rows_before] == -3.0).all() and (s_big[rows_before + n :] == -3.0).all()


def _sentinels(q_shape, s_shape, q_dtype=FP8, s_dtype=torch.float32):
    q = torch.full(q_shape, 0x5A, dtype=torch.uint8)
    q = q.view(q_dtype) if q_dtype in (FP8, torch.float8_e5m2) else q.to(q_dtype)
    return q, torch.full(s_shape, -7.0, dtype=s_dtype)


def _blockwise_into_rejections():
    """name -> (w, q_out shape, scale_inv_out shape, q dtype, scale dtype, kwargs, regex the message must match)."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    good_q, good_s = (200, 300), (2, 3)
    nan_last = w.clone()
    nan_last[-1, -1] = float("nan")
    overflow = w.clone()
    overflow[150, 2] = 3.4e38
    f8, f32 = FP8, torch.float32
    return {
        "nan_last": (nan_last, good_q, good_s, f8, f32, {}, position_pattern((199, 299))),
        "bf16_overflow": (overflow, good_q, good_s, f8, f32, {}, position_pattern((150, 2))),
        "q_rows": (w, (199, 300), good_s, f8, f32, {}, "q_out"),
        "q_cols": (w, (200, 301), good_s, f8, f32, {}, "q_out"),
        "q_uint8": (w, good_q, good_s, torch.uint8, f32, {}, "q_out"),
        "q_e5m2": (w, good_q, good_s, torch.float8_e5m2, f32, {}, "q_out"),
        "q_bf16": (w, good_q, good_s, torch.bfloat16, f32, {}, "q_out"),
        "s_rows": (w, good_q, (1, 3), f8, f32, {}, "scale_inv_out"),
        "s_cols": (w, good_q, (2, 4), f8, f32, {}, "scale_inv_out"),
        "s_float64": (w, good_q, good_s, f8, torch.float64, {}, "scale_inv_out"),
        "s_bf16": (w, good_q, good_s, f8, torch.bfloat16, {}, "scale_inv_out"),
        "scale_format": (w, good_q, good_s, f8, f32, {"scale_format": "e8m0"}, "scale_format"),
        "block_zero": (w, good_q, good_s, f8, f32, {"block_size": (0, 128)}, "block_size"),
        "block_negative": (w, good_q, good_s, f8, f32, {"block_size": (-128, 128)}, "block_size"),
        "block_len3": (w, good_q, good_s, f8, f32, {"block_size": (128, 128, 1)}, "block_size"),
        "w_3d": (w.view(200, 3, 100), (200, 3, 100), (2, 1), f8, f32, {}, r"\(200, 3, 100\)"),
    }


@pytest.mark.parametrize("name", list(_blockwise_into_rejections()))
def test_blockwise_into_rejection_leaves_outputs_untouched(name):
    """A rejected quantize_blockwise_into (NaN/Inf input, wrong out shape or dtype, bad scale_format/block_size,
    3-D input) raises a ValueError naming the culprit and writes nothing to either output."""
    w, q_shape, s_shape, q_dtype, s_dtype, kwargs, pattern = _blockwise_into_rejections()[name]
    q_out, s_out = _sentinels(q_shape, s_shape, q_dtype, s_dtype)
    q_before, s_before = q_out.clone(), s_out.clone()
    with pytest.raises(ValueError, match=pattern):
        quant.quantize_blockwise_into(w, q_out, s_out, **kwargs)
    assert same_bits(q_out, q_before) and same_bits(s_out, s_before)


@pytest.mark.parametrize(
    "name", ["nan", "q_rows", "q_uint8", "q_e5m2", "s_len", "s_2d", "s_float64", "scale_format"]
)
def test_per_channel_into_rejection_leaves_outputs_untouched(name):
    """A rejected quantize_per_channel_into (NaN, wrong out shape/dtype, bad scale_format) raises ValueError and
    writes nothing."""
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(2))
    q_shape, s_shape, q_dtype, s_dtype, kwargs = (50, 70), (50,), FP8, torch.float32, {}
    if name == "nan":
        w[49, 69] = float("nan")
    elif name == "q_rows":
        q_shape = (49, 70)
    elif name == "q_uint8":
        q_dtype = torch.uint8
    elif name == "q_e5m2":
        q_dtype = torch.float8_e5m2
    elif name == "s_len":
        s_shape = (51,)
    elif name == "s_2d":
        s_shape = (50, 1)
    elif name == "s_float64":
        s_dtype = torch.float64
    elif name == "scale_format":
        kwargs = {"scale_format": "fp16"}
    q_out, s_out = _sentinels(q_shape, s_shape, q_dtype, s_dtype)
    q_before, s_before = q_out.clone(), s_out.clone()
    with pytest.raises(ValueError):
        quant.quantize_per_channel_into(w, q_out, s_out, **kwargs)
    assert same_bits(q_out, q_before) and same_bits(s_out, s_before)


# =====================================================================================================================
# per output channel


@settings(max_examples=40, **SETTINGS)
@given(case=cases(), fmt=st.sampled_from(FORMATS))
def test_per_channel_matches_float64_reference(case, fmt):
    """quantize_per_channel: bytes and per-row float32 scales bit-identical to the reference (one group per row)."""
    w = make_weight(case, (1, max(case.k, 1)))
    q, s = quant.quantize_per_channel(w, fmt)
    assert q.dtype == FP8 and q.shape == w.shape and s.dtype == torch.float32 and tuple(s.shape) == (case.n,)
    want_q, want_s = ref_weight_quantize(w, (1, case.k), fmt)
    assert_f32_equal(s, want_s[:, 0])
    assert_codes_equal(q, want_q)


@settings(max_examples=20, **SETTINGS)
@given(case=cases(), fmt=st.sampled_from(FORMATS))
def test_per_channel_error_bound_and_pow2_properties(case, fmt):
    """Per-channel: dequant error within the E4M3 rounding bound of its row; pow2 scales are tight powers of two;
    all-zero rows get the floor scale; nothing overflows."""
    w = make_weight(case, (1, case.k))
    q, s = quant.quantize_per_channel(w, fmt)
    x = bf16_round(to_np32(w))
    s64 = s.numpy().astype(np.float64)
    deq = quant.dequantize_per_channel(q, s).numpy().astype(np.float64)
    assert np.isfinite(deq).all() and not np.isin(codes_of(q), NAN_CODES).any()
    s_el = s64[:, None]
    bound = s_el * e4m3_half_ulp(np.abs(x) / s_el) + 2.0**-22 * (np.abs(x) + np.abs(deq))
    assert (np.abs(deq - x) <= bound).all()
    assert (np.abs(deq) <= (E4M3_MAX * s_el).astype(np.float32)).all()  # 448*scale, rounded like the product
    amax = np.abs(x).max(axis=1)
    floor = FLOOR_SCALE_POW2 if fmt == "pow2" else float(FLOOR_SCALE_FP32)
    assert (s64[amax == 0] == floor).all()
    if fmt == "pow2":
        assert (np.frexp(s64)[0] == 0.5).all()
        assert (E4M3_MAX * s64 >= amax).all()
        above = amax > AMAX_FLOOR
        assert (E4M3_MAX * s64[above] < 2.0 * amax[above]).all()


# =====================================================================================================================
# activations (dynamic 1 x group_size per-token groups)

LEADS = st.one_of(st.lists(st.integers(1, 6), max_size=3), st.tuples(st.integers(100, 400)).map(list))


@settings(max_examples=50, **SETTINGS)
@given(
    lead=LEADS,
    k=dims(700),
    group=st.sampled_from([128, 128, 128, 64, 96, 1]),
    dtype=st.sampled_from(DTYPES),
    fmt=st.sampled_from(FORMATS),
    seed=st.integers(0, 2**32 - 1),
    log_mag=st.floats(-6.0, 4.0),
    kind=st.sampled_from(KINDS),
    outliers=st.integers(0, 2),
    zero_groups=st.integers(0, 2),
)
def test_activation_groups_match_float64_reference(
    lead, k, group, dtype, fmt, seed, log_mag, kind, outliers, zero_groups
):
    """quantize_activation_groups: q like x, scale [..., ceil(K/group)], bytes/scales bit-identical to the
    reference applied to x in its own dtype (activations are not BF16-rounded), any leading batch dims, K not a
    multiple of the group; dequantize_activation_groups is within the E4M3 bound."""
    if group == 1:
        k = min(k, 64)  # one group per element: keep the python reference loop short
    tokens = int(np.prod(lead)) if lead else 1
    case = Case(tokens, k, dtype, seed, log_mag, kind, outliers, zero_groups, True, False)
    x = to_tensor(make_values(case, (1, group)), dtype).reshape(*lead, k)
    if (group, fmt) == (128, "fp32"):
        q, s = quant.quantize_activation_groups(x)  # the defaults
    else:
        q, s = quant.quantize_activation_groups(x, group, fmt)
    groups = -(-k // group)
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (*lead, groups)
    x64 = to_np32(x).astype(np.float64).reshape(tokens, k)
    want_q, want_s = ref_quantize(x64, (1, group), fmt)
    assert_f32_equal(s.reshape(tokens, groups), want_s)
    assert_codes_equal(q.reshape(tokens, k), want_q)
    deq = quant.dequantize_activation_groups(q, s, group).numpy().astype(np.float64).reshape(tokens, k)
    s_el = expand(want_s, (tokens, k), (1, group))
    bound = s_el * e4m3_half_ulp(np.abs(x64) / s_el) + 2.0**-22 * (np.abs(x64) + np.abs(deq))
    assert np.isfinite(deq).all() and (np.abs(deq - x64) <= bound).all()


def test_activation_fp32_is_quantized_as_is_not_bf16_rounded():
    """FP32 activations are quantized from their own values: a value that BF16 would round changes the result."""
    x = torch.tensor([448.0, 17.01])  # 17.01 -> 18 (0x59) as is; via BF16 it would be 17.0 -> tie -> 16 (0x58)
    q, s = quant.quantize_activation_groups(x)
    assert s.tolist() == [1.0] and codes_of(q).tolist() == [0x7E, 0x59]


# =====================================================================================================================
# dequantization


@settings(max_examples=30, **SETTINGS)
@given(
    n=dims(400),
    k=dims(400),
    block=BLOCKS,
    seed=st.integers(0, 2**32 - 1),
    pow2=st.booleans(),
)
def test_dequantize_is_the_exact_float32_product(n, k, block, seed, pow2):
    """dequantize_blockwise / _per_channel / _activation_groups return exactly float32(code value * scale) for every
    non-NaN code (incl. -0 and subnormals) and arbitrary positive float32 scales."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k)).astype(np.uint8)
    codes[np.isin(codes, NAN_CODES)] = 0x80
    q = torch.from_numpy(codes).view(FP8)
    vals = e4m3_decode(codes)

    def scales(shape):
        if pow2:
            return np.ldexp(1.0, rng.integers(-60, 60, shape)).astype(np.float32)
        return (10.0 ** rng.uniform(-14, 30, shape)).astype(np.float32)

    bn, bk = block
    sb = scales((-(-n // bn), -(-k // bk)))
    got = quant.dequantize_blockwise(q, torch.from_numpy(sb), block)
    assert got.dtype == torch.float32
    assert_f32_equal(got, (vals * expand(sb, (n, k), block)).astype(np.float32), "dequantize_blockwise")

    sc = scales((n,))
    got = quant.dequantize_per_channel(q, torch.from_numpy(sc))
    assert_f32_equal(got, (vals * sc.astype(np.float64)[:, None]).astype(np.float32), "dequantize_per_channel")

    sg = scales((n, -(-k // 128)))
    got = quant.dequantize_activation_groups(q, torch.from_numpy(sg))
    assert_f32_equal(got, (vals * expand(sg, (n, k), (1, 128))).astype(np.float32), "dequantize_activation_groups")


@settings(max_examples=20, **SETTINGS)
@given(case=cases(max_dim=520), block=BLOCKS)
def test_pow2_dequantized_weights_are_a_fixed_point(case, block):
    """pow2 round trip: dequantize(quantize(dequantize(quantize(w)))) == dequantize(quantize(w)) bit for bit
    (dequantized pow2 values are exactly representable, so re-quantizing them loses nothing)."""
    w = make_weight(case, block)
    deq1 = quant.dequantize_blockwise(*quant.quantize_blockwise(w, block, "pow2"), block)
    deq2 = quant.dequantize_blockwise(*quant.quantize_blockwise(deq1, block, "pow2"), block)
    assert same_bits(deq1, deq2)
    deq1 = quant.dequantize_per_channel(*quant.quantize_per_channel(w, "pow2"))
    deq2 = quant.dequantize_per_channel(*quant.quantize_per_channel(deq1, "pow2"))
    assert same_bits(deq1, deq2)


def test_fp32_round_trip_requantization_is_stable():
    """fp32 scales: re-quantizing dequantized weights stays within one E4M3 rounding of the first dequantization."""
    w = make_weight(Case(300, 400, torch.bfloat16, 11, 0.0, "normal", 2, 1, True, False))
    q, s = quant.quantize_blockwise(w)
    deq1 = quant.dequantize_blockwise(q, s)
    q2, s2 = quant.quantize_blockwise(deq1)
    deq2 = quant.dequantize_blockwise(q2, s2).numpy().astype(np.float64)
    x = bf16_round(deq1.numpy())
    s_el = expand(s2.numpy(), x.shape, (128, 128))
    bound = s_el * e4m3_half_ulp(np.abs(x) / s_el) + 2.0**-22 * (np.abs(x) + np.abs(deq2))
    assert (np.abs(deq2 - x) <= bound).all()
    assert np.allclose(s2.numpy(), s.numpy(), rtol=2.0**-7)  # amax moves by at most a BF16 rounding


# =====================================================================================================================
# argument validation


_ONES = torch.ones(4, 4)
_Q200 = torch.zeros(200, 10).to(FP8)
_qb, _qpc, _qact = quant.quantize_blockwise, quant.quantize_per_channel, quant.quantize_activation_groups
_FLOAT_ERR = (TypeError, ValueError)

BAD_CALLS = {  # name -> (call, accepted exception type(s), regex the message must match)
    "blockwise_3d": (lambda: _qb(torch.zeros(2, 3, 4)), ValueError, r"\(2, 3, 4\)"),
    "blockwise_1d": (lambda: _qb(torch.zeros(5)), ValueError, r"\(5,\)"),
    "blockwise_0d": (lambda: _qb(torch.tensor(1.0)), ValueError, r"\(\)"),
    "blockwise_format": (lambda: _qb(_ONES, scale_format="e8m0"), ValueError, "scale_format"),
    "blockwise_format_case": (lambda: _qb(_ONES, scale_format="POW2"), ValueError, "scale_format"),
    "blockwise_block_zero": (lambda: _qb(_ONES, (0, 128)), ValueError, "block_size"),
    "blockwise_block_neg": (lambda: _qb(_ONES, (128, -1)), ValueError, "block_size"),
    "blockwise_block_len1": (lambda: _qb(_ONES, (128,)), ValueError, "block_size"),
    "blockwise_block_len3": (lambda: _qb(_ONES, (128, 128, 128)), ValueError, "block_size"),
    "blockwise_block_frac": (lambda: _qb(_ONES, (127.5, 128)), ValueError, "block_size"),
    "blockwise_int_input": (lambda: _qb(torch.ones(4, 4, dtype=torch.int32)), _FLOAT_ERR, "int32"),
    "blockwise_fp8_input": (lambda: _qb(torch.zeros(4, 4).to(FP8)), _FLOAT_ERR, "float8"),
    "per_channel_3d": (lambda: _qpc(torch.zeros(2, 3, 4)), ValueError, r"\(2, 3, 4\)"),
    "per_channel_format": (lambda: _qpc(_ONES, "fp8"), ValueError, "scale_format"),
    "activation_group_zero": (lambda: _qact(_ONES, 0), ValueError, "group_size"),
    "activation_0d": (lambda: _qact(torch.tensor(1.0)), ValueError, r"\(\)"),
    "activation_format": (lambda: _qact(_ONES, 128, "int8"), ValueError, "scale_format"),
    "dequant_block_scale_shape": (lambda: quant.dequantize_blockwise(_Q200, torch.ones(1, 1)), ValueError, "scale_inv"),
    "dequant_block_scale_dtype": (
        lambda: quant.dequantize_blockwise(_Q200, torch.ones(2, 1, dtype=torch.float64)),
        ValueError,
        "scale_inv",
    ),
    "dequant_block_bad_block": (
        lambda: quant.dequantize_blockwise(_Q200, torch.ones(2, 1), (0, 128)),
        ValueError,
        "block_size",
    ),
    "dequant_block_3d": (
        lambda: quant.dequantize_blockwise(torch.zeros(2, 2, 2).to(FP8), torch.ones(1, 1)),
        ValueError,
        r"\(2, 2, 2\)",
    ),
    "dequant_channel_scale_shape": (
        lambda: quant.dequantize_per_channel(torch.zeros(20, 10).to(FP8), torch.ones(10)),
        ValueError,
        "scale",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_wrong_arguments_give_clear_errors(name):
    """Wrong arguments (non-2-D inputs, unknown scale_format, bad block_size or group_size, non-float input, scale
    tensors of the wrong shape/dtype) raise a ValueError/TypeError whose message names the problem."""
    call, exc_type, pattern = BAD_CALLS[name]
    with pytest.raises(exc_type, match=pattern):
        call()
