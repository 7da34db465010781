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
            "h200": REPO / "docs/results/decode_attention_h200_2026-11-27.json",
            "h100_plan": REPO / "docs/results/decode_attention_plan_h100_2026-11-28.json"}  # budgets, ragged cells


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
        assert row.startswith(f"| {bench().cell_label(cell)} |")
        assert f"| {fa3 / ours:.2f}x |" in row  # FA3 FP8 / split-KV, from the same run
    assert result["device"] in text.splitlines()[0]


def test_report_with_flashinfer_columns():
    """--flashinfer adds FlashInfer's FP8 decode and its ratio to FA3's; a cell where it failed shows '-'."""
    result = json.loads(RECORDED["h200"].read_text())
    first, second = result["cells"][0]["kernels"], result["cells"][1]["kernels"]
    first["fi_fp8"] = {"us": first["fa3_fp8"]["us"] / 1.25, "of_copy_bw": 0.5,
                       "error": {"max_abs": 1e-3, "max_rel": 0.0, "ref_max": 1.0}}
    second["fi_fp8"] = {"error_text": "RuntimeError: no nvcc"}
    lines = bench().report(result).splitlines()
    header = next(line for line in lines if line.startswith("| bs x context"))
    assert "FlashInfer FP8 us (%)" in header and "FA3 FP8 / FlashInfer FP8" in header
    rows = [line for line in lines if line[:3].strip("| ").isdigit()]
    assert all(row.count("|") == header.count("|") for row in rows)
    assert "| 1.25x |" in rows[0] and "/1.00e-03 |" in rows[0]
    assert "| - |" in rows[1]


def test_report_with_both_optional_kernels():
    """--flashinfer and --v-widen-tile together: a column of times and of ratios each, the errors in that order."""
    result = json.loads(RECORDED["h200"].read_text())
    k = result["cells"][0]["kernels"]
    err = {"max_abs": 2e-3, "max_rel": 0.0, "ref_max": 1.0}
    k["fi_fp8"] = {"us": k["fa3_fp8"]["us"] / 0.5, "of_copy_bw": 0.2, "error": err}
    k["split_kv_vtile"] = {"us": k["fa3_fp8"]["us"] / 2.0, "of_copy_bw": 0.6, "error": err, "same_bits": True}
    lines = bench().report(result).splitlines()
    header = next(line for line in lines if line.startswith("| bs x context"))
    assert header.index("FlashInfer FP8 us") < header.index("split-KV, V widened on its tile us")
    assert header.endswith("max abs err FA3 FP8 / split-KV / FlashInfer FP8 / split-KV, V widened on its tile |")
    rows = [line for line in lines if line[:3].strip("| ").isdigit()]
    assert all(row.count("|") == header.count("|") for row in rows)
    assert lines[lines.index(header) + 1].count("|") == header.count("|")
    assert "| 0.50x | 2.00x |" in rows[0] and rows[0].endswith("/2.00e-03/2.00e-03 |")


def test_the_kernels_plan_at_equal_lengths_was_among_the_best_measured_on_the_h100():
    """At equal lengths the plan (plan_splits over work_budget) gives each sequence the splits of the recorded H100
    sweep (which swept split counts, before the plan) that were within 10 % of the best at the default tile, stages
    and warps, at every cell whose sweep reached them (the first cell's sweep was cut by its time share)."""
    result = json.loads(RECORDED["h100"].read_text())
    budget = FDA.work_budget(bench().KV_HEADS, result["sms"])
    checked = 0
    for cell in result["cells"]:
        swept = {s["splits"]: s["us"] for s in cell["sweep"] if "us" in s and s["block_n"] == FDA.DEFAULT_BLOCK_N
                 and s["num_stages"] == FDA.DEFAULT_STAGES and s["num_warps"] == FDA.DEFAULT_WARPS}
        if not swept:
            continue
        plan = set(FDA.plan_splits([cell["context"]] * cell["batch"], budget))
        assert len(plan) == 1, plan
        rule = plan.pop()
        assert rule in swept, (cell["batch"], cell["context"], rule)
        assert swept[rule] <= 1.10 * min(swept.values()), (cell["batch"], cell["context"], rule, swept)
        checked += 1
    assert checked >= len(result["cells"]) - 1


def test_sweep_variants_and_none_without_a_sweep():
    assert bench().variants({}) == []  # --no-sweep: no variant (an empty product is one empty variant)
    quick = bench().variants(bench().QUICK_SWEEP)
    assert len(quick) == 12 and {v["per_sm"] for v in quick} == {1, 2, 4} and {v["fine"] for v in quick} == {1, 3}
    assert all(set(v) == {"block_n", "num_warps", "num_stages", "per_sm", "fine", "preplan"} for v in quick)
    # each configuration's four forms (grid x where the plan is made) back to back: a cut sweep still compares them
    assert [(v["fine"], v["preplan"]) for v in quick[:4]] == [(3, False), (3, True), (1, False), (1, True)]
    assert len({v["per_sm"] for v in quick[:4]}) == 1


def test_ragged_cells_and_their_labels():
    import attention_cells as AC  # scripts/gpu/attention_cells.py

    lengths = AC.ragged_lengths(32, 4096)
    assert lengths == AC.ragged_lengths(32, 4096) and len(lengths) == 32  # seeded: every kernel the same draw
    assert 64 <= min(lengths) and max(lengths) <= 8 * 4096 and max(lengths) > 3 * 4096  # a long tail
    assert abs(sum(lengths) / 32 - 4096) < 0.05 * 4096
    assert bench().cell_label({"batch": 8, "context": 4096, "ragged": True, "max_context": 9000}) == \
        "8 x 4096r (max 9000)"
    assert bench().cell_label({"batch": 8, "context": 4096}) == "8 x 4096"
    assert bench().work_of({"budget": 33, "splits": 11}) == "budget 33 (11 splits at most)"  # runs before fine
    assert bench().work_of({"budget": 33, "fine": 1, "splits": 4}) == "budget 33, fine 1 (4 splits at most)"
    assert bench().work_of({"budget": 33, "fine": 3, "preplan": True, "splits": 4}) == \
        "budget 33, fine 3, preplan (4 splits at most)"
    assert bench().work_of({"splits": 4}) == "4 splits"


def test_command_line():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/bench_decode_attention.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--out", "--quick", "--deadline-s", "--no-sweep", "--cells", "--flashinfer", "--v-widen-tile",
                 "--pdl", "--single-plan", "--step-plan", "--fused-merge"):
        assert flag in proc.stdout
