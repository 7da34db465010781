"""``TokenizerManager`` patch (the HTTP process): ``/health`` reports 503 while the engine is inconsistent.

SGLang's ``/health`` generates one token and calls the server healthy as soon as *any* output arrives; while the
engine refuses to serve, the refusals themselves are outputs. So the HTTP process reads each weight-update answer:
one that says the engine is inconsistent (:data:`sglang_fp8rl.weight_sync.protocol.INCONSISTENT_MARK`) puts the server
status back to ``Starting`` (``/health``: 503 at once); the first answer that does not brings it back ``Up``.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_fp8rl.weight_sync.protocol import INCONSISTENT_MARK

UPDATE_METHODS = ("update_weights_from_tensor", "update_weights_from_distributed", "update_weights_from_disk",
                  "update_weights_from_ipc")
_HELD = "_fp8rl_health_held"


def follow_answer(manager: Any, answer: Any) -> None:
    """Hold the server status at Starting while update answers say the engine is inconsistent."""
    from sglang.srt.managers.tokenizer_manager import ServerStatus  # heavy; only the HTTP process gets here

    message = answer[1] if isinstance(answer, tuple) and len(answer) > 1 else ""
    if INCONSISTENT_MARK in str(message):
        manager.server_status = ServerStatus.Starting
        setattr(manager, _HELD, True)
    elif getattr(manager, _HELD, False):
        manager.server_status = ServerStatus.Up
        setattr(manager, _HELD, False)


def wrap_update_answer(original: Callable) -> Callable:
    """An async TokenizerManager update method, followed by :func:`follow_answer`."""
    async def update(self, *args, **kwargs):
        answer = await original(self, *args, **kwargs)
        follow_answer(self, answer)
        return answer

    return update
