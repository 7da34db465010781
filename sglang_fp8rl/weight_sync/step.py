"""One trainer step on the engine, as one object with explicit transitions: the one owner of a step's state.

::

    IDLE --begin--> OPEN --validated* / applied* / refused* / write_failed*--> OPEN --end / abandon--> IDLE

* **begin**: SGLang's ``begin_weight_update`` (0.5.21+, a *session*), else the first request after the last end. A
  session's begin while another step is open abandons that step.
* **requests**: each one is validate-only (the validation round of an all-or-nothing step: the step is then
  *atomic*, and the names it validated are its *extent*), applied (its tensors were written), refused (nothing of it
  written) or failed while writing (a device error: part of it written).
* **end**: SGLang's ``end_weight_update`` (0.5.21+), else a request carrying the step-complete marker, a disk update
  that rewrote every parameter, a checkpoint-engine IPC update (one call per step), or an explicit ``/flush_cache``
  answered after applied requests (verl's end of a weight sync: no marker, no session; :attr:`UpdateStep
  .ends_on_flush`). A marker inside a session is noted and the step ends with the session.
* **abandon**: a new step starts while this one is open: a validate-only request after this step's apply round began
  (the client's next all-or-nothing push), or a session's begin. Whatever this step left is dropped or marked.
* **held halves**: an FP8 weight and its scale may come in different requests of a step (verl's buckets split them).
  An applied request leaves the half whose partner has not come yet with the step (a copy, at most
  :data:`MAX_HELD_BYTES` in all); the request that brings the partner writes the pair; a later tensor of the same
  weight (BF16, a whole pair, the same half again) supersedes it. Validate-only requests must carry whole pairs, and
  a request that ends the step (the marker) is refused, before any of it is written, if a half would stay held.
  Halves still held when a step ends or is abandoned are dropped (their weights keep their old values) and named.

**Consistency** (what the :class:`Commit` tells the caller to mark; the engine serves only while nothing is dirty):
a step that declared its extent (atomic, or a session) is complete only if it was never refused or failed after a
write, wrote every name it validated and left no half: then its end clears the dirty marks of what it wrote. Any
other end of such a step, and its abandonment, marks everything it wrote dirty; a refusal or failed write after a
write marks them at once, every time (cumulative: a later partial step never hides an earlier one). A plain step
(neither atomic nor a session: verl 0.9.1, custom loops) has no extent: each written request counts as complete
(cleared when written); a half dropped after such a step wrote anything leaves its weight dirty.

Every TP rank sees the same requests and (through the guard's agreement) the same verdicts, so every rank's step
makes the same transitions. Queries (``describe``, ``pairing``, the properties) never change state.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Iterable, Optional

import torch

from sglang_fp8rl.engine import OWNERS, declare
from sglang_fp8rl.kv_scales.engine import mark_calibrated, mark_due
from sglang_fp8rl.kv_scales.layers import attention_layers
from sglang_fp8rl.weight_sync.engine_state import engine_state
from sglang_fp8rl.weight_sync.fp8_payload import Pairing, complete_pairs, partner_name, weight_of, without_partners
from sglang_fp8rl.weight_sync.validate import NamedTensors, UpdateRejected, request_bytes

# the most bytes of FP8 halves a step holds for their partners (one bucket-split pair is one weight's codes: tens of
# MB for an 8B model; a trainer that splits every pair is sending scales and codes in separate steps)
MAX_HELD_BYTES = 1 << 30
NAMES_SHOWN = 3  # names a message lists before "... and N more"

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where a step is."""

    IDLE = "idle"
    OPEN = "open"


def some_names(names: Iterable[str]) -> str:
    """A few names for a message, and how many more."""
    names = sorted(names)
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


@dataclasses.dataclass(frozen=True)
class Commit:
    """What ending (or abandoning) a step decides, applied once by the caller (:func:`apply_commit`)."""

    index: int
    recalibrate: bool  # a KV-scale recalibration is due
    unpaired: tuple[str, ...] = ()  # held halves whose partner never came: dropped
    clean: tuple[str, ...] = ()  # a complete step rewrote these: their dirty marks go
    dirty: tuple[str, ...] = ()  # the step did not complete: these hold a mix until a complete step rewrites them
    incomplete: str = ""  # why the step is not complete ("" when it is)
    abandoned: bool = False  # a new step started while this one was open

    @property
    def unpaired_weights(self) -> tuple[str, ...]:
        """The weights of the unpaired halves (never written in this step)."""
        return tuple(sorted({weight_of(name) for name in self.unpaired}))

    def unpaired_message(self) -> str:
        """Each unpaired half with the partner it waited for."""
        return without_partners(self.unpaired)


@dataclasses.dataclass
class UpdateStep:
    """The current step (see the module doc). ``index`` counts steps ended or abandoned in this process."""

    index: int = 0
    phase: Phase = Phase.IDLE
    session: bool = False  # opened by SGLang's begin_weight_update: only its end ends the step
    atomic: bool = False  # a validate-only request ran in this step
    applying: bool = False  # a request of the apply round arrived (applied, refused or failed)
    requests: int = 0
    validated_names: set[str] = dataclasses.field(default_factory=set)  # an atomic step's extent
    written: set[str] = dataclasses.field(default_factory=set)
    broken: str = ""  # the first refusal or failed write after a write in a step with an extent
    trainer_kv_layers: set[int] = dataclasses.field(default_factory=set)
    complete_requested: bool = False  # a step-complete marker arrived inside a session
    held: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # FP8 halves awaiting their partner

    # -- queries ------------------------------------------------------------------------------------------------------

    @property
    def open(self) -> bool:
        """Whether a step is in progress."""
        return self.phase is Phase.OPEN

    @property
    def declared(self) -> bool:
        """Whether the step declared its extent (atomic, or a session): only its complete end clears dirty marks."""
        return self.atomic or self.session

    @property
    def held_bytes(self) -> int:
        """Bytes of the halves held for their partners."""
        return request_bytes(list(self.held.items()))

    @property
    def ends_on_flush(self) -> bool:
        """Whether an explicit cache flush ends this step: open, outside a session, with weights written, not
        all-or-nothing (its applying round may still come) and holding no FP8 half for its partner."""
        return self.open and not self.session and not self.atomic and bool(self.written) and not self.held

    def starts_new_step(self, validate_only: bool) -> bool:
        """Whether a request abandons this step and opens the next: a validate-only request after the apply round
        of this step began (the next all-or-nothing push)."""
        return validate_only and self.open and (self.applying or bool(self.broken))

    def missing(self) -> set[str]:
        """Names this atomic step validated but has not written."""
        return self.validated_names - self.written

    def pairing(self, named: NamedTensors, validate_only: bool = False, ends_step: bool = False) -> Pairing:
        """A request matched with the halves held (a query: what applying it would hold, take or supersede);
        UpdateRejected when it would hold halves in a validate-only request, leave any held at the step's end, or
        hold more than :data:`MAX_HELD_BYTES`. A request that starts a new step sees no held half (they are
        dropped with the old step)."""
        held = {} if self.starts_new_step(validate_only) else self.held
        pairing = complete_pairs(named, held)
        left = sorted(set(held) - set(pairing.taken) - set(pairing.superseded) | set(pairing.hold))
        if ends_step and left:
            raise UpdateRejected("this request ends the step, but FP8 halves would stay without their partner: "
                                 + without_partners(left))
        if not pairing.hold:
            return pairing
        first = sorted(pairing.hold)[0]
        if validate_only:
            raise UpdateRejected(f"{first}: an all-or-nothing (validate-only) request must carry "
                                 f"{partner_name(first)} too (split pairs are taken only in applied requests)")
        kept = request_bytes([(n, t) for n, t in held.items() if n not in pairing.taken + pairing.superseded])
        extra = request_bytes(list(pairing.hold.items()))
        if kept + extra > MAX_HELD_BYTES:
            raise UpdateRejected(f"{first}: waiting for {partner_name(first)} would hold {kept + extra:,} "
                                 f"bytes of FP8 halves in this step, more than {MAX_HELD_BYTES:,}; send each weight "
                                 "with its scale")
        return pairing

    def describe(self) -> dict[str, Any]:
        """Telemetry for /get_server_info (a query: changes nothing)."""
        return {"steps_ended": self.index, "phase": self.phase.value, "session": self.session, "atomic": self.atomic,
                "requests": self.requests, "written": len(self.written), "validated": len(self.validated_names),
                "broken": self.broken, "trainer_kv_layers": len(self.trainer_kv_layers),
                "held_halves": sorted(self.held), "held_bytes": self.held_bytes}

    # -- transitions --------------------------------------------------------------------------------------------------

    def begin(self, session: bool = False) -> Optional[Commit]:
        """Open a step (a session's begin, or the first request after an end). A session's begin while a step is open
        abandons that step first and returns its commit."""
        abandoned = self.abandon() if session and self.open else None
        self.phase = Phase.OPEN
        self.session = self.session or session
        return abandoned

    def validated(self, names: Iterable[str] = ()) -> Optional[Commit]:
        """A validate-only request passed: the step is atomic and ``names`` join its extent. Returns the commit of
        the step it abandoned, if it started a new one."""
        abandoned = self._next_round()
        self.validated_names.update(names)
        return abandoned

    def validation_refused(self) -> Optional[Commit]:
        """A validate-only request was refused (nothing written). Returns the commit of the step it abandoned."""
        return self._next_round()

    def _next_round(self) -> Optional[Commit]:
        abandoned = self.abandon() if self.starts_new_step(True) else None
        self.begin()
        self.requests += 1
        self.atomic = True
        return abandoned

    def applied(self, names: Iterable[str], kv_layers: Iterable[int] = (), pairing: Optional[Pairing] = None
                ) -> tuple[str, ...]:
        """A request was written in full: its tensors, the layers whose KV scales the trainer sent, and (``pairing``)
        the held halves it completed or superseded and the halves it leaves to hold (copied: the sender may reuse its
        buffers). Returns its names when the step is already broken (to mark dirty), else ()."""
        self._apply_round()
        names = tuple(names)
        self.written.update(names)
        self.trainer_kv_layers.update(kv_layers)
        if pairing is not None:
            for name in pairing.taken + pairing.superseded:
                self.held.pop(name, None)
            self.held.update({name: tensor.clone() for name, tensor in pairing.hold.items()})
        return names if self.broken else ()

    def refused(self, message: str) -> tuple[str, ...]:
        """A request of the apply round (or of a plain step) was refused, nothing of it written. In a step with an
        extent that wrote anything, the step is broken: returns every tensor written so far (to mark dirty), at
        every refusal; else ()."""
        self._apply_round()
        return self._break(message) if self.declared and self.written else ()

    def write_failed(self, names: Iterable[str], message: str) -> tuple[str, ...]:
        """A request failed after its writing started: its tensors hold a mix. Returns what is now dirty: its names,
        and in a step with an extent everything the step wrote (the step is broken)."""
        self._apply_round()
        names = tuple(names)
        if not self.declared:
            return names
        self.written.update(names)
        return self._break(message)

    def _apply_round(self) -> None:
        self.begin()
        self.requests += 1
        self.applying = True

    def _break(self, message: str) -> tuple[str, ...]:
        self.broken = self.broken or message
        return tuple(sorted(self.written))

    def end(self, num_attention_layers: int, marker: bool = False) -> Optional[Commit]:
        """End the step and return its commit; ``marker``: ended by a step-complete marker, which inside a session
        is only noted (None returned: the session's end commits)."""
        if marker and self.session:
            self.complete_requested = True
            return None
        incomplete = self._incomplete_reason()
        commit = self._commit(recalibrate=len(self.trainer_kv_layers) < num_attention_layers,
                              complete=not incomplete, incomplete=incomplete)
        self.reset(commit.index)
        return commit

    def abandon(self) -> Commit:
        """Close this step because a new one starts: nothing of it counts as complete."""
        reason = self._incomplete_reason() or "a new step started before this one ended"
        commit = self._commit(recalibrate=bool(self.written), complete=False, incomplete=reason, abandoned=True)
        self.reset(commit.index)
        return commit

    def _incomplete_reason(self) -> str:
        if self.broken:
            return f"it was refused or failed after writing: {self.broken}"
        missing = self.missing() if self.atomic else set()
        if missing:
            return (f"{len(missing)} of the {len(self.validated_names)} tensors its validation round checked were "
                    f"never written ({some_names(missing)})")
        if self.held and self.written:
            return f"FP8 halves never got their partner ({without_partners(sorted(self.held))})"
        return ""

    def _commit(self, recalibrate: bool, complete: bool, incomplete: str, abandoned: bool = False) -> Commit:
        unpaired = tuple(sorted(self.held))
        if self.declared:
            clean, dirty = (self.written, set()) if complete else (set(), self.written)
        else:  # a plain step's requests were cleared as they were written; a dropped half leaves its weight stale
            clean, dirty = set(), {weight_of(name) for name in unpaired} if self.written else set()
        return Commit(index=self.index + 1, recalibrate=recalibrate, unpaired=unpaired, clean=tuple(sorted(clean)),
                      dirty=tuple(sorted(dirty)), incomplete=incomplete, abandoned=abandoned)

    def reset(self, index: Optional[int] = None) -> None:
        """Back to IDLE with nothing recorded (``index``: the number of steps ended so far)."""
        fresh = UpdateStep(index=self.index if index is None else index)
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(fresh, field.name))


declare("step", UpdateStep)


def current_step() -> UpdateStep:
    """This process's step (the scheduler process on a server): ``OWNERS.step``."""
    return OWNERS.step


def apply_commit(commit: Optional[Commit]) -> Optional[Commit]:
    """Apply what a step's end or abandonment decided: dirty marks, the KV recalibration, one log line each."""
    if commit is None:
        return None
    state = engine_state()
    state.mark_written(commit.clean)
    if commit.dirty:
        state.mark_dirty(commit.dirty, f"weight-update step {commit.index} did not complete: {commit.incomplete}")
    how = "abandoned (a new step started)" if commit.abandoned else "ended"
    if commit.unpaired:
        logger.error("[fp8rl] step %d %s with FP8 halves whose partner never came (%s): dropped, those weights keep "
                     "their old values", commit.index, how, commit.unpaired_message())
    if commit.dirty:
        logger.error("[fp8rl] step %d %s incomplete (%s): %d tensors marked dirty (%s); the engine refuses to serve "
                     "until a complete step rewrites them", commit.index, how, commit.incomplete, len(commit.dirty),
                     some_names(commit.dirty))
    if commit.recalibrate:
        mark_due()
    elif not commit.abandoned:  # the trainer's scales are the newest: they supersede a recalibration still due
        mark_calibrated()
        logger.info("[fp8rl] step %d: the trainer supplied every layer's KV scales; no recalibration", commit.index)
    return commit


def end_step(model: torch.nn.Module, marker: bool = False) -> Optional[Commit]:
    """End this process's step and apply its commit (a KV recalibration due unless the trainer sent every layer's
    scales, which then also cancel one still due); None when a marker arrived inside a session (its end commits)."""
    return apply_commit(current_step().end(len(attention_layers(model)), marker=marker))
