"""Test setup: the torchvision stand-in SGLang needs to import on CPU (sglang_fp8rl.cpu_runner), GPU-test skips."""

from __future__ import annotations

import os
import socket
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")
# the test helpers here, and the modules of scripts/ and scripts/gpu/ that tests import by name
sys.path[:0] = [HERE, SCRIPTS, os.path.join(SCRIPTS, "gpu")]

from sglang_fp8rl.cpu_runner import install_cpu_stubs  # noqa: E402

install_cpu_stubs()

HAS_CUDA = False
try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency of the env
    pass


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped (and reported as skipped) without CUDA."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu/run_gpu_suite.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def patch_rope_for_cpu() -> None:
    """SGLang's RotaryEmbedding imports vllm's op on unknown platforms; on CPU the native path is what we want."""
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _restore_fp8rl_options(monkeypatch):
    """A test that parses a command line publishes its options in FP8RL_OPTIONS (server_args.set_options); restore
    the variable afterwards so that later tests see the defaults (monkeypatch undoes both calls at teardown)."""
    name = "FP8RL_OPTIONS"
    if name in os.environ:
        monkeypatch.setenv(name, os.environ[name])
    else:
        monkeypatch.delenv(name, raising=False)
