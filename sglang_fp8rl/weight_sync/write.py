"""The write of a validated request, in place.

The replayed FP8 writes go first, as grouped quantizer launches at the placements the dry run found; then the copies
into plain parameters (one multi-tensor copy per pair of devices); then the rest through the model's own
``load_weights``, whose FP8 loaders re-quantize into the existing storage. On CUDA the quantizers skip their NaN/Inf
pre-read (the request was validated) and raise one device flag, checked once after the write. Errors propagate: the
caller knows writing has started (guard.py marks the request's tensors dirty on every rank).
"""

from __future__ import annotations

from typing import Callable

import torch

from sglang_fp8rl.kernels.dispatch import check_nonfinite_flag
from sglang_fp8rl.layers.fp8_storage import copy_pairs, layer_states, prevalidated_writes, write_planned
from sglang_fp8rl.weight_sync.engine_state import engine_state
from sglang_fp8rl.weight_sync.request import Validated


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (CPU for a model without any)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def apply_validated(model: torch.nn.Module, load_weights: Callable, validated: Validated) -> None:
    """Write a validated request in place: the replayed FP8 writes first (grouped launches), then the rest through
    the model's load_weights; errors propagate (the caller knows writing has started)."""
    device, state = model_device(model), engine_state()
    state.writes += 1
    with prevalidated_writes(layer_states(model), device) as flag:
        write_planned(list(validated.incoming_writes()))
        copy_pairs([(param.data, tensor) for param, tensor in validated.plain_copies()])  # SGLang's default loader
        if validated.to_load:
            load_weights(list(validated.to_load))
    if flag is not None:
        check_nonfinite_flag(flag, validated.named_tensors())  # cannot trip after validation; defence in depth
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    state.note_written(model, validated.destinations)
