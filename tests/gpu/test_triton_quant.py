"""The Triton quantizers against the torch reference (sglang_fp8rl.quant run on the CPU): bit for bit.

The reference runs on the CPU on purpose: quant.py on CUDA divides ``amax / 448`` as ``amax * (1/448)`` (torch's
CUDA kernel turns a division by a CPU scalar into a multiplication by its reciprocal), which is not the rule the
module states; the kernel implements the stated rule, true division. See docs/quantizer_kernel.md.

Outputs are poisoned before each call (FP8 code 0x7F is NaN, never a valid result; scales NaN) so an unwritten
element cannot pass. Every test draws fresh random inputs; the seed is in the failure message.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang_fp8rl import quant
from sglang_fp8rl.kernels import dispatch

triton = pytest.importorskip("triton")
tl = triton.language
from sglang_fp8rl.kernels import triton_quant  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FORMATS = ("fp32", "pow2")
POISON_CODE = 0x7F  # e4m3fn NaN


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def fresh_generator() -> tuple[torch.Generator, int]:
    """A CPU generator with a fresh seed (reported on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def random_weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random signs, magnitudes log-uniform in 1e-6..1e4 around per-row/per-column centres so block amaxes vary."""
    centre = torch.empty(n, 1).uniform_(-4.0, 2.0, generator=gen) + torch.empty(1, k).uniform_(-1.0, 1.0, generator=gen)
    log10 = (centre + torch.empty(n, k).uniform_(-2.0, 2.0, generator=gen)).clamp(-6.0, 4.0)
    sign = torch.randint(0, 2, (n, k), generator=gen).float() * 2 - 1
    return (sign * torch.pow(10.0, log10)).to(dtype)


def poisoned_codes(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, POISON_CODE, dtype=torch.uint8, device="cuda").view(quant.FP8_DTYPE)


def poisoned_scales(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device="cuda")


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str, seed: int) -> None:
    """Bitwise equality (uint8 view for codes, int32 view for scales) with the first mismatch in the message."""
    as_int = torch.uint8 if got.element_size() == 1 else torch.int32
    g, w = got.detach().cpu().view(as_int), want.detach().cpu().view(as_int)
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)} (seed {seed})"
    diff = g != w
    if bool(diff.any()):
        pos = tuple(int(i) for i in diff.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(diff.sum())}/{diff.numel()} differ, first at {pos}: got {g[pos].item():#x} want "
            f"{w[pos].item():#x} (seed {seed})"
        )


def check_blockwise(w: torch.Tensor, block_size: tuple[int, int], fmt: str, seed: int) -> None:
    """Dispatch on CUDA (fresh poisoned outputs) against the CPU reference."""
    q_ref, s_ref = quant.quantize_blockwise(w.cpu(), block_size, fmt)
    q = poisoned_codes(tuple(w.shape))
    s = poisoned_scales(tuple(s_ref.shape))
    dispatch.quantize_blockwise_into(w, q, s, block_size, fmt)
    assert_bits_equal(q, q_ref, f"q {tuple(w.shape)} {w.dtype} {fmt} {block_size}", seed)
    assert_bits_equal(s, s_ref, f"scale_inv {tuple(w.shape)} {w.dtype} {fmt} {block_size}", seed)


def check_per_channel(w: torch.Tensor, fmt: str, seed: int) -> None:
    q_ref, s_ref = quant.quantize_per_channel(w.cpu(), fmt)
    q = poisoned_codes(tuple(w.shape))
    s = poisoned_scales((w.shape[0],))
    dispatch.quantize_per_channel_into(w, q, s, fmt)
    assert_bits_equal(q, q_ref, f"q {tuple(w.shape)} {w.dtype} {fmt}", seed)
    assert_bits_equal(s, s_ref, f"scale {tuple(w.shape)} {w.dtype} {fmt}", seed)


def random_shape(gen: torch.Generator, low: int, high: int) -> tuple[int, int]:
    n, k = torch.randint(low, high + 1, (2,), generator=gen).tolist()
    return n, k


def fp8_grid_values() -> torch.Tensor:
    """Every finite positive e4m3 value, the midpoints between neighbours (ties), and one BF16 ulp either side."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(quant.FP8_DTYPE).float()  # 0 .. 448
    mids = ((codes[:-1] + codes[1:]) / 2).to(torch.bfloat16)  # exact: e4m3 has 3 mantissa bits, BF16 has 7
    bits = mids.view(torch.int16)
    ulp_up = (bits + 1).view(torch.bfloat16)  # positive values: the next BF16 up / down
    ulp_down = (bits[1:] - 1).view(torch.bfloat16)
    below_min = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-12])  # a tie, and underflow below 2**-9
    values = torch.cat([codes, mids.float(), ulp_up.float(), ulp_down.float(), below_min])
    assert torch.equal(values.to(torch.bfloat16).float(), values)
    return values


# ---------------------------------------------------------------------------------------------------------------------
# blockwise


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blockwise_random_shapes(dtype: torch.dtype, fmt: str) -> None:
    gen, seed = fresh_generator()
    shapes = [random_shape(gen, 1, 700) for _ in range(2)] + [(256, 384), (1, 1), (129, 127)]
    for n, k in shapes:
        check_blockwise(random_weight(n, k, dtype, gen).cuda(), quant.DEFAULT_BLOCK_SIZE, fmt, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [(64, 128), (128, 64), (32, 256)])
def test_blockwise_other_block_sizes(block_size: tuple[int, int]) -> None:
    gen, seed = fresh_generator()
    n, k = random_shape(gen, 100, 500)
    check_blockwise(random_weight(n, k, torch.bfloat16, gen).cuda(), block_size, "fp32", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_blockwise_into_row_slices_of_a_parameter(dtype: torch.dtype, fmt: str) -> None:
    """Write fused sections into param[r0:r1] and the matching scale rows; everything else stays untouched."""
    gen, seed = fresh_generator()
    n_total, k = 1024 + int(torch.randint(1, 127, (1,), generator=gen)), 1000
    q_param = poisoned_codes((n_total, k))
    s_param = poisoned_scales(quant.blockwise_scale_shape((n_total, k)))
    sections = [(0, 128), (128, 640), (640, 896), (896, n_total)]  # block-aligned starts, last one ragged
    weights = [random_weight(r1 - r0, k, dtype, gen).cuda() for r0, r1 in sections]
    for (r0, r1), w in zip(sections[1:], weights[1:]):  # section 0 is left unwritten on purpose
        scale_rows = s_param[r0 // 128 : quant.ceil_div(r1, 128)]
        dispatch.quantize_blockwise_into(w, q_param[r0:r1], scale_rows, scale_format=fmt)
    for (r0, r1), w in zip(sections[1:], weights[1:]):
        q_ref, s_ref = quant.quantize_blockwise(w.cpu(), scale_format=fmt)
        assert_bits_equal(q_param[r0:r1], q_ref, f"q rows {r0}:{r1}", seed)
        assert_bits_equal(s_param[r0 // 128 : quant.ceil_div(r1, 128)], s_ref, f"scale rows of {r0}:{r1}", seed)
    assert bool((q_param[:128].view(torch.uint8) == POISON_CODE).all()), "rows outside the slices were written"
    assert bool(s_param[0].isnan().all()), "scale rows outside the slices were written"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_blockwise_strided_inputs(dtype: torch.dtype) -> None:
    """Inputs that are views: wider rows, column-major (transposed), every other row and third column."""
    gen, seed = fresh_generator()
    n, k = random_shape(gen, 130, 400)
    base = random_weight(2 * n + 3, 3 * k + 7, dtype, gen).cuda()
    views = [
        ("wider rows", base[:n, 5 : 5 + k], "fp32"),
        ("transposed", base[:k, :n].t(), "pow2"),
        ("every other row, third column", base[1::2, 2::3][:n, :k], "fp32"),
    ]
    for name, w, fmt in views:
        assert not w.is_contiguous(), name
        check_blockwise(w, quant.DEFAULT_BLOCK_SIZE, fmt, seed)


@pytest.mark.gpu
def test_blockwise_strided_output() -> None:
    """A column-major destination (unusual, but the strides are honoured)."""
    gen, seed = fresh_generator()
    w = random_weight(300, 200, torch.bfloat16, gen).cuda()
    q_ref, s_ref = quant.quantize_blockwise(w.cpu())
    q = poisoned_codes((200, 300)).t()
    s = poisoned_scales((2, 3)).t()
    dispatch.quantize_blockwise_into(w, q, s)
    assert_bits_equal(q.contiguous(), q_ref, "q column-major", seed)
    assert_bits_equal(s.contiguous(), s_ref, "scale column-major", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_blockwise_all_zero_blocks_and_negative_zero(fmt: str) -> None:
    gen, seed = fresh_generator()
    w = random_weight(384, 300, torch.bfloat16, gen)
    w[:128, :128] = 0.0
    w[128:256, 128:256] = -0.0
    w[256:, 256:] = 0.0
    w[300, 10] = -0.0  # a negative zero inside a normal block
    w[:2, :] = 0.0  # zero rows crossing blocks
    check_blockwise(w.cuda(), quant.DEFAULT_BLOCK_SIZE, fmt, seed)
    flag = dispatch.new_nonfinite_flag("cuda")
    dispatch.quantize_blockwise_into(w.cuda(), poisoned_codes((384, 300)), poisoned_scales((3, 3)), scale_format=fmt,
                                     nonfinite_flag=flag)
    assert int(flag.item()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blockwise_huge_outliers_and_tiny_blocks(dtype: torch.dtype, fmt: str) -> None:
    """One outlier per block flushes the rest towards (signed) zero codes; all-tiny blocks hit the amax floor."""
    gen, seed = fresh_generator()
    w = random_weight(256, 384, torch.float32, gen) * 1e-3
    w[5, 7] = 1e4
    w[130, 200] = -9.9e3
    w[129, 129] = 3.0e4 if dtype == torch.float16 else 2.5e38  # near the top of the input format
    w[:128, 256:] = w[:128, 256:] * 1e-20  # amax < 1e-10: the floor decides the scale
    check_blockwise(w.to(dtype).cuda(), quant.DEFAULT_BLOCK_SIZE, fmt, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_blockwise_rounding_across_fp8_binades(fmt: str) -> None:
    """Every e4m3 value, every tie between neighbours and one BF16 ulp either side, at scales 1 and 2**e."""
    gen, seed = fresh_generator()
    values = fp8_grid_values()
    for exponent in (0, -7, 5):
        grid = values * 2.0**exponent
        sign = torch.randint(0, 2, (128, 128), generator=gen).float() * 2 - 1
        idx = torch.randint(0, len(grid), (128, 128), generator=gen)
        w = sign * grid[idx]
        w[0, 0] = 448.0 * 2.0**exponent  # amax: scale_inv is exactly 2**exponent, x / scale_inv is exact
        # more blocks: scale 1.75 * 2**exponent keeps the quotients on the grid; 1.3 moves them off it
        blocks = torch.cat([w, w * 1.75, w * 1.3], dim=1)
        check_blockwise(blocks.to(torch.bfloat16).cuda(), quant.DEFAULT_BLOCK_SIZE, fmt, seed)


@pytest.mark.gpu
def test_blockwise_real_layer_shapes() -> None:
    """Qwen3-8B shapes, BF16, as the update path sees them."""
    gen, seed = fresh_generator()
    for n, k in [(6144, 4096), (4096, 12288)]:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
        check_blockwise(w, quant.DEFAULT_BLOCK_SIZE, "fp32", seed)


# ---------------------------------------------------------------------------------------------------------------------
# per channel


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_channel_random_shapes_several_rows_a_program(dtype: torch.dtype, fmt: str) -> None:
    gen, seed = fresh_generator()
    for _ in range(2):
        n = int(torch.randint(1, 700, (1,), generator=gen))
        k = int(torch.randint(257, 513, (1,), generator=gen))  # one tile of 512 columns, 32 rows a program
        check_per_channel(random_weight(n, k, dtype, gen).cuda(), fmt, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [12288, 16385, 20000], ids=["row-in-registers", "two-pass-edge", "two-pass"])
def test_per_channel_long_rows(k: int, fmt: str) -> None:
    gen, seed = fresh_generator()
    n = int(torch.randint(1, 40, (1,), generator=gen))
    check_per_channel(random_weight(n, k, torch.bfloat16, gen).cuda(), fmt, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_per_channel_row_slices_and_strided_inputs(dtype: torch.dtype) -> None:
    gen, seed = fresh_generator()
    n_total, k = 900, 300
    q_param = poisoned_codes((n_total, k))
    s_param = poisoned_scales((n_total,))
    base = random_weight(2 * n_total, 2 * k, dtype, gen).cuda()
    pieces = [
        ((100, 400), base[:300, 1 : k + 1]),  # wider rows, unaligned start
        ((400, 900), base[::2, ::2][:500, :k]),  # every other row and column
        ((0, 50), base[:k, :50].t()),  # column-major
    ]
    for (r0, r1), w in pieces:
        assert not w.is_contiguous()
        dispatch.quantize_per_channel_into(w, q_param[r0:r1], s_param[r0:r1], "pow2")
    for (r0, r1), w in pieces:
        q_ref, s_ref = quant.quantize_per_channel(w.cpu(), "pow2")
        assert_bits_equal(q_param[r0:r1], q_ref, f"q rows {r0}:{r1}", seed)
        assert_bits_equal(s_param[r0:r1], s_ref, f"scale rows {r0}:{r1}", seed)
    assert bool((q_param[50:100].view(torch.uint8) == POISON_CODE).all()), "rows outside the slices were written"
    assert bool(s_param[50:100].isnan().all())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_per_channel_zero_rows_outliers_and_binades(fmt: str) -> None:
    gen, seed = fresh_generator()
    values = fp8_grid_values()
    w = values[torch.randint(0, len(values), (64, 1000), generator=gen)]
    w[:, 0] = 448.0
    w[10] = 0.0
    w[11] = -0.0
    w[12, 5] = 1e4  # outlier: the rest of row 12 flushes towards zero codes
    w[13] *= 1e-15  # below the amax floor
    w[14:20] *= 1.0009765625
    check_per_channel(w.to(torch.bfloat16).cuda(), fmt, seed)


# ---------------------------------------------------------------------------------------------------------------------
# NaN / Inf


def reference_error(fn, *args) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_blockwise_nonfinite_flag_skips_bad_blocks(dtype: torch.dtype) -> None:
    gen, seed = fresh_generator()
    w = random_weight(300, 500, dtype, gen)
    w[140, 10] = float("nan")  # block (1, 0)
    w[5, 400] = float("-inf")  # block (0, 3)
    if dtype == torch.float32:
        w[290, 300] = 3.4e38  # finite in FP32, Inf once rounded to BF16: block (2, 2)
    bad_blocks = [(1, 0), (0, 3)] + ([(2, 2)] if dtype == torch.float32 else [])
    want_message = reference_error(quant.quantize_blockwise, w)

    q, s = poisoned_codes((300, 500)), poisoned_scales((3, 4))
    flag = dispatch.new_nonfinite_flag("cuda")
    dispatch.quantize_blockwise_into(w.cuda(), q, s, nonfinite_flag=flag)
    assert int(flag.item()) == 1

    clean = w.clone()
    clean[~torch.isfinite(quant.round_to_bf16(w))] = 0.0  # blocks are independent: the good ones are unchanged
    q_ref, s_ref = quant.quantize_blockwise(clean)
    q_cpu, s_cpu = q.cpu().view(torch.uint8), s.cpu()
    for bn in range(3):
        for bk in range(4):
            rows, cols = slice(bn * 128, (bn + 1) * 128), slice(bk * 128, (bk + 1) * 128)
            if (bn, bk) in bad_blocks:
                assert bool((q_cpu[rows, cols] == POISON_CODE).all()), f"bad block {(bn, bk)} was written"
                assert bool(s_cpu[bn, bk].isnan()), f"scale of bad block {(bn, bk)} was written"
            else:
                assert_bits_equal(q_cpu[rows, cols], q_ref[rows, cols].view(torch.uint8), f"block {(bn, bk)}", seed)
                assert_bits_equal(s_cpu[bn, bk], s_ref[bn, bk], f"scale {(bn, bk)}", seed)

    with pytest.raises(ValueError) as info:
        dispatch.check_nonfinite_flag(flag, {"w": w.cuda()})
    assert str(info.value) == want_message

    # default mode: the pre-check raises the reference's message and writes nothing
    q2, s2 = poisoned_codes((300, 500)), poisoned_scales((3, 4))
    with pytest.raises(ValueError) as info:
        dispatch.quantize_blockwise_into(w.cuda(), q2, s2)
    assert str(info.value) == want_message
    assert bool((q2.view(torch.uint8) == POISON_CODE).all()) and bool(s2.isnan().all())


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_precheck_catches_each_kind_of_nonfinite(dtype: torch.dtype, bad: float) -> None:
    """torch.aminmax on CUDA: NaN propagates, +-Inf show up; the error names the reference's position."""
    gen, _ = fresh_generator()
    w = random_weight(257, 300, dtype, gen)
    i, j = int(torch.randint(0, 257, (1,), generator=gen)), int(torch.randint(0, 300, (1,), generator=gen))
    w[i, j] = bad
    want = reference_error(quant.quantize_per_channel, w)
    q, s = poisoned_codes((257, 300)), poisoned_scales((257,))
    with pytest.raises(ValueError) as info:
        dispatch.quantize_per_channel_into(w.cuda(), q, s)
    assert str(info.value) == want
    assert bool((q.view(torch.uint8) == POISON_CODE).all()) and bool(s.isnan().all())


@pytest.mark.gpu
def test_per_channel_nonfinite_flag_skips_bad_rows() -> None:
    gen, seed = fresh_generator()
    for k in (300, 20000):  # one-tile and two-pass kernels
        w = random_weight(70, k, torch.bfloat16, gen)
        w[3, k - 1] = float("inf")
        w[40, 0] = float("nan")
        q, s = poisoned_codes((70, k)), poisoned_scales((70,))
        flag = dispatch.new_nonfinite_flag("cuda")
        dispatch.quantize_per_channel_into(w.cuda(), q, s, nonfinite_flag=flag)
        assert int(flag.item()) == 1
        good = [r for r in range(70) if r not in (3, 40)]
        q_ref, s_ref = quant.quantize_per_channel(w[good])
        assert_bits_equal(q[good], q_ref, f"good rows k={k}", seed)
        assert_bits_equal(s[good], s_ref, f"good scales k={k}", seed)
        assert bool((q[[3, 40]].view(torch.uint8) == POISON_CODE).all()) and bool(s[[3, 40]].isnan().all())


@pytest.mark.gpu
def test_one_flag_slot_per_tensor_names_the_tensor() -> None:
    gen, _ = fresh_generator()
    weights = {name: random_weight(200, 260, torch.bfloat16, gen).cuda() for name in ("qkv", "o_proj", "down")}
    weights["o_proj"][199, 3] = float("nan")
    flags = torch.zeros(len(weights), dtype=torch.int32, device="cuda")
    for slot, w in enumerate(weights.values()):
        dispatch.quantize_blockwise_into(w, poisoned_codes((200, 260)), poisoned_scales((2, 3)),
                                         nonfinite_flag=flags[slot : slot + 1])
    assert flags.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match=r"o_proj\[199, 3\] is nan"):
        dispatch.check_nonfinite_flag(flags, weights)
    dispatch.check_nonfinite_flag(torch.zeros(3, dtype=torch.int32, device="cuda"), weights)


# ---------------------------------------------------------------------------------------------------------------------
# plumbing


@pytest.mark.gpu
def test_cpu_input_into_cuda_outputs() -> None:
    gen, seed = fresh_generator()
    w = random_weight(150, 260, torch.float32, gen)  # stays on the CPU: moved like the reference does
    check_blockwise(w, quant.DEFAULT_BLOCK_SIZE, "fp32", seed)
    check_per_channel(w, "pow2", seed)


@pytest.mark.gpu
def test_validation_errors_match_the_reference_on_cuda() -> None:
    w = torch.randn(130, 200, dtype=torch.bfloat16, device="cuda")
    good_q, good_s = poisoned_codes((130, 200)), poisoned_scales((2, 2))
    cases = [
        (poisoned_codes((130, 201)), good_s, "fp32"),
        (torch.empty(130, 200, device="cuda", dtype=torch.bfloat16), good_s, "fp32"),
        (good_q, poisoned_scales((2, 1)), "fp32"),
        (good_q, good_s.double(), "fp32"),
        (good_q, good_s, "fp16"),
    ]
    for q, s, fmt in cases:
        with pytest.raises(ValueError) as want:
            quant.quantize_blockwise_into(w, q, s, scale_format=fmt)
        with pytest.raises(ValueError) as got:
            dispatch.quantize_blockwise_into(w, q, s, scale_format=fmt)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="nonfinite_flag"):
        dispatch.quantize_blockwise_into(w, good_q, good_s, nonfinite_flag=torch.zeros(1, device="cuda"))
    assert bool((good_q.view(torch.uint8) == POISON_CODE).all()) and bool(good_s.isnan().all())


@triton.jit
def _division_mismatch_kernel(out_ptr, S_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    """Count pairs where the kernel's quotient differs from div.rn: all 128 BF16 significands x S_BLOCK scales."""
    mantissa = tl.program_id(0) * S_BLOCK + tl.arange(0, S_BLOCK)
    scale = (mantissa | 0x3F800000).to(tl.float32, bitcast=True)[None, :]  # every float32 significand in [1, 2)
    x = ((tl.arange(0, 128) << 16) | 0x3F800000).to(tl.float32, bitcast=True)[:, None]  # every BF16 one in [1, 2)
    want = tl.math.div_rn(x, scale)
    got = triton_quant._clamped_quotient(x, scale, triton_quant._reciprocal(scale), FP8_MAX)
    differ = want.to(tl.int32, bitcast=True) != got.to(tl.int32, bitcast=True)
    tl.atomic_add(out_ptr, tl.sum(differ.to(tl.int32)))


@pytest.mark.gpu
def test_reciprocal_division_is_correctly_rounded_for_every_bf16_input() -> None:
    """Exhaustive: x * RN(1/s) + one FMA correction == RN(x / s) for all 2**7 x 2**23 significand pairs.

    Correct rounding of a normal quotient depends only on the significands (every step scales by powers of two
    and stays normal for the quotients that encode to a non-zero FP8 value), so this covers every BF16 weight and
    every float32 scale_inv; both quotient binades occur (x < s and x >= s).
    """
    s_block = 1024
    mismatches = torch.zeros(1, dtype=torch.int32, device="cuda")
    _division_mismatch_kernel[(2**23 // s_block,)](mismatches, S_BLOCK=s_block, FP8_MAX=quant.FP8_MAX, num_warps=8)
    assert int(mismatches.item()) == 0


@pytest.mark.gpu
def test_ptx_uses_correctly_rounded_division_and_conversions() -> None:
    """div.rn and fma.rn (not Triton's approximate '/'), RNE to BF16, RNE-saturating to E4M3."""
    w = torch.randn(256, 256, device="cuda")
    q, s = poisoned_codes((256, 256)), poisoned_scales((2, 2))
    for kernel in (
        triton_quant.quantize_blockwise_launch(w, q, s, quant.DEFAULT_BLOCK_SIZE, True),
        triton_quant.quantize_per_channel_launch(w, q, poisoned_scales((256,)), False),
    ):
        ptx = kernel.asm["ptx"]
        assert "div.rn.f32" in ptx and "fma.rn.f32" in ptx
        assert "div.full.f32" not in ptx and "div.approx" not in ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert "cvt.rn.bf16" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp32", "pow2"])
def test_reference_is_device_independent(fmt):
    """quant.py on CUDA gives the same bits as on CPU (torch rewrites `tensor / python_float` as a reciprocal
    multiplication on CUDA; the reference divides by a tensor to keep true division)."""
    w = torch.randn(1000, 700, dtype=torch.bfloat16) * 3
    q_cpu, s_cpu = quant.quantize_blockwise(w, scale_format=fmt)
    q_gpu, s_gpu = quant.quantize_blockwise(w.cuda(), scale_format=fmt)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)
    q_cpu, s_cpu = quant.quantize_per_channel(w, scale_format=fmt)
    q_gpu, s_gpu = quant.quantize_per_channel(w.cuda(), scale_format=fmt)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)
