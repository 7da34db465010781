"""scripts/gpu/lanes.sh on CPU: each lane on its own GPU index with its own scratch, results and logs packed into
$OUT, a lane past DEADLINE stopped while the others finish."""

from __future__ import annotations

import os
import pathlib
import subprocess
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_lanes_run_side_by_side_and_pack_their_results(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "FP8RL_REPO": str(REPO), "OUT": str(out), "DEADLINE": "5"}
    lanes = ['echo "gpu=$CUDA_VISIBLE_DEVICES work=$WORK lane=$LANE" > $LANE_OUT/seen.txt; '
             'printf "# lane zero\\n| a | b |\\n" > $LANE_OUT/report.md',
             'echo "gpu=$CUDA_VISIBLE_DEVICES" > $LANE_OUT/seen.txt; sleep 60; echo never > $LANE_OUT/late.txt']
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu/lanes.sh"), *lanes], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = (out / "lanes_summary.md").read_text()
    assert "[lane 0] rc=0" in summary and "[lane 1] rc=124" in summary  # lane 1 outlived DEADLINE: stopped
    assert "# lane zero" in summary  # a lane's .md reports are shown
    with tarfile.open(out / "lanes.tgz") as tar:
        names = set(tar.getnames())
        seen0 = tar.extractfile("./0/out/seen.txt").read().decode()
        seen1 = tar.extractfile("./1/out/seen.txt").read().decode()
    gpu, work, lane = seen0.split()
    assert (gpu, lane) == ("gpu=0", "lane=0") and work.startswith("work=/tmp/lanes.") and work.endswith("/0")
    assert seen1.strip() == "gpu=1"
    assert "./1/out/late.txt" not in names and {"./lane_0.log", "./lane_1.log"} <= names
