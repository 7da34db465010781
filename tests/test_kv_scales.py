"""FP8 KV-cache scales (sglang_fp8rl.kv_scales): numerics against a float64 reference, the plumbing through SGLang's
real ``RadixAttention`` objects, the decode fold, and recalibration through SGLang's real CPU ModelRunner.

The numeric reference is exact: ``max(amax, 2**-10) * margin / 448`` is a ``Fraction``; the pow2 scale is the smallest
``2**e`` not below it, the fp32 scale the smallest float32 not below it (both found by exact comparisons).

Model-level scenarios run in a fresh process (``python tests/test_kv_scales.py SCENARIO ...``): SGLang's ModelRunner
owns process-global state.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import types
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_fp8rl.compat.updates import updater_of
from sglang_fp8rl.cpu_runner import install_cpu_stubs

install_cpu_stubs()

from sglang_fp8rl.kv_scales import (  # noqa: E402
    calibrate,
    decode_fold,
    default_kv_scale_mode,
    forward,
    layers,
    numerics,
    observer,
)

E4M3_MAX = 448
FLOOR = Fraction(1, 1024)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True, max_examples=300)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)

# =====================================================================================================================
# float64 / exact reference


def exact_target(amax: float, margin: float) -> Fraction:
    return max(Fraction(amax), FLOOR) * Fraction(margin) / E4M3_MAX


def ceil_pow2_ref(x: Fraction) -> float:
    """Smallest power of two >= x."""
    e = math.floor(math.log2(float(x))) - 2
    while Fraction(2) ** e < x:
        e += 1
    return float(Fraction(2) ** e)


def ceil_fp32_ref(x: Fraction) -> float:
    """Smallest float32 >= x."""
    f = np.float32(float(x))
    while Fraction(float(f)) < x:
        f = np.nextafter(f, np.float32(np.inf))
    while Fraction(float(np.nextafter(f, np.float32(0)))) >= x:
        f = np.nextafter(f, np.float32(0))
    return float(f)


def ref_pow2(amax: float, margin: float) -> float:
    return ceil_pow2_ref(exact_target(amax, margin))


def ref_fp32(amax: float, margin: float) -> float:
    return ceil_fp32_ref(exact_target(amax, margin))


amaxes = st.one_of(
    st.floats(min_value=0, max_value=BF16_MAX, allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([0.0, 2.0**-149, 2.0**-10, 1.0, 224.0, 448.0, 3.0e38]),
)
margins = st.one_of(st.sampled_from([1.0, 1.05, 2.0, 4.0]), st.floats(min_value=1.0, max_value=64.0))


# =====================================================================================================================
# numerics


@settings(**SETTINGS)
@given(st.lists(st.tuples(amaxes, amaxes), min_size=1, max_size=6), margins, st.sampled_from(numerics.KV_SCALE_FORMATS))
def test_scales_match_exact_reference(rows, margin, scale_format):
    policy = numerics.ScalePolicy(margin=margin, scale_format=scale_format)
    amax = torch.tensor(rows, dtype=torch.float32)  # K/V amax arrive as float32
    rows = amax.tolist()
    got = numerics.scales_from_amax(amax, policy)
    ref = ref_pow2 if scale_format == "pow2" else ref_fp32
    assert got.dtype == torch.float32 and got.shape == (len(rows), 2)
    for (ka, va), (ks, vs) in zip(rows, got.tolist()):
        assert ks == ref(ka, margin) and vs == ref(va, margin)
        for amax, s in ((ka, ks), (va, vs)):
            assert Fraction(s) * E4M3_MAX >= max(Fraction(amax), FLOOR) * Fraction(margin)  # headroom >= margin
            if scale_format == "pow2":
                assert math.frexp(s)[0] == 0.5  # a power of two


@settings(**SETTINGS)
@given(st.floats(min_value=2.0**-10, max_value=1e4, width=32), margins)
def test_calibrated_amax_never_saturates_and_division_is_one_rounding(amax, margin):
    """x / scale of every |x| <= amax stays <= 448 / margin, and a pow2 scale divides BF16 values exactly."""
    x = torch.linspace(-amax, amax, 257).to(torch.bfloat16)
    scale = numerics.scales_from_amax(x.abs().max().float(), numerics.ScalePolicy(margin=margin))  # 0-d, as SGLang's
    q = x / scale  # what the MHA pool does before the cast (memory_pool.py:2340-2343)
    assert q.dtype == torch.bfloat16
    assert float(q.abs().max()) <= E4M3_MAX / margin
    assert torch.equal(q.double(), x.double() / scale.double())  # exact: no rounding before the E4M3 cast


def test_floor_and_all_zero_layer():
    got = numerics.scales_from_amax(torch.zeros(3, 2))
    assert torch.equal(got, torch.full((3, 2), ref_pow2(0.0, numerics.DEFAULT_KV_MARGIN)))
    assert float(got[0, 0]) == 2.0**-17  # 2**-10 * 2 / 448 ~ 4.4e-6 -> 2**-17


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1.0])
def test_non_finite_or_negative_amax_is_rejected_by_name(bad):
    amax = torch.ones(3, 2)
    amax[1, 1] = bad
    with pytest.raises(ValueError, match="layer 7 V"):
        numerics.scales_from_amax(amax, labels=["layer 3", "layer 7", "layer 9"])


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf"), 1e39, 1e-50])
def test_check_scales_rejects_what_float32_cannot_hold_positive(bad):
    with pytest.raises(ValueError, match="layer 1 K"):
        numerics.check_scales(torch.tensor([[0.5, 0.5], [bad, 0.5]], dtype=torch.float64), ["layer 0", "layer 1"])


@settings(**SETTINGS)
@given(st.floats(min_value=1e-30, max_value=1e30), st.sampled_from(numerics.KV_SCALE_FORMATS))
def test_round_scales_is_the_ceiling(value, scale_format):
    got = float(numerics.round_scales(torch.tensor([value], dtype=torch.float64),
                                      numerics.ScalePolicy(scale_format=scale_format))[0])
    ref = (ceil_pow2_ref if scale_format == "pow2" else ceil_fp32_ref)(Fraction(value))
    assert got == ref and Fraction(got) >= Fraction(value)


def test_round_scales_rejects_a_ceiling_past_float32():
    with pytest.raises(ValueError):
        numerics.round_scales(torch.tensor([3.0e38], dtype=torch.float64))  # its pow2 ceiling is 2**128


@pytest.mark.parametrize("kwargs", [dict(margin=0.5), dict(margin=float("inf")), dict(margin=True),
                                    dict(scale_format="e8m0")])
def test_policy_validation(kwargs):
    with pytest.raises(ValueError):
        numerics.ScalePolicy(**kwargs)


def test_reduce_heads_and_headroom():
    per_head = torch.tensor([[1.0, 5.0, 2.0], [0.5, 0.25, 3.0]])
    assert numerics.reduce_heads(per_head).tolist() == [5.0, 3.0]
    amax = torch.tensor([[5.0, 3.0]])
    scales = numerics.scales_from_amax(amax)
    assert bool((numerics.headroom(amax, scales) >= numerics.DEFAULT_KV_MARGIN).all())


def test_default_mode():
    assert default_kv_scale_mode("fp8_e4m3", "fp8_online_blockwise") == "calibrate"
    assert default_kv_scale_mode("fp8_e4m3", None) == "static"
    assert default_kv_scale_mode("auto", "fp8_online_blockwise") == "static"
    assert default_kv_scale_mode("fp8_e5m2", "fp8_online_blockwise") == "static"


# =====================================================================================================================
# SGLang's RadixAttention objects (they construct on CPU)


def radix_layers(n=3, q_heads=4, kv_heads=2, head_dim=16, quant_config=None):
    from sglang.srt.layers.radix_attention import RadixAttention

    return [RadixAttention(q_heads, head_dim, head_dim**-0.5, kv_heads, layer_id=i, quant_config=quant_config,
                           prefix=f"model.layers.{i}.self_attn.attn") for i in range(n)]


def as_model(mods):
    return torch.nn.ModuleList(mods)


def test_attach_gives_unit_tensors_and_floats():
    mods = radix_layers()
    assert mods[0].k_scale is None  # what Qwen3 gets: no quant_config reaches RadixAttention
    got = layers.attach_scales(as_model(mods), "cpu")
    assert [m.layer_id for m in got] == [0, 1, 2]
    for m in mods:
        for n in numerics.KV_NAMES:
            t = getattr(m, f"{n}_scale")
            assert t.dtype == torch.float32 and t.dim() == 0 and float(t) == 1.0
            assert getattr(m, f"{n}_scale_float") == 1.0
        assert "k_scale" not in dict(m.named_parameters())
    ptrs = [m.k_scale.data_ptr() for m in mods]
    layers.attach_scales(as_model(mods), "cpu")  # idempotent: same storage
    assert ptrs == [m.k_scale.data_ptr() for m in mods]


def test_attach_adopts_sglang_kv_method_parameters_and_float_scales():
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    mods = radix_layers(n=2)
    mods[0] = radix_layers(n=1, quant_config=Fp8Config())[0]  # Fp8KVCacheMethod: k_scale/v_scale parameters at -1
    mods[0].quant_method.process_weights_after_loading(mods[0])  # -1 -> 1.0 ("Defaulting to scaling factors of 1.0")
    param_ptr = mods[0].k_scale.data_ptr()
    # what load_kv_cache_scales assigns (qwen2.py:457-459); on a layer with KV parameters it raises TypeError
    mods[1].k_scale, mods[1].v_scale = 0.25, 0.5
    layers.attach_scales(as_model(mods), "cpu")
    assert mods[0].k_scale.data_ptr() == param_ptr and mods[0].k_scale_float == 1.0
    assert float(mods[1].k_scale) == 0.25 and mods[1].v_scale_float == 0.5


def test_attach_refuses_a_parameter_it_cannot_adopt():
    (layer,) = radix_layers(n=1)
    layer.k_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)  # shape [1]: replacing it would fail
    with pytest.raises(ValueError, match="cannot adopt"):
        layers.attach_scales(as_model([layer]), "cpu")


def test_write_in_place_keeps_storage_and_floats_consistent():
    mods = radix_layers()
    attached = layers.attach_scales(as_model(mods), "cpu")
    ptrs = [(m.k_scale.data_ptr(), m.v_scale.data_ptr()) for m in mods]
    written = layers.write_scales(attached, {0: (0.125, 2.0**-5), 2: (4.0, 0.1)})
    assert written == {0: (0.125, 2.0**-5), 2: (4.0, float(np.float32(0.1)))}
    assert ptrs == [(m.k_scale.data_ptr(), m.v_scale.data_ptr()) for m in mods]
    assert layers.read_scales(attached) == {0: (0.125, 2.0**-5), 1: (1.0, 1.0), 2: (4.0, float(np.float32(0.1)))}
    assert layers.tensors_match_floats(attached)


@pytest.mark.parametrize("bad", [{1: (float("nan"), 1.0)}, {1: (1.0, 0.0)}, {1: (-2.0, 1.0)}, {1: (1.0, 1e39)},
                                 {5: (1.0, 1.0)}])
def test_write_is_all_or_nothing(bad):
    mods = radix_layers()
    attached = layers.attach_scales(as_model(mods), "cpu")
    with pytest.raises(ValueError):
        layers.write_scales(attached, {0: (0.5, 0.5), **bad})
    assert layers.read_scales(attached) == {i: (1.0, 1.0) for i in range(3)}
    assert layers.tensors_match_floats(attached)


def test_write_refuses_layers_without_tensors():
    mods = radix_layers(n=1)
    with pytest.raises(ValueError, match="attach_scales"):
        layers.write_scales(mods, {0: (0.5, 0.5)})


@pytest.mark.parametrize("name, target", [
    ("model.layers.3.self_attn.k_scale", (3, "k")),
    ("model.layers.3.self_attn.v_scale", (3, "v")),
    ("model.layers.12.self_attn.k_proj.k_scale", (12, "k")),
    ("model.layers.12.self_attn.v_proj.v_scale", (12, "v")),
    ("model.layers.0.self_attn.attn.k_scale", (0, "k")),
    ("model.layers.4.self_attn.kv_scale", (4, "kv")),
    ("model.language_model.layers.2.self_attn.k_scale", (2, "k")),
    ("model.layers.3.self_attn.k_proj.weight", None),
    ("model.layers.3.self_attn.k_proj.weight_scale", None),
    ("model.layers.3.mlp.down_proj.input_scale", None),
    ("model.layers.3.self_attn.q_scale", None),
])
def test_kv_scale_names(name, target):
    got = layers.parse_kv_scale_name(name)
    assert (got if got is None else (got.layer, got.which)) == target


def test_contradictory_name_is_an_error():
    with pytest.raises(ValueError, match="k_proj cannot carry a v_scale"):
        layers.parse_kv_scale_name("model.layers.1.self_attn.k_proj.v_scale")


def test_kv_scale_values_and_merge():
    named = [("model.layers.0.self_attn.k_scale", torch.tensor(0.25)),
             ("model.layers.1.self_attn.kv_scale", torch.tensor([0.5], dtype=torch.bfloat16)),
             ("model.layers.2.self_attn.v_proj.v_scale", torch.tensor(2.0, dtype=torch.float64))]
    values = layers.kv_scale_values(named)
    assert values == {0: {"k": 0.25}, 1: {"k": 0.5, "v": 0.5}, 2: {"v": 2.0}}
    merged = layers.merge_scales({0: (1.0, 1.0), 1: (1.0, 1.0), 2: (3.0, 3.0)}, values)
    assert merged == {0: (0.25, 1.0), 1: (0.5, 0.5), 2: (3.0, 2.0)}
    with pytest.raises(ValueError, match="given twice"):
        layers.kv_scale_values(named + [("model.layers.1.self_attn.v_scale", torch.tensor(1.0))])
    with pytest.raises(ValueError, match="one element"):
        layers.kv_scale_values([("model.layers.0.self_attn.k_scale", torch.ones(2))])
    with pytest.raises(ValueError, match="unknown"):
        layers.merge_scales({0: (1.0, 1.0)}, {3: {"k": 1.0}})


# =====================================================================================================================
# observer


def extend_batch(num_tokens):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_num_tokens=num_tokens, batch_size=1)


@settings(**SETTINGS)
@given(st.integers(1, 9), st.integers(0, 9), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1))
def test_head_amax_matches_reference(tokens, padding, heads, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens + padding, heads * 8, generator=g) * 10).to(torch.bfloat16)
    x[tokens:] = 1e4  # padding rows must not count
    got = observer.head_amax(x, heads, tokens)
    ref = x[:tokens].double().abs().reshape(tokens, heads, 8).amax(dim=(0, 2))
    assert torch.equal(got.double(), ref)


class RecordingBackend:
    """Stands in for an attention backend in unit tests (the real one is exercised by the model scenarios)."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return q


def test_observer_records_real_radix_attention_calls_and_restores_the_backend():
    mods = radix_layers(n=2, kv_heads=2, head_dim=4)
    backend = RecordingBackend()
    obs = observer.KVAmaxObserver()
    k0 = torch.tensor([[1.0, -2, 0, 0, 0, 0, 3, 0], [0, 0, 0, 0, 0, 0, 0, -9]])  # 2 tokens x (2 heads x 4)
    v0 = torch.tensor([[0.5, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, -7, 0, 0, 0]])
    with observer.observing(backend, obs):
        backend.forward(None, k0, v0, mods[0], extend_batch(1))  # only the first token is valid
        backend.forward(None, k0, v0, mods[0], extend_batch(2))
        backend.forward(None, k0 * 2, v0, mods[1], extend_batch(2))
        backend.forward(None, None, None, mods[1], extend_batch(2))  # cross-layer KV sharing: nothing to see
    assert "forward" not in vars(backend)
    per_head = obs.per_head([0, 1])
    assert per_head[0][0].tolist() == [2.0, 9.0] and per_head[0][1].tolist() == [0.5, 7.0]
    assert per_head[1][0].tolist() == [4.0, 18.0]
    assert obs.table([0, 1]).tolist() == [[9.0, 7.0], [18.0, 7.0]]
    assert obs.tokens == {0: 3, 1: 2}
    with pytest.raises(ValueError, match="never reached attention layer"):
        obs.table([0, 1, 2])


def test_observing_restores_an_instance_forward():
    backend = RecordingBackend()
    own = backend.forward
    backend.forward = own
    with observer.observing(backend, observer.KVAmaxObserver()):
        assert backend.forward is not own
    assert vars(backend)["forward"] is own


# =====================================================================================================================
# decode fold


def test_backend_classes_are_classified():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert decode_fold.scale_source(object.__new__(TritonAttnBackend)) == "float"
    assert decode_fold.scale_source(object.__new__(TorchNativeAttnBackend)) == "none"
    assert decode_fold.install_decode_fold(object.__new__(TorchNativeAttnBackend)) is False
    with pytest.raises(decode_fold.UnsupportedBackend):
        decode_fold.scale_source(RecordingBackend())


def _float_reading_backend_class():
    """SGLang's TritonAttnBackend class with a torch decode that reads the floats the way its kernel call does
    (triton_backend.py:1780-1782); the first call freezes them, as a captured CUDA graph does. SGLang's own
    kernels need CUDA (the Triton interpreter mis-handles BF16/FP8): see the gpu tests below."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    class Frozen(TritonAttnBackend):
        def __init__(self, k_cache, v_cache):
            self.k_cache, self.v_cache, self.frozen = k_cache, v_cache, {}

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            k_descale, v_descale = self.frozen.setdefault(layer.layer_id, (layer.k_scale_float, layer.v_scale_float))
            logits = (q.double() @ self.k_cache.double().T) * layer.scaling * k_descale
            return (torch.softmax(logits, -1) @ self.v_cache.double()) * v_descale

    return Frozen


def test_fold_makes_a_frozen_float_decode_follow_the_tensors():
    g = torch.Generator().manual_seed(0)
    k_true, v_true, q = (torch.randn(6, 8, generator=g) * 20).double(), torch.randn(6, 8, generator=g).double(), \
        torch.randn(1, 8, generator=g).double()
    (layer,) = radix_layers(n=1, q_heads=1, kv_heads=1, head_dim=8)
    layers.attach_scales(as_model([layer]), "cpu")
    reference = torch.softmax((q @ k_true.T) * layer.scaling, -1) @ v_true

    def run(folded, scales):
        backend = _float_reading_backend_class()(k_true / scales[0], v_true / scales[1])  # the cache under `scales`
        if folded:
            assert decode_fold.install_decode_fold(backend) and decode_fold.is_folded(backend)
            assert decode_fold.install_decode_fold(backend)  # idempotent
        layers.write_scales([layer], {0: (1.0, 1.0)})
        backend.forward_decode(q, None, None, layer, None)  # "capture" with the old scales
        layers.write_scales([layer], {0: scales})  # recalibrated afterwards
        return backend.forward_decode(q, None, None, layer, None)

    new = (0.125, 2.0**-6)
    assert not torch.allclose(run(False, new), reference)  # stale floats: wrong attention
    assert torch.allclose(run(True, new), reference, rtol=1e-12, atol=0)
    assert (layer.k_scale_float, layer.v_scale_float) == new  # restored after each folded call


def _triton_kernel_backend(k_cache, v_cache, q_heads, splits=4):
    """SGLang's TritonAttnBackend class whose decode is exactly its kernel call with the layer's floats
    (triton_backend.py:1780-1782, 1841-1856); static buffers, so the call can be captured in a CUDA graph."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    tokens, _, dim = k_cache.shape
    batch = 4
    dev = k_cache.device

    class KernelBackend(TritonAttnBackend):
        def __init__(self):
            self.indptr = torch.arange(0, tokens + 1, tokens // batch, dtype=torch.int32, device=dev)
            self.indices = torch.arange(tokens, dtype=torch.int64, device=dev)
            self.logits = torch.empty(batch, q_heads, splits, dim, dtype=torch.float32, device=dev)
            self.lse = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=dev)
            self.splits = torch.full((batch,), splits, dtype=torch.int32, device=dev)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            o = torch.empty(batch, q_heads, dim, dtype=q.dtype, device=dev)
            decode_attention_fwd(q.view(batch, q_heads, dim), k_cache, v_cache, o, self.indptr, self.indices,
                                 self.logits, self.lse, self.splits, splits, layer.scaling, layer.k_scale_float,
                                 layer.v_scale_float)
            return o

    return KernelBackend()


@pytest.mark.gpu
def test_cuda_e4m3_cast_overflows_to_nan_and_the_saturating_write_does_not_gpu():
    """On CUDA an E4M3 cast past 448 gives NaN (measured on an H100, torch 2.11), so the engine's K/V write
    saturates after dividing by the scale (hooks/kv_cache.wrap_set_kv_buffer); this pins both facts."""
    x = torch.tensor([447.0, 464.0, 465.0, 1000.0, -3.0e4], dtype=torch.bfloat16, device="cuda")
    cast = x.to(torch.float8_e4m3fn).float().cpu()
    assert torch.isnan(cast[3:]).all()  # the reason for the saturating write
    saturated = numerics.saturating_scale_(x.clone(), torch.tensor(1.0, device="cuda"))
    assert saturated.to(torch.float8_e4m3fn).float().cpu().tolist() == [448.0, 448.0, 448.0, 448.0, -448.0]


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads", [8, 32])  # 8 KV heads: Triton's MHA kernel (8) and its grouped kernel (32)
def test_triton_decode_graph_follows_recalibrated_scales_gpu(q_heads):
    """A decode CUDA graph captured before a recalibration reads the new scales at replay, through the fold."""
    kv_heads, dim, tokens = 8, 128, 4 * 64
    g = torch.Generator(device="cuda").manual_seed(0)
    k_true = (torch.randn(tokens, kv_heads, dim, device="cuda", generator=g) * 40).to(torch.bfloat16)
    v_true = (torch.randn(tokens, kv_heads, dim, device="cuda", generator=g) * 2).to(torch.bfloat16)
    q = (torch.randn(4, q_heads * dim, device="cuda", generator=g) * 4).to(torch.bfloat16)
    k_cache = torch.empty(tokens, kv_heads, dim, dtype=torch.float8_e4m3fn, device="cuda")
    v_cache = torch.empty_like(k_cache)
    (layer,) = radix_layers(n=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=dim)
    layers.attach_scales(as_model([layer]), "cuda")

    def set_scales(ks, vs):  # what a recalibration does: new scales in place, the cache rewritten under them
        layers.write_scales([layer], {0: (ks, vs)})
        k_cache.copy_(numerics.saturating_scale_(k_true.clone(), layer.k_scale).to(torch.float8_e4m3fn))
        v_cache.copy_(numerics.saturating_scale_(v_true.clone(), layer.v_scale).to(torch.float8_e4m3fn))

    def captured(backend):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            backend.forward_decode(q, None, None, layer, None)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward_decode(q, None, None, layer, None)
        return graph, out

    set_scales(1.0, 1.0)
    plain, folded = _triton_kernel_backend(k_cache, v_cache, q_heads), _triton_kernel_backend(k_cache, v_cache,
                                                                                              q_heads)
    assert decode_fold.install_decode_fold(folded)
    plain_graph, plain_out = captured(plain)
    folded_graph, folded_out = captured(folded)

    amax = torch.stack([k_true.abs().amax(), v_true.abs().amax()]).double().cpu()[None]
    new = tuple(numerics.scales_from_amax(amax)[0].tolist())  # what the engine's calibration picks
    assert new[1] != 1.0  # V's scale moves: the graph captured at (1, 1) is stale without the fold
    set_scales(*new)
    native = plain.forward_decode(q, None, None, layer, None)  # eager, floats read now: SGLang's own result
    plain_graph.replay()
    folded_graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(plain_out, native)  # the unfolded graph kept the captured floats: stale scales
    assert torch.equal(folded_out, folded.forward_decode(q, None, None, layer, None))  # graph == eager fold
    if q_heads == kv_heads:  # q stays BF16 in the MHA kernel: the fold is exact
        assert torch.equal(folded_out, native)
    else:  # the grouped kernel casts q to FP8 (decode_attention.py:487): only q * s_k outside E4M3's range differs
        assert torch.allclose(folded_out.float(), native.float(), rtol=0.05, atol=0.02)


# =====================================================================================================================
# calibration batch


class WordTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [sum(map(ord, w)) % 300 for w in text.split()]


def test_recalibration_measures_under_the_given_scales_and_restores_them_on_failure(monkeypatch):
    """FlashInfer's paged prefill attends to the FP8 cache: the engine calibrates under its start-up scales, so that
    a recalibration measures what a fresh server measures. During the forward the layers hold ``under``; after it the
    new scales (the record's ``changed`` against the scales that served); a failed forward leaves the served ones."""
    mods = radix_layers(n=2)
    model = as_model(mods)
    layers.attach_scales(model, "cpu")
    served = {0: (0.5, 4.0), 1: (2.0, 0.25)}
    layers.write_scales(mods, served)
    runner = types.SimpleNamespace(model=model)
    seen = []

    def measure(model_runner, token_ids, group=None):
        seen.append(layers.read_scales(mods))
        return torch.tensor([[448.0, 896.0], [224.0, 112.0]], dtype=torch.float64)

    monkeypatch.setattr(calibrate, "measure_amax", measure)
    under = {0: (1.0, 1.0), 1: (1.0, 1.0)}
    cal = calibrate.recalibrate(runner, [[1, 2]], numerics.ScalePolicy(margin=1.0), under=under)
    assert seen == [under]
    assert layers.read_scales(mods) == cal.scales == {0: (1.0, 2.0), 1: (0.5, 0.25)}
    assert cal.changed == (0, 1)  # layer 1's V kept its served value, its K did not

    def failing(model_runner, token_ids, group=None):
        raise RuntimeError("KV calibration needs 2 free KV slots, 0 are free")

    monkeypatch.setattr(calibrate, "measure_amax", failing)
    with pytest.raises(RuntimeError, match="free KV slots"):
        calibrate.recalibrate(runner, [[1, 2]], under=under)
    assert layers.read_scales(mods) == cal.scales
    assert layers.tensors_match_floats(mods)


def test_calibration_token_ids_default_batch():
    ids = calibrate.calibration_token_ids(WordTokenizer(), num_seqs=3, seq_len=50)
    assert [len(s) for s in ids] == [50, 50, 50]
    assert len({tuple(s[:5]) for s in ids}) == 3  # different offsets: no shared prefix
    assert calibrate.check_token_ids(ids, vocab_size=300) == 150
    with pytest.raises(ValueError, match="outside the vocabulary"):
        calibrate.check_token_ids([[1, 300]], vocab_size=300)
    with pytest.raises(ValueError, match="more than"):
        calibrate.check_token_ids(ids, vocab_size=300, max_tokens=100)
    with pytest.raises(ValueError, match="no empty"):
        calibrate.check_token_ids([[1], []], vocab_size=300)


def test_load_token_ids(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps([[1, 2, 3], [4]]))
    assert calibrate.load_token_ids(str(path)) == [[1, 2, 3], [4]]
    path.write_text(json.dumps({"ids": [1]}))
    with pytest.raises(ValueError, match="list of token-id lists"):
        calibrate.load_token_ids(str(path))


def test_record_as_dict():
    record = calibrate.KVScaleRecord()
    assert record.as_dict() == {"writes": 0}
    record.record(calibrate.Calibration(amax={0: (3.0, 1.0)}, scales={0: (2.0**-6, 2.0**-7)}, changed=(0,),
                                        tokens=10, seconds=0.01, finished_at=1.0, source="calibration"))
    d = record.as_dict()
    assert d["writes"] == 1 and d["scales"] == {"0": [2.0**-6, 2.0**-7]} and d["changed_layers"] == [0]
    json.dumps(d)


# =====================================================================================================================
# SGLang's CPU ModelRunner (subprocess scenarios)

QUANT = ("--quantization", "fp8_online_blockwise")
CALIB_IDS = [[(7 * i + j) % 300 + 1 for j in range(40)] for i in range(3)]


def run_scenario(scenario, model_dir, out, *server_args, tp_size=1, timeout=600):
    """This file as a worker, one process per TP rank (gloo on CPU); every rank is killed past ``timeout``."""
    env = dict(os.environ, SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r % os.cpu_count()) for r in range(tp_size)))
    env.pop("FP8RL_OPTIONS", None)
    extra = list(server_args)
    if tp_size > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            extra += ["--tp-size", str(tp_size), "--nccl-port", str(s.getsockname()[1])]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), scenario, model_dir, f"{out}.{rank}.pt",
                               str(rank), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in range(tp_size)]
    results = []
    for rank, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(
                f"rank {rank} of {scenario} still running after {timeout} s (a hung collective?)") from None
        assert proc.returncode == 0, f"rank {rank} of {scenario} failed:\n{log[-8000:]}"
        results.append(torch.load(f"{out}.{rank}.pt", weights_only=False))
    return results


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sgl_model import TINY, write_checkpoint

    d = tmp_path_factory.mktemp("kv")
    write_checkpoint(str(d / "w0"), TINY, seed=3)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_recalibration_through_the_model_runner(tiny, kv_dtype):
    (out,) = run_scenario("calibrate", str(tiny / "w0"), str(tiny / f"cal_{kv_dtype}"), *QUANT,
                          "--kv-cache-dtype", kv_dtype)
    amax, first = out["amax"], out["first_scales"]
    assert out["backend_scale_source"] == "none"  # torch_native on CPU ignores scales; the GPU tests cover the rest
    assert out["free_before"] == out["free_after"]  # every KV slot and request slot given back
    assert out["first_tokens"] == sum(map(len, CALIB_IDS))
    if kv_dtype == "auto":  # the BF16 cache holds exactly the K/V the observer saw: same amax, bit for bit
        assert torch.equal(amax, out["cache_amax"])
    ref = numerics.scales_from_amax(amax)
    assert first == {i: tuple(r) for i, r in enumerate(ref.tolist())}
    assert out["floats_match"] and out["ptrs_stable"]
    assert torch.equal(out["amax_again"], amax)  # deterministic: a fresh server would derive the same scales
    # after an update that multiplies layer 0's v_proj by 8, layer 0's V amax (input: the embeddings) is exactly 8x
    after = out["amax_after_update"]
    assert after[0, 1] == 8 * amax[0, 1] and after[0, 0] == amax[0, 0]
    assert out["scales_after_update"][0][1] == 8 * first[0][1]


@pytest.mark.slow
def test_tp2_ranks_agree_and_match_tp1(tmp_path):
    from sgl_model import TINY, write_checkpoint

    write_checkpoint(str(tmp_path / "w"), dict(TINY, num_key_value_heads=2), seed=4)
    (tp1,) = run_scenario("amax", str(tmp_path / "w"), str(tmp_path / "tp1"), *QUANT)
    r0, r1 = run_scenario("amax", str(tmp_path / "w"), str(tmp_path / "tp2"), *QUANT, tp_size=2)
    assert not torch.equal(r0["local"][0], r1["local"][0])  # each rank holds one KV head of layer 0
    assert torch.equal(r0["amax"], r1["amax"]) and r0["scales"] == r1["scales"]  # the MAX all-reduce
    assert torch.equal(r0["amax"][0], tp1["amax"][0])  # layer 0: the same K/V heads, the same blocks of FP8 weights


# a rank-local failure at each stage of a TP recalibration: tests/test_kv_tp_faults.py


# ---------------------------------------------------------------------------------------------------------------------
# worker side


def _cache_amax(model_runner, layer_ids):
    pool = model_runner.token_to_kv_pool
    return torch.tensor([[float(pool.get_key_buffer(i).float().abs().max()),
                          float(pool.get_value_buffer(i).float().abs().max())] for i in layer_ids], dtype=torch.float64)


def free_slots(model_runner):
    return model_runner.token_to_kv_pool_allocator.available_size(), model_runner.req_to_token_pool.available_size()


def scenario_calibrate(runner):
    mr = runner.torch_runner
    attached = layers.attach_scales(mr.model, mr.device)
    ids = [m.layer_id for m in attached]
    ptrs = [m.k_scale.data_ptr() for m in attached]
    for i in ids:
        mr.token_to_kv_pool.get_key_buffer(i).zero_()
        mr.token_to_kv_pool.get_value_buffer(i).zero_()
    free_before = free_slots(mr)
    amax = calibrate.measure_amax(mr, CALIB_IDS)
    cache_amax = _cache_amax(mr, ids)
    first = calibrate.recalibrate(mr, CALIB_IDS)
    free_after = free_slots(mr)
    amax_again = calibrate.measure_amax(mr, CALIB_IDS)
    from safetensors.torch import load_file  # an update through SGLang's WeightUpdater: layer 0's v_proj x 8

    sd = load_file(os.path.join(mr.server_args.model_path, "model.safetensors"))
    name = "model.layers.0.self_attn.v_proj.weight"
    ok, msg = updater_of(mr).update_weights_from_tensor([(name, sd[name] * 8)])
    assert ok, msg
    after = calibrate.recalibrate(mr, CALIB_IDS)
    return {"amax": amax, "cache_amax": cache_amax, "first_scales": first.scales, "first_tokens": first.tokens,
            "free_before": free_before, "free_after": free_after, "amax_again": amax_again,
            "amax_after_update": torch.tensor([after.amax[i] for i in ids], dtype=torch.float64),
            "scales_after_update": [after.scales[i] for i in ids],
            "floats_match": layers.tensors_match_floats(attached),
            "ptrs_stable": ptrs == [m.k_scale.data_ptr() for m in attached],
            "backend_scale_source": decode_fold.scale_source(mr.attn_backend)}


def tp_group_of():
    """SGLang's TP group of this process (ModelRunner.tp_group up to 0.5.22; parallel_state has it in every release)."""
    from sglang.srt.distributed import parallel_state

    return parallel_state.get_tp_group()


def scenario_amax(runner):
    mr = runner.torch_runner
    attached = layers.attach_scales(mr.model, mr.device)
    ids = [m.layer_id for m in attached]
    obs = observer.KVAmaxObserver()
    with observer.observing(mr.attn_backend, obs):
        forward.calibration_forward(mr, CALIB_IDS)
    local = [k for k, _ in obs.per_head(ids)]
    tp = tp_group_of()
    group = tp.cpu_group if tp.world_size > 1 else None
    cal = calibrate.recalibrate(mr, CALIB_IDS, group=group)
    return {"local": local, "amax": torch.tensor([cal.amax[i] for i in ids], dtype=torch.float64),
            "scales": cal.scales}


SCENARIOS = {"calibrate": scenario_calibrate, "amax": scenario_amax}


def worker_main(argv):
    scenario, model_dir, out, rank, *server_args = argv
    from sglang_fp8rl.cpu_runner import build_runner

    runner = build_runner(model_dir, server_args, int(rank))
    with torch.no_grad():
        result = SCENARIOS[scenario](runner)
    torch.save(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    worker_main(sys.argv[1:])
