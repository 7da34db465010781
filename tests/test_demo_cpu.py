"""CPU-side pieces of `python -m sglang_fp8rl.demo` and `scripts/bench_update.py` (no server starts here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sglang_fp8rl import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_update  # noqa: E402


def test_write_checkpoint(tmp_path):
    from safetensors.torch import load_file

    dims = dict(demo.DEMO_DIMS, num_hidden_layers=2)
    sd = demo.write_checkpoint(str(tmp_path), dims, seed=3)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    config = json.load(open(tmp_path / "config.json"))
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
    dims = dict(demo.DEMO_DIMS, num_hidden_layers=1, vocab_size=256)
    a, b = demo.random_state_dict(dims, 0), demo.random_state_dict(dims, 1)
    assert torch.equal(a["model.norm.weight"], demo.random_state_dict(dims, 0)["model.norm.weight"])
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"])


def test_no_cuda_exits_2_with_message(monkeypatch, capsys):
    monkeypatch.setattr(demo, "cuda_available", lambda: False)
    assert demo.main([]) == demo.EXIT_NO_CUDA == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path of the module entry point")
def test_module_entry_point_without_cuda():
    r = subprocess.run([sys.executable, "-m", "sglang_fp8rl.demo"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "needs a CUDA GPU" in r.stderr


def test_formatting():
    text = demo.format_schemes({"counts": {"block": 16, "channel": 0, "bf16": 0}, "exceptions": {}},
                               ["[fp8rl] fp8_online_blockwise: linear layers block=16\n"])
    assert "block=16" in text and "exceptions: none" in text and "[fp8rl]" in text
    assert "no fp8rl telemetry" in demo.format_schemes(None, [])
    line = demo.format_update({"index": 1, "ok": True, "message": "ok", "tensors": 47, "bytes": 2 << 20,
                               "validate_s": 0.01, "apply_s": 0.002, "fp8_layers_written": {"block": 16},
                               "bf16_params_written": 15})
    assert "#1" in line and "2.0 MiB" in line and "block=16" in line
    assert demo.format_update(None) == "last update: none recorded"


def test_bench_update_helpers():
    from check_server import hf_shapes
    from make_models import QWEN3_COMMON, QWEN3_SHAPES

    shapes = hf_shapes(dict(QWEN3_COMMON, **QWEN3_SHAPES["qwen3-8b"]))
    ps = bench_update.payload_stats(shapes)
    assert ps["largest_bytes"] == 151936 * 4096 * 2 and ps["tensors"] == 3 + 11 * 36
    assert 16e9 < ps["bytes"] < 17e9
    moved = bench_update.apply_bytes(shapes)
    lin = sum(bench_update._numel(shapes[n]) for n in bench_update.linear_names(shapes))
    assert moved["quant_read"] == 2 * lin and lin < moved["quant_write"] < lin * 1.01
    res = {"model": "qwen3-8b", "payload": ps, "bucket_mb": 512, "d2d_copy_GBps": 2900.0, "engines": {
        "bf16": {"tensor": {"timed_s": [2.0, 2.0], "mean_s": 2.0, "peak_extra_first_bytes": 0}},
        "fp8": {"tensor": {"timed_s": [2.4, 2.4], "mean_s": 2.4, "peak_extra_first_bytes": 2 * 10**9,
                           "server_telemetry": {"validate_s": 1.0, "apply_s": 0.1}, "quantizer_GBps": 250.0,
                           "quantizer_vs_d2d": 0.09}},
    }}
    res["targets"] = bench_update.targets(res)
    assert any("1.20x -> FAIL" in t for t in res["targets"])
    assert any("(tensor): 2.000 GB vs 1.245 GB -> FAIL" in t for t in res["targets"])
    assert any("(disk): UNKNOWN" in t for t in res["targets"])
    md = bench_update.render(res)
    assert "| fp8 | tensor |" in md and "250 (0.09x)" in md
    s = bench_update.sum_bucket_stats([{"ok": True, "tensors": 2, "apply_s": 0.5, "fp8_layers_written": {"block": 2}},
                                       {"ok": True, "tensors": 1, "apply_s": 0.25, "fp8_layers_written": {"block": 1}}])
    assert s["tensors"] == 3 and s["apply_s"] == 0.75 and s["fp8_layers_written"] == {"block": 3}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_bench_update_needs_cuda(tmp_path, capsys):
    assert bench_update.main(["--model-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
