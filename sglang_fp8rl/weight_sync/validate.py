"""Validation of a weight update, without writing anything: per-tensor checks, then a dry run of ``load_weights``.

Per tensor: a string name, unique in the request; a BF16/FP16/FP32 tensor; values finite once rounded to BF16 (one
read-only reduction per tensor, one device sync per request). Then a *dry run* of the model's own ``load_weights``
over the whole request, with every parameter's loader replaced by a checker: our FP8 parameters run their loader's
side-effect-free twin (``CHECK_ATTR``: placement and full shape through :mod:`sglang_fp8rl.layers.placement`); other
parameters get our shape rule (:func:`check_plain_shape`: SGLang's loaders check only some dimensions) and then
SGLang's own loader into a scratch tensor. The dry run's outcome depends only on names, shapes and dtypes, so
it is remembered per request signature. Every failure raises :class:`UpdateRejected` naming the tensor and reason.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from sglang.srt.layers.linear import LinearBase, ReplicatedLinear
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_loader.weight_utils import default_weight_loader

from sglang_fp8rl.layers.fp8_storage import CHECK_ATTR, IncomingWrite, is_prequantized
from sglang_fp8rl.layers.moe import EXPERT_WEIGHTS, unquantized_expert_shape
from sglang_fp8rl.layers.placement import placement_for_layer
from sglang_fp8rl.quant import FP8_DTYPE, UNQUANTIZED_DTYPES, extremes, extremes_finite_in_bf16
from sglang_fp8rl.weight_sync.finite import all_finite_in_bf16

NamedTensors = Sequence[tuple[str, torch.Tensor]]

WIRE_DTYPES = UNQUANTIZED_DTYPES + (FP8_DTYPE,)  # what may travel: FP8 E4M3 codes only with their scales
# names that SGLang's model loaders skip on purpose (not parameters); accepted and ignored
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# what SGLang's loaders raise on a tensor they do not take (asserts included)
DRY_RUN_ERRORS = (ValueError, AssertionError, KeyError, RuntimeError, IndexError, TypeError, AttributeError)
DRY_RUN_CACHE_SIZE = 256  # request signatures remembered per model (an 8B model in 512 MB buckets uses ~33)
# SGLang's loaders that write a same-size tensor as ``param.data.copy_(loaded)`` and nothing else (every supported
# release, off NPU and GGUF): the default one (norms) and ReplicatedLinear's (MoE routers, linear.py's
# ReplicatedLinear.weight_loader). Their writes replay as one multi-tensor copy instead of a load_weights call,
# which costs a walk of the model's parameters per request (~4 ms at 24 MoE layers, RESULTS 29b).
WHOLE_COPY_LOADERS = (default_weight_loader, ReplicatedLinear.weight_loader)


class UpdateRejected(ValueError):
    """A weight update refused during validation: nothing was written."""


# ---------------------------------------------------------------------------------------------------------------------
# per-tensor checks


def check_name(name: object) -> str:
    """Reject names that are not non-empty strings (SGLang's loaders would raise on them while writing)."""
    if not isinstance(name, str) or not name:
        raise UpdateRejected(f"{name!r}: a tensor name must be a non-empty string, got {type(name).__name__}")
    return name


def check_dtype(name: str, tensor: object) -> None:
    """Reject non-tensors and dtypes other than BF16/FP16/FP32 (and FP8 E4M3 codes paired with their scales)."""
    if not isinstance(tensor, torch.Tensor):
        raise UpdateRejected(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in UNQUANTIZED_DTYPES and not is_prequantized(tensor):
        raise UpdateRejected(f"{name}: dtype {tensor.dtype} is not accepted (send bf16, fp16 or fp32 weights, or "
                             "float8_e4m3fn codes with their weight_scale_inv)")


def check_tensor(name: str, tensor: torch.Tensor) -> None:
    """Reject bad dtypes and values that are not finite in BF16, naming the first bad index."""
    check_dtype(name, tensor)
    if tensor.numel() and not is_prequantized(tensor) and not extremes_finite_in_bf16(extremes(tensor)):
        bad = (~torch.isfinite(tensor.to(torch.bfloat16))).nonzero()[0].tolist()
        raise UpdateRejected(f"{name}: contains NaN/Inf in BF16 (first at index {bad}); nothing was written")


def check_tensors(named_tensors: NamedTensors) -> None:
    """check_tensor over a request: one multi-tensor reduction per (device, dtype) and one host sync per device; the
    exact per-tensor check runs only when that flags something, to name the culprit (or clear a false alarm)."""
    for name, tensor in named_tensors:
        check_dtype(check_name(name), tensor)
    if not all_finite_in_bf16([t for _, t in named_tensors if t.numel() and not is_prequantized(t)]):
        for name, tensor in named_tensors:
            check_tensor(name, tensor)


def request_bytes(named_tensors: Sequence[tuple[Any, Any]]) -> int:
    """Bytes of the tensors of a request (other entries count 0)."""
    return sum(t.numel() * t.element_size() for _, t in named_tensors if isinstance(t, torch.Tensor))


def check_unique(names: Sequence[str]) -> None:
    """Reject a request that names the same tensor twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise UpdateRejected(f"{name}: appears more than once in the same update")
        seen.add(name)


# ---------------------------------------------------------------------------------------------------------------------
# the shape rule for parameters that are not ours (BF16: embeddings, norms, lm_head, routers, layers kept in BF16)


def shard_id_of(owner: Optional[torch.nn.Module], args: tuple, kwargs: dict) -> Any:
    """The shard a loader call writes (``loaded_shard_id`` of a linear, ``shard_id`` of a FusedMoE), or None."""
    if isinstance(owner, FusedMoE):  # FusedMoE.weight_loader(param, loaded, weight_name, shard_id, expert_id)
        return kwargs.get("shard_id", args[1] if len(args) > 1 else None)
    return args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))


def loader_shard(args: tuple, kwargs: dict) -> str:
    """Which part of a parameter a loader call writes: its arguments after the tensor, as text ("" for the whole)."""
    return repr(args + tuple(sorted(kwargs.items()))) if args or kwargs else ""


def expected_full_shape(owner: Optional[torch.nn.Module], param_name: str, param: torch.nn.Parameter,
                        shard_id: Any) -> Optional[tuple[int, ...]]:
    """The exact shape the tensor of a weight is sent in, where it is known: linear weights (our placement helpers,
    tested against SGLang's loaders), vocabulary embeddings / lm_head (the original vocabulary) and one expert's
    tensor of a FusedMoE kept in BF16."""
    if isinstance(owner, FusedMoE) and param_name in EXPERT_WEIGHTS:
        return unquantized_expert_shape(owner, param_name, shard_id)
    if param_name != "weight" or param.dim() != 2:
        return None
    if isinstance(owner, LinearBase):
        return tuple(placement_for_layer(owner, shard_id).full_shape)
    if isinstance(owner, VocabParallelEmbedding) and not getattr(owner, "use_presharded_weights", False):
        return int(owner.org_vocab_size), int(owner.embedding_dim)
    return None


def check_plain_shape(owner: Optional[torch.nn.Module], param_name: str, param: torch.nn.Parameter,
                      loaded: torch.Tensor, shard_id: Any = None) -> None:
    """ValueError unless ``loaded`` has the full shape the parameter is loaded from.

    SGLang's loaders narrow the dimension they shard and may broadcast the others (the vocab loader checks only the
    first dimension, so a [V, 1] tensor would fill every column). Linear weights and embeddings have an exactly
    known full shape; other parameters must match in rank and in every dimension but the one a loader shards."""
    if param.numel() == 1 and loaded.numel() == 1:
        return  # SGLang's default loader fills a one-element parameter from any one-element tensor
    expected = expected_full_shape(owner, param_name, param, shard_id)
    if expected is not None:
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected the full shape {expected}, got {tuple(loaded.shape)}")
        return
    if loaded.dim() != param.dim():
        raise ValueError(f"expected a {param.dim()}-D tensor like the parameter {tuple(param.shape)}, "
                         f"got shape {tuple(loaded.shape)}")
    sharded = {getattr(param, attr, None) for attr in ("output_dim", "packed_dim")} - {None}
    for dim, (want, got) in enumerate(zip(param.shape, loaded.shape)):
        if dim not in sharded and want != got:
            raise ValueError(f"dimension {dim} is {got}, the parameter's is {want} (shape {tuple(param.shape)})")


# ---------------------------------------------------------------------------------------------------------------------
# dry run of the model's own load_weights


@dataclasses.dataclass
class DryRunRecord:
    """Which parameters one tensor reached during a dry run, and where it writes in our FP8 layers."""

    fp8_writes: list[IncomingWrite] = dataclasses.field(default_factory=list)
    plain_params: int = 0
    # plain parameters whose loader is SGLang's default one copying the request's own tensor whole (norms): the
    # write is ``param.data.copy_(tensor)``, replayable as such
    plain_copies: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    # (parameter, loader_shard) of every plain loader call: where two tensors of one request would write the same part
    plain_writes: list[tuple[torch.nn.Parameter, str]] = dataclasses.field(default_factory=list)
    # every FP8 loader call received the request's own tensor (not a view or copy the model made): its writes can
    # be replayed on the next request's tensor of the same name
    replayable: bool = True

    @property
    def consumed(self) -> bool:
        """Whether the tensor reached any parameter."""
        return bool(self.fp8_writes) or self.plain_params > 0


@dataclasses.dataclass
class DryRunTarget:
    """Where the checkers record: the record of the tensor being dry-run now, and that tensor."""

    record: DryRunRecord = dataclasses.field(default_factory=DryRunRecord)
    tensor: Optional[torch.Tensor] = None


def _load_into_scratch(real_loader: Callable, param: torch.nn.Parameter, loaded: torch.Tensor, *args,
                       **kwargs) -> None:
    """Run SGLang's own loader of a parameter into a scratch tensor: its checks run, the parameter is untouched.

    The scratch must be real memory of the parameter's device and dtype: ``param.data`` only accepts a tensor of
    the same type (no ``meta``), and a loader bound to the parameter object writes through ``param.data``. So the
    dry run of a BF16 parameter costs one temporary of its size (the largest is the embedding)."""
    original = param.data
    param.data = torch.empty_like(original)
    try:
        real_loader(param, loaded, *args, **kwargs)
    finally:
        param.data = original


def _current_loader(param: torch.nn.Parameter) -> Optional[Callable]:
    return param.__dict__.get("_weight_loader") or param.__dict__.get("weight_loader")


def _set_loader(param: torch.nn.Parameter, loader: Optional[Callable]) -> None:
    # SGLang's vLLM-style parameters expose weight_loader as a read-only property over _weight_loader
    key = "_weight_loader" if "_weight_loader" in param.__dict__ else "weight_loader"
    if loader is None:
        param.__dict__.pop(key, None)
    else:
        param.__dict__[key] = loader


def param_owners(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, str]]:
    """id(param) -> (owning module, attribute name), computed once per model."""
    owners = model.__dict__.get("_fp8rl_param_owners")
    if owners is None:
        owners = {id(p): (m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False)}
        model.__dict__["_fp8rl_param_owners"] = owners
    return owners


@contextlib.contextmanager
def replaced_loaders(model: torch.nn.Module, make: Callable[[torch.nn.Parameter, Callable], Callable]
                     ) -> Iterator[None]:
    """Inside the block, every parameter's loader is ``make(param, its real loader)``; restored after."""
    saved: dict[int, tuple[torch.nn.Parameter, Optional[Callable]]] = {}
    for param in model.parameters():
        real = _current_loader(param)
        saved[id(param)] = (param, real)
        _set_loader(param, make(param, real or default_weight_loader))
    try:
        yield
    finally:
        for param, real in saved.values():
            _set_loader(param, real)


def loader_copies_whole(loader: Callable, param: torch.nn.Parameter, loaded: torch.Tensor, args: tuple,
                        kwargs: dict) -> bool:
    """Whether this loader call is ``param.data.copy_(loaded)`` and nothing else (see WHOLE_COPY_LOADERS)."""
    func = loader.__func__ if inspect.ismethod(loader) else loader  # ReplicatedLinear's is a bound method
    return (func in WHOLE_COPY_LOADERS and not args and not kwargs and param.size() == loaded.size()
            and not getattr(param, "is_gguf_weight", False) and not getattr(param, "is_gguf_weight_type", False))


@contextlib.contextmanager
def dry_run_loaders(model: torch.nn.Module) -> Iterator[DryRunTarget]:
    """Replace every parameter's loader by a checker that records into ``target.record`` but never writes."""
    target = DryRunTarget()
    owners = param_owners(model)

    def make_checker(param: torch.nn.Parameter, real: Callable) -> Callable:
        def checker(p: torch.nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> None:
            # our FP8 parameters carry a side-effect-free twin of their loader; it returns where the loader would write
            check = p.__dict__.get(CHECK_ATTR)
            if check is not None:
                target.record.fp8_writes.append(check(p, loaded, *args, **kwargs))
                target.record.replayable &= loaded is target.tensor
                return
            owner, param_name = owners.get(id(p), (None, ""))
            check_plain_shape(owner, param_name, p, loaded, shard_id_of(owner, args, kwargs))
            _load_into_scratch(real, p, loaded, *args, **kwargs)
            target.record.plain_params += 1
            target.record.plain_writes.append((p, loader_shard(args, kwargs)))
            if loader_copies_whole(real, p, loaded, args, kwargs) and loaded is target.tensor:
                target.record.plain_copies.append(p)

        return checker

    with replaced_loaders(model, make_checker):
        yield target


def _rejected(model: torch.nn.Module, name: str, error: BaseException) -> UpdateRejected:
    return UpdateRejected(f"{name}: not accepted by {type(model).__name__}.load_weights: {type(error).__name__}: "
                          f"{error}")


def dry_run_each(model: torch.nn.Module, load_weights: Callable,
                 named_tensors: NamedTensors) -> dict[str, DryRunRecord]:
    """Dry-run each named tensor in its own load_weights call (exact attribution); raise UpdateRejected."""
    records: dict[str, DryRunRecord] = {}
    with dry_run_loaders(model) as target:
        for name, tensor in named_tensors:
            target.record, target.tensor = DryRunRecord(), tensor
            try:
                load_weights([(name, tensor)])
            except DRY_RUN_ERRORS as e:
                raise _rejected(model, name, e) from e
            records[name] = target.record
    return records


def dry_run(model: torch.nn.Module, load_weights: Callable, named_tensors: NamedTensors) -> dict[str, DryRunRecord]:
    """Dry-run a whole request in one load_weights call, attributing each loader call to the tensor being iterated.

    SGLang's loaders handle each item before pulling the next, so the attribution is exact. A model that buffers
    items (loader calls after the stream ended, or a name that reached nothing), or any error, is dry-run again
    tensor by tensor, so that verdicts and messages never depend on the batching."""
    records: dict[str, DryRunRecord] = {}
    with dry_run_loaders(model) as target:
        def stream():
            for name, tensor in named_tensors:
                target.record, target.tensor = records.setdefault(name, DryRunRecord()), tensor
                yield name, tensor
            target.record, target.tensor = DryRunRecord(), None  # collects calls made after the last item

        try:
            load_weights(stream())
            batched_ok = not target.record.consumed
        except DRY_RUN_ERRORS:
            batched_ok = False
    if batched_ok and all(r.consumed or is_ignored_name(model, n) for n, r in records.items()):
        return records
    return dry_run_each(model, load_weights, named_tensors)


def is_ignored_name(model: torch.nn.Module, name: str) -> bool:
    """Names the model's loader skips on purpose: rotary caches, and lm_head of a tied-embedding model."""
    if name.endswith(IGNORED_SUFFIXES):
        return True
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    return tied and name.split(".")[-2:] == ["lm_head", "weight"]


def request_signature(named_tensors: NamedTensors) -> tuple:
    """What a dry run's outcome depends on: the names, shapes, dtypes and device types, in order (not the values)."""
    return tuple((name, tuple(t.shape), t.dtype, t.device.type) for name, t in named_tensors)


def cached_dry_run(model: torch.nn.Module, load_weights: Callable,
                   named_tensors: NamedTensors) -> dict[str, DryRunRecord]:
    """dry_run, remembered per request signature: an RL trainer sends the same names and shapes every step."""
    cache = model.__dict__.setdefault("_fp8rl_dry_runs", collections.OrderedDict())
    key = request_signature(named_tensors)
    records = cache.get(key)
    if records is None:
        records = dry_run(model, load_weights, named_tensors)  # raises UpdateRejected: nothing is remembered
        cache[key] = records
        if len(cache) > DRY_RUN_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return records


def checked_dry_run(model: torch.nn.Module, load_weights: Callable,
                    named_tensors: NamedTensors) -> dict[str, DryRunRecord]:
    """A whole request's checks in order: each tensor (name, dtype, finite values), unique names, then the
    (remembered) dry run of ``load_weights``; UpdateRejected at the first failure."""
    check_tensors(named_tensors)
    check_unique([name for name, _ in named_tensors])
    return cached_dry_run(model, load_weights, named_tensors)
