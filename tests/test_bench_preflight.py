"""scripts/gpu/bench_preflight.py on CPU: its command line and a tiny run of both checks (the GPU run is the
measurement)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "bench_preflight.py"


def test_both_checks_run_over_the_clients_buckets(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tensors", "100", "--shape", "64", "128",
                          "--bucket-mb", "1", "--repeats", "2", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["tensors"], result["shape"], result["buckets"]) == (100, [64, 128], 2)  # 16 KiB each: 64 a MiB
    assert len(result["per_tensor_s"]) == len(result["batched_s"]) == 2
    assert result["speedup"] > 0


@pytest.mark.parametrize("bad", [["--tensors", "0"], ["--shape", "0", "4"], ["--repeats", "0"]])
def test_bad_arguments_are_refused(bad):
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *bad], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "must be positive" in out.stderr
