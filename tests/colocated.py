"""Worker scenario (run by tests/sgl_worker.py): verl's colocated weight sync through SGLang's real release/resume
methods (``SchedulerWeightUpdaterManager`` from 0.5.15, the ``Scheduler``'s mixin before) on a CPU ModelRunner.

torch_memory_saver needs CUDA, so :class:`EmulatedMemorySaver` stands in for SGLang's adapter over it: enabled, its
``pause`` overwrites the bytes of a region's tensors (0xFF: NaN in every float dtype) and its ``resume`` copies them
back only where the region has a CPU backup. Its regions hold what SGLang allocates inside them on this path: the
model's parameters and buffers (``load_model``'s ``weights`` region) and the KV and request pools (``kv_cache``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from sgl_worker import (
    IdleScheduler,
    RunnerEngine,
    differing_names,
    flush_answerer,
    logits_for,
    pointers,
    session_manager,
    snapshot,
)

from sglang_fp8rl.compat import updates

KV_CACHE, WEIGHTS = "kv_cache", "weights"  # SGLang's GPU_MEMORY_TYPE_* tags
NORM = "model.norm.weight"  # left out of the partial push


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors an object holds as attributes, directly or in lists (a KV pool's per-layer buffers)."""
    found = []
    for value in vars(obj).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in items if isinstance(t, torch.Tensor)]
    return found


class EmulatedMemorySaver:
    """torch_memory_saver's pause/resume on CPU (see the module doc); ``backup``: the weights region's CPU backup."""

    enabled = True  # a memory saver that releases (SGLang's real adapter with torch_memory_saver loaded)

    def __init__(self, runner: Any, backup: bool) -> None:
        model = runner.model
        self.regions = {WEIGHTS: list(model.parameters()) + list(model.buffers()),
                        KV_CACHE: _tensors_of(runner.token_to_kv_pool) + _tensors_of(runner.req_to_token_pool)}
        self.backup = {WEIGHTS: backup, KV_CACHE: False}
        self.saved: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.paused: list[str] = []

    def _storages(self, tag: str) -> list[torch.Tensor]:
        """One uint8 view of each distinct storage of the region."""
        seen: dict[int, torch.Tensor] = {}
        for t in self.regions[tag]:
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr(), torch.empty(0, dtype=torch.uint8).set_(storage))
        return list(seen.values())

    def pause(self, tag: str) -> None:
        """Release: the bytes are gone (kept on the host first where the region has a backup)."""
        storages = self._storages(tag)
        if self.backup[tag]:
            self.saved[tag] = [(s, s.clone()) for s in storages]
        for s in storages:
            s.fill_(0xFF)
        self.paused.append(tag)

    def resume(self, tag: str) -> None:
        """Map again: the backup's bytes where there is one, else what the release left."""
        for s, copy in self.saved.pop(tag, []):
            s.copy_(copy)
        self.paused.remove(tag)


def memory_owner(runner: Any, saver: EmulatedMemorySaver) -> Any:
    """The object SGLang's release/resume methods run on: its manager (0.5.15+), else a stand-in for the Scheduler
    with the attributes its mixin reads."""
    owner = updates.memory_occupation_owner()
    if owner.__name__ == "SchedulerWeightUpdaterManager":
        from sglang.srt.disaggregation.utils import DisaggregationMode

        manager = session_manager(runner)
        manager.memory_saver_adapter = saver
        manager.scheduler.disaggregation_mode = DisaggregationMode.NULL
        manager.scheduler._engine_paused = False  # 0.5.23 reads it in its idle check
        return manager
    from sglang.srt.distributed import parallel_state

    return SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner), memory_saver_adapter=saver,
                           offload_tags=set(), flush_cache=lambda **_: True, is_fully_idle=lambda **_: True,
                           tp_cpu_group=parallel_state.get_tp_group().cpu_group)


def release(owner: Any, tags: list[str]) -> None:
    """SGLang's release_memory_occupation (the plugin's hook around it)."""
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

    updates.memory_occupation_owner().release_memory_occupation(owner, ReleaseMemoryOccupationReqInput(tags=tags))


def resume(owner: Any, tags: list[str]) -> None:
    """SGLang's resume_memory_occupation (the plugin's hook around it)."""
    from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

    updates.memory_occupation_owner().resume_memory_occupation(owner, ResumeMemoryOccupationReqInput(tags=tags))


def _state() -> dict:
    from sglang_fp8rl.kv_scales.calibrate import kv_scale_record
    from sglang_fp8rl.kv_scales.engine import kv_state
    from sglang_fp8rl.weight_sync.engine_state import engine_state
    from sglang_fp8rl.weight_sync.step import current_step

    state = engine_state()
    return {"consistent": state.consistent, "dirty": sorted(state.dirty), "reason": state.inconsistent_reason,
            "released": sorted(state.released), "step": current_step().describe(), "kv_due": kv_state().due,
            "kv_writes": kv_scale_record().as_dict()["writes"]}


def _kv_scales() -> dict:
    from sglang_fp8rl.kv_scales.calibrate import kv_scale_record

    return kv_scale_record().as_dict().get("scales", {})


def _verl_push(runner: Any, flush: Any, weights: dict) -> list:
    """verl's sync: plain buckets (no validation round, no marker), then an explicit /flush_cache ends the step."""
    from sglang_fp8rl.weight_sync.client import WeightPushError, push_state_dict

    try:
        answers = push_state_dict(RunnerEngine(runner), weights, bucket_bytes=1 << 16, atomic=False, complete=False)
    except WeightPushError as e:
        return [str(e)]
    return [answer[1] for answer in answers] + [flush().success]


def cycle(runner: Any, owner: Any, flush: Any, w1: dict, w1_dir: str, out: dict) -> None:
    """One colocated step into ``out``: release (KV cache and weights) -> a push and a disk update refused -> resume
    the weights -> a push without the final norm -> the full push of W1 (each verl's way) -> resume the KV cache."""
    from sglang_fp8rl.hooks.kv_cache import recalibrate_if_due
    from sglang_fp8rl.kv_scales.engine import mark_due

    model = runner.torch_runner.model
    saver = owner.memory_saver_adapter
    out.update(ptrs_before=pointers(model), params_before=snapshot(model), start=_state())
    release(owner, [KV_CACHE, WEIGHTS])
    out["released"], out["saver_paused"] = _state(), list(saver.paused)
    out["push_released"] = _verl_push(runner, flush, w1)
    out["disk_released"] = updates.updater_of(runner.torch_runner).update_weights_from_disk(w1_dir, "auto")
    out["after_refusal"] = _state()
    mark_due()  # as if a step had ended before the release: its recalibration must wait for the resume
    recalibrate_if_due(owner)
    out["due_while_released"] = _state()
    resume(owner, [WEIGHTS])
    out["resumed_weights"] = _state()
    out["changed_by_resume"] = differing_names(out["params_before"], snapshot(model))
    out["push_partial"] = _verl_push(runner, flush, {k: v for k, v in w1.items() if k != NORM})
    out["after_partial"] = _state()
    out["push_full"] = _verl_push(runner, flush, w1)
    out["after_full"] = _state()
    resume(owner, [KV_CACHE])
    out["resumed_kv"], out["saver_paused_end"] = _state(), list(saver.paused)
    out.update(params=snapshot(model), ptrs_after=pointers(model), kv_after=_kv_scales(), logits=logits_for(runner))


def scenario_colocated(runner: Any, extra: dict) -> dict:
    """The process starts on W1 (its cold start is the reference); W0 is pushed; then one colocated step, with a CPU
    backup of the weights if the server was started with ``--enable-weights-cpu-backup``, ending on W1."""
    mr = runner.torch_runner
    model = mr.model
    out: dict = {"cold": {"params": snapshot(model), "kv_scales": _kv_scales(), "logits": logits_for(runner)},
                 "backup": bool(mr.server_args.enable_weights_cpu_backup)}
    owner = memory_owner(mr, EmulatedMemorySaver(mr, out["backup"]))
    flush = flush_answerer(IdleScheduler(mr))
    w0, w1 = (torch.load(extra[k], weights_only=False) for k in ("w0", "w1"))
    out["push_w0"], out["on_w0"] = _verl_push(runner, flush, w0), _state()
    out["kv_w0"] = _kv_scales()
    cycle(runner, owner, flush, w1, extra["w1_dir"], out)
    return out
