"""Subprocess worker (one per TP rank) for tests/test_kv_tp_faults.py: KV recalibrations on SGLang's real CPU
ModelRunner at TP 2 (gloo), each with a rank-local fault injected on rank 1 at one stage.

Usage: as tests/sgl_worker.py (``python tests/sgl_worker_kv_tp.py SCENARIO MODEL_DIR OUT_PATH EXTRA_JSON [args...]``);
its scenarios join sgl_worker's and its ``main`` runs them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import time
from types import SimpleNamespace

import sgl_worker  # first: it installs the CPU stand-ins before SGLang is imported
import torch

# A hung collective never returns: past this, the worker prints every thread's stack and exits, so that a hang fails
# the test in about a minute instead of gloo's own timeout (484 s were seen).
WATCHDOG_S = 45

SERVED = (0.5, 0.25)  # the scales in force before each faulty recalibration, unlike anything a calibration derives


def _raise_oom(where: str):
    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError(f"simulated: out of memory in {where}")
    return fail


@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    had_own = name in vars(owner)
    original = vars(owner).get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _failing_call(fn, n: int, error: Exception):
    """``fn`` whose n-th call raises ``error`` (the others run ``fn``)."""
    calls = {"n": 0}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise error
        return fn(*args, **kwargs)
    return call


def fault(stage: str, mr) -> contextlib.AbstractContextManager:
    """A rank-local fault at ``stage`` of a recalibration, through SGLang's real classes where the stage is theirs."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_fp8rl.kv_scales import calibrate

    if stage == "prepare_for_extend":  # the case: the batch's allocation fails at its start
        return _patched(ScheduleBatch, "prepare_for_extend", _raise_oom("ScheduleBatch.prepare_for_extend"))
    if stage == "kv_alloc":  # SGLang's own failure inside prepare_for_extend, after it took the request slots
        return _patched(mr.token_to_kv_pool_allocator, "alloc", lambda *args, **kwargs: None)
    if stage == "forward_batch":  # after every slot was taken
        init_new = vars(ForwardBatch)["init_new"].__func__
        return _patched(ForwardBatch, "init_new", classmethod(functools.wraps(init_new)(
            _raise_oom("ForwardBatch.init_new"))))
    if stage == "forward":  # a device error that surfaces once the forward (and its collectives) ran
        real = ModelRunner.forward

        @functools.wraps(real)
        def forward(self, *args, **kwargs):
            real(self, *args, **kwargs)
            raise RuntimeError("simulated CUDA error: an illegal memory access was encountered")
        return _patched(ModelRunner, "forward", forward)
    if stage == "scales":  # after the amax all-reduce
        return _patched(calibrate, "scales_from_amax", _raise_oom("deriving the scales"))
    if stage == "under":  # before the calibration forward: the start-up scales it runs under
        return _patched(calibrate, "write_scales", _failing_call(calibrate.write_scales, 1, RuntimeError(
            "simulated CUDA error while writing the start-up scales")))
    if stage == "write":  # the last stage: writing the new scales (the first write is the start-up scales)
        return _patched(calibrate, "write_scales", _failing_call(calibrate.write_scales, 2, RuntimeError(
            "simulated CUDA error while writing the new scales")))
    raise ValueError(stage)


STAGES = ("prepare_for_extend", "kv_alloc", "forward_batch", "forward", "scales", "under", "write")


class Warnings(logging.Handler):
    """The plugin's warnings and errors, as the engine logs them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def scenario_kv_tp_faults(runner, extra: dict) -> dict:
    """For each stage in turn, rank 1 fails there during a due recalibration (hooks/kv_cache.recalibrate_if_due, as
    SGLang's scheduler calls it); then the load-time calibration with a fault; then a healthy recalibration. Each
    rank records how long each call took, its warnings, its scales and free slots."""
    from sglang_fp8rl.hooks.kv_cache import calibrate_now, recalibrate_if_due
    from sglang_fp8rl.kv_scales.calibrate import kv_scale_record
    from sglang_fp8rl.kv_scales.engine import kv_state, mark_due
    from sglang_fp8rl.kv_scales.layers import attention_layers, read_scales, tensors_match_floats, write_scales

    mr = runner.torch_runner
    layers = attention_layers(mr.model)
    faulty = extra["tp_rank"] == 1
    manager = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=mr), flush_cache=lambda: True)
    warnings = Warnings()
    logging.getLogger("sglang_fp8rl").addHandler(warnings)
    out = {"mode": kv_state().mode, "load": kv_scale_record().as_dict(), "under": dict(kv_state().calibrated_under)}
    write_scales(layers, {layer.layer_id: SERVED for layer in layers})
    out["served"] = read_scales(layers)

    def free() -> tuple[int, int]:
        return mr.token_to_kv_pool_allocator.available_size(), mr.req_to_token_pool.available_size()

    def call(stage, fn) -> dict:
        free_before, logged = free(), len(warnings.messages)
        with fault(stage, mr) if faulty and stage else contextlib.nullcontext(), watchdog():
            started, error = time.perf_counter(), None
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the load-time calibration's answer, recorded as it is
                error = f"{type(e).__name__}: {e}"
            seconds = time.perf_counter() - started
        return {"stage": stage, "seconds": seconds, "error": error, "warnings": warnings.messages[logged:],
                "due": kv_state().due, "scales": read_scales(layers), "floats_match": tensors_match_floats(layers),
                "free_before": free_before, "free_after": free(), "writes": kv_scale_record().as_dict()["writes"]}

    out["faults"] = []
    for stage in STAGES:
        mark_due()  # as the end of a weight-update step does
        out["faults"].append(call(stage, lambda: recalibrate_if_due(manager)))
    out["load_time"] = call("prepare_for_extend", lambda: calibrate_now(mr))
    out["healthy"] = call(None, lambda: recalibrate_if_due(manager))
    return out


def main() -> None:
    """sgl_worker's entry point, with this module's scenarios."""
    sgl_worker.SCENARIOS.update(kv_tp_faults=scenario_kv_tp_faults)
    sgl_worker.main()


if __name__ == "__main__":
    main()
