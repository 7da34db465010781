"""Engine side of a weight update: the engine's update state, the write of a validated request, and the guard on
``model.load_weights`` for callers that bypass the entry points.

Writing: the model's own ``load_weights`` runs on the validated tensors, and its FP8 loaders re-quantize in place into
the existing storage (CUDA: the quantizers skip their NaN/Inf pre-read and raise one device flag, checked once).
A failure *after* writing started cannot come from the request's content (it was validated); it is a device error,
reported as :class:`PartialUpdateError`, and the names it was writing stay *dirty*: the engine is inconsistent, and
refuses to serve, until later successful updates have re-sent every dirty tensor (or a full disk update succeeds).
A failure whose tensors are unknown, and weights that came back from SGLang's memory saver without a CPU backup
(hooks/memory.py), mark :data:`EVERYTHING`: it goes when a full disk update succeeds, or when the writes since it was
marked have reached every parameter on every TP rank (:meth:`EngineState.mark_written`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from sglang_fp8rl.kernels.dispatch import check_nonfinite_flag
from sglang_fp8rl.layers.fp8_storage import copy_pairs, layer_state, prevalidated_writes, write_planned
from sglang_fp8rl.parallel import Verdict, agree
from sglang_fp8rl.weight_sync.fp8_payload import attach_scales, pair_stream
from sglang_fp8rl.weight_sync.request import Destinations, Unwritten, Validated, validate_request
from sglang_fp8rl.weight_sync.validate import NamedTensors, UpdateRejected, request_bytes

logger = logging.getLogger(__name__)

EVERYTHING = "*"  # dirty marker of a failure whose tensors are unknown: only a full update clears it
WRITE_ERRORS = (RuntimeError, ValueError, AssertionError, TypeError, IndexError, KeyError, torch.cuda.OutOfMemoryError)


class PartialUpdateError(RuntimeError):
    """A weight update failed after writing started: the engine holds a mix of old and new weights."""


# ---------------------------------------------------------------------------------------------------------------------
# telemetry and engine state


@dataclasses.dataclass
class UpdateStats:
    """What the last update did (readable from Python and, via the scheduler's internal state, over HTTP)."""

    index: int
    ok: bool = False
    message: str = ""
    source: str = ""
    tensors: int = 0
    bytes: int = 0
    ignored: list[str] = dataclasses.field(default_factory=list)
    validate_s: float = 0.0
    apply_s: float = 0.0
    fp8_layers_written: dict[str, int] = dataclasses.field(default_factory=dict)
    bf16_params_written: int = 0
    replayed_tensors: int = 0  # written at their dry-run placement, without the model's load_weights
    peak_extra_bytes: Optional[int] = None  # CUDA: peak allocated during validate+apply minus allocated before

    def count(self, named_tensors: NamedTensors) -> None:
        """Record the request's size."""
        self.tensors = len(named_tensors)
        self.bytes = request_bytes(named_tensors)

    def add(self, validated: Validated) -> None:
        """Record what a validated request will write."""
        self.ignored += validated.ignored
        for scheme, n in validated.fp8_layers.items():
            self.fp8_layers_written[scheme] = self.fp8_layers_written.get(scheme, 0) + n
        self.bf16_params_written += validated.plain_params
        self.replayed_tensors += len(validated.replayed) + len(validated.copied)

    def summary(self) -> str:
        """The one log line of an update."""
        if not self.ok:
            return f"[fp8rl] weight update #{self.index} ({self.source}) REJECTED: {self.message}"
        layers = ", ".join(f"{k}={v}" for k, v in sorted(self.fp8_layers_written.items())) or "none"
        return (
            f"[fp8rl] weight update #{self.index} ({self.source}): {self.tensors} tensors, "
            f"{self.bytes / 2**20:.1f} MiB, validate {self.validate_s * 1e3:.1f} ms, "
            f"quantize+write {self.apply_s * 1e3:.1f} ms; FP8 layers re-quantized: {layers}; "
            f"BF16 params written: {self.bf16_params_written}; replayed without load_weights: "
            f"{self.replayed_tensors}"
            + (f"; peak extra GPU memory {self.peak_extra_bytes / 2**20:.1f} MiB" if self.peak_extra_bytes is not None
               else "")
            + (f"; ignored: {self.ignored}" if self.ignored else "")
        )


@dataclasses.dataclass
class EngineState:
    """Per-process update state: counts, the last update's stats, and the tensors a failed write left dirty."""

    updates: int = 0
    writes: int = 0  # requests whose writing started
    last: Optional[UpdateStats] = None
    dirty: set[str] = dataclasses.field(default_factory=set)
    inconsistent_reason: str = ""
    flush_due: bool = False  # an update's cache flush was refused while requests ran: flushed when idle
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


_STATE = EngineState()


def engine_state() -> EngineState:
    """This process's update state (the scheduler process on a server)."""
    return _STATE


def new_stats(source: str) -> UpdateStats:
    """Stats of a new update request (numbered in this process)."""
    _STATE.updates += 1
    return UpdateStats(index=_STATE.updates, source=source)


def record(stats: UpdateStats) -> None:
    """Remember and log the outcome of an update."""
    _STATE.last = stats
    (logger.info if stats.ok else logger.warning)("%s", stats.summary())


def last_update_stats() -> Optional[dict[str, Any]]:
    """The last update's stats as a dict, or None if no update happened in this process."""
    return dataclasses.asdict(_STATE.last) if _STATE.last else None


# ---------------------------------------------------------------------------------------------------------------------
# writing


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (CPU for a model without any)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def apply_validated(model: torch.nn.Module, load_weights: Callable, validated: Validated) -> None:
    """Write a validated request in place: the replayed FP8 writes first (grouped launches), then the rest through
    the model's load_weights; errors propagate (the caller knows writing has started)."""
    device = model_device(model)
    _STATE.writes += 1
    states = [state for state in map(layer_state, model.modules()) if state is not None]
    with prevalidated_writes(states, device) as flag:
        write_planned(list(validated.incoming_writes()))
        copy_pairs([(param.data, tensor) for param, tensor in validated.plain_copies()])  # SGLang's default loader
        if validated.to_load:
            load_weights(list(validated.to_load))
    if flag is not None:
        check_nonfinite_flag(flag, validated.named_tensors())  # cannot trip after validation; defence in depth
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _STATE.note_written(model, validated.destinations)


@contextlib.contextmanager
def peak_memory(stats: UpdateStats, device: torch.device) -> Iterator[None]:
    """On CUDA, record the peak extra memory allocated inside the block into ``stats``."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        yield
    finally:
        stats.peak_extra_bytes = torch.cuda.max_memory_allocated(device) - before


# ---------------------------------------------------------------------------------------------------------------------
# the guard on model.load_weights

@contextlib.contextmanager
def validated_stream(model: torch.nn.Module) -> Iterator[None]:
    """Inside this block, the model's guarded ``load_weights`` streams its input straight through: the caller (the
    disk path's second pass) validated all of it beforehand."""
    guard = model.__dict__["load_weights"]
    guard.streaming_validated = True
    try:
        yield
    finally:
        guard.streaming_validated = False


class GuardedLoadWeights:
    """Replacement for ``model.load_weights`` once the model is loaded.

    SGLang's update entry points validate and write through :mod:`sglang_fp8rl.weight_sync.guard`; this guard is
    for everything else that calls ``load_weights`` (checkpoint-engine IPC, user code): the request is collected,
    validated and written here, rank-locally, raising :class:`UpdateRejected` or :class:`PartialUpdateError`."""

    def __init__(self, model: torch.nn.Module, original: Callable):
        self.model = model
        self.original = original
        self.streaming_validated = False  # set by validated_stream() around a pass it validated itself

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        if self.streaming_validated:
            return self.original(pair_stream(weights))
        return self.update(list(weights))

    def update(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Validate, then write one request (rank-local)."""
        stats = new_stats("load_weights")
        stats.count(named_tensors)
        try:
            validated = validate_request(self.model, self.original, attach_scales(named_tensors))
        except UpdateRejected as e:
            stats.message = str(e)
            record(stats)
            raise
        stats.add(validated)
        names = validated.names
        try:
            apply_validated(self.model, self.original, validated)
        except WRITE_ERRORS as e:
            reason = f"update #{stats.index} failed after writing started: {type(e).__name__}: {e}"
            _STATE.mark_dirty(names, reason)
            stats.message = reason
            record(stats)
            raise PartialUpdateError(f"{reason}. The engine holds a mix of old and new weights; "
                                     "re-send those tensors before serving again.") from e
        _STATE.mark_written(names, agreed=False)  # rank-local: the caller's agreement comes after (guard)
        stats.ok, stats.message = True, "ok"
        record(stats)


def is_attached(model: torch.nn.Module) -> bool:
    """Whether the model's load_weights is guarded."""
    return isinstance(model.__dict__.get("load_weights"), GuardedLoadWeights)


def original_load_weights(model: torch.nn.Module) -> Callable:
    """The model's own load_weights, behind our guard."""
    guard = model.__dict__.get("load_weights")
    return guard.original if isinstance(guard, GuardedLoadWeights) else model.load_weights


def attach(model: torch.nn.Module) -> bool:
    """Guard ``model.load_weights`` if the model has layers quantized by this package; returns whether it did."""
    if is_attached(model):
        return True
    if not any(layer_state(m) is not None for m in model.modules()):
        return False
    model.load_weights = GuardedLoadWeights(model, model.load_weights)
    return True
