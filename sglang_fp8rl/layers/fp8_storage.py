"""The one FP8 writer of dense and MoE layers: rows of an FP8 weight and their scales, written in place.

Every FP8 write of this package (initial load, every weight update, dummy fill) goes through :func:`write_rows`:
BF16 rounding on the source device, the block-scale rows a write covers (checked: a 128-row block never straddles two
shards), the Triton quantizer on CUDA (the torch reference elsewhere), and the non-finite mode of a validated update.

Storage conventions (SGLang's): ``weight_scale_inv`` is the blockwise *dequantization multiplier*
([ceil(N/128), ceil(K/128)] float32, ``w ~= q * scale_inv``); ``weight_scale`` is the per-channel one ([N] float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from sglang_fp8rl.kernels.dispatch import (
    new_nonfinite_flag,
    quantize_blockwise_into,
    quantize_blockwise_many,
    quantize_per_channel_into,
)
from sglang_fp8rl.layers.placement import scale_rows
from sglang_fp8rl.layers.scheme import Scheme, SchemeDecision
from sglang_fp8rl.quant import FP8_DTYPE, UNQUANTIZED_DTYPES, dequantize_blockwise

# attribute of our FP8 parameters holding a loader twin that validates an incoming tensor without writing
# (used by the weight-update dry run); it returns the IncomingWrite the loader would make
CHECK_ATTR = "fp8rl_check"
# attribute of a module quantized by this package that holds its Fp8LayerState
STATE_ATTR = "_fp8rl"
_LAYER_STATES_ATTR = "_fp8rl_layer_states"  # on the model: layer_states' list

# attribute of FP8 codes sent pre-quantized (a trainer's checkpoint-format update): their block scales, the
# [ceil(N/128), ceil(K/128)] float32 dequantization multipliers sent as `<name>_scale_inv` (weight_sync/fp8_payload.py)
SCALE_ATTR = "fp8rl_scale_inv"

# SGLang's dummy loader draws weights from U(-1e-3, 1e-3); never-loaded layers get the same distribution in BF16.
DUMMY_WEIGHT_RANGE = 1e-3


@dataclasses.dataclass
class Fp8LayerState:
    """What this package knows about one quantized layer (dense linear or FusedMoE), kept on it as ``_fp8rl``."""

    prefix: str
    decision: SchemeDecision
    block_size: tuple[int, int]
    scale_format: str
    # while a validated update is written (prevalidated_writes): its one device flag for non-finite input, raised by
    # the quantizers instead of their own NaN/Inf pre-read (the update already checked every tensor)
    nonfinite_flag: Optional[torch.Tensor] = dataclasses.field(default=None, compare=False, repr=False, kw_only=True)

    @property
    def is_block(self) -> bool:
        """Whether the layer is stored as 128x128 blocks (else one scale per output row)."""
        return self.decision.scheme is Scheme.BLOCK


def layer_state(module: torch.nn.Module) -> Optional[Fp8LayerState]:
    """The module's state if this package quantized it, else None."""
    state = getattr(module, STATE_ATTR, None)
    return state if isinstance(state, Fp8LayerState) else None


def layer_states(model: torch.nn.Module) -> tuple[Fp8LayerState, ...]:
    """The states of every layer of ``model`` this package quantized, found once per model: a walk of its modules
    costs milliseconds (~3.8 ms at 24 MoE layers, RESULTS 29b), and every update request needs them, while the set
    is fixed once the weights are loaded (the first update comes after that)."""
    states = model.__dict__.get(_LAYER_STATES_ATTR)
    if states is None:
        states = tuple(state for state in map(layer_state, model.modules()) if state is not None)
        model.__dict__[_LAYER_STATES_ATTR] = states
    return states


# ---------------------------------------------------------------------------------------------------------------------
# non-finite mode of a validated update

@contextlib.contextmanager
def prevalidated_writes(states: Sequence[Fp8LayerState], device: torch.device) -> Iterator[Optional[torch.Tensor]]:
    """Inside this block, the layers' writes on ``device`` (CUDA) use one shared non-finite flag instead of a
    pre-read; the flag is each layer state's for the duration, and cleared after."""
    flag = new_nonfinite_flag(device) if device.type == "cuda" else None
    for state in states:
        state.nonfinite_flag = flag
    try:
        yield flag
    finally:
        for state in states:
            state.nonfinite_flag = None


def _flag_for(state: Fp8LayerState, device: torch.device) -> Optional[torch.Tensor]:
    flag = state.nonfinite_flag
    return flag if flag is not None and flag.device == device else None


# ---------------------------------------------------------------------------------------------------------------------
# writing


def write_rows(state: Fp8LayerState, w: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               dst_rows: slice) -> None:
    """Quantize ``w`` into rows ``dst_rows`` of the 2-D FP8 ``weight`` and the matching rows of its ``scale``.

    ``scale`` is the whole scale of ``weight``: 2-D block scale for block layers, 1-D per-row scale otherwise."""
    w = w.to(torch.bfloat16).to(weight.device)  # round on the source device: half the bytes to move
    flag = _flag_for(state, weight.device)
    if state.is_block:
        rows = scale_rows(dst_rows, state.block_size[0], weight.shape[0])
        quantize_blockwise_into(w, weight[dst_rows], scale[rows], state.block_size, state.scale_format,
                                nonfinite_flag=flag)
    else:
        quantize_per_channel_into(w, weight[dst_rows], scale[dst_rows], state.scale_format, nonfinite_flag=flag)


def is_prequantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is FP8 E4M3 codes sent with their block scales."""
    return t.dtype == FP8_DTYPE and getattr(t, SCALE_ATTR, None) is not None


def dequantized_bf16(codes: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """Pre-quantized codes as the BF16 weight they stand for: codes x their block's scale in float32, then BF16."""
    return dequantize_blockwise(codes, getattr(codes, SCALE_ATTR), block_size).to(torch.bfloat16)


def check_incoming_dtype(what: str, loaded: torch.Tensor) -> None:
    """ValueError unless ``loaded`` is BF16/FP16/FP32, or FP8 E4M3 codes that came with their scales."""
    if loaded.dtype not in UNQUANTIZED_DTYPES and not is_prequantized(loaded):
        raise ValueError(f"{what}: expected a BF16/FP16/FP32 tensor, or float8_e4m3fn codes with their "
                         f"weight_scale_inv in the same update; got {loaded.dtype}")


def source_blocks(src_rows: slice, src_cols: slice, block_size: tuple[int, int]) -> tuple[slice, slice]:
    """The block rows and columns of a sent scale that this rank's slice covers; ValueError unless the slice starts
    on a block (a block split between ranks would need its codes re-quantized, which a fallback layer does)."""
    bn, bk = block_size
    if src_rows.start % bn or src_cols.start % bk:
        raise ValueError(f"this rank's slice (rows {src_rows.start}.., cols {src_cols.start}..) does not start on a "
                         f"{bn}x{bk} block of the sent codes")
    return slice(src_rows.start // bn, -(-src_rows.stop // bn)), slice(src_cols.start // bk, -(-src_cols.stop // bk))


def check_incoming(state: Fp8LayerState, loaded: torch.Tensor, src_rows: slice, src_cols: slice, dst_rows: slice,
                   n_local: int) -> None:
    """What :func:`write_incoming` checks before writing (the dry run's twin)."""
    check_incoming_dtype(state.prefix, loaded)
    if is_prequantized(loaded) and state.is_block:
        source_blocks(src_rows, src_cols, state.block_size)
        scale_rows(dst_rows, state.block_size[0], n_local)


def write_incoming(state: Fp8LayerState, loaded: torch.Tensor, src_rows: slice, src_cols: slice,
                   weight: torch.Tensor, scale: torch.Tensor, dst_rows: slice) -> None:
    """Write this rank's slice of an incoming full tensor into rows ``dst_rows``: quantized from BF16/FP16/FP32, or,
    for pre-quantized codes, copied as sent (block layers) or re-quantized from their BF16 value (fallback layers)."""
    if not is_prequantized(loaded):
        write_rows(state, loaded[src_rows, src_cols], weight, scale, dst_rows)
    elif not state.is_block:
        write_rows(state, dequantized_bf16(loaded, state.block_size)[src_rows, src_cols], weight, scale, dst_rows)
    else:
        for dst, src in sent_blocks(state, loaded, src_rows, src_cols, weight, scale, dst_rows):
            dst.copy_(src)


def sent_blocks(state: Fp8LayerState, loaded: torch.Tensor, src_rows: slice, src_cols: slice, weight: torch.Tensor,
                scale: torch.Tensor, dst_rows: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) of pre-quantized codes and their scales into a block layer: this rank's blocks, as sent."""
    block_rows, block_cols = source_blocks(src_rows, src_cols, state.block_size)
    dst_blocks = scale_rows(dst_rows, state.block_size[0], weight.shape[0])
    return [(weight[dst_rows], loaded[src_rows, src_cols]),
            (scale[dst_blocks], getattr(loaded, SCALE_ATTR)[block_rows, block_cols])]


@dataclasses.dataclass(frozen=True, eq=False)
class IncomingWrite:
    """Where this rank writes one incoming full tensor in one FP8 layer, as its loader would: rows and columns of
    the tensor into rows of the layer's 2-D FP8 ``weight`` (a dense layer's, or one expert's) and of its ``scale``.

    The dry run of an update finds it once per request signature; replaying it skips the model's ``load_weights``.
    ``weight`` None: the tensor has nothing to write on this rank (an expert held by another rank)."""

    state: Fp8LayerState
    weight: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    src_rows: Optional[slice] = None
    src_cols: Optional[slice] = None
    dst_rows: Optional[slice] = None

    @functools.cached_property
    def block_destination(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``weight`` and of its block ``scale`` that this write quantizes into: views made once, since the
        dry run's records (and so this write) serve every request of their signature."""
        rows = scale_rows(self.dst_rows, self.state.block_size[0], self.weight.shape[0])
        return self.weight[self.dst_rows], self.scale[rows]


def write_planned(writes: Sequence[tuple[IncomingWrite, torch.Tensor]]) -> None:
    """Write many incoming tensors at their planned places, with the results of :func:`write_incoming` on each, in
    few launches: block layers' quantizations through ``quantize_blockwise_many`` (one launch per block size, scale
    format and input dtype), pre-quantized blocks in one multi-tensor copy, the rest (per-channel layers, inputs on
    another device) one by one."""
    quantize: dict[tuple[tuple[int, int], str], list] = {}
    flags: dict[tuple[tuple[int, int], str], Optional[torch.Tensor]] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for target, loaded in writes:
        state, weight, scale = target.state, target.weight, target.scale
        if weight is None:
            continue
        if not (state.is_block and loaded.device == weight.device):
            write_incoming(state, loaded, target.src_rows, target.src_cols, weight, scale, target.dst_rows)
        elif is_prequantized(loaded):
            copies += sent_blocks(state, loaded, target.src_rows, target.src_cols, weight, scale, target.dst_rows)
        else:
            item = (loaded[target.src_rows, target.src_cols], *target.block_destination)
            quantize.setdefault((state.block_size, state.scale_format), []).append(item)
            flags[(state.block_size, state.scale_format)] = _flag_for(state, weight.device)
    copy_pairs(copies)
    for (block_size, scale_format), items in quantize.items():
        quantize_blockwise_many(items, flags[(block_size, scale_format)], block_size, scale_format)


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair, as one multi-tensor copy per pair of devices (the fast path needs one)."""
    by_devices: dict[tuple[torch.device, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        by_devices.setdefault((dst.device, src.device), []).append((dst, src))
    for group in by_devices.values():
        torch._foreach_copy_([dst for dst, _ in group], [src for _, src in group])


def dummy_bf16(shape: tuple[int, ...], device: torch.device, key: str) -> torch.Tensor:
    """Deterministic U(-1e-3, 1e-3) BF16 values for a never-loaded weight, seeded by its name."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
    generator = torch.Generator(device=device).manual_seed(seed)
    w = torch.empty(shape, dtype=torch.bfloat16, device=device)
    return w.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)


def refuse_scale(prefix: str, name: str, param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any,
                 **kwargs: Any) -> None:
    """Weight loader of our scale parameters (dense and MoE): scales come with their codes or from our quantizer."""
    raise ValueError(
        f"{prefix}.{name}: fp8_online_blockwise computes FP8 scales itself, or takes them only as "
        "`<weight>_scale_inv` beside float8_e4m3fn codes of 128x128 blocks; this scale tensor is refused"
    )
