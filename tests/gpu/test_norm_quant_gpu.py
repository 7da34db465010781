"""The producer kernels that quantize their own output (sglang_fp8rl.kernels.norm_quant) against SGLang's unfused
kernels on the GPU: SGLang's RMSNorm (residual added in place) and SiluAndMul, then its 1x128 quantizer.

The BF16 outputs agree within one BF16 step (both compute in float32; the order of the mean's sum and the exponential
may differ), the residual bit for bit; the codes and multipliers are quant.quantize_activation_groups of the fused
kernel's own output bit for bit, in both scale layouts, eagerly and replayed from a CUDA graph after the inputs
changed. Launched as programmatic dependent launches (as served on Hopper), in a captured chain norm -> GEMM ->
SiLU -> GEMM -> norm of dependent launches, every bit equals the chain launched plainly.
"""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.quant import quantize_activation_groups

pytestmark = pytest.mark.gpu
EPS = 1e-6


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    from bench_norm_quant import bf16_steps  # scripts/: the benchmark's own measure

    return bf16_steps(a, b)


def own_quantization(out: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> bool:
    ref_q, ref_s = quantize_activation_groups(out.cpu(), 128)
    return torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s.cpu(), ref_s)


def inputs(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mags = torch.exp(torch.randn(m, 1, device="cuda", generator=gen).clamp(-2, 2) * 2)
    return (torch.randn(m, k, device="cuda", generator=gen) * mags).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 7, 64, 384])
@pytest.mark.parametrize("layout,pdl", [("row", False), ("tma", False), ("tma", True)])
def test_add_rmsnorm_quant_matches_sglangs_norm(m, layout, pdl):
    from sglang.srt.layers.layernorm import RMSNorm

    from sglang_fp8rl.kernels.norm_quant import add_rmsnorm_quant

    k = 4096
    norm = RMSNorm(k, eps=EPS).cuda().to(torch.bfloat16)
    norm.weight.data = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    x, r = inputs(m, k, m), inputs(m, k, m + 1)
    r_ours, r_theirs = r.clone(), r.clone()
    out, q, s = add_rmsnorm_quant(x, norm.weight.data, EPS, r_ours, scale_layout=layout, pdl=pdl)
    ref, ref_residual = norm.forward_cuda(x.clone(), r_theirs)
    assert torch.equal(r_ours, ref_residual)
    assert steps_apart(out, ref) <= 1
    assert own_quantization(out, q, s)


@pytest.mark.parametrize("m", [1, 7, 64, 384])
@pytest.mark.parametrize("pdl", [False, True])
def test_silu_mul_quant_matches_sglangs_silu_and_mul(m, pdl):
    from bench_norm_quant import bare_silu_and_mul
    from sglang.srt.layers.activation import SiluAndMul

    from sglang_fp8rl.kernels.norm_quant import silu_mul_quant

    # gates of |g| < ~25 (as a model's): far beyond, exp(-g) overflows float32 and the two kernels' tiny results
    # differ near BF16's underflow (an H200 run with row magnitudes up to ~200 found 1,830 steps between two of them)
    gen = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * 12288, device="cuda", generator=gen) * 5).to(torch.bfloat16)
    out, q, s = silu_mul_quant(gate_up, scale_layout="tma", pdl=pdl)
    assert steps_apart(out, bare_silu_and_mul(SiluAndMul).forward_cuda(gate_up)) <= 1
    assert own_quantization(out, q, s)


def test_both_replay_from_a_cuda_graph_after_their_inputs_changed():
    from sglang_fp8rl.kernels.norm_quant import add_rmsnorm_quant, silu_mul_quant

    x, r, gate_up = inputs(8, 4096, 1), inputs(8, 4096, 2), inputs(8, 2 * 12288, 3)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    add_rmsnorm_quant(x, w, EPS, r.clone())  # compile outside the capture
    silu_mul_quant(gate_up)
    residual = r.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm_out = add_rmsnorm_quant(x, w, EPS, residual)
        silu_out = silu_mul_quant(gate_up)
    x.copy_(inputs(8, 4096, 4))
    gate_up.copy_(inputs(8, 2 * 12288, 5))
    residual.copy_(r)
    graph.replay()
    eager_residual = r.clone()
    eager = (add_rmsnorm_quant(x, w, EPS, eager_residual), silu_mul_quant(gate_up))
    for replayed, again in zip((norm_out, silu_out), eager):
        for a, b in zip(replayed, again):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bits, FP8 codes included
    assert torch.equal(residual, eager_residual)


def test_a_chain_of_dependent_launches_replays_the_plain_chains_bits():
    """norm -> gate_up GEMM -> SiLU -> down GEMM -> norm, each a dependent launch reading the one before: a wait
    placed after a read would show as a bit that differs from the plain chain (run for a few input sets)."""
    from sglang_fp8rl.kernels.block_gemm import block_fp8_gemm
    from sglang_fp8rl.kernels.norm_quant import add_rmsnorm_quant, silu_mul_quant
    from sglang_fp8rl.quant import quantize_blockwise

    h, inter, m = 4096, 2048, 8
    w = (1 + 0.1 * inputs(1, h, 0)[0].float()).to(torch.bfloat16)
    gate_up_w = quantize_blockwise((inputs(2 * inter, h, 1).float() / 64).cuda())
    down_w = quantize_blockwise((inputs(h, inter, 2).float() / 64).cuda())

    def chain(x, residual, pdl):
        out, q, s = add_rmsnorm_quant(x, w, EPS, residual, scale_layout="tma", pdl=pdl)
        gate_up = block_fp8_gemm(q, s, *gate_up_w, split_k=2, pdl=pdl)
        _, q2, s2 = silu_mul_quant(gate_up, scale_layout="tma", pdl=pdl)
        down = block_fp8_gemm(q2, s2, *down_w, split_k=4, pdl=pdl)
        return (out, gate_up, down, *add_rmsnorm_quant(down, w, EPS, residual, pdl=pdl))

    x, r = inputs(m, h, 3), inputs(m, h, 4)
    residual = r.clone()
    chain(x, residual.clone(), True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain(x, residual, True)
    for seed in range(5, 10):
        x.copy_(inputs(m, h, seed))
        r.copy_(inputs(m, h, seed + 100))
        residual.copy_(r)
        graph.replay()
        plain_residual = r.clone()
        plain = chain(x, plain_residual, False)
        torch.cuda.synchronize()
        for a, b in zip(replayed, plain):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        assert torch.equal(residual, plain_residual)
