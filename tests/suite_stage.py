"""Run one stage of scripts/gpu/run_gpu_suite.sh on CPU with a stand-in python3 that only records its command lines:
what the stage would run, with which arguments (tests of the suite's stages)."""

from __future__ import annotations

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]


def stage_command_lines(tmp_path: pathlib.Path, stage: str, script: str, unset: tuple[str, ...] = (),
                        **env: str) -> list[str]:
    """The command lines of ``script`` that ``run_gpu_suite.sh stage`` runs, OUT and WORK under ``tmp_path``; ``env``
    sets the stage's variables (variables of the same names, and those named in ``unset``, are dropped from this
    process's environment first)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python3").write_text('#!/bin/bash\necho "python3 $*" >> "$CALLS"\n')
    (fake / "python3").chmod(0o755)
    calls = tmp_path / f"calls_{stage}_{'_'.join(sorted(env))}"
    base = {k: v for k, v in os.environ.items() if k not in env and k not in unset}
    base.update(PATH=f"{fake}:{os.environ['PATH']}", FP8RL_REPO=str(REPO), CALLS=str(calls),
                OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), **env)
    subprocess.run(["bash", str(REPO / "scripts/gpu/run_gpu_suite.sh"), stage], env=base, cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    return [ln for ln in calls.read_text().splitlines() if script in ln]
