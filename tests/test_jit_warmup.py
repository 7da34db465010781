"""CPU checks of sglang_fp8rl.kernels.jit_warmup (DeepGEMM JIT compiled in parallel worker processes before capture).

Covered here: the job plan (coarse-to-fine order, interleaved streams, what gemm_select asks for in each mode), the
CUDA-graph token counts read from SGLang's own CudaGraphConfig, the worker pool with real worker processes running a
fake job (every job once, failures, a dying worker, the timeout), the record of warmed jobs, how many workers fit in
GPU memory (free memory injected), and preparation's call. The DeepGEMM job itself and the startup it saves are
measured on the GPU (scripts/bench_startup.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_fp8rl.kernels import gemm_select as gs
from sglang_fp8rl.kernels import jit_warmup as jw
from sglang_fp8rl.kernels.deepgemm import DeepGemmFacts
from sglang_fp8rl.kernels.gemm_select import prepare as prepare_mod
from sglang_fp8rl.server_args import Fp8rlOptions, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------------------------------------
# plan


@given(st.lists(st.integers(1, 10_000), max_size=80))
@settings(max_examples=200, deadline=None)
def test_spread_order_is_a_coarse_to_fine_permutation(values):
    got = jw.spread_order(values)
    vals = sorted(set(values))
    assert sorted(got) == vals
    if len(vals) >= 3:
        assert got[:2] == [vals[0], vals[-1]]
        assert got[2] == vals[(len(vals) - 1) // 2]


def test_spread_order_example():
    assert jw.spread_order([1, 2, 4, 8, 16, 32, 64, 128, 256]) == [1, 256, 16, 4, 64, 2, 8, 32, 128]


def test_plan_jobs_interleaves_streams_and_covers_each_once():
    streams = {(256, 384, None): [1, 8, 64, 8], (128, 256, None): [4, 512], (256, 384, 124): [96]}
    jobs = jw.plan_jobs(streams)
    assert len(jobs) == len(set(jobs)) == 3 + 2 + 1
    assert {(j.n, j.k, j.num_sms) for j in jobs[:3]} == set(streams)  # the first round takes one job per stream
    assert [j.m for j in jobs if (j.n, j.num_sms) == (256, None)] == [1, 64, 8]


def test_capture_token_counts_from_sglang_cuda_graph_config():
    from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig

    def args(decode, prefill):
        return types.SimpleNamespace(cuda_graph_config=CudaGraphConfig(decode=decode, prefill=prefill))

    both = args(PhaseConfig(backend=Backend.FULL, bs=[1, 8, 16]), PhaseConfig(backend=Backend.BREAKABLE, bs=[16, 512]))
    assert jw.capture_token_counts(both) == [1, 8, 16, 512]
    no_prefill = args(PhaseConfig(backend=Backend.FULL, bs=[1, 2]), PhaseConfig(backend=Backend.DISABLED, bs=[64]))
    assert jw.capture_token_counts(no_prefill) == [1, 2]
    assert jw.capture_token_counts(types.SimpleNamespace()) == []
    assert jw.capture_token_counts(None) == []


def test_default_workers_share_the_cpus_between_ranks():
    assert jw.default_workers(1, cpus=16) == jw.MAX_WORKERS
    assert jw.default_workers(2, cpus=16) == 7
    assert jw.default_workers(8, cpus=16) == 1
    assert jw.default_workers(1, cpus=1) == 1


def test_ranks_on_node():
    from sglang_fp8rl.hooks.model_runner import ranks_on_node  # the engine hook's; imports SGLang's runtime

    assert ranks_on_node(types.SimpleNamespace(tp_size=4, pp_size=2, nnodes=2)) == 4
    assert ranks_on_node(types.SimpleNamespace(tp_size=2)) == 2
    assert ranks_on_node(None) == 1


def test_warmup_streams_per_mode():
    cands = gs.make_candidates()  # default, deepgemm_sms_124, deepgemm_sms_112, fp8rl_n64_sk4
    shapes = [(256, 384), (200, 384)]  # N=200 is not a DeepGEMM shape: SGLang runs Triton, nothing to warm
    capture = [1, 8, 88, 96, 512]
    # nothing measured, nothing to measure (off / cache without entries): the default at every captured M
    assert gs.warmup_streams(shapes, capture, {}, set(), cands) == {(256, 384, None): set(capture)}
    # buckets to be measured add their measured point (the upper edge) to the default's launches
    keys = {gs.shape_key(256, 384, b) for b in (16, 96)}
    assert gs.warmup_streams(shapes, capture, {}, keys, cands) == {(256, 384, None): set(capture) | {16}}
    # bucket 96 (M 81-96) cached on deepgemm_sms_112: that variant at the captured M of the bucket
    key96 = gs.shape_key(256, 384, 96)
    got = gs.warmup_streams(shapes, capture, {key96: "deepgemm_sms_112"}, set(), cands)
    assert got == {(256, 384, None): set(capture), (256, 384, 112): {88, 96}}
    # a bucket on our Triton kernel needs no DeepGEMM launch
    assert gs.warmup_streams(shapes, capture, {gs.shape_key(256, 384, 8): "fp8rl_n64_sk4"}, set(),
                             cands) == {(256, 384, None): set(capture)}


def test_variant_streams_cover_what_phase_2_measures_and_capture_launches():
    cands = gs.make_candidates()
    todo = [(256, 384, 96, ["deepgemm_sms_124", "fp8rl_n64_sk4"]), (256, 384, 8, ["fp8rl_n64_sk4"]),
            (200, 384, 96, ["deepgemm_sms_112"])]
    assert gs.variant_streams(todo, [1, 8, 88, 96, 512], cands) == {(256, 384, 124): {88, 96}}


# ---------------------------------------------------------------------------------------------------------------------
# the pool, with real worker processes running a fake job


FAKE_RUNNER = textwrap.dedent('''
    import os, time

    def run(job, state):
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(f"{os.getpid()} {job.n} {job.k} {job.m} {job.num_sms}\\n")
        if job.m == 7:
            raise ValueError("no kernel for M=7")
        if job.m == 5:
            os._exit(3)
        if job.m == 9:
            time.sleep(600)  # a hung compile: only the pool's timeout ends it
        if 10 <= job.m < 40:
            time.sleep(0.2)  # a compile takes seconds: every worker gets some
    ''')


@pytest.fixture
def fake_runner(tmp_path):
    (tmp_path / "fake_jit_runner.py").write_text(FAKE_RUNNER)
    log = tmp_path / "jobs.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO, os.environ.get("PYTHONPATH", "")]),
               FAKE_LOG=str(log))

    def runs():
        return [line.split() for line in log.read_text().splitlines()] if log.exists() else []

    return types.SimpleNamespace(spec="fake_jit_runner:run", env=env, runs=runs)


def jobs_for(ms, n=256, k=384, sms=None):
    return [jw.Job(n, k, m, sms) for m in ms]


def one_round(jobs, workers, runner, timeout_s=jw.TIMEOUT_S):
    """One round of jobs on a fresh pool of real worker processes."""
    with jw.WarmupPool(workers, timeout_s=timeout_s, runner=runner.spec, env=runner.env) as pool:
        return pool.run(jobs)


def test_pool_runs_every_job_once_across_workers(fake_runner):
    jobs = jobs_for(range(10, 40)) + jobs_for([64], sms=124)
    result = one_round(jobs, 3, fake_runner, timeout_s=60)
    assert (result.done, result.failed, result.workers, result.timed_out) == (31, 0, 3, False)
    assert sorted(result.succeeded, key=dataclasses.astuple) == sorted(jobs, key=dataclasses.astuple)
    runs = fake_runner.runs()
    assert sorted((int(r[3]), r[4]) for r in runs) == sorted((j.m, str(j.num_sms)) for j in jobs)
    assert len({r[0] for r in runs}) > 1  # more than one process did work


def test_pool_counts_a_failing_job_and_goes_on(fake_runner):
    result = one_round(jobs_for([6, 7, 8]), 1, fake_runner, timeout_s=60)
    assert (result.done, result.failed) == (2, 1)
    assert "M=7" in result.errors[0] and "ValueError" in result.errors[0] and "m=7" in result.errors[0]
    assert {j.m for j in result.succeeded} == {6, 8}
    assert "1 failed" in result.summary()


def test_pool_survives_a_dying_worker(fake_runner):
    jobs = jobs_for([5] + list(range(10, 20)))
    result = one_round(jobs, 2, fake_runner, timeout_s=60)
    assert result.failed == 1 and result.done == len(jobs) - 1
    assert 5 not in {j.m for j in result.succeeded}
    assert any("worker exit 3" in e for e in result.errors)


def test_pool_stops_at_the_timeout(fake_runner):
    t0 = time.monotonic()
    result = one_round(jobs_for([9, 11, 12]), 1, fake_runner, timeout_s=3)
    assert time.monotonic() - t0 < 20  # the sleeping worker is killed, not waited for
    assert result.timed_out and result.failed == 3 and result.done == 0
    assert "stopped at the timeout" in result.summary()


def test_pool_keeps_its_workers_between_rounds(fake_runner):
    with jw.WarmupPool(2, runner=fake_runner.spec, env=fake_runner.env, timeout_s=60) as pool:
        first = pool.run(jobs_for([10, 11, 12]))
        pids = {w.proc.pid for w in pool.pool}
        second = pool.run(jobs_for([13, 14], sms=112))
        assert {w.proc.pid for w in pool.pool} == pids  # no new worker started
    assert (first.done, second.done, first.failed + second.failed) == (3, 2, 0)
    assert {int(r[0]) for r in fake_runner.runs()} <= pids


def test_pool_after_a_timeout_runs_nothing(fake_runner):
    # the timeout must leave a worker time to start on a loaded 2-core machine (3 s once did not), and stay far below
    # the hung job's sleep
    with jw.WarmupPool(1, runner=fake_runner.spec, env=fake_runner.env, timeout_s=20) as pool:
        assert pool.run(jobs_for([9])).timed_out
        later = pool.run(jobs_for([10]))
    assert (later.done, later.failed) == (0, 1)
    assert [int(r[3]) for r in fake_runner.runs()] == [9]


def test_pool_with_nothing_to_do_starts_nothing(fake_runner):
    assert one_round([], 4, fake_runner).workers == 0
    assert one_round(jobs_for([1]), 0, fake_runner).workers == 0
    assert fake_runner.runs() == []


def test_worker_loop_protocol():
    out = types.SimpleNamespace(lines=[], write=lambda s: out.lines.append(s), flush=lambda: None)
    calls = []

    def runner(job, state):
        state["seen"] = state.get("seen", 0) + 1
        calls.append((job, state["seen"]))
        if job.m == 2:
            raise RuntimeError("boom")

    lines = [json.dumps(dataclasses.asdict(j)) + "\n" for j in jobs_for([1, 2, 3])] + ["\n"]
    jw.worker_loop(runner, lines, out, (RuntimeError,))
    msgs = [json.loads(s) for s in out.lines]
    assert msgs[0] == {"ready": True}
    assert "s" in msgs[1] and "RuntimeError: boom" in msgs[2]["error"] and "s" in msgs[3]
    assert [c[1] for c in calls] == [1, 2, 3]  # one state for the worker's life (weights made once per shape)


def test_load_runner_rejects_a_bad_spec():
    with pytest.raises(ValueError, match="module:function"):
        jw.load_runner("no_colon")
    assert jw.load_runner(jw.DEFAULT_RUNNER) is jw.deepgemm_job
    assert jw.DEFAULT_RUNNER == "sglang_fp8rl.kernels.jit_worker:deepgemm_job"


# ---------------------------------------------------------------------------------------------------------------------
# the record of warmed jobs


def test_warm_up_records_what_worked_and_skips_it_next_time(fake_runner, tmp_path, monkeypatch):
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "dg"))
    streams = {(256, 384, None): [6, 7, 8], (256, 384, 124): [6]}
    with jw.WarmupPool(2, runner=fake_runner.spec, env=fake_runner.env, timeout_s=60) as pool:
        first = jw.warm_up(pool, streams, env="gpu=A")
        assert (first.jobs, first.done, first.failed) == (4, 3, 1)
        assert jw.warmed_jobs("gpu=A") == {jw.Job(256, 384, 6), jw.Job(256, 384, 8), jw.Job(256, 384, 6, 124)}
        again = jw.warm_up(pool, streams, env="gpu=A")
        assert again.jobs == 1  # only the failed one is tried again
        other = jw.warm_up(pool, streams, env="gpu=B")
        assert other.jobs == 4  # another GPU or version: nothing is assumed compiled
    assert jw.warmed_jobs("gpu=A") == set()  # the record holds one environment
    ms = [int(r[3]) for r in fake_runner.runs()]
    assert sorted(ms) == [6, 6, 6, 6, 7, 7, 7, 8, 8]


def test_worker_env_never_precompiles_every_m(monkeypatch):
    monkeypatch.setenv("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "1")
    assert jw.worker_env()["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "0"


def test_warmed_jobs_tolerates_a_broken_record(tmp_path):
    path = tmp_path / jw.RECORD_NAME
    path.write_text("{not json")
    assert jw.warmed_jobs("e", str(path)) == set()
    path.write_text(json.dumps({"env": "e", "jobs": [[1, 2]]}))
    assert jw.warmed_jobs("e", str(path)) == set()


# ---------------------------------------------------------------------------------------------------------------------
# how many workers fit in GPU memory

GIB = jw.GIB


@pytest.mark.parametrize(
    "option, ranks, free, total, fraction, pre_load, expect",
    [
        (-1, 1, 70 * GIB, 80 * GIB, 0.7, 79 * GIB, 12),  # one engine, 8B model: the CPU count decides
        (4, 1, 70 * GIB, 80 * GIB, 0.7, 79 * GIB, 4),  # an explicit count is an upper bound
        (-1, 1, 31 * GIB, 80 * GIB, 0.5, 40 * GIB, 5),  # colocated trainer holds 40 GiB: (31 - 21) / 2 workers
        (-1, 1, 31 * GIB, 80 * GIB, 0.5, None, 0),  # pre-load free unknown: the device total is the base
        (-1, 1, 10 * GIB, 80 * GIB, 0.9, 12 * GIB, 3),  # (10 - 2.2) / 2
        (-1, 1, 3 * GIB, 80 * GIB, 0.9, 12 * GIB, 0),  # less than one worker's memory above the reserve
        (-1, 1, 70 * GIB, 80 * GIB, None, 79 * GIB, 0),  # mem_fraction_static unknown: no workers
        (0, 1, 70 * GIB, 80 * GIB, 0.7, 79 * GIB, 0),  # warm-up off
        (-1, 8, 70 * GIB, 80 * GIB, 0.7, 79 * GIB, 1),  # 8 ranks share 16 CPUs
    ],
)
def test_decide_workers(option, ranks, free, total, fraction, pre_load, expect):
    decision = jw.decide_workers(option, ranks, free, total, fraction, pre_load, cpus=16)
    assert decision.workers == expect
    assert decision.reserve_bytes == jw.engine_reserve_bytes(total, fraction, pre_load)
    assert f"{expect} workers" in decision.describe()


@given(free=st.integers(0, 200 * GIB), total=st.integers(1, 200 * GIB), pre=st.none() | st.integers(0, 200 * GIB),
       fraction=st.none() | st.floats(0.05, 0.99), option=st.integers(-1, 20), cpus=st.integers(1, 256))
@settings(max_examples=300, deadline=None)
def test_workers_never_touch_what_the_engine_leaves_to_others(free, total, pre, fraction, option, cpus):
    decision = jw.decide_workers(option, 1, free, total, fraction, pre, cpus=cpus)
    assert 0 <= decision.workers <= decision.requested <= max(option, jw.MAX_WORKERS)
    # the workers' memory comes out of free memory above the reserve: SGLang's non-KV share (pre-load free x
    # (1 - mem_fraction_static)) and the safety margin stay free
    assert decision.workers == 0 or free - decision.workers * jw.WORKER_GPU_BYTES >= decision.reserve_bytes
    base = total if pre is None else pre
    if fraction is not None:
        assert decision.reserve_bytes >= base * (1 - fraction) + jw.SAFETY_BYTES - 1
    # and as many as fit are started
    fit = max(0, (free - decision.reserve_bytes) // jw.WORKER_GPU_BYTES)
    assert decision.workers == min(decision.requested, fit)


# ---------------------------------------------------------------------------------------------------------------------
# preparation's call

H100 = DeepGemmFacts(enabled=True, dispatch_is_deepgemm=True, sms=132)


def runtime(free: int = 80 << 30, total: int = 80 << 30, facts: DeepGemmFacts = H100) -> gs.Runtime:
    """This process as an H100 with SGLang's DeepGEMM default, the given free memory, a CPU bench (no timing)."""
    return gs.Runtime(facts, gs.make_candidates(), gs.env_info(facts), gs.cache_path(),
                      gpu_memory=lambda: (free, total), make_bench=lambda f: gs.Bench.create("cpu", f, timer=None))


def request(mode: str, workers: int, **kw) -> gs.PrepareRequest:
    kw.setdefault("mem_fraction_static", 0.9)
    return gs.PrepareRequest(mode=mode, jit_workers=workers, **kw)


@pytest.fixture
def prepare_env(monkeypatch, tmp_path):
    monkeypatch.setenv(gs.ENV_CACHE, str(tmp_path / "gemm_select.json"))
    gs.reset_state()
    monkeypatch.setattr(jw, "default_workers", lambda ranks, cpus=None: 12 // ranks)
    calls = []
    monkeypatch.setattr(jw, "warm_up", lambda pool, streams, env: calls.append((pool.workers, streams))
                        or jw.WarmupResult())
    yield calls
    gs.reset_state()


@pytest.mark.parametrize("mode, workers, ranks, expect", [("off", -1, 1, 12), ("cache", 3, 1, 3), ("off", -1, 4, 3),
                                                          ("cache", 0, 1, None)])
def test_prepare_warms_the_captured_sizes(prepare_env, mode, workers, ranks, expect):
    gs.prepare_shapes([(256, 384)], request(mode, workers, capture_ms=(1, 8, 512), ranks_on_node=ranks), runtime())
    assert prepare_env == ([] if expect is None else [(expect, {(256, 384, None): {1, 8, 512}})])


def test_prepare_auto_compiles_variants_before_phase_2(monkeypatch, prepare_env):
    seen = {}

    def autotune(shapes, candidates, settings, **kw):
        seen.update(kw, settings=settings)
        kw["before_alternatives"]([(256, 384, 96, ["deepgemm_sms_124", "fp8rl_n64_sk4"])])
        return {}

    monkeypatch.setattr(prepare_mod, "autotune", autotune)
    gs.prepare_shapes([(256, 384)], request("auto", 2, max_m=96, capture_ms=(8, 88)), runtime())
    default = {8, 88} | set(gs.buckets_upto(96))  # captured M and every bucket's measured point
    assert prepare_env == [(2, {(256, 384, None): default}), (2, {(256, 384, 124): {88, 96}})]
    assert seen["skip"] == set() and seen["settings"].max_m == 96


def test_prepare_limits_workers_by_free_gpu_memory(prepare_env):
    reserve = jw.engine_reserve_bytes(80 << 30, 0.9)
    gs.prepare_shapes([(256, 384)], request("off", 8, capture_ms=(1,)),
                      runtime(free=reserve + 3 * jw.WORKER_GPU_BYTES + 1))
    assert [w for w, _ in prepare_env] == [3]


def test_prepare_starts_no_worker_without_the_memory(prepare_env, caplog):
    """A colocated trainer (or a second engine) holds the memory: no worker, one log line, SGLang compiles later."""
    with caplog.at_level("INFO", logger=prepare_mod.__name__):
        gs.prepare_shapes([(256, 384)], request("off", 8, capture_ms=(1,), mem_fraction_static=0.5,
                                                pre_load_free_bytes=40 << 30), runtime(free=21 << 30))
    assert prepare_env == []
    lines = [r.getMessage() for r in caplog.records if "JIT warm-up: 0 workers" in r.getMessage()]
    assert len(lines) == 1 and "during CUDA-graph capture" in lines[0]


@pytest.mark.parametrize("facts", [DeepGemmFacts(), DeepGemmFacts(enabled=True, ue8m0=True, dispatch_is_deepgemm=True),
                                   DeepGemmFacts(enabled=True, dispatch_is_deepgemm=False)],
                         ids=["deepgemm_off", "ue8m0", "other_backend"])
def test_prepare_warms_nothing_unless_sglang_runs_fp32_deepgemm(prepare_env, facts):
    gs.prepare_shapes([(256, 384)], request("off", 8, capture_ms=(1,)), runtime(facts=facts))
    assert prepare_env == []


def test_jit_workers_option():
    assert parse_args([]).jit_workers == jw.AUTO_WORKERS == -1
    assert parse_args(["--fp8rl-jit-workers", "4"]).jit_workers == 4
    with pytest.raises(ValueError, match="--fp8rl-jit-workers"):
        Fp8rlOptions(jit_workers=-2)
    with pytest.raises(ValueError, match="--fp8rl-jit-workers"):
        Fp8rlOptions(jit_workers=True)


def test_worker_module_runs_as_a_script(fake_runner):
    """The real entry point (python -m sglang_fp8rl.kernels.jit_worker) speaks the protocol."""
    import subprocess

    job = json.dumps(dataclasses.asdict(jw.Job(256, 384, 3))) + "\n"
    out = subprocess.run(jw.worker_command(0, fake_runner.spec), input=job, capture_output=True, text=True,
                         env=fake_runner.env, timeout=120, check=True).stdout
    msgs = [json.loads(line) for line in out.splitlines()]
    assert msgs[0] == {"ready": True} and "s" in msgs[1] and len(msgs) == 2
    assert sys.executable == jw.worker_command(0)[0]


def test_worker_run_as_a_script_pins_its_gpu(tmp_path):
    """Run as ``python -m`` (the module is then __main__, and the runner a second import of it), the worker still
    selects the GPU it was given: a rank's workers must not put their memory on another rank's GPU. CUDA is faked."""
    import subprocess

    log = tmp_path / "device"
    code = ("import runpy, torch; torch.cuda.is_available = lambda: True; "
            f"torch.cuda.set_device = lambda d: open({str(log)!r}, 'w').write(str(d)); "
            "runpy.run_module('sglang_fp8rl.kernels.jit_worker', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, "--device", "3", "--runner", jw.DEFAULT_RUNNER], input="",
                         capture_output=True, text=True, timeout=120, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])))
    assert json.loads(out.stdout.splitlines()[0]) == {"ready": True}
    assert log.read_text() == "3"
