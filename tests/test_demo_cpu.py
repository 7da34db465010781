"""`python -m sglang_fp8rl.demo`: its CPU version end to end, the GPU version's pieces that run without a GPU
(server flags, start-up progress from the log), and the CPU-side helpers of `scripts/bench_update.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import bench_update
import pytest
import torch
import update_bench_report

from sglang_fp8rl import demo, demo_common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_write_checkpoint(tmp_path):
    from safetensors.torch import load_file

    dims = dict(demo_common.DEMO_DIMS, num_hidden_layers=2)
    sd = demo_common.write_checkpoint(str(tmp_path), dims, seed=3)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "vocab_size"):
        assert config[k] == dims[k]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert set(loaded) == set(sd) and len(loaded) == 3 + 11 * dims["num_hidden_layers"]
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    h, hd = dims["hidden_size"], dims["head_dim"]
    assert loaded["model.layers.1.self_attn.q_proj.weight"].shape == (dims["num_attention_heads"] * hd, h)
    assert loaded["model.layers.0.mlp.down_proj.weight"].shape == (h, dims["intermediate_size"])
    assert torch.equal(loaded["lm_head.weight"], sd["lm_head.weight"])
    # every linear dimension of the demo model is a multiple of 128: all linears are eligible for the block scheme
    for name, t in loaded.items():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            assert t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0, name


def test_random_state_dict_seeds_differ():
    dims = dict(demo_common.DEMO_DIMS, num_hidden_layers=1, vocab_size=256)
    a, b = demo_common.random_state_dict(dims, 0), demo_common.random_state_dict(dims, 1)
    assert torch.equal(a["model.norm.weight"], demo_common.random_state_dict(dims, 0)["model.norm.weight"])
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize(("cuda", "argv", "version"), [(False, [], "cpu"), (True, ["--cpu"], "cpu"), (True, [], "gpu")])
def test_main_picks_the_version(monkeypatch, cuda, argv, version):
    """GPU where CUDA is available, else (or with --cpu) the CPU version; main returns that version's exit code."""
    from sglang_fp8rl import demo_cpu, demo_gpu

    monkeypatch.setattr(demo, "cuda_available", lambda: cuda)
    monkeypatch.setattr(demo_cpu, "run_cpu", lambda args, started=None: 10)
    monkeypatch.setattr(demo_gpu, "run_gpu", lambda args: 20)
    assert demo.main(argv) == {"cpu": 10, "gpu": 20}[version]


def test_formatting():
    text = demo_common.format_schemes({"counts": {"block": 16, "channel": 0, "bf16": 0}, "exceptions": {}},
                               ["[fp8rl] fp8_online_blockwise: linear layers block=16\n"])
    assert "block=16" in text and "exceptions: none" in text and "[fp8rl]" in text
    assert "no fp8rl telemetry" in demo_common.format_schemes(None, [])
    line = demo_common.format_update({"index": 1, "ok": True, "message": "ok", "tensors": 47, "bytes": 2 << 20,
                               "validate_s": 0.01, "apply_s": 0.002, "fp8_layers_written": {"block": 16},
                               "bf16_params_written": 15})
    assert "#1" in line and "2.0 MiB" in line and "block=16" in line
    assert demo_common.format_update(None) == "last update: none recorded"


# a cold start of the GPU demo as SGLang 0.5.17 and this plugin log it (wording from their sources)
SERVER_LOG = """\
[2026-11-22 06:40:24] server_args=ServerArgs(model_path='/tmp/m', quantization='fp8_online_blockwise')
[2026-11-22 06:40:51] Init torch distributed begin.
[2026-11-22 06:40:52] Init torch distributed ends. elapsed=0.61 s, mem usage=0.00 GB
[2026-11-22 06:40:53] Load weight begin. avail mem=78.50 GB
[2026-11-22 06:40:54] [fp8rl] fp8_online_blockwise: linear layers block=16, channel=0, bf16=0
[2026-11-22 06:40:54] Load weight end. elapsed=0.80 s, type=Qwen3ForCausalLM, avail mem=78.40 GB, mem usage=0.10 GB.
[2026-11-22 06:40:54] [fp8rl] weight updates of this model are validated and re-quantized in place
[2026-11-22 06:41:06] [fp8rl] DeepGEMM JIT warm-up for 1 CUDA-graph token counts: 4/4 launches by 4 workers in 11.2 s
[2026-11-22 06:41:07] Memory pool end. avail mem=60.10 GB
[2026-11-22 06:41:08] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs=[1], avail mem=60.1
Capturing batches (bs=1 avail_mem=60.05 GB): 100%|##########| 1/1 [00:19<00:00, 19.0s/it]
[2026-11-22 06:41:27] Capture target decode CUDA graph end. elapsed=19.02 s, mem usage=0.05 GB, avail mem=60.05 GB.
[2026-11-22 06:41:40] The server is fired up and ready to roll!
"""


def stamp(text: str) -> float:
    from datetime import datetime

    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()


def test_startup_phases_from_a_server_log(tmp_path):
    """Every phase mark of a start is found, timed from the log's own timestamps, and described in the table."""
    from sglang_fp8rl.startup_phases import StartupWatcher, phase_table

    log = tmp_path / "server.log"
    lines = SERVER_LOG.splitlines(keepends=True)
    watcher = StartupWatcher(str(log), launched_at=stamp("2026-11-22 06:40:00"))
    assert watcher.doing_now().startswith("launcher")
    log.write_text("".join(lines[:5]) + lines[5][:20])  # the server is writing line 6 right now
    first = watcher.poll(now=stamp("2026-11-22 06:40:54"))
    assert [e.at for e in first] == [24, 51, 53]
    assert "loading the BF16 weights" in watcher.doing_now()
    log.write_text("".join(lines))
    rest = watcher.poll(now=stamp("2026-11-22 06:41:41"))
    assert [e.at for e in rest] == [54, 66, 67, 68, 87, 100]  # line 6 counted once, complete
    assert watcher.poll(now=stamp("2026-11-22 06:41:42")) == []
    assert watcher.doing_now() == "answering the first /health_generate"
    table = phase_table(watcher.events, ready_at=102.4, ready_what="first /health_generate")
    rows = table.splitlines()[2:]
    assert rows[0] == "| 24 | 24 | launcher: Python start and SGLang import |"
    assert rows[1] == "| 51 | 27 | scheduler process: start and SGLang import |"
    assert "| 66 | 12 | DeepGEMM JIT warm-up (parallel nvcc compiles): DeepGEMM JIT warm-up for 1 CUDA-graph" in rows[4]
    assert rows[7] == "| 87 | 19 | decode CUDA-graph capture (with kernel JIT) |"
    assert rows[-1] == "| 102 | 2 | first /health_generate |"
    assert sum(int(r.split("|")[2]) for r in rows) == 102


def test_startup_watcher_without_timestamps(tmp_path):
    """A mark without a timestamp is placed when it was read; times never run backwards; no log yet is no event."""
    from sglang_fp8rl.startup_phases import StartupWatcher

    log = tmp_path / "server.log"
    watcher = StartupWatcher(str(log), launched_at=1000.0)
    assert watcher.poll(now=1001.0) == []
    log.write_text("Load weight end. elapsed=1 s\n[2026-11-22 06:40:51] Memory pool end. avail mem=1 GB\n")
    events = watcher.poll(now=1030.0)
    assert [e.at for e in events] == [30.0, 30.0]  # the stamp lies before the first event: clamped
    assert watcher.last_line.startswith("Memory pool end")


@pytest.mark.slow
def test_gpu_server_flags_parse_with_sglang(tmp_path):
    """The GPU demo's launch flags are valid for SGLang 0.5.17 with the plugin: decode graphs for bs 1 only, no
    prefill graphs, gemm_select off, one JIT worker per linear shape; --server-args come last and win."""
    from sglang_fp8rl import demo_gpu

    model = str(tmp_path / "model")
    demo_common.write_config(model, demo_common.DEMO_DIMS)
    cmd = demo_gpu.server_command(model, 30030, 0.2, ["--fp8rl-jit-workers", "0"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[-2:] == ["--fp8rl-jit-workers", "0"]
    code = f"""
import json, os, sys
from sglang_fp8rl.cpu_runner import install_cpu_stubs
install_cpu_stubs()
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang_fp8rl.compat.runtime import cuda_graph_config
from sglang_fp8rl.kernels.jit_warmup import capture_token_counts
args = prepare_server_args({cmd[3:]!r} + ["--device", "cpu"])
config = cuda_graph_config(args)
prefill = "disabled" if config is None else config.prefill.backend  # before 0.5.14 no prefill graph is captured
capture = capture_token_counts(args)
if not capture and getattr(args, "cuda_graph_bs_decode", None):  # 0.5.21+ resolves the capture only with a GPU
    capture = list(args.cuda_graph_bs_decode)
    prefill = args.cuda_graph_backend_prefill
print("RESULT", json.dumps({{"capture": capture, "options": json.loads(os.environ["FP8RL_OPTIONS"]),
                            "prefill": prefill, "quant": args.quantization}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "FP8RL_OPTIONS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert result["capture"] == [1] and result["prefill"] == "disabled" and result["quant"] == "fp8_online_blockwise"
    assert result["options"]["gemm_select"] == "off" and result["options"]["jit_workers"] == 0


@pytest.mark.slow
def test_cpu_demo_runs_end_to_end():
    """`python -m sglang_fp8rl.demo` on CPU: SGLang's ModelRunner loads the model in FP8, W1 goes through SGLang's
    WeightUpdater into the same FP8 storage, and the greedy tokens change."""
    argv = ["--cpu"] if torch.cuda.is_available() else []  # without CUDA the demo must pick the CPU version itself
    r = subprocess.run([sys.executable, "-m", "sglang_fp8rl.demo", *argv], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, check=False)
    out = r.stdout
    assert r.returncode == 0, (out + r.stderr)[-6000:]
    assert argv or "running the CPU version" in out
    assert "linear layers per scheme: block=16, channel=0, bf16=0" in out
    assert "[fp8rl] fp8_online_blockwise: linear layers block=16, channel=0, bf16=0" in out
    assert "success=True" in out and "last update #1: ok=True" in out and "FP8 layers re-quantized: block=28" in out
    assert "FP8 parameters updated in place (same storage): True; engine consistent: True; updates so far: 1" in out
    before = json.loads(out.split("before (W0): ", 1)[1].splitlines()[0])
    after = json.loads(out.split("after  (W1): ", 1)[1].splitlines()[0])
    assert len(before) == len(after) == demo_common.NEW_TOKENS and before != after
    assert "changed: True" in out
    assert "since the demo started (imports included)" in out
    assert "decode runs without CUDA graphs" not in out + r.stderr  # the engine's GPU-only advice


def qwen3_8b_shapes() -> dict:
    from make_models import QWEN3_COMMON, QWEN3_SHAPES
    from server_payloads import hf_shapes

    return hf_shapes(dict(QWEN3_COMMON, **QWEN3_SHAPES["qwen3-8b"]))


def test_bench_update_helpers():
    import math

    shapes = qwen3_8b_shapes()
    ps = update_bench_report.payload_stats(shapes)
    assert ps["largest_bytes"] == 151936 * 4096 * 2 and ps["tensors"] == 3 + 11 * 36
    assert 16e9 < ps["bytes"] < 17e9
    moved = update_bench_report.apply_bytes(shapes)
    lin = sum(math.prod(shapes[n]) for n in update_bench_report.linear_names(shapes))
    assert moved["quant_read"] == 2 * lin and lin < moved["quant_write"] < lin * 1.01
    res = {"model": "qwen3-8b", "payload": ps, "bucket_mb": 512, "d2d_copy_GBps": 2900.0, "engines": {
        "bf16": {"tensor": {"timed_s": [2.0, 2.0], "mean_s": 2.0, "peak_extra_first_bytes": 0}},
        "fp8": {"tensor": {"timed_s": [2.4, 2.4], "mean_s": 2.4, "peak_extra_first_bytes": 2 * 10**9,
                           "server_telemetry": {"validate_s": 1.0, "apply_s": 0.1}, "apply_GBps": 250.0,
                           "apply_vs_d2d": 0.09}},
    }}
    res["targets"] = update_bench_report.targets(res)
    assert any("1.20x -> FAIL" in t for t in res["targets"])
    assert any("(tensor): 2.000 GB vs 1.245 GB -> FAIL (device-wide polling" in t for t in res["targets"])
    assert any("(disk): UNKNOWN" in t for t in res["targets"])
    assert any(t.startswith("FP8 prequant <= 0.80x BF16 tensor: UNKNOWN") for t in res["targets"])
    assert any("FP8 apply >= 50% of copy bandwidth (tensor): 9% -> FAIL" in t for t in res["targets"])
    md = update_bench_report.render(res)
    assert "| fp8 | tensor |" in md and "250 (0.09x)" in md
    s = update_bench_report.sum_bucket_stats(
        [{"ok": True, "tensors": 2, "apply_s": 0.5, "fp8_layers_written": {"block": 2}},
         {"ok": True, "tensors": 1, "apply_s": 0.25, "fp8_layers_written": {"block": 1}}])
    assert s["tensors"] == 3 and s["apply_s"] == 0.75 and s["fp8_layers_written"] == {"block": 3}


def test_bench_update_prequant_bytes_and_bandwidth():
    """A pre-quantized update copies codes and scales (read = write); BF16 in reads twice what FP8 writes."""
    shapes = qwen3_8b_shapes()
    bf16_in, pre = update_bench_report.apply_bytes(shapes), update_bench_report.apply_bytes(shapes, prequant=True)
    assert pre["quant_read"] == pre["quant_write"] == bf16_in["quant_write"]
    assert pre["bf16_copy_rw"] == bf16_in["bf16_copy_rw"] and pre["total"] < bf16_in["total"]
    rec = {"server_telemetry": {"apply_s": 0.5}}
    update_bench_report.apply_bandwidth(rec, {"total": 10**9}, 2000.0)
    assert rec["apply_GBps"] == 2.0 and rec["apply_vs_d2d"] == 0.001 and rec["apply_bytes"] == {"total": 10**9}
    rec = {"server_telemetry": None}
    update_bench_report.apply_bandwidth(rec, {"total": 10**9}, 2000.0)
    assert "apply_GBps" not in rec


def test_bench_update_targets_for_every_path():
    """Ratios against the issue-16 targets, the allocator-rounded memory bound, the apply bandwidth, the atomic
    step's cost, and a table row per measured path."""
    ps = update_bench_report.payload_stats(qwen3_8b_shapes())
    embed = ps["largest_bytes"]
    res = {"model": "qwen3-8b", "payload": ps, "bucket_mb": 512, "d2d_copy_GBps": 3000.0, "engines": {
        "bf16": {"tensor": {"timed_s": [0.3], "mean_s": 0.30}, "disk": {"timed_s": [2.0], "mean_s": 2.0}},
        "fp8": {"tensor": {"timed_s": [0.32], "mean_s": 0.32, "apply_vs_d2d": 0.6, "apply_GBps": 1800.0,
                           "server_telemetry": {"validate_s": 0.05, "apply_s": 0.1,
                                                "server_peak_extra_bytes": embed + (1 << 20)},
                           "peak_extra_first_bytes": 0},
                "atomic": {"timed_s": [0.4], "mean_s": 0.40},
                "validate_only": {"timed_s": [0.07], "mean_s": 0.07},
                "prequant": {"timed_s": [0.2], "mean_s": 0.20, "apply_vs_d2d": 0.3,
                             "peak_extra_first_bytes": 2 * 10**9},
                "disk": {"timed_s": [2.8], "mean_s": 2.8, "server_telemetry": {"validate_s": 1.1, "apply_s": 1.2}}},
    }}
    r = update_bench_report.ratios(res)
    assert r["tensor"] == pytest.approx(0.32 / 0.30) and r["prequant"] == pytest.approx(0.2 / 0.3)
    assert r["disk"] == pytest.approx(1.4) and r["atomic_vs_fp8_tensor"] == pytest.approx(1.25)
    lines = update_bench_report.targets(res)
    assert "FP8 tensor <= 1.10x BF16 tensor: 0.32 s / 0.30 s = 1.07x -> PASS" in lines
    assert "FP8 prequant <= 0.80x BF16 tensor: 0.20 s / 0.30 s = 0.67x -> PASS" in lines
    assert "FP8 disk <= 1.30x BF16 disk: 2.80 s / 2.00 s = 1.40x -> FAIL" in lines
    # the embedding's scratch copy, rounded up to the allocator's 2 MiB blocks, is within the bound
    assert any(t.startswith("FP8 peak extra memory <= largest BF16 tensor (tensor): 1.246 GB vs 1.245 GB -> PASS "
                            "(server allocator") for t in lines)
    assert any("(prequant): 2.000 GB vs 1.245 GB -> FAIL (device-wide polling" in t for t in lines)
    assert any("(atomic): UNKNOWN" in t for t in lines)
    assert "FP8 apply >= 50% of copy bandwidth (tensor): 60% -> PASS" in lines
    assert "FP8 apply >= 50% of copy bandwidth (prequant): 30% -> FAIL" in lines
    assert any(t.startswith("FP8 atomic step (no target): 0.40 s vs 0.32 s by tensor = +0.08 s (1.25x); "
                            "validate-only phase alone 0.07 s") for t in lines)
    res["targets"] = lines
    md = update_bench_report.render(res)
    for path in ("tensor", "atomic", "validate_only", "prequant", "disk"):
        assert f"| fp8 | {path} |" in md
    assert "| fp8 | disk | n/a | 2.80 | 2.80 | n/a | n/a | n/a | n/a | 1.100 | 1.200 | n/a | n/a |" in md


def test_bench_update_command_line():
    args = bench_update.parse_args(["--model-dir", "m", "--out", "o"])
    assert (args.model, args.bucket_mb, args.repeats, args.skip_disk, args.engines) == (
        "qwen3-8b", 512, 2, False, ["bf16", "fp8"])
    args = bench_update.parse_args(["--model-dir", "m", "--out", "o", "--skip-disk", "--repeats", "3"])
    assert args.skip_disk and args.repeats == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_bench_update_needs_cuda(tmp_path, capsys):
    assert bench_update.main(["--model-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
