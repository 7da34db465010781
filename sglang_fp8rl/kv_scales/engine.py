"""This process's FP8 KV-scale state: the mode, the calibration batch, and whether a recalibration is due.

A recalibration is due after every *complete* weight update: a request carrying the step-complete marker (the
client sends it with the last bucket of a step, and alone for an explicit recalibration), or a full update from disk
(no name filter). Trainer-supplied scales of every attention layer in a step make that step's recalibration moot.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from typing import Any, Optional, Sequence

from sglang_fp8rl.kv_scales.calibrate import (
    DEFAULT_CALIBRATION_SEQ_LEN,
    DEFAULT_CALIBRATION_SEQS,
    calibration_token_ids,
    check_token_ids,
    load_token_ids,
)
from sglang_fp8rl.kv_scales.numerics import ScalePolicy

logger = logging.getLogger(__name__)

RANDOM_BATCH_SEED = 0


@dataclasses.dataclass
class KVScaleState:
    """Per-process KV-scale state (set at load in ``calibrate`` mode)."""

    mode: str = "static"
    explicit: bool = False  # the user asked for calibrate (not auto): an unverified backend is then an error
    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    batch_source: str = ""
    policy: ScalePolicy = dataclasses.field(default_factory=ScalePolicy)
    due: bool = False  # a complete update happened since the last calibration
    trainer_layers: set[int] = dataclasses.field(default_factory=set)  # layers given scales by the trainer this step
    deferred: int = 0  # due recalibrations skipped because the engine was busy or short of KV slots
    fused_write: bool = False  # --fp8rl-kv-write fused: one kernel writes calibrated K/V (kernels/kv_store.py)
    # the scales in force when the layers got their tensors (SGLang's, normally 1.0): every calibration runs under
    # them, so that a recalibration measures what a fresh server's start-up calibration measures
    calibrated_under: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)

    @property
    def calibrating(self) -> bool:
        """Whether this engine measures its KV scales."""
        return self.mode == "calibrate"


_STATE = KVScaleState()


def kv_state() -> KVScaleState:
    """This process's KV-scale state."""
    return _STATE


def random_token_ids(vocab_size: int, num_seqs: int = DEFAULT_CALIBRATION_SEQS,
                     seq_len: int = DEFAULT_CALIBRATION_SEQ_LEN) -> list[list[int]]:
    """A seeded batch of random token ids (when the model has no tokenizer): fixed, but not representative text."""
    rng = random.Random(RANDOM_BATCH_SEED)
    return [[rng.randrange(vocab_size) for _ in range(seq_len)] for _ in range(num_seqs)]


def calibration_batch(path: str, tokenizer_path: Optional[str], vocab_size: int, context_len: int,
                      max_tokens: Optional[int] = None) -> tuple[list[list[int]], str]:
    """(token ids, where they come from): the user's JSON file, else the built-in text through the model's
    tokenizer, else seeded random ids; every sequence cut to the model's context length."""
    if path:
        ids = load_token_ids(path)
        source = path
    else:
        ids, source = _tokenized_text(tokenizer_path)
        if ids is None:
            ids, source = random_token_ids(vocab_size), f"random ids (seed {RANDOM_BATCH_SEED}; no tokenizer)"
    ids = [seq[: max(1, context_len - 1)] for seq in ids]
    check_token_ids(ids, vocab_size, max_tokens)
    return ids, source


def _tokenized_text(tokenizer_path: Optional[str]) -> tuple[Optional[list[list[int]]], str]:
    if not tokenizer_path:
        return None, ""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        logger.info("[fp8rl] KV calibration: no tokenizer at %s (%s); using random token ids", tokenizer_path, e)
        return None, ""
    return calibration_token_ids(tokenizer), f"built-in text through {tokenizer_path}'s tokenizer"


def batch_within(token_ids: list[list[int]], free_slots: int) -> list[list[int]]:
    """The calibration batch cut to fit ``free_slots`` KV slots (each sequence shortened alike; the same pool size
    always gives the same batch); ValueError if not even one token per sequence fits."""
    total = sum(map(len, token_ids))
    if total <= free_slots:
        return token_ids
    per_seq = free_slots // len(token_ids)
    if per_seq < 1:
        raise ValueError(f"the KV pool has {free_slots} free slots, too few for a calibration batch of "
                         f"{len(token_ids)} sequences")
    return [seq[:per_seq] for seq in token_ids]


def mark_due() -> None:
    """A complete weight update happened: recalibrate at the next opportunity (unless the trainer gave scales)."""
    _STATE.due = _STATE.calibrating


def note_trainer_scales(layers: Sequence[int]) -> None:
    """The trainer sent KV scales for these layers in the current step."""
    _STATE.trainer_layers.update(layers)


def take_due(num_layers: int) -> bool:
    """Whether a recalibration should run now; resets the step's bookkeeping."""
    due = _STATE.due and len(_STATE.trainer_layers) < num_layers
    if _STATE.due and not due:
        logger.info("[fp8rl] KV scales: the trainer supplied every layer's scales this step; no recalibration")
    _STATE.due = False
    _STATE.trainer_layers.clear()
    return due


def set_up(mode: str, token_ids: list[list[int]], batch_source: str, explicit: bool = False,
           fused_write: bool = False) -> KVScaleState:
    """Set this process's mode, calibration batch and K/V write path (at load)."""
    _STATE.mode, _STATE.token_ids, _STATE.batch_source, _STATE.explicit = mode, token_ids, batch_source, explicit
    _STATE.fused_write = fused_write
    return _STATE


def describe(state: KVScaleState, record: dict[str, Any]) -> dict[str, Any]:
    """Telemetry for /get_server_info."""
    return {"mode": state.mode, "write": "fused" if state.fused_write else "sglang", "batch": state.batch_source,
            "calibration_tokens": sum(map(len, state.token_ids)),
            "deferred": state.deferred, **record}
