"""The weight-update step's lifecycle through SGLang's real WeightUpdater on CPU: what a hostile trainer found.

Each case names the defect it was written for: a one-tensor disk update after a failed write (6), an all-or-nothing
step refused in its apply round (7), trainer KV scales sent in an early bucket (4), a recalibration deferred while
requests run (5)."""

from __future__ import annotations

import os

import pytest
import torch
from sgl_model import run_worker, write_w0_w1

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("lifecycle")
    _, w1 = write_w0_w1(d)
    torch.save(w1, d / "w1.pt")
    os.makedirs(d / "one", exist_ok=True)
    save_file({"model.norm.weight": w1["model.norm.weight"].contiguous()}, str(d / "one" / "model.safetensors"))
    extra = {"w1": str(d / "w1.pt"), "w1_dir": str(d / "w1"), "one_tensor_dir": str(d / "one"), "bucket_bytes": 1 << 16}
    out = run_worker("lifecycle", str(d / "w0"), str(d / "lifecycle.pt"), *QUANT, "--kv-cache-dtype", "fp8_e4m3",
                     extra=extra)
    return out


def test_a_one_tensor_disk_update_after_a_failed_write_leaves_the_engine_inconsistent(lifecycle):
    """(6) Only a checkpoint that reaches every parameter clears what a failed write left dirty."""
    assert not lifecycle["failed"][0]
    assert lifecycle["one_tensor_disk"][0] and not lifecycle["consistent_after_one_tensor"]
    assert lifecycle["full_disk"][0] and lifecycle["consistent_after_full"]


def test_an_atomic_step_refused_in_its_apply_round_marks_the_written_tensors_dirty(lifecycle):
    """(7) The engine does not call itself consistent, and the error says earlier buckets were written."""
    error = lifecycle["atomic_error"]
    assert error is not None and "buckets 1-1 of this step were written" in error
    assert "engine inconsistent" in error and "apply round" in error
    assert not lifecycle["consistent_after_broken_step"] and lifecycle["dirty_after_broken_step"] > 0


def test_trainer_scales_in_an_early_bucket_are_kept_when_the_step_ends(lifecycle):
    """(4) Every layer's scales in bucket 1, the step's end in bucket 2: no recalibration overwrites them."""
    assert all(ok for ok, _ in lifecycle["trainer_step"]), lifecycle["trainer_step"]
    assert not lifecycle["due_after_trainer_step"] and lifecycle["writes_in_trainer_step"] == 1  # the trainer's own
    assert all(scales == (0.5, 0.5) for scales in lifecycle["scales_after_trainer_step"].values())


def test_a_deferred_recalibration_stays_due_and_runs_when_idle(lifecycle):
    """(5) Requests running at the step's end defer the recalibration; it is not dropped, and runs when idle."""
    assert lifecycle["plain_step"][0]
    assert lifecycle["due_while_busy"] and not lifecycle["due_after_idle"]
    assert lifecycle["source_after_idle"] == "calibration"
