"""SGLang's release and resume of GPU memory (``--enable-memory-saver``; verl's colocated mode): the scheduler's
``release_memory_occupation`` / ``resume_memory_occupation`` (:func:`~sglang_fp8rl.compat.updates.
memory_occupation_owner`).

Where our tensors live (docs/INTEGRATIONS.md, "Colocated"): every parameter of the model, our FP8 codes and scales
included, is allocated inside SGLang's ``weights`` region while the model loads; the KV pool inside ``kv_cache``. The
FP8 KV scales, the GEMM selection and every other tensor the plugin makes after the load live outside any region and
are never released. torch_memory_saver keeps a released tensor's address, so pointers and captured CUDA graphs stay
valid; the bytes come back only from a CPU backup (``--enable-weights-cpu-backup``), and SGLang re-runs nothing after
a resume (it copies back only the model's buffers, which it saved at the release).

So, for a model served with this package:

* while the weights are released, a weight update is refused, saying why (SGLang would write to unmapped memory:
  :func:`sglang_fp8rl.weight_sync.pipeline.weights_released_error`); while anything is released, generation is
  refused and a due KV recalibration waits (its forward reads the weights and writes the KV pool);
* weights resumed without a CPU backup hold whatever the GPU left there: the engine is marked inconsistent
  (:data:`~sglang_fp8rl.weight_sync.engine_state.EVERYTHING`) and refuses to serve until the writes since have reached
  every parameter (the trainer's next full push); that step's end makes a KV recalibration due as any step does (the
  trainer sends no KV scales), and it runs once nothing is released any more. The KV scales themselves are never
  released, so they need neither a host copy nor a recalibration of their own;
* with a CPU backup nothing is marked: the bytes come back as they were.

Nothing here raises into SGLang's scheduler: our part runs after SGLang's method, guarded and logged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS as WEIGHTS

from sglang_fp8rl.hooks.kv_cache import recalibrate_if_due
from sglang_fp8rl.weight_sync.engine_state import engine_state
from sglang_fp8rl.weight_sync.load_guard import is_attached

logger = logging.getLogger(__name__)

LOST = ("the weights were resumed from SGLang's memory saver without a CPU backup (--enable-weights-cpu-backup): "
        "their GPU memory holds whatever was there until a weight update rewrites every parameter")


def released_message() -> str:
    """Why a generation request is refused while GPU memory is released (logged: SGLang's abort carries no text)."""
    tags = ", ".join(sorted(engine_state().released))
    return (f"[fp8rl] refusing to serve: the engine's GPU memory is released ({tags}); resume it first "
            "(/resume_memory_occupation)")


def served_runner(manager: Any) -> Any:
    """The ModelRunner of the scheduler object that answered (a manager from 0.5.15, the Scheduler before)."""
    return manager.tp_worker.model_runner


def weights_lost(manager: Any, runner: Any) -> bool:
    """Whether a resume of the weights leaves their bytes undefined: the memory saver really released them (SGLang's
    no-op adapter, without ``--enable-memory-saver``, releases nothing) and no CPU backup restored them."""
    releases = bool(getattr(manager.memory_saver_adapter, "enabled", False))
    return releases and not getattr(runner.server_args, "enable_weights_cpu_backup", False)


def wrap_release(original: Callable) -> Callable:
    """release_memory_occupation: SGLang's release, then the tags it released recorded (whatever it raised)."""
    def release_memory_occupation(self, recv_req):
        try:
            return original(self, recv_req)
        finally:
            _guarded("recording a release of GPU memory", lambda: _released(self))

    return release_memory_occupation


def _released(manager: Any) -> None:
    if not is_attached(served_runner(manager).model):
        return
    state = engine_state()
    state.released = set(manager.offload_tags)
    logger.info("[fp8rl] GPU memory released (%s): weight updates are refused until the weights are resumed, "
                "generation until everything is", ", ".join(sorted(state.released)))


def wrap_resume(original: Callable) -> Callable:
    """resume_memory_occupation: SGLang's resume, then weights that came back without their bytes marked, and a due
    KV recalibration run once nothing is released any more."""
    def resume_memory_occupation(self, recv_req):
        before = set(engine_state().released)
        try:
            return original(self, recv_req)
        finally:
            _guarded("recording a resume of GPU memory", lambda: _resumed(self, before))

    return resume_memory_occupation


def _resumed(manager: Any, before: set[str]) -> None:
    runner = served_runner(manager)
    if not is_attached(runner.model):
        return
    state = engine_state()
    state.released = set(manager.offload_tags)
    if WEIGHTS in before - state.released:
        if weights_lost(manager, runner):
            state.mark_dirty((), LOST)
            logger.warning("[fp8rl] %s; the engine refuses to serve until then", LOST)
        else:
            logger.info("[fp8rl] weights resumed with their bytes (CPU backup, or nothing was released)")
    if not state.released:
        recalibrate_if_due(manager)


def _guarded(what: str, call: Callable[[], None]) -> None:
    """Run our part after SGLang's method; nothing may escape into SGLang's scheduler loop."""
    try:
        call()
    except Exception:  # noqa: BLE001 - the boundary to SGLang's scheduler: nothing may escape
        logger.exception("[fp8rl] %s failed", what)
