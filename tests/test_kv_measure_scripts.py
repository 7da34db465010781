"""CPU tests of the FP8-KV measurement scripts (issue 15): bench_rollout's KV configs, backends and tables
(scripts/kv_measure.py), the drifted policy (scripts/kv_drift.py) and accuracy_regression's FP8-KV arms
(scripts/accuracy_kv.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from fractions import Fraction

import accuracy_kv as AK
import accuracy_metrics as AM
import accuracy_regression as AR
import bench_rollout as BR
import bench_rollout_child as CHILD
import bench_rollout_configs as BRC
import bench_rollout_report as BRR
import kv_drift as D
import kv_measure as KV
import pytest
import torch
import train_toy_policy as TT

# ---------------------------------------------------------------------------------------------------------------------
# the recalibration log line


def test_recalibration_line_formats_parse():
    assert KV.parse_recalibration_ms(KV.KV_RECAL_LOG_EXAMPLE) == 41.0
    stamp = "[2026-11-24 10:00:00 TP0] "
    assert KV.parse_recalibration_ms(stamp + "[fp8rl] KV scales recalibrated (36 layers, 4 seqs in 2 s) in 1,234.5 ms")\
        == 1234.5
    assert KV.parse_recalibration_ms("[fp8rl] KV-scale recalibration took 0.052 s") == pytest.approx(52.0)
    assert KV.parse_recalibration_ms("[fp8rl] kv scales recalibrated in 800 us") == pytest.approx(0.8)
    assert KV.parse_recalibration_ms("[fp8rl] KV scales recalibrated in 41 ms (max rel. error 0.02)") == 41.0
    for line in ["[fp8rl] KV scales from trainer in 0.3 ms: 36 layers",
                 "[fp8rl] KV scales not recalibrated after this update (requests are running); deferred",
                 "[fp8rl] KV scales recalibration failed in 3 ms: non-finite K",
                 "[fp8rl] KV scales: calibrated on the engine (2048 tokens of built-in text)",
                 "[fp8rl] gemm_select: measured 6 entries in 29.3 s",
                 "KV scales recalibrated in 5 ms (no [fp8rl] tag)",
                 "[fp8rl] KV scales recalibrated (4 seqs of 512 tokens)"]:
        assert KV.parse_recalibration_ms(line) is None, line


def test_recalibration_line_of_the_engine_parses():
    """The line the plugin logs today (Calibration.summary) gives its time back, to the 0.1 ms it prints."""
    from sglang_fp8rl.kv_scales.calibrate import Calibration

    cal = Calibration(amax={0: (3.0, 1.5), 1: (9.0, 0.5)}, scales={0: (2 ** -6, 2 ** -7), 1: (2 ** -5, 2 ** -8)},
                      changed=(1,), tokens=2048, seconds=0.04137, finished_at=0.0, source="calibration")
    assert KV.parse_recalibration_ms("[2026-11-24 TP0] " + cal.summary()) == pytest.approx(41.4)
    trainer = dataclasses.replace(cal, source="trainer")
    assert KV.parse_recalibration_ms(trainer.summary()) is None


def test_recalibration_times_keep_one_rank():
    text = "\n".join(["[t TP1] [fp8rl] KV scales recalibrated in 9.0 ms",
                      "[t TP0] [fp8rl] KV scales recalibrated in 7.0 ms", "noise",
                      "[t TP0] [fp8rl] KV scales recalibrated in 8.0 ms"])
    assert KV.recalibration_times(text) == [7.0, 8.0]
    assert KV.recalibration_times("[fp8rl] KV scales recalibrated in 3 ms\n") == [3.0]
    assert KV.recalibration_times("") == []


# ---------------------------------------------------------------------------------------------------------------------
# bench_rollout: configs, backends, flags


def test_kv_configs_and_backend_env():
    on = BRC.config_spec("fp8_online_blockwise_kv")
    assert on["flags"] == ["--quantization", "fp8_online_blockwise", "--kv-cache-dtype", "fp8_e4m3"]
    assert BRC.config_spec("fp8_online_blockwise_kv_static")["flags"][-2:] == ["--fp8rl-kv-scales", "static"]
    assert BRC.config_spec("fp8_online_blockwise_kv_sglang_write")["flags"] == [*on["flags"], "--fp8rl-kv-write",
                                                                               "sglang"]
    from sglang_fp8rl.server_args import parse_args
    assert parse_args(BRC.config_spec("fp8_online_blockwise_kv_sglang_write")["flags"]).kv_write == "sglang"  # real
    assert parse_args(on["flags"]).kv_write == "fused"  # the default write
    assert BRC.config_spec("bf16_kv")["flags"] == ["--kv-cache-dtype", "fp8_e4m3"]
    assert "SGLANG_FLASHINFER_USE_PAGED" not in on["env"]
    assert BRC.config_spec("fp8_online_blockwise_kv", backend="flashinfer")["env"]["SGLANG_FLASHINFER_USE_PAGED"] == "1"
    assert BRC.config_spec("bf16_kv", backend="flashinfer")["env"]["SGLANG_FLASHINFER_USE_PAGED"] == "1"
    assert "SGLANG_FLASHINFER_USE_PAGED" not in BRC.config_spec("bf16", backend="flashinfer")["env"]
    assert set(BRC.KV_CONFIGS) <= set(BRC.EXTRA_CONFIGS) and not set(BRC.KV_CONFIGS) & set(BRC.CONFIGS)


def test_plan_runs_labels_and_order():
    assert BRC.plan_runs(["bf16", "fp8_online_blockwise_kv"], "triton", ["flashinfer", "triton"]) == [
        ("bf16", "bf16", "triton"), ("bf16@flashinfer", "bf16", "flashinfer"),
        ("fp8_online_blockwise_kv", "fp8_online_blockwise_kv", "triton")]
    assert BRC.plan_runs(["fp8_online_blockwise_kv"], "flashinfer", ["triton"]) == [
        ("bf16@triton", "bf16", "triton"), ("fp8_online_blockwise_kv", "fp8_online_blockwise_kv", "flashinfer")]
    assert [r[0] for r in BRC.plan_runs(["bf16", "bf16"], "triton")] == ["bf16"]


def _sglang_parser():
    one_batch = pytest.importorskip("sglang.benchmark.one_batch")
    from sglang.srt import server_args as SA

    from sglang_fp8rl.server_args import add_cli_args

    if "fp8_online_blockwise" not in SA.QUANTIZATION_CHOICES:
        SA.add_quantization_method_choices(["fp8_online_blockwise"])
    parser = argparse.ArgumentParser()
    SA.ServerArgs.add_cli_args(parser)
    one_batch.BenchArgs.add_cli_args(parser)
    add_cli_args(parser)  # what the plugin's ServerArgs hook adds in the benchmark process
    return parser, one_batch


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_kv_bench_flags_parse_with_sglang_bench_one_batch(backend):
    """The KV configs' flags, with two output lengths, are accepted by SGLang 0.5.17's own bench_one_batch parser."""
    parser, one_batch = _sglang_parser()
    for cfg in BRC.KV_CONFIGS:
        argv = (BRC.bench_flags("/m/qwen3-8b", [64, 128], 512, [256, 1024], 0.7, "/tmp/r.jsonl", cfg,
                               attention_backend=backend) + BRC.config_spec(cfg, backend=backend)["flags"])
        ns = parser.parse_args(argv)
        ba = one_batch.BenchArgs.from_cli_args(ns)
        assert ba.output_len == (256, 1024) and ba.batch_size == (64, 128)
        assert ns.attention_backend == backend and ns.kv_cache_dtype == "fp8_e4m3"
        assert ns.fp8rl_kv_scales == ("static" if cfg.endswith("_static") else "auto")
    assert BRC.sweep_order([64, 128], [256, 1024], repeat=1) == [(64, 256), (64, 1024), (128, 256), (128, 1024)]
    prof = BRC.profile_flags("x", [1024, 256], 3)
    assert prof[prof.index("--profile-start-step") + 1] == "64"  # from the shortest output length


def test_parse_rows_from_log_assigns_output_lengths():
    def row(bs, dec):
        return (f"Prefill. latency: 0.5 s, throughput: 1000.0 token/s\nDecode 0. Batch size: {bs}, latency: 0.01 s, "
                f"throughput: 1.0 token/s\nDecode.  median latency: 0.01 s, median throughput: {dec} token/s\n"
                f"Total. latency: 3.0 s, throughput: 10.0 token/s\n")

    text = (row(64, 1.0) + "Benchmark ...\n" + row(64, 100.0) + row(64, 101.0)
            + "skipping (128, 512, 256) due to max batch size limit\n" + row(128, 200.0))
    sweep = BRC.sweep_order([64, 128], [256, 1024])
    rows = BRR.parse_rows_from_log(text, sweep)
    assert [(r["batch_size"], r["output_len"], r["median_decode_throughput"]) for r in rows] == [
        (64, 256, 100.0), (64, 1024, 101.0), (128, 1024, 200.0)]
    assert "output_len" not in BRR.parse_rows_from_log(text)[0]  # without a sweep: as before
    info = BRR.parse_log(text)
    assert info["skipped"] == [[128, 256]] and info["skipped_bs"] == [128] and info["kv_recal_ms"] == []


def test_cli_output_lengths_backends_and_fa3_refusal(monkeypatch, capsys):
    a = BR.parse_args(["--output-len", "1024", "256", "256"])
    assert a.output_lens == [256, 1024] and a.output_len == 1024 and a.attention_backend == "triton"
    monkeypatch.setattr(KV, "fa3_available", lambda python: (False, "No module named 'sgl_kernel'"))
    with pytest.raises(SystemExit, match="FlashAttention-3 does not import here"):
        BR.main(["--dry-run", "--attention-backend", "fa3", "--out", "/tmp/never_written_fp8rl"])
    with pytest.raises(SystemExit, match="FlashAttention-3"):
        BR.main(["--dry-run", "--bf16-backend", "fa3", "--out", "/tmp/never_written_fp8rl"])
    monkeypatch.setattr(KV, "fa3_available", lambda python: (True, ""))
    assert BR.main(["--dry-run", "--attention-backend", "fa3", "--configs", "fp8_online_blockwise_kv",
                    "--out", "/tmp/never_written_fp8rl"]) == 0
    assert "--attention-backend fa3" in capsys.readouterr().out
    assert not os.path.exists("/tmp/never_written_fp8rl")


def test_fa3_probe_reports_why():
    ok, why = KV.fa3_available(sys.executable)
    try:
        import sgl_kernel.flash_attn  # noqa: F401
        from sgl_kernel import flash_ops  # noqa: F401
    except (ImportError, OSError):
        assert not ok and why
    else:  # pragma: no cover - a machine with FA3
        assert ok


def test_dry_run_flashinfer_kv(capsys):
    assert BR.main(["--dry-run", "--attention-backend", "flashinfer", "--bf16-backend", "triton", "--configs", "bf16",
                    "fp8_online_blockwise_kv", "--output-len", "256", "1024", "--out", "/tmp/never_written_fp8rl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    env = {ln.split(":")[0][2:]: ln for ln in lines if ln.startswith("# ")}
    cmds = {lab: lines[lines.index(env[lab]) + 1] for lab in env}
    assert set(cmds) == {"bf16", "bf16@triton", "fp8_online_blockwise_kv"}
    assert "SGLANG_FLASHINFER_USE_PAGED=1" in env["fp8_online_blockwise_kv"]
    assert "SGLANG_FLASHINFER_USE_PAGED" not in env["bf16"] + env["bf16@triton"]
    assert "--attention-backend triton" in cmds["bf16@triton"] and "--attention-backend flashinfer" in cmds["bf16"]
    assert "--output-len 256 1024" in cmds["fp8_online_blockwise_kv"]
    assert "--kv-cache-dtype fp8_e4m3" in cmds["fp8_online_blockwise_kv"]


def test_child_stops_a_config_that_needs_the_missing_option(monkeypatch, capsys):
    argv = ["--kv-cache-dtype", "fp8_e4m3", "--fp8rl-kv-scales", "static"]
    assert KV.kv_scales_supported()  # this checkout has the option
    CHILD._check_kv_scales_option(argv)
    monkeypatch.setattr(KV, "kv_scales_supported", lambda: False)
    with pytest.raises(SystemExit) as e:
        CHILD._check_kv_scales_option(argv)
    assert e.value.code == 3 and KV.KV_OPTION_MISSING in capsys.readouterr().out
    CHILD._check_kv_scales_option(argv[:2])
    out = capsys.readouterr().out
    assert "WARNING" in out and "static scale 1.0" in out
    assert BRR.parse_log(out)["kv_option_missing"]
    CHILD._check_kv_scales_option(["--quantization", "fp8"])  # no FP8 cache: nothing to say
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------------------------------
# the FP8-KV table


def _row(bs, ol, decode, total=None):
    total = total if total is not None else 0.5 + ol * bs / decode
    return {"batch_size": bs, "output_len": ol, "median_decode_throughput": decode,
            "median_decode_latency": bs / decode, "total_latency": total,
            "prefill_throughput": 1.0, "overall_throughput": 1.0}


def _grid(scale):
    """bs 64 / 128 at out 256 / 1024 with decode tok/s = scale x a base."""
    base = {(64, 256): 5000.0, (128, 256): 8000.0, (64, 1024): 4000.0, (128, 1024): 6000.0}
    return [_row(bs, ol, v * scale) for (bs, ol), v in base.items()]


def _results():
    return {
        "bf16": {"config": "bf16", "backend": "triton", "rows": _grid(1.0)},
        "bf16@flashinfer": {"config": "bf16", "backend": "flashinfer", "rows": _grid(1.05)},
        "fp8_online_blockwise_kv": {"config": "fp8_online_blockwise_kv", "backend": "triton", "rows": _grid(1.65),
                                    "flags": ["--kv-cache-dtype", "fp8_e4m3"], "status": "ok",
                                    "kv_dtype": "torch.float8_e4m3fn", "kv_recal_ms": [41.0, 45.0]},
        "fp8_online_blockwise_kv_static": {"config": "fp8_online_blockwise_kv_static", "backend": "triton",
                                           "rows": _grid(1.7), "flags": ["--kv-cache-dtype", "fp8_e4m3"],
                                           "status": "ok", "kv_dtype": "torch.bfloat16"},
    }


def test_kv_ratios_against_same_and_best_backend():
    res = _results()
    rows = {(r["label"], r["bs"], r["output_len"]): r for r in KV.kv_ratio_rows(res)}
    r = rows[("fp8_online_blockwise_kv", 128, 1024)]
    assert r["vs_same"] == pytest.approx(1.65) and r["same_label"] == "bf16"
    assert r["vs_best"] == pytest.approx(1.65 / 1.05) and r["best_label"] == "bf16@flashinfer"
    assert KV.bf16_best(res, 64, 256) == (pytest.approx(5250.0), "bf16@flashinfer")
    assert KV.bf16_same_backend(res, "fa3", 64, 256) == (None, None)
    assert not any(r["config"] == "bf16" for r in KV.kv_ratio_rows(res))


def test_kv_targets_pass_miss_and_margin():
    t = {(x["bs"], x["output_len"]): x for x in KV.kv_targets(_results())}
    assert set(t) == {(64, 256), (128, 256), (64, 1024), (128, 1024)}
    # vs BF16 best: 1.65 / 1.05 = 1.571: passes 1.55 at out 256, misses 1.60 at out 1024
    assert t[(64, 256)]["status"] == "PASS" and t[(64, 256)]["margin"] == pytest.approx(1.65 / 1.05 - 1.55)
    assert t[(128, 1024)]["status"] == "MISS" and t[(128, 1024)]["margin"] == pytest.approx(1.65 / 1.05 - 1.60)
    assert t[(128, 1024)]["status_same"] == "PASS" and t[(128, 1024)]["margin_same"] == pytest.approx(0.05)
    res = _results()
    kv = res["fp8_online_blockwise_kv"]
    kv["rows"] = [r for r in kv["rows"] if r["output_len"] == 256]
    assert {x["status"] for x in KV.kv_targets(res) if x["output_len"] == 1024} == {"n/a"}


def test_recalibration_against_the_rollout():
    (r,) = KV.recal_report(_results())
    row = KV.find_row(_results()["fp8_online_blockwise_kv"], 128, 1024)
    assert r["count"] == 2 and r["max_ms"] == 45.0 and r["median_ms"] == 43.0
    assert r["rollout_s"] == pytest.approx(row["total_latency"])
    assert r["fraction"] == pytest.approx(0.045 / row["total_latency"]) and r["status"] == "PASS"
    assert r["steps_equivalent"] == pytest.approx(45.0 / (row["median_decode_latency"] * 1e3))
    slow = _results()
    slow["fp8_online_blockwise_kv"]["kv_recal_ms"] = [1e3 * row["total_latency"] * 0.03]
    assert KV.recal_report(slow)[0]["status"] == "MISS"
    slow["fp8_online_blockwise_kv"]["rows"] = _grid(1.0)[:1]
    assert KV.recal_report(slow)[0]["status"] == "n/a"


def test_kv_section_text_and_warnings():
    res = _results()
    text = KV.format_kv_section(res)
    assert "| fp8_online_blockwise_kv | triton | 1024 | 128 | 9,900 | 1.650 | 1.571 (flashinfer) |" in text
    assert "decode @bs128 out1024 >= 1.60: 1.571 MISS (margin -0.029); same backend 1.650 PASS (+0.050)" in text
    assert "2 recalibration(s), median 43.0 ms, max 45.0 ms" in text and "PASS" in text
    assert "fp8_online_blockwise_kv_static: the KV cache was allocated as torch.bfloat16, not FP8" in text
    res["fp8_online_blockwise_kv"]["kv_recal_ms"] = []
    assert "no KV-scale recalibration line" in KV.format_kv_section(res)
    assert KV.format_kv_section({"bf16": res["bf16"]}) == ""
    weights_only = {"bf16": res["bf16"], "fp8_online_blockwise": {**res["fp8_online_blockwise_kv"], "flags": []}}
    assert KV.format_kv_section(weights_only) == ""  # no FP8-KV entry: no FP8-KV section


def test_bench_rollout_two_backends_merged(tmp_path, monkeypatch):
    """main() twice with the bench faked: triton, then FlashInfer merging the first run; the second table divides
    by the faster BF16 and reports the recalibration time of both FP8-KV runs."""
    speed = {("bf16", "triton"): 1.0, ("bf16", "flashinfer"): 1.1, ("fp8_online_blockwise_kv", "triton"): 1.7,
             ("fp8_online_blockwise_kv", "flashinfer"): 1.8, ("fp8_online_blockwise_kv_static", "flashinfer"): 1.9}
    seen = []

    def fake_run(label, cmd, env, log_path, timeout_s):
        backend = cmd[cmd.index("--attention-backend") + 1]
        cfg = label.split("@")[0]
        seen.append((label, backend, env.get("SGLANG_FLASHINFER_USE_PAGED")))
        dtype = "torch.float8_e4m3fn" if "--kv-cache-dtype" in cmd else "torch.bfloat16"
        recal = "[2026-11-24 TP0] [fp8rl] KV scales recalibrated (36 layers, 2048 tokens) in 40.0 ms\n" \
            if cfg == "fp8_online_blockwise_kv" else ""
        with open(log_path, "w") as f:
            f.write(f"KV Cache is allocated. dtype: {dtype}, #tokens: 400000, K size: 1 GB\n{recal}")
        with open(cmd[cmd.index("--result-filename") + 1], "w") as f:
            for r in _grid(speed[(cfg, backend)]):
                f.write(json.dumps(r) + "\n")
        return {"rc": 0, "timed_out": False, "wall_s": 1.0}

    monkeypatch.setattr(BR, "run_config", fake_run)
    common = ["--output-len", "256", "1024", "--model-dir", str(tmp_path / "models")]
    assert BR.main(["--configs", "bf16", "fp8_online_blockwise_kv", "--out", str(tmp_path / "tri"), *common]) == 0
    assert BR.main(["--attention-backend", "flashinfer", "--configs", "bf16", "fp8_online_blockwise_kv",
                    "--merge", str(tmp_path / "tri" / "results.json"), "--out", str(tmp_path / "fi"), *common]) == 0
    assert ("fp8_online_blockwise_kv", "flashinfer", "1") in seen and ("bf16", "flashinfer", None) in seen
    res = json.loads((tmp_path / "fi" / "results.json").read_text())
    assert set(res["results"]) == {"bf16", "fp8_online_blockwise_kv", "bf16@triton", "fp8_online_blockwise_kv@triton"}
    assert res["meta"]["output_lens"] == [256, 1024] and res["meta"]["attention_backend"] == "flashinfer"
    t = {(x["label"], x["bs"], x["output_len"]): x for x in res["kv_targets"]}
    assert t[("fp8_online_blockwise_kv", 128, 1024)]["vs_best"] == pytest.approx(1.8 / 1.1)
    assert t[("fp8_online_blockwise_kv@triton", 64, 256)]["vs_best"] == pytest.approx(1.7 / 1.1)
    assert t[("fp8_online_blockwise_kv@triton", 64, 256)]["vs_same"] == pytest.approx(1.7)
    assert {r["label"] for r in res["kv_recalibration"]} == {"fp8_online_blockwise_kv",
                                                             "fp8_online_blockwise_kv@triton"}
    summary = (tmp_path / "fi" / "summary.md").read_text()
    assert "output 256:" in summary and "output 1024:" in summary and "attention backend flashinfer" in summary
    assert "FP8 KV cache (issue 15)" in summary and "recalibration(s)" in summary
    assert "(from " in summary  # merged entries say where they come from
    merged = json.loads((tmp_path / "tri" / "results.json").read_text())
    assert merged["results"]["fp8_online_blockwise_kv"]["kv_recal_ms"] == [40.0]
    # a third call adds one config and merges both earlier tables (repeatable --merge, merged-of-merged entries)
    assert BR.main(["--attention-backend", "flashinfer", "--configs", "fp8_online_blockwise_kv_static",
                    "--merge", str(tmp_path / "tri" / "results.json"), "--merge", str(tmp_path / "fi" / "results.json"),
                    "--out", str(tmp_path / "fi2"), *common]) == 0
    res = json.loads((tmp_path / "fi2" / "results.json").read_text())
    assert set(res["results"]) == {"fp8_online_blockwise_kv_static", "bf16@triton", "fp8_online_blockwise_kv@triton",
                                   "bf16@flashinfer", "fp8_online_blockwise_kv@flashinfer"}
    rows = {(r["label"], r["bs"], r["output_len"]): r for r in res["kv_ratios"]}
    assert rows[("fp8_online_blockwise_kv_static", 64, 1024)]["vs_same"] == pytest.approx(1.9 / 1.1)
    assert rows[("fp8_online_blockwise_kv_static", 64, 1024)]["same_label"] == "bf16@flashinfer"


def test_combine_keeps_this_runs_entries():
    mine = {"bf16": {"config": "bf16", "backend": "flashinfer", "rows": [1]}}
    merged = {"bf16@flashinfer": {"config": "bf16", "backend": "flashinfer", "rows": [2]},
              "bf16@triton": {"config": "bf16", "backend": "triton", "rows": [3]}}
    assert BR.combine(mine, merged) == {"bf16": mine["bf16"], "bf16@triton": merged["bf16@triton"]}


# ---------------------------------------------------------------------------------------------------------------------
# the drift


def test_parse_and_auto_factor():
    assert D.parse_factor("64") == 64 and D.parse_factor("1/256") == Fraction(1, 256)
    assert D.parse_factor(" auto ") == D.AUTO and D.parse_factor("0.25") == Fraction(1, 4)
    for bad in ["48", "0", "-4", "x", "1/3"]:
        with pytest.raises(ValueError):
            D.parse_factor(bad)
    assert D.auto_factor(5.0, 64) == 512  # 5 x 512 = 2560 >= 1792; 5 x 256 = 1280 is not
    assert D.auto_factor(100.0, 256) == 256
    assert D.auto_factor(1792.0, 1) == 1
    with pytest.raises(ValueError):
        D.auto_factor(0.0, 64)


def _tiny_qwen3(dtype=torch.float64, seed=0, layers=2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=TT.VOCAB_SIZE, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=128,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms, so that the drift moves real values
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def _seqs():
    return [TT.prompt_ids(a, b) + TT.answer_ids(a, b) for a, b in [(123, 4567), (99999, 100), (5000, 5000)]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_drift_preserves_the_function_and_scales_kv_amax(dtype):
    model = _tiny_qwen3(dtype)
    drifted = _tiny_qwen3(dtype, seed=1)
    drifted.load_state_dict(D.drift_state_dict(model.state_dict(), 64, "256"))
    ids = torch.tensor(_seqs())
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, drifted(input_ids=ids).logits
    assert torch.equal(a, b)  # powers of two: bit for bit
    before, after = D.kv_amax(model, _seqs()), D.kv_amax(drifted, _seqs())
    assert len(before) == 2
    for (k0, v0), (k1, v1) in zip(before, after):
        assert k1 == 64 * k0 and v1 == 256 * v0
    assert D.kv_amax(drifted, _seqs()[:1])[0][0] <= after[0][0]


def test_drift_changes_exactly_the_planned_tensors():
    sd = _tiny_qwen3(torch.float32).state_dict()
    out = D.drift_state_dict(sd, "1/4", 8)
    changed = {n for n in sd if not torch.equal(sd[n], out[n])}
    assert changed == {f"model.layers.{i}.self_attn.{t}.weight" for i in range(2)
                       for t in ("k_norm", "q_norm", "v_proj", "o_proj")}
    assert torch.equal(out["model.layers.0.self_attn.q_norm.weight"], sd["model.layers.0.self_attn.q_norm.weight"] * 4)
    with pytest.raises(ValueError, match="resolve 'auto'"):
        D.drift_state_dict(sd, "auto", 8)


def test_drift_without_qk_norm_uses_the_projections_and_checks_exactness():
    names = [f"model.layers.0.self_attn.{p}.{k}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
             for k in ("weight", "bias") if not (p == "o_proj" and k == "bias")]
    plan = D.drift_plan(names, Fraction(4), Fraction(2))
    assert plan["model.layers.0.self_attn.k_proj.bias"] == 4 and plan["model.layers.0.self_attn.q_proj.weight"] == \
        Fraction(1, 4)
    assert plan["model.layers.0.self_attn.v_proj.bias"] == 2 and plan["model.layers.0.self_attn.o_proj.weight"] == \
        Fraction(1, 2)
    with pytest.raises(ValueError, match="no o_proj weight"):
        D.drift_plan([n for n in names if "o_proj" not in n], Fraction(4), Fraction(2))
    with pytest.raises(ValueError, match="no attention layer"):
        D.drift_plan(["lm_head.weight"], Fraction(4), Fraction(2))
    big = {"model.layers.0.self_attn.v_proj.weight": torch.full((2, 2), 3e38, dtype=torch.bfloat16),
           "model.layers.0.self_attn.o_proj.weight": torch.ones(2, 2, dtype=torch.bfloat16),
           "model.layers.0.self_attn.k_norm.weight": torch.ones(2, dtype=torch.bfloat16),
           "model.layers.0.self_attn.q_norm.weight": torch.ones(2, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="not exact"):
        D.drift_state_dict(big, 1, 4)


def _save_tiny_checkpoint(path, dtype=torch.bfloat16):
    model = _tiny_qwen3(torch.float32)
    model.to(dtype).save_pretrained(path)
    TT.build_tokenizer().save_pretrained(path)
    (path / "task.json").write_text(json.dumps(TT.DEFAULT_TASK))
    return model


def test_write_drifted_checkpoint_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    src, dst = tmp_path / "toy", tmp_path / "drifted"
    _save_tiny_checkpoint(src)
    rec = D.write_drifted_checkpoint(str(src), str(dst), 64, "256", extra={"note": "x"})
    assert rec["k_factor"] == "64" and rec["v_factor"] == "256" and rec["tensors_scaled"] == 8 and rec["layers"] == 2
    assert D.read_drift_record(str(dst)) == rec and D.read_drift_record(str(src)) is None
    assert (dst / "task.json").exists() and (dst / "tokenizer.json").exists()
    assert not (tmp_path / "drifted.partial").exists()
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    ids = torch.tensor(_seqs())
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    (k0, v0), (k1, v1) = D.kv_amax(a, _seqs())[0], D.kv_amax(b, _seqs())[0]
    assert (k1, v1) == (64 * k0, 256 * v0)


# ---------------------------------------------------------------------------------------------------------------------
# accuracy arms


def test_every_arm_that_calibrates_gets_the_task_batch(tmp_path):
    """--kv-calibration task: the in-context task sequences go to every arm that calibrates its K/V scales (the
    split-KV and FA3 arms too, not only fp8_kv_calibrate), so their scales agree; none where no arm calibrates."""
    import accuracy_driver as DRV

    task = dict(TT.DEFAULT_TASK, prefix_len=40)

    def args(*arms, kv_calibration="task"):
        return argparse.Namespace(arms=list(arms), kv_calibration=kv_calibration, out=str(tmp_path))

    for arms in (["fp8_kv_splitkv"], ["fp8", "fp8_kv_fa3"], ["fp8_kv_calibrate", "fp8_kv_splitkv_lean"]):
        path = DRV.resolve_kv_calibration(args(*arms), task)
        assert path == str(tmp_path / "kv_calibration.json"), arms
        seqs = json.loads((tmp_path / "kv_calibration.json").read_text())
        assert len(seqs) == 64 and all(len(q) == 1 + 40 + 1 + 12 + 7 for q in seqs)  # prefix, problem, answer
    assert DRV.resolve_kv_calibration(args("fp8", "fp8_kv_static"), task) == ""
    assert DRV.resolve_kv_calibration(args("fp8_kv_splitkv", kv_calibration="default"), task) == ""
    assert DRV.resolve_kv_calibration(args("fp8_kv_splitkv"), None) == ""
    assert DRV.resolve_kv_calibration(args("fp8_kv_fa3", kv_calibration="b.json"), task) == os.path.abspath("b.json")


def test_arm_settings_and_options():
    assert AK.arm_engine_kwargs("fp8", "fp8_online_blockwise") == {"quantization": "fp8_online_blockwise"}
    assert AK.arm_engine_kwargs("fp8_kv_static", "q") == {"quantization": "q", "kv_cache_dtype": "fp8_e4m3"}
    assert AK.arm_options("fp8") == {} and AK.arm_options("fp8_kv_static", "/c.json") == {"kv_scales": "static"}
    assert AK.arm_options("fp8_kv_calibrate", "/c.json") == {"kv_scales": "calibrate", "kv_calibration": "/c.json"}
    assert AK.arm_engine_kwargs("fp8_kv_splitkv_bf16q", "q") == {"quantization": "q", "kv_cache_dtype": "fp8_e4m3",
                                                                 "attention_backend": "fa3"}
    assert AK.arm_options("fp8_kv_splitkv") == {"kv_scales": "calibrate", "decode_attention": "split_kv"}
    assert AK.arm_options("fp8_kv_fa3") == {"kv_scales": "calibrate", "decode_attention": "fa3"}
    assert AK.arm_engine_kwargs("fp8_kv_fa3", "q")["attention_backend"] == "fa3"
    assert AK.arm_options("fp8_kv_splitkv_bf16q") == {"kv_scales": "calibrate", "decode_attention": "split_kv",
                                                      "decode_query": "bf16"}
    assert AK.arm_options("fp8_kv_splitkv_lean") == {"kv_scales": "calibrate", "decode_attention": "split_kv",
                                                     "decode_query": "bf16", "producer_quant": "on"}
    from sglang_fp8rl.server_args import Fp8rlOptions

    for arm in AK.ARMS:  # every arm's options are valid plugin options
        Fp8rlOptions(**{k: v for k, v in AK.arm_options(arm, "/c.json").items()})
    assert AK.engine_name("original", "fp8") == "fp8" and AK.engine_name("drifted", "bf16") == "drifted_bf16"
    with pytest.raises(ValueError):
        AK.arm_engine_kwargs("fp8_kv", "q")


def test_fp8rl_options_published_and_restored(monkeypatch):
    from sglang_fp8rl import server_args as SA

    monkeypatch.setenv(SA.ENV_VAR, SA.Fp8rlOptions(bf16_first_layers=1).to_json())
    before = os.environ[SA.ENV_VAR]
    with AK.fp8rl_options({"kv_scales": "static"}):
        opts = SA.get_options()
        assert opts.kv_scales == "static" and opts.bf16_first_layers == 1  # the user's options stay
    assert os.environ[SA.ENV_VAR] == before
    monkeypatch.delenv(SA.ENV_VAR)
    with AK.fp8rl_options({"kv_scales": "calibrate"}):
        assert SA.get_options().kv_scales == "calibrate"
    assert SA.ENV_VAR not in os.environ
    with pytest.raises(SystemExit, match="no kv_nonsense option"):
        with AK.fp8rl_options({"kv_nonsense": 1}):
            pass
    assert AK.missing_options(["kv_scales", "kv_calibration"]) == []


def _rec(gen_lps, score_lps, outs=None):
    outs = outs or [[1, 2]] * len(gen_lps)
    return {"gen": [{"output_ids": o, "logprobs": g} for o, g in zip(outs, gen_lps)],
            "score": [{"token_logprobs": s, "dists": []} for s in score_lps]}


def test_records_signature_and_diff(tmp_path):
    sig = AK.signature(model="/m", top_k=32, conts=AK.prompts_digest([[1, 2]]))
    rec = _rec([[-0.1, -0.2]], [[None, -0.5]])
    rec["score"][0]["dists"] = [{3: -0.1, 17: -2.4}, {}]
    path = AK.record_path(str(tmp_path), "drifted", "fp8")
    AK.save_record(path, sig, rec)
    assert AK.load_record(path, sig) == rec  # token ids come back as ints
    assert AK.load_record(path, {**sig, "top_k": 20}) is None
    assert AK.load_record(str(tmp_path / "none.json.gz"), sig) is None
    d = AK.record_diff(rec, rec)
    assert AK.is_identical(d) and d["greedy_identical_fraction"] == 1.0
    other = _rec([[-0.1, -0.25]], [[None, -0.4]], outs=[[1, 3]])
    d = AK.record_diff(rec, other)
    assert d["greedy_identical_fraction"] == 0.0 and d["max_abs_gen_logprob_diff"] == 0.0  # first token only
    assert d["max_abs_score_logprob_diff"] == pytest.approx(0.1) and not AK.is_identical(d)


def _metrics(tmpe, kl, em):
    return {"tmpe_fp8_vs_bf16_engine_scoring": tmpe, "kl_continuation": {"mean": kl, "p99": kl},
            "kl_prompt": {"mean": kl}, "task_exact_match_fp8": em, "task_exact_match_bf16": 1.0,
            "greedy_identical_fraction": 1.0, "top1_agreement_continuation": 1.0}


def test_verdicts_and_table():
    table = {"original": {"fp8": _metrics(1.0001, 1e-7, 1.0), "fp8_kv_static": _metrics(1.001, 1e-5, 1.0),
                          "fp8_kv_calibrate": _metrics(1.001, 1e-5, 1.0)},
             "drifted": {"fp8": _metrics(1.0001, 1e-7, 1.0), "fp8_kv_static": _metrics(1.3, 0.2, 0.6),
                         "fp8_kv_calibrate": _metrics(1.001, 1e-5, 1.0)}}
    same = {"greedy_identical_fraction": 1.0, "max_abs_gen_logprob_diff": 0.0, "max_abs_score_logprob_diff": 0.0}
    diffs = {"bf16": same, "fp8_kv_calibrate": {**same, "max_abs_score_logprob_diff": 0.01}}
    v = AK.verdicts(table, diffs)
    assert any(s.startswith("calibrate close to weight-only FP8 on the original policy: yes") for s in v)
    assert any(s.startswith("static degrades on the drifted policy (vs calibrate): yes") for s in v)
    assert any(s.startswith("bf16: drifted == original") and ": yes" in s for s in v)
    assert any(s.startswith("fp8_kv_calibrate: drifted == original") and ": NO" in s for s in v)
    text = AK.format_arms_table(table, diffs, {"n_prompts": 4, "kl_exact": True, "missing": ["drifted/bf16"],
                                               "drift": {"k_factor": "512", "v_factor": "4096", "k_amax_before": 5.0,
                                                         "k_amax_after": 2560.0},
                                               "kv_scales": {"original/fp8_kv_calibrate": {
                                                   "writes": 1, "source": "calibration", "seconds": 0.04,
                                                   "scales": {"0": [0.5, 0.25]}, "amax": {"0": [100.0, 50.0]}}}})
    assert "| drifted | fp8_kv_static | 0.2 / 0.2 |" in text and "K x512, V x4096" in text
    assert "INCOMPLETE" in text and "drifted/bf16" in text
    assert "1 write(s), source calibration, last 40.0 ms, k scale [0.5, 0.5], k amax max 100" in text
    assert AK.kv_telemetry_line(None).startswith("no KV-scale telemetry")
    table["drifted"]["fp8_kv_static"] = _metrics(1.001, 1e-5, 1.0)
    assert any("static degrades on the drifted policy (vs calibrate): NO" in s for s in AK.verdicts(table, {}))
    table["original"]["fp8_kv_calibrate"] = _metrics(1.02, 1e-3, 0.9)
    assert any("original policy: NO" in s for s in AK.verdicts(table, {}))


class _KVFakeEngine:
    """sglang.Engine stand-in: p(next | last token), shifted by the arm; the static FP8 cache breaks on a drifted
    policy (its K/V would clip), everything else computes (nearly) the BF16 function."""

    instances = []

    def __init__(self, **kw):
        from sglang_fp8rl.server_args import get_options

        self.kw = kw
        self.mode = get_options().kv_scales if kw.get("kv_cache_dtype") else None
        self.calibration = get_options().kv_calibration
        drifted = D.read_drift_record(kw["model_path"]) is not None
        self.shift = 0.0 if not kw.get("quantization") else {None: 0.01, "calibrate": 0.012,
                                                             "static": 4.0 if drifted else 0.012}[self.mode]
        _KVFakeEngine.instances.append(self)
        os.write(1, f"[fp8rl] fake engine kv={self.mode}\n".encode())

    def _dist(self, last):
        logits = [0.0] * TT.VOCAB_SIZE
        logits[(last * 7 + 3) % 17] = 4.0
        logits[TT.EOS] = 1.0 + self.shift
        return dict(enumerate(AR_softmax(logits)))

    def get_server_info(self):
        kv = {"writes": 1, "source": "calibration", "seconds": 0.01, "scales": {"0": [0.5, 0.25]},
              "amax": {"0": [100.0, 50.0]}} if self.mode == "calibrate" else {"writes": 0}
        return {"internal_states": [{"fp8rl": {"kv_scales": kv}}]}

    def generate(self, input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len):
        outs = []
        for ids in input_ids:
            top_in = [None] + [[(lp, t, None) for t, lp in self._dist(ids[j - 1]).items()] for j in range(1, len(ids))]
            tok_in = [(None, ids[0], None)] + [(self._dist(ids[j - 1])[ids[j]], ids[j], None)
                                               for j in range(1, len(ids))]
            out, last, tok_out = [], ids[-1], []
            for _ in range(sampling_params["max_new_tokens"]):
                d = self._dist(last)
                t = max(d, key=d.get)
                out.append(t)
                tok_out.append((d[t], t, None))
                last = t
                if t in sampling_params.get("stop_token_ids", []):
                    break
            outs.append({"output_ids": out, "meta_info": {"input_top_logprobs": top_in, "input_token_logprobs": tok_in,
                                                          "output_token_logprobs": tok_out, "finish_reason": None}})
        return outs

    def shutdown(self):
        pass


def AR_softmax(logits):
    import math

    m = max(logits)
    z = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - z for x in logits]


def test_accuracy_kv_arms_end_to_end_with_fake_engine(tmp_path, monkeypatch):
    sglang = pytest.importorskip("sglang")
    monkeypatch.setattr(sglang, "Engine", _KVFakeEngine, raising=False)
    monkeypatch.delenv("FP8RL_OPTIONS", raising=False)
    model = tmp_path / "toy"
    _save_tiny_checkpoint(model)
    out = tmp_path / "acc"
    argv = ["--model", str(model), "--task", "addition", "--out", str(out), "--n-prompts", "6", "--chunk", "4",
            "--no-hf-reference", "--arms", "fp8", "fp8_kv_static", "fp8_kv_calibrate", "--policies", "original",
            "drifted", "--reuse"]
    _KVFakeEngine.instances = []
    assert AR.main(argv) == 0
    engines = _KVFakeEngine.instances
    assert len(engines) == 8 and [e.mode for e in engines[:4]] == [None, None, "static", "calibrate"]
    assert engines[3].kw["kv_cache_dtype"] == "fp8_e4m3" and engines[3].calibration.endswith("kv_calibration.json")
    assert engines[2].calibration == "" and engines[4].kw["model_path"] == str(out / "policy_drifted")
    assert "FP8RL_OPTIONS" not in os.environ  # restored after every engine
    cal = json.loads((out / "kv_calibration.json").read_text())
    assert len(cal) == 64 and all(len(s) <= 128 and max(s) < TT.VOCAB_SIZE for s in cal)
    res = json.loads((out / "accuracy.json").read_text())
    drift = res["meta"]["drift"]
    assert Fraction(drift["k_factor"]) >= 64 and Fraction(drift["v_factor"]) >= 256
    assert drift["k_amax_after"] >= D.DRIFT_TARGET_AMAX and drift["v_amax_after"] >= D.DRIFT_TARGET_AMAX
    assert drift["k_amax_after"] == pytest.approx(drift["k_amax_before"] * float(Fraction(drift["k_factor"])), rel=1e-6)
    arms = res["arms"]
    assert arms["drifted"]["fp8_kv_static"]["kl_continuation"]["mean"] > 100 * arms["drifted"]["fp8_kv_calibrate"][
        "kl_continuation"]["mean"]
    assert res["cross_policy"]["bf16"]["greedy_identical_fraction"] == 1.0
    key = "tmpe_fp8_vs_bf16_engine_scoring"
    assert res["metrics"][key] == arms["original"]["fp8"][key]  # the primary table is original / weight-only
    assert res["meta"]["kv_scales"]["original/fp8_kv_calibrate"]["writes"] == 1
    text = (out / "summary.md").read_text()
    assert "static degrades on the drifted policy (vs calibrate): yes" in text
    assert "calibrate close to weight-only FP8 on the drifted policy: yes" in text
    assert "fp8_kv_calibrate: drifted == original" in text and "INCOMPLETE" not in text
    assert "[fp8rl] fake engine kv=calibrate" in (out / "engine_drifted_fp8_kv_calibrate.log").read_text()
    # a second call reuses every record and the drifted checkpoint: no engine starts
    assert AR.main(argv) == 0 and len(_KVFakeEngine.instances) == 8
    assert json.loads((out / "accuracy.json").read_text())["arms"] == arms


def test_accuracy_deadline_leaves_work_for_the_next_call(tmp_path, monkeypatch):
    sglang = pytest.importorskip("sglang")
    monkeypatch.setattr(sglang, "Engine", _KVFakeEngine, raising=False)
    model = tmp_path / "toy"
    _save_tiny_checkpoint(model)
    out = tmp_path / "acc"
    argv = ["--model", str(model), "--task", "addition", "--out", str(out), "--n-prompts", "4", "--chunk", "4",
            "--no-hf-reference", "--arms", "fp8", "fp8_kv_calibrate", "--reuse", "--drift-k", "64", "--drift-v", "256"]
    _KVFakeEngine.instances = []
    assert AR.main([*argv, "--deadline-s", "1", "--min-engine-s", "600"]) == 3
    assert _KVFakeEngine.instances == []
    text = (out / "summary.md").read_text()
    assert "INCOMPLETE" in text and "original/bf16" in text
    assert json.loads((out / "accuracy.json").read_text())["meta"]["missing"] == ["original/bf16", "original/fp8",
                                                                                   "original/fp8_kv_calibrate"]
    assert AR.main(argv) == 0 and len(_KVFakeEngine.instances) == 3


def test_accuracy_cli_rejects_bad_drift_and_tmpe_reuses_the_package():
    with pytest.raises(SystemExit):
        AR.parse_args(["--model", "m", "--out", "o", "--drift-k", "48"])
    from sglang_fp8rl.rollout_correction import token_mult_prob_error

    a, b = [-0.1, -2.0, None], [-0.2, -1.5, -0.3]
    ta, tb = torch.tensor(a[:2], dtype=torch.float64), torch.tensor(b[:2], dtype=torch.float64)
    want = float(token_mult_prob_error(ta, tb, torch.ones(2)))
    assert AM.token_mult_prob_error(a, b) == want


class _FailingStaticEngine(_KVFakeEngine):
    """The static arm's engine dies at start (as a scheduler that refuses a setup would)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        if self.mode == "static":
            raise RuntimeError("Rank 0 scheduler died during initialization (exit code: 1).")


def test_accuracy_one_failed_arm_keeps_the_others(tmp_path, monkeypatch):
    sglang = pytest.importorskip("sglang")
    options_before = os.environ.get("FP8RL_OPTIONS")
    monkeypatch.setattr(sglang, "Engine", _FailingStaticEngine, raising=False)
    model = tmp_path / "toy"
    _save_tiny_checkpoint(model)
    out = tmp_path / "acc"
    _KVFakeEngine.instances = []
    rc = AR.main(["--model", str(model), "--task", "addition", "--out", str(out), "--n-prompts", "4", "--chunk", "4",
                  "--no-hf-reference", "--arms", "fp8_kv_static", "fp8_kv_calibrate"])
    assert rc == 1
    res = json.loads((out / "accuracy.json").read_text())
    assert set(res["arms"]["original"]) == {"fp8_kv_calibrate"} and list(res["meta"]["failed"]) == [
        "original/fp8_kv_static"]
    assert "FAILED original/fp8_kv_static: RuntimeError: Rank 0 scheduler died" in (out / "summary.md").read_text()
    assert os.environ.get("FP8RL_OPTIONS") == options_before  # each arm's options were taken back
