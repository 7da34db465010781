"""The blockwise quantizer of :mod:`triton_quant` over many tensors in one launch (a weight update's bucket).

A weight update writes hundreds of tensors; launched one by one, the host time per launch (argument binding,
slicing, checks) is most of the update, not the GPU's. Here a table holds one row per tensor (addresses, extents,
row strides) and program (i, t) quantizes block i of tensor t with the same device primitives as the one-tensor
kernel, so every tensor's codes and scales are bit-identical to a launch of its own.

The kernel assumes what :func:`cannot_group` checks on the host: full blocks, unit column strides, aligned rows,
32-bit offsets inside a tile. The dispatcher sends everything else through the one-tensor kernel. These launchers
do no validation: :mod:`sglang_fp8rl.kernels.dispatch` validates and calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_fp8rl.kernels.triton_quant import (
    _AMAX_FLOOR_BITS,
    _load_bf16,
    _num_warps,
    _quantize_block,
    _store_codes,
    _tile_mask,
    supports_block_size,
)
from sglang_fp8rl.quant import FP8_DTYPE, FP8_MAX

# one table row per tensor, int64: input, codes and scale addresses, then rows, columns and the three row strides
TABLE_COLUMNS = 8
# element types reach the kernel as constexpr codes (the table holds plain addresses)
INPUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
OUTPUT_KINDS = {FP8_DTYPE: 0, torch.float32: 1}  # float32: the unrounded quotient, for the interpreter tests
# what the kernel promises the compiler (tl.multiple_of), so that it reads and writes 16-byte vectors
ALIGN_BYTES = 16  # of the input and codes addresses
STRIDE_MULTIPLE = 16  # of their row strides, in elements
# tensors per launch: grid y is the tensor index, and CUDA allows at most 2**16 - 1 there
MAX_TENSORS_PER_LAUNCH = 65_535


@triton.jit
def _grouped_blockwise_kernel(
    table_ptr,
    flag_ptr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    POW2: tl.constexpr,
    USE_FLAG: tl.constexpr,
    FP8_MAX: tl.constexpr = FP8_MAX,
    AMAX_FLOOR_BITS: tl.constexpr = _AMAX_FLOOR_BITS,
    COLUMNS: tl.constexpr = TABLE_COLUMNS,
):
    """Block ``program_id(0)`` of tensor ``program_id(1)``; programs past a tensor's last block return at once."""
    pid = tl.program_id(0)
    entry = table_ptr + tl.program_id(1) * COLUMNS
    n_col_blocks = tl.load(entry + 4) // BLOCK_K
    if pid >= (tl.load(entry + 3) // BLOCK_N) * n_col_blocks:
        return
    bn = pid // n_col_blocks
    bk = pid - bn * n_col_blocks
    w_row_stride, q_row_stride = tl.load(entry + 5), tl.load(entry + 6)  # int64: tile origins
    # the host guarantees 16-byte aligned rows and that offsets inside a tile fit 32 bits
    w_stride = tl.multiple_of(w_row_stride.to(tl.int32), 16)
    q_stride = tl.multiple_of(q_row_stride.to(tl.int32), 16)
    # typed pointers from the table's addresses, cast here in the kernel's body: the alignment hint holds only on a
    # pointer (one given to the integer is lost in the cast), and not on one returned by a helper function
    if IN_KIND == 0:
        w_ptr = tl.load(entry).to(tl.pointer_type(tl.bfloat16))
    elif IN_KIND == 1:
        w_ptr = tl.load(entry).to(tl.pointer_type(tl.float16))
    else:
        w_ptr = tl.load(entry).to(tl.pointer_type(tl.float32))
    if OUT_KIND == 0:
        q_ptr = tl.load(entry + 1).to(tl.pointer_type(tl.float8e4nv))
    else:
        q_ptr = tl.load(entry + 1).to(tl.pointer_type(tl.float32))
    w_ptr = tl.multiple_of(w_ptr, 16)
    q_ptr = tl.multiple_of(q_ptr, 16)
    s_ptr = tl.load(entry + 2).to(tl.pointer_type(tl.float32))
    row0 = bn * BLOCK_N  # int64: a tile can start past 2**31 elements
    col0 = bk * BLOCK_K
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    mask = _tile_mask(r, c, BLOCK_N, BLOCK_K, False, False)
    w_tile = w_ptr + row0 * w_row_stride + col0
    x = _load_bf16(w_tile + (r[:, None] * w_stride + c[None, :]), mask, IN_KIND != 0)
    y, scale, finite = _quantize_block(x, FP8_MAX, AMAX_FLOOR_BITS, POW2)
    q_tile = q_ptr + row0 * q_row_stride + col0
    _store_codes(q_tile + (r[:, None] * q_stride + c[None, :]), y, mask & finite)
    tl.store(s_ptr + bn * tl.load(entry + 7) + bk, scale, mask=finite)
    if USE_FLAG:
        tl.store(flag_ptr, 1, mask=finite == 0)  # every writer writes the same 1


# ---------------------------------------------------------------------------------------------------------------------
# host side


def cannot_group(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor,
                 block_size: tuple[int, int]) -> Optional[str]:
    """Why this (input, codes, scale) triple cannot go through the grouped kernel, or None if it can."""
    if w.dtype not in INPUT_KINDS or q_out.dtype not in OUTPUT_KINDS or scale_out.dtype != torch.float32:
        return f"dtypes {w.dtype} -> {q_out.dtype} / {scale_out.dtype}"
    if not supports_block_size(block_size):
        return f"block size {block_size}"
    if w.dim() != 2 or q_out.shape != w.shape or scale_out.dim() != 2:
        return "not 2-D tensors of one shape"
    (bn, bk), (n, k) = block_size, w.shape
    if n == 0 or k == 0 or n % bn or k % bk:
        return f"shape {tuple(w.shape)} is not whole {bn}x{bk} blocks"
    if tuple(scale_out.shape) != (n // bn, k // bk):
        return f"scale shape {tuple(scale_out.shape)}"
    if w.stride(1) != 1 or q_out.stride(1) != 1 or scale_out.stride(1) != 1:
        return "column stride is not 1"
    for t in (w, q_out):
        if t.data_ptr() % ALIGN_BYTES or t.stride(0) % STRIDE_MULTIPLE:
            return "rows not aligned"
        if (bn - 1) * t.stride(0) + bk >= 2**31:
            return "tile offsets need 64 bits"
    if not (w.is_cuda and w.device == q_out.device == scale_out.device):
        return "tensors not on one CUDA device"
    return None


def _table_row(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> list[int]:
    return [w.data_ptr(), q_out.data_ptr(), scale_out.data_ptr(), w.shape[0], w.shape[1], w.stride(0),
            q_out.stride(0), scale_out.stride(0)]


def quantize_blockwise_grouped_launch(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    block_size: tuple[int, int],
    pow2: bool,
    flag: Optional[torch.Tensor] = None,
    max_tensors: int = MAX_TENSORS_PER_LAUNCH,
) -> int:
    """Launches over ``items`` (input, codes, scale), all of one input and one output dtype, each accepted by
    :func:`cannot_group`, at most ``max_tensors`` per launch; returns the launches made. The caller keeps the inputs
    alive until the launches have run (stream order)."""
    if max_tensors < 1:
        raise ValueError(f"max_tensors must be at least 1, got {max_tensors}")
    # every chunk fits the grid, so no launch fails on its size after earlier chunks were written
    for start in range(0, len(items), max_tensors):
        _launch(items[start:start + max_tensors], block_size, pow2, flag)
    return -(-len(items) // max_tensors)


def _launch(items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block_size: tuple[int, int],
            pow2: bool, flag: Optional[torch.Tensor]) -> None:
    """One launch over at most MAX_TENSORS_PER_LAUNCH items (grid y: one program column per tensor)."""
    w0, q0, s0 = items[0]
    bn, bk = block_size
    table = torch.tensor([_table_row(*item) for item in items], dtype=torch.int64).to(w0.device)
    max_blocks = max((w.shape[0] // bn) * (w.shape[1] // bk) for w, _, _ in items)
    _grouped_blockwise_kernel[(max_blocks, len(items))](
        table,
        s0 if flag is None else flag,  # never dereferenced without USE_FLAG
        IN_KIND=INPUT_KINDS[w0.dtype],
        OUT_KIND=OUTPUT_KINDS[q0.dtype],
        BLOCK_N=bn,
        BLOCK_K=bk,
        POW2=pow2,
        USE_FLAG=flag is not None,
        num_warps=_num_warps(bn * bk),
    )
