"""Every runtime patch of SGLang, installed by the plugin in each SGLang process (idempotent).

One module per patched SGLang class: :mod:`.model_runner` (after load: guard updates, prepare GEMMs),
:mod:`.weight_updater` (every update entry point), :mod:`.scheduler` (telemetry, refusal while inconsistent).
Every patch leaves models that do not use this package untouched.
"""

from __future__ import annotations

import logging

from sglang_fp8rl.hooks import model_runner, scheduler, weight_updater
from sglang_fp8rl.hooks.patching import patch

logger = logging.getLogger(__name__)


def install_hooks() -> None:
    """Install all engine patches (idempotent)."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    patch(ModelRunner, "load_model", model_runner.wrap_load_model)
    for name in ("update_weights_from_tensor", "update_weights_from_distributed"):
        patch(WeightUpdater, name, weight_updater.wrap_update)
    patch(WeightUpdater, "_update_weights_from_flattened_bucket", weight_updater.wrap_flattened_bucket)
    patch(WeightUpdater, "update_weights_from_disk", weight_updater.wrap_update_from_disk)
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError as e:  # the scheduler module needs CUDA-only deps on some installs; telemetry is optional
        logger.warning("[fp8rl] /get_server_info telemetry unavailable: %s", e)
        return
    patch(Scheduler, "get_internal_state", scheduler.wrap_internal_state)
    patch(Scheduler, "handle_generate_request", scheduler.wrap_generate)
