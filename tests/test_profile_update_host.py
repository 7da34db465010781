"""scripts/profile_update_host.py: its command line, and the whole measurement on a tiny Qwen3-MoE through SGLang's
real CPU ModelRunner (one layer of 8 experts: a few seconds)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import profile_update_host as PH
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "profile_update_host.py"


def test_arguments_and_dims():
    args = PH.parse_args([])
    assert (args.layers, args.experts, args.bucket_mb, args.pushes, args.profile) == (8, 128, 5.0, 3, False)
    dims = PH.dims_of(PH.parse_args(["--layers", "2", "--experts", "16", "--hidden", "256"]))
    assert (dims["num_hidden_layers"], dims["num_experts"], dims["num_attention_heads"]) == (2, 16, 2)
    for bad in (["--experts", "0"], ["--hidden", "100"], ["--bucket-mb", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            PH.parse_args(bad)


def test_help_runs():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--bucket-mb" in out.stdout


@pytest.mark.slow
def test_tiny_measurement(tmp_path):
    """Every push reports every tensor of the model (1 layer: 8 experts x 3, a router, 8 attention tensors, embedding,
    norm, lm_head), the profile lists its top functions, and the JSON holds the same pushes."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--layers", "1", "--experts", "8", "--pushes", "2",
                          "--profile", "--top", "5", "--digest", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "by tottime" in out.stdout and "params digest:" in out.stdout and "best of 2" in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    tensors = 8 * 3 + 1 + 8 + 3
    assert [p["tensors"] for p in result["warmup"] + result["pushes"]] == [tensors] * 3
    assert all(p["validate_s"] > 0 and p["apply_s"] > 0 and p["buckets"] == 1 for p in result["pushes"])


@pytest.mark.slow
def test_flattened_buckets_write_the_same_bits(tmp_path):
    """--flatten: flattened buckets reach the engine through SGLang's decode and write what (name, tensor) lists
    write, bit for bit (the same digest after the same pushes); every tensor of each push is counted."""
    digests = {}
    for flatten in (False, True):
        out = subprocess.run([sys.executable, str(SCRIPT), "--layers", "1", "--experts", "8", "--pushes", "2",
                              "--digest", "--json", str(tmp_path / f"r{flatten}.json")] + (["--flatten"] * flatten),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        result = json.loads((tmp_path / f"r{flatten}.json").read_text())
        assert result["flatten"] is flatten
        assert [p["tensors"] for p in result["pushes"]] == [8 * 3 + 1 + 8 + 3] * 2
        assert ("flattened buckets of" in out.stdout) is flatten
        digests[flatten] = result["digest"]
    assert digests[True] == digests[False]
