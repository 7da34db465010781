"""SGLang's tensor-parallel groups, and one verdict for all TP ranks: an update is applied everywhere or nowhere.

Each TP rank validates and writes its own shard. A rank-local failure (out of memory in a dry-run scratch, a device
error while writing) must not leave ranks on different weights, or the next all-reduce mixes two policies, or hangs
when the failed rank refuses requests the others schedule. So every guarded update exchanges its local verdict over
SGLang's TP CPU group (gloo) twice: after validation (any rank rejects: every rank rejects, nothing is written) and
after writing (any rank failed: every rank is marked inconsistent). Every rank makes the same exchanges in the same
order whatever happens locally, so the exchanges always pair up. The KV-scale calibration agrees the same way at
each of its stages (kv_scales/forward.py) and all-reduces its amax over the TP device group (:func:`tp_device_group`).

Imports nothing of ours: both ``weight_sync/`` and ``kv_scales/`` use it (docs/ARCHITECTURE.md, layers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One rank's outcome of a phase: ok, or the reason it failed."""

    ok: bool
    message: str = ""
    wrote: bool = False  # the rank started writing weights in this request


def tp_cpu_group() -> Optional[Any]:
    """SGLang's TP CPU (gloo) group when this process is one of several TP ranks, else None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    from sglang.srt.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return group.cpu_group if group.world_size > 1 else None


def tp_device_group() -> Optional[Any]:
    """The TP group of device tensors (for the amax all-reduce), None with a single rank."""
    from sglang.srt.distributed import parallel_state

    group = parallel_state.get_tp_group()
    return group.device_group if group.world_size > 1 else None


def combine(verdicts: list[Verdict]) -> Verdict:
    """ok if every rank is ok, else the failures, each prefixed with its rank; ``wrote`` if any rank wrote."""
    wrote = any(v.wrote for v in verdicts)
    failed = [(rank, v) for rank, v in enumerate(verdicts) if not v.ok]
    if not failed:
        return Verdict(True, wrote=wrote)
    if len(verdicts) == 1:
        return failed[0][1]
    return Verdict(False, "; ".join(f"TP rank {rank}: {v.message}" for rank, v in failed), wrote=wrote)


def gather(local: Any, group: Optional[Any] = None) -> list[Any]:
    """Every TP rank's ``local``, in rank order (``[local]`` without a TP group). Every rank must call it."""
    group = tp_cpu_group() if group is None else group
    if group is None:
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return gathered


def agree(local: Verdict, group: Optional[Any] = None) -> Verdict:
    """The combined verdict of every TP rank (``local`` itself without a TP group)."""
    gathered = gather(local, group)
    if len(gathered) == 1:
        return local
    return combine([v if isinstance(v, Verdict) else Verdict(False, f"unreadable verdict {v!r}") for v in gathered])
