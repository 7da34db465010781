"""This process's FP8 KV-scale state: the mode, the calibration batch, whether a recalibration is due, and the record
of the last scales written. One :class:`KVScaleState` per process, ``OWNERS.kv_scales`` (:mod:`sglang_fp8rl.engine`);
its transitions are :mod:`.engine`'s, its writes :mod:`.calibrate`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Optional

from sglang_fp8rl.engine import OWNERS, declare
from sglang_fp8rl.kv_scales.numerics import ScalePolicy

if TYPE_CHECKING:  # calibrate imports this module
    from sglang_fp8rl.kv_scales.calibrate import Calibration

logger = logging.getLogger(__name__)


class KVScaleRecord:
    """The last scales written and how they were obtained (for /get_server_info); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last: Optional[Calibration] = None
        self.count = 0

    def record(self, calibration: Calibration) -> None:
        """Remember one write and log it once."""
        with self._lock:
            self.last = calibration
            self.count += 1
        logger.info("%s", calibration.summary())

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly telemetry: per-layer scales, amax, time and source of the last write."""
        with self._lock:
            last, count = self.last, self.count
        if last is None:
            return {"writes": 0}
        return {"writes": count, "source": last.source, "time": last.finished_at, "seconds": last.seconds,
                "tokens": last.tokens, "sequences": last.sequences, "changed_layers": list(last.changed),
                "scales": {str(i): list(s) for i, s in last.scales.items()},
                "amax": {str(i): list(a) for i, a in last.amax.items()}}


@dataclasses.dataclass
class KVScaleState:
    """This process's KV-scale state (set at load in ``calibrate`` mode), and the record of the scales written."""

    mode: str = "static"
    explicit: bool = False  # the user asked for calibrate (not auto): an unverified backend is then an error
    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    batch_source: str = ""
    policy: ScalePolicy = dataclasses.field(default_factory=ScalePolicy)
    due: bool = False  # a step ended since the last successful calibration
    deferred: int = 0  # due recalibrations skipped because the engine was busy or short of KV slots
    fused_write: bool = False  # --fp8rl-kv-write fused: one kernel writes calibrated K/V (kernels/kv_store.py)
    # the scales in force when the layers got their tensors (SGLang's, normally 1.0): every calibration runs under
    # them, so that a recalibration measures what a fresh server's start-up calibration measures
    calibrated_under: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    record: KVScaleRecord = dataclasses.field(default_factory=KVScaleRecord)  # the last scales written

    @property
    def calibrating(self) -> bool:
        """Whether this engine measures its KV scales."""
        return self.mode == "calibrate"


declare("kv_scales", KVScaleState)


def kv_state() -> KVScaleState:
    """This process's KV-scale state: ``OWNERS.kv_scales``."""
    return OWNERS.kv_scales
