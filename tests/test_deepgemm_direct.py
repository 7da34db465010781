"""The default block-FP8 linear made as SGLang's two launches (kernels.deepgemm.linear_direct): the same calls as
SGLang's own DeepGEMM linear, checked against the installed SGLang's real code with only the two CUDA launches
recorded; installed only where nothing speaks against it, and logged once."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types

import pytest
import torch

# tests/ is on sys.path (conftest.py); clean_state is that module's autouse fixture, used here too: a fresh selection
# and a per-test cache file
from test_gemm_select import ON, Recorder, clean_state, cpu_runtime, request  # noqa: F401

from sglang_fp8rl.compat import versions
from sglang_fp8rl.compat.runtime import DEEPGEMM_LINEAR_PARAMS, deepgemm_linear_is_quant_then_gemm
from sglang_fp8rl.kernels import deepgemm as dg
from sglang_fp8rl.kernels import gemm_select as gs
from sglang_fp8rl.kernels.deepgemm import DeepGemmFacts
from sglang_fp8rl.kernels.gemm_select import lookup as lookup_mod
from sglang_fp8rl.kernels.gemm_select import prepare as prepare_mod
from sglang_fp8rl.quant import FP8_DTYPE

M, N, K = 5, 256, 512
TWO_LAUNCH_RELEASES = ("0.5.12", "0.5.15.post1", "0.5.17", "0.5.21")


class Launches:
    """The two CUDA launches of a DeepGEMM block linear, recorded: the activation quantizer and fp8_gemm_nt."""

    def __init__(self):
        self.quant, self.gemm = [], []
        self.xq = torch.zeros(M, K, dtype=FP8_DTYPE)
        self.xs = torch.ones(K // 128, 8).t()[:M]  # column-major, TMA-aligned, as SGLang lays the scales out

    def quantizer(self, x, group_size, **kwargs):
        self.quant.append((x.shape, x.data_ptr(), group_size, kwargs))
        return self.xq, self.xs

    def fp8_gemm_nt(self, lhs, rhs, out, *args, **kwargs):
        self.gemm.append((lhs, rhs, tuple(out.shape), out.dtype, args, kwargs))
        out.fill_(1.5)


def operands():
    x = torch.randn(M, K, dtype=torch.bfloat16)
    return x, torch.zeros(N, K, dtype=FP8_DTYPE), torch.ones(N // 128, K // 128)


def run_sglang_linear(monkeypatch, launches: Launches, x, w, s):
    """SGLang's own DeepGEMM linear, its real code, with the custom-op dispatch (CUDA only) skipped, the JIT hook
    as it is with SGLANG_JIT_DEEPGEMM_PRECOMPILE off (nothing to do) and the two launches recorded."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.deep_gemm_wrapper import compile_utils, entrypoint

    fu = dg.sglang_fp8_utils()
    monkeypatch.setattr(fu, "sglang_per_token_group_quant_fp8", launches.quantizer)
    monkeypatch.setattr(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", True)
    monkeypatch.setattr(compile_utils, "deep_gemm_execution_hook", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(entrypoint, "deep_gemm", types.SimpleNamespace(fp8_gemm_nt=launches.fp8_gemm_nt),
                        raising=False)
    monkeypatch.setitem(fu.w8a8_block_fp8_matmul_deepgemm.__globals__, "deep_gemm_fp8_fp8_bf16_nt",
                        lambda a, a_s, b, b_s, c: entrypoint.gemm_nt_f8f8bf16((a, a_s), (b, b_s), c))
    return fu.deepgemm_w8a8_block_fp8_linear_with_fallback(input=x, weight=w, block_size=[128, 128],
                                                           weight_scale=s, input_scale=None, bias=None)


def run_direct(monkeypatch, launches: Launches, x, w, s, bias=None):
    monkeypatch.setattr(dg.sglang_fp8_kernel(), "sglang_per_token_group_quant_fp8", launches.quantizer)
    monkeypatch.setattr(dg, "deep_gemm_module", lambda: types.SimpleNamespace(fp8_gemm_nt=launches.fp8_gemm_nt))
    return dg.linear_direct(x, w, s, bias)


def test_the_adapter_reads_the_installed_release():
    fn = dg.sglang_fp8_utils().deepgemm_w8a8_block_fp8_linear_with_fallback
    release = versions.installed_sglang().split("+")[0]
    assert deepgemm_linear_is_quant_then_gemm(fn) == (release in TWO_LAUNCH_RELEASES)
    assert not deepgemm_linear_is_quant_then_gemm(lambda input, weight: None)
    assert not deepgemm_linear_is_quant_then_gemm(len)  # a builtin without a readable signature


def test_direct_makes_sglangs_two_launches(monkeypatch):
    fn = dg.sglang_fp8_utils().deepgemm_w8a8_block_fp8_linear_with_fallback
    if not deepgemm_linear_is_quant_then_gemm(fn):
        pytest.skip(f"this release's DeepGEMM linear has other parameters than {DEEPGEMM_LINEAR_PARAMS}")
    x, w, s = operands()
    theirs, ours = Launches(), Launches()
    y_theirs = run_sglang_linear(monkeypatch, theirs, x, w, s)
    y_ours = run_direct(monkeypatch, ours, x, w, s)
    assert theirs.quant == ours.quant and len(ours.quant) == 1
    (_, ptr, group, kwargs), = ours.quant
    assert ptr == x.data_ptr() and group == 128
    assert kwargs == {"column_major_scales": True, "scale_tma_aligned": True, "scale_ue8m0": False}
    assert len(theirs.gemm) == len(ours.gemm) == 1
    for (lhs, rhs, shape, dtype, args, kw), launches in ((theirs.gemm[0], theirs), (ours.gemm[0], ours)):
        assert lhs[0] is launches.xq and lhs[1] is launches.xs and rhs[0] is w and rhs[1] is s
        assert shape == (M, N) and dtype == torch.bfloat16 and args == () and kw == {}
    assert torch.equal(y_theirs, y_ours) and y_ours.shape == (M, N)


def test_direct_keeps_leading_dims_and_adds_the_bias(monkeypatch):
    x, w, s = operands()
    bias = torch.arange(N, dtype=torch.bfloat16)
    y = run_direct(monkeypatch, Launches(), x.view(1, M, K), w, s, bias)
    assert y.shape == (1, M, N) and torch.equal(y[0, 0], 1.5 + bias)


@pytest.mark.parametrize("case, takes", [
    ("ok", True), ("fp16", False), ("empty", False), ("strided", False), ("n_not_64", False), ("k_not_128", False)])
def test_direct_takes_only_what_sglang_runs_on_deepgemm(case, takes):
    x, w, _ = operands()
    if case == "fp16":
        x = x.half()
    elif case == "empty":
        x = x[:0]
    elif case == "strided":
        x = torch.randn(K, M, dtype=torch.bfloat16).t()
    elif case == "n_not_64":
        w = torch.zeros(N + 32, K, dtype=FP8_DTYPE)
    elif case == "k_not_128":
        w, x = torch.zeros(N, K + 64, dtype=FP8_DTYPE), torch.randn(M, K + 64, dtype=torch.bfloat16)
    assert dg.direct_takes(x, w) is takes


def test_direct_reason_says_why_not(monkeypatch):
    assert "not DeepGEMM" in dg.direct_reason(DeepGemmFacts())
    assert "not DeepGEMM" in dg.direct_reason(DeepGemmFacts(enabled=True, ue8m0=True, dispatch_is_deepgemm=True))
    monkeypatch.setattr(dg, "deepgemm_linear_is_quant_then_gemm", lambda fn: False)
    assert "0.5.12-0.5.21" in dg.direct_reason(ON)
    monkeypatch.setattr(dg, "deepgemm_linear_is_quant_then_gemm", lambda fn: True)
    for value, on in (("1", True), ("true", True), ("0", False), ("false", False)):
        monkeypatch.setenv(dg.PRECOMPILE_ENV, value)
        assert (dg.direct_reason(ON) is not None) is on
    monkeypatch.delenv(dg.PRECOMPILE_ENV)
    assert dg.PRECOMPILE_ENV in dg.direct_reason(ON)  # SGLang's default: on


def test_apply_routes_the_default_through_the_direct_call_only_when_installed(monkeypatch):
    direct = Recorder("direct")
    monkeypatch.setattr(lookup_mod, "linear_direct", direct)
    x, w, s = operands()
    default = Recorder("sglang")
    gs.install({}, {})
    assert gs.apply_selected(x, w, s, None, default) == "sglang" and direct.calls == []
    gs.install({}, {}, direct=True)
    assert gs.installed().direct
    assert gs.apply_selected(x, w, s, None, default) == "direct" and len(default.calls) == 1
    assert direct.calls[0][0][0] is x and direct.calls[0][0][1] is w and direct.calls[0][0][2] is s
    assert gs.apply_selected(x.half(), w, s, None, default) == "sglang"  # not DeepGEMM's: SGLang decides
    assert gs.apply_selected(x, w, s, None, default, (64, 64)) == "sglang"  # other blocks: SGLang's call
    picked = Recorder("picked")
    gs.install({gs.shape_key(N, K, 8): "x"}, {"x": gs.Candidate("x", picked)}, direct=True)
    assert gs.apply_selected(x, w, s, None, default) == "picked"  # a measured choice wins over the default


def runtime(reason):
    return dataclasses.replace(cpu_runtime(gs.make_candidates(), ON), direct_reason=lambda facts: reason)


@pytest.mark.parametrize("reason", [None, "SGLANG_JIT_DEEPGEMM_PRECOMPILE is on"])
def test_preparation_installs_the_direct_call_and_logs_the_decision_once(reason, caplog):
    with caplog.at_level(logging.INFO, logger=prepare_mod.__name__):
        prepare_mod.prepare_shapes([(N, K)], request("cache", budget=0.0), runtime(reason))
    assert gs.installed().direct is (reason is None)
    said = [r.getMessage() for r in caplog.records if "SGLang's default GEMM" in r.getMessage()]
    assert len(said) == 1 and (("launched directly" in said[0]) if reason is None else (reason in said[0]))


def test_selection_off_or_a_named_backend_keeps_sglangs_own_linear():
    for off in (request("off", budget=0.0), request("auto", budget=0.0, fp8_gemm_backend="triton")):
        prepare_mod.prepare_shapes([(N, K)], off, runtime(None))
        assert not gs.installed().direct


def test_captured_launches_stay_sglangs_own_call(monkeypatch):
    direct = Recorder("direct")
    monkeypatch.setattr(lookup_mod, "linear_direct", direct)
    monkeypatch.setattr(lookup_mod, "capturing", lambda x: True)
    gs.install({}, {}, direct=True)
    x, w, s = operands()
    assert gs.apply_selected(x, w, s, None, Recorder("sglang")) == "sglang" and direct.calls == []
    monkeypatch.setattr(lookup_mod, "capturing", lambda x: False)
    assert gs.apply_selected(x, w, s, None, Recorder("sglang")) == "direct"


def test_capturing_is_false_for_host_tensors_and_true_under_torch_compile(monkeypatch):
    assert lookup_mod.capturing(torch.zeros(2)) is False
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert lookup_mod.capturing(torch.zeros(2)) is True


def test_dynamo_traces_the_apply_through_sglangs_call(monkeypatch):
    """Under torch.compile (SGLang's piecewise prefill graphs) the apply takes SGLang's call, never the direct one."""
    direct = Recorder("direct")
    monkeypatch.setattr(lookup_mod, "linear_direct", lambda *a: direct(*a) or a[0])
    gs.install({}, {}, direct=True)
    x, w, s = operands()
    sglang_calls = []

    def sglang_linear(input, weight, block_size, weight_scale, input_scale, bias):
        sglang_calls.append(1)
        return input * 2

    compiled = torch.compile(lambda t: gs.apply_selected(t, w, s, None, sglang_linear), backend="eager",
                             fullgraph=False)
    out = compiled(x)
    assert torch.equal(out, x * 2) and direct.calls == [] and sglang_calls
