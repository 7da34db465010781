"""Subprocess worker: build SGLang's real ModelRunner on CPU for a tiny checkpoint and run one scenario.

Usage: python tests/sgl_worker.py SCENARIO MODEL_DIR OUT_PATH EXTRA_JSON [server args...]
The plugin is found the way SGLang finds it in production: through `sglang.srt.plugins.load_plugins()` and the
installed entry point.
"""

from __future__ import annotations

import json
import os
import sys
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cpu_stubs  # noqa: E402

cpu_stubs.install_cpu_stubs()

import torch  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 99, 120, 7], [250, 3, 3, 64, 11]]


def build_runner(model_dir: str, server_args: list[str], tp_rank: int = 0):
    """SGLang's own CPU ModelRunner for MODEL_DIR (torch_native attention, no CUDA graphs)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True  # else RotaryEmbedding imports vllm's op on an unknown platform
    from sglang.benchmark.one_batch import load_model
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.server_args import PortArgs, prepare_server_args

    sa = prepare_server_args([
        "--model-path", model_dir, "--device", "cpu", "--dtype", "bfloat16", "--mem-fraction-static", "0.05",
        "--max-total-tokens", "512", "--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled",
        *server_args,
    ])
    _set_envs_and_config(sa)
    bench_runner, _ = load_model(sa, PortArgs.init_new(sa), tp_rank, tp_rank)
    return bench_runner


def logits_for(bench_runner, prompts=PROMPTS) -> list[torch.Tensor]:
    """Last-position logits of each prompt (one prefill each, fresh KV pool)."""
    from sglang.benchmark.one_batch import extend
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = []
    for rid, ids in enumerate(prompts):
        bench_runner.clear()
        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.set_extend_range(0, len(ids))
        _, logits, _ = extend([req], bench_runner.torch_runner)
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
    return runner.torch_runner.weight_updater


def scenario_updates(runner, extra: dict) -> dict:
    """Apply a list of update requests (each a list of (name, tensor) from a saved file) through SGLang's
    WeightUpdater; record each answer, pointers before/after, parameters after each request, and logits at the end."""
    from sglang_fp8rl.weight_sync.update import engine_state

    model = runner.torch_runner.model
    updater = _updater(runner)
    requests = torch.load(extra["requests"], weights_only=False)
    ptrs_before = pointers(model)
    answers, params_after = [], []
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
    return {"answers": answers, "ptrs_before": ptrs_before, "ptrs_after": pointers(model),
            "params_after": params_after, "final_params": snapshot(model), "logits": logits_for(runner),
            "state": {"consistent": engine_state().consistent, "updates": engine_state().updates}}


def scenario_leak(runner, extra: dict) -> dict:
    """Many consecutive updates: live tensor count and allocated CPU bytes must not grow."""
    import gc

    model = runner.torch_runner.model
    updater = _updater(runner)
    request = torch.load(extra["requests"], weights_only=False)[0]["tensors"]

    def live_tensors() -> int:
        gc.collect()
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))

    counts = []
    ptrs_before = pointers(model)
    for i in range(extra.get("n", 200)):
        ok, msg = updater.update_weights_from_tensor(request)
        assert ok, msg
        if i in (9, extra.get("n", 200) - 1):
            counts.append(live_tensors())
    return {"live_tensors": counts, "ptrs_before": ptrs_before, "ptrs_after": pointers(model)}


def scenario_device_failure(runner, extra: dict) -> dict:
    """A failure after writing started (simulated device error in the 3rd quantized write), then a full update."""
    import sglang_fp8rl.layers.linear as linear
    from sglang_fp8rl.weight_sync.update import engine_state

    model = runner.torch_runner.model
    updater = _updater(runner)
    request = torch.load(extra["requests"], weights_only=False)[0]["tensors"]
    real = linear.quantize_rows_into_layer
    calls = {"n": 0}

    def failing(layer, w, dst_rows):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated CUDA error: an illegal memory access was encountered")
        return real(layer, w, dst_rows)

    linear.quantize_rows_into_layer = failing
    first = updater.update_weights_from_tensor(request)
    state_after_failure = {"consistent": engine_state().consistent, "reason": engine_state().inconsistent_reason}
    linear.quantize_rows_into_layer = real
    second = updater.update_weights_from_tensor(request)
    return {"first": first, "state_after_failure": state_after_failure, "second": second,
            "consistent_after_second": engine_state().consistent, "final_params": snapshot(model)}


class RunnerEngine:
    """``sglang.Engine``'s update methods without its processes, straight into SGLang's WeightUpdater.

    The serialization step is left out here: SGLang's WeightUpdater patches torch's tensor reductions for CUDA IPC
    in this process, which breaks pickling CPU tensors afterwards; tests/test_client.py checks the payload format
    with SGLang's own deserializer in a clean process instead."""

    def __init__(self, runner):
        self.updater = _updater(runner)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return self.updater.update_weights_from_tensor(list(named_tensors), load_format=load_format)

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


SCENARIOS = {"client": scenario_client, "load": scenario_load, "updates": scenario_updates, "leak": scenario_leak,
             "device_failure": scenario_device_failure}


def main() -> None:
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
