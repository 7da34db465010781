"""The engine's consistency: update counts, the last update's stats, and the tensors a failed write left dirty.

A failure *after* writing started cannot come from the request's content (it was validated); it is a device error,
and the names it was writing stay *dirty*: the engine is inconsistent, and refuses to serve, until later successful
updates have re-sent every dirty tensor (or a full disk update succeeds). A failure whose tensors are unknown, and
weights that came back from SGLang's memory saver without a CPU backup (hooks/memory.py), mark :data:`EVERYTHING`: it
goes when a full disk update succeeds, or when the writes since it was marked have reached every parameter on every TP
rank (:meth:`EngineState.mark_written`). The one :class:`EngineState` of this process is ``OWNERS.engine_state``
(:mod:`sglang_fp8rl.engine`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from sglang_fp8rl.engine import OWNERS, declare
from sglang_fp8rl.parallel import Verdict, agree
from sglang_fp8rl.weight_sync.request import Destinations, Unwritten

if TYPE_CHECKING:  # telemetry imports this module
    from sglang_fp8rl.weight_sync.telemetry import UpdateStats

logger = logging.getLogger(__name__)

EVERYTHING = "*"  # dirty marker of a failure whose tensors are unknown: only a full update clears it


@dataclasses.dataclass
class EngineState:
    """Per-process update state: counts, the last update's stats, and the tensors a failed write left dirty."""

    updates: int = 0
    writes: int = 0  # requests whose writing started
    last: Optional[UpdateStats] = None
    dirty: set[str] = dataclasses.field(default_factory=set)
    inconsistent_reason: str = ""
    released: set[str] = dataclasses.field(default_factory=set)  # SGLang's memory-saver tags released now
    # while EVERYTHING is marked: what no successful write has reached since (None: nothing written since)
    unwritten: Optional[Unwritten] = None

    @property
    def consistent(self) -> bool:
        """Whether every weight comes from one complete update (nothing left dirty by a failed write)."""
        return not self.dirty

    def mark_dirty(self, names: Iterable[str], reason: str) -> None:
        """A write failed part-way over ``names`` (EVERYTHING when unknown)."""
        names = tuple(names) or (EVERYTHING,)
        if EVERYTHING in names:
            self.unwritten = None  # only writes from now on can replace what it lost
        self.dirty.update(names)
        self.inconsistent_reason = reason

    def mark_written(self, names: Iterable[str], full: bool = False, agreed: bool = True) -> None:
        """``names`` were written completely; ``full``: every weight of the model was. ``agreed``: every TP rank makes
        this call at this point (the guard's and the step's calls, after their agreement): while EVERYTHING is marked,
        the ranks then agree whether each one's writes since the mark reached all its parameters (one exchange over
        the CPU group), and if so it goes."""
        if full:
            self.dirty.clear()
        else:
            self.dirty.difference_update(names)
        if agreed and EVERYTHING in self.dirty:
            self._clear_if_rewritten()
        if EVERYTHING not in self.dirty:
            self.unwritten = None
        if not self.dirty:
            self.inconsistent_reason = ""

    def note_written(self, model: torch.nn.Module, destinations: Optional[Destinations]) -> None:
        """A request was written on this rank at ``destinations``: while EVERYTHING is marked, count what it
        reached."""
        if EVERYTHING not in self.dirty or destinations is None:
            return
        if self.unwritten is None:
            self.unwritten = Unwritten(model)
        self.unwritten.reached(destinations)

    def _clear_if_rewritten(self) -> None:
        local = self.unwritten is not None and self.unwritten.empty
        # the same decision on every rank: a rank that judged alone could serve while another refuses (EP places
        # experts on one rank, so one rank's writes can be complete before another's)
        if not agree(Verdict(local)).ok:
            return
        self.dirty.discard(EVERYTHING)
        logger.info("[fp8rl] every parameter was rewritten since the engine lost track of its weights (%s)",
                    self.inconsistent_reason)

    def unwritten_summary(self) -> str:
        """How much of the model no write has reached since EVERYTHING was marked (for messages)."""
        if self.unwritten is None:
            return "all of them (nothing written yet)"
        return f"{self.unwritten.rows_left} FP8 weight rows and {len(self.unwritten.plain)} other parameters"


declare("engine_state", EngineState)


def engine_state() -> EngineState:
    """This process's update state (the scheduler process on a server): ``OWNERS.engine_state``."""
    return OWNERS.engine_state
