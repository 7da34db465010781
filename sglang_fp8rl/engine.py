"""This process's engine-wide state: one owner object per concern, all reached through :data:`OWNERS`.

A scheduler process serves one model; what the plugin remembers between calls of SGLang lives in these owners and
nowhere else (no module keeps a state object of its own):

* ``step``: the weight-update step (:class:`~sglang_fp8rl.weight_sync.step.UpdateStep`);
* ``engine_state``: the engine's consistency: update counts, the last update's stats, tensors a failed write left
  dirty, SGLang's memory-saver tags released now (:class:`~sglang_fp8rl.weight_sync.engine_state.EngineState`);
* ``kv_scales``: the FP8 KV scales: mode, calibration batch, whether a recalibration is due, the record of the last
  scales written (:class:`~sglang_fp8rl.kv_scales.state.KVScaleState`);
* ``gemm_table``: the block-FP8 GEMM chosen per shape (:class:`~sglang_fp8rl.kernels.gemm_select.lookup.Selection`);
* ``kv_cache``: the cache hook's own: a cache flush left due, the K/V write paths logged
  (:class:`~sglang_fp8rl.hooks.kv_cache.CacheState`).

The classes live in the layers that know them; this module imports none of them (it is the lowest layer, so that
every layer may reach it). Each owning module declares its concern once, at import (:func:`declare`), and keeps a
typed accessor for its callers (``current_step()``, ``engine_state()``, ``kv_state()``, ``cache_state()``). The
scheduler's telemetry and the tests reach every owner here; :func:`reset` gives fresh ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:  # the owners' classes, for type checkers only: they live in higher layers
    from sglang_fp8rl.hooks.kv_cache import CacheState
    from sglang_fp8rl.kernels.gemm_select.lookup import Selection
    from sglang_fp8rl.kv_scales.state import KVScaleState
    from sglang_fp8rl.weight_sync.engine_state import EngineState
    from sglang_fp8rl.weight_sync.step import UpdateStep

T = TypeVar("T")


class Owners:
    """One attribute per concern (module doc), set when its module declares it."""

    step: UpdateStep
    engine_state: EngineState
    kv_scales: KVScaleState
    gemm_table: Selection
    kv_cache: CacheState


OWNERS = Owners()
_FACTORIES: dict[str, Callable[[], Any]] = {}


def declare(concern: str, factory: Callable[[], T]) -> T:
    """Make ``factory()`` this process's owner of ``concern`` (one of :class:`Owners`' attributes, declared once,
    by the module that defines its class); returns it."""
    if concern not in Owners.__annotations__:
        raise ValueError(f"{concern!r} is not a concern of sglang_fp8rl.engine.Owners")
    if concern in _FACTORIES:
        raise ValueError(f"the engine-wide concern {concern!r} is declared twice")
    _FACTORIES[concern] = factory
    owner = factory()
    setattr(OWNERS, concern, owner)
    return owner


def reset(*concerns: str) -> None:
    """Fresh owners for ``concerns``, every declared one when none is named (tests: a case that must not see what
    an earlier one left)."""
    unknown = set(concerns) - set(_FACTORIES)
    if unknown:
        raise ValueError(f"no engine-wide concern {sorted(unknown)} is declared (known: {sorted(_FACTORIES)})")
    for concern in concerns or tuple(_FACTORIES):
        setattr(OWNERS, concern, _FACTORIES[concern]())
