"""This process's FP8 KV-scale transitions: the mode and calibration batch set at load, a recalibration made due or
done (the state itself: :mod:`.state`, ``OWNERS.kv_scales``).

A recalibration becomes due when a weight-update step ends (:mod:`sglang_fp8rl.weight_sync.step` decides: not when
the trainer sent every attention layer's scales during the step). It stays due until a calibration succeeds, so a
recalibration deferred because requests were running is retried at the next opportunity.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Optional

from sglang_fp8rl.kv_scales.calibrate import (
    DEFAULT_CALIBRATION_SEQ_LEN,
    DEFAULT_CALIBRATION_SEQS,
    calibration_token_ids,
    check_token_ids,
    load_token_ids,
)
from sglang_fp8rl.kv_scales.state import KVScaleState, kv_state

logger = logging.getLogger(__name__)

RANDOM_BATCH_SEED = 0
NO_TOKENIZER = "no tokenizer"


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
        if ids is None:  # source: why the text cannot be used
            ids, source = random_token_ids(vocab_size), f"random ids (seed {RANDOM_BATCH_SEED}; {source})"
    ids = [seq[: max(1, context_len - 1)] for seq in ids]
    check_token_ids(ids, vocab_size, max_tokens)
    return ids, source


def _tokenized_text(tokenizer_path: Optional[str]) -> tuple[Optional[list[list[int]]], str]:
    """(the built-in text's batch, its source), or (None, why not)."""
    if not tokenizer_path:
        return None, NO_TOKENIZER
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        logger.info("[fp8rl] KV calibration: no tokenizer at %s (%s); using random token ids", tokenizer_path, e)
        return None, NO_TOKENIZER
    try:
        return calibration_token_ids(tokenizer), f"built-in text through {tokenizer_path}'s tokenizer"
    except ValueError as e:  # a tokenizer that turns the text into no tokens: a server must still start
        logger.warning("[fp8rl] KV calibration: %s's tokenizer: %s; using random token ids", tokenizer_path, e)
        return None, str(e)


def batch_within(token_ids: list[list[int]], free_slots: int,
                 free_requests: Optional[int] = None) -> list[list[int]]:
    """The calibration batch cut to fit ``free_slots`` KV slots and ``free_requests`` request slots (one per
    sequence): its first sequences, as many as there are free request slots, each shortened alike to the KV slots (the
    same pool sizes always give the same batch); ValueError if not even one token of one sequence fits."""
    if free_requests is not None:
        if free_requests < 1:
            raise ValueError("no request slot is free for a calibration batch")
        token_ids = token_ids[:free_requests]  # whole sequences: each still starts where it did
    total = sum(map(len, token_ids))
    if total <= free_slots:
        return token_ids
    per_seq = free_slots // len(token_ids)
    if per_seq < 1:
        raise ValueError(f"the KV pool has {free_slots} free slots, too few for a calibration batch of "
                         f"{len(token_ids)} sequences")
    return [seq[:per_seq] for seq in token_ids]


def mark_due() -> None:
    """A step ended that needs new scales: recalibrate at the next opportunity (kept until one succeeds)."""
    state = kv_state()
    state.due = state.calibrating


def mark_calibrated() -> None:
    """A calibration succeeded: nothing is due any more."""
    kv_state().due = False


def set_up(mode: str, token_ids: list[list[int]], batch_source: str, explicit: bool = False,
           fused_write: bool = False) -> KVScaleState:
    """Set this process's mode, calibration batch and K/V write path (at load)."""
    state = kv_state()
    state.mode, state.token_ids, state.batch_source, state.explicit = mode, token_ids, batch_source, explicit
    state.fused_write = fused_write
    return state


def describe(state: KVScaleState, record: dict[str, Any]) -> dict[str, Any]:
    """Telemetry for /get_server_info."""
    return {"mode": state.mode, "write": "fused" if state.fused_write else "sglang", "batch": state.batch_source,
            "calibration_tokens": sum(map(len, state.token_ids)),
            "deferred": state.deferred, "due": state.due, **record}
