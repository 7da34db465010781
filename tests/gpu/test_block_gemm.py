"""Every block-FP8 GEMM candidate of gemm_select against the float64 block-scaled product, on the GPU.

Shapes: every blockwise linear of Qwen3-0.6B / 8B / 32B and Llama-3-8B at TP 1, 2 and 4 (per-rank N x K from
``layers.scheme.decision_table``), M in {1, 7, 64, 100, 128, 129, 200} (non-multiples of 128 and the DeepGEMM edge at
128/129), fresh random draws each run (the seed is in the failure message). The reference is
``(xq * xs) @ (wq * ws)^T`` in float64, once on the activation codes of ``sglang_fp8rl.quant`` and once on those of
SGLang's group quantizer (most candidates quantize with it; the two may differ by one E4M3 step in a few elements, a
different division, which at K 512 and M 1 cost 1.3e-2 against the other's codes); a candidate's error is the
smaller of its two; the bound is the selector's REL_TOL (1e-2 relative Frobenius error). A BF16 output alone costs
~1.6e-3 and FP32 accumulation far less; an error in a scale, a tile or a split would cost O(1).
Plus: our split-K kernel is bitwise reproducible and gives the same bits inside a CUDA graph, and its fused form
(the activation quantized inside the kernel) gives the unfused kernel's bits on the reference's activation codes.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang_fp8rl.kernels import deepgemm
from sglang_fp8rl.kernels import gemm_select as gs
from sglang_fp8rl.kernels import jit_warmup as jw
from sglang_fp8rl.layers.scheme import KNOWN_MODELS, Scheme, decision_table
from sglang_fp8rl.quant import quantize_activation_groups

pytestmark = pytest.mark.gpu

MODELS = ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B", "Llama-3-8B")
TPS = (1, 2, 4)
MS = (1, 7, 100, 129, 200)
BOUND = gs.REL_TOL


def block_shapes() -> list[tuple[int, int]]:
    shapes = set()
    for model in MODELS:
        for row in decision_table(KNOWN_MODELS[model], TPS):
            if row["scheme"] == Scheme.BLOCK:
                shapes.add((sum(row["shards"].values()), row["k_local"]))
    return sorted(shapes)


SHAPES = block_shapes()
# DeepGEMM JIT-compiles one kernel per tile configuration (2-6 s each on a cold cache; ~40 s per shape measured on
# H100), so the DeepGEMM candidates (SGLang's default included) are checked on Qwen3-8B's TP 1/2 shapes by default;
# FP8RL_GPU_TEST_FULL=1 checks them on every shape. Our kernel and Triton run on every shape.
DEEPGEMM_SHAPES = {(n, k) for model in ("Qwen3-8B",) for row in decision_table(KNOWN_MODELS[model], (1, 2))
                   for n, k in [(sum(row["shards"].values()), row["k_local"])]}
FULL = os.environ.get("FP8RL_GPU_TEST_FULL", "0") == "1"


@pytest.fixture(scope="module")
def candidates():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # every kernel, ours in all its configurations and at every M (the selector tries it only at small M)
    cands = gs.make_candidates(triton=True, ours=gs.ALL_OURS_CONFIGS)
    restore = _compile_deepgemm_cases(cands)
    yield cands
    restore()


def _compile_deepgemm_cases(cands):
    """DeepGEMM kernels of the cases below, compiled in parallel by the server's own warm-up (one per tile
    configuration, seconds each: serially they take most of the stage), and SGLang's precompile of every M off."""
    if not deepgemm.detect().default_is_fp32_deepgemm:
        return lambda: None
    from sglang.srt.layers.deep_gemm_wrapper import compile_utils

    before = compile_utils._ENABLE_JIT_DEEPGEMM_PRECOMPILE
    compile_utils._ENABLE_JIT_DEEPGEMM_PRECOMPILE = False
    shapes = SHAPES if FULL else sorted(DEEPGEMM_SHAPES)
    variants = [c.num_sms for c in cands.values() if c.needs_deepgemm] + [None]
    streams = {(n, k, sms): MS for n, k in shapes for sms in variants if deepgemm.deepgemm_takes_shape(n, k)}
    with jw.WarmupPool(jw.default_workers(), torch.cuda.current_device(), env=jw.worker_env()) as pool:
        print(jw.warm_up(pool, streams, gs.env_key(gs.env_info())).summary())

    def restore():
        compile_utils._ENABLE_JIT_DEEPGEMM_PRECOMPILE = before

    return restore


def activation_codes(x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The 1x128 codes and multipliers of ``x`` by this package's quantizer and by SGLang's (row-major scales)."""
    from sglang_fp8rl.compat.runtime import fp8_kernel_module

    return [quantize_activation_groups(x, 128), fp8_kernel_module().sglang_per_token_group_quant_fp8(x, 128)]


@pytest.mark.parametrize("n, k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_every_candidate_matches_float64(candidates, n, k):
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    wq, ws = gs.random_block_weight(n, k, "cuda", gen)
    facts = deepgemm.detect()
    ran = []
    for m in MS:
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        refs = [gs.block_scaled_reference(*codes, wq, ws) for codes in activation_codes(x)]
        for name, c in candidates.items():
            if c.can_implement(n, k, facts):
                continue
            if name.startswith("deepgemm") and not FULL and (n, k) not in DEEPGEMM_SHAPES:
                continue
            out = c.fn(x, wq, ws, None)
            torch.cuda.synchronize()
            err = min(gs.rel_error(out, ref) for ref in refs)
            assert out.shape == (m, n) and err <= BOUND, f"{name} N={n} K={k} M={m}: rel err {err:.3g} (seed {seed})"
            ran.append(name)
    assert any(name.startswith(gs.OURS_PREFIX) for name in ran)
    assert gs.DEFAULT in ran or not (FULL or (n, k) in DEEPGEMM_SHAPES)


@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_ours_is_reproducible_and_graph_safe(split_k):
    from sglang_fp8rl.kernels.block_gemm import block_fp8_gemm

    gen = torch.Generator(device="cuda").manual_seed(split_k)
    n, k, m = 4096, 12288, 37
    wq, ws = gs.random_block_weight(n, k, "cuda", gen)
    xq, xs = quantize_activation_groups(torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16), 128)
    eager = [block_fp8_gemm(xq, xs, wq, ws, split_k=split_k) for _ in range(3)]
    assert all(torch.equal(eager[0], e) for e in eager[1:])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block_fp8_gemm(xq, xs, wq, ws, split_k=split_k)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block_fp8_gemm(xq, xs, wq, ws, split_k=split_k)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager[0])
    ref = gs.block_scaled_reference(xq, xs, wq, ws)
    assert gs.rel_error(eager[0], ref) <= BOUND


def bf16_activation(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """BF16 rows of very different magnitudes (one random scale a token), as decode activations are."""
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    return x * torch.exp(torch.randn(m, 1, device="cuda", generator=gen) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_fused_activation_quantization_equals_the_unfused_kernel_bit_for_bit(split_k):
    """block_fp8_linear (the BF16 activation quantized inside the kernel) == quant.quantize_activation_groups (on
    the GPU: torch's correctly rounded division) + block_fp8_gemm, on every shape at M <= 16, eager and replayed in a
    CUDA graph; the CPU interpreter checks the same on small shapes (tests/test_block_gemm_interpreter.py)."""
    from sglang_fp8rl.kernels.block_gemm import block_fp8_gemm, block_fp8_linear

    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for n, k in SHAPES:
        wq, ws = gs.random_block_weight(n, k, "cuda", gen)
        for m in (1, 7, 16):
            x = bf16_activation(m, k, gen)
            xq, xs = quantize_activation_groups(x, 128)
            unfused = block_fp8_gemm(xq, xs, wq, ws, split_k=split_k)
            fused = block_fp8_linear(x, wq, ws, split_k=split_k)
            assert torch.equal(fused, unfused), f"N={n} K={k} M={m} split_k={split_k} (seed {seed})"
    graph = torch.cuda.CUDAGraph()
    block_fp8_linear(x, wq, ws, split_k=split_k)  # compiled before the capture
    with torch.cuda.graph(graph):
        captured = block_fp8_linear(x, wq, ws, split_k=split_k)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, unfused)


def test_shape_list_covers_the_issue():
    assert (24576, 4096) in SHAPES and (6144, 4096) in SHAPES and (4096, 12288) in SHAPES  # Qwen3-8B TP1
    assert len(SHAPES) >= 20


@pytest.mark.parametrize("n, k", sorted(DEEPGEMM_SHAPES), ids=[f"{n}x{k}" for n, k in sorted(DEEPGEMM_SHAPES)])
def test_direct_call_equals_sglangs_linear_bit_for_bit(candidates, monkeypatch, n, k):
    """kernels.deepgemm.linear_direct (the default outside CUDA graphs) gives SGLang's DeepGEMM linear's bits."""
    monkeypatch.setenv(deepgemm.PRECOMPILE_ENV, "0")
    why_not = deepgemm.direct_reason(deepgemm.detect())
    if why_not is not None:
        pytest.skip(why_not)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    wq, ws = gs.random_block_weight(n, k, "cuda", gen)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    for m in MS:
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        for b in (None, bias):
            ours = deepgemm.linear_direct(x, wq, ws, b)
            theirs = gs.candidates.sglang_block_call(gs.candidates.default_linear(), x, wq, ws, b)
            assert torch.equal(ours, theirs), f"N={n} K={k} M={m} bias={b is not None}"


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("prefetch,pdl", [(True, False), (True, True), (False, True)], ids=["pf", "pfpdl", "pdl"])
def test_weight_prefetch_and_pdl_give_the_default_kernels_bits(split_k, prefetch, pdl):
    """The weight slice prefetched to L2 and the programmatic dependent launch change when bytes move, not the
    arithmetic: the default kernel's output bit for bit, eagerly and in a CUDA graph whose kernel before the GEMM
    writes its activation (a copy), replayed after that activation changed."""
    from sglang_fp8rl.kernels.block_gemm import block_fp8_gemm

    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for n, k in SHAPES:
        wq, ws = gs.random_block_weight(n, k, "cuda", gen)
        for m in (1, 7, 16):
            xq, xs = quantize_activation_groups(torch.randn(m, k, device="cuda", generator=gen), 128)
            default = block_fp8_gemm(xq, xs, wq, ws, split_k=split_k)
            tried = block_fp8_gemm(xq, xs, wq, ws, split_k=split_k, prefetch=prefetch, pdl=pdl)
            assert torch.equal(tried, default), f"N={n} K={k} M={m} split_k={split_k} (seed {seed})"
    source = [quantize_activation_groups(torch.randn(m, k, device="cuda", generator=gen), 128) for _ in range(2)]
    xq, xs = (t.clone() for t in source[0])
    src_q, src_s = (t.clone() for t in source[0])

    def linear():
        xq.copy_(src_q)  # the kernel before the GEMM writes the operand the GEMM reads after its wait
        xs.copy_(src_s)
        return block_fp8_gemm(xq, xs, wq, ws, split_k=split_k, prefetch=prefetch, pdl=pdl)

    linear()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear()
    src_q.copy_(source[1][0])
    src_s.copy_(source[1][1])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, block_fp8_gemm(*source[1], wq, ws, split_k=split_k))


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "qpdl"])
def test_own_activation_quantizer_gives_the_references_codes_and_the_fused_kernels_bits(split_k, pdl):
    """block_gemm.quantize_activation == quant.quantize_activation_groups bit for bit (codes and multipliers), and
    the chain quantizer -> GEMM (both dependent launches with ``pdl``) == block_fp8_linear, eagerly and in a CUDA
    graph whose kernel before the quantizer writes its input (a copy), replayed after that input changed."""
    from sglang_fp8rl.kernels.block_gemm import block_fp8_gemm, block_fp8_linear, quantize_activation

    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    for n, k in SHAPES:
        wq, ws = gs.random_block_weight(n, k, "cuda", gen)
        for m in (1, 7, 16):
            x = bf16_activation(m, k, gen)
            xq, xs = quantize_activation(x, pdl=pdl)
            ref_q, ref_s = quantize_activation_groups(x, 128)
            assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)), f"K={k} M={m} (seed {seed})"
            assert torch.equal(xs, ref_s), f"K={k} M={m} (seed {seed})"
            chained = block_fp8_gemm(xq, xs, wq, ws, split_k=split_k, pdl=pdl)
            assert torch.equal(chained, block_fp8_linear(x, wq, ws, split_k=split_k)), f"N={n} K={k} M={m}"
    sources = [bf16_activation(7, k, gen) for _ in range(2)]
    x, src = sources[0].clone(), sources[0].clone()

    def linear():
        x.copy_(src)  # the kernel before the quantizer writes what it reads after its wait
        xq, xs = quantize_activation(x, pdl=pdl)
        return block_fp8_gemm(xq, xs, wq, ws, split_k=split_k, pdl=pdl)

    linear()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear()
    src.copy_(sources[1])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, block_fp8_linear(sources[1], wq, ws, split_k=split_k))
