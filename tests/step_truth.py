"""Worker scenarios (run by tests/sgl_worker.py) for issue 34's step defects, through SGLang's real WeightUpdater and
(0.5.21+) its real SchedulerWeightUpdaterManager on a CPU ModelRunner. The items of the issue are in brackets."""

from __future__ import annotations

import logging

import torch
from sgl_worker import RunnerEngine, SessionEngine, differing_names, session_manager, snapshot

from sglang_fp8rl.compat.updates import updater_of

HALF = "model.layers.1.mlp.down_proj.weight"
BF16_LAYER = "model.layers.0.mlp.down_proj.weight"  # the tests keep layer 0 in BF16 (--fp8rl-bf16-first-layers 1)


class Records(logging.Handler):
    """The package's log lines, kept for the test to read."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("sglang_fp8rl").addHandler(self)
        logging.getLogger("sglang_fp8rl").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _state() -> dict:
    from sglang_fp8rl.weight_sync.engine_state import engine_state
    from sglang_fp8rl.weight_sync.step import current_step

    state = engine_state()
    return {"consistent": state.consistent, "dirty": sorted(state.dirty), "reason": state.inconsistent_reason,
            "step": current_step().describe()}


def _push(engine, weights: dict, bucket_bytes: int) -> str | None:
    from sglang_fp8rl.weight_sync.client import WeightPushError, push_state_dict

    try:
        push_state_dict(engine, weights, bucket_bytes=bucket_bytes)
        return None
    except WeightPushError as e:
        return str(e)


def _refuse_apply_bucket(model, n: int):
    """Make the n-th request of each apply round refuse (a rank-local failure while validating it); returns undo."""
    from sglang_fp8rl.weight_sync import pipeline

    real = pipeline.validate_request
    seen = {"n": 0}

    def validate(model_, load_weights, named, *args, **kwargs):
        if model_.__dict__.get("_fp8rl_apply_round"):
            seen["n"] += 1
            if seen["n"] == n:
                raise MemoryError("simulated out of memory while validating")
        return real(model_, load_weights, named, *args, **kwargs)

    pipeline.validate_request = validate

    def undo() -> None:
        pipeline.validate_request = real

    return seen, undo


class RoundEngine(RunnerEngine):
    """RunnerEngine that tells the model whether a request belongs to the apply round (for _refuse_apply_bucket)."""

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.model = runner.torch_runner.model

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.model.__dict__["_fp8rl_apply_round"] = load_format is None
        try:
            return super().update_weights_from_tensor(named_tensors, load_format, flush_cache)
        finally:
            self.model.__dict__.pop("_fp8rl_apply_round", None)


def scenario_step_truth(runner, extra: dict) -> dict:
    """[1] two atomic pushes refused in their apply round, then a complete one; [2] a dead trainer's half, then an
    atomic push and a plain push that supersedes a half; [4] halves that could never pair; [5] the answer and the
    telemetry of a request that leaves a half held."""
    from sglang_fp8rl.quant import quantize_blockwise

    records = Records()
    model = runner.torch_runner.model
    updater, engine = updater_of(runner.torch_runner), RoundEngine(runner)
    w1, w2 = (torch.load(extra[k], weights_only=False) for k in ("w1", "w2"))
    bucket_bytes = extra["bucket_bytes"]
    out: dict = {}
    # [1] the first refusal marks bucket 1 dirty; the second push rewrites bucket 1 and is refused again
    seen, undo = _refuse_apply_bucket(model, 2)
    try:
        out["push1"] = _push(engine, w1, bucket_bytes)
        out["after_push1"] = _state()
        seen["n"] = 0
        out["push2"] = _push(engine, w2, bucket_bytes)
        out["after_push2"] = _state()
    finally:
        undo()
    out["params_after_push2"] = snapshot(model)
    out["push3"] = _push(engine, w2, bucket_bytes)
    out["after_push3"] = _state()
    # [2] + [5] a trainer sends a weight's codes and dies before the scale (outside any session)
    codes, scale = quantize_blockwise(w1[HALF], scale_format="pow2")
    out["half"] = updater.update_weights_from_tensor([(HALF, codes)])
    out["after_half"] = _state()
    records.lines.clear()
    out["push_after_half"] = _push(engine, w1, bucket_bytes)
    out["after_push_after_half"] = _state()
    out["log_after_half"] = list(records.lines)
    # a held half superseded by the BF16 weight of a later plain request
    updater.update_weights_from_tensor([(HALF + "_scale_inv", scale)])
    out["superseded"] = updater.update_weights_from_tensor([(HALF, w2[HALF])])
    out["after_superseded"] = _state()
    # [4] halves that could never pair: refused at arrival, nothing of their request written
    norm = "model.norm.weight"
    before = snapshot(model)
    fused = "model.layers.1.self_attn.qkv_proj.weight_scale_inv"
    out["never_pair"] = {
        "fused_name": updater.update_weights_from_tensor([(norm, w1[norm] * 3), (fused, torch.ones(4, 2))]),
        "no_fp8_module": updater.update_weights_from_tensor([(norm + "_scale_inv", torch.ones(1))]),
        "unknown_name": updater.update_weights_from_tensor(
            [("model.layers.1.mlp.nonexistent.weight", codes)]),
        "bf16_layer": updater.update_weights_from_tensor([(BF16_LAYER, quantize_blockwise(w1[BF16_LAYER])[0])]),
        "wrong_shape": updater.update_weights_from_tensor([(HALF + "_scale_inv", torch.ones(3, 3))]),
        "contradicted": updater.update_weights_from_tensor([(HALF, w1[HALF]), (HALF + "_scale_inv", scale)]),
    }
    out["never_pair_changed"] = differing_names(before, snapshot(model))
    out["after_never_pair"] = _state()
    return out


def scenario_session_recovery(runner, extra: dict) -> dict:
    """[3] SGLang 0.5.21+: a trainer opens a session, writes part of an atomic step and leaves a half held, then dies;
    the next trainer's push_state_dict closes the stale session (the engine drops the half and keeps the dead step's
    tensors dirty) and its own step succeeds."""
    from sglang_fp8rl.quant import quantize_blockwise
    from sglang_fp8rl.weight_sync.buckets import buckets

    records = Records()
    model = runner.torch_runner.model
    engine = SessionEngine(session_manager(runner.torch_runner))
    w1 = torch.load(extra["w1"], weights_only=False)
    chunks = list(buckets(w1, extra["bucket_bytes"]))
    codes, _ = quantize_blockwise(w1[HALF], scale_format="pow2")
    out = {"begin": engine.begin_weight_update()}
    out["validated"] = [engine.update_weights_from_tensor(chunk, load_format="fp8rl.validate") for chunk in chunks]
    out["written"] = engine.update_weights_from_tensor(chunks[0])
    out["half"] = engine.update_weights_from_tensor([(HALF, codes)])
    out["dead_step"] = _state()
    records.lines.clear()
    out["recovered"] = _push(engine, w1, extra["bucket_bytes"])
    out["after_recovery"] = _state()
    out["log"] = list(records.lines)
    out["session_open"] = engine.manager._session is not None
    out["params"] = snapshot(model)
    return out
