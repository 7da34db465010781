"""The split-KV FP8 decode attention kernel (kernels/fp8_decode_attention.py) on a GPU: against the float64 reference,
against FlashAttention-3's FP8 decode where sgl_kernel's FA3 is installed, and inside a CUDA graph captured at one
context length and replayed at others (its grid is fixed per batch, its plan of splits made from the lengths at run
time)."""

from __future__ import annotations

import pytest
import torch
from decode_attention_case import ROW_TOLERANCE, paged_case, reference

from sglang_fp8rl.kernels.fp8_decode_attention import fp8_decode_attention

pytestmark = pytest.mark.gpu


def on_cuda(case: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def run(case: dict, **kw) -> torch.Tensor:
    return fp8_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["page_table"], case["cache_seqlens"],
                                case["softmax_scale"], case["k_descale"], case["v_descale"], **kw)


# (batch, kv_heads, group, dim, page, lengths): Qwen3-8B's heads at batch 1 and 8, ragged lengths, pages > 1
CASES = [(1, 8, 4, 128, 1, [4096]), (8, 8, 4, 128, 1, [1, 17, 128, 129, 1000, 2048, 3000, 4097]),
         (3, 2, 8, 64, 16, [5, 300, 2000]), (33, 4, 4, 128, 1, [i * 37 + 1 for i in range(33)])]


@pytest.mark.parametrize("batch,kv_heads,group,dim,page,lens", CASES)
def test_matches_the_float64_reference(batch, kv_heads, group, dim, page, lens):
    case = paged_case(batch, batch, kv_heads, group, dim, page, lens)
    ref, vmax = reference(case)
    gpu = on_cuda(case)
    out32 = torch.full(ref.shape, float("nan"), device="cuda")
    run(gpu, out=out32)
    assert ((out32.double().cpu() - ref).abs() <= ROW_TOLERANCE * vmax).all()
    out16 = run(gpu)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, run(gpu)), "not deterministic"


@pytest.mark.parametrize("length", [1, 129, 4096, 12288])
def test_one_sequence_planned_in_the_kernels_gives_the_default_bits(length):
    """single_plan at batch 1 (no plan launch): the plan launch's output bit for bit, eager and in a replayed graph."""
    case = on_cuda(paged_case(length, 1, 8, 4, 128, 1, [length]))
    assert torch.equal(run(case, single_plan=True), run(case, single_plan=False))
    out = torch.empty(1, 32, 128, dtype=torch.bfloat16, device="cuda")
    run(case, out=out, single_plan=True)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(case, out=out, single_plan=True)
    case["cache_seqlens"].fill_(max(1, length // 2))  # the graph replays at another length
    graph.replay()
    assert torch.equal(out, run(case))


@pytest.mark.parametrize("batch,kv_heads,group,dim,page,lens", CASES)
def test_a_bf16_query_is_read_as_such(batch, kv_heads, group, dim, page, lens):
    """--fp8rl-decode-query bf16: within the tolerance of the float64 attention of the BF16 query itself."""
    case = paged_case(batch, batch, kv_heads, group, dim, page, lens)
    gen = torch.Generator().manual_seed(batch)
    case["q"] = (torch.randn(case["q"].shape, generator=gen) * 2.0).to(torch.bfloat16)
    ref, vmax = reference(case)
    out = torch.full(ref.shape, float("nan"), device="cuda")
    run(on_cuda(case), out=out)
    assert ((out.double().cpu() - ref).abs() <= ROW_TOLERANCE * vmax).all()


@pytest.mark.parametrize("batch,kv_heads,group,dim,page,lens", CASES)
def test_v_widened_on_its_tile_is_as_close_to_the_reference_as_the_default(batch, kv_heads, group, dim, page, lens):
    """V_WIDEN_TILE changes where V is widened (on its tile, through shared memory), not the values the MMA reads; the
    compiled loop adds in another order, so its float32 output differs from the default's by a few ulps (up to
    3.8e-6 on an H100): held to the default's error against the float64 reference, and to the default within 3e-5
    of the largest value a row reads."""
    case = paged_case(batch + 100, batch, kv_heads, group, dim, page, lens)
    ref, vmax = reference(case)
    gpu = on_cuda(case)
    default, tile = (torch.empty(ref.shape, device="cuda") for _ in range(2))
    run(gpu, out=default)
    run(gpu, out=tile, v_widen_tile=True)

    def error(out: torch.Tensor) -> float:
        return ((out.double().cpu() - ref).abs() / vmax).max().item()

    assert error(tile) <= error(default) + 1e-5, (error(tile), error(default))
    assert ((tile - default).abs().double().cpu() <= 3e-5 * vmax).all()


def fa3_or_skip():
    """sgl_kernel's FA3 module, or a skip where its library is not installed (flash_attn raises ImportError, which
    newer pytest's importorskip no longer turns into a skip)."""
    try:
        from sgl_kernel import flash_attn
    except ImportError as e:
        pytest.skip(f"sgl_kernel's FA3 is not installed: {e}")
    return flash_attn


def test_agrees_with_fa3_fp8_decode():
    flash_attn = fa3_or_skip()
    case = on_cuda(paged_case(7, 8, 8, 4, 128, 1, [64, 300, 1024, 4000, 5, 777, 2048, 129]))
    ref, vmax = reference({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()})
    batch = case["q"].shape[0]
    fa3 = flash_attn.flash_attn_with_kvcache(
        q=case["q"].contiguous(), k_cache=case["k_cache"], v_cache=case["v_cache"], page_table=case["page_table"],
        cache_seqlens=case["cache_seqlens"], cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        max_seqlen_q=1, softmax_scale=case["softmax_scale"], causal=True, k_descale=case["k_descale"],
        v_descale=case["v_descale"])
    ours = run(case)
    err_fa3 = ((fa3.double().cpu() - ref).abs() / vmax).max().item()
    err_ours = ((ours.double().cpu() - ref).abs() / vmax).max().item()
    # FA3 rounds P to E4M3, this kernel to FP16: it is the closer of the two to the reference
    assert err_ours <= err_fa3 + 1e-3, (err_ours, err_fa3)
    assert err_fa3 < 0.05


@pytest.mark.parametrize("preplan", [False, True], ids=["plan-per-program", "preplan"])
def test_a_graph_captured_at_one_length_replays_at_others(preplan):
    """Captured at one length, replayed at others: the same bits as an eager call, and (preplan: the plan written by
    its own launch inside the graph) the same bits as the default."""
    case = on_cuda(paged_case(3, 4, 8, 4, 128, 1, [4096] * 4))
    lens = case["cache_seqlens"]
    out = torch.empty(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens.fill_(16)
    run(case, out=out, preplan=preplan)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(case, out=out, preplan=preplan)
    for new in ([16, 16, 16, 16], [4096, 1, 2000, 3333], [1, 1, 1, 4096], [0, 4096, 0, 7]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(case)), new


def test_dependent_launches_replay_the_plain_launchs_bits_in_a_chain_of_layers():
    """pdl=True: plan, split and merge as programmatic dependent launches, three layers back to back in one graph,
    each layer's query the previous layer's output (a wait placed after a read would show as a differing bit),
    replayed at other lengths: the plain launches' bits."""
    case = on_cuda(paged_case(5, 8, 8, 4, 128, 1, [4096] * 8))
    lens = case["cache_seqlens"]

    def layers(pdl: bool) -> list[torch.Tensor]:
        q, outs = case["q"], []
        for _ in range(3):
            out = fp8_decode_attention(q, case["k_cache"], case["v_cache"], case["page_table"], lens,
                                       case["softmax_scale"], case["k_descale"], case["v_descale"], pdl=pdl)
            outs.append(out)
            q = out.to(case["q"].dtype)
        return outs

    layers(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = layers(True)
    for new in ([4096] * 8, [1, 17, 128, 129, 1000, 2048, 3000, 4096], [0, 4096, 0, 7, 1, 1, 2, 3]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        plain = layers(False)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(replayed, plain)), new


@pytest.mark.parametrize("batch,kv_heads,group,dim,page,lens", CASES)
def test_merged_by_the_last_split_gives_the_default_bits(batch, kv_heads, group, dim, page, lens):
    """fused_merge (each sequence's last split merges, no merge launch): the default's bits eager, and in a graph of
    three layers (each layer's query the previous output) replayed 20 times at other lengths, each within its pages;
    the counts of eager calls are back at 0 after every call."""
    from sglang_fp8rl.kernels.split_kv_plan_kernel import merge_counts

    case = on_cuda(paged_case(batch + 200, batch, kv_heads, group, dim, page, lens))
    assert torch.equal(run(case, fused_merge=True), run(case))
    lens_t = case["cache_seqlens"]

    def layers(fused: bool) -> list[torch.Tensor]:
        q, outs = case["q"], []
        for _ in range(3):
            outs.append(run(dict(case, q=q), fused_merge=fused))
            q = outs[-1].to(case["q"].dtype)
        return outs

    layers(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = layers(True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(20):  # each sequence at most as long as its pages hold
        new = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=gen)) if i else n for n in lens],
                           dtype=torch.int32)
        lens_t.copy_(new)
        graph.replay()
        want, eager = layers(False), layers(True)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(replayed, want, eager)), new.tolist()
        assert not merge_counts(lens_t.device, batch * kv_heads)[: batch * kv_heads].any()


def test_one_plan_a_step_replays_the_per_layer_plans_bits():
    """step_plan through the dispatcher, as SGLang captures a batch size: two eager forwards on the capture's lengths
    tensor, then the captured one, four layers each, each layer's query the previous layer's output; the graph
    replayed at lengths refilled in place (longer ones too, which a stale plan would cut short) gives the per-layer
    plan's bits, and the next eager step (a new lengths tensor) as well."""
    from decode_attention_case import fa3_decode_kwargs

    from sglang_fp8rl.kernels.attention_select import dispatching

    def fa3(*args, **kwargs):
        raise AssertionError("a plain FP8 decode call reached FA3")

    case = on_cuda(paged_case(11, 8, 8, 4, 128, 1, [4096] * 8))
    lens = case["cache_seqlens"]
    shared, per_layer = dispatching(fa3, "split_kv", forms=("step_plan",)), dispatching(fa3, "split_kv", forms=())

    def forward(dispatch, lengths: torch.Tensor) -> list[torch.Tensor]:
        q, outs = case["q"], []
        for _ in range(4):
            outs.append(dispatch(**fa3_decode_kwargs(case, q=q, cache_seqlens=lengths)))
            q = outs[-1].to(case["q"].dtype)
        return outs

    lens.fill_(16)
    for _ in range(2):
        forward(shared, lens)  # SGLang's warm-up runs: eager, on the tensor the capture uses
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = forward(shared, lens)
    for new in ([16] * 8, [1, 17, 128, 129, 1000, 2048, 3000, 4096], [4096] * 8, [0, 4096, 0, 7, 1, 1, 2, 3]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        want = forward(per_layer, lens)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(replayed, want)), new
    fresh = torch.tensor([4096, 3000, 2048, 1000, 129, 128, 17, 1], dtype=torch.int32, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(forward(shared, fresh), forward(per_layer, fresh)))


@pytest.mark.parametrize("pdl", [False, True])
def test_the_output_codes_are_its_own_quantization(pdl):
    """out_codes (--fp8rl-producer-quant on, for o_proj): quant.quantize_activation_groups of the BF16 output, bit for
    bit, in the layout SGLang hands DeepGEMM; the output itself the plain call's."""
    from sglang_fp8rl.kernels.norm_quant import empty_scales
    from sglang_fp8rl.quant import quantize_activation_groups

    case = on_cuda(paged_case(9, 8, 8, 4, 128, 1, [1, 17, 128, 129, 1000, 2048, 3000, 4097]))
    codes = torch.empty(8, 32 * 128, dtype=torch.float8_e4m3fn, device="cuda")
    scales = empty_scales(8, 32 * 128, torch.device("cuda"), "tma")
    out = run(case, out_codes=(codes, scales), pdl=pdl)
    assert torch.equal(out, run(case))
    ref_q, ref_s = quantize_activation_groups(out.reshape(8, -1).cpu(), 128)
    assert torch.equal(codes.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scales.cpu().contiguous(), ref_s)


def test_the_query_read_in_qkv_replays_the_copys_bits():
    """--fp8rl-decode-query bf16 with the query placeholder (kernels/query_placeholder.py): a decode of SGLang's form
    (``q.contiguous().view(...)``, then FA3's function: here the dispatcher) captured in a CUDA graph with the
    placeholder, and again with the copy, replays the same bits after qkv is rewritten in place."""
    from decode_attention_case import fa3_decode_kwargs

    from sglang_fp8rl.kernels import attention_select as sel
    from sglang_fp8rl.kernels import query_placeholder as qp

    batch, kv_heads, group, dim = 8, 8, 4, 128
    heads = kv_heads * group
    case = on_cuda(paged_case(5, batch, kv_heads, group, dim, 1, [4096, 1, 17, 129, 1000, 2048, 3000, 4097]))
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, device="cuda").to(torch.bfloat16)

    def no_fa3(**kwargs):
        raise AssertionError("a plain decode of at most 8 sequences went to FA3")

    dispatcher = sel.dispatching(no_fa3, "auto", query="bf16")

    def decode(q):
        return dispatcher(**fa3_decode_kwargs(case, q=q.contiguous().view(-1, heads, dim)))

    placeheld = qp.reading_the_model_query(decode)
    outs, graphs = [], []
    for fn in (placeheld, decode):
        fn(qkv[:, :heads * dim])  # compiled outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fn(qkv[:, :heads * dim]))
        graphs.append(graph)
    assert not qp._STANDING
    for seed in range(5):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), seed
        assert torch.equal(outs[0], decode(qkv[:, :heads * dim])), seed
