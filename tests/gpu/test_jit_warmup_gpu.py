"""The DeepGEMM JIT warm-up on the GPU: real worker processes launch SGLang's DeepGEMM block linear, the cubins land
in DeepGEMM's cache, and this process then launches the same configurations without compiling.

The check on "without compiling": a launch whose kernel must be compiled takes seconds (nvcc, 2.5-5.5 s measured on
H100), one that loads a cached cubin takes milliseconds; the bound below (1 s) sits between the two.
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest
import torch

from sglang_fp8rl.kernels import deepgemm
from sglang_fp8rl.kernels import jit_warmup as jw

pytestmark = pytest.mark.gpu

CACHED_LAUNCH_S = 1.0


@pytest.fixture(scope="module")
def deepgemm_default():
    if not deepgemm.detect().default_is_fp32_deepgemm:
        pytest.skip("SGLang's block-FP8 dispatch on this GPU is not DeepGEMM")


def test_warm_up_compiles_in_workers_then_this_process_only_loads(deepgemm_default, tmp_path, monkeypatch):
    # a num_sms no candidate uses gives kernels no other test or start compiled (num_sms is a template parameter;
    # DeepGEMM wants it even)
    sms = torch.cuda.get_device_properties(0).multi_processor_count - 6
    n, k, ms = 2048, 1024, (1, 48, 200, 1000)
    monkeypatch.setenv("DG_JIT_CACHE_DIR", jw.deepgemm_cache_dir())  # the record goes where DeepGEMM writes
    with jw.WarmupPool(2, torch.cuda.current_device(), timeout_s=240, env=jw.worker_env()) as pool:
        result = jw.warm_up(pool, {(n, k, sms): ms}, env=f"test|{time.time()}")
    assert (result.done, result.failed, result.timed_out) == (len(ms), 0, False), result.summary()
    assert set(result.succeeded) == {jw.Job(n, k, m, sms) for m in ms}
    # SGLang's own DeepGEMM linear (what capture launches) finds every kernel compiled; SGLang's precompile of every
    # M (its default, which the plugin's launcher turns off) would hide what this checks
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.deep_gemm_wrapper import compile_utils
    from sglang.srt.layers.quantization.fp8_utils import deepgemm_w8a8_block_fp8_linear_with_fallback

    monkeypatch.setattr(compile_utils, "_ENABLE_JIT_DEEPGEMM_PRECOMPILE", False)

    weight = torch.zeros(n, k, device="cuda", dtype=torch.float8_e4m3fn)
    scale = torch.ones(n // 128, k // 128, device="cuda")
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t = time.monotonic()
        with deep_gemm_wrapper.configure_deep_gemm_num_sms(sms):
            deepgemm_w8a8_block_fp8_linear_with_fallback(x, weight, [128, 128], scale)
        torch.cuda.synchronize()
        assert time.monotonic() - t < CACHED_LAUNCH_S, f"M={m}: SGLang's call compiled a kernel the warm-up did not"


DEVICE_RUNNER = textwrap.dedent('''
    import os, torch

    def run(job, state):
        with open(os.environ["DEVICE_LOG"], "a") as f:
            f.write(f"{torch.cuda.current_device()}\\n")
    ''')


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_workers_run_on_the_rank_s_gpu(tmp_path):
    """A rank on GPU 1 starts its workers on GPU 1 (their ~2 GB each must not land on another rank's GPU)."""
    (tmp_path / "device_runner.py").write_text(DEVICE_RUNNER)
    log = tmp_path / "devices.log"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(jw.worker_env(), DEVICE_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(tmp_path), repo, os.environ.get("PYTHONPATH", "")]))
    with jw.WarmupPool(2, 1, timeout_s=120, runner="device_runner:run", env=env) as pool:
        result = pool.run([jw.Job(256, 384, m) for m in (1, 2, 3)])
    assert result.done == 3, result.summary()
    assert set(log.read_text().split()) == {"1"}
