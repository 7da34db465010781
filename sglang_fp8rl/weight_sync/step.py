"""One trainer step on the engine, as one object with explicit transitions: the one owner of a step's state.

::

    IDLE --begin--> OPEN --validated* / applied* / refused*--> OPEN --end--> IDLE   (end returns the step's Commit)

* **begin**: SGLang's ``begin_weight_update`` (0.5.21+, a *session*), else the first request after the last end.
* **requests**: each one is validate-only (the first round of an all-or-nothing step: the step is then *atomic*),
  applied (its tensors were written) or refused (nothing of it was written).
* **end**: SGLang's ``end_weight_update`` (0.5.21+), else a request carrying the step-complete marker, a disk update
  that rewrote every parameter, a checkpoint-engine IPC update (one call per step), or an explicit ``/flush_cache``
  answered after applied requests (verl's end of a weight sync: no marker, no session; :attr:`UpdateStep
  .ends_on_flush`). A marker inside a session is noted and the step ends with the session.
* **held halves**: an FP8 weight and its scale may come in different requests of a step (verl's buckets split them).
  An applied request leaves the half whose partner has not come yet with the step (a copy, at most
  :data:`MAX_HELD_BYTES` in all; a request that would hold more is refused); the request that brings the partner
  writes the pair. Validate-only requests must carry whole pairs, and a request that ends the step (the marker) is
  refused, before any of it is written, if a half would stay without its partner.
* **commit** (what :meth:`UpdateStep.end` returns, applied by the caller): a KV-scale recalibration becomes due
  unless the trainer sent every attention layer's scales during the step; halves still held when a session ends are
  *unpaired*: dropped, their weights never written (old values kept), and the end is answered as refused, naming
  each half and its partner.
* **broken**: in an atomic step, a request refused after another was written (:meth:`UpdateStep.refused` says so at
  once, with the tensors written so far): the engine holds a mix of two policies, and the caller marks those tensors
  *dirty* (the engine refuses to serve until they are re-sent). A trainer that stops after a refusal never ends the
  step, so this cannot wait for the end.

Every TP rank sees the same requests and (through the guard's agreement) the same verdicts, so every rank's step
makes the same transitions. Queries (``describe``, the properties) never change state.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Iterable, Optional

import torch

from sglang_fp8rl.kv_scales.engine import mark_calibrated, mark_due
from sglang_fp8rl.kv_scales.layers import attention_layers
from sglang_fp8rl.weight_sync.fp8_payload import Pairing, complete_pairs, partner_name, weight_of, without_partners
from sglang_fp8rl.weight_sync.validate import NamedTensors, UpdateRejected, request_bytes

# the most bytes of FP8 halves a step holds for their partners (one bucket-split pair is one weight's codes: tens of
# MB for an 8B model; a trainer that splits every pair is sending scales and codes in separate steps)
MAX_HELD_BYTES = 1 << 30

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where a step is."""

    IDLE = "idle"
    OPEN = "open"


@dataclasses.dataclass(frozen=True)
class Commit:
    """What ending a step decides (applied once by the caller)."""

    index: int
    recalibrate: bool  # a KV-scale recalibration is due
    unpaired: tuple[str, ...] = ()  # held halves whose partner never came

    @property
    def unpaired_weights(self) -> tuple[str, ...]:
        """The weights of the unpaired halves (never written in this step)."""
        return tuple(sorted({weight_of(name) for name in self.unpaired}))

    def unpaired_message(self) -> str:
        """Each unpaired half with the partner it waited for."""
        return without_partners(self.unpaired)


@dataclasses.dataclass
class UpdateStep:
    """The current step (see the module doc). ``index`` counts steps ended in this process."""

    index: int = 0
    phase: Phase = Phase.IDLE
    session: bool = False  # opened by SGLang's begin_weight_update: only its end ends the step
    atomic: bool = False  # a validate-only request ran in this step
    requests: int = 0
    written: set[str] = dataclasses.field(default_factory=set)
    broken: str = ""  # an atomic step's first refusal after a write: the step is half applied
    trainer_kv_layers: set[int] = dataclasses.field(default_factory=set)
    complete_requested: bool = False  # a step-complete marker arrived inside a session
    held: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # FP8 halves awaiting their partner

    @property
    def held_bytes(self) -> int:
        """Bytes of the halves held for their partners."""
        return request_bytes(list(self.held.items()))

    def pairing(self, named: NamedTensors, validate_only: bool = False, ends_step: bool = False) -> Pairing:
        """A request matched with the halves held (a query: what applying it would hold or take); UpdateRejected
        when it would hold halves in a validate-only request, leave any held at the step's end, or hold more than
        :data:`MAX_HELD_BYTES`."""
        pairing = complete_pairs(named, self.held)
        left = sorted(set(self.held) - set(pairing.taken) | set(pairing.hold))
        if ends_step and left:
            raise UpdateRejected("this request ends the step, but FP8 halves would stay without their partner: "
                                 + without_partners(left))
        if not pairing.hold:
            return pairing
        first = sorted(pairing.hold)[0]
        if validate_only:
            raise UpdateRejected(f"{first}: an all-or-nothing (validate-only) request must carry "
                                 f"{partner_name(first)} too (split pairs are taken only in applied requests)")
        extra = request_bytes(list(pairing.hold.items()))
        if self.held_bytes + extra > MAX_HELD_BYTES:
            raise UpdateRejected(f"{first}: waiting for {partner_name(first)} would hold {self.held_bytes + extra:,} "
                                 f"bytes of FP8 halves in this step, more than {MAX_HELD_BYTES:,}; send each weight "
                                 "with its scale")
        return pairing

    @property
    def ends_on_flush(self) -> bool:
        """Whether an explicit cache flush ends this step: open, outside a session, with weights written, not
        all-or-nothing (its applying round may still come) and holding no FP8 half for its partner."""
        return self.open and not self.session and not self.atomic and bool(self.written) and not self.held

    @property
    def open(self) -> bool:
        """Whether a step is in progress."""
        return self.phase is Phase.OPEN

    def begin(self, session: bool = False) -> None:
        """Open a step (a session's begin, or the first request after an end). A session's begin while a step
        without a session is open ends nothing: that step's requests become part of the session's step."""
        if self.phase is Phase.IDLE:
            self.phase = Phase.OPEN
        self.session = self.session or session

    def validated(self) -> None:
        """A validate-only request passed: the step is atomic (all-or-nothing)."""
        self.begin()
        self.requests += 1
        self.atomic = True

    def applied(self, names: Iterable[str], kv_layers: Iterable[int] = (), pairing: Optional[Pairing] = None) -> None:
        """A request was written in full: its tensors, the layers whose KV scales the trainer sent, and (``pairing``)
        the held halves it completed and the halves it leaves to hold (copied: the sender may reuse its buffers)."""
        self.begin()
        self.requests += 1
        self.written.update(names)
        self.trainer_kv_layers.update(kv_layers)
        if pairing is not None:
            for name in pairing.taken:
                self.held.pop(name, None)
            self.held.update({name: tensor.clone() for name, tensor in pairing.hold.items()})

    def refused(self, message: str) -> tuple[str, ...]:
        """A request was refused (nothing of it written). In an atomic step after a write the step breaks: returns
        the tensors written so far (to mark dirty), once; else ()."""
        self.begin()
        self.requests += 1
        if not (self.atomic and self.written and not self.broken):
            return ()
        self.broken = message
        return tuple(sorted(self.written))

    def end(self, num_attention_layers: int, marker: bool = False) -> Optional[Commit]:
        """End the step and return its commit; ``marker``: ended by a step-complete marker, which inside a session
        is only noted (None returned: the session's end commits)."""
        if marker and self.session:
            self.complete_requested = True
            return None
        commit = Commit(index=self.index + 1, recalibrate=len(self.trainer_kv_layers) < num_attention_layers,
                        unpaired=tuple(sorted(self.held)))
        self.reset(commit.index)
        return commit

    def reset(self, index: Optional[int] = None) -> None:
        """Back to IDLE with nothing recorded (``index``: the number of steps ended so far)."""
        fresh = UpdateStep(index=self.index if index is None else index)
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(fresh, field.name))

    def describe(self) -> dict[str, Any]:
        """Telemetry for /get_server_info (a query: changes nothing)."""
        return {"steps_ended": self.index, "phase": self.phase.value, "session": self.session, "atomic": self.atomic,
                "requests": self.requests, "written": len(self.written), "broken": self.broken,
                "trainer_kv_layers": len(self.trainer_kv_layers), "held_halves": sorted(self.held),
                "held_bytes": self.held_bytes}


_STEP = UpdateStep()


def current_step() -> UpdateStep:
    """This process's step (the scheduler process on a server)."""
    return _STEP


def end_step(model: torch.nn.Module, marker: bool = False) -> Optional[Commit]:
    """End this process's step and apply its commit (a KV recalibration due unless the trainer sent every layer's
    scales, which then also cancel one still due); None when a marker arrived inside a session (its end commits)."""
    commit = _STEP.end(len(attention_layers(model)), marker=marker)
    if commit is None:
        return None
    if commit.unpaired:
        logger.error("[fp8rl] step %d ended with FP8 halves whose partner never came (%s): dropped, those weights keep "
                     "their old values", commit.index, commit.unpaired_message())
    if commit.recalibrate:
        mark_due()
    else:  # the trainer's scales are the newest: they also supersede a recalibration still due from an earlier step
        mark_calibrated()
        logger.info("[fp8rl] step %d: the trainer supplied every layer's KV scales; no recalibration", commit.index)
    return commit
