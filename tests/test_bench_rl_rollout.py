"""CPU tests of scripts/bench_rl_rollout.py: workload, server command lines (SGLang's real parser), log parsing (the
installed SGLang's own log lines), the report against hand-computed values, the HTTP client, the dry run and the
suite stage."""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import math
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time
import types
from typing import ClassVar

import bench_rl_rollout as RR
import pytest
import rollout_report as REP
import rollout_server as SRV
import rollout_workload as WL
from suite_stage import stage_command_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")

FIXTURE = os.path.join(ROOT, "tests", "data", "rl_rollout_recorded.json")
# the workload the fixture was recorded with
FIXTURE_ARGS = ["--num-prompts", "8", "--input-len", "16", "--output-median", "100", "--output-cap", "400"]
# hand-made answers of the long scale: bf16, bf16_graphs512 (0.8 x bf16's times), fp8 (0.64 x), fp8_kv (0.5 x)
LONG_FIXTURE = os.path.join(ROOT, "tests", "data", "rl_rollout_recorded_long.json")
LONG_ARGS = ["--scale", "long", "--num-prompts", "6"]


def _fixture() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------------
# workload


def test_lognormal_median_cap_and_seed():
    n = 20001
    xs = WL.output_lengths(n, "lognormal", 8192, seed=3, median=1500, sigma=1.0)
    assert len(xs) == n and min(xs) >= 1 and max(xs) == 8192
    assert statistics.median(xs) == pytest.approx(1500, rel=0.03)
    # P(L >= cap) = P(Z > ln(8192 / 1500) / sigma)
    p_cap = 0.5 * math.erfc(math.log(8192 / 1500) / math.sqrt(2))
    assert sum(x == 8192 for x in xs) / n == pytest.approx(p_cap, abs=0.01)
    assert xs == WL.output_lengths(n, "lognormal", 8192, seed=3, median=1500, sigma=1.0)
    assert xs != WL.output_lengths(n, "lognormal", 8192, seed=4, median=1500, sigma=1.0)
    # sigma 0: every length is the median; a cap below the median: more than half sit at the cap
    assert set(WL.output_lengths(50, "lognormal", 8192, 0, median=700, sigma=0.0)) == {700}
    low = WL.output_lengths(1001, "lognormal", 1000, 0, median=1500, sigma=1.0)
    assert max(low) == 1000 and statistics.median(low) == 1000 and sum(x == 1000 for x in low) > 500


def test_uniform_fixed_and_prompts():
    u = WL.output_lengths(5000, "uniform", 8192, 0, lo=10, hi=20)
    assert min(u) == 10 and max(u) == 20 and statistics.mean(u) == pytest.approx(15, abs=0.3)
    assert max(WL.output_lengths(500, "uniform", 15, 0, lo=10, hi=20)) == 15  # capped
    assert max(WL.output_lengths(500, "uniform", 64, 0, lo=1)) == 64  # hi defaults to the cap
    assert WL.output_lengths(4, "fixed", 8192, 0, median=1500) == [1500] * 4
    assert WL.output_lengths(4, "fixed", 1000, 0, fixed=3000) == [1000] * 4
    with pytest.raises(ValueError):
        WL.output_lengths(4, "pareto", 100, 0)
    p = WL.prompt_ids(5, 512, seed=7)
    assert len(p) == 5 and {len(x) for x in p} == {512}
    assert all(WL.TOKEN_RANGE[0] <= t < WL.TOKEN_RANGE[1] for x in p for t in x)
    assert p == WL.prompt_ids(5, 512, seed=7) and p != WL.prompt_ids(5, 512, seed=8)
    assert p == WL.prompt_ids(5, [512] * 5, seed=7)  # per-prompt lengths: the same ids when they are all equal
    q = WL.prompt_ids(3, [4, 9, 1], seed=7)
    assert [len(x) for x in q] == [4, 9, 1] and q[0] == p[0][:4]
    with pytest.raises(ValueError):
        WL.prompt_ids(2, [4], seed=7)


def test_prompt_length_distributions():
    n = 20001
    xs = WL.input_lengths(n, "lognormal", seed=3, length=2048, sigma=0.5, lo=256, hi=8192)
    assert statistics.median(xs) == pytest.approx(2048, rel=0.03) and min(xs) >= 256 and max(xs) == 8192
    # P(L > hi) = P(Z > ln(8192 / 2048) / 0.5); P(L < lo) = P(Z < ln(256 / 2048) / 0.5)
    assert sum(x == 8192 for x in xs) / n == pytest.approx(0.5 * math.erfc(math.log(4) / 0.5 / math.sqrt(2)),
                                                          abs=0.002)
    assert sum(x == 256 for x in xs) / n == pytest.approx(0.5 * math.erfc(math.log(8) / 0.5 / math.sqrt(2)),
                                                         abs=0.001)
    assert xs == WL.input_lengths(n, "lognormal", seed=3, length=2048, sigma=0.5, lo=256, hi=8192)
    assert xs[:50] != WL.input_lengths(50, "lognormal", seed=4, length=2048, sigma=0.5, lo=256, hi=8192)
    assert max(WL.input_lengths(500, "lognormal", 0, length=100, sigma=3.0)) > 10_000  # no upper bound given
    u = WL.input_lengths(3000, "uniform", 0, lo=100, hi=200)
    assert min(u) == 100 and max(u) == 200
    assert WL.input_lengths(3, "fixed", 0, length=77, lo=100, hi=50) == [77] * 3  # bounds are for the draws
    with pytest.raises(ValueError):
        WL.input_lengths(3, "uniform", 0, lo=1)
    with pytest.raises(ValueError):
        WL.input_lengths(3, "pareto", 0)


def test_cli_scales_and_workload():
    a = RR.parse_args([])
    assert (a.num_prompts, a.output_median, a.output_cap, a.input_len) == (384, 1500, 8192, 512)
    assert a.configs == ["bf16", "fp8"] and a.output_dist == "lognormal" and a.output_sigma == 1.0
    assert a.mem_fraction_static is None and a.input_dist == "fixed"
    g = RR.parse_args(["--scale", "long"])
    assert (g.num_prompts, g.input_dist, g.input_len, g.input_sigma, g.input_lo, g.input_hi) == (
        192, "lognormal", 2048, 0.5, 256, 8192)
    assert (g.output_dist, g.output_median, g.output_sigma, g.output_cap) == ("lognormal", 1500, 1.2, 16384)
    # the docstring's token counts of the long scale (seed 0)
    ins = WL.input_lengths(192, "lognormal", 0, length=2048, sigma=0.5, lo=256, hi=8192)
    outs = WL.output_lengths(192, "lognormal", 16384, 0, median=1500, sigma=1.2)
    assert (sum(ins), max(ins), sum(outs), sum(x == 16384 for x in outs)) == (449_778, 6091, 533_836, 4)
    g = RR.parse_args(["--scale", "long", "--input-dist", "fixed", "--input-len", "4096", "--output-sigma", "1"])
    assert (g.input_dist, g.input_len, g.output_sigma, g.output_cap) == ("fixed", 4096, 1.0, 16384)
    s = RR.parse_args(["--scale", "short"])
    assert (s.num_prompts, s.output_median, s.output_cap) == (256, 1000, 4096)
    s = RR.parse_args(["--scale", "short", "--num-prompts", "300", "--output-cap", "2048"])
    assert (s.num_prompts, s.output_median, s.output_cap) == (300, 1000, 2048)
    assert RR.parse_args(["--model", "qwen3-30b-a3b"]).mem_fraction_static == 0.88
    w = WL.make_workload(RR.parse_args(FIXTURE_ARGS))
    assert w["max_new_tokens"] == _fixture()["max_new_tokens"]  # deterministic with the seed
    # prompt lengths draw from a stream of their own: a seed's output lengths and first ids stay as they were
    v = WL.make_workload(RR.parse_args([*FIXTURE_ARGS, "--input-dist", "lognormal", "--input-lo", "8"]))
    assert v["max_new_tokens"] == w["max_new_tokens"] and len({len(x) for x in v["input_ids"]}) > 1
    assert v["input_ids"][0][:8] == w["input_ids"][0][:8] and v["input_stats"]["n"] == 8
    assert "8 prompts x lognormal(median 16, sigma 0.5) at least 8 random token ids" in WL.describe_workload(
        v["spec"])
    assert len(w["input_ids"]) == 8 and {len(x) for x in w["input_ids"]} == {16}
    assert w["stats"]["total"] == sum(w["max_new_tokens"]) and w["stats"]["max"] == max(w["max_new_tokens"])
    assert WL.request_body([1, 2], 7) == {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 7, "temperature": 1.0, "ignore_eos": True}}
    assert "lognormal(median 100, sigma 1) capped at 400" in WL.describe_workload(w["spec"])
    for bad in (["--extra-args", "nope=--x"], ["--extra-args", "fp8"], ["--num-prompts", "0"],
                ["--output-dist", "uniform", "--output-lo", "50", "--output-hi", "10"], ["--input-dist", "uniform"],
                ["--input-lo", "300", "--input-hi", "200"], ["--scale", "long", "--input-sigma", "-1"]):
        with pytest.raises(SystemExit):
            RR.parse_args(bad)


# ---------------------------------------------------------------------------------------------------------------------
# server command lines


def _server_parser():
    from sglang.srt import server_args as SA

    from sglang_fp8rl.server_args import add_cli_args

    if "fp8_online_blockwise" not in SA.QUANTIZATION_CHOICES:  # the plugin adds it at load_plugins() time
        SA.add_quantization_method_choices(["fp8_online_blockwise"])
    parser = argparse.ArgumentParser()
    SA.ServerArgs.add_cli_args(parser)
    add_cli_args(parser)  # what the plugin's ServerArgs hook adds to launch_server's parser
    return parser


@pytest.mark.parametrize("fa3_fallback", [False, True])
def test_server_commands_parse_with_sglang_server_args(fa3_fallback):
    """Every config's launch_server command line is accepted by SGLang 0.5.17's own ServerArgs parser."""
    from sglang_fp8rl.compat.runtime import decode_graph_limit_fields
    from sglang_fp8rl.server_args import FP8_DECODE_GRAPH_MAX_BS, options_from_namespace

    parser = _server_parser()
    args = RR.parse_args(["--configs", *RR.CONFIGS, "--extra-args", "all=--max-running-requests=512",
                          "fp8=--fp8rl-gemm-select off", "fp8_kv=--fp8rl-kv-scales=static", "--seed", "5"])
    plan = RR.build_plan(args, "/m/qwen3-8b", fa3_fallback=fa3_fallback)
    assert [p["name"] for p in plan] == list(RR.CONFIGS)
    assert len({p["port"] for p in plan}) == len(plan)
    for p in plan:
        cmd = p["cmd"]
        assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
        ns = parser.parse_args(cmd[3:])
        name = p["name"]
        assert ns.model_path == "/m/qwen3-8b" and ns.port == p["port"] and ns.load_format == "dummy"
        assert ns.skip_tokenizer_init and ns.decode_log_interval == 1 and ns.random_seed == 5
        assert ns.max_running_requests == 512 and ns.mem_fraction_static is None
        assert ns.quantization == (None if name.startswith("bf16") else "fp8_online_blockwise")
        assert ns.kv_cache_dtype == ("fp8_e4m3" if "_kv" in name else "auto")
        named = next((b for b in ("triton", "flashinfer") if name.endswith("_" + b)), None)
        backend = named or ("triton" if fa3_fallback else None)
        assert ns.attention_backend == backend  # None: SGLang's default (FA3 on Hopper)
        assert p["fa3_fallback"] == (fa3_fallback and named is None)
        assert ("SGLANG_FLASHINFER_USE_PAGED" in p["env"]) == (name == "fp8_kv_flashinfer")
        assert ns.decode_attention_backend == ("flashinfer" if name == "fp8_kv_fi_decode" else None)
        assert ns.fp8rl_gemm_select == ("off" if name == "fp8" else "auto")
        assert ns.fp8rl_kv_scales == ("static" if name == "fp8_kv" else "auto")
        assert ns.fp8rl_split_kv_max_batch == (8 if name == "fp8_kv_auto8" else 32)
        options_from_namespace(ns)  # every config's --fp8rl-* values are valid options
        assert p["env"]["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "0"
        # bf16_graphs512: the decode capture the plugin sets for FP8, in the field it sets (this release's)
        max_field, _ = decode_graph_limit_fields(ns)
        assert getattr(ns, max_field) == (FP8_DECODE_GRAPH_MAX_BS if name == "bf16_graphs512" else None)
    moe = RR.parse_args(["--model", "qwen3-30b-a3b", "--configs", "bf16", "--extra-args",
                         "bf16=--attention-backend flashinfer --kv-cache-dtype fp8_e4m3"])
    (p,) = RR.build_plan(moe, "/m/qwen3-30b-a3b", fa3_fallback=True)
    ns = parser.parse_args(p["cmd"][3:])
    assert ns.mem_fraction_static == 0.88 and ns.attention_backend == "flashinfer" and not p["fa3_fallback"]
    assert p["env"]["SGLANG_FLASHINFER_USE_PAGED"] == "1"  # FlashInfer's paged prefix path with an FP8 KV cache


def test_attention_backend_and_extra_args():
    assert RR.attention_backend([]) is None
    assert RR.attention_backend(["--attention-backend", "fa3", "--attention-backend=triton"]) == "triton"
    assert RR.parse_extra_args(["fp8=--a 1", "fp8=--b", "bf16=", "all=--c=2"], RR.CONFIGS) == {
        "fp8": ["--a", "1", "--b"], "bf16": [], "all": ["--c=2"]}
    assert RR.config_flags("fp8", {"fp8": ["--a"], "all": ["--c"]}) == [*RR.CONFIGS["fp8"], "--c", "--a"]
    with pytest.raises(ValueError):
        RR.parse_extra_args(["x=--a"], RR.CONFIGS)


# ---------------------------------------------------------------------------------------------------------------------
# log parsing


def _sglang_log_lines(caplog) -> list[str]:
    """Decode and prefill lines written by the installed SGLang's own SchedulerMetricsReporter (scheduler faked)."""
    MR = pytest.importorskip("sglang.srt.managers.scheduler_components.metrics_reporter")
    from sglang.srt.disaggregation.utils import DisaggregationMode

    class Pool:
        def get_decode_usage_msg_parts(self):
            return ["#token: 1234, token usage: 0.42"]

        get_prefill_usage_msg_parts = get_decode_usage_msg_parts

    sched = types.SimpleNamespace(
        pool_stats_observer=types.SimpleNamespace(get_pool_stats=Pool), forward_ct=7,
        spec_algorithm=types.SimpleNamespace(is_none=lambda: True), disaggregation_mode=DisaggregationMode.NULL,
        server_args=types.SimpleNamespace(language_only=False, encoder_transfer_backend=None), waiting_queue=[1, 2],
        kv_events_publisher=types.SimpleNamespace(publish_kv_events=lambda: None, emit_kv_metrics=lambda: None))
    rep = types.SimpleNamespace(
        scheduler=sched, current_scheduler_metrics_enabled=False, scheduler_status_logger=None, forward_ct_decode=1,
        decode_log_interval=1, is_stats_logging_rank=True, last_decode_stats_tic=time.perf_counter(),
        last_prefill_stats_tic=time.perf_counter(), num_generated_tokens=100, _graph_backend_label="cuda graph",
        enable_mfu_metrics=False, step_time_dict={}, stats=types.SimpleNamespace(new_token_ratio=0.0))
    with caplog.at_level(logging.INFO, logger=MR.logger.name):
        stats = MR.PrefillStats(log_input_tokens=8192, log_hit_tokens=0, new_token_ratio=0.7, num_new_seqs=16,
                                num_running_reqs=types.SimpleNamespace(total=12))
        MR.SchedulerMetricsReporter.report_prefill_stats(rep, None, stats, False)
        for running, graph in [(300, False), (256, True), (40, True)]:
            MR.SchedulerMetricsReporter.report_decode_stats(
                rep, graph, running_batch=types.SimpleNamespace(reqs=[None] * running, forward_iter=None))
    return [r.getMessage() for r in caplog.records if r.name == MR.logger.name]


def test_decode_lines_of_the_installed_sglang_parse(caplog):
    lines = _sglang_log_lines(caplog)
    assert len(lines) == 4 and lines[0].startswith("Prefill batch") and "cuda graph: False" in lines[0]
    d = REP.parse_decode_log("\n".join(f"[2026-11-25 10:00:0{i} TP0] {ln}" for i, ln in enumerate(lines)))
    assert (d["decode_batches"], d["no_graph_batches"], d["peak_running"], d["peak_queue"]) == (3, 1, 300, 2)
    assert d["no_graph_share"] == pytest.approx(1 / 3)
    assert d["no_graph_token_share"] == pytest.approx(300 / 596)
    assert all(REP.keep_lines(ln) == [ln] for ln in lines)
    # the floors read each step's held tokens from the same lines, and the prefill before the first step
    import rollout_floor as RF

    # (the reporter counts the generated tokens once: the later lines show a throughput of 0, which is no step)
    assert [(n, t, p) for n, _, t, p in RF.steps_with_tokens(lines)] == [(300, 1234, True)]


def test_scheduler_startup_line_wording():
    """The start-up line the KV pool and max running requests come from, in the installed scheduler's source."""
    import importlib.util

    spec = importlib.util.find_spec("sglang.srt.managers.scheduler")
    with open(spec.origin) as f:
        src = f.read()
    assert 'f"max_total_num_tokens={self.max_total_num_tokens}, "' in src
    assert 'f"max_running_requests={self.max_running_requests}, "' in src
    assert '"KV cache pool is full. Retract requests. "' in src
    line = ("[2026-11-25 10:00:03 TP0] max_total_num_tokens=335592, chunked_prefill_size=8192, max_prefill_tokens="
            "16384, max_running_requests=2048, context_len=40960, available_gpu_mem=10.12 GB")
    info = REP.parse_startup_log(line)
    assert info["kv_tokens"] == 335592 and info["max_running_requests"] == 2048


def test_fixture_logs_parse():
    cfg = _fixture()["configs"]
    bf16 = REP.parse_startup_log("\n".join(cfg["bf16"]["startup_log"]))
    assert bf16["kv_tokens"] == 335592 and bf16["kv_dtype"] == "torch.bfloat16" and bf16["weight_gib"] == 15.26
    kv = REP.parse_startup_log("\n".join(cfg["fp8_kv"]["startup_log"]))
    assert kv["kv_tokens"] == 784960 and kv["kv_dtype"] == "torch.float8_e4m3fn" and kv["fp8rl"]
    # bf16: running 8 8 8 6 6 4 3 2 1 1, the first five without a graph; the prefill line's "cuda graph" not counted
    d = REP.parse_decode_log("\n".join(cfg["bf16"]["run_log"]))
    assert (d["decode_batches"], d["no_graph_batches"], d["decode_tokens"], d["no_graph_tokens"]) == (10, 5, 47, 36)
    assert d["no_graph_share"] == 0.5 and d["no_graph_token_share"] == pytest.approx(36 / 47)
    assert d["peak_running"] == 8 and d["peak_queue"] == 2
    assert REP.parse_retractions("\n".join(cfg["bf16"]["run_log"])) == {"retract_events": 1, "retracted_reqs": 2}
    assert REP.parse_decode_log("")["no_graph_share"] is None and REP.parse_decode_log("")["peak_running"] is None
    assert REP.graph_max_bs({"cuda_graph_config": {"decode": {"max_bs": 256}}}) == 256
    assert REP.graph_max_bs({"cuda_graph_max_bs_decode": 160}) == 160 and REP.graph_max_bs({}) is None


# ---------------------------------------------------------------------------------------------------------------------
# the report


def test_report_matches_hand_computed_values():
    res = REP.build_report(_fixture()["configs"], 8)
    b, f, k = res["bf16"], res["fp8"], res["fp8_kv"]
    # bf16 completion times sorted: 2.0 2.5 3.0 3.5 6.0 8.0 9.5 10.0; 1434 tokens
    assert b["makespan_s"] == 10.0 and b["complete"] and b["done"] == 8
    assert b["p50_s"] == pytest.approx(3.5 + 0.5 * (6.0 - 3.5))  # 4.75
    assert b["p90_s"] == pytest.approx(9.5 + 0.3 * (10.0 - 9.5))  # 9.65
    assert b["output_tokens"] == 1434 and b["output_tok_s"] == pytest.approx(143.4)
    assert b["vs_base"] == {"speedup": 1.0, "output_tok_s": 1.0, "p50": 1.0, "p90": 1.0, "kv_tokens": 1.0,
                            "peak_running": 1.0}
    # fp8: every time x 0.8
    assert f["makespan_s"] == 8.0 and f["p50_s"] == pytest.approx(3.8) and f["p90_s"] == pytest.approx(7.72)
    assert f["vs_base"]["speedup"] == pytest.approx(1.25) and f["vs_base"]["output_tok_s"] == pytest.approx(1.25)
    assert f["vs_base"]["p50"] == pytest.approx(0.8) and f["vs_base"]["p90"] == pytest.approx(0.8)
    assert f["vs_base"]["kv_tokens"] == pytest.approx(392480 / 335592)
    assert (f["no_graph_batches"], f["decode_batches"], f["no_graph_tokens"], f["decode_tokens"]) == (2, 6, 16, 29)
    # fp8_kv: 1.5 2.0 2.5 3.0 4.0 5.0 6.0 7.5
    assert k["makespan_s"] == 7.5 and k["p50_s"] == pytest.approx(3.5) and k["p90_s"] == pytest.approx(6.45)
    assert k["output_tok_s"] == pytest.approx(1434 / 7.5) and k["vs_base"]["speedup"] == pytest.approx(10 / 7.5)
    assert k["vs_base"]["p90"] == pytest.approx(6.45 / 9.65) and k["no_graph_share"] == 0.0
    assert k["vs_base"]["kv_tokens"] == pytest.approx(784960 / 335592) and k["graph_max_bs"] == 8
    assert b["max_running_requests"] == 2048 and b["retract_events"] == 1


def _long_fixture() -> dict:
    with open(LONG_FIXTURE) as f:
        return json.load(f)


def test_baseline_is_the_faster_bf16():
    """Ratios against the faster of bf16 and bf16_graphs512 (whichever is listed first), the only one of them that
    ran, a finished one over one that did not finish, else the first config."""
    cfg = _long_fixture()["configs"]
    res = REP.build_report({n: cfg[n] for n in ("fp8", "bf16", "bf16_graphs512", "fp8_kv")}, 6)
    assert {r["baseline"] for r in res.values()} == {"bf16_graphs512"}
    # bf16 150 s, bf16_graphs512 120 s, fp8 96 s, fp8_kv 75 s
    assert res["fp8"]["vs_base"]["speedup"] == pytest.approx(1.25)
    assert res["fp8_kv"]["vs_base"]["speedup"] == pytest.approx(1.6)
    assert res["bf16"]["vs_base"]["speedup"] == pytest.approx(0.8) and res["bf16_graphs512"]["vs_base"]["p50"] == 1.0
    assert res["fp8_kv"]["vs_base"]["kv_tokens"] == pytest.approx(811924 / 357376)
    pick = REP.pick_baseline(res)
    assert pick["candidates"] == {"bf16": 150.0, "bf16_graphs512": 120.0}
    assert pick["why"] == "the faster BF16: bf16 150.0 s, bf16_graphs512 120.0 s"
    # bf16 faster: it is the baseline
    slow = {**cfg["bf16_graphs512"], "requests": [dict(r, done_s=r["done_s"] * 2) for r in cfg["bf16_graphs512"]
                                                  ["requests"]]}
    res = REP.build_report({"bf16_graphs512": slow, "bf16": cfg["bf16"], "fp8": cfg["fp8"]}, 6)
    assert res["fp8"]["baseline"] == "bf16" and res["fp8"]["vs_base"]["speedup"] == pytest.approx(150 / 96)
    # the faster one did not finish: the finished one is the baseline
    cut = {**cfg["bf16_graphs512"], "requests": [dict(r, ok=False) if r["i"] == 2 else r for r in
                                                 cfg["bf16_graphs512"]["requests"]]}
    res = REP.build_report({"bf16": cfg["bf16"], "bf16_graphs512": cut, "fp8": cfg["fp8"]}, 6)
    assert res["fp8"]["baseline"] == "bf16" and "bf16_graphs512 did not finish" in REP.pick_baseline(res)["why"]
    # one BF16 config, listed last; no BF16 config at all: the first config
    res = REP.build_report({"fp8": cfg["fp8"], "bf16_graphs512": cfg["bf16_graphs512"]}, 6)
    assert res["fp8"]["vs_base"]["speedup"] == pytest.approx(1.25)
    assert REP.pick_baseline(res)["why"] == "the only one of bf16 / bf16_graphs512 that ran"
    res = REP.build_report({"fp8_kv": cfg["fp8_kv"], "fp8": cfg["fp8"]}, 6)
    assert res["fp8"]["baseline"] == "fp8_kv" and res["fp8"]["vs_base"]["speedup"] == pytest.approx(75 / 96)
    assert REP.pick_baseline({})["config"] is None


def test_partial_failed_and_skipped_configs():
    records = {
        "bf16": {"requests": [{"i": 0, "ok": True, "done_s": 4.0, "output_tokens": 10},
                              {"i": 1, "ok": True, "done_s": 2.0, "output_tokens": 20},
                              {"i": 2, "ok": False, "error": "not done within the run timeout (5 s)"}],
                 "status": "1 requests failed or timed out", "run_s": 5.0,
                 "server_info": {"max_total_num_tokens": 1000, "max_running_requests": 7}},
        "fp8": {"flags": ["--quantization", "fp8_online_blockwise"], "status": "skipped (deadline)", "requests": []},
    }
    res = REP.build_report(records, 3)
    b = res["bf16"]
    assert (b["done"], b["failed"], b["complete"], b["makespan_s"], b["output_tok_s"]) == (2, 1, False, 4.0, 7.5)
    assert b["kv_tokens"] == 1000 and b["max_running_requests"] == 7  # from /server_info when the log lacks them
    assert b["errors"] == ["not done within the run timeout (5 s)"]
    assert res["fp8"]["makespan_s"] is None and res["fp8"]["vs_base"]["speedup"] is None
    meta = {"model_desc": "x", "workload_desc": "y", "lengths": WL.length_stats([10, 20, 30], 30)}
    text = REP.format_summary(res, meta)
    assert "| bf16 | 2/3 (1 requests failed or timed out) | > 5.0 |" in text
    assert "| fp8 | 0/3 (skipped (deadline)) | — |" in text
    assert REP.completion_curve(records["bf16"]["requests"]) == ([2.0, 4.0], [1, 2])


class _FakeAx:
    def __init__(self, calls):
        self.calls = calls

    def step(self, xs, ys, **kw):
        self.calls.append((xs, ys, kw["label"]))

    def __getattr__(self, name):
        return lambda *a, **k: None


def _fake_matplotlib(calls, fail=False) -> types.ModuleType:
    mpl = types.ModuleType("matplotlib")
    plt = types.ModuleType("matplotlib.pyplot")

    def subplots(**_kw):
        if fail:
            raise RuntimeError("no display backend")
        fig = types.SimpleNamespace(tight_layout=lambda: None,
                                    savefig=lambda path, **k: pathlib.Path(path).write_bytes(b"\x89PNG fake"))
        return fig, _FakeAx(calls)

    mpl.pyplot = plt
    plt.subplots, plt.close = subplots, lambda fig: None
    return mpl


def test_dry_run_writes_json_markdown_and_plot(tmp_path, monkeypatch, capsys):
    calls: list = []
    mpl = _fake_matplotlib(calls)
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", mpl.pyplot)
    out = tmp_path / "dry"
    assert RR.main(["--dry-run", "--out", str(out), "--configs", "bf16", "fp8", "fp8_kv", *FIXTURE_ARGS]) == 0
    printed = capsys.readouterr().out
    assert "sglang.launch_server" in printed and "--quantization fp8_online_blockwise --kv-cache-dtype fp8_e4m3" in \
        printed and "| fp8_kv | 8/8 | 7.5 |" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["dry_run"] and data["meta"]["recorded_mismatch"] == []
    assert list(data["results"]) == ["bf16", "fp8", "fp8_kv"]
    assert data["results"]["fp8"]["vs_base"]["speedup"] == pytest.approx(1.25)
    assert data["curves"]["bf16"][0] == [2.0, 2.5, 3.0, 3.5, 6.0, 8.0, 9.5, 10.0]
    md = (out / "summary.md").read_text()
    assert "| config | done | makespan s |" in md and "speed-up vs bf16" in md and "DRY RUN" in md
    assert "| bf16 | 8/8 | 10.0 | 4.8 | 9.7 | 143 | 335,592 | 8 | 50.0 % (5/10); 76.6 % of tokens | 1.000 |" in md
    assert (out / "completion.png").read_bytes().startswith(b"\x89PNG")
    assert [c[1][-1] for c in calls] == [8, 8, 8] and calls[0][0][:2] == [0.0, 2.0]
    assert not (out / "answers.json").exists()  # only a real run records answers


def test_dry_run_of_the_long_scale_side_by_side_configs(tmp_path, monkeypatch, capsys):
    """--scale long with recorded answers of bf16, bf16_graphs512, fp8 and fp8_kv: lognormal prompt lengths, their
    command lines, and a table against the faster BF16 (bf16_graphs512 here), its steps' column first."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "long"
    assert RR.main(["--dry-run", *LONG_ARGS, "--configs", "bf16", "bf16_graphs512", "fp8", "fp8_kv", "--gpus", "0",
                    "1", "--recorded", LONG_FIXTURE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--random-seed 0 --cuda-graph-max-bs 512\n" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["recorded_mismatch"] == [] and data["meta"]["workload"]["input_dist"] == "lognormal"
    assert data["meta"]["input_lengths"]["total"] == 20_052 and data["meta"]["input_lengths"]["max"] == 6091
    assert data["baseline"]["config"] == "bf16_graphs512"
    assert {n: round(r["vs_base"]["speedup"], 4) for n, r in data["results"].items()} == {
        "bf16": 0.8, "bf16_graphs512": 1.0, "fp8": 1.25, "fp8_kv": 1.6}
    md = (out / "summary.md").read_text()
    assert "6 prompts x lognormal(median 2048, sigma 0.5) within [256, 8192] random token ids, output lognormal(" \
           "median 1500, sigma 1.2) capped at 16384" in md
    assert "ratios against bf16_graphs512: the faster BF16: bf16 150.0 s, bf16_graphs512 120.0 s" in md
    assert "| bf16 | 6/6 | 150.0 |" in md and "| fp8_kv | 6/6 | 75.0 |" in md and "speed-up vs bf16_graphs512" in md
    assert "| running requests | bf16_graphs512: steps, ms/step, s | bf16: steps" in md
    assert "| 1 | 1, 16.00, 0.0 | 1, 20.00, 0.0 | 1, 12.80, 0.0 | 1, 10.00, 0.0 | 0.80 | 1.25 | 1.60 |" in md
    # bf16's capture (4 in this hand-made run) left its 5-6-request steps without a graph; graphs512's did not
    assert data["results"]["bf16"]["no_graph_batches"] == 3
    assert data["results"]["bf16_graphs512"]["no_graph_batches"] == 0


def test_dry_run_survives_a_failed_plot_and_flags_a_workload_mismatch(tmp_path, monkeypatch, capsys):
    mpl = _fake_matplotlib([], fail=True)
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", mpl.pyplot)
    out = tmp_path / "dry"
    assert RR.main(["--dry-run", "--out", str(out), "--configs", "fp8", "bf16", *FIXTURE_ARGS, "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert "plotting failed" in printed and "do not match this workload" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["recorded_mismatch"] and list(data["results"]) == ["fp8", "bf16"]
    # listed second, bf16 is still the baseline (the only BF16 config)
    assert data["results"]["fp8"]["vs_base"]["speedup"] == pytest.approx(1.25)
    assert data["baseline"]["config"] == "bf16" and data["results"]["bf16"]["vs_base"]["speedup"] == 1.0
    assert not (out / "completion.png").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: the numbers still come out
    assert RR.main(["--dry-run", "--out", str(out), "--configs", "bf16", *FIXTURE_ARGS]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no answers for"):
        RR.main(["--dry-run", "--out", str(out), "--configs", "bf16_triton", *FIXTURE_ARGS])


# ---------------------------------------------------------------------------------------------------------------------
# the HTTP client, against a fake /generate


class _Generate(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list] = []
    release = threading.Event()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        n = body["sampling_params"]["max_new_tokens"]
        if type(self).release.wait(n / 1000.0):  # 1 ms per token, unless the test stops the "server"
            self.send_response(503)
            self.end_headers()
            return
        data = json.dumps({"output_ids": list(range(n)), "meta_info": {
            "completion_tokens": n, "finish_reason": {"type": "length", "length": n}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    _Generate.seen, _Generate.release = [], threading.Event()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Generate)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    _Generate.release.set()
    srv.shutdown()
    srv.server_close()


def test_submit_all_records_each_completion(fake_server):
    # the delays are far apart (2 s against at most 0.15 s), so a loaded machine cannot reorder them
    wl = {"input_ids": [[i, i + 1] for i in range(12)], "max_new_tokens": [2000, 20, 150, 60] * 3}
    recs, run_s = SRV.submit_all(fake_server, wl, timeout_s=30)
    assert len(recs) == 12 and all(r["ok"] for r in recs) and run_s < 20
    assert [r["output_tokens"] for r in recs] == wl["max_new_tokens"] and {r["finish"] for r in recs} == {"length"}
    # submitted at once: every request finishes after its own delay, the longest last
    assert {r["max_new_tokens"] for r in sorted(recs, key=lambda r: r["done_s"])[-3:]} == {2000}
    assert all(r["done_s"] >= r["max_new_tokens"] / 1000.0 for r in recs)
    assert max(r["done_s"] for r in recs) < 2.0 * 3  # not one after another (that would take >= 3 x 2 s + ...)
    assert all(b["sampling_params"] == {"max_new_tokens": b["sampling_params"]["max_new_tokens"], "temperature": 1.0,
                                        "ignore_eos": True} for b in _Generate.seen)
    assert sorted(map(tuple, (b["input_ids"] for b in _Generate.seen))) == sorted(map(tuple, wl["input_ids"]))


def test_submit_all_stops_at_the_run_timeout(fake_server):
    wl = {"input_ids": [[1], [2], [3]], "max_new_tokens": [10, 20, 60_000]}  # the last one would take 60 s
    stopped = []

    def stop():
        stopped.append(time.perf_counter())
        _Generate.release.set()  # the "server" goes away: open requests end

    recs, run_s = SRV.submit_all(fake_server, wl, timeout_s=1.0, on_timeout=stop)
    assert stopped and 1.0 <= run_s < 5
    assert recs[0]["ok"] and recs[1]["ok"] and not recs[2]["ok"] and "503" in recs[2]["error"]
    s = REP.summarize_requests(recs, 3)
    assert (s["done"], s["complete"], s["output_tokens"]) == (2, False, 30)


# ---------------------------------------------------------------------------------------------------------------------
# the script and the suite stage


def test_script_imports_light_and_help():
    code = (f"import sys; sys.path[:0] = [{SCRIPTS!r}]; import bench_rl_rollout; bad = [m for m in ('torch', "
            "'sglang', 'transformers', 'matplotlib', 'requests') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_rl_rollout.py"), "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60, check=False)
    assert r.returncode == 0 and "--extra-args" in r.stdout and "--dry-run" in r.stdout


def test_suite_stage_passes_its_arguments(tmp_path):
    """run_gpu_suite.sh rl_rollout runs the script with --scale short, a deadline, and RL_ROLLOUT_ARGS / RL_ARGS."""

    def run(**env):
        return stage_command_lines(tmp_path, "rl_rollout", "bench_rl_rollout.py",
                                   unset=("RL_ARGS", "RL_ROLLOUT_ARGS"), **env)

    (line,) = run(RL_ROLLOUT_ARGS="--configs bf16 fp8_kv", RL_ARGS="--arms bf16")
    assert "--scale short" in line and "--deadline-s" in line and line.endswith("--configs bf16 fp8_kv")
    assert f"--out {tmp_path}/work/rl_rollout" in line and f"--model-dir {tmp_path}/work/models" in line
    (line,) = run(RL_ARGS="--scale full")
    assert line.endswith("--scale full")
    long_args = "--scale long --configs bf16 bf16_graphs512 fp8 fp8_kv --gpus 0 1"
    (line,) = run(RL_ROLLOUT_ARGS=long_args)
    assert line.endswith(long_args)
    a = RR.parse_args(line.split("bench_rl_rollout.py", 1)[1].split())  # the stage's --scale short comes first
    assert (a.scale, a.num_prompts, a.output_cap, a.gpus) == ("long", 192, 16384, [0, 1]) and a.deadline_s > 0


FAKE_SERVER = r'''
import json, sys, threading, time, http.server
port = int(sys.argv[sys.argv.index("--port") + 1])
fp8 = "fp8_online_blockwise" in sys.argv
kv = 2000 if fp8 else 1000
print(f"[2026-11-25 10:00:00 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: {kv}, K size: 1 GB",
      flush=True)
print(f"[2026-11-25 10:00:01 TP0] max_total_num_tokens={kv}, chunked_prefill_size=8192, max_prefill_tokens=16384, "
      "max_running_requests=8, context_len=40960, available_gpu_mem=10.12 GB", flush=True)
lock, running = threading.Lock(), [0]

class H(http.server.BaseHTTPRequestHandler):
    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"max_total_num_tokens": kv, "cuda_graph_config": {"decode": {"max_bs": 4}},
                    "internal_states": [{}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        with lock:
            running[0] += 1
            print(f"[2026-11-25 10:00:02 TP0] Decode batch, #running-req: {running[0]}, #token: 10, token usage: 0.01, "
                  f"cuda graph: {running[0] <= 4}, gen throughput (token/s): 1.00, #queue-req: 0", flush=True)
        time.sleep(n / (2000.0 if fp8 else 1000.0))
        with lock:
            running[0] -= 1
        self._send({"output_ids": [1] * n, "meta_info": {"completion_tokens": n, "finish_reason": {"type": "length"}}})

    def log_message(self, *a):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_main_runs_servers_and_replays_its_answers(tmp_path, monkeypatch, capsys):
    """main() end to end on CPU: a fake launch_server (health, /server_info, /generate, scheduler log lines) per
    config, FA3 missing (triton fallback), results.json + answers.json; then --dry-run on those answers gives the same
    report."""
    from conftest import free_port

    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    monkeypatch.setattr(RR, "server_command", lambda model, port, flags, seed, mem=None: [
        sys.executable, str(fake), "--port", str(port), *flags])
    monkeypatch.setattr(RR, "fa3_missing", lambda plan: "no flash_ops here")
    import make_models
    import rollout_floor as RF

    monkeypatch.setattr(make_models, "ensure", lambda d, names: None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    monkeypatch.setattr(RF, "measure_bandwidth_gbps", lambda: (3000.0, "measured before the servers started"))
    out = tmp_path / "run"
    wl = ["--num-prompts", "6", "--input-len", "4", "--output-median", "100", "--output-cap", "300"]
    rc = RR.main(["--out", str(out), "--model-dir", str(tmp_path), "--port-base", str(free_port()), "--deadline-s",
                  "300", "--min-s", "20", "--start-timeout", "60", *wl])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "elapsed" in printed and "FlashAttention-3 does not import here" in printed
    data = json.loads((out / "results.json").read_text())
    b, f = data["results"]["bf16"], data["results"]["fp8"]
    assert b["complete"] and f["complete"] and b["fa3_fallback"]
    assert b["flags"][-2:] == ["--attention-backend", "triton"]
    assert (b["kv_tokens"], f["kv_tokens"], b["max_running_requests"], b["graph_max_bs"]) == (1000, 2000, 8, 4)
    assert b["decode_batches"] == 6 and b["peak_running"] >= 2 and f["vs_base"]["kv_tokens"] == 2.0
    lens = WL.make_workload(RR.parse_args(wl))["max_new_tokens"]
    assert b["output_tokens"] == f["output_tokens"] == sum(lens)
    assert b["makespan_s"] >= max(lens) / 1000.0 and f["makespan_s"] >= max(lens) / 2000.0
    assert "(triton: no FA3)" in (out / "summary.md").read_text()
    assert (out / "server_bf16.log").exists() and (out / "answers.json").exists()
    dry = tmp_path / "dry"
    assert RR.main(["--dry-run", "--recorded", str(out / "answers.json"), "--out", str(dry), *wl]) == 0
    replay = json.loads((dry / "results.json").read_text())
    assert replay["meta"]["recorded_mismatch"] == []
    # the run measured the copy bandwidth before its servers, kept it with its answers, and the replay took it
    assert json.loads((out / "answers.json").read_text())["bandwidth_gbps"] == 3000.0
    assert replay["meta"]["bandwidth_source"] == "recorded with the answers"
    assert replay["results"]["fp8"]["floors"] == data["results"]["fp8"]["floors"]
    assert data["results"]["fp8"]["floors"]["all"]["steps"] >= 1
    for name in ("bf16", "fp8"):
        for key in ("makespan_s", "p50_s", "p90_s", "kv_tokens", "no_graph_share", "peak_running", "vs_base"):
            assert replay["results"][name][key] == data["results"][name][key], (name, key)


def test_percentiles_count_unfinished_requests_as_later_than_every_finished_one():
    """A run cut short (10 planned, 8 done): p50 is the finished requests' median rank, p90 lands on an unfinished
    request and is unknown, never the largest finished time."""
    done = [float(x) for x in range(1, 9)]
    assert REP.completion_percentile(done, 8, 50) == 4.5
    assert REP.completion_percentile(done, 10, 50) == 5.5  # numpy rank 4.5 of 10: between the 5th and 6th
    assert REP.completion_percentile(done, 10, 90) is None
    assert REP.completion_percentile([], 10, 50) is None


def test_gpus_run_a_waves_configs_side_by_side_one_per_gpu(tmp_path, monkeypatch, capsys):
    """--gpus 0 1: configs run in waves of two, at the same time, each server seeing only its GPU; a third config
    waits for the next wave."""
    calls, lock = [], threading.Lock()

    def run_config(item, log_path, workload, start_timeout, run_timeout, deadline_at=math.inf):
        with lock:
            calls.append((item["name"], item["env"].get("CUDA_VISIBLE_DEVICES"), time.time()))
        time.sleep(0.3)
        with lock:
            calls.append((item["name"], "end", time.time()))
        return {"flags": item["flags"], "status": "ok", "requests": []}

    monkeypatch.setattr(RR, "run_config", run_config)
    monkeypatch.setattr(RR, "fa3_missing", lambda plan: None)
    monkeypatch.setitem(sys.modules, "make_models", types.SimpleNamespace(ensure=lambda d, names: None))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    wl = ["--num-prompts", "4", "--input-len", "4", "--output-median", "10", "--output-cap", "20"]
    RR.main(["--out", str(tmp_path / "run"), "--model-dir", str(tmp_path), "--configs", "bf16", "fp8", "fp8_kv",
             "--gpus", "0", "1", "--min-s", "1", *wl])
    starts = {name: (gpu, t) for name, gpu, t in calls if gpu != "end"}
    ends = {name: t for name, what, t in calls if what == "end"}
    assert {name: gpu for name, (gpu, _) in starts.items()} == {"bf16": "0", "fp8": "1", "fp8_kv": "0"}
    assert starts["fp8"][1] < ends["bf16"] and starts["bf16"][1] < ends["fp8"]  # side by side
    assert starts["fp8_kv"][1] >= max(ends["bf16"], ends["fp8"])  # the next wave
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_dry_run_joins_the_answers_of_runs_made_one_after_another(tmp_path, monkeypatch):
    """--recorded A B: each config from the first file that has it (one config per GPU call), one table."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    data = _fixture()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({**data, "configs": {"bf16": data["configs"]["bf16"], "fp8": data["configs"]["fp8"]}}))
    second.write_text(json.dumps({**data, "configs": {"fp8_kv": data["configs"]["fp8_kv"],
                                                      "bf16": data["configs"]["fp8"]}}))  # never read: a has bf16
    out = tmp_path / "dry"
    assert RR.main(["--dry-run", "--recorded", str(first), str(second), "--out", str(out), "--configs", "bf16", "fp8",
                    "fp8_kv", *FIXTURE_ARGS]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["recorded_sources"] == {"bf16": str(first), "fp8": str(first), "fp8_kv": str(second)}
    assert res["results"]["fp8"]["vs_base"]["speedup"] == pytest.approx(1.25)
    with pytest.raises(SystemExit, match="no answers for"):
        RR.main(["--dry-run", "--recorded", str(first), "--out", str(out), "--configs", "fp8_kv", *FIXTURE_ARGS])


def test_joined_report_names_each_configs_run_and_reads_gzip(tmp_path, monkeypatch):
    import gzip

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    data = _fixture()
    first, second = tmp_path / "bf16.json.gz", tmp_path / "fp8.json"
    with gzip.open(first, "wt") as f:
        json.dump({**data, "configs": {"bf16": data["configs"]["bf16"]}}, f)
    second.write_text(json.dumps({**data, "configs": {"fp8": data["configs"]["fp8"]}}))
    out = tmp_path / "joined"
    assert RR.main(["--dry-run", "--recorded", str(first), str(second), "--out", str(out), "--configs", "bf16", "fp8",
                    *FIXTURE_ARGS]) == 0
    md = (out / "summary.md").read_text()
    assert "joined from the recorded answers of runs made one after another" in md and "DRY RUN" not in md
    assert "bf16 from bf16.json.gz; fp8 from fp8.json" in md


def test_decode_steps_by_running_requests():
    """Step time = running / gen throughput of each decode line; bands of running requests; speed-up per band."""
    import rollout_regimes as RG

    def line(n, thr):
        return (f"[2026-11-27 08:36:20] Decode batch, #running-req: {n}, #token: 9, token usage: 0.01, cuda graph: "
                f"True, gen throughput (token/s): {thr}, #queue-req: 0")

    slow = [line(300, 10000.0)] * 3 + [line(4, 500.0), line(4, 400.0), line(4, 500.0), line(1, 0.0)]
    fast = [line(300, 15000.0)] * 3 + [line(4, 800.0)] * 3 + ["Prefill batch, #new-seq: 1"]
    r = RG.regimes(slow)
    assert list(r) == ["3-4", "257-384"] and r["3-4"]["steps"] == 3  # a zero throughput is not a step
    assert r["3-4"]["median_step_ms"] == pytest.approx(8.0) and r["3-4"]["seconds"] == pytest.approx(0.026)
    assert r["257-384"]["median_step_ms"] == pytest.approx(30.0)
    text = RG.format_regimes({"bf16": r, "fp8": RG.regimes(fast)})
    assert "| 3-4 | 3, 8.00, 0.0 | 3, 5.00, 0.0 | 1.60 |" in text
    assert "| 257-384 | 3, 30.00, 0.1 | 3, 20.00, 0.1 | 1.50 |" in text
    assert RG.format_regimes({"bf16": {}}) == ""
    # with DP attention SGLang names the rank ("Decode batch [0]"), as the graph-share parser of the report reads it
    dp = line(2, 100.0).replace("Decode batch,", "Decode batch [0],")
    assert RG.decode_steps([dp]) == [(2, 0.02)] and REP.parse_decode_log(dp)["peak_running"] == 2
