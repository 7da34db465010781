"""``--fp8rl-producer-quant``: the norm / SiLU before a block-FP8 linear hands it its input already quantized.

Against real SGLang classes on CPU: the reference producers are SGLang's RMSNorm / SiluAndMul native forwards bit for
bit with quant.quantize_activation_groups' codes; the plan wires exactly the producers of block-FP8 linears of ours;
a wired forward falls back to SGLang's for every call it does not take and, after a kernel failure, for good; the
linear's reference apply and the GEMM selection take the handed codes. End to end (a real Qwen3 served on CPU with
the option on): tests/test_model_cpu.py.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm

from sglang_fp8rl.hooks import producers as hook
from sglang_fp8rl.kernels import deepgemm, producers
from sglang_fp8rl.kernels.gemm_select import lookup
from sglang_fp8rl.kernels.gemm_select.candidates import DEFAULT, Candidate
from sglang_fp8rl.layers.linear import Fp8OnlineBlockwiseLinearMethod, reference_linear
from sglang_fp8rl.quant import quantize_activation_groups, quantize_blockwise
from sglang_fp8rl.server_args import parse_args

EPS = 1e-6


def silu_and_mul() -> SiluAndMul:
    """SGLang's SiluAndMul on its native forward, built without its __init__ (scripts/bench_norm_quant's helper): that
    reads the process's published server args (0.5.17+), and publishing them here would leave them to every later
    test of this process."""
    from bench_norm_quant import bare_silu_and_mul

    silu = bare_silu_and_mul(SiluAndMul)
    silu._forward_method = silu.forward_native
    return silu


def bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen))).to(torch.bfloat16)


def test_reference_producers_are_sglangs_native_forwards_with_their_own_quantization():
    norm = RMSNorm(256, eps=EPS)
    norm.weight.data = (1 + 0.1 * torch.randn(256)).to(torch.bfloat16)
    x, r = bf16(5, 256, seed=1), bf16(5, 256, seed=2)
    ours_r = r.clone()
    out, q, s = producers.add_rmsnorm_quant(x, norm.weight.data, EPS, ours_r)
    ref_out, ref_r = norm.forward_native(x.clone(), r.clone())
    assert torch.equal(out, ref_out) and torch.equal(ours_r, ref_r)
    ref_q, ref_s = quantize_activation_groups(out, 128)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    alone, _, _ = producers.add_rmsnorm_quant(x, norm.weight.data, EPS)
    assert torch.equal(alone, norm.forward_native(x.clone()))
    gate_up = bf16(3, 512, seed=3)
    out, q, s = producers.silu_mul_quant(gate_up)
    assert torch.equal(out, silu_and_mul().forward_native(gate_up))
    assert torch.equal(q.view(torch.uint8), quantize_activation_groups(out, 128)[0].view(torch.uint8))


def linear(n: int, k: int, block: bool = True) -> torch.nn.Module:
    """A linear of ours as the plan sees it (its method, scheme and weight shape): a stand-in for a loaded layer."""
    layer = torch.nn.Module()
    layer.quant_method = object.__new__(Fp8OnlineBlockwiseLinearMethod)
    layer._fp8rl = types.SimpleNamespace(is_block=block, block_size=(128, 128))
    layer.weight = torch.nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
    return layer


def decoder_layer(hidden: int, inter: int, qkv: torch.nn.Module | None = None, down_block: bool = True,
                  norm: torch.nn.Module | None = None) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.input_layernorm = norm or RMSNorm(hidden, eps=EPS)
    layer.post_attention_layernorm = RMSNorm(hidden, eps=EPS)
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = qkv if qkv is not None else linear(3 * hidden, hidden)
    layer.mlp = torch.nn.Module()
    layer.mlp.gate_up_proj = linear(2 * inter, hidden)
    layer.mlp.act_fn = silu_and_mul()
    layer.mlp.down_proj = linear(hidden, inter, block=down_block)
    return layer


def test_the_plan_wires_exactly_the_producers_of_block_fp8_linears():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([
        decoder_layer(256, 384),
        decoder_layer(256, 384, qkv=torch.nn.Linear(256, 768), down_block=False),  # BF16 qkv, per-channel down
        decoder_layer(256, 384, norm=RMSNorm(256, eps=EPS, cast_x_before_out_mul=True)),
        decoder_layer(16384, 384),
    ])
    wire, left = hook.plan(model)
    assert [name for name, _, _ in wire] == [
        "layers.0.input_layernorm", "layers.0.post_attention_layernorm", "layers.0.mlp.act_fn",
        "layers.1.post_attention_layernorm", "layers.2.post_attention_layernorm", "layers.2.mlp.act_fn",
        "layers.3.mlp.act_fn"]
    assert left == {
        "layers.1.input_layernorm": "its linear is not block-FP8 (a BF16 layer)",
        "layers.1.mlp.act_fn": "its linear fell back to per-channel FP8",
        "layers.2.input_layernorm": "it rounds to BF16 before the weight multiply",
        "layers.3.input_layernorm": "its width 16384 is above 8192",
        "layers.3.post_attention_layernorm": "its width 16384 is above 8192"}


def test_deterministic_inference_wires_nothing(caplog):
    model = torch.nn.Module()
    model.layer = decoder_layer(256, 384)
    with caplog.at_level(logging.INFO, logger=hook.__name__):
        assert hook.install(model, types.SimpleNamespace(enable_deterministic_inference=True)) == 0
    assert "off under deterministic inference" in caplog.text
    assert "forward" not in vars(model.layer.input_layernorm)


def test_a_wired_norm_hands_over_its_codes_and_falls_back_for_every_call_it_does_not_take(monkeypatch, caplog):
    model = torch.nn.Module()
    model.layer = decoder_layer(256, 384)
    with caplog.at_level(logging.INFO, logger=hook.__name__):
        assert hook.install(model, None) == 3
    assert "3 producers quantize their output for a block-FP8 linear; 0 left as they are" in caplog.text
    norm, silu = model.layer.input_layernorm, model.layer.mlp.act_fn
    x, r = bf16(4, 256, seed=4), bf16(4, 256, seed=5)
    out, residual = norm(x, r.clone())
    ref_out, ref_residual = RMSNorm.forward_native(norm, x.clone(), r.clone())
    assert torch.equal(out, ref_out) and torch.equal(residual, ref_residual)
    codes, scales = producers.quantized_input(out)
    assert torch.equal(scales, quantize_activation_groups(out, 128)[1])
    assert producers.quantized_input(silu(bf16(4, 768, seed=6))) is not None
    assert producers.quantized_input(silu(bf16(producers.FUSED_MAX_ROWS, 768, seed=6))) is not None
    assert producers.quantized_input(norm(bf16(producers.FUSED_MAX_ROWS, 256, seed=8))) is not None
    # calls the fused kernel does not take: SGLang's own forward, nothing handed over
    many = producers.FUSED_MAX_ROWS + 1  # a batch above the fused kernels' measured range
    taken_by_sglang = [norm(x.float()), norm(x, r.clone(), r.clone())[0], norm(x.t().contiguous().t()),
                       silu(bf16(4, 640, seed=7)), norm(bf16(many, 256, seed=8)), silu(bf16(many, 768, seed=9))]
    assert all(producers.quantized_input(t) is None for t in taken_by_sglang)
    # the kernel fails once: logged once, SGLang's forward for this call and every later one, of every producer
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(producers, "add_rmsnorm_quant", broken)
    with caplog.at_level(logging.WARNING, logger=hook.__name__):
        out, _ = norm(x, r.clone())
        again = model.layer.post_attention_layernorm(x)
        after = silu(bf16(4, 768, seed=6))
    assert torch.equal(out, ref_out)
    assert all(producers.quantized_input(t) is None for t in (out, again, after))
    assert caplog.text.count("the fused kernel failed (RuntimeError: no kernel here)") == 1


def test_codes_are_handed_over_through_a_reshape_and_never_after_an_in_place_write():
    codes = torch.empty(2, 256)
    out = producers.attach(bf16(2, 256, seed=12), codes, "scales")
    assert producers.quantized_input(out) == (codes, "scales")
    # a reshape of the same rows (as the attention output reaches o_proj) carries them; a slice or a copy does not
    assert producers.quantized_input(out.view(2, 2, 128).view(2, 256)) == (codes, "scales")
    assert producers.quantized_input(out[1:]) is None and producers.quantized_input(out.clone()) is None
    assert producers.quantized_input(out.view(512)) is None  # not rows of the codes' width
    out[0, 0] = 1.0  # e.g. a fused residual add writing the norm's output after it was quantized
    assert producers.quantized_input(out) is None
    again = producers.attach(bf16(2, 256, seed=13), codes, "scales")
    again.view(-1).mul_(2)  # a write through a view moves the shared version counter too
    assert producers.quantized_input(again) is None


def test_under_inference_mode_the_producers_compute_as_before_and_hand_nothing_over():
    """SGLANG_ENABLE_TORCH_INFERENCE_MODE: the forward's tensors are inference tensors, without the version counter
    that tells an in-place write; a wired norm and SiLU still give SGLang's output and hand no codes over (their
    linears quantize as before), and no call raises."""
    model = torch.nn.Module()
    model.layer = decoder_layer(256, 384)
    assert hook.install(model, None) == 3
    norm, silu = model.layer.input_layernorm, model.layer.mlp.act_fn
    x, r = bf16(4, 256, seed=14), bf16(4, 256, seed=15)
    with torch.inference_mode():
        out, residual = norm(x.clone(), r.clone())
        gate_up = bf16(4, 768, seed=16).clone()
        assert out.is_inference() and producers.quantized_input(out) is None
        assert producers.quantized_input(silu(gate_up)) is None
        assert producers.quantized_input(producers.attach(out.clone(), torch.empty(4, 256), "scales")) is None
    ref_out, ref_residual = RMSNorm.forward_native(norm, x.clone(), r.clone())
    assert torch.equal(out, ref_out) and torch.equal(residual, ref_residual)


def test_the_reference_linear_computes_with_the_handed_codes():
    layer = linear(128, 256)
    wq, ws = quantize_blockwise(bf16(128, 256, seed=8))
    layer.weight.data, layer.weight_scale_inv = wq, torch.nn.Parameter(ws, requires_grad=False)
    layer._fp8rl.is_block = True
    x, other = bf16(3, 256, seed=9), bf16(3, 256, seed=10)
    plain = reference_linear(layer, x, None)
    assert torch.equal(reference_linear(layer, producers.attach(x.clone(), *quantize_activation_groups(x, 128)), None),
                       plain)
    handed_other = producers.attach(x.clone(), *quantize_activation_groups(other, 128))
    assert torch.equal(reference_linear(layer, handed_other, None), reference_linear(layer, other, None))


def test_the_selected_gemm_takes_the_handed_codes_where_it_can(monkeypatch):
    codes = torch.empty(2, 256)
    x = producers.attach(bf16(2, 256, seed=11), codes, "scales")
    weight, scale = torch.empty(128, 256), torch.empty(1, 2)
    calls = []

    def ours(*args):
        calls.append(("ours", args[:2]))
        return "ours-out"

    lookup.install({lookup.shape_key(128, 256, lookup.m_bucket(2)): "fp8rl_stub"},
                   {DEFAULT: Candidate(DEFAULT, None), "fp8rl_stub": Candidate("fp8rl_stub", None, prequantized=ours)})
    try:
        assert lookup.apply_prequantized(producers.quantized_input(x), x, weight, scale, None) == "ours-out"
        assert len(calls) == 1 and calls[0][1][0] is codes and calls[0][1][1] == "scales"
        lookup.install({}, {})
        # the default: SGLang's DeepGEMM GEMM launch where it runs DeepGEMM, else None (the linear quantizes x)
        deepgemm.prequantized_default_reason.cache_clear()
        monkeypatch.setattr(deepgemm, "detect", lambda *a: deepgemm.DeepGemmFacts())
        assert lookup.apply_prequantized(producers.quantized_input(x), x, weight, scale, None) is None
        assert deepgemm.prequantized_default_reason() == \
            "SGLang's block-FP8 linear is not DeepGEMM with float32 scales here"
    finally:
        lookup.reset_state()
        deepgemm.prequantized_default_reason.cache_clear()


def test_the_num_sms_variants_run_sglangs_gemm_launch_on_the_codes_under_their_sm_count(monkeypatch):
    """A num_sms DeepGEMM candidate (chosen at larger M) takes handed codes: SGLang's GEMM launch on them while the SM
    count is its own, restored after (SGLang's own ``configure_deep_gemm_num_sms``, with DeepGEMM faked on)."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.deep_gemm_wrapper import entrypoint

    from sglang_fp8rl.kernels.gemm_select import candidates

    sms = [100]
    monkeypatch.setattr(entrypoint, "ENABLE_JIT_DEEPGEMM", True)
    monkeypatch.setattr(entrypoint, "deep_gemm", types.SimpleNamespace(get_num_sms=lambda: sms[-1],
                                                                       set_num_sms=sms.append), raising=False)
    assert deep_gemm_wrapper.configure_deep_gemm_num_sms is entrypoint.configure_deep_gemm_num_sms
    seen = []
    monkeypatch.setattr(candidates, "prequantized_default", lambda *a: seen.append((a[:2], sms[-1])) or "deepgemm-out")
    reg = candidates.make_candidates()
    variants = [c for c in reg.values() if c.num_sms is not None]
    assert variants and all(c.prequantized is not None for c in variants)
    for c in variants:
        assert c.prequantized("codes", "scales", None, None, None, None) == "deepgemm-out"
        assert seen[-1] == (("codes", "scales"), c.num_sms) and sms[-1] == 100


def test_the_option_is_off_by_default_and_checked():
    assert parse_args([]).producer_quant == "off"
    assert parse_args(["--fp8rl-producer-quant", "on"]).producer_quant == "on"
    from sglang_fp8rl.server_args import Fp8rlOptions

    with pytest.raises(ValueError, match="--fp8rl-producer-quant must be one of"):
        Fp8rlOptions(producer_quant="always")
