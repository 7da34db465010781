"""The calibration forward on SGLang's ModelRunner, in stages that every TP rank passes together.

The forward is SGLang's own benchmark path (one_batch's ``extend`` as
:func:`sglang_fp8rl.compat.runtime.extend_forward_batch` rebuilds it: a ``ScheduleBatch`` over the live pools with a
stand-in prefix cache, ``ForwardBatch.init_new``; then ``ModelRunner.forward``), the one the CPU tests and
``bench_one_batch`` already drive. Its KV slots come from the live allocator and are given back afterwards, so the
caller must hold the scheduler idle with the prefix cache flushed.

Under TP the forward and the amax all-reduce are collectives: a rank that failed before them (an allocation while
building the batch) would leave the others waiting there for good. So the work is cut into stages, and after each
one the ranks exchange their outcome over SGLang's TP CPU group (:class:`TPStages`): a failure anywhere ends the
calibration on every rank at the same boundary, before any collective the failed rank would skip. The one window
left is inside ``ModelRunner.forward`` itself, between its own collectives, as for any TP forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from sglang_fp8rl.compat.runtime import allocated_kv_len, extend_forward_batch, prefill_request, req_pool_index
from sglang_fp8rl.kv_scales.layers import attention_layers
from sglang_fp8rl.kv_scales.observer import KVAmaxObserver, observing
from sglang_fp8rl.parallel import Verdict, agree

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CalibrationFailed(RuntimeError):
    """A calibration stage failed on some TP rank; raised on every rank alike."""


class TPStages:
    """Runs a calibration's stages in step on every TP rank: after each stage the ranks agree on its outcome.

    Without TP a stage's exception propagates as it is."""

    def __init__(self, tp: bool) -> None:
        self.tp = tp

    def run(self, stage: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``; under TP, CalibrationFailed on every rank (naming the ranks and their errors) if it failed on
        any."""
        if not self.tp:
            return fn(*args)
        result, error = None, None
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - a rank-local failure of any kind (out of memory) must reach every rank
            error = e
        verdict = agree(Verdict(error is None, "" if error is None else f"{type(error).__name__}: {error}"))
        if not verdict.ok:
            raise CalibrationFailed(f"KV calibration failed {stage}: {verdict.message}") from error
        return result


class CalibrationBatch:
    """One prefill of a token batch (one request per sequence) over the runner's live pools; every slot it takes is
    given back by :meth:`release`."""

    def __init__(self, model_runner: Any, token_ids: Sequence[Sequence[int]]) -> None:
        self.model_runner = model_runner
        self.token_ids = token_ids
        self.reqs: list[Any] = []
        self.forward_batch: Any = None

    def build(self) -> None:
        """Take the request and KV slots and build the ForwardBatch (RuntimeError if too few KV slots are free)."""
        needed = sum(len(seq) for seq in self.token_ids)
        free = self.model_runner.token_to_kv_pool_allocator.available_size()
        if needed > free:
            raise RuntimeError(f"KV calibration needs {needed} free KV slots, {free} are free (flush the cache first)")
        self.reqs = [prefill_request(rid=f"fp8rl-kv-calibration-{i}", ids=list(seq), max_new_tokens=1)
                     for i, seq in enumerate(self.token_ids)]
        self.forward_batch = extend_forward_batch(self.reqs, self.model_runner)

    def forward(self) -> None:
        """The model's forward over the built batch (no sampling: only the attention layers' K/V are wanted)."""
        with torch.no_grad():
            self.model_runner.forward(self.forward_batch)

    def release(self) -> None:
        """Give back the request and KV slots the allocation actually handed out (those of a half-built batch too)."""
        pool, allocator = self.model_runner.req_to_token_pool, self.model_runner.token_to_kv_pool_allocator
        reqs, self.reqs, self.forward_batch = self.reqs, [], None
        for req in reqs:
            row = req_pool_index(req)
            if row is None:
                continue
            allocated = allocated_kv_len(req)
            if allocated:  # set by the allocation once the token slots are written
                allocator.free(pool.req_to_token[row, :allocated])
            pool.free(req)


def calibration_forward(model_runner: Any, token_ids: Sequence[Sequence[int]]) -> None:
    """One prefill of ``token_ids`` (one request each) through ``model_runner`` on this rank; every slot is given
    back."""
    batch = CalibrationBatch(model_runner, token_ids)
    try:
        batch.build()
        batch.forward()
    finally:
        batch.release()


def _amax_table(batch: CalibrationBatch, layer_ids: Sequence[int]) -> torch.Tensor:
    observer = KVAmaxObserver()
    with observing(batch.model_runner.attn_backend, observer):
        batch.forward()
    table = observer.table(layer_ids)
    batch.release()  # inside the stage: a rank that cannot give its slots back fails the calibration everywhere
    return table


def measure_amax(model_runner: Any, token_ids: Sequence[Sequence[int]],
                 group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
    """float64 ``[layers, 2]`` (K, V) amax of a calibration forward, in ``attention_layers`` order, on the CPU.

    With ``group`` (the tensor-parallel group) the amax is the max over its ranks, so every rank derives the same
    per-layer scales, as trainer-supplied scales are. The ranks agree (:class:`TPStages`) once the batch is built and
    once the forward is done; if any failed, every rank raises :class:`CalibrationFailed` naming it, and none waits
    in the forward or the all-reduce."""
    stages = TPStages(tp=group is not None)
    batch = CalibrationBatch(model_runner, token_ids)
    try:
        layer_ids = stages.run("while building the calibration batch", _build, batch)
        table = stages.run("in the calibration forward", _amax_table, batch, layer_ids)
    finally:
        _release_after_failure(batch)
    if group is not None:
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX, group=group)
    return table.to("cpu", torch.float64)


def _build(batch: CalibrationBatch) -> list[int]:
    layer_ids = [layer.layer_id for layer in attention_layers(batch.model_runner.model)]
    batch.build()
    return layer_ids


def _release_after_failure(batch: CalibrationBatch) -> None:
    if not batch.reqs:
        return
    try:
        batch.release()
    except Exception as e:  # noqa: BLE001 - the calibration already failed on every rank; that failure is the answer
        logger.error("[fp8rl] KV calibration: giving back its KV slots failed too: %s: %s", type(e).__name__, e)
