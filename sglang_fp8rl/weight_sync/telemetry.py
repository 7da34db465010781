"""What each update did: its stats (:class:`UpdateStats`), one log line, and the last one kept for telemetry.

The count of updates and the last stats live in the engine's state (weight_sync/engine_state.py), where the
scheduler's telemetry (hooks/scheduler.py) and :func:`last_update_stats` read them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Optional

import torch

from sglang_fp8rl.weight_sync.engine_state import engine_state
from sglang_fp8rl.weight_sync.request import Validated
from sglang_fp8rl.weight_sync.validate import NamedTensors, request_bytes
from sglang_fp8rl.weight_sync.write import model_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class UpdateStats:
    """What the last update did (readable from Python and, via the scheduler's internal state, over HTTP)."""

    index: int
    ok: bool = False
    message: str = ""
    source: str = ""
    tensors: int = 0
    bytes: int = 0
    ignored: list[str] = dataclasses.field(default_factory=list)
    validate_s: float = 0.0
    apply_s: float = 0.0
    fp8_layers_written: dict[str, int] = dataclasses.field(default_factory=dict)
    bf16_params_written: int = 0
    replayed_tensors: int = 0  # written at their dry-run placement, without the model's load_weights
    peak_extra_bytes: Optional[int] = None  # CUDA: peak allocated during validate+apply minus allocated before

    def count(self, named_tensors: NamedTensors) -> None:
        """Record the request's size."""
        self.tensors = len(named_tensors)
        self.bytes = request_bytes(named_tensors)

    def add(self, validated: Validated) -> None:
        """Record what a validated request will write."""
        self.ignored += validated.ignored
        for scheme, n in validated.fp8_layers.items():
            self.fp8_layers_written[scheme] = self.fp8_layers_written.get(scheme, 0) + n
        self.bf16_params_written += validated.plain_params
        self.replayed_tensors += len(validated.replayed) + len(validated.copied)

    def summary(self) -> str:
        """The one log line of an update."""
        if not self.ok:
            return f"[fp8rl] weight update #{self.index} ({self.source}) REJECTED: {self.message}"
        layers = ", ".join(f"{k}={v}" for k, v in sorted(self.fp8_layers_written.items())) or "none"
        return (
            f"[fp8rl] weight update #{self.index} ({self.source}): {self.tensors} tensors, "
            f"{self.bytes / 2**20:.1f} MiB, validate {self.validate_s * 1e3:.1f} ms, "
            f"quantize+write {self.apply_s * 1e3:.1f} ms; FP8 layers re-quantized: {layers}; "
            f"BF16 params written: {self.bf16_params_written}; replayed without load_weights: "
            f"{self.replayed_tensors}"
            + (f"; peak extra GPU memory {self.peak_extra_bytes / 2**20:.1f} MiB" if self.peak_extra_bytes is not None
               else "")
            + (f"; ignored: {self.ignored}" if self.ignored else "")
        )


def new_stats(source: str) -> UpdateStats:
    """Stats of a new update request (numbered in this process)."""
    state = engine_state()
    state.updates += 1
    return UpdateStats(index=state.updates, source=source)


def record(stats: UpdateStats) -> None:
    """Remember and log the outcome of an update."""
    engine_state().last = stats
    (logger.info if stats.ok else logger.warning)("%s", stats.summary())


def last_update_stats() -> Optional[dict[str, Any]]:
    """The last update's stats as a dict, or None if no update happened in this process."""
    last = engine_state().last
    return dataclasses.asdict(last) if last else None


@contextlib.contextmanager
def measured(source: str, model: torch.nn.Module) -> Iterator[UpdateStats]:
    """The stats of a new update request; on CUDA, the peak extra memory allocated inside the block goes into them."""
    stats = new_stats(source)
    device = model_device(model)
    if device.type != "cuda":
        yield stats
        return
    torch.cuda.reset_peak_memory_stats(device)
    before = _allocated_bytes(device).get("current", 0)
    try:
        yield stats
    finally:
        stats.peak_extra_bytes = _allocated_bytes(device).get("peak", 0) - before


def _allocated_bytes(device: torch.device) -> dict[str, int]:
    """The caching allocator's allocated-bytes counters (current, peak, ...), read without torch.cuda.memory_stats'
    flattening of every counter into one dict (about 0.3 ms a call, twice per update request)."""
    return torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {})
