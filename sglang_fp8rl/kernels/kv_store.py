"""One Triton launch that writes a batch's K and V into an FP8 (E4M3) KV cache with calibrated scales.

SGLang's write with scale tensors is a chain of elementwise kernels per layer and step: divide K, divide V (in place),
cast both to E4M3, scatter both rows into the cache; with calibrated scales this package adds a clamp to +-448 to each
(an overflowing E4M3 cast gives NaN on CUDA). This kernel does it all in one pass over K and V, bit for bit, for the
power-of-two scales of the ``pow2`` policy (kv_scales/numerics.py):

* ``x / scale`` is computed in float32 (``div.rn``) and rounded to BF16, as torch's in-place ``bf16.div_(scale)``
  does; with a power-of-two scale the quotient is exact, so the order of roundings cannot matter;
* clamped to +-448 (NaN kept), then cast to E4M3 with round-to-nearest-even, like torch's cast.

Unlike SGLang's write it leaves K and V unchanged: Triton decode does not read them after the write, and Triton
extend passes clones. The launcher does no validation beyond :func:`cannot_store`, which the caller asks first.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_fp8rl.quant import FP8_MAX

MAX_ROW = 16384  # K or V elements per token held in registers by one program
# the CUDA-graph padding slot: padded tokens of a captured batch write there; SGLang's store_cache skips it
# (kernels/ops/kvcache/kvcache.py, reserved_skip_index=0), and so does this kernel, so both leave the same bytes
RESERVED_SLOT = 0


@triton.jit
def _store_row(src, src_token_stride, src_head_stride, dst, dst_row_stride, token, slot, scale,
               HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
               SKIP_SLOT: tl.constexpr):
    """One token's row (heads x head_dim) of K or V: scaled, saturated, cast, stored at cache row ``slot``."""
    idx = tl.arange(0, BLOCK)
    mask = (idx < ROW) & (slot != SKIP_SLOT)
    x = tl.load(src + token * src_token_stride + (idx // HEAD_DIM) * src_head_stride + idx % HEAD_DIM,
                mask=mask, other=0.0)
    q = tl.math.div_rn(x.to(tl.float32), scale).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(dst + slot * dst_row_stride + idx, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit(do_not_specialize=["k_token_stride", "k_head_stride", "v_token_stride", "v_head_stride",
                               "k_row_stride", "v_row_stride"])
def _scaled_store_kernel(k, v, k_scale, v_scale, k_cache, v_cache, loc,
                         k_token_stride, k_head_stride, v_token_stride, v_head_stride, k_row_stride, v_row_stride,
                         K_HEAD_DIM: tl.constexpr, K_ROW: tl.constexpr, K_BLOCK: tl.constexpr,
                         V_HEAD_DIM: tl.constexpr, V_ROW: tl.constexpr, V_BLOCK: tl.constexpr,
                         FP8_MAX: tl.constexpr, SKIP_SLOT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc + token).to(tl.int64)
    _store_row(k, k_token_stride, k_head_stride, k_cache, k_row_stride, token, slot, tl.load(k_scale),
               K_HEAD_DIM, K_ROW, K_BLOCK, FP8_MAX, SKIP_SLOT)
    _store_row(v, v_token_stride, v_head_stride, v_cache, v_row_stride, token, slot, tl.load(v_scale),
               V_HEAD_DIM, V_ROW, V_BLOCK, FP8_MAX, SKIP_SLOT)


def _cannot_store_one(name: str, x: torch.Tensor, cache: torch.Tensor, scale: object) -> Optional[str]:
    if x.dim() != 3 or x.dtype != torch.bfloat16 or x.stride(2) != 1:
        return f"{name}: needs a BF16 [tokens, heads, head_dim] tensor with unit stride in head_dim"
    if cache.dim() != 3 or cache.shape[1:] != x.shape[1:] or cache.stride(2) != 1 or cache.stride(1) != x.shape[2]:
        return f"{name} cache: needs rows of [heads, head_dim] laid out contiguously, matching {name}"
    if cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        return f"{name} cache: dtype {cache.dtype} is not E4M3 storage"
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        return f"{name} scale: needs a one-element float32 tensor"
    if x.shape[1] * x.shape[2] > MAX_ROW:
        return f"{name}: {x.shape[1] * x.shape[2]} elements per token exceed {MAX_ROW}"
    return None


def cannot_store(k: torch.Tensor, v: torch.Tensor, k_scale: object, v_scale: object, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, loc: torch.Tensor) -> Optional[str]:
    """Why :func:`store_scaled_fp8` cannot write these tensors (None when it can)."""
    tensors = (k, v, k_cache, v_cache, loc) + tuple(s for s in (k_scale, v_scale) if isinstance(s, torch.Tensor))
    if any(t.device.type != "cuda" or t.device != k.device for t in tensors):
        return "needs every tensor on the same CUDA device"
    if loc.dim() != 1 or loc.numel() != k.shape[0] or loc.dtype not in (torch.int32, torch.int64):
        return "needs one int32/int64 cache slot per token"
    if v.shape[0] != k.shape[0]:
        return "K and V hold different numbers of tokens"
    return _cannot_store_one("K", k, k_cache, k_scale) or _cannot_store_one("V", v, v_cache, v_scale)


def store_scaled_fp8(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor) -> None:
    """``k_cache[loc] = e4m3(clamp(k / k_scale))`` and the same for V, in one launch (see the module docstring);
    tokens bound for :data:`RESERVED_SLOT` are not written."""
    if k.shape[0] == 0:
        return
    k_cache8, v_cache8 = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
    k_row, v_row = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
    _scaled_store_kernel[(k.shape[0],)](
        k, v, k_scale, v_scale, k_cache8, v_cache8, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache8.stride(0), v_cache8.stride(0),
        K_HEAD_DIM=k.shape[2], K_ROW=k_row, K_BLOCK=triton.next_power_of_2(k_row),
        V_HEAD_DIM=v.shape[2], V_ROW=v_row, V_BLOCK=triton.next_power_of_2(v_row),
        FP8_MAX=FP8_MAX, SKIP_SLOT=RESERVED_SLOT, num_warps=4,
    )
