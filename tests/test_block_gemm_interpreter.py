"""CPU checks of our block-FP8 GEMM kernel (sglang_fp8rl.kernels.block_gemm) under the Triton interpreter.

The interpreter runs the kernel's own code (masks, K loop, scales, split-K partials and the counter-driven reduction)
on CPU tensors, sequentially. What it cannot show: speed, the GPU's memory ordering of the split-K reduction, and the
BF16 output rounding (the interpreter truncates FP32 -> BF16); those are GPU tests (tests/gpu/test_block_gemm.py;
this file has another name because pytest needs unique basenames).
So the exactness checks here use a float32 output and compare with the float64 block-scaled product.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import E4M3_RNE_PREAMBLE, QUANTIZER_PREAMBLE, check_under_interpreter

from sglang_fp8rl.kernels import gemm_select as gs

INTERPRETER_CHECK = textwrap.dedent(
    """
    import os
    import torch
    from sglang_fp8rl import quant
    from sglang_fp8rl.kernels import block_gemm as bg
    from sglang_fp8rl.kernels.gemm_select import block_scaled_reference, rel_error

    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)

    def operands(m, n, k):
        # rows of very different magnitudes, so a scale applied to the wrong block or token shows
        w = torch.randn(n, k) * torch.exp(torch.randn(n, 1).clamp(-2, 2) * 2)
        x = torch.randn(m, k) * torch.exp(torch.randn(m, 1).clamp(-2, 2) * 2)
        wq, ws = quant.quantize_blockwise(w.to(torch.bfloat16))
        xq, xs = quant.quantize_activation_groups(x.to(torch.bfloat16), 128)
        return xq, xs, wq, ws

    cases = [(1, 64, 128, 64, 1), (3, 200, 384, 64, 2), (17, 256, 512, 128, 1), (33, 130, 640, 64, 4),
             (70, 128, 256, 64, 4), (129, 96, 256, 128, 1), (5, 300, 384, 64, 4)]
    for m, n, k, block_n, split_k in cases:
        xq, xs, wq, ws = operands(m, n, k)
        ref = block_scaled_reference(xq, xs, wq, ws)
        out = bg.block_fp8_gemm(xq, xs, wq, ws, torch.float32, block_n=block_n, split_k=split_k)
        err = rel_error(out, ref)
        assert out.shape == (m, n) and err < 1e-6, (seed, m, n, k, block_n, split_k, err)
        again = bg.block_fp8_gemm(xq, xs, wq, ws, torch.float32, block_n=block_n, split_k=split_k)
        assert torch.equal(out, again), ("not reproducible", seed, m, n, k, split_k)  # counters were reset
        bias = torch.randn(n)
        with_bias = bg.block_fp8_gemm(xq, xs, wq, ws, torch.float32, bias, block_n=block_n, split_k=split_k)
        assert rel_error(with_bias, ref + bias.double()) < 1e-6, (seed, m, n, k, "bias")
        bf16 = bg.block_fp8_gemm(xq, xs, wq, ws, torch.bfloat16, block_n=block_n, split_k=split_k)
        assert bf16.dtype == torch.bfloat16 and rel_error(bf16, ref) < 1e-2, (seed, m, n, k, "bf16")

    # column-major (strided) activation scales, as DeepGEMM's quantizer writes them
    xq, xs, wq, ws = operands(9, 128, 384)
    xs_cm = xs.t().contiguous().t()
    assert xs_cm.stride() != xs.stride()
    out = bg.block_fp8_gemm(xq, xs_cm, wq, ws, torch.float32, split_k=2)
    assert rel_error(out, block_scaled_reference(xq, xs, wq, ws)) < 1e-6
    assert bg.block_fp8_gemm(xq[:0], xs[:0], wq, ws).shape == (0, 128)
    print("block_gemm interpreter ok", seed)
    """
)


def test_block_gemm_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    check_under_interpreter(INTERPRETER_CHECK, "block_gemm interpreter ok")


FUSED_CHECK = QUANTIZER_PREAMBLE + E4M3_RNE_PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels import block_gemm as bg

    # block_fp8_linear (the activation quantized inside the kernel) against quant.quantize_activation_groups followed
    # by block_fp8_gemm: the same codes and multipliers, the same loop, so the same float32 bits
    cases = [(1, 64, 256, 64, 1), (5, 200, 384, 64, 4), (16, 128, 512, 128, 2), (17, 96, 256, 64, 1)]
    for m, n, k, block_n, split_k in cases:
        x = weight(m, k, torch.bfloat16)  # rows of very different magnitudes, exact in BF16
        x[0, :128] = 0.0  # an all-zero group: the amax floor
        wq, ws = quant.quantize_blockwise(weight(n, k, torch.bfloat16))
        xq, xs = quant.quantize_activation_groups(x, 128)
        for out_dtype in (torch.float32, torch.bfloat16):
            unfused = bg.block_fp8_gemm(xq, xs, wq, ws, out_dtype, block_n=block_n, split_k=split_k)
            fused = bg.block_fp8_linear(x, wq, ws, out_dtype, block_n=block_n, split_k=split_k)
            assert torch.equal(fused, unfused), (m, n, k, block_n, split_k, out_dtype,
                                                 (fused.float() - unfused.float()).abs().max())
        bias = torch.randn(n)
        assert torch.equal(bg.block_fp8_linear(x, wq, ws, torch.float32, bias, block_n=block_n, split_k=split_k),
                           bg.block_fp8_gemm(xq, xs, wq, ws, torch.float32, bias, block_n=block_n, split_k=split_k))

    # a NaN activation (a CUDA-graph warm-up on an uninitialized buffer) never raises its group's amax and gives a
    # finite code: the other tokens' outputs are untouched and no output is NaN from the quantizer
    x = weight(3, 256, torch.bfloat16)
    wq, ws = quant.quantize_blockwise(weight(64, 256, torch.bfloat16))
    clean = bg.block_fp8_linear(x, wq, ws, torch.float32)
    x[1, 5] = float("nan")
    dirty = bg.block_fp8_linear(x, wq, ws, torch.float32)
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[2], clean[2])
    assert torch.isfinite(dirty).all()
    assert bg.block_fp8_linear(x[:0], wq, ws).shape == (0, 64)

    # our own activation quantizer (the first launch of the _qpdl candidates): quant.quantize_activation_groups' codes
    # and multipliers bit for bit, a K not a multiple of its programs' 8 groups, an all-zero group, a NaN; then
    # quantizer + GEMM == the fused kernel
    for m, k in [(1, 4096), (3, 1152), (16, 256), (2, 128)]:
        x = weight(m, k, torch.bfloat16)
        x[0, :128] = 0.0
        if m > 1:
            x[1, 5] = float("nan")
        q, s = bg.quantize_activation(x)
        ref_q, ref_s = quant.quantize_activation_groups(torch.nan_to_num(x, nan=0.0), 128)
        assert torch.equal(s, ref_s), (m, k)  # the NaN never raised its group's amax
        nan = torch.isnan(x)  # its own code is the GPU's (min / max drop a NaN there, not in the interpreter)
        assert torch.equal(q.view(torch.uint8)[~nan], ref_q.view(torch.uint8)[~nan]), (m, k)
    x = weight(5, 384, torch.bfloat16)
    wq, ws = quant.quantize_blockwise(weight(200, 384, torch.bfloat16))
    for split_k in (1, 4):
        chained = bg.block_fp8_gemm(*bg.quantize_activation(x, pdl=True), wq, ws, torch.float32, split_k=split_k)
        assert torch.equal(chained, bg.block_fp8_linear(x, wq, ws, torch.float32, split_k=split_k))
    assert bg.quantize_activation(x[:0])[0].shape == (0, 384)
    print("fused block_gemm interpreter ok")
    """
)


def test_fused_activation_quantization_under_the_triton_interpreter() -> None:
    """block_fp8_linear == quant.quantize_activation_groups + block_fp8_gemm, bit for bit (float32 and BF16 out)."""
    pytest.importorskip("triton")
    check_under_interpreter(FUSED_CHECK, "fused block_gemm interpreter ok")


@pytest.mark.parametrize(
    "what, change, message",
    [
        ("K not a multiple of 128", dict(k=200), "K=200 is not a multiple of 128"),
        ("activation scale shape", dict(xs_cols=3), "xs has shape"),
        ("weight scale shape", dict(ws_rows=1), "ws has shape"),
        ("scale dtype", dict(xs_dtype=torch.bfloat16), "scales must be float32"),
        ("block_n", dict(block_n=32), "block_n 32"),
        ("split_k", dict(split_k=3), "split_k 3"),
    ],
)
def test_block_gemm_rejects_bad_operands(what, change, message) -> None:
    from sglang_fp8rl.kernels import block_gemm as bg

    m, n, k = 4, 256, change.get("k", 256)
    xq = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    xs = torch.ones(m, change.get("xs_cols", max(1, k // 128)), dtype=change.get("xs_dtype", torch.float32))
    ws = torch.ones(change.get("ws_rows", 2), max(1, k // 128))
    with pytest.raises(ValueError, match=message):
        bg.block_fp8_gemm(xq, xs, wq, ws, block_n=change.get("block_n", 64), split_k=change.get("split_k", 1))


@pytest.mark.parametrize(
    "what, x, message",
    [
        ("FP16 activation", torch.zeros(4, 256, dtype=torch.float16), "2-D BF16 tensor"),
        ("3-D activation", torch.zeros(1, 4, 256, dtype=torch.bfloat16), "2-D BF16 tensor"),
        ("strided activation", torch.zeros(256, 4, dtype=torch.bfloat16).t(), "contiguous rows"),
        ("K of another width", torch.zeros(4, 384, dtype=torch.bfloat16), "need the same K"),
    ],
)
def test_block_fp8_linear_rejects_bad_activations(what, x, message) -> None:
    from sglang_fp8rl.kernels import block_gemm as bg

    wq = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    ws = torch.ones(2, 2)
    with pytest.raises(ValueError, match=message):
        bg.block_fp8_linear(x, wq, ws)


@pytest.mark.parametrize(
    "what, x, message",
    [
        ("float32", torch.zeros(2, 256), "BF16"),
        ("K not a multiple of 128", torch.zeros(2, 200, dtype=torch.bfloat16), "multiple of 128"),
        ("3-D", torch.zeros(1, 2, 256, dtype=torch.bfloat16), "2-D"),
        ("strided rows", torch.zeros(256, 2, dtype=torch.bfloat16).t(), "contiguous rows"),
    ],
)
def test_quantize_activation_rejects_bad_activations(what, x, message) -> None:
    pytest.importorskip("triton")
    from sglang_fp8rl.kernels import block_gemm as bg

    with pytest.raises(ValueError, match=message):
        bg.quantize_activation(x)


def test_block_m_tiles() -> None:
    from sglang_fp8rl.kernels import block_gemm as bg

    assert [bg.block_m_for(m) for m in (1, 16, 17, 64, 65, 128, 129, 4096)] == [16, 16, 32, 64, 128, 128, 128, 128]
    assert gs.OURS_MAX_M <= bg.MAX_BLOCK_M  # the selector never asks for more than one token tile
