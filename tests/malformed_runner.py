"""Runs every case of tests/malformed_cases.py through SGLang's real WeightUpdater, in one worker process.

Per case: parameters and pointers before, the answer (or the exception, which must never happen), parameters and
pointers after, and whether they equal the expected ones. Applied cases are undone with a full update back to W0,
which is checked too. Distributed cases broadcast from a trainer subprocess (tests/dist_trainer.py) over gloo.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from typing import Any

import torch
from malformed_cases import (
    VICTIM,
    Case,
    all_cases,
    damaged_bucket,
    distributed_plan,
    flattened,
    tensor_request,
    write_disk_case,
)
from update_group import join_update_group

from sglang_fp8rl import quant
from sglang_fp8rl.compat.updates import update_from_distributed, updater_of

HERE = os.path.dirname(os.path.abspath(__file__))
VICTIM_LAYER = VICTIM.rsplit(".", 1)[0]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def pointers(model: torch.nn.Module) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in model.named_parameters()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def differing(params: dict, expected: dict) -> list[str]:
    return [name for name in expected if not same(params[name], expected[name])]


def expected_after(case: Case, sent: Any, s0: dict, s1: dict) -> dict:
    """What an applied case leaves: W1 after a full update, W0 plus the victim alone otherwise; the victim (a
    blockwise layer) holds the reference quantization of the tensor actually sent (fp16 rounds some values)."""
    base = dict(s0 if case.position == "alone" else s1)
    named = sent["named"] if isinstance(sent, dict) and "named" in sent else sent
    sent = dict(named) if isinstance(named, list) else {}
    if VICTIM not in sent:
        return base
    if sent[VICTIM].dtype == torch.float8_e4m3fn:  # pre-quantized: stored exactly as sent
        base[VICTIM_LAYER + ".weight"], base[VICTIM_LAYER + ".weight_scale_inv"] = sent[VICTIM], \
            sent[VICTIM + "_scale_inv"]
    else:
        base[VICTIM_LAYER + ".weight"], base[VICTIM_LAYER + ".weight_scale_inv"] = quant.quantize_blockwise(
            sent[VICTIM])
    return base


def start_trainer(plan_path: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "dist_trainer.py"), plan_path, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def call(updater: Any, case: Case, w1: dict, extra: dict, work: str) -> tuple[Any, Any]:
    """Send one case; returns (answer, what was sent)."""
    if case.entry == "tensor" and case.defect.startswith("format:"):
        fmt = case.defect.split(":", 1)[1]
        load_format = "my_pkg.my_loader" if fmt == "custom_loader" else fmt
        if fmt == "custom_loader":  # registered as SGLang registers one: on the updater, or (up to 0.5.15) its args
            loaders = getattr(updater, "custom_weight_loaders", None)
            (loaders if loaders is not None else updater.server_args.custom_weight_loader).append(load_format)
        return updater.update_weights_from_tensor(list(w1.items()), load_format=load_format), None
    if case.entry == "tensor":
        named = tensor_request(case, w1)
        return updater.update_weights_from_tensor(named), named
    if case.entry == "bucket" and case.defect.startswith("layout:"):
        return updater.update_weights_from_tensor(damaged_bucket(case.defect.split(":")[1], w1),
                                                  load_format="flattened_bucket"), None
    if case.entry == "bucket":
        named = tensor_request(case, w1)
        bucket = flattened(named)
        return updater.update_weights_from_tensor(bucket, load_format="flattened_bucket"), {"named": named}
    if case.entry == "disk":
        kind = case.defect.split(":")[1]
        path = write_disk_case(kind, os.path.join(work, case.id), extra["model_dir"], w1)
        return updater.update_weights_from_disk(path, "auto"), {"path": path}
    kwargs, _ = distributed_plan(case.defect.split(":")[1], w1)
    return update_from_distributed(updater, **kwargs), None


def run_all(runner: Any, extra: dict) -> dict:
    """Every case, in order; returns {case id: record}."""
    model = runner.torch_runner.model
    updater = updater_of(runner.torch_runner)
    w0 = torch.load(extra["w0"], weights_only=False)
    w1 = torch.load(extra["w1"], weights_only=False)
    cases = all_cases()
    s0, ptrs = snapshot(model), pointers(model)
    ok, msg = updater.update_weights_from_tensor(list(w1.items()))
    assert ok, msg
    s1 = snapshot(model)
    ok, msg = updater.update_weights_from_tensor(list(w0.items()))
    assert ok and not differing(snapshot(model), s0), msg

    plan = [distributed_plan(c.defect.split(":")[1], w1)[1] for c in cases if c.entry == "distributed"]
    plan_path = os.path.join(extra["work"], "dist_plan.pt")
    torch.save(plan, plan_path)
    trainer = join_update_group(updater, lambda port: start_trainer(plan_path, port), "fp8rl_test")

    results = {}
    for case in cases:
        record: dict[str, Any] = {"expect": case.expect, "says": case.says}
        try:
            answer, sent = call(updater, case, w1, extra, extra["work"])
            record["answer"] = (bool(answer[0]), str(answer[1]))
        except BaseException as e:  # noqa: BLE001 - the invariant is that nothing escapes: record it
            record["raised"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            sent = None
        after = snapshot(model)
        record["pointers_same"] = pointers(model) == ptrs
        record["path"] = sent.get("path") if isinstance(sent, dict) else None
        if record.get("answer", (False,))[0]:
            record["differing"] = differing(after, expected_after(case, sent, s0, s1))
            ok, msg = updater.update_weights_from_tensor(list(w0.items()))  # back to W0 for the next case
            record["restored"] = ok and not differing(snapshot(model), s0)
        else:
            record["differing"] = differing(after, s0)
        results[case.id] = record
    trainer.wait(timeout=120)
    results["_trainer"] = {"returncode": trainer.returncode, "log": trainer.stdout.read()[-4000:]}
    return results
