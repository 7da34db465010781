"""The trainer's side of sglang-fp8rl, and its contract: the names in ``__all__`` are what an RL trainer calls to push
its weights into an SGLang engine served with `--quantization fp8_online_blockwise` (``push_state_dict``,
``push_distributed`` after ``init_update_group``, ``push_from_disk``), to ask for a KV-scale recalibration
(``recalibrate_kv_scales``), to hold one weight-update session around a step of its own (``step_session``), and the
errors it gets back (``WeightPushError``, and ``SessionError`` for a session the engine refused). A trainer imports
them from here (``from sglang_fp8rl.trainer import push_state_dict``); the modules behind them
(``sglang_fp8rl.weight_sync``) are the implementation. Importing this package loads no SGLang module and nothing of the
engine side (hooks, layers, KV scales); the wire names both sides share are in
:mod:`sglang_fp8rl.weight_sync.protocol`."""

from sglang_fp8rl.weight_sync.client import (
    init_update_group,
    push_distributed,
    push_from_disk,
    push_state_dict,
    recalibrate_kv_scales,
)
from sglang_fp8rl.weight_sync.errors import WeightPushError
from sglang_fp8rl.weight_sync.session import SessionError, step_session

__all__ = [
    "push_state_dict",
    "push_distributed",
    "push_from_disk",
    "init_update_group",
    "recalibrate_kv_scales",
    "step_session",
    "WeightPushError",
    "SessionError",
]
