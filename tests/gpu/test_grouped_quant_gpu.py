"""The grouped blockwise quantizer on the GPU: one launch over a bucket of tensors gives the bytes of one launch per
tensor (codes and scales, BF16 and FP32 inputs, row slices of fused parameters, column slices of wider tensors),
a NaN sets the flag and writes nothing of its block, and items the kernel cannot take are written on their own."""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.kernels import dispatch
from sglang_fp8rl.quant import FP8_DTYPE

pytestmark = pytest.mark.gpu

POISON = 0x7F  # E4M3 NaN: a byte the kernel should have written but did not cannot pass


def weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(n, k, device="cuda", generator=gen)
    return (w * torch.exp2(torch.randint(-20, 8, (n, 1), device="cuda", generator=gen).float())).to(dtype)


def bucket(dtype: torch.dtype, gen: torch.Generator):
    """Qwen3-8B-like writes at TP 2: q/k/v shards into one fused parameter, a column half of a wider tensor."""
    fused_q = torch.full((3072, 4096), POISON, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)
    fused_s = torch.full((24, 32), float("nan"), device="cuda")
    down = weight(4096, 12288, dtype, gen)
    items = [
        (weight(2048, 4096, dtype, gen), fused_q[:2048], fused_s[:16]),
        (weight(512, 4096, dtype, gen), fused_q[2048:2560], fused_s[16:20]),
        (weight(512, 4096, dtype, gen), fused_q[2560:], fused_s[20:]),
        (down[:, 6144:], *outputs(4096, 6144)),
        (weight(128, 128, dtype, gen), *outputs(128, 128)),
    ]
    return items


def outputs(n: int, k: int):
    return (torch.full((n, k), POISON, dtype=torch.uint8, device="cuda").view(FP8_DTYPE),
            torch.full((-(-n // 128), -(-k // 128)), float("nan"), device="cuda"))


def one_by_one(items, pow2: bool):
    ref = []
    for w, q, s in items:
        q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
        dispatch.quantize_blockwise_into(w, q_ref, s_ref, scale_format="pow2" if pow2 else "fp32")
        ref.append((q_ref, s_ref))
    return ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_grouped_equals_one_launch_per_tensor(dtype, pow2):
    gen = torch.Generator(device="cuda").manual_seed(7)
    items = bucket(dtype, gen)
    assert all(dispatch.grouped_reason(*item) is None for item in items)
    ref = one_by_one(items, pow2)
    flag = dispatch.new_nonfinite_flag("cuda")
    launches = dispatch.quantize_blockwise_many(items, flag, scale_format="pow2" if pow2 else "fp32")
    assert launches == 1
    dispatch.check_nonfinite_flag(flag)
    for (w, q, s), (q_ref, s_ref) in zip(items, ref):
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), tuple(w.shape)
        assert torch.equal(s, s_ref), tuple(w.shape)


def test_a_nan_sets_the_flag_and_only_its_block_stays_unwritten():
    gen = torch.Generator(device="cuda").manual_seed(8)
    items = bucket(torch.bfloat16, gen)
    items[1][0][300, 17] = float("nan")  # k shard, rows 256..383 of it: fused rows 2304..2431, block column 0
    ref = one_by_one([items[0], *items[2:]], False)
    flag = dispatch.new_nonfinite_flag("cuda")
    dispatch.quantize_blockwise_many(items, flag)
    assert flag.item() == 1
    q_k, s_k = items[1][1], items[1][2]
    assert bool((q_k[256:384, :128].view(torch.uint8) == POISON).all()) and bool(s_k[2, 0].isnan())
    assert not bool((q_k[:256].view(torch.uint8) == POISON).any()) and int(s_k.isnan().sum()) == 1
    for (_, q, s), (q_ref, s_ref) in zip([items[0], *items[2:]], ref):
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_items_the_kernel_cannot_take_are_written_on_their_own():
    gen = torch.Generator(device="cuda").manual_seed(9)
    odd = (weight(200, 300, torch.bfloat16, gen), *outputs(200, 300))  # partial blocks
    cpu = (weight(128, 256, torch.bfloat16, gen).cpu(), *outputs(128, 256))  # input on another device
    items = [odd, cpu, *bucket(torch.bfloat16, gen)]
    assert dispatch.grouped_reason(*odd) is not None and dispatch.grouped_reason(*cpu) is not None
    ref = one_by_one(items, False)
    assert dispatch.quantize_blockwise_many(items, dispatch.new_nonfinite_flag("cuda")) == 3
    for (_, q, s), (q_ref, s_ref) in zip(items, ref):
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
