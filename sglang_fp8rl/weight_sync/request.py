"""A whole update request, validated: what it writes, and how.

:func:`validate_request` runs the checks of :mod:`sglang_fp8rl.weight_sync.validate` and the (remembered) dry run of
the model's ``load_weights``, then splits the request three ways:

* **replayed**: a tensor whose dry run reached only our FP8 layers, with the request's own tensor object, in a model
  whose ``load_weights`` only routes each tensor to its parameter's loader (:data:`ROUTING_ONLY_MODELS`). Its writes
  (:class:`~sglang_fp8rl.layers.fp8_storage.IncomingWrite`, the loader's placement) are replayed directly, so a
  bucket's blockwise quantizations go in a few grouped launches instead of one Python dispatch each;
* **copied**: in such a model, a tensor whose dry run reached only plain parameters through SGLang's default loader
  (norms), copied whole: the copies of a request go in one multi-tensor copy;
* **through the model**: everything else (embeddings, lm_head, sharded loaders, other models) goes through
  ``load_weights``.

Each way gives the same bytes; the split only decides how many host calls the write takes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional

import torch

from sglang_fp8rl.layers.fp8_storage import IncomingWrite, dequantized_bf16, is_prequantized, layer_state
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE
from sglang_fp8rl.weight_sync.validate import (
    DryRunRecord,
    NamedTensors,
    UpdateRejected,
    checked_dry_run,
    is_ignored_name,
)

# SGLang models whose load_weights maps each name to a parameter and calls its loader, and does nothing else with
# the FP8 weights (no post-processing after the loop, as DeepSeek's derived MLA weights), and whose replayed writes
# are tested against their loaders (tests/test_replayed_writes.py): replaying the loader's placement is the same
# write. Other models go through load_weights for every tensor.
ROUTING_ONLY_MODELS = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})


@dataclasses.dataclass
class Validated:
    """A validated request: the tensors to write (ignored names dropped), split by how, and what they will write."""

    to_load: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)  # through load_weights
    replayed: list[tuple[str, torch.Tensor, tuple[IncomingWrite, ...]]] = dataclasses.field(default_factory=list)
    copied: list[tuple[str, torch.Tensor, tuple[torch.nn.Parameter, ...]]] = dataclasses.field(default_factory=list)
    names: list[str] = dataclasses.field(default_factory=list)  # of the tensors to write
    ignored: list[str] = dataclasses.field(default_factory=list)
    fp8_layers: dict[str, int] = dataclasses.field(default_factory=dict)
    plain_params: int = 0
    complete: bool = False  # a checkpoint that reaches every parameter of the model (validate_stream)
    destinations: Optional[Destinations] = None  # where it writes (validate_request): what a write rewrites

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor to write, by name."""
        return {**dict(self.to_load), **{name: tensor for name, tensor, _ in self.replayed + self.copied}}

    def incoming_writes(self) -> Iterator[tuple[IncomingWrite, torch.Tensor]]:
        """The replayed writes, each with its tensor."""
        for _, tensor, writes in self.replayed:
            for write in writes:
                yield write, tensor

    def plain_copies(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The replayed copies into plain parameters, each with its tensor."""
        for _, tensor, params in self.copied:
            for param in params:
                yield param, tensor


def replays_writes(model: torch.nn.Module) -> bool:
    """Whether this model's FP8 writes may skip its load_weights (see :data:`ROUTING_ONLY_MODELS`)."""
    return type(model).__name__ in ROUTING_ONLY_MODELS


def copies_whole(record: DryRunRecord, tensor: torch.Tensor) -> bool:
    """Whether the tensor reached only plain parameters, each through SGLang's default loader copying it whole."""
    return (not record.fp8_writes and not is_prequantized(tensor)
            and 0 < record.plain_params == len(record.plain_copies))


def for_plain_params(name: str, tensor: torch.Tensor, record: DryRunRecord) -> torch.Tensor:
    """Pre-quantized codes bound for parameters that are not ours (a layer kept in BF16) go as their BF16 value."""
    if not is_prequantized(tensor) or not record.plain_params:
        return tensor
    if record.fp8_writes:
        raise UpdateRejected(f"{name}: reaches both FP8 and BF16 parameters; send it in BF16")
    return dequantized_bf16(tensor, DEFAULT_BLOCK_SIZE)


@dataclasses.dataclass
class Destinations:
    """Where the tensors of one update (or one checkpoint) write, by the dry run's records: two tensors writing the
    same place (one parameter under two names, as SGLang's Qwen3 loader takes ``model.layers.N`` and ``layers.N``)
    are refused, since on CUDA both go in one multi-tensor copy or one grouped launch, where which lands is
    undefined."""

    fp8: dict[tuple[int, tuple[int, ...]], list[tuple[slice, str]]] = dataclasses.field(default_factory=dict)
    plain: dict[int, list[tuple[str, str]]] = dataclasses.field(default_factory=dict)

    def add(self, model: torch.nn.Module, name: str, record: DryRunRecord) -> None:
        """Record ``name``'s writes; UpdateRejected naming both tensors if another tensor writes the same place."""
        for write in record.fp8_writes:
            if write.weight is None:
                continue  # nothing written on this rank
            rows, key = write.dst_rows, (write.weight.data_ptr(), tuple(write.weight.shape))
            for other_rows, other in self.fp8.setdefault(key, []):
                if other != name and rows.start < other_rows.stop and other_rows.start < rows.stop:
                    raise _written_twice(other, name, f"rows {rows.start}:{rows.stop} of an FP8 weight of "
                                                      f"{write.state.prefix}")
            self.fp8[key].append((rows, name))
        for param, shard in record.plain_writes:
            for other_shard, other in self.plain.setdefault(id(param), []):
                if other != name and (shard == other_shard or not shard or not other_shard):  # "": all of it
                    raise _written_twice(other, name, _param_name(model, param))
            self.plain[id(param)].append((shard, name))


    def covers(self, model: torch.nn.Module) -> bool:
        """Whether these writes reach every parameter of the model on this rank (see :class:`Unwritten`)."""
        unwritten = Unwritten(model)
        unwritten.reached(self)
        return unwritten.empty


class Unwritten:
    """What of a model's parameters on this rank no write has reached yet, in :class:`Destinations`' terms: the rows
    of every FP8 weight (one per dense layer; one per local expert and weight of a FusedMoE layer; its scale goes with
    its rows) and every other parameter. Writes are added request by request (:meth:`reached`), overlaps included."""

    def __init__(self, model: torch.nn.Module):
        self.rows: dict[tuple[int, tuple[int, ...]], bytearray] = {}  # 1 where a row was written
        self.rows_left = 0
        owned: set[int] = set()
        for module in model.modules():
            if layer_state(module) is None:
                continue
            owned.update(id(p) for p in module.parameters(recurse=False))
            for weight in fp8_targets(module):
                self.rows[(weight.data_ptr(), tuple(weight.shape))] = bytearray(weight.shape[0])
                self.rows_left += weight.shape[0]
        self.plain = {id(p) for p in model.parameters() if id(p) not in owned}

    def reached(self, destinations: Destinations) -> None:
        """Count the writes of one request (or checkpoint)."""
        for key, written in destinations.fp8.items():
            mask = self.rows.get(key)
            if mask is None:
                continue
            for rows, _ in written:
                self.rows_left -= mask[rows.start:rows.stop].count(0)
                mask[rows.start:rows.stop] = b"\x01" * (rows.stop - rows.start)
        self.plain.difference_update(destinations.plain)

    @property
    def empty(self) -> bool:
        """Whether every parameter was reached."""
        return self.rows_left == 0 and not self.plain


def fp8_targets(module: torch.nn.Module) -> list[torch.Tensor]:
    """The 2-D FP8 weights a layer's loaders write: its ``weight``, or each local expert's ``w13``/``w2`` slice."""
    if hasattr(module, "w13_weight"):
        return [w.data[i] for w in (module.w13_weight, module.w2_weight) for i in range(w.shape[0])]
    return [module.weight.data]


def _written_twice(first: str, second: str, where: str) -> UpdateRejected:
    return UpdateRejected(f"{first!r} and {second!r} write the same {where} (one parameter under two names?); send "
                          "each parameter once")


def _param_name(model: torch.nn.Module, param: torch.nn.Parameter) -> str:
    return next((name for name, p in model.named_parameters() if p is param), f"parameter {tuple(param.shape)}")


def validate_request(model: torch.nn.Module, load_weights: Callable, named_tensors: NamedTensors,
                     destinations: Optional[Destinations] = None) -> Validated:
    """Check the whole request before anything is written; raise UpdateRejected naming the tensor and the reason.
    ``destinations``: the writes of earlier parts of the same update (a checkpoint validated in chunks)."""
    records = checked_dry_run(model, load_weights, named_tensors)
    replay = replays_writes(model)
    destinations = Destinations() if destinations is None else destinations
    result = Validated(destinations=destinations)
    for name, tensor in named_tensors:
        record = records[name]
        destinations.add(model, name, record)
        if not record.consumed:
            if not is_ignored_name(model, name):
                raise UpdateRejected(f"{name}: not a parameter of {type(model).__name__} (its load_weights ignored it)")
            result.ignored.append(name)
            continue
        for write in record.fp8_writes:
            scheme = write.state.decision.scheme.value
            result.fp8_layers[scheme] = result.fp8_layers.get(scheme, 0) + 1
        result.plain_params += record.plain_params
        if replay and record.replayable and not record.plain_params:
            result.replayed.append((name, tensor, tuple(record.fp8_writes)))
        elif replay and copies_whole(record, tensor):
            result.copied.append((name, tensor, tuple(record.plain_copies)))
        else:
            result.to_load.append((name, for_plain_params(name, tensor, record)))
        result.names.append(name)
    return result


STREAM_CHUNK = 64  # tensors validated together on the disk path (bounded host memory, few loader swaps)


def validate_stream(model: torch.nn.Module, load_weights: Callable, weights: Iterator[tuple[str, torch.Tensor]],
                    chunk: int = STREAM_CHUNK) -> Validated:
    """Validate a stream of tensors (a checkpoint's first pass) in chunks; what it would write, without the tensors."""
    total = Validated()
    seen: set[str] = set()
    destinations = Destinations()
    pending: list[tuple[str, torch.Tensor]] = []

    def flush() -> None:
        part = validate_request(model, load_weights, pending, destinations)
        total.ignored += part.ignored
        total.plain_params += part.plain_params
        for scheme, n in part.fp8_layers.items():
            total.fp8_layers[scheme] = total.fp8_layers.get(scheme, 0) + n
        total.names += part.names  # the tensors themselves are not kept: the second pass reads them again
        pending.clear()

    for name, tensor in weights:
        if name in seen:
            raise UpdateRejected(f"{name}: appears more than once in the checkpoint")
        seen.add(name)
        pending.append((name, tensor))
        if len(pending) == chunk:
            flush()
    if pending:
        flush()
    total.complete = destinations.covers(model)
    return total
