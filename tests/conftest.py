"""Test setup: the torchvision stand-in SGLang needs to import on CPU (sglang_fp8rl.cpu_runner), GPU-test skips."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")
# the test helpers here, and the modules of scripts/ and scripts/gpu/ that tests import by name
sys.path[:0] = [HERE, SCRIPTS, os.path.join(SCRIPTS, "gpu")]

from rank_pair import free_port  # noqa: E402, F401  (tests import it from here)

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


# what parsing a command line with our quantization sets in this process: our options (server_args.set_options) and
# DeepGEMM's precompile default (server_args.lazy_deepgemm_compile); a later test must see neither
PARSE_SIDE_EFFECTS = ("FP8RL_OPTIONS", "SGLANG_JIT_DEEPGEMM_PRECOMPILE")


def _restore(saved: dict) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True, scope="module")
def _restore_parse_side_effects_of_a_module():
    """The same at the end of every module: a module-scoped fixture's parse happens before any test's own guard."""
    saved = {name: os.environ.get(name) for name in PARSE_SIDE_EFFECTS}
    yield
    _restore(saved)


@pytest.fixture(autouse=True)
def _restore_parse_side_effects():
    """Restore the variables a parsed command line sets, so that no test's outcome depends on which tests ran
    before it in the same process."""
    saved = {name: os.environ.get(name) for name in PARSE_SIDE_EFFECTS}
    yield
    _restore(saved)
