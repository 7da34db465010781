"""CPU checks of sglang_fp8rl.kernels.gemm_select (per-shape block-FP8 GEMM selection, measured at load).

Covered here: M bucketing, cache keys / versioning / invalidation, the JSON round trip, the lookup and its fallback,
what each candidate can run, the selection rule, the log table, the float64 block-scaled reference (against
brute-force loops), the two-phase autotune loop (fake candidates and timer), preparation in each
--fp8rl-gemm-select mode, with DeepGEMM off and with an explicit --fp8-gemm-backend, and the linear method calling
SGLang's dispatch unchanged when nothing is selected. The real candidates, the CUDA-graph timing and set_num_sms
inside graph capture are GPU tests (tests/gpu/test_block_gemm.py, scripts/bench_gemm.py).
"""

from __future__ import annotations

import json
import logging
import os
import types

import pytest
import torch

from sglang_fp8rl import quant
from sglang_fp8rl.kernels import gemm_select as gs
from sglang_fp8rl.kernels.deepgemm import DeepGemmFacts
from sglang_fp8rl.kernels.gemm_select import lookup as lookup_mod
from sglang_fp8rl.kernels.gemm_select import prepare as prepare_mod
from sglang_fp8rl.layers.linear import Fp8OnlineBlockwiseLinearMethod, LayerState, block_shapes
from sglang_fp8rl.layers.scheme import choose_scheme
from sglang_fp8rl.server_args import Fp8rlOptions

OFF = DeepGemmFacts()  # SGLANG_ENABLE_JIT_DEEPGEMM=0, or no DeepGEMM (CPU)
ON = DeepGemmFacts(enabled=True, dispatch_is_deepgemm=True, sms=132)  # an H100 with SGLang's defaults


@pytest.fixture(autouse=True)
def clean_state(monkeypatch, tmp_path):
    monkeypatch.setenv(gs.ENV_CACHE, str(tmp_path / "cache" / "gemm_select.json"))
    gs.reset_state()
    yield
    gs.reset_state()


def sglang_decode_capture_bs(max_bs: int = 256) -> list[int]:
    """SGLang 0.5.17's decode CUDA-graph batch sizes (server_args._generate_decode_cuda_graph_batch_sizes)."""
    bs = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    return [b for b in bs if b <= max_bs]


def request(mode: str = "auto", budget: float = 20.0, **kw) -> gs.PrepareRequest:
    """A preparation without JIT warm-up (its own tests are in test_jit_warmup.py)."""
    return gs.PrepareRequest(mode=mode, budget_s=budget, jit_workers=kw.pop("jit_workers", 0), **kw)


def cpu_runtime(cands, facts: DeepGemmFacts = OFF, timer=None) -> gs.Runtime:
    """This process on CPU: the given candidates and DeepGEMM facts, the test's cache file, a CPU bench."""
    return gs.Runtime(facts, dict(cands), gs.env_info(facts), gs.cache_path(),
                      make_bench=lambda f: gs.Bench.create("cpu", f, timer=timer))


# ---------------------------------------------------------------------------------------------------------------------
# buckets


@pytest.mark.parametrize(
    "m, bucket",
    [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (12, 16), (16, 16), (17, 32), (24, 32), (33, 48), (96, 96), (97, 112),
     (100, 112), (128, 128), (129, 144), (192, 192), (256, 256), (257, 320), (500, 512), (513, 1024), (1025, 2048),
     (16384, 16384)],
)
def test_m_bucket_values(m, bucket):
    assert gs.m_bucket(m) == bucket


def test_m_bucket_monotone_and_covering():
    prev = 0
    for m in range(1, 5000):
        b = gs.m_bucket(m)
        assert b >= m and b >= prev
        assert gs.m_bucket(b) == b  # a bucket is its own bucket
        prev = b
    with pytest.raises(ValueError):
        gs.m_bucket(0)


def test_buckets_match_cuda_graph_batch_sizes():
    # every captured decode bs <= 256 lands in a bucket less than 16 above it; the DeepGEMM 128/129 cliff is an edge
    for bs in sglang_decode_capture_bs(256):
        assert 0 <= gs.m_bucket(bs) - bs < 16, bs
    assert gs.m_bucket(128) != gs.m_bucket(129)
    b = gs.buckets_upto(256)
    assert b == [1, 2, 4, 8] + list(range(16, 257, 16)) and len(b) == 20
    assert gs.buckets_upto(100) == [1, 2, 4, 8] + list(range(16, 113, 16))
    assert gs.buckets_upto(2000)[-3:] == [512, 1024, 2048]


def test_bucket_points():
    assert gs.bucket_points(128) == (128,)
    assert gs.bucket_points(128, "both") == (113, 128)
    assert gs.bucket_points(16, "both") == (9, 16)
    assert gs.bucket_points(2, "both") == (2,)
    assert gs.bucket_points(1, "both") == (1,)
    with pytest.raises(ValueError):
        gs.bucket_points(16, "all")


# ---------------------------------------------------------------------------------------------------------------------
# cache keying, versioning, round trip

INFO = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "sms": "132", "deepgemm": "fp32", "torch": "2.11.0+cu130",
        "triton": "3.6.0", "sglang": "0.5.17", "sgl_kernel": "0.4.5", "deep_gemm": "0.1.5.post1",
        "sglang_fp8rl": "0.1.0", "schema": str(gs.SCHEMA)}


def entry(choice: str, us: dict, rejected=None, names=None) -> gs.Entry:
    names = names if names is not None else gs.candidate_names()
    return gs.Entry(candidates=list(names), choice=choice, us=us, rejected=rejected or {}, points=[128], time=0)


def test_env_info_has_every_key_field():
    info = gs.env_info()
    assert set(INFO) == set(info)
    assert info["gpu"] == "cpu" and info["schema"] == str(gs.SCHEMA) and info["torch"] == torch.__version__
    assert info["deepgemm"] == "off"  # SGLang's DeepGEMM layer on a machine without CUDA


def test_env_key_tells_deepgemm_states_apart():
    keys = {gs.env_key(gs.env_info(facts)) for facts in (OFF, ON, DeepGemmFacts(enabled=True, ue8m0=True))}
    assert len(keys) == 3  # the default candidate is another kernel in each: never share measurements


@pytest.mark.parametrize("field", sorted(INFO), ids=lambda f: f"field_{f}")  # an id "gpu" would mean: skip on CPU
def test_env_key_changes_with_every_field(field):
    other = dict(INFO, **{field: INFO[field] + "x"})
    assert gs.env_key(other) != gs.env_key(INFO)
    assert gs.env_key(dict(reversed(list(INFO.items())))) == gs.env_key(INFO)


def test_shape_key_round_trip():
    assert gs.shape_key(24576, 4096, 128) == "N=24576,K=4096,M=128"
    assert gs.parse_shape_key(gs.shape_key(24576, 4096, 128)) == (24576, 4096, 128)


def test_cache_default_path_and_override(monkeypatch, tmp_path):
    assert gs.cache_path() == str(tmp_path / "cache" / "gemm_select.json")
    monkeypatch.delenv(gs.ENV_CACHE)
    assert gs.cache_path() == os.path.join(os.path.expanduser("~"), ".cache", "sglang_fp8rl", "gemm_select.json")


def test_json_round_trip_and_merge(tmp_path):
    path = str(tmp_path / "c" / "g.json")
    assert gs.load_cache(path) == {"schema": gs.SCHEMA, "envs": {}}  # missing file
    e1 = {gs.shape_key(24576, 4096, 128): entry("deepgemm_sms_124", {"deepgemm_default": 101.0,
                                                                     "deepgemm_sms_124": 42.2})}
    gs.merge_entries(path, INFO, e1)
    other = dict(INFO, deep_gemm="0.2.0")
    e2 = {gs.shape_key(4096, 4096, 64): entry(gs.DEFAULT, {"deepgemm_default": 11.5})}
    gs.merge_entries(path, other, e2)
    data = gs.load_cache(path)
    assert gs.env_entries(data, INFO) == e1  # merged, not overwritten
    assert gs.env_entries(data, other) == e2
    assert data["envs"][gs.env_key(INFO)]["info"] == INFO
    assert os.listdir(os.path.dirname(path)) == ["g.json"]  # no temp file left behind
    e3 = {gs.shape_key(24576, 4096, 128): entry(gs.DEFAULT, {"deepgemm_default": 50.0})}
    gs.merge_entries(path, INFO, e3)  # re-measured entry replaces the old one
    assert gs.load_entries(INFO, path) == e3
    # the file stays readable JSON: an entry is its fields
    raw = json.loads(open(path).read())["envs"][gs.env_key(INFO)]["entries"][gs.shape_key(24576, 4096, 128)]
    assert raw["choice"] == gs.DEFAULT and raw["us"] == {"deepgemm_default": 50.0} and raw["points"] == [128]


@pytest.mark.parametrize("text", ["{not json", json.dumps({"schema": 999, "envs": {}}), json.dumps([1, 2]),
                                  json.dumps({"schema": 2, "envs": {}})])
def test_bad_cache_reads_as_empty(tmp_path, text):
    path = tmp_path / "g.json"
    path.write_text(text)
    assert gs.load_cache(str(path)) == {"schema": gs.SCHEMA, "envs": {}}


def test_malformed_entries_are_left_out(tmp_path):
    path = tmp_path / "g.json"
    good = entry(gs.DEFAULT, {"deepgemm_default": 1.0}).to_json()
    entries = {"N=1,K=1,M=1": good, "N=2,K=1,M=1": [1], "N=3,K=1,M=1": {"choice": "x"},
               "N=4,K=1,M=1": dict(good, choice=7), "N=5,K=1,M=1": dict(good, surprise=1)}
    path.write_text(json.dumps({"schema": gs.SCHEMA, "envs": {gs.env_key(INFO): {"info": INFO, "entries": entries}}}))
    assert sorted(gs.load_entries(INFO, str(path))) == ["N=1,K=1,M=1", "N=5,K=1,M=1"]


def test_versions_invalidate(tmp_path):
    key = gs.shape_key(24576, 4096, 128)
    names = gs.candidate_names()
    gs.merge_entries(None, INFO, {key: entry("deepgemm_sms_124", {"deepgemm_default": 101.0,
                                                                  "deepgemm_sms_124": 42.0})})
    data = gs.load_cache()
    assert gs.cached_choice(128, 24576, 4096, gs.env_entries(data, INFO), names) == "deepgemm_sms_124"
    newer = dict(INFO, sglang="0.5.18")
    assert gs.cached_choice(128, 24576, 4096, gs.env_entries(data, newer), names) == gs.DEFAULT


# ---------------------------------------------------------------------------------------------------------------------
# lookup and selection


def test_select_lookup_and_fallbacks():
    names = gs.candidate_names()
    assert names[0] == gs.DEFAULT and names == ["deepgemm_default", "deepgemm_sms_124", "deepgemm_sms_112",
                                                "fp8rl_n64_sk4", "fp8rl_n64_sk4_pdl"]
    entries = {
        gs.shape_key(24576, 4096, 112): entry("deepgemm_sms_112", {}),
        # another candidate set
        gs.shape_key(24576, 4096, 128): entry("deepgemm_sms_124", {}, names=names + ["fp8rl_fused_n64_sk4"]),
        gs.shape_key(4096, 4096, 128): entry("deepgemm_sms_7", {}),  # unknown name
    }
    assert gs.cached_choice(100, 24576, 4096, entries, names) == "deepgemm_sms_112"  # bucket 112
    assert gs.cached_choice(112, 24576, 4096, entries, names) == "deepgemm_sms_112"
    assert gs.cached_choice(113, 24576, 4096, entries, names) == gs.DEFAULT  # stale entry
    assert gs.cached_choice(128, 4096, 4096, entries, names) == gs.DEFAULT  # unknown choice
    assert gs.cached_choice(64, 24576, 4096, entries, names) == gs.DEFAULT  # missing bucket
    assert gs.cached_choice(112, 6144, 4096, entries, names) == gs.DEFAULT  # missing shape
    assert gs.cached_choice(1, 1, 1, {}, names) == gs.DEFAULT


def test_select_reads_the_cache_file_of_this_environment():
    key = gs.shape_key(24576, 4096, 128)
    gs.merge_entries(None, gs.env_info(ON), {key: entry("deepgemm_sms_124", {})})
    gs.merge_entries(None, dict(gs.env_info(ON), gpu="other"), {key: entry("triton_default", {})})
    gs.reset_state()
    gs.prepare_shapes([(24576, 4096)], request("cache"), cpu_runtime(gs.make_candidates(), ON))
    assert gs.select(120, 24576, 4096) == "deepgemm_sms_124"


def test_cached_deepgemm_choice_is_never_used_with_deepgemm_off(caplog):
    """SGLANG_ENABLE_JIT_DEEPGEMM=0: a cached DeepGEMM variant (SGLang asserts at capture if it runs) is not chosen."""
    key = gs.shape_key(24576, 4096, 128)
    cands = gs.make_candidates()
    # as a cache written before DeepGEMM's state was part of the environment would hold it
    gs.merge_entries(None, gs.env_info(OFF), {key: entry("deepgemm_sms_124", {})})
    got = gs.prepare_shapes([(24576, 4096)], request("cache"), cpu_runtime(cands, OFF))
    assert got == {} and gs.select(120, 24576, 4096) == gs.DEFAULT
    default = Recorder("sglang")
    x = torch.zeros(120, 4096, dtype=torch.bfloat16)
    assert gs.apply_selected(x, torch.zeros(24576, 4096), torch.ones(192, 32), None, default) == "sglang"
    # the same entry with DeepGEMM on is used: the check above is about DeepGEMM's state, not the entry
    gs.merge_entries(None, gs.env_info(ON), {key: entry("deepgemm_sms_124", {})})
    gs.prepare_shapes([(24576, 4096)], request("cache"), cpu_runtime(cands, ON))
    assert gs.select(120, 24576, 4096) == "deepgemm_sms_124"
    # and a device with fewer SMs than the variant asks for does not get it either
    gs.merge_entries(None, gs.env_info(DeepGemmFacts(True, False, True, 114)), {key: entry("deepgemm_sms_124", {})})
    gs.prepare_shapes([(24576, 4096)], request("cache"), cpu_runtime(cands, DeepGemmFacts(True, False, True, 114)))
    assert gs.select(120, 24576, 4096) == gs.DEFAULT


def test_autotune_never_picks_a_deepgemm_variant_with_deepgemm_off():
    last: list = []
    fake = make_fake_candidates(last)
    cands = {gs.DEFAULT: fake[gs.DEFAULT],
             "variant": gs.Candidate("variant", fake["fast"].fn, needs_deepgemm=True, num_sms=100)}

    def timer(call, nrot, calls, reps):
        call(0)
        return US[last[-1]]

    settings = gs.TuneSettings(max_m=2)
    on = gs.autotune([(256, 384)], cands, settings, bench=gs.Bench.create("cpu", ON, timer=timer), log=print)
    off = gs.autotune([(256, 384)], cands, settings, bench=gs.Bench.create("cpu", OFF, timer=timer), log=print)
    assert {e.choice for e in on.values()} == {"variant"}
    assert {e.choice for e in off.values()} == {gs.DEFAULT}
    assert all("DeepGEMM disabled" in e.rejected["variant"] for e in off.values())


@pytest.mark.parametrize("backend", ["triton", "deep_gemm", "flashinfer_deepgemm", "cutlass"])
def test_explicit_fp8_gemm_backend_turns_selection_off(monkeypatch, caplog, backend):
    """--fp8-gemm-backend named by the user: SGLang's dispatch of that backend runs every GEMM, one log line."""
    calls: list = []
    cands, runtime = install_fake_tuning(monkeypatch, calls)
    key = gs.shape_key(256, 384, 2)
    gs.merge_entries(None, runtime.info, {key: entry("fast", {}, names=list(cands))})
    with caplog.at_level(logging.INFO, logger=prepare_mod.__name__):
        got = gs.prepare_shapes([(256, 384)], request("auto", fp8_gemm_backend=backend), runtime)
    assert got == {} and calls == [] and gs.select(2, 256, 384) == gs.DEFAULT
    lines = [r.getMessage() for r in caplog.records if "--fp8-gemm-backend" in r.getMessage()]
    assert len(lines) == 1 and backend in lines[0]
    # "auto" (SGLang's default) keeps the selection: the cached choice is used
    gs.prepare_shapes([(256, 384)], request("cache", fp8_gemm_backend="auto"), runtime)
    assert gs.select(2, 256, 384) == "fast"


def test_prepare_model_checks_its_arguments():
    with pytest.raises(ValueError, match="mode"):
        gs.prepare_model([(256, 384)], mode="fast", budget_s=1.0, jit_workers=0)
    assert gs.prepare_model([], mode="auto", budget_s=1.0, jit_workers=0) == {}  # nothing to do: nothing detected
    assert gs.GEMM_SELECT_MODES == ("auto", "cache", "off")


def test_candidate_set_is_configurable():
    assert list(gs.make_candidates((120, 100), triton=True, ours=((128, 1),), fused=((64, 2),))) == [
        "deepgemm_default", "deepgemm_sms_120", "deepgemm_sms_100", "triton_default", "fp8rl_n128_sk1",
        "fp8rl_n64_sk4_pdl", "fp8rl_fused_n64_sk2"]
    assert list(gs.make_candidates((), ours=(), fused=(), pdl=())) == ["deepgemm_default"]
    assert list(gs.make_candidates((), ours=(), pdl=(), prefetch=gs.PREFETCH_FORMS)) == [
        "deepgemm_default", "fp8rl_n64_sk4_pf", "fp8rl_n64_sk4_pfpdl", "fp8rl_n64_sk4_pdl", "fp8rl_n64_sk1_pdl"]
    assert list(gs.make_candidates((), ours=(), pdl=(), own_quant=gs.OWN_QUANT_FORMS)) == [
        "deepgemm_default", "fp8rl_n64_sk4_qpdl", "fp8rl_n64_sk1_qpdl"]
    assert gs.ours_name(64, 4) == "fp8rl_n64_sk4"
    # not a server candidate (no gain beyond the spread on an H100): the server's set is the default registry
    assert not any(name.endswith("_qpdl") for name in gs.candidate_names())


def test_excluded_candidates_are_left_out_and_their_cached_choices_not_used(caplog):
    pdl = "fp8rl_n64_sk4_pdl"
    assert gs.check_excluded([pdl, "deepgemm_sms_124"]) == (pdl, "deepgemm_sms_124")
    with pytest.raises(ValueError, match="deepgemm_default cannot be excluded: it runs wherever nothing else"):
        gs.check_excluded([gs.DEFAULT])
    with pytest.raises(ValueError, match="'nope' is not a GEMM candidate of the server; they are deepgemm_sms_124"):
        gs.check_excluded(["nope"])
    with pytest.raises(ValueError, match="'nope' is not a GEMM candidate"):
        gs.prepare_model([], mode="auto", budget_s=1.0, jit_workers=0, exclude=["nope"])
    assert list(gs.server_candidates([pdl])) == [n for n in gs.candidate_names() if n != pdl]
    # a cache written with every candidate: its choice of the excluded one is not served (another candidate set)
    key = gs.shape_key(4096, 4096, 8)
    gs.merge_entries(None, gs.env_info(ON), {key: entry(pdl, {})})
    gs.reset_state()
    excluding = request("cache", exclude=(pdl,))
    runtime = cpu_runtime(gs.server_candidates(excluding.exclude), ON)
    with caplog.at_level(logging.INFO, logger=prepare_mod.__name__):
        assert gs.prepare_shapes([(4096, 4096)], excluding, runtime) == {}
    assert gs.select(8, 4096, 4096) == gs.DEFAULT
    assert any(f"excluded {pdl}" in r.getMessage() for r in caplog.records)
    gs.reset_state()
    gs.prepare_shapes([(4096, 4096)], request("cache"), cpu_runtime(gs.server_candidates(), ON))
    assert gs.select(8, 4096, 4096) == pdl  # the same cache without the exclusion


def test_choose():
    us = {"deepgemm_default": 101.0, "deepgemm_sms_124": 42.2, "deepgemm_sms_96": 42.1, "triton_default": 59.8}
    assert gs.choose(us, {}) == "deepgemm_sms_96"
    assert gs.choose(us, {"deepgemm_sms_96": "rel. error"}) == "deepgemm_sms_124"
    assert gs.choose({"deepgemm_default": 40.0, "deepgemm_sms_124": 39.5}, {}) == gs.DEFAULT  # < 3 % gain
    assert gs.choose({"deepgemm_default": 40.0, "deepgemm_sms_124": 38.0}, {}) == "deepgemm_sms_124"
    assert gs.choose({"deepgemm_default": 40.0, "deepgemm_sms_124": 38.0}, {}, min_gain=0.1) == gs.DEFAULT
    assert gs.choose({}, {"deepgemm_default": "x"}) == gs.DEFAULT
    assert gs.choose({"triton_default": 50.0, "deepgemm_default": float("nan")}, {}) == "triton_default"


def test_can_implement_says_why_not():
    reg = gs.make_candidates((124, 132), triton=True)
    d, s124, s132, tr = (reg[n] for n in ("deepgemm_default", "deepgemm_sms_124", "deepgemm_sms_132",
                                          "triton_default"))
    off, on = DeepGemmFacts(sms=132), DeepGemmFacts(enabled=True, sms=132)
    assert d.can_implement(100, 100, off) is None  # the default always runs
    assert tr.can_implement(24576, 4096, off) is None
    assert s124.can_implement(24576, 4096, on) is None
    assert "disabled" in s124.can_implement(24576, 4096, off)
    assert "UE8M0" in s124.can_implement(24576, 4096, DeepGemmFacts(enabled=True, ue8m0=True, sms=132))
    assert "Triton" in s124.can_implement(4096 + 32, 4096, on)
    assert "Triton" in s124.can_implement(4096, 4096 + 64, on)
    assert "num_sms" in s132.can_implement(4096, 4096, on)
    reg = gs.make_candidates(fused=gs.FUSED_FORMS, prefetch=gs.PREFETCH_FORMS)
    for name in ("fp8rl_n64_sk4", "fp8rl_fused_n64_sk4", "fp8rl_n64_sk4_pfpdl"):
        ours = reg[name]
        assert ours.can_implement(4096, 4096, off, m=16) is None  # needs no DeepGEMM
        assert "M 17" in ours.can_implement(4096, 4096, on, m=17)
        assert "K 4000" in ours.can_implement(4096, 4000, on, m=8)


def test_format_table():
    entries = {
        gs.shape_key(24576, 4096, 128): entry("deepgemm_sms_124", {"deepgemm_default": 101.0,
                                                                   "deepgemm_sms_124": 42.2},
                                              {"triton_default": "ValueError: rel. error"}),
        gs.shape_key(4096, 4096, 1): entry(gs.DEFAULT, {"deepgemm_default": 13.3, "deepgemm_sms_124": 13.4}),
    }
    table = gs.format_table(entries)
    lines = table.splitlines()
    assert lines[0] == ("| N | K | M bucket | choice | gain vs default | deepgemm_default us | deepgemm_sms_124 us | "
                        "triton_default us |")
    assert lines[1] == "|" + "---|" * 8
    assert lines[2] == "| 4096 | 4096 | 1 | deepgemm_default | x1.00 | 13.3 | 13.4 | - |"
    assert lines[3] == "| 24576 | 4096 | 128 | deepgemm_sms_124 | x2.39 | 101.0 | 42.2 | REJ |"
    assert gs.format_table({}).count("\n") == 1  # header only


# ---------------------------------------------------------------------------------------------------------------------
# float64 block-scaled reference


def brute_force(xq, xs, wq, ws, block=(128, 128)):
    """out[i][j] = sum over K blocks of xs[i,kb] * ws[j//bn, kb] * sum_{k in block} xq[i,k] * wq[j,k], in Python."""
    bn, bk = block
    xqv, xsv, wqv, wsv = xq.float().tolist(), xs.tolist(), wq.float().tolist(), ws.tolist()
    m, k = xq.shape
    n = wq.shape[0]
    out = [[0.0] * n for _ in range(m)]
    for i in range(m):
        for j in range(n):
            acc = 0.0
            for kb in range(0, k, bk):
                part = sum(xqv[i][c] * wqv[j][c] for c in range(kb, min(kb + bk, k)))
                acc += xsv[i][kb // bk] * wsv[j // bn][kb // bk] * part
            out[i][j] = acc
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("m, n, k", [(3, 130, 200), (1, 128, 256), (5, 257, 129)])
def test_reference_matches_brute_force(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)  # blocks of very different scales
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    wq, ws = quant.quantize_blockwise(w, (128, 128))
    xq, xs = quant.quantize_activation_groups(x, 128)
    ref = gs.block_scaled_reference(xq, xs, wq, ws)
    assert ref.dtype == torch.float64 and ref.shape == (m, n)
    torch.testing.assert_close(ref, brute_force(xq, xs, wq, ws), rtol=1e-12, atol=1e-12)
    # the same product as quant.py's dequantizers (float32 there, so a loose bound)
    deq = quant.dequantize_activation_groups(xq, xs).double() @ quant.dequantize_blockwise(wq, ws).double().t()
    torch.testing.assert_close(ref, deq, rtol=1e-5, atol=1e-6)
    cols = gs.check_columns(n, generator=g)
    torch.testing.assert_close(gs.block_scaled_reference(xq, xs, wq, ws, cols=cols), ref[:, cols], rtol=1e-12,
                               atol=1e-12)


def test_rel_error_and_tolerance():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * torch.tensor([0.02, 2.0]).repeat_interleave(128).unsqueeze(1)
    wq, ws = quant.quantize_blockwise(w)
    xq, xs = quant.quantize_activation_groups(torch.randn(7, 512, generator=g).to(torch.bfloat16))
    ref = gs.block_scaled_reference(xq, xs, wq, ws)
    assert gs.rel_error(ref.to(torch.bfloat16), ref) < 4e-3  # a bf16 output alone is well inside REL_TOL
    assert gs.rel_error(ref.to(torch.bfloat16), ref) < gs.REL_TOL
    wrong_scale = gs.block_scaled_reference(xq, xs, wq, ws.flip(0))  # e.g. a transposed / mis-strided scale
    assert gs.rel_error(wrong_scale, ref) > 10 * gs.REL_TOL
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert gs.rel_error(bad, ref) == float("inf")


def test_check_columns_cover_every_16_group():
    g = torch.Generator().manual_seed(1)
    for n in (16, 130, 4096, 24576):
        cols = gs.check_columns(n, generator=g)
        assert cols.min() >= 0 and cols.max() == n - 1
        assert set((cols // 16).tolist()) == set(range((n + 15) // 16))


# ---------------------------------------------------------------------------------------------------------------------
# the linear method: SGLang's call unchanged unless a choice is installed


class Recorder:
    def __init__(self, tag):
        self.tag, self.calls = tag, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.tag


def fake_layer(n=256, k=512, block=(128, 128)):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=quant.FP8_DTYPE), requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 4), requires_grad=False)
    layer._fp8rl = types.SimpleNamespace(block_size=block, is_block=True)
    return layer


def run_block_apply(default, mode: str = "auto"):
    config = types.SimpleNamespace(options=Fp8rlOptions(gemm_select=mode))
    method = Fp8OnlineBlockwiseLinearMethod(quant_config=config, prefix="model.layers.0.mlp.gate_up_proj")
    method._block_linear = default
    layer = fake_layer()
    x = torch.zeros(5, 512, dtype=torch.bfloat16)
    return method._apply_block_cuda(layer, x, None), layer, x


def expected_kwargs(layer, x):
    return {"input": x, "weight": layer.weight, "block_size": [128, 128], "weight_scale": layer.weight_scale_inv,
            "input_scale": None, "bias": None}


def same_kwargs(got, want):
    return got.keys() == want.keys() and all(got[key] is want[key] or got[key] == want[key] for key in want)


def test_linear_unchanged_when_off(monkeypatch):
    names = gs.candidate_names()
    gs.merge_entries(None, gs.env_info(ON), {gs.shape_key(256, 512, 8): entry("deepgemm_sms_112", {}, names=names)})
    gs.prepare_shapes([(256, 512)], request("off"), cpu_runtime(gs.make_candidates(), ON))

    def boom(*a, **k):
        raise AssertionError("the selector must not run")

    monkeypatch.setattr(lookup_mod, "select", boom)
    default = Recorder("sglang")
    out, layer, x = run_block_apply(default, "off")
    assert out == "sglang" and len(default.calls) == 1
    args, kwargs = default.calls[0]
    assert args == () and same_kwargs(kwargs, expected_kwargs(layer, x))


@pytest.mark.parametrize("mode", [None, "auto", "cache"])
def test_linear_with_empty_cache_calls_sglang_identically(mode, monkeypatch):
    # SGLang's default (precompile on) keeps SGLang's own linear call; with it off the default is made directly
    # (tests/test_deepgemm_direct.py), which a parse of our options earlier in this process would have set
    monkeypatch.setenv("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "1")
    if mode is not None:
        gs.prepare_shapes([(256, 512)], request(mode, budget=0.0), cpu_runtime(gs.make_candidates(), ON))
    default = Recorder("sglang")
    out, layer, x = run_block_apply(default, mode or Fp8rlOptions().gemm_select)
    assert out == "sglang" and len(default.calls) == 1
    args, kwargs = default.calls[0]
    assert args == () and same_kwargs(kwargs, expected_kwargs(layer, x))


def test_linear_uses_cached_choice():
    names = gs.candidate_names()
    gs.merge_entries(None, gs.env_info(ON), {gs.shape_key(256, 512, 8): entry("deepgemm_sms_112", {}, names=names)})
    picked = Recorder("sms112")
    reg = gs.make_candidates()
    reg["deepgemm_sms_112"] = gs.Candidate("deepgemm_sms_112", picked, needs_deepgemm=True, num_sms=112)
    gs.prepare_shapes([(256, 512)], request("cache"), cpu_runtime(reg, ON))
    default = Recorder("sglang")
    out, layer, x = run_block_apply(default, "cache")  # M = 5 -> bucket 8
    assert out == "sms112" and default.calls == []
    args, _ = picked.calls[0]
    assert args[0] is x and args[1] is layer.weight and args[2] is layer.weight_scale_inv and args[3] is None


def test_selector_leaves_other_block_sizes_alone(monkeypatch):
    picked = Recorder("picked")
    gs.install({gs.shape_key(256, 512, 4): "x"}, {"x": gs.Candidate("x", picked)})
    default = Recorder("sglang")
    layer = fake_layer(block=(64, 64))
    x = torch.zeros(3, 512, dtype=torch.bfloat16)
    monkeypatch.setattr(lookup_mod, "select", lambda *a, **k: pytest.fail("no lookup for 64x64 blocks"))
    assert gs.apply_selected(x, layer.weight, layer.weight_scale_inv, None, default, (64, 64)) == "sglang"
    assert default.calls[0][1]["block_size"] == [64, 64] and picked.calls == []


def test_install_refuses_unknown_candidates():
    with pytest.raises(ValueError, match="unknown"):
        gs.install({"N=1,K=1,M=1": "nope"}, {})
    gs.install({"N=1,K=1,M=1": gs.DEFAULT}, {})  # the default is the fallback, never an installed choice
    assert gs.installed().choices == {}


# ---------------------------------------------------------------------------------------------------------------------
# the autotune loop on CPU (fake candidates and a fake timer; the real timing and kernels need the GPU)


def make_fake_candidates(last: list):
    def exact(x, w, s, bias):  # the block-scaled product, rounded to bf16 like a real kernel's output
        xq, xs = quant.quantize_activation_groups(x, 128)
        return (quant.dequantize_activation_groups(xq, xs) @ quant.dequantize_blockwise(w, s).t()).to(x.dtype)

    def fn(name, body):
        def run(x, w, s, bias):
            last.append(name)
            return body(x, w, s, bias)
        return gs.Candidate(name, run)

    def broken(x, w, s, bias):
        raise RuntimeError("no kernel image")

    return {
        gs.DEFAULT: fn(gs.DEFAULT, exact),
        "fast": fn("fast", exact),
        "wrong": fn("wrong", lambda x, w, s, bias: exact(x, w, s.flip(0) * 3.0, bias)),
        "nan": fn("nan", lambda x, w, s, bias: exact(x, w, s, bias) * float("nan")),
        "broken": fn("broken", broken),
    }


US = {gs.DEFAULT: 100.0, "fast": 40.0, "wrong": 10.0, "nan": 5.0, "broken": 1.0}


def fake_timer(last):
    def timer(call, nrot, calls, reps):
        call(0)
        return US[last[-1]]
    return timer


def cpu_bench(timer, copy_gbs=None, facts=OFF):
    return gs.Bench.create("cpu", facts, timer=timer, copy_gbs=copy_gbs)


def quiet(_: str) -> None:
    return None


def test_autotune_loop_checks_rejects_and_chooses():
    last: list = []
    new = gs.autotune([(256, 384), (256, 384)], make_fake_candidates(last), gs.TuneSettings(max_m=16),
                      bench=cpu_bench(fake_timer(last)), log=quiet)
    assert sorted(new) == sorted(gs.shape_key(256, 384, b) for b in (1, 2, 4, 8, 16))
    for e in new.values():
        assert e.choice == "fast" and e.candidates == [gs.DEFAULT, "fast", "wrong", "nan", "broken"]
        assert e.us == {gs.DEFAULT: 100.0, "fast": 40.0}
        assert set(e.rejected) == {"wrong", "nan", "broken"}
        assert "rel. error" in e.rejected["wrong"] and "RuntimeError" in e.rejected["broken"]
        assert e.rel_err[gs.DEFAULT] < 4e-3 and e.rel_err["nan"] == float("inf")
        assert set(e.first_call_s) == {gs.DEFAULT, "fast", "wrong", "nan"}  # "broken" raised in its first call
    # what the autotune writes is what the lookup reads back
    gs.merge_entries(None, INFO, new)
    entries = gs.load_entries(INFO)
    assert gs.cached_choice(3, 256, 384, entries, list(make_fake_candidates([]))) == "fast"
    assert gs.cached_choice(17, 256, 384, entries, list(make_fake_candidates([]))) == gs.DEFAULT  # above max_m
    assert "| 256 | 384 | 16 | fast | x2.50 |" in gs.format_table(new)


def test_autotune_points_skip_budget_and_order():
    last: list = []
    cands = make_fake_candidates(last)
    skip = {gs.shape_key(256, 384, 1)}
    new = gs.autotune([(256, 384)], cands, gs.TuneSettings(max_m=8, points="both"), bench=cpu_bench(fake_timer(last)),
                      skip=skip, log=quiet)
    assert sorted(new) == sorted(gs.shape_key(256, 384, b) for b in (2, 4, 8))  # bucket 1 skipped
    assert new[gs.shape_key(256, 384, 8)].points == [5, 8]
    assert new[gs.shape_key(256, 384, 8)].us["fast"] == 80.0  # summed over both points
    assert gs.autotune([(256, 384)], cands, gs.TuneSettings(max_m=8, budget_s=-1), bench=cpu_bench(fake_timer(last)),
                       log=quiet) == {}
    reordered = {"fast": cands["fast"], gs.DEFAULT: cands[gs.DEFAULT]}
    with pytest.raises(ValueError, match="first"):
        gs.autotune([(256, 384)], reordered, gs.TuneSettings(max_m=1), bench=cpu_bench(fake_timer(last)))


def test_autotune_skips_alternatives_where_the_default_is_efficient():
    last: list = []
    new = gs.autotune([(256, 384)], make_fake_candidates(last), gs.TuneSettings(max_m=4),
                      bench=cpu_bench(fake_timer(last), copy_gbs=1.0), log=quiet)  # default ~1 GB/s = ~100 %
    assert sorted(new) == sorted(gs.shape_key(256, 384, b) for b in (1, 2, 4))
    for e in new.values():
        assert e.choice == gs.DEFAULT and list(e.us) == [gs.DEFAULT] and e.default_frac_copy_bw >= 0.7
        assert set(e.skipped) == {"fast", "wrong", "nan", "broken"} and "copy bandwidth" in e.skipped["fast"]
    assert set(last) == {gs.DEFAULT}
    gs.merge_entries(None, INFO, new)  # complete entries: valid for the next start
    assert gs.cached_choice(3, 256, 384, gs.load_entries(INFO), list(make_fake_candidates([]))) == gs.DEFAULT


def test_autotune_measures_least_efficient_defaults_first():
    order: list = []
    seen_m: list = []

    def exact(x, w, s, bias):
        xq, xs = quant.quantize_activation_groups(x, 128)
        return (quant.dequantize_activation_groups(xq, xs) @ quant.dequantize_blockwise(w, s).t()).to(x.dtype)

    def default(x, w, s, bias):
        seen_m.append(x.shape[0])
        return exact(x, w, s, bias)

    def alt(x, w, s, bias):
        order.append(x.shape[0])
        return exact(x, w, s, bias)

    cands = {gs.DEFAULT: gs.Candidate(gs.DEFAULT, default), "alt": gs.Candidate("alt", alt)}
    default_us = {1: 10.0, 2: 30.0, 4: 20.0}  # efficiency falls as the time grows: M=2, then 4, then 1

    def timing(call, nrot, calls, reps):
        n_before = len(order)
        call(0)
        if len(order) > n_before:  # an alternative ran
            return 5.0
        return default_us[seen_m[-1]]

    new = gs.autotune([(256, 384)], cands, gs.TuneSettings(max_m=4, min_gain=0.0),
                      bench=cpu_bench(timing, copy_gbs=1e9), log=quiet)
    # each alternative ran twice per entry (first call + timed call); the entries came least efficient first
    assert order[::2] == [2, 4, 1]
    assert all(e.choice == "alt" for e in new.values())


def test_autotune_measures_num_sms_variants_only_where_the_default_is_far_off():
    last: list = []
    fake = make_fake_candidates(last)
    exact, rows = fake["fast"].fn, []

    def default(x, w, s, b):
        rows.append(x.shape[0])
        return fake[gs.DEFAULT].fn(x, w, s, b)

    cands = {gs.DEFAULT: gs.Candidate(gs.DEFAULT, default), "fast": fake["fast"],
             "variant": gs.Candidate("variant", lambda x, w, s, b: (last.append("fast"), exact(x, w, s, b))[1],
                                     num_sms=100)}

    def timer(call, nrot, calls, reps):  # the default takes 100 us at M=1 and 200 us at M=2; the others 40 us
        call(0)
        return (100.0 * rows[-1]) if last[-1] == gs.DEFAULT else 40.0

    bw = gs.linear_bytes(1, 256, 384) / 100e-6 / 1e9 / 0.6  # the default reaches 60 % at M=1, ~30 % at M=2
    todo = []
    new = gs.autotune([(256, 384)], cands, gs.TuneSettings(max_m=2), bench=cpu_bench(timer, copy_gbs=bw), log=quiet,
                      before_alternatives=todo.extend)
    e1, e2 = new[gs.shape_key(256, 384, 1)], new[gs.shape_key(256, 384, 2)]
    assert e1.default_frac_copy_bw == pytest.approx(0.6, abs=1e-3)
    assert set(e1.us) == {gs.DEFAULT, "fast"} and "variant" in e1.skipped  # 60 %: variants not worth a JIT
    assert e2.default_frac_copy_bw < gs.VARIANT_BELOW and set(e2.us) == {gs.DEFAULT, "fast", "variant"}
    # phase 2's work, announced once before it starts, least efficient entry first
    assert todo == [(256, 384, 2, ["fast", "variant"]), (256, 384, 1, ["fast"])]


def test_autotune_phases_can_run_alone():
    last: list = []
    cands = make_fake_candidates(last)
    settings = gs.TuneSettings(max_m=2)
    bench = cpu_bench(fake_timer(last))
    phase = gs.measure_defaults([(256, 384)], cands, settings, bench, gs.tune.Deadline(60.0))
    assert phase.done == {} and [p.bucket for p in phase.pending] == [1, 2] and set(last) == {gs.DEFAULT}
    assert phase.todo() == [(256, 384, 1, ["fast", "wrong", "nan", "broken"]),
                            (256, 384, 2, ["fast", "wrong", "nan", "broken"])]
    out = gs.measure_alternatives(phase, cands, settings, bench, gs.tune.Deadline(60.0))
    assert sorted(out) == [gs.shape_key(256, 384, 1), gs.shape_key(256, 384, 2)]
    assert all(e.choice == "fast" for e in out.values())


# ---------------------------------------------------------------------------------------------------------------------
# scripts/bench_gemm.py on CPU: --help, shape parsing, the markdown tables

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gemm", os.path.join(REPO_ROOT, "scripts", "bench_gemm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_help_and_no_gpu():
    import subprocess
    import sys

    script = os.path.join(REPO_ROOT, "scripts", "bench_gemm.py")
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "--tune" in r.stdout and "gate_up 24576x4096" in r.stdout
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def test_bench_shapes_and_markdown():
    bench = load_bench()
    assert bench.parse_shapes("qkv, gate_up,1024x2048") == [("qkv", 6144, 4096), ("gate_up", 24576, 4096),
                                                            ("1024x2048", 1024, 2048)]
    assert bench.MS == (1, 8, 32, 64, 96, 112, 128, 144, 192, 256)
    row = {"shape": "gate_up", "N": 24576, "K": 4096, "M": 128,
           "us": {"bf16": 77.6, "deepgemm_default": 103.6, "deepgemm_sms_124": 44.0, "triton_default": 59.8},
           "errors": {"triton_default": "rel. error 0.5 > 0.01", "deepgemm_sms_96": "ValueError: x"},
           "derived": {m: {"frac_copy_bw": 0.5, "tflops": 100.0, "frac_peak": 0.1, "x_bf16": 77.6 / us}
                       for m, us in {"bf16": 77.6, "deepgemm_default": 103.6, "deepgemm_sms_124": 44.0,
                                     "triton_default": 59.8}.items()}}
    res = {"peaks": {"copy_GBs": 3003.0, "bf16_tflops": 795.0, "fp8_tflops": 1313.0}, "rows": [row]}
    md = bench.markdown(res, ["bf16", "deepgemm_default", "deepgemm_sms_124", "deepgemm_sms_96", "triton_default"])
    lines = md.splitlines()
    assert lines[0] == "copy 3003 GB/s; peaks bf16 795, fp8 1313 TFLOP/s"
    assert lines[4] == ("| gate_up | 128 | 77.6 | 103.6 (x0.75) | 44.0 (x1.76) | n/a | 59.8 (x1.30) FAIL | "
                        "deepgemm_sms_124 |")
    assert lines[-1].startswith("| gate_up | 128 | 50%, 100 (10%) |") and "n/a" in lines[-1]


# ---------------------------------------------------------------------------------------------------------------------
# preparation: what runs once after load, in each --fp8rl-gemm-select mode


def fake_model(shapes, block=(128, 128), device="cpu"):
    model = torch.nn.Module()
    for i, (n, k) in enumerate(shapes):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=quant.FP8_DTYPE, device=device), requires_grad=False)
        layer._fp8rl = LayerState(f"l{i}", choose_scheme(k, [n], block), block, "fp32")
        model.add_module(f"l{i}", layer)
    channel = torch.nn.Module()  # a per-channel fallback layer is never tuned
    channel.weight = torch.nn.Parameter(torch.zeros(384, 200, dtype=quant.FP8_DTYPE), requires_grad=False)
    channel._fp8rl = LayerState("channel", choose_scheme(200, [384], block), block, "fp32")
    model.add_module("channel", channel)
    model.add_module("norm", torch.nn.LayerNorm(8))
    return model


def test_block_shapes_feed_prepare_model():
    model = fake_model([(256, 384), (256, 384), (128, 256)])
    assert block_shapes(model, "cpu") == [(128, 256), (256, 384)]
    assert block_shapes(model) == []  # CPU weights: nothing to tune on CUDA
    assert block_shapes(fake_model([(256, 384)], block=(64, 64)), "cpu") == []  # the cache is for 128x128 blocks


def install_fake_tuning(monkeypatch, calls, facts: DeepGemmFacts = OFF):
    last: list = []
    cands = make_fake_candidates(last)
    real = prepare_mod.autotune

    def autotune(shapes, candidates, settings, **kw):
        calls.append((list(shapes), sorted(kw["skip"]), settings.budget_s))
        assert kw.pop("log") == prepare_mod.logger.debug  # progress lines are debug; the decision log is prepare's
        return real(shapes, candidates, settings, log=quiet, **kw)

    monkeypatch.setattr(prepare_mod, "autotune", autotune)
    return cands, cpu_runtime(cands, facts, timer=fake_timer(last))


def test_prepare_auto_measures_missing_then_reads_the_cache(monkeypatch, caplog):
    calls: list = []
    cands, runtime = install_fake_tuning(monkeypatch, calls)
    assert gs.select(3, 256, 384) == gs.DEFAULT  # the apply path's lookup before anything is measured
    with caplog.at_level("INFO", logger=prepare_mod.__name__):
        got = gs.prepare_shapes([(256, 384)], request("auto", budget=30.0, max_m=8), runtime)
    assert calls == [([(256, 384)], [], 30.0)]
    assert sorted(got) == sorted(gs.shape_key(256, 384, b) for b in (1, 2, 4, 8))
    assert all(e.choice == "fast" for e in got.values())
    table = [r for r in caplog.records if "gemm_select (auto" in r.getMessage()]
    assert len(table) == 1 and "| 256 | 384 | 8 | fast |" in table[0].getMessage()
    assert gs.cached_choice(3, 256, 384, gs.load_entries(runtime.info), list(cands)) == "fast"
    assert gs.select(3, 256, 384) == "fast"  # the apply path's lookup sees what was just measured
    # a new process (fresh state) with the same cache: nothing is measured again
    gs.reset_state()
    calls.clear()
    assert sorted(gs.prepare_shapes([(256, 384)], request("auto", max_m=8), runtime)) == sorted(got)
    assert calls == []


def test_prepare_measures_only_what_is_missing(monkeypatch):
    calls: list = []
    _, runtime = install_fake_tuning(monkeypatch, calls)
    gs.prepare_shapes([(256, 384)], request("auto", max_m=4), runtime)
    gs.reset_state()
    calls.clear()
    got = gs.prepare_shapes([(256, 384), (128, 256)], request("auto", max_m=4), runtime)
    assert calls == [([(128, 256), (256, 384)], sorted(gs.shape_key(256, 384, b) for b in (1, 2, 4)), 20.0)]
    assert len(got) == 6


@pytest.mark.parametrize("mode", ["cache", "off"])
def test_prepare_never_measures_in_cache_or_off_mode(monkeypatch, mode):
    calls: list = []
    cands, runtime = install_fake_tuning(monkeypatch, calls)
    key = gs.shape_key(256, 384, 2)
    gs.merge_entries(None, runtime.info, {key: entry("fast", {}, names=list(cands))})
    got = gs.prepare_shapes([(256, 384)], request(mode, max_m=4), runtime)
    assert calls == []
    assert got == ({} if mode == "off" else {key: gs.load_entries(runtime.info)[key]})
    assert gs.select(2, 256, 384) == (gs.DEFAULT if mode == "off" else "fast")


def test_prepare_zero_budget_keeps_sglang(monkeypatch):
    calls: list = []
    _, runtime = install_fake_tuning(monkeypatch, calls)
    assert gs.prepare_shapes([(256, 384)], request("auto", budget=0.0, max_m=4), runtime) == {} and calls == []


def test_prepare_unwritable_cache_keeps_choices(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(gs.ENV_CACHE, str(blocker / "sub" / "gemm_select.json"))  # parent is a file
    calls: list = []
    cands, runtime = install_fake_tuning(monkeypatch, calls)
    with caplog.at_level("WARNING", logger=prepare_mod.__name__):
        got = gs.prepare_shapes([(256, 384)], request("auto", max_m=2), runtime)
    assert len(got) == 2 and "could not write the cache" in caplog.text
    assert gs.select(2, 256, 384) == "fast"


def test_the_servers_exclusion_is_the_candidate_set_measured(monkeypatch):
    """--fp8rl-gemm-exclude, as a scheduler process reads it, reaches the load-time preparation as its candidates."""
    from sglang_fp8rl.hooks import model_runner
    from sglang_fp8rl.server_args import ENV_VAR

    pdl = "fp8rl_n64_sk4_pdl"
    seen: dict = {}

    def prepare_shapes(shapes, request, runtime, agree=None):
        seen.update(shapes=shapes, exclude=request.exclude, names=list(runtime.candidates))
        return {}

    monkeypatch.setattr(prepare_mod, "prepare_shapes", prepare_shapes)
    monkeypatch.setattr(model_runner, "block_shapes", lambda model: [(256, 384)])
    monkeypatch.setenv(ENV_VAR, Fp8rlOptions(gemm_exclude=(pdl,)).to_json())
    model_runner._prepare_gemms(types.SimpleNamespace(model=None), agree=None)
    assert seen == {"shapes": [(256, 384)], "exclude": (pdl,),
                    "names": [n for n in gs.candidate_names() if n != pdl]}
