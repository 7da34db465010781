"""CPU checks of sglang_fp8rl.kernels: the dispatch falls back to quant.py bit for bit and validates like it.

The last tests run the Triton kernels under TRITON_INTERPRET=1 (in a subprocess, since the interpreter is chosen
when a kernel is defined). The interpreter's FP32 -> FP8 and FP32 -> BF16 casts do not round like the hardware
and its fma rounds twice, so there the kernels write into float32 destinations (the clamped quotient, before the
FP8 cast) from inputs that are exact in BF16, with the fma replaced by an extended-precision one: indexing, masks,
strides, amax, scales (exactly), the division and the NaN/Inf flag are checked; the casts and the real FMA are
checked on the GPU (tests/gpu/test_triton_quant.py).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import QUANTIZER_PREAMBLE, run_under_interpreter

from sglang_fp8rl import quant
from sglang_fp8rl.kernels import dispatch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def random_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    log10 = torch.empty(n, k).uniform_(-6.0, 4.0)
    sign = torch.randint(0, 2, (n, k)).float() * 2 - 1
    return (sign * torch.pow(10.0, log10)).to(dtype)


def error_of(fn, *args, **kwargs) -> tuple[type, str] | None:
    """(type, message) of what ``fn`` raises, or None."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError, IndexError, ZeroDivisionError) as e:
        return type(e), str(e)
    return None


# ---------------------------------------------------------------------------------------------------------------------
# fallback: bit-exact with quant.py


@pytest.mark.parametrize("fmt", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blockwise_falls_back_to_reference_bit_exactly(dtype: torch.dtype, fmt: str) -> None:
    for n, k in [(300, 200), (128, 128), (1, 5)]:
        w = random_weight(n, k, dtype)
        q_ref, s_ref = quant.quantize_blockwise(w, scale_format=fmt)
        q = torch.empty(n, k, dtype=quant.FP8_DTYPE)
        s = torch.empty(quant.blockwise_scale_shape((n, k)))
        dispatch.quantize_blockwise_into(w, q, s, scale_format=fmt)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


@pytest.mark.parametrize("fmt", ["fp32", "pow2"])
def test_per_channel_falls_back_into_row_slices(fmt: str) -> None:
    w = random_weight(200, 130, torch.float32)[:, ::1]
    q_param = torch.zeros(500, 130, dtype=quant.FP8_DTYPE)
    s_param = torch.zeros(500)
    dispatch.quantize_per_channel_into(w.t().contiguous().t(), q_param[100:300], s_param[100:300], fmt)
    q_ref, s_ref = quant.quantize_per_channel(w, fmt)
    assert torch.equal(q_param[100:300].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s_param[100:300], s_ref)
    assert not bool(q_param[:100].view(torch.uint8).any()) and not bool(s_param[300:].any())


def test_blockwise_fallback_into_param_row_slice() -> None:
    w = random_weight(256, 300, torch.bfloat16)
    q_param = torch.zeros(512, 300, dtype=quant.FP8_DTYPE)
    s_param = torch.zeros(4, 3)
    dispatch.quantize_blockwise_into(w, q_param[128:384], s_param[1:3])
    q_ref, s_ref = quant.quantize_blockwise(w)
    assert torch.equal(q_param[128:384].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s_param[1:3], s_ref)


def test_cpu_outputs_never_take_the_kernel_path() -> None:
    w = torch.randn(4, 4)
    assert not dispatch._on_kernel_path(w, torch.empty(4, 4, dtype=quant.FP8_DTYPE), torch.empty(1, 1))


# ---------------------------------------------------------------------------------------------------------------------
# validation: the same errors as the reference


def _blockwise_cases() -> list[tuple]:
    w = torch.randn(130, 200, dtype=torch.bfloat16)
    q, s = torch.empty(130, 200, dtype=quant.FP8_DTYPE), torch.empty(2, 2)
    nan_w = w.clone()
    nan_w[70, 150] = float("nan")
    w3d = torch.randn(130, 200, 1)
    return [
        (w, torch.empty(130, 201, dtype=quant.FP8_DTYPE), s, quant.DEFAULT_BLOCK_SIZE, "fp32"),
        (w, torch.empty(130, 200, dtype=torch.bfloat16), s, quant.DEFAULT_BLOCK_SIZE, "fp32"),
        (w, q, torch.empty(2, 1), quant.DEFAULT_BLOCK_SIZE, "fp32"),
        (w, q, s.double(), quant.DEFAULT_BLOCK_SIZE, "fp32"),
        (w, q, s, quant.DEFAULT_BLOCK_SIZE, "e4m3"),
        (w, q, s, (64, 64), "fp32"),  # the scale is (3, 4) for 64x64 blocks
        (w, q, s, (0, 128), "fp32"),
        (w.int(), q, s, quant.DEFAULT_BLOCK_SIZE, "fp32"),
        (w3d, torch.empty(130, 200, 1, dtype=quant.FP8_DTYPE), s, quant.DEFAULT_BLOCK_SIZE, "fp32"),
        (nan_w, q, s, quant.DEFAULT_BLOCK_SIZE, "fp32"),
        (nan_w, q, s, quant.DEFAULT_BLOCK_SIZE, "bogus"),  # NaN reported first, as in the reference
    ]


@pytest.mark.parametrize("case", range(len(_blockwise_cases())))
def test_blockwise_validation_matches_reference(case: int) -> None:
    w, q, s, block_size, fmt = _blockwise_cases()[case]
    q_before, s_before = q.clone(), s.clone()
    want = error_of(quant.quantize_blockwise_into, w, q, s, block_size, fmt)
    got = error_of(dispatch.quantize_blockwise_into, w, q, s, block_size, fmt)
    assert want is not None
    assert got == want
    # bit for bit: the scale buffers are torch.empty, and uninitialized memory may hold NaN, which equals nothing
    assert torch.equal(q.view(torch.uint8), q_before.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), s_before.view(torch.uint8))


def test_per_channel_validation_matches_reference() -> None:
    w = torch.randn(50, 70)
    q, s = torch.empty(50, 70, dtype=quant.FP8_DTYPE), torch.empty(50)
    inf_w = w.clone()
    inf_w[3, 69] = float("-inf")
    cases = [
        (w, torch.empty(50, 71, dtype=quant.FP8_DTYPE), s, "fp32"),
        (w, q, torch.empty(51), "fp32"),
        (w, q, s.half(), "fp32"),
        (w, q, s, "int8"),
        (inf_w, q, s, "fp32"),
        (torch.randn(50), torch.empty(50, dtype=quant.FP8_DTYPE), s, "fp32"),
    ]
    for w_, q_, s_, fmt in cases:
        want = error_of(quant.quantize_per_channel_into, w_, q_, s_, fmt)
        assert want is not None
        assert error_of(dispatch.quantize_per_channel_into, w_, q_, s_, fmt) == want


# ---------------------------------------------------------------------------------------------------------------------
# NaN/Inf: the pre-check and the flag


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aminmax_precheck_sees_every_nonfinite(dtype: torch.dtype, bad: float) -> None:
    """torch.aminmax propagates NaN and reports +-Inf; the message is the reference's (first position)."""
    for pos in [(0, 0), (17, 33), (63, 99)]:
        w = random_weight(64, 100, dtype)
        w[pos] = bad
        w[40, 1] = bad  # a second offender, later in row-major order unless pos is after it
        lo, hi = torch.aminmax(w)
        assert not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))
        want = error_of(quant.check_finite, quant.round_to_bf16(w))
        assert error_of(dispatch._check_finite_before_write, w) == want


def test_precheck_catches_fp32_values_that_overflow_bf16() -> None:
    w = torch.randn(10, 10)
    w[4, 6] = 3.4e38  # finite FP32, Inf after the BF16 rounding the reference does first
    assert bool(torch.isfinite(w).all())
    want = error_of(quant.quantize_blockwise, w)
    assert want is not None and "w[4, 6] is inf" in want[1]
    assert error_of(dispatch._check_finite_before_write, w) == want


def test_precheck_passes_finite_extremes() -> None:
    w = torch.tensor([[3.38e38, -3.38e38, 1e-45, 0.0, -0.0]])
    dispatch._check_finite_before_write(w)
    dispatch._check_finite_before_write(w.to(torch.bfloat16))
    dispatch._check_finite_before_write(torch.tensor([[65504.0, -65504.0]], dtype=torch.float16))


def test_check_nonfinite_flag() -> None:
    w_good, w_bad = torch.randn(5, 5), torch.randn(5, 5)
    w_bad[2, 3] = float("nan")
    dispatch.check_nonfinite_flag(dispatch.new_nonfinite_flag("cpu"), {"a": w_bad})  # clear: no check at all
    flag = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^b\[2, 3\] is nan"):
        dispatch.check_nonfinite_flag(flag, {"a": w_good, "b": w_bad})
    with pytest.raises(ValueError, match="pass the weights"):
        dispatch.check_nonfinite_flag(flag)
    with pytest.raises(ValueError, match="nonfinite flag set"):
        dispatch.check_nonfinite_flag(flag, {"a": w_good})
    slots = torch.tensor([0, 1, 0], dtype=torch.int32)  # one slot per tensor: only the flagged one is re-checked
    with pytest.raises(ValueError, match=r"^y\[2, 3\] is nan"):
        dispatch.check_nonfinite_flag(slots, {"x": w_bad, "y": w_bad, "z": w_good})


# ---------------------------------------------------------------------------------------------------------------------
# kernel helpers (pure Python) and the kernels under the Triton interpreter


def test_supports_block_size_and_per_channel_tiles() -> None:
    tq = pytest.importorskip("sglang_fp8rl.kernels.triton_quant")
    assert tq.supports_block_size((128, 128)) and tq.supports_block_size([64, 256])
    for bad in [(128,), (96, 128), (128, 0), (1, 64), (512, 512), ("128", 128), None]:
        assert not tq.supports_block_size(bad)
    assert tq.per_channel_tile(4096, 4096) == (4, 4096, True)
    assert tq.per_channel_tile(4096, 12288) == (1, 16384, True)
    assert tq.per_channel_tile(10, 300) == (16, 512, True)
    assert tq.per_channel_tile(5, 20000) == (4, tq.ROW_CHUNK, False)


INTERPRETER_CHECK = QUANTIZER_PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels import triton_quant as tq

    def blockwise(w, block_size, fmt):
        n, k = w.shape
        _, s_ref = quant.quantize_blockwise(w, block_size, fmt)
        y = torch.full((n, k), 7.0)
        s = torch.full(s_ref.shape, float("nan"))
        tq.quantize_blockwise_launch(w, y, s, block_size, fmt == "pow2", torch.zeros(1, dtype=torch.int32))
        assert torch.equal(s, s_ref), (w.shape, w.stride(), block_size, fmt)
        assert torch.equal(y, quotient(w, quant.expand_block_scale(s_ref, (n, k), block_size))), (w.shape, fmt)

    def per_channel(w, fmt):
        _, s_ref = quant.quantize_per_channel(w, fmt)
        y = torch.full(tuple(w.shape), 7.0)
        s = torch.full(s_ref.shape, float("nan"))
        tq.quantize_per_channel_launch(w, y, s, fmt == "pow2")
        assert torch.equal(s, s_ref), (w.shape, fmt)
        assert torch.equal(y, quotient(w, s_ref[:, None])), (w.shape, fmt)

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fmt in ("fp32", "pow2"):
            blockwise(weight(200, 300, dtype), (128, 128), fmt)
            blockwise(weight(70, 90, dtype), (64, 32), fmt)
            blockwise(weight(260, 2 * 140, dtype)[::2, 1::2].t(), (128, 128), fmt)  # strided, transposed
            per_channel(weight(9, 300, dtype), fmt)
            per_channel(weight(3, 17000, dtype), fmt)  # two-pass path
    small = weight(300, 300, torch.bfloat16)
    small[:128, :128] = 0.0
    small[200:, 200:] *= 1e-30  # below the amax floor
    blockwise(small, (128, 128), "fp32")
    # normal BF16 values from 2**-126 to 2**-97 (a block far below the amax floor): quotients correctly rounded,
    # although the division's residual would be subnormal without the kernel's lift (it failed here before it)
    exponents = torch.randint(-126, -96, (128, 256))
    tiny = torch.ldexp(torch.randn(128, 256).sign() * (1 + torch.rand(128, 256)), exponents).to(torch.bfloat16)
    blockwise(tiny, (128, 128), "fp32")

    # NaN/Inf: flag set, bad blocks (rows) untouched, the others written
    w = weight(300, 300, torch.bfloat16)
    w[150, 10] = float("nan")
    w[10, 290] = float("inf")
    y = torch.full((300, 300), 7.0)
    s = torch.full((3, 3), -1.0)
    flag = torch.zeros(1, dtype=torch.int32)
    tq.quantize_blockwise_launch(w, y, s, (128, 128), False, flag)
    assert flag.item() == 1
    assert bool((y[128:256, :128] == 7).all()) and bool((y[:128, 256:] == 7).all())
    assert s[1, 0] == -1 and s[0, 2] == -1 and bool((s[2] != -1).all())
    y = torch.full((300, 300), 7.0)
    s = torch.full((300,), -1.0)
    flag.zero_()
    tq.quantize_per_channel_launch(w, y, s, False, flag)
    assert flag.item() == 1
    assert bool((y[[10, 150]] == 7).all()) and bool((s[[10, 150]] == -1).all()) and bool((s[11:150] != -1).all())
    print("interpreter ok")
    """
)


def test_kernels_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_under_interpreter(INTERPRETER_CHECK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout
