"""scripts/gpu/bench_decode_attention.py's CPU parts: its report rebuilt from the recorded GPU runs (docs/results), the
split counts its sweep compares with the kernel's rule, and its command line."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from sglang_fp8rl.kernels import fp8_decode_attention as FDA

REPO = pathlib.Path(__file__).resolve().parents[1]
RECORDED = {"h100": REPO / "docs/results/decode_attention_h100_2026-11-27.json",
            "h200": REPO / "docs/results/decode_attention_h200_2026-11-27.json"}


def bench():
    spec = importlib.util.spec_from_file_location("bench_decode_attention",
                                                  REPO / "scripts/gpu/bench_decode_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("card", sorted(RECORDED))
def test_report_from_a_recorded_run(card):
    result = json.loads(RECORDED[card].read_text())
    text = bench().report(result)
    rows = [line for line in text.splitlines() if line[:3].strip("| ").isdigit()]
    assert len(rows) == len(result["cells"])
    for row, cell in zip(rows, result["cells"]):
        fa3, ours = cell["kernels"]["fa3_fp8"]["us"], cell["kernels"]["split_kv"]["us"]
        assert row.startswith(f"| {cell['batch']} x {cell['context']} |")
        assert f"| {fa3 / ours:.2f}x |" in row  # FA3 FP8 / split-KV, from the same run
    assert result["device"] in text.splitlines()[0]


def test_the_kernels_split_rule_was_among_the_best_measured_on_the_h100():
    """The default split count (num_splits) against the sweep's splits at the default tile, stages and warps: within
    10 % of the best split count measured at every cell of the H100 sweep that reached its splits (the first cell's
    sweep was cut by its time share)."""
    result = json.loads(RECORDED["h100"].read_text())
    checked = 0
    for cell in result["cells"]:
        swept = {s["splits"]: s["us"] for s in cell["sweep"] if "us" in s and s["block_n"] == FDA.DEFAULT_BLOCK_N
                 and s["num_stages"] == FDA.DEFAULT_STAGES and s["num_warps"] == FDA.DEFAULT_WARPS}
        if not swept:
            continue
        rule = FDA.num_splits(cell["batch"], bench().KV_HEADS, result["sms"])
        assert rule in swept, (cell["batch"], cell["context"], rule)
        assert swept[rule] <= 1.10 * min(swept.values()), (cell["batch"], cell["context"], rule, swept)
        checked += 1
    assert checked >= len(result["cells"]) - 1


def test_command_line():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/bench_decode_attention.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--out", "--quick", "--deadline-s", "--no-sweep"):
        assert flag in proc.stdout
