"""One-pass Triton FP8 (E4M3) weight quantizers, bit-identical to :mod:`sglang_fp8rl.quant`.

Two kernels, both reading the input once from device memory and writing FP8 codes and float32 dequantization
multipliers straight into the destination (row slices of a larger parameter included):

* blockwise: one program per (bn, bk) weight block, the whole block held in registers;
* per output channel: one program per group of rows; a row that fits the tile (K <= 16384) is held in registers,
  a longer one is read twice (the second read is served by L2).

How each rounding rule of ``quant.py`` is reproduced (see docs/quantizer_kernel.md):

* input -> BF16: ``cvt.rn`` (round to nearest even), like ``torch.Tensor.to(torch.bfloat16)``; FP16 goes
  through FP32 first, which is exact, as torch does;
* amax: an integer max over the bits of ``|x|`` (for non-negative floats integer order is float order); it is
  exact, needs no NaN convention, and a result ``>= 0x7F800000`` means the group holds an Inf or NaN;
* ``amax / 448`` uses ``tl.math.div_rn`` (``div.rn.f32``): Triton's ``/`` on float32 lowers to an approximate
  division and would differ from torch in the last bit. ``x / scale_inv`` is the correctly rounded quotient too,
  computed as ``x * RN(1/scale_inv)`` plus one FMA correction (see :func:`_clamped_quotient`; proven exact for
  BF16 inputs by an exhaustive GPU test), which costs half the instructions of a ``div.rn`` per element;
* ``pow2``: the power-of-two ceiling is taken on the float32 bits (round the exponent up when any mantissa bit
  is set); the scale is always a positive normal number since ``amax >= 1e-10``;
* FP32 -> E4M3 after the explicit clamp: ``fp_downcast_rounding="rtne"``, i.e. ``cvt.rn.satfinite.e4m3x2.f32``
  on sm89+, the same RNE as torch's software conversion.

A group (block or row) that holds a NaN/Inf writes nothing, neither codes nor scale; with ``USE_FLAG`` it also
stores 1 into an int32 flag in device memory, which the caller checks once per weight update.

These launchers do no validation: :mod:`sglang_fp8rl.kernels.dispatch` validates and calls them.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
import triton
import triton.language as tl

from sglang_fp8rl.quant import AMAX_FLOOR, DEFAULT_BLOCK_SIZE, FP8_MAX, ceil_div

TILE_ELEMS = 16384  # elements a program holds: one 128x128 block, 128 values a thread at 4 warps
MAX_TILE_ELEMS = 32768  # largest blockwise tile accepted (other block sizes use the torch reference)
ROW_CHUNK = 4096  # per-channel chunk along K when a row does not fit TILE_ELEMS


def _float32_bits(value: float) -> int:
    """Bit pattern of ``value`` rounded to float32 (nearest even, as torch's scalar conversion)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


# quant.py's constants reach the kernels as defaults of constexpr parameters rather than as globals read in the
# kernel body: Triton re-checks every such global on each launch, which is host time. The IEEE-754 bit masks in
# the kernels are literals: 0x7FFFFFFF (|x|), 0x7F800000 (exponent; also the bits of +Inf, so |x| bits >= it <=>
# Inf or NaN), 0x007FFFFF (mantissa), 0x00800000 (one exponent step).
_AMAX_FLOOR_BITS = _float32_bits(AMAX_FLOOR)


# ---------------------------------------------------------------------------------------------------------------------
# device primitives


@triton.jit
def _load_bf16(ptrs, mask, ROUND_TO_BF16: tl.constexpr):
    """Load and round to BF16 (RNE); masked lanes read 0.0, which never raises an abs-max.

    The tile stays BF16 until the amax is known, so fewer registers are live across the reduction (at 4 warps,
    12 registers spilled instead of 24 with a float32 tile).
    """
    x = tl.load(ptrs, mask=mask, other=0.0)
    if ROUND_TO_BF16:
        x = x.to(tl.float32).to(tl.bfloat16, fp_downcast_rounding="rtne")
    return x


@triton.jit
def _abs_bits(x):
    """Bits of |x| (BF16) in the high half of an int32, i.e. the float32 bits of |x|: ordered like the floats,
    NaN above Inf."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) << 16


@triton.jit
def _scale_from_amax_bits(amax_bits, FP8_MAX: tl.constexpr, AMAX_FLOOR_BITS: tl.constexpr, POW2: tl.constexpr):
    """quant.scale_from_amax on amax bits: max(amax, 1e-10) / 448, or its power-of-two ceiling."""
    amax = tl.maximum(amax_bits, AMAX_FLOOR_BITS).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, FP8_MAX)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exp_bits = bits & 0x7F800000
        exp_bits = tl.where((bits & 0x007FFFFF) != 0, exp_bits + 0x00800000, exp_bits)
        scale = exp_bits.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _reciprocal(scale):
    """RN(1 / scale), once per block or row: the per-element division becomes a multiply and two FMAs."""
    return tl.math.div_rn(1.0, scale)


@triton.jit
def _clamped_quotient(x, scale, rcp, FP8_MAX: tl.constexpr):
    """clamp(x / scale, -448, 448) with x / scale correctly rounded, as quant.cast_to_fp8 computes it.

    ``q0 = x * rcp`` is within a couple of ulps; one FMA correction (Markstein) with the exact residual
    ``x - q0 * scale`` rounds it correctly. That holds for every BF16 ``x`` and float32 ``scale`` whose quotient is
    a normal float32 (x below 2**-96 lifted by 2**64 first, so that the residual stays a normal float32): tests/gpu
    checks all 2**30 pairs of significands exhaustively. Smaller quotients (< 2**-126)
    encode as a signed FP8 zero either way; the correction can lose the sign of a zero, so x's sign is put back.
    ``tl.math.div_rn`` per element gives the same bits at about twice the instructions (Triton's ``/`` on float32
    is an approximate division and would not).
    """
    # |x| < 2**-96 (a block far below the amax floor): the residual would be subnormal and lose the bits the
    # correction needs, so x is lifted by 2**64 and the quotient scaled back, both exact (literals: no global lookup)
    tiny = tl.abs(x) < 1.262177448353619e-29
    xs = tl.where(tiny, x * 18446744073709551616.0, x)
    q0 = xs * rcp
    q = tl.where(tiny, 5.421010862427522e-20, 1.0) * tl.fma(tl.fma(-q0, scale, xs), rcp, q0)
    x_bits = x.to(tl.int32, bitcast=True)
    sign = x_bits ^ (x_bits & 0x7FFFFFFF)
    q = ((q.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
    return tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)


@triton.jit
def _quantize_block(x, FP8_MAX: tl.constexpr, AMAX_FLOOR_BITS: tl.constexpr, POW2: tl.constexpr):
    """A whole block held in registers: its clamped quotients (float32, still to be cast), its scale, and whether
    it is finite (a block holding a NaN/Inf writes nothing)."""
    amax_bits = tl.max(_abs_bits(x))
    scale = _scale_from_amax_bits(amax_bits, FP8_MAX, AMAX_FLOOR_BITS, POW2)
    y = _clamped_quotient(x.to(tl.float32), scale, _reciprocal(scale), FP8_MAX)
    return y, scale, amax_bits < 0x7F800000


@triton.jit
def _store_codes(ptrs, y, mask):
    """Store ``y`` cast (RNE) to the destination's element type: FP8 codes, or the quotient itself for float32."""
    tl.store(ptrs, y.to(ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _tile_mask(r, c, rows_left, cols_left, MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """In-bounds mask of a tile. A dimension known to be full contributes a constant, so that the compiler still
    sees masks constant along K and keeps 16-byte loads and stores (a runtime column mask would split them)."""
    if MASK_N:
        row_ok = r < rows_left
    else:
        row_ok = tl.full(r.shape, 1, tl.int1)
    if MASK_K:
        col_ok = c < cols_left
    else:
        col_ok = tl.full(c.shape, 1, tl.int1)
    return row_ok[:, None] & col_ok[None, :]


@triton.jit
def _tile_offsets(r, c, stride_r, stride_c, WIDE_INDEX: tl.constexpr):
    """Element offsets inside a tile: 32-bit unless the tile spans 2**31 elements (huge strides)."""
    if WIDE_INDEX:
        return r.to(tl.int64)[:, None] * stride_r + c.to(tl.int64)[None, :] * stride_c
    else:
        return r[:, None] * stride_r + c[None, :] * stride_c


# ---------------------------------------------------------------------------------------------------------------------
# kernels


# Triton compiles one variant per "integer is 1 / divisible by 16" pattern of its integer arguments; that matters
# for the K extent and the row strides (vectorized, aligned rows) and not for the rest, which are left generic
# (fewer compiles).
@triton.jit(do_not_specialize=["n_rows", "s_stride_r", "s_stride_c"])
def _blockwise_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    flag_ptr,
    n_rows,
    n_cols,
    w_stride_r,
    w_stride_c,
    q_stride_r,
    q_stride_c,
    s_stride_r,
    s_stride_c,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_K: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
    POW2: tl.constexpr,
    USE_FLAG: tl.constexpr,
    FP8_MAX: tl.constexpr = FP8_MAX,
    AMAX_FLOOR_BITS: tl.constexpr = _AMAX_FLOOR_BITS,
):
    """One (BLOCK_N, BLOCK_K) weight block: load once, amax, scale, write codes and its scale."""
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_K)
    bn = pid // n_col_blocks
    bk = pid - bn * n_col_blocks
    # the tile's origin in 64 bits (a row slice of a large parameter can start past 2**31 elements)
    row0 = bn.to(tl.int64) * BLOCK_N
    col0 = bk.to(tl.int64) * BLOCK_K
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    mask = _tile_mask(r, c, n_rows - bn * BLOCK_N, n_cols - bk * BLOCK_K, MASK_N, MASK_K)
    w_tile = w_ptr + row0 * w_stride_r + col0 * w_stride_c
    x = _load_bf16(w_tile + _tile_offsets(r, c, w_stride_r, w_stride_c, WIDE_INDEX), mask, ROUND_TO_BF16)
    y, scale, finite = _quantize_block(x, FP8_MAX, AMAX_FLOOR_BITS, POW2)
    q_tile = q_ptr + row0 * q_stride_r + col0 * q_stride_c
    _store_codes(q_tile + _tile_offsets(r, c, q_stride_r, q_stride_c, WIDE_INDEX), y, mask & finite)
    tl.store(s_ptr + bn.to(tl.int64) * s_stride_r + bk.to(tl.int64) * s_stride_c, scale, mask=finite)
    if USE_FLAG:
        # a plain store, not an atomic: every writer writes the same 1
        tl.store(flag_ptr, 1, mask=finite == 0)


@triton.jit(do_not_specialize=["n_rows", "s_stride"])
def _per_channel_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    flag_ptr,
    n_rows,
    n_cols,
    w_stride_r,
    w_stride_c,
    q_stride_r,
    q_stride_c,
    s_stride,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_K: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
    POW2: tl.constexpr,
    USE_FLAG: tl.constexpr,
    FP8_MAX: tl.constexpr = FP8_MAX,
    AMAX_FLOOR_BITS: tl.constexpr = _AMAX_FLOOR_BITS,
):
    """BLOCK_N output rows: amax over each row, then codes; rows longer than BLOCK_K are read twice."""
    pid = tl.program_id(0)
    row0 = pid.to(tl.int64) * BLOCK_N
    rows_left = n_rows - pid * BLOCK_N
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + row0 * w_stride_r
    q_rows = q_ptr + row0 * q_stride_r
    if ONE_TILE:
        mask = _tile_mask(r, c, rows_left, n_cols, MASK_N, MASK_K)
        x = _load_bf16(w_rows + _tile_offsets(r, c, w_stride_r, w_stride_c, WIDE_INDEX), mask, ROUND_TO_BF16)
        amax_bits = tl.max(_abs_bits(x), axis=1)
        finite = amax_bits < 0x7F800000
        scale = _scale_from_amax_bits(amax_bits, FP8_MAX, AMAX_FLOOR_BITS, POW2)
        y = _clamped_quotient(x.to(tl.float32), scale[:, None], _reciprocal(scale)[:, None], FP8_MAX)
        _store_codes(q_rows + _tile_offsets(r, c, q_stride_r, q_stride_c, WIDE_INDEX), y, mask & finite[:, None])
    else:
        amax_bits = tl.zeros([BLOCK_N], dtype=tl.int32)
        for k0 in range(0, n_cols, BLOCK_K):
            mask = _tile_mask(r, c, rows_left, n_cols - k0, MASK_N, MASK_K)
            offs = _tile_offsets(r, c, w_stride_r, w_stride_c, WIDE_INDEX)
            x = _load_bf16(w_rows + tl.cast(k0, tl.int64) * w_stride_c + offs, mask, ROUND_TO_BF16)
            amax_bits = tl.maximum(amax_bits, tl.max(_abs_bits(x), axis=1))
        finite = amax_bits < 0x7F800000
        scale = _scale_from_amax_bits(amax_bits, FP8_MAX, AMAX_FLOOR_BITS, POW2)
        rcp = _reciprocal(scale)
        for k0 in range(0, n_cols, BLOCK_K):
            mask = _tile_mask(r, c, rows_left, n_cols - k0, MASK_N, MASK_K)
            offs = _tile_offsets(r, c, w_stride_r, w_stride_c, WIDE_INDEX)
            x = _load_bf16(w_rows + tl.cast(k0, tl.int64) * w_stride_c + offs, mask, ROUND_TO_BF16)
            y = _clamped_quotient(x.to(tl.float32), scale[:, None], rcp[:, None], FP8_MAX)
            q_offs = _tile_offsets(r, c, q_stride_r, q_stride_c, WIDE_INDEX)
            _store_codes(q_rows + tl.cast(k0, tl.int64) * q_stride_c + q_offs, y, mask & finite[:, None])
    row_ok = r < rows_left
    tl.store(s_ptr + (row0 + r) * s_stride, scale, mask=row_ok & finite)
    if USE_FLAG:
        any_bad = tl.max((row_ok & (amax_bits >= 0x7F800000)).to(tl.int32))
        tl.store(flag_ptr, 1, mask=any_bad > 0)


# ---------------------------------------------------------------------------------------------------------------------
# host side: tile choice and launch (no validation here)


def _num_warps(tile_elems: int) -> int:
    """4 warps for a 16K-element tile (128 values a thread): one warp per 4096 elements, at most 8.

    Occupancy, not instruction count, decides here: at 4 warps a program uses ~255 registers a thread and two
    programs share an SM, one loading while the other computes and stores. At 8 or 16 warps the register file
    holds one program an SM and the loads stall (H100, whole Qwen3-8B model, BF16: 96% of copy bandwidth at 4
    warps, 72% at 8, 70% at 16; 8 warps capped at 128 registers: 89%).
    """
    return max(1, min(8, tile_elems // 4096))


def _wide_index(tile: tuple[int, int], *tensors: torch.Tensor) -> bool:
    """Whether offsets inside a tile can pass 2**31 elements (only for huge strides): then they are 64-bit."""
    return any((tile[0] - 1) * t.stride(0) + (tile[1] - 1) * t.stride(1) >= 2**31 for t in tensors)


def supports_block_size(block_size: object) -> bool:
    """True for two powers of two whose tile fits the kernel; anything else goes to the torch reference."""
    if block_size == DEFAULT_BLOCK_SIZE:  # the common case, decided without the checks below
        return True
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        return False
    if not all(isinstance(b, int) and b >= 1 and b & (b - 1) == 0 for b in block_size):
        return False
    return 128 <= block_size[0] * block_size[1] <= MAX_TILE_ELEMS


def quantize_blockwise_launch(
    x: torch.Tensor,
    q_out: torch.Tensor,
    scale_out: torch.Tensor,
    block_size: tuple[int, int],
    pow2: bool,
    flag: torch.Tensor | None = None,
) -> Any:
    """Launch the blockwise kernel on validated CUDA tensors; returns Triton's compiled kernel (or None if empty)."""
    n, k = x.shape
    bn, bk = block_size
    grid = (ceil_div(n, bn) * ceil_div(k, bk),)
    if grid[0] == 0:
        return None
    return _blockwise_kernel[grid](
        x,
        q_out,
        scale_out,
        scale_out if flag is None else flag,  # never dereferenced without USE_FLAG
        n,
        k,
        x.stride(0),
        x.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        scale_out.stride(0),
        scale_out.stride(1),
        BLOCK_N=bn,
        BLOCK_K=bk,
        MASK_N=n % bn != 0,
        MASK_K=k % bk != 0,
        WIDE_INDEX=_wide_index((bn, bk), x, q_out),
        ROUND_TO_BF16=x.dtype != torch.bfloat16,
        POW2=pow2,
        USE_FLAG=flag is not None,
        num_warps=_num_warps(bn * bk),
    )


def per_channel_tile(n: int, k: int) -> tuple[int, int, bool]:
    """(BLOCK_N, BLOCK_K, ONE_TILE): whole rows in one tile when they fit, else ROW_CHUNK columns at a time."""
    k_pow2 = triton.next_power_of_2(max(k, 1))
    if k_pow2 > TILE_ELEMS:
        return max(1, TILE_ELEMS // ROW_CHUNK), ROW_CHUNK, False
    rows = min(triton.next_power_of_2(max(n, 1)), max(1, TILE_ELEMS // k_pow2))
    return rows, k_pow2, True


def quantize_per_channel_launch(
    x: torch.Tensor,
    q_out: torch.Tensor,
    scale_out: torch.Tensor,
    pow2: bool,
    flag: torch.Tensor | None = None,
) -> Any:
    """Launch the per-channel kernel on validated CUDA tensors; returns Triton's compiled kernel (or None if empty)."""
    n, k = x.shape
    block_n, block_k, one_tile = per_channel_tile(n, k)
    grid = (ceil_div(n, block_n),)
    if grid[0] == 0 or k == 0:
        return None
    return _per_channel_kernel[grid](
        x,
        q_out,
        scale_out,
        scale_out if flag is None else flag,
        n,
        k,
        x.stride(0),
        x.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        scale_out.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ONE_TILE=one_tile,
        MASK_N=n % block_n != 0,
        MASK_K=k % block_k != 0,
        WIDE_INDEX=_wide_index((block_n, block_k), x, q_out),
        ROUND_TO_BF16=x.dtype != torch.bfloat16,
        POW2=pow2,
        USE_FLAG=flag is not None,
        num_warps=_num_warps(block_n * block_k),
    )
