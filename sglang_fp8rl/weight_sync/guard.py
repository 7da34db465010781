"""The guarded update: obtain, validate, agree across TP ranks, write, agree again; answer, never raise.

Every SGLang update entry point hands this module two functions (the pipeline's, :mod:`.pipeline`): ``prepare``
(obtain the request's tensors from its transport and validate them; nothing is written) and ``write``.
:func:`run` calls them in order with a TP agreement after each (:mod:`sglang_fp8rl.parallel`), so that all ranks apply
an update or none does, and turns every outcome into SGLang's ``(success, message)`` answer:

* anything raised by ``prepare`` is a rejection, on every rank: nothing was written, the previous weights stay;
* anything raised by ``write`` (a device error: the content was validated) marks the tensors being written dirty on
  every rank: the engine is inconsistent and refuses to serve until they are re-sent.

Nothing escapes into SGLang's scheduler: an exception there would kill the engine, which costs an RL job hours.
That is why the three ``except Exception`` clauses below exist; they log the traceback and answer with the
exception's type and message.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

import torch

from sglang_fp8rl.parallel import Verdict, agree
from sglang_fp8rl.weight_sync.engine_state import engine_state
from sglang_fp8rl.weight_sync.fp8_payload import Pairing, without_partners
from sglang_fp8rl.weight_sync.protocol import ANSWER_MARK, INCONSISTENT_MARK
from sglang_fp8rl.weight_sync.request import Validated
from sglang_fp8rl.weight_sync.step import Commit, apply_commit, current_step, end_step, some_names
from sglang_fp8rl.weight_sync.telemetry import UpdateStats, measured, record
from sglang_fp8rl.weight_sync.validate import UpdateRejected

logger = logging.getLogger(__name__)

REJECTED = f"{ANSWER_MARK} update rejected, nothing was written, previous weights kept: "
HELD = "FP8 halves held for their partner: "
INCOMPLETE = f"{ANSWER_MARK} weight-update step ended incomplete: "
VALIDATED = f"{ANSWER_MARK} validated, nothing written (validate-only request)"
PARTIAL = f"{INCONSISTENT_MARK} the engine holds a mix of old and new weights and refuses to serve until the " \
          "tensors of the failed update are re-sent: "


@dataclasses.dataclass
class Prepared:
    """A validated request, ready to write: what it writes and how big it is."""

    validated: Validated
    tensors: int = 0
    bytes: int = 0
    full: bool = False  # it rewrites every weight of the model (a disk update without a name filter)
    validate_only: bool = False  # the first phase of an all-or-nothing step: answer, write nothing
    step_complete: bool = False  # the last request of a trainer step
    kv_scales: Optional[dict[int, tuple[float, float]]] = None  # trainer-supplied, written after the weights
    pairing: Optional[Pairing] = None  # FP8 halves it completes from earlier requests of the step, or leaves held


def _describe(error: BaseException, context: str = "") -> str:
    text = str(error) if isinstance(error, UpdateRejected) else f"{type(error).__name__}: {error}"
    return f"{context}: {text}" if context else text


def _prepare_verdict(prepare: Callable[[], Prepared], context: str) -> tuple[Optional[Prepared], Verdict]:
    try:
        return prepare(), Verdict(True)
    except UpdateRejected as e:
        return None, Verdict(False, _describe(e, context))
    except Exception as e:  # noqa: BLE001 - the boundary to SGLang's scheduler: nothing may escape (module doc)
        logger.exception("[fp8rl] unexpected error while preparing an update (answered as a rejection)")
        return None, Verdict(False, _describe(e, context))


def _write_verdict(write: Callable[[Prepared], None], prepared: Prepared) -> Verdict:
    try:
        write(prepared)
        return Verdict(True, wrote=True)
    except Exception as e:  # noqa: BLE001 - the boundary to SGLang's scheduler: nothing may escape (module doc)
        logger.exception("[fp8rl] error while writing a validated update")
        return Verdict(False, _describe(e), wrote=True)


def run(model: torch.nn.Module, source: str, prepare: Callable[[], Prepared], write: Callable[[Prepared], None],
        context: str = "", validate_only: bool = False) -> tuple[bool, str]:
    """One guarded update (see the module doc); returns SGLang's (success, message). ``context`` (e.g. the checkpoint
    path) prefixes the messages of errors that do not name their tensor themselves; ``validate_only``: the request
    is a validation-round request (its refusal writes nothing of any step)."""
    t0 = time.perf_counter()
    with measured(source, model) as stats:
        prepared, local = _prepare_verdict(prepare, context)
        verdict = agree(local)
        t1 = time.perf_counter()
        stats.validate_s = t1 - t0
        if prepared is not None:
            stats.tensors, stats.bytes = prepared.tensors, prepared.bytes
            stats.add(prepared.validated)
        if not verdict.ok:
            return _refused(stats, verdict.message, validate_only)
        if prepared.validate_only:
            apply_commit(current_step().validated(prepared.validated.names))
            stats.ok, stats.message = True, VALIDATED
            record(stats)
            return True, with_state(VALIDATED)
        verdict = agree(_write_verdict(write, prepared))
        stats.apply_s = time.perf_counter() - t1
    if not verdict.ok:
        return _write_failed(stats, source, prepared, verdict.message)
    _written(prepared)
    if prepared.step_complete:
        end_step(model, marker=True)  # the request was refused up front if it left halves unpaired
    stats.ok, stats.message = True, "ok"
    record(stats)
    held = current_step().held
    return True, with_state("Success" + (f"; {HELD}{without_partners(sorted(held))}" if held else ""))


def _written(prepared: Prepared) -> None:
    """A request written in full: dirty marks cleared now where the request counts as complete in itself (a plain
    step, or a checkpoint that rewrote everything); a step with an extent clears them at its complete end."""
    step, names = current_step(), prepared.validated.names
    if prepared.full or not step.declared:
        engine_state().mark_written(names, full=prepared.full)
    late = step.applied(names, kv_layers=prepared.kv_scales or (), pairing=prepared.pairing)
    if late:
        engine_state().mark_dirty(late, f"written after the step was broken ({step.broken})")


def _write_failed(stats: UpdateStats, source: str, prepared: Prepared, message: str) -> tuple[bool, str]:
    """Writing failed on some rank: the request's tensors (and, in a step with an extent, all it wrote) are dirty."""
    reason = f"update #{stats.index} ({source}) failed after writing started: {message}"
    dirty = current_step().write_failed(prepared.validated.names, reason)
    engine_state().mark_dirty(dirty, reason)
    stats.message = reason
    record(stats)
    earlier = len(dirty) - len(prepared.validated.names)
    return False, PARTIAL + reason + (f" (with the {earlier} tensors written earlier in this step)" if earlier > 0
                                      else "")


def end_answer(commit: Commit) -> Optional[str]:
    """What a step's end answers when the step did not complete cleanly (halves dropped, tensors left dirty), else
    None."""
    parts = []
    if commit.unpaired:
        parts.append(f"FP8 halves whose partner never came were dropped, not written: {commit.unpaired_message()} "
                     "(those weights keep their old values)")
    if commit.dirty:
        parts.append(f"{commit.incomplete}; {len(commit.dirty)} tensors are dirty until a complete step rewrites "
                     f"them ({some_names(commit.dirty)})")
    return INCOMPLETE + "; ".join(parts) if parts else None


def _refused(stats: UpdateStats, message: str, validate_only: bool) -> tuple[bool, str]:
    """A request refused on every rank: nothing of it written. The answer says what the step had written before it:
    in a step with an extent that wrote anything, those tensors are dirty until a complete step rewrites them."""
    stats.message = message
    record(stats)
    step = current_step()
    if validate_only:
        apply_commit(step.validation_refused())
        return False, with_state(REJECTED + message)
    dirty = step.refused(message)
    if dirty:
        what = "an all-or-nothing step was refused in its apply round" if step.atomic else \
            "a weight-update session's step was refused"
        reason = (f"{what} after {len(dirty)} of its tensors were written ({some_names(dirty)}); nothing of the "
                  f"refused request was written: {message}")
        engine_state().mark_dirty(dirty, reason)
        return False, PARTIAL + reason
    return False, with_state(REJECTED + message)


def run_unvalidated(model: torch.nn.Module, source: str, call: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """An entry point whose tensors cannot be obtained up front (checkpoint-engine IPC): SGLang's own method runs,
    its ``load_weights`` calls are validated rank-locally by the model's guard, and the ranks agree on the outcome.
    If any rank failed after any rank wrote, every rank is marked inconsistent."""
    state = engine_state()
    writes_before = state.writes
    try:
        ok, message = call()
    except Exception as e:  # noqa: BLE001 - the boundary to SGLang's scheduler: nothing may escape (module doc)
        logger.exception("[fp8rl] unexpected error in %s", source)
        ok, message = False, _describe(e)
    verdict = agree(Verdict(bool(ok), "" if ok else str(message), wrote=state.writes > writes_before))
    if verdict.ok:
        end_step(model)  # checkpoint-engine sends a whole step in one call
        return True, with_state(message)
    if verdict.wrote:
        state.mark_dirty((), f"{source} failed on some rank after others wrote: {verdict.message}")
        return False, PARTIAL + verdict.message
    return False, with_state(REJECTED + verdict.message)


def with_state(message: str) -> str:
    """An answer, plus the engine's inconsistency when a failed update's tensors are still to be re-sent."""
    state = engine_state()
    if state.consistent:
        return message
    return f"{message} {INCONSISTENT_MARK} still inconsistent: {state.inconsistent_reason}"
