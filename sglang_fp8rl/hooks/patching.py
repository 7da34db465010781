"""The one way this package patches an SGLang method: wrap it once, keep its metadata, leave a mark."""

from __future__ import annotations

import functools
from typing import Any, Callable

_MARK = "_fp8rl_patched"


def patch(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)`` unless it is already ours (idempotent)."""
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)
