"""In-process checks of the update validation's batching (sglang_fp8rl.weight_sync.validate).

The end-to-end behaviour (rejections, equivalence with a cold load, pointer stability) is tested through SGLang's
ModelRunner in test_weight_updates.py. These tests pin how validation scales: one host sync per request for the
finiteness check, and one ``load_weights`` call for the dry run, with an exact per-tensor fallback for models whose
loader buffers items or fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.model_loader.weight_utils import default_weight_loader

from sglang_fp8rl.layers.fp8_storage import copy_pairs
from sglang_fp8rl.weight_sync import finite as F
from sglang_fp8rl.weight_sync import request as R
from sglang_fp8rl.weight_sync import validate as U


def copy_loader(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape {tuple(loaded.shape)} != {tuple(param.shape)}"
    param.data.copy_(loaded)


class TinyModel(torch.nn.Module):
    """Two BF16 parameters with SGLang-style ``weight_loader`` attributes; optionally buffers like a fusing loader."""

    def __init__(self, buffering: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16), requires_grad=False)
        for p in (self.a, self.b):
            p.weight_loader = copy_loader
        self.buffering = buffering
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        params = dict(self.named_parameters())
        held = []
        for name, tensor in weights:
            if name not in params:
                continue
            if self.buffering:
                held.append((name, tensor))
                continue
            params[name].weight_loader(params[name], tensor)
        for name, tensor in held:  # e.g. a model that fuses pairs of tensors at the end
            params[name].weight_loader(params[name], tensor)


def good():
    return [("a", torch.randn(4, 3, dtype=torch.bfloat16)), ("b", torch.randn(5, dtype=torch.bfloat16))]


def test_clean_request_is_one_dry_run_call_and_one_sync(monkeypatch):
    model = TinyModel()
    syncs = []
    real = F.extremes_finite_in_bf16
    monkeypatch.setattr(F, "extremes_finite_in_bf16", lambda ends: syncs.append(ends.numel()) or real(ends))
    validated = R.validate_request(model, model.load_weights, good())
    assert [n for n, _ in validated.to_load] == ["a", "b"] and validated.plain_params == 2
    assert model.calls == 1 and syncs == [4]  # min and max of both (host) tensors, checked together
    assert bool((model.a == 0).all()) and bool((model.b == 0).all())  # a dry run writes nothing


def test_buffering_model_falls_back_to_exact_per_tensor_dry_runs():
    model = TinyModel(buffering=True)
    records = U.dry_run(model, model.load_weights, good())
    assert model.calls == 1 + 2  # the batched call attributed loader calls to no tensor: redone one by one
    assert records["a"].plain_params == 1 and records["b"].plain_params == 1
    assert bool((model.a == 0).all())


def test_error_names_the_right_tensor_even_when_buffered():
    model = TinyModel(buffering=True)
    bad = [good()[0], ("b", torch.randn(6, dtype=torch.bfloat16))]
    with pytest.raises(U.UpdateRejected,
                       match=r"^b: not accepted by TinyModel\.load_weights: ValueError: dimension 0 is 6"):
        R.validate_request(model, model.load_weights, bad)


def test_unknown_name_rejected_after_exact_check():
    model = TinyModel()
    with pytest.raises(U.UpdateRejected, match="^c: not a parameter of TinyModel"):
        R.validate_request(model, model.load_weights, good() + [("c", torch.randn(2))])


@pytest.mark.parametrize("where", [0, 1])
def test_nonfinite_found_with_one_sync_then_named(where):
    tensors = good()
    name, t = tensors[where]
    t.view(-1)[-1] = float("inf")
    with pytest.raises(U.UpdateRejected, match=f"^{name}: contains NaN/Inf in BF16"):
        U.check_tensors(tensors)
    fp32_overflow = [("a", torch.full((4, 3), 3.4e38))]  # finite in FP32, Inf in BF16
    with pytest.raises(U.UpdateRejected, match="^a: contains NaN/Inf in BF16"):
        U.check_tensors(fp32_overflow)


def test_dtype_checked_before_any_reduction():
    with pytest.raises(U.UpdateRejected, match="^b: dtype torch.int32 is not accepted"):
        U.check_tensors([good()[0], ("b", torch.ones(5, dtype=torch.int32))])
    U.check_tensors([("empty", torch.empty(0))])  # nothing to reduce


def test_stream_is_validated_in_chunks(monkeypatch):
    model = TinyModel()
    seen = []
    real = R.validate_request
    monkeypatch.setattr(R, "validate_request",
                        lambda m, lw, named, *rest: seen.append(len(named)) or real(m, lw, named, *rest))
    stream = [good()[0], good()[1]]
    assert R.validate_stream(model, model.load_weights, iter(stream), chunk=1).names == ["a", "b"]
    assert seen == [1, 1]
    seen.clear()
    assert R.validate_stream(model, model.load_weights, iter(stream)).names == ["a", "b"] and seen == [2]
    with pytest.raises(U.UpdateRejected, match="appears more than once"):
        R.validate_stream(model, model.load_weights, iter(stream + [good()[0]]))


class AliasModel(TinyModel):
    """Takes every name also as ``alias.<name>``, as SGLang's Qwen3 takes ``layers.N`` for ``model.layers.N``."""

    def load_weights(self, weights):
        super().load_weights((name.removeprefix("alias."), tensor) for name, tensor in weights)


def test_two_names_for_one_parameter_are_refused_in_a_request_and_across_stream_chunks():
    model = AliasModel()
    a, b = good()
    with pytest.raises(U.UpdateRejected, match="'a' and 'alias.a' write the same a "):
        R.validate_request(model, model.load_weights, [a, ("alias.a", a[1].clone())])
    with pytest.raises(U.UpdateRejected, match="'alias.b' and 'b' write the same b "):
        R.validate_stream(model, model.load_weights, iter([("alias.b", b[1]), a, b]), chunk=1)
    assert R.validate_request(model, model.load_weights, [("alias.a", a[1]), b]).names == ["alias.a", "b"]


def test_dry_run_is_remembered_per_request_signature():
    model = TinyModel()

    R.validate_request(model, model.load_weights, good())
    assert model.calls == 1
    again = R.validate_request(model, model.load_weights, good())  # new values, same names and shapes
    assert model.calls == 1 and again.names == ["a", "b"]
    bad_values = good()
    bad_values[1][1][0] = float("nan")
    with pytest.raises(U.UpdateRejected, match="^b: contains NaN/Inf"):  # values are still checked every time
        R.validate_request(model, model.load_weights, bad_values)
    R.validate_request(model, model.load_weights, good()[:1])  # another signature: a new dry run
    assert model.calls == 2
    wrong = [good()[0], ("b", torch.randn(6, dtype=torch.bfloat16))]
    for _ in range(2):  # a rejected request is never remembered as valid
        with pytest.raises(U.UpdateRejected, match="^b: not accepted"):
            R.validate_request(model, model.load_weights, wrong)
    assert U.request_signature(good()) == (("a", (4, 3), torch.bfloat16, "cpu"), ("b", (5,), torch.bfloat16, "cpu"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["bf16", "fp16", "fp32"]),
                          st.sampled_from(["none", "nan", "inf", "-inf", "huge32", "big"])), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1))
def test_fast_finiteness_check_never_passes_a_bad_tensor(specs, seed):
    """The device path (L1 norm) may raise a false alarm (the exact check then clears it) but never misses a tensor
    that is not finite once rounded to BF16; the host path (min/max per tensor in a thread pool) is exact.
    Float64 reference: |x| beyond BF16's largest finite value, NaN, Inf."""
    g = torch.Generator().manual_seed(seed)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    tensors = []
    for n, dtype, poison in specs:
        t = torch.randn(n, generator=g, dtype=torch.float64)
        value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge32": 3.4e38,
                 "big": 6.0e4}.get(poison)
        if value is not None:
            t[n // 2] = value
        tensors.append(t.to(dtypes[dtype]))
    bf16_max = torch.finfo(torch.bfloat16).max
    bad = any(not bool(torch.isfinite(t.to(torch.bfloat16)).all()) for t in tensors)
    reference_bad = any(bool((~torch.isfinite(t.double()) | (t.double().abs() > bf16_max * (1 + 2**-9))).any())
                        for t in tensors)
    assert bad == reference_bad
    assert F._host_finite_in_bf16(tensors) == (not bad)  # min/max in the host pool: exact
    assert U.all_finite_in_bf16(tensors) == (not bad)  # host tensors take that path
    if bad:
        assert not F._device_finite_in_bf16(tensors)  # the device path's L1 norm (runs on CPU too): conservative


@pytest.mark.parametrize("chunk_bytes", [1, 100, 1 << 20])
def test_host_check_in_chunks_is_exact(monkeypatch, chunk_bytes):
    """The host check's chunks (one tensor each, a few mixed-dtype tensors each, one chunk checked on the calling
    thread) find a bad value wherever it is, and pass when there is none."""
    monkeypatch.setattr(F, "HOST_CHECK_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    good = [torch.randn(n, generator=g).to(dtypes[n % 3]) for n in range(1, 40)]
    assert F._host_finite_in_bf16(good)
    for i in (0, 17, len(good) - 1):
        for value in (float("nan"), float("-inf"), 3.4e38):
            bad = [t.clone() for t in good]
            bad[i] = bad[i].float()
            bad[i][-1] = value
            assert not F._host_finite_in_bf16(bad), (i, value)


def test_copied_norms_get_what_the_default_loader_writes():
    """The copied norms (copy_pairs into param.data, as apply_validated does) == SGLang's default loader, dtype
    casts included."""
    def params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16), requires_grad=False),
                torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False),
                torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16), requires_grad=False)]
    tensors = [torch.randn(5), torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(6, dtype=torch.float16)[::2]]
    copied, loaded = params(), params()
    storage = [p.data.data_ptr() for p in copied]
    copy_pairs([(param.data, tensor) for param, tensor in zip(copied, tensors)])
    for param, tensor in zip(loaded, tensors):
        default_weight_loader(param, tensor)
    for got, want in zip(copied, loaded):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert [p.data.data_ptr() for p in copied] == storage  # in place
