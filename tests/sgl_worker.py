"""Subprocess worker: build SGLang's real ModelRunner on CPU for a tiny checkpoint and run one scenario.

Usage: python tests/sgl_worker.py SCENARIO MODEL_DIR OUT_PATH EXTRA_JSON [server args...]
The plugin is found the way SGLang finds it in production: through `sglang.srt.plugins.load_plugins()` and the
installed entry point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import sys
from types import SimpleNamespace

from rank_pair import STACKS_AFTER_ENV

from sglang_fp8rl.compat.runtime import one_batch, prefill_request
from sglang_fp8rl.compat.updates import updater_of
from sglang_fp8rl.cpu_runner import build_runner, install_cpu_stubs

install_cpu_stubs()

import torch  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 99, 120, 7], [250, 3, 3, 64, 11]]


def logits_for(bench_runner, prompts=PROMPTS) -> list[torch.Tensor]:
    """Last-position logits of each prompt (one prefill each, fresh KV pool)."""
    extend = one_batch().extend
    out = []
    for rid, ids in enumerate(prompts):
        bench_runner.clear()
        _, logits, _ = extend([prefill_request(rid, ids, max_new_tokens=1)], bench_runner.torch_runner)
        out.append(logits[0].float().clone())
    return out


def snapshot(model) -> dict[str, torch.Tensor]:
    """Copy of every parameter (bytes as they are) and its data_ptr."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def pointers(model) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in model.named_parameters()}


def scheme_report(model) -> dict:
    for module in model.modules():
        config = getattr(getattr(module, "quant_method", None), "quant_config", None)
        if config is not None and hasattr(config, "report"):
            return {"summary": config.report.summary(), "decisions": {k: (v.scheme.value, v.reason)
                                                                      for k, v in config.report.decisions.items()}}
    return {}


def scenario_load(runner, extra: dict) -> dict:
    """Parameters, pointers, scheme report and logits after a cold load."""
    model = runner.torch_runner.model
    return {"params": snapshot(model), "ptrs": pointers(model), "report": scheme_report(model),
            "logits": logits_for(runner)}


def _updater(runner):
    return updater_of(runner.torch_runner)


def scenario_updates(runner, extra: dict) -> dict:
    """Apply a list of update requests (each a list of (name, tensor) from a saved file) through SGLang's
    WeightUpdater; record each answer, pointers before/after, parameters after each request, and logits at the end."""
    from sglang_fp8rl.weight_sync import request
    from sglang_fp8rl.weight_sync.engine_state import engine_state
    from sglang_fp8rl.weight_sync.step import current_step

    model = runner.torch_runner.model
    updater = _updater(runner)
    if extra.get("no_replay"):  # every tensor through the model's load_weights
        request.ROUTING_ONLY_MODELS = frozenset()
    requests = torch.load(extra["requests"], weights_only=False)
    ptrs_before = pointers(model)
    answers, params_after, steps = [], [], []
    for req in requests:
        kind = req.get("kind", "tensor")
        if kind == "tensor":
            answers.append(updater.update_weights_from_tensor(req["tensors"], load_format=req.get("load_format")))
        elif kind == "bucket":
            answers.append(updater.update_weights_from_tensor(req["bucket"], load_format="flattened_bucket"))
        elif kind == "disk":
            answers.append(updater.update_weights_from_disk(req["path"], "auto"))
        if extra.get("params_each", True):
            params_after.append(snapshot(model))
        if extra.get("step_each"):
            steps.append(current_step().describe())
    return {"answers": answers, "ptrs_before": ptrs_before, "ptrs_after": pointers(model), "steps": steps,
            "params_after": params_after, "final_params": snapshot(model), "logits": logits_for(runner),
            "state": {"consistent": engine_state().consistent, "updates": engine_state().updates}}


def scenario_leak(runner, extra: dict) -> dict:
    """Many consecutive updates: live tensor count and the bytes they hold must not grow."""
    import gc

    model = runner.torch_runner.model
    updater = _updater(runner)
    request = torch.load(extra["requests"], weights_only=False)[0]["tensors"]
    n = extra.get("n", 200)

    def live() -> tuple[int, int]:
        gc.collect()
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if t.device.type == "cpu"}
        return len(tensors), sum(storages.values())

    counts = []
    ptrs_before = pointers(model)
    for i in range(n):
        ok, msg = updater.update_weights_from_tensor(request)
        assert ok, msg
        if i in (9, n - 1):
            counts.append(live())
    return {"live": counts, "ptrs_before": ptrs_before, "ptrs_after": pointers(model)}


@contextlib.contextmanager
def device_error_at_write(n: int, enabled: bool = True):
    """The n-th FP8 quantizer call of the block raises a simulated device error (replayed and loader writes alike:
    both end in these quantizers on CPU)."""
    from sglang_fp8rl.kernels import dispatch
    from sglang_fp8rl.layers import fp8_storage

    calls = {"n": 0}
    patched = [(module, name, getattr(module, name)) for module in (dispatch, fp8_storage)
               for name in ("quantize_blockwise_into", "quantize_per_channel_into")]

    def failing(real):
        def quantize(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == n:
                raise RuntimeError("simulated CUDA error: an illegal memory access was encountered")
            return real(*args, **kwargs)
        return quantize

    if enabled:
        for module, name, real in patched:
            setattr(module, name, failing(real))
    try:
        yield
    finally:
        for module, name, real in patched:
            setattr(module, name, real)


def scenario_device_failure(runner, extra: dict) -> dict:
    """A failure after writing started (simulated device error in the 3rd quantized write), then a full update."""
    from sglang_fp8rl.weight_sync.engine_state import engine_state

    model = runner.torch_runner.model
    updater = _updater(runner)
    request = torch.load(extra["requests"], weights_only=False)[0]["tensors"]
    with device_error_at_write(3):
        first = updater.update_weights_from_tensor(request)
    state_after_failure = {"consistent": engine_state().consistent, "reason": engine_state().inconsistent_reason}
    second = updater.update_weights_from_tensor(request)
    return {"first": first, "state_after_failure": state_after_failure, "second": second,
            "consistent_after_second": engine_state().consistent, "final_params": snapshot(model)}


def decoded_request(named_tensors, load_format):
    """What a TP worker hands SGLang's WeightUpdater: ``flattened_bucket`` payloads arrive serialized per rank (the
    format sglang.Engine takes them in), every rank's the same here; anything else as given."""
    if load_format == "flattened_bucket":
        from sglang.srt.utils import MultiprocessingSerializer

        return MultiprocessingSerializer.deserialize(named_tensors[0])
    return named_tensors if isinstance(named_tensors, dict) else list(named_tensors)


def request_names(named_tensors, load_format) -> list:
    """The tensor names of one update request, pairs or flattened bucket."""
    payload = decoded_request(named_tensors, load_format)
    if isinstance(payload, dict):
        return [meta.name for meta in payload["metadata"]]
    return [name for name, _ in payload]


class RunnerEngine:
    """``sglang.Engine``'s update methods without its processes, straight into SGLang's WeightUpdater.

    The serialization of lists is left out here: SGLang's WeightUpdater patches torch's tensor reductions for CUDA
    IPC in this process, which breaks pickling CPU tensors afterwards; tests/test_client.py checks the payload format
    with SGLang's own deserializer in a clean process instead. Flattened buckets arrive serialized, as sglang.Engine
    takes them (the client's own pickler writes CPU tensors as bytes), and are decoded as a TP worker decodes them."""

    server_args = SimpleNamespace(tp_size=1)

    def __init__(self, runner):
        self.updater = _updater(runner)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return self.updater.update_weights_from_tensor(decoded_request(named_tensors, load_format),
                                                       load_format=load_format)

    def update_weights_from_disk(self, model_path, load_format=None):
        return self.updater.update_weights_from_disk(model_path, load_format or "auto")


def scenario_client(runner, extra: dict) -> dict:
    """The trainer client against the engine adapter: a bucketed push, a bad push, a disk push."""
    from sglang_fp8rl.weight_sync.client import WeightPushError, push_from_disk, push_state_dict

    model = runner.torch_runner.model
    engine = RunnerEngine(runner)
    sd = torch.load(extra["state_dict"], weights_only=False)
    ptrs_before = pointers(model)
    answers = push_state_dict(engine, sd, bucket_bytes=extra["bucket_bytes"])
    after_push = snapshot(model)
    bad = {name: t.clone() for name, t in list(sd.items())[:2]}
    first = next(iter(bad))
    bad[first].view(-1)[0] = float("nan")
    try:
        push_state_dict(engine, bad)
        bad_error = None
    except WeightPushError as e:
        bad_error = str(e)
    after_bad = snapshot(model)
    disk_answer = push_from_disk(engine, extra["disk"]) if extra.get("disk") else None
    return {"answers": answers, "after_push": after_push, "bad_error": bad_error, "after_bad": after_bad,
            "disk_answer": disk_answer, "final_params": snapshot(model), "ptrs_before": ptrs_before,
            "ptrs_after": pointers(model)}


def scenario_tp_fault(runner, extra: dict) -> dict:
    """Rank-local failures on TP rank 1 only: (a) validation runs out of memory, (b) a device error while writing;
    then (c) a complete update. Every rank records its answers, parameters and engine state after each request."""
    import sglang_fp8rl.weight_sync.pipeline as pipeline
    from sglang_fp8rl.weight_sync.engine_state import engine_state

    model = runner.torch_runner.model
    updater = _updater(runner)
    request = torch.load(extra["requests"], weights_only=False)[0]["tensors"]
    faulty = extra["tp_rank"] == 1
    out = {"params_before": snapshot(model), "steps": []}

    def step(name: str) -> None:
        answer = updater.update_weights_from_tensor(request)
        out["steps"].append({"name": name, "answer": answer, "params": snapshot(model),
                             "consistent": engine_state().consistent, "dirty": sorted(engine_state().dirty)})

    real_validate = pipeline.validate_request
    if faulty:
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("simulated: out of memory in the dry-run scratch")
        pipeline.validate_request = out_of_memory
    step("validation_oom")
    pipeline.validate_request = real_validate
    with device_error_at_write(3, enabled=faulty):
        step("write_error")
    step("complete")
    return out


def scenario_atomic(runner, extra: dict) -> dict:
    """All-or-nothing steps with the trainer client: a step whose last bucket the engine refuses, then a good one
    (``extra["flatten"]``: buckets sent flattened)."""
    from sglang_fp8rl.weight_sync.client import WeightPushError, push_state_dict
    from sglang_fp8rl.weight_sync.engine_state import engine_state

    model = runner.torch_runner.model
    engine = RunnerEngine(runner)
    requests = []
    send = engine.update_weights_from_tensor
    flatten = extra.get("flatten", False)

    def logged(named_tensors, load_format=None, flush_cache=True):
        requests.append({"load_format": load_format, "names": request_names(named_tensors, load_format),
                         "flush_cache": flush_cache})
        return send(named_tensors, load_format=load_format, flush_cache=flush_cache)

    engine.update_weights_from_tensor = logged
    sd = torch.load(extra["state_dict"], weights_only=False)
    before = snapshot(model)
    bad = dict(sd)
    bad["model.layers.0.mlp.nope.weight"] = torch.ones(2, 2, dtype=torch.bfloat16)  # last: passes the client
    writes = engine_state().writes
    try:
        push_state_dict(engine, bad, bucket_bytes=extra["bucket_bytes"], flatten=flatten)
        bad_error = None
    except WeightPushError as e:
        bad_error = str(e)
    writes_after_bad = engine_state().writes - writes
    after_bad = snapshot(model)
    bad_formats = [r["load_format"] for r in requests]
    requests.clear()
    ptrs = pointers(model)
    good_answers = push_state_dict(engine, sd, bucket_bytes=extra["bucket_bytes"], flatten=flatten)
    return {"before": before, "bad_error": bad_error, "writes_after_bad": writes_after_bad, "after_bad": after_bad,
            "good_answers": good_answers, "after_good": snapshot(model), "bad_formats": bad_formats,
            "last_request_names": requests[-1]["names"], "formats": [r["load_format"] for r in requests],
            "flushes": [r["flush_cache"] for r in requests], "pointers_kept": ptrs == pointers(model),
            "consistent": engine_state().consistent}


def scenario_kv(runner, extra: dict) -> dict:
    """FP8 KV scales on the engine: the load-time calibration, an update completing a step (layer 0's v_proj x8),
    the recalibration SGLang's scheduler would trigger, trainer-supplied scales good and bad."""
    from types import SimpleNamespace

    from sglang_fp8rl.hooks.kv_cache import recalibrate_if_due
    from sglang_fp8rl.hooks.scheduler import telemetry
    from sglang_fp8rl.kv_scales.calibrate import kv_scale_record
    from sglang_fp8rl.kv_scales.engine import kv_state
    from sglang_fp8rl.kv_scales.layers import attention_layers, read_scales, tensors_match_floats

    mr = runner.torch_runner
    model, updater = mr.model, updater_of(mr)
    layers = attention_layers(model)
    out = {"mode": kv_state().mode, "batch": kv_state().batch_source, "load": kv_scale_record().as_dict(),
           "ptrs": [layer.k_scale.data_ptr() for layer in layers] if kv_state().calibrating else []}
    sd = torch.load(extra["state_dict"], weights_only=False)
    name = "model.layers.0.self_attn.v_proj.weight"
    manager = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=mr), flush_cache=lambda: True)
    out["update"] = updater.update_weights_from_tensor([(name, sd[name] * 8), ("fp8rl.step_complete", torch.zeros(()))])
    out["due"] = kv_state().due
    recalibrate_if_due(manager)
    out["after_step"] = kv_scale_record().as_dict()
    before = read_scales(layers) if kv_state().calibrating else {}
    answers = {}
    for case, value in (("good", 0.3), ("nan", float("nan")), ("zero", 0.0), ("negative", -1.0)):
        answers[case] = updater.update_weights_from_tensor(
            [("model.layers.1.self_attn.k_scale", torch.tensor(value)), ("model.layers.1.self_attn.v_scale",
                                                                        torch.tensor([0.25]))])
        answers[case + "_scales"] = read_scales(layers) if kv_state().calibrating else {}
    calibrating = kv_state().calibrating
    out.update(answers=answers, before_trainer=before,
               floats_match=tensors_match_floats(layers) if calibrating else None,
               ptrs_after=[layer.k_scale.data_ptr() for layer in layers] if kv_state().calibrating else [],
               telemetry=telemetry(model)["kv_scales"])
    return out


def session_manager(mr) -> object:
    """SGLang's own SchedulerWeightUpdaterManager (0.5.21+) over this ModelRunner, as the scheduler builds it (the
    parts a CPU process has: no draft model, no memory saver, an idle engine whose cache flush succeeds)."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker

    worker = SimpleNamespace(model_runner=mr, weight_update_runners=lambda: [("target", mr)])
    worker.deserialize_own_rank = lambda payloads: TpModelWorker.deserialize_own_rank(worker, payloads)
    scheduler = SimpleNamespace(record_weight_version_change=lambda new_version=None: None)
    kwargs = dict(tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=lambda **_: True,
                  is_fully_idle=lambda **_: True, scheduler=scheduler)
    if any(f.name == "tp_cpu_group" and f.init for f in dataclasses.fields(SchedulerWeightUpdaterManager)):
        from sglang.srt.distributed import parallel_state  # 0.5.21 takes the group; 0.5.23 reads it itself

        kwargs["tp_cpu_group"] = parallel_state.get_tp_group().cpu_group
    return SchedulerWeightUpdaterManager(**kwargs)


class SessionEngine:
    """An in-process stand-in for ``sglang.Engine`` over SGLang's real session manager: the calls our client makes."""

    def __init__(self, manager) -> None:
        self.manager = manager

    def begin_weight_update(self):
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        out = self.manager.begin_weight_update(BeginWeightUpdateReqInput())
        return out.success, out.message

    def end_weight_update(self):
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        out = self.manager.end_weight_update(EndWeightUpdateReqInput())
        return out.success, out.message

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        import base64

        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        from sglang_fp8rl.weight_sync.client import serialize_for_ranks

        payload = [base64.b64decode(p) for p in serialize_for_ranks(named, 1)]
        out = self.manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payload, load_format=load_format, flush_cache=flush_cache))
        return out.success, out.message


def scenario_sessions(runner, extra: dict) -> dict:
    """SGLang 0.5.21+'s weight-update sessions through its real SchedulerWeightUpdaterManager: a bare update refused
    by SGLang; a trainer driving begin/update/end itself; our client's push_state_dict (which opens and closes the
    session, also around a refused bucket); FP8 bytes and pointers across end_weight_update's re-run of
    process_weights_after_loading; the KV recalibration at the session's end."""
    from sglang_fp8rl.kv_scales.calibrate import kv_scale_record
    from sglang_fp8rl.kv_scales.engine import kv_state
    from sglang_fp8rl.weight_sync.client import WeightPushError, push_state_dict
    from sglang_fp8rl.weight_sync.step import current_step

    mr = runner.torch_runner
    model = mr.model
    engine = SessionEngine(session_manager(mr))
    w1 = torch.load(extra["w1"], weights_only=False)
    w0 = torch.load(extra["w0"], weights_only=False)
    out = {"bare": engine.update_weights_from_tensor(list(w1.items()))}
    calibrations = kv_scale_record().as_dict()["writes"] if kv_state().calibrating else None
    out["begin"] = engine.begin_weight_update()
    out["update"] = engine.update_weights_from_tensor(list(w1.items()))
    before_end, ptrs_before_end = snapshot(model), pointers(model)
    out["end"] = engine.end_weight_update()
    out["end_changed"] = sorted(differing_names(before_end, snapshot(model)))
    out["end_moved"] = ptrs_before_end != pointers(model)
    out["params_w1"] = snapshot(model)
    out["step"] = current_step().describe()
    out["calibrations"] = (calibrations, kv_scale_record().as_dict()["writes"]
                           if kv_state().calibrating else None)
    out["client"] = push_state_dict(engine, w0, bucket_bytes=1 << 16)
    out["params_w0"] = snapshot(model)
    bad = dict(w1)
    bad[next(reversed(bad))] = torch.full_like(bad[next(reversed(bad))], float("nan"))
    try:
        push_state_dict(engine, bad, bucket_bytes=1 << 16)
        out["refused"] = None
    except WeightPushError as e:
        out["refused"] = str(e)
    out["session_open_after_refusal"] = engine.manager._session is not None
    out["params_after_refusal"] = snapshot(model)
    # an FP8 weight whose scale never comes before the session ends, then one whose scale comes in the next request
    from sglang_fp8rl.quant import quantize_blockwise

    name = extra.get("half", "model.layers.1.mlp.down_proj.weight")
    codes, scale = quantize_blockwise(w1[name], scale_format="pow2")
    engine.begin_weight_update()
    out["half"] = engine.update_weights_from_tensor([(name, codes)])
    out["half_step"] = current_step().describe()
    out["half_end"] = engine.end_weight_update()
    out["params_after_half"] = snapshot(model)
    engine.begin_weight_update()
    out["split"] = [engine.update_weights_from_tensor([(name, codes)]),
                    engine.update_weights_from_tensor([(name + "_scale_inv", scale)]), engine.end_weight_update()]
    out["split_sent"] = (codes, scale)
    out["params_after_split"] = snapshot(model)
    return out


class IdleScheduler:
    """The parts of SGLang's scheduler that its /flush_cache handler and the plugin's hook read, on an idle engine."""

    def __init__(self, mr) -> None:
        from types import SimpleNamespace

        self.tp_worker = SimpleNamespace(model_runner=mr)
        self._pending_flush = None  # up to 0.5.14 the handler keeps its pending flush on the scheduler
        self.flushes = 0

    def flush_cache(self, **_) -> bool:
        self.flushes += 1
        return True

    def is_fully_idle(self, **_) -> bool:
        return True


def flush_answerer(scheduler: IdleScheduler):
    """A callable answering one /flush_cache through SGLang's own handler (the plugin's hook around it)."""
    import inspect

    from sglang.srt.managers.io_struct import FlushCacheReqInput

    from sglang_fp8rl.compat import updates

    owner, method = updates.flush_request_handler()
    if method != "handle":  # up to 0.5.14: a Scheduler method
        return lambda: getattr(owner, method)(scheduler, FlushCacheReqInput())
    params = inspect.signature(owner).parameters
    handler = owner(**{name: getattr(scheduler, name, None) for name in params})
    return lambda: handler.handle(FlushCacheReqInput())


def scenario_flush(runner, extra: dict) -> dict:
    """verl's weight sync: updates with no step marker and no session, then an explicit /flush_cache answered by
    SGLang's own handler; a step holding an FP8 half for its partner, then that partner."""
    from sglang_fp8rl.kv_scales.calibrate import kv_scale_record
    from sglang_fp8rl.kv_scales.engine import kv_state
    from sglang_fp8rl.quant import quantize_blockwise
    from sglang_fp8rl.weight_sync.step import current_step

    mr = runner.torch_runner
    updater = updater_of(mr)
    sd = torch.load(extra["state_dict"], weights_only=False)
    scheduler = IdleScheduler(mr)
    flush = flush_answerer(scheduler)
    writes = (lambda: kv_scale_record().as_dict()["writes"]) if kv_state().calibrating else (lambda: None)
    out = {"writes_load": writes(), "flush_idle": flush().success, "step_idle": current_step().describe()}
    name = "model.layers.0.self_attn.v_proj.weight"
    out["update"] = updater.update_weights_from_tensor([(name, sd[name] * 8)])
    out["step_open"], out["due_before_flush"] = current_step().describe(), kv_state().due
    out["flush"] = flush().success
    out["step_after_flush"], out["writes_after_flush"] = current_step().describe(), writes()
    out["record"] = kv_scale_record().as_dict() if kv_state().calibrating else {}
    out["flush_again"], out["writes_after_again"] = flush().success, writes()
    half = "model.layers.1.mlp.down_proj.weight"
    codes, scale = quantize_blockwise(sd[half], scale_format="pow2")
    out["half"] = updater.update_weights_from_tensor([(half, codes)])
    out["flush_held"] = flush().success
    out["step_held"] = current_step().describe()
    out["partner"] = updater.update_weights_from_tensor([(half + "_scale_inv", scale)])
    out["flush_paired"] = flush().success
    out["step_paired"], out["writes_paired"] = current_step().describe(), writes()
    out["flushes"] = scheduler.flushes
    return out


def differing_names(a: dict, b: dict) -> list[str]:
    """Names whose bytes differ between two snapshots."""
    return [name for name in a if not torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))]


def scenario_lifecycle(runner, extra: dict) -> dict:
    """The step's defects as a hostile trainer meets them (issue items in brackets): a one-tensor disk update after a
    failed write [6]; an atomic step refused in its apply round [7]; with an FP8 KV cache, trainer scales sent in an
    early bucket [4] and a recalibration deferred while requests run, then retried when idle [5]."""
    from types import SimpleNamespace

    from sglang_fp8rl.hooks.kv_cache import recalibrate_if_due
    from sglang_fp8rl.kv_scales.calibrate import kv_scale_record
    from sglang_fp8rl.kv_scales.engine import kv_state
    from sglang_fp8rl.kv_scales.layers import attention_layers, read_scales
    from sglang_fp8rl.weight_sync import request as request_module
    from sglang_fp8rl.weight_sync.client import WeightPushError, push_state_dict
    from sglang_fp8rl.weight_sync.engine_state import engine_state

    mr = runner.torch_runner
    model, updater = mr.model, updater_of(mr)
    w1 = torch.load(extra["w1"], weights_only=False)
    out: dict = {}
    # [6] a failed write leaves the engine inconsistent; a one-tensor checkpoint must not make it consistent
    with device_error_at_write(3):
        out["failed"] = updater.update_weights_from_tensor(list(w1.items()))
    out["one_tensor_disk"] = updater.update_weights_from_disk(extra["one_tensor_dir"], "auto")
    out["consistent_after_one_tensor"] = engine_state().consistent
    out["full_disk"] = updater.update_weights_from_disk(extra["w1_dir"], "auto")
    out["consistent_after_full"] = engine_state().consistent
    # [7] an atomic step whose second bucket is refused in the apply round (a rank-local failure while re-validating)
    real_validate = request_module.validate_request
    applied = {"n": 0}

    def failing_in_apply(model_, load_weights, named, *args, **kwargs):
        if getattr(model_, "_fp8rl_apply_round", False):
            applied["n"] += 1
            if applied["n"] == 2:
                raise MemoryError("simulated out of memory while re-validating")
        return real_validate(model_, load_weights, named, *args, **kwargs)

    class Engine(RunnerEngine):
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            model.__dict__["_fp8rl_apply_round"] = load_format is None
            return super().update_weights_from_tensor(named_tensors, load_format, flush_cache)

    from sglang_fp8rl.weight_sync import pipeline

    pipeline.validate_request = failing_in_apply
    try:
        push_state_dict(Engine(runner), w1, bucket_bytes=extra["bucket_bytes"])
        out["atomic_error"] = None
    except WeightPushError as e:
        out["atomic_error"] = str(e)
    finally:
        pipeline.validate_request = real_validate
        model.__dict__.pop("_fp8rl_apply_round", None)
    out["consistent_after_broken_step"] = engine_state().consistent
    out["dirty_after_broken_step"] = len(engine_state().dirty)
    if not kv_state().calibrating:
        return out
    # [4] every layer's scales in the first bucket, the step's end in a later one: no recalibration, scales kept
    layers = attention_layers(model)
    scales = [(f"model.layers.{i}.self_attn.{kv}_scale", torch.tensor(0.5)) for i in range(len(layers))
              for kv in ("k", "v")]
    writes = kv_scale_record().as_dict()["writes"]
    first = [(n, t) for n, t in w1.items() if "layers.0." in n]
    rest = [(n, t) for n, t in w1.items() if "layers.0." not in n]
    out["trainer_step"] = [updater.update_weights_from_tensor(first + scales),
                           updater.update_weights_from_tensor(rest + [("fp8rl.step_complete", torch.zeros(()))])]
    busy = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=mr), flush_cache=lambda: False)
    idle = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=mr), flush_cache=lambda: True)
    recalibrate_if_due(idle)
    out["due_after_trainer_step"] = kv_state().due
    out["scales_after_trainer_step"] = read_scales(layers)
    out["writes_in_trainer_step"] = kv_scale_record().as_dict()["writes"] - writes
    # [5] a step ends while requests run: deferred, still due; retried when idle
    out["plain_step"] = updater.update_weights_from_tensor(list(w1.items()) + [("fp8rl.step_complete",
                                                                                 torch.zeros(()))])
    recalibrate_if_due(busy)
    out["due_while_busy"] = kv_state().due
    recalibrate_if_due(idle)
    out["due_after_idle"] = kv_state().due
    out["source_after_idle"] = kv_scale_record().as_dict().get("source")
    return out


def scenario_malformed(runner, extra: dict) -> dict:
    """The malformed-request suite (tests/malformed_cases.py), every case in this one process."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from malformed_runner import run_all

    return run_all(runner, extra)


SCENARIOS = {"client": scenario_client, "load": scenario_load, "updates": scenario_updates, "leak": scenario_leak,
             "device_failure": scenario_device_failure, "malformed": scenario_malformed,
             "tp_fault": scenario_tp_fault, "atomic": scenario_atomic, "kv": scenario_kv,
             "sessions": scenario_sessions, "lifecycle": scenario_lifecycle, "flush": scenario_flush,
             "step_truth": lambda r, e: __import__("step_truth").scenario_step_truth(r, e),
             "session_recovery": lambda r, e: __import__("step_truth").scenario_session_recovery(r, e),
             "colocated": lambda r, e: __import__("colocated").scenario_colocated(r, e),
             "scale_out": lambda r, e: __import__("scale_out_scenario").scenario_scale_out(r, e),
             "hang": lambda r, e: __import__("time").sleep(e["seconds"])}  # the harness's own test


def main() -> None:
    stacks_after = os.environ.get(STACKS_AFTER_ENV)  # set by tests/rank_pair.stacks_env
    if stacks_after:
        faulthandler.dump_traceback_later(float(stacks_after), exit=True)
    scenario, model_dir, out_path, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    runner = build_runner(model_dir, sys.argv[5:], extra.get("tp_rank", 0))
    with torch.no_grad():
        result = SCENARIOS[scenario](runner, extra)
    torch.save(result, out_path)
    # an orderly gloo teardown: left to interpreter exit, its threads can abort the process after the scenario is
    # done ("terminate called without an active exception", seen once in CI on a TP-2 run)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
