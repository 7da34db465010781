"""Recalibration on the engine: one prefill of a fixed token batch through SGLang's ModelRunner, K/V amax observed
at the attention backend, per-layer scales written in place.

The forward (:mod:`sglang_fp8rl.kv_scales.forward`) takes its KV slots from the live allocator and gives them back,
so the caller must hold the scheduler idle with the prefix cache flushed (after a weight update SGLang flushes it
anyway): cached K/V written under the old scales would otherwise be read back under the new ones. Under TP every
stage of a recalibration, from reading the scales in force to writing the new ones, ends in an agreement of the ranks
(:class:`~sglang_fp8rl.kv_scales.forward.TPStages`): a failure on any rank returns on every rank, each with the scales
it served before.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from sglang_fp8rl.kv_scales.forward import TPStages, measure_amax
from sglang_fp8rl.kv_scales.layers import attention_layers, layer_labels, read_scales, write_scales
from sglang_fp8rl.kv_scales.numerics import ScalePolicy, scales_from_amax
from sglang_fp8rl.kv_scales.state import KVScaleRecord, kv_state

logger = logging.getLogger(__name__)

DEFAULT_CALIBRATION_SEQS = 4
DEFAULT_CALIBRATION_SEQ_LEN = 512

# Mixed-domain text for the default calibration batch: prose, code, math, structured data, two other scripts.
CALIBRATION_TEXT = (
    "The committee met on a cold morning in early March to review the results of the previous quarter. Revenue had "
    "grown, but the costs of the new warehouse were higher than anyone had planned, and two of the largest customers "
    "had asked to renegotiate their contracts before the summer.\n\n"
    "def merge_intervals(intervals):\n    intervals.sort(key=lambda pair: pair[0])\n    merged = []\n"
    "    for start, end in intervals:\n        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n            merged.append([start, end])\n"
    "    return merged\n\n"
    "Let f(x) = 3x^2 - 12x + 7. Setting f'(x) = 6x - 12 = 0 gives x = 2, and f(2) = 12 - 24 + 7 = -5, so the minimum "
    "of f is -5. The sum of the first n odd numbers is n^2; for n = 17 it is 289.\n\n"
    '{"id": 4821, "name": "sensor-7", "readings": [21.4, 21.9, 22.3, 21.8], "status": "ok", "tags": ["north", '
    '"roof"]}\n\n'
    "Question: A train leaves at 9:40 and arrives at 13:15. How long is the journey? Answer: 3 hours 35 minutes.\n\n"
    "Die Bibliothek bleibt am Montag geschlossen. 图书馆周一闭馆，请在周二再来。 Il pleut depuis trois jours.\n"
)


def calibration_token_ids(tokenizer: Any, num_seqs: int = DEFAULT_CALIBRATION_SEQS,
                          seq_len: int = DEFAULT_CALIBRATION_SEQ_LEN) -> list[list[int]]:
    """The default batch: ``num_seqs`` windows of ``seq_len`` tokens over the repeated calibration text.

    Each window starts at a different offset, so no two sequences share a prefix."""
    ids = list(tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))
    if not ids:
        raise ValueError("the tokenizer turned the calibration text into no tokens")
    stride = max(1, len(ids) // max(1, num_seqs))
    need = seq_len + stride * num_seqs
    stream = ids * (need // len(ids) + 1)
    return [stream[i * stride:i * stride + seq_len] for i in range(num_seqs)]


def load_token_ids(path: str) -> list[list[int]]:
    """A calibration batch from a JSON file: a list of token-id lists."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the KV calibration batch {path!r}: {e}") from e
    if not isinstance(data, list) or not all(isinstance(seq, list) for seq in data):
        raise ValueError(f"{path}: the KV calibration batch must be a JSON list of token-id lists")
    return [[int(t) for t in seq] for seq in data]


def check_token_ids(token_ids: Sequence[Sequence[int]], vocab_size: int, max_tokens: Optional[int] = None) -> int:
    """Validate a calibration batch (non-empty sequences of in-vocabulary ids); returns its token count."""
    if not token_ids or any(len(seq) == 0 for seq in token_ids):
        raise ValueError("the KV calibration batch needs at least one sequence and no empty one")
    bad = [t for seq in token_ids for t in seq if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"KV calibration token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    total = sum(len(seq) for seq in token_ids)
    if max_tokens is not None and total > max_tokens:
        raise ValueError(f"the KV calibration batch has {total} tokens, more than the {max_tokens} allowed")
    return total


# ---------------------------------------------------------------------------------------------------------------------
# recalibration and its record


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One recalibration: what was measured and written."""

    amax: dict[int, tuple[float, float]]
    scales: dict[int, tuple[float, float]]
    changed: tuple[int, ...]  # layers whose K or V scale changed
    tokens: int
    seconds: float
    finished_at: float  # time.time()
    source: str  # "calibration" or "trainer"
    sequences: int = 0  # of the calibration batch (cut to the free request and KV slots)

    def summary(self) -> str:
        """One log line."""
        ks = [s[0] for s in self.scales.values()]
        vs = [s[1] for s in self.scales.values()]
        measured = f"on {self.tokens} tokens in {self.sequences} sequences " if self.source == "calibration" else ""
        return (f"[fp8rl] KV scales from {self.source} {measured}in {self.seconds * 1e3:.1f} ms: "
                f"{len(self.scales)} layers, {len(self.changed)} changed, k in [{min(ks):g}, {max(ks):g}], "
                f"v in [{min(vs):g}, {max(vs):g}]")


def kv_scale_record() -> KVScaleRecord:
    """This process's record of KV-scale writes (part of its KV-scale state)."""
    return kv_state().record


def apply_scales(layers: Sequence[Any], scales: dict[int, tuple[float, float]], *, source: str, tokens: int = 0,
                 amax: Optional[dict[int, tuple[float, float]]] = None, started: Optional[float] = None,
                 before: Optional[dict[int, tuple[float, float]]] = None, sequences: int = 0) -> Calibration:
    """Write ``scales`` in place (all or nothing), record and log the write; returns its record. ``before``: the
    scales that served until now (default: the layers' current ones), for the record of what changed."""
    calibration = _write(layers, scales, source=source, tokens=tokens, amax=amax, before=before, sequences=sequences,
                         started=time.perf_counter() if started is None else started)
    kv_scale_record().record(calibration)
    return calibration


def _write(layers: Sequence[Any], scales: dict[int, tuple[float, float]], *, source: str, started: float,
           before: Optional[dict[int, tuple[float, float]]], tokens: int = 0, sequences: int = 0,
           amax: Optional[dict[int, tuple[float, float]]] = None) -> Calibration:
    before = read_scales(layers) if before is None else before
    written = write_scales(layers, scales)
    changed = tuple(i for i, s in written.items() if before.get(i) != s)
    return Calibration(amax=amax or {}, scales=written, changed=changed, tokens=tokens,
                       seconds=time.perf_counter() - started, finished_at=time.time(), source=source,
                       sequences=sequences)


def recalibrate(model_runner: Any, token_ids: Sequence[Sequence[int]], policy: ScalePolicy = ScalePolicy(),
                group: Optional[torch.distributed.ProcessGroup] = None,
                under: Optional[dict[int, tuple[float, float]]] = None) -> Calibration:
    """Measure K/V amax on ``token_ids`` and write the derived per-layer scales in place into every attention layer.

    ``under``: scales written for the calibration forward only (the engine passes its start-up scales). A backend
    whose prefill attends to the FP8 cache (FlashInfer's paged prefill) measures later layers' K/V through the scales
    in force; under fixed ones the result depends on the weights alone, as a fresh server's calibration does.
    Raises (``ValueError`` for non-finite K/V, ``RuntimeError`` for too few free KV slots; with ``group``,
    :class:`~sglang_fp8rl.kv_scales.forward.CalibrationFailed` on every rank alike for a failure on any rank at any
    stage) with the previous scales back in force; nothing is recorded then."""
    started = time.perf_counter()
    stages = TPStages(tp=group is not None)
    layers, in_force = stages.run("while reading the KV scales in force", _in_force, model_runner)
    calibration = None
    try:
        if under is not None:
            stages.run("while writing the start-up scales it runs under", write_scales, layers, under)
        amax = measure_amax(model_runner, token_ids, group)
        scales = stages.run("while deriving the scales", _scales, amax, policy, layers)
        calibration = stages.run("while writing the scales", functools.partial(
            _write, source="calibration", started=started, before=in_force, tokens=sum(map(len, token_ids)),
            sequences=len(token_ids), amax=_by_layer(layers, amax)), layers, scales)
    finally:
        if calibration is None:  # every rank gets here after the same stage: each puts back what it served
            write_scales(layers, in_force)
    kv_scale_record().record(calibration)
    return calibration


def _in_force(model_runner: Any) -> tuple[list[Any], dict[int, tuple[float, float]]]:
    layers = attention_layers(model_runner.model)
    return layers, read_scales(layers)


def _by_layer(layers: Sequence[Any], table: torch.Tensor) -> dict[int, tuple[float, float]]:
    return {layer.layer_id: tuple(row) for layer, row in zip(layers, table.tolist(), strict=True)}


def _scales(amax: torch.Tensor, policy: ScalePolicy, layers: Sequence[Any]) -> dict[int, tuple[float, float]]:
    return _by_layer(layers, scales_from_amax(amax, policy, layer_labels(layers)))
