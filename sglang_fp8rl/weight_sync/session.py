"""Trainer side: one step inside SGLang's weight-update session where the engine has sessions (SGLang 0.5.21+).

From 0.5.21, SGLang answers ``update_weights_from_tensor`` and ``update_weights_from_distributed`` with
``success=False`` unless they run between ``/begin_weight_update`` and ``/end_weight_update``. The client opens a
session around each step, and closes it even when a bucket is refused or the trainer raises. An engine without
sessions (404 on the route, or an ``sglang.Engine`` without the method) is driven as before. ``end_weight_update`` is
the step boundary on the engine: it commits the step (KV-scale recalibration included).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from sglang_fp8rl.compat.updates import engine_session_call
from sglang_fp8rl.weight_sync.errors import WeightPushError
from sglang_fp8rl.weight_sync.protocol import ANSWER_MARK

logger = logging.getLogger(__name__)

BEGIN, END = "begin_weight_update", "end_weight_update"
ALREADY_OPEN = "already open"  # SGLang's refusal of a second begin (scheduler_components/weight_updater.py)


class SessionError(WeightPushError):
    """The engine refused to open or close a weight-update session."""


def _call(target: Any, route: str, timeout: float) -> tuple[bool, str] | None:
    """(success, message) of a session call; None when the engine has no such route or method."""
    if isinstance(target, str):
        import requests

        response = requests.post(f"{target.rstrip('/')}/{route}", json={}, timeout=timeout)
        if response.status_code == 404:
            return None
        try:
            body = response.json()
        except ValueError:
            raise SessionError(f"/{route} answered HTTP {response.status_code}: {response.text[:2000]}") from None
        return bool(body.get("success")), str(body.get("message", ""))
    method = engine_session_call(target, route)
    if method is None:
        return None
    answer = method()
    if isinstance(answer, dict):
        return bool(answer.get("success")), str(answer.get("message", ""))
    return bool(answer[0]), str(answer[1])


def begin(target: Any, timeout: float) -> bool:
    """Open a session; False when the engine has none. A session left open by a trainer that died mid-step is closed
    first: the engine drops what that step left (held FP8 halves; an unfinished step's tensors stay dirty until this
    step rewrites them) and says so, which is logged; then the session opens, so one crash does not refuse every
    later step."""
    answer = _call(target, BEGIN, timeout)
    if answer is None:
        return False
    ok, message = answer
    if not ok and ALREADY_OPEN in message:
        closed = _call(target, END, timeout)
        logger.warning("[fp8rl] a weight-update session was left open (a previous step did not finish): closed it; "
                       "the engine answered: %s", closed[1] if closed and closed[1] else "success")
        ok, message = _call(target, BEGIN, timeout) or (False, "the engine stopped answering /begin_weight_update")
    if not ok:
        raise SessionError(f"/{BEGIN} refused: {message}")
    if message and ANSWER_MARK in message:  # the engine abandoned a step left open: what it dropped
        logger.warning("[fp8rl] /%s: %s", BEGIN, message)
    return True


def end(target: Any, timeout: float) -> None:
    """Close the session (the engine commits the step)."""
    answer = _call(target, END, timeout)
    if answer is not None and not answer[0]:
        raise SessionError(f"/{END} refused: {answer[1]}")


@contextlib.contextmanager
def step_session(target: Any, timeout: float) -> Iterator[bool]:
    """A weight-update session around the body where the engine has sessions (yields whether it has); closed on any
    exit. A failure to close after a failed body is logged, so the body's error is the one raised."""
    opened = begin(target, timeout)
    try:
        yield opened
    except BaseException:  # a dead trainer's KeyboardInterrupt too: the engine must not keep the session open
        if opened:
            try:
                end(target, timeout)
            except Exception as e:  # noqa: BLE001 - the step's own error matters more; this one is logged
                logger.error("[fp8rl] closing the weight-update session after a failed step failed too: %s", e)
        raise
    if opened:
        end(target, timeout)
