"""scripts/gpu/fa3_knobs.py's CPU parts: the pairs it times, its report from a recorded-shaped result, its command
line. (The timing itself needs FA3 on a GPU.)"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def knobs():
    spec = importlib.util.spec_from_file_location("fa3_knobs", REPO / "scripts/gpu/fa3_knobs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pairs_are_every_split_count_and_packing_but_the_heuristics():
    m = knobs()
    assert len(m.KNOBS) == len(m.SPLITS) * len(m.PACKINGS) - 1 == 23
    assert (0, None) not in m.KNOBS and (0, True) in m.KNOBS and (64, False) in m.KNOBS
    assert len(set(m.KNOBS)) == len(m.KNOBS)
    assert m.knob_label(0, None) == "splits auto, pack_gqa auto" and m.knob_label(8, True) == "splits 8, pack_gqa True"


def test_report_names_the_fastest_pair_and_its_gain():
    m = knobs()

    def pair(n, p, us, err=1e-3):
        return {"num_splits": n, "pack_gqa": p, "us": us, "of_copy_bw": 0.5 * 100 / us, "max_abs": err}

    equal = {"batch": 64, "context": 2048, "ragged": False, "max_context": 2048,
             "bf16": {"us": 90.0, "of_copy_bw": 0.99}, "default": pair(0, None, 100.0),
             "pairs": [pair(4, True, 80.0, 2e-3), pair(8, None, 95.0),
                       {"num_splits": 64, "pack_gqa": False, "error_text": "RuntimeError: no"}]}
    equal["best"] = equal["pairs"][0]
    ragged = {"batch": 128, "context": 1024, "ragged": True, "max_context": 8192,
              "bf16": {"us": 50.0, "of_copy_bw": 0.98}, "default": pair(0, None, 60.0), "pairs": [], "cut": True}
    text = m.report({"device": "NVIDIA H100 80GB HBM3", "copy_gbps": 3029.0, "date": "2026-12-08", "cells": [
        equal, ragged]})
    lines = text.splitlines()
    assert "NVIDIA H100 80GB HBM3" in lines[0] and "3,029 GB/s" in lines[1] and "23 pairs" in lines[1]
    rows = [ln for ln in lines if ln[:3].strip("| ").isdigit()]
    header = next(ln for ln in lines if ln.startswith("| bs x context"))
    assert len(rows) == 2 and all(r.count("|") == header.count("|") for r in rows)
    assert rows[0] == ("| 64 x 2048 | 90.0 (99 %) | 100.0 (50 %) | splits 4, pack_gqa True | 80.0 (62 %) | 1.25x | 2 "
                       "| 1.00e-03 / 2.00e-03 |")
    assert rows[1].startswith("| 128 x 1024r (max 8192) | 50.0 (98 %) | 60.0 (83 %) | - | - | - | 0 (cut) |")


def test_command_line():
    m = knobs()
    a = m.parse_args(["--out", "/tmp/x"])
    assert (a.cells, a.deadline_s) == ("all", 300.0)
    with pytest.raises(SystemExit):
        m.parse_args(["--out", "/tmp/x", "--cells", "some"])
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/fa3_knobs.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "num_splits" in proc.stdout and "--deadline-s" in proc.stdout
