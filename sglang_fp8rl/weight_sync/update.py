"""Engine side of a weight update: validate the whole request, then write it in place; telemetry.

Every SGLang update path (`/update_weights_from_tensor` incl. flattened buckets, `/update_weights_from_distributed`,
`/update_weights_from_disk`, and the `sglang.Engine` methods) ends in ``model.load_weights``. :func:`attach` wraps that
method of a model served with `fp8_online_blockwise` by :class:`GuardedLoadWeights`:

1. **validate** (nothing is written): unique names; floating dtype; finite values (one read-only reduction per
   tensor, one device sync per request); and a *dry run* of the model's own ``load_weights`` over the whole request
   with every parameter's loader replaced by a checker, which proves that each name resolves to a parameter and that
   its shape fits (for FP8 layers through our sharding helpers, for BF16 parameters by running SGLang's loader into
   a scratch tensor). The dry run's outcome depends only on names, shapes and dtypes, so it is remembered per
   request signature and skipped when a trainer sends the same request again; the values are checked every time.
   Any failure raises
   :class:`UpdateRejected` naming the tensor and the reason; the model keeps its previous weights byte for byte;
2. **apply**: the model's own ``load_weights``, whose FP8 loaders re-quantize into the existing storage.

A failure *after* writing started cannot come from the request's content (it was validated); it would be a device
error. It is reported as such, and the engine is marked inconsistent (see :func:`engine_state`) until a later update
succeeds.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from sglang.srt.model_loader.weight_utils import default_weight_loader

from sglang_fp8rl.kernels.dispatch import check_nonfinite_flag
from sglang_fp8rl.layers.fp8_storage import CHECK_ATTR, layer_state, prevalidated_writes
from sglang_fp8rl.quant import FP8_DTYPE, extremes, extremes_finite_in_bf16

logger = logging.getLogger(__name__)

# names that SGLang's model loaders skip on purpose (not parameters); accepted and ignored
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
DRY_RUN_ERRORS = (ValueError, AssertionError, KeyError, RuntimeError, IndexError, TypeError)
DRY_RUN_CACHE_SIZE = 256  # request signatures remembered per model (an 8B model in 512 MB buckets uses ~33)
STREAM_CHUNK = 64  # tensors validated together on the disk path (bounded host memory, few loader swaps)


class UpdateRejected(ValueError):
    """A weight update refused during validation: nothing was written."""


class PartialUpdateError(RuntimeError):
    """A weight update failed after writing started: the engine holds a mix of old and new weights."""


# ---------------------------------------------------------------------------------------------------------------------
# telemetry and engine state


@dataclasses.dataclass
class UpdateStats:
    """What the last update did (readable from Python and, via the scheduler's internal state, over HTTP)."""

    index: int
    ok: bool
    message: str
    tensors: int = 0
    bytes: int = 0
    ignored: list[str] = dataclasses.field(default_factory=list)
    validate_s: float = 0.0
    apply_s: float = 0.0
    fp8_layers_written: dict[str, int] = dataclasses.field(default_factory=dict)
    bf16_params_written: int = 0
    peak_extra_bytes: Optional[int] = None  # CUDA: peak allocated during validate+apply minus allocated before

    def summary(self) -> str:
        """The one log line of an update."""
        if not self.ok:
            return f"[fp8rl] weight update #{self.index} REJECTED: {self.message}"
        layers = ", ".join(f"{k}={v}" for k, v in sorted(self.fp8_layers_written.items())) or "none"
        return (
            f"[fp8rl] weight update #{self.index}: {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB, "
            f"validate {self.validate_s * 1e3:.1f} ms, quantize+write {self.apply_s * 1e3:.1f} ms; "
            f"FP8 layers re-quantized: {layers}; BF16 params written: {self.bf16_params_written}"
            + (f"; peak extra GPU memory {self.peak_extra_bytes / 2**20:.1f} MiB" if self.peak_extra_bytes is not None
               else "")
            + (f"; ignored: {self.ignored}" if self.ignored else "")
        )


@dataclasses.dataclass
class EngineState:
    """Per-process update state: counts, the last update's stats, and whether the weights are consistent."""

    updates: int = 0
    last: Optional[UpdateStats] = None
    consistent: bool = True
    inconsistent_reason: str = ""


_STATE = EngineState()


def engine_state() -> EngineState:
    """This process's update state (the scheduler process on a server)."""
    return _STATE


def last_update_stats() -> Optional[dict[str, Any]]:
    """The last update's stats as a dict, or None if no update happened in this process."""
    return dataclasses.asdict(_STATE.last) if _STATE.last else None


def _record(stats: UpdateStats) -> None:
    _STATE.last = stats
    (logger.info if stats.ok else logger.warning)("%s", stats.summary())


# ---------------------------------------------------------------------------------------------------------------------
# per-tensor checks


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    """Reject non-tensors and non-floating or FP8 dtypes."""
    if not isinstance(tensor, torch.Tensor):
        raise UpdateRejected(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE:
        raise UpdateRejected(f"{name}: dtype {tensor.dtype} is not accepted (send bf16, fp16 or fp32 weights)")


def check_tensor(name: str, tensor: torch.Tensor) -> None:
    """Reject bad dtypes and values that are not finite in BF16, naming the first bad index."""
    check_dtype(name, tensor)
    if tensor.numel() and not extremes_finite_in_bf16(extremes(tensor)):
        bad = (~torch.isfinite(tensor.to(torch.bfloat16))).nonzero()[0].tolist()
        raise UpdateRejected(f"{name}: contains NaN/Inf in BF16 (first at index {bad}); nothing was written")


def check_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """check_tensor over a request with one host sync per device; the per-tensor pass runs only to name a culprit."""
    for name, tensor in named_tensors:
        check_dtype(name, tensor)
    ends_by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, tensor in named_tensors:
        if tensor.numel():
            ends_by_device.setdefault(tensor.device, []).append(extremes(tensor))
    if all(extremes_finite_in_bf16(torch.cat(ends)) for ends in ends_by_device.values()):
        return
    for name, tensor in named_tensors:
        check_tensor(name, tensor)


def check_unique(names: Sequence[str]) -> None:
    """Reject a request that names the same tensor twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise UpdateRejected(f"{name}: appears more than once in the same update")
        seen.add(name)


# ---------------------------------------------------------------------------------------------------------------------
# dry run of the model's own load_weights


@dataclasses.dataclass
class DryRunRecord:
    """Which parameters one tensor reached during a dry run."""

    fp8_layers: list[str] = dataclasses.field(default_factory=list)
    bf16_params: int = 0

    @property
    def consumed(self) -> bool:
        return bool(self.fp8_layers) or self.bf16_params > 0


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


@dataclasses.dataclass
class DryRunTarget:
    """Where the checkers record: the record of the tensor being dry-run now."""

    record: DryRunRecord = dataclasses.field(default_factory=DryRunRecord)


@contextlib.contextmanager
def dry_run_loaders(model: torch.nn.Module) -> Iterator[DryRunTarget]:
    """Replace every parameter's loader by a checker that records into ``target.record`` but never writes."""
    target = DryRunTarget()
    saved: dict[int, tuple[torch.nn.Parameter, Optional[Callable]]] = {}

    def make_checker(param: torch.nn.Parameter, real: Callable) -> Callable:
        def checker(p: torch.nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> None:
            # our FP8 parameters carry a side-effect-free twin of their loader; it returns the layer's prefix
            check = p.__dict__.get(CHECK_ATTR)
            if check is not None:
                target.record.fp8_layers.append(check(p, loaded, *args, **kwargs))
            else:
                _load_into_scratch(real, p, loaded, *args, **kwargs)
                target.record.bf16_params += 1

        return checker

    for param in model.parameters():
        real = _current_loader(param)
        saved[id(param)] = (param, real)
        _set_loader(param, make_checker(param, real or default_weight_loader))
    try:
        yield target
    finally:
        for param, real in saved.values():
            _set_loader(param, real)


def _rejected(model: torch.nn.Module, name: str, error: BaseException) -> UpdateRejected:
    return UpdateRejected(f"{name}: not accepted by {type(model).__name__}.load_weights: {type(error).__name__}: "
                          f"{error}")


def dry_run_each(model: torch.nn.Module, load_weights: Callable,
                 named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, DryRunRecord]:
    """Dry-run each named tensor in its own load_weights call (exact attribution); raise UpdateRejected."""
    records: dict[str, DryRunRecord] = {}
    with dry_run_loaders(model) as target:
        for name, tensor in named_tensors:
            target.record = DryRunRecord()
            try:
                load_weights([(name, tensor)])
            except DRY_RUN_ERRORS as e:
                raise _rejected(model, name, e) from e
            records[name] = target.record
    return records


def dry_run(model: torch.nn.Module, load_weights: Callable,
            named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, DryRunRecord]:
    """Dry-run a whole request in one load_weights call, attributing each loader call to the tensor being iterated.

    SGLang's loaders handle each item before pulling the next, so the attribution is exact. A model that buffers
    items (loader calls after the stream ended, or a name that reached nothing), or any error, is dry-run again
    tensor by tensor, so that verdicts and messages never depend on the batching."""
    records: dict[str, DryRunRecord] = {}
    with dry_run_loaders(model) as target:
        def stream():
            for name, tensor in named_tensors:
                target.record = records.setdefault(name, DryRunRecord())
                yield name, tensor
            target.record = DryRunRecord()  # collects calls made after the last item

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


# ---------------------------------------------------------------------------------------------------------------------
# validate + apply


def request_signature(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple:
    """What a dry run's outcome depends on: the names, shapes, dtypes and device types, in order (not the values)."""
    return tuple((name, tuple(t.shape), t.dtype, t.device.type) for name, t in named_tensors)


def cached_dry_run(model: torch.nn.Module, load_weights: Callable,
                   named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, DryRunRecord]:
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


def validate_update(model: torch.nn.Module, load_weights: Callable,
                    named_tensors: Sequence[tuple[str, torch.Tensor]], stats: UpdateStats) -> list[tuple[str, torch.Tensor]]:
    """Check the whole request before anything is written; returns the tensors to load (ignored names dropped)."""
    check_unique([name for name, _ in named_tensors])
    check_tensors(named_tensors)
    records = cached_dry_run(model, load_weights, named_tensors)
    to_load = []
    for name, tensor in named_tensors:
        record = records[name]
        if not record.consumed:
            if not is_ignored_name(model, name):
                raise UpdateRejected(f"{name}: not a parameter of {type(model).__name__} (its load_weights ignored it)")
            stats.ignored.append(name)
            continue
        for prefix in record.fp8_layers:
            scheme = model_layer_scheme(model, prefix)
            stats.fp8_layers_written[scheme] = stats.fp8_layers_written.get(scheme, 0) + 1
        stats.bf16_params_written += record.bf16_params
        to_load.append((name, tensor))
    return to_load


def model_layer_scheme(model: torch.nn.Module, prefix: str) -> str:
    """Scheme name ('block'/'channel') of one of the model's FP8 layers."""
    cache = model.__dict__.setdefault("_fp8rl_scheme_by_prefix", {})
    if not cache:
        for module in model.modules():
            state = layer_state(module)
            if state is not None:
                cache[state.prefix] = state.decision.scheme.value
    return cache[prefix]


def _start_peak_tracking(device: torch.device) -> Optional[int]:
    """On CUDA, reset the allocator's peak counter and return the bytes allocated now (None elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _model_device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _synchronize(model: torch.nn.Module) -> None:
    device = _model_device(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GuardedLoadWeights:
    """Replacement for ``model.load_weights``: lists are validated then applied; iterators stream through."""

    def __init__(self, model: torch.nn.Module, original: Callable):
        self.model = model
        self.original = original

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]):
        if not isinstance(weights, (list, tuple)):
            # initial load and the disk path (validated up front by the engine hook) stream tensor by tensor
            return self.original(weights)
        return self.update(list(weights))

    def update(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Validate, then apply one update request."""
        _STATE.updates += 1
        stats = UpdateStats(index=_STATE.updates, ok=False, message="")
        stats.tensors = len(named_tensors)
        stats.bytes = sum(t.numel() * t.element_size() for _, t in named_tensors if isinstance(t, torch.Tensor))
        device = _model_device(self.model)
        allocated_before = _start_peak_tracking(device)
        t0 = time.perf_counter()
        try:
            to_load = validate_update(self.model, self.original, named_tensors, stats)
        except UpdateRejected as e:
            stats.message = str(e)
            _record(stats)
            raise
        t1 = time.perf_counter()
        stats.validate_s = t1 - t0
        try:
            with prevalidated_writes(_model_device(self.model)) as flag:
                self.original(to_load)
            if flag is not None:
                check_nonfinite_flag(flag, dict(to_load))  # cannot trip after validation; defence in depth
            _synchronize(self.model)
        except (RuntimeError, ValueError, AssertionError) as e:
            _STATE.consistent = False
            _STATE.inconsistent_reason = f"update #{stats.index} failed after writing started: {e}"
            stats.message = _STATE.inconsistent_reason
            _record(stats)
            raise PartialUpdateError(
                f"{_STATE.inconsistent_reason}. The engine holds a mix of old and new weights; "
                "send a complete update before serving again."
            ) from e
        stats.apply_s = time.perf_counter() - t1
        if allocated_before is not None:
            stats.peak_extra_bytes = torch.cuda.max_memory_allocated(device) - allocated_before
        stats.ok = True
        stats.message = "ok"
        _STATE.consistent = True
        _STATE.inconsistent_reason = ""
        _record(stats)


def is_attached(model: torch.nn.Module) -> bool:
    """Whether the model's load_weights is already guarded."""
    return isinstance(model.__dict__.get("load_weights"), GuardedLoadWeights)


def attach(model: torch.nn.Module) -> bool:
    """Guard ``model.load_weights`` if the model has layers quantized by this package; returns whether it did."""
    if is_attached(model):
        return True
    if not any(layer_state(m) is not None for m in model.modules()):
        return False
    model.load_weights = GuardedLoadWeights(model, model.load_weights)
    return True


def validate_stream(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    chunk: int = STREAM_CHUNK) -> int:
    """Validate a stream of tensors (the disk path's first pass) in chunks; returns how many were checked."""
    guard = model.__dict__.get("load_weights")
    original = guard.original if isinstance(guard, GuardedLoadWeights) else model.load_weights
    stats = UpdateStats(index=0, ok=False, message="")
    seen: set[str] = set()
    count = 0
    pending: list[tuple[str, torch.Tensor]] = []
    for name, tensor in weights:
        if name in seen:
            raise UpdateRejected(f"{name}: appears more than once in the checkpoint")
        seen.add(name)
        pending.append((name, tensor))
        if len(pending) == chunk:
            validate_update(model, original, pending, stats)
            count += len(pending)
            pending = []
    if pending:
        validate_update(model, original, pending, stats)
        count += len(pending)
    return count
