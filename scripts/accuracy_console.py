"""The console of scripts/accuracy_regression.py: `console()`, a stream on the original stderr that stays the terminal
while an engine's fds 1/2 point at its log, and `say()`, the timestamped progress line written to it."""

from __future__ import annotations

import os
import sys
import time

_CONSOLE = None


def console():
    """A stream on the original stderr: still the terminal while the engine's fds 1/2 point at its log."""
    global _CONSOLE
    if _CONSOLE is None:
        try:
            _CONSOLE = os.fdopen(os.dup(2), "w", buffering=1)
        except OSError:
            _CONSOLE = sys.stderr
    return _CONSOLE


def say(msg: str) -> None:
    print(f"[accuracy {time.strftime('%H:%M:%S')}] {msg}", file=console(), flush=True)
