"""Where this package's Triton kernels may be programmatic dependent launches (Triton-free: a query only)."""

from __future__ import annotations

import functools
import os

import torch

MIN_MAJOR = 9  # compute capability 9.0 (Hopper) and later, as sgl-kernel's own ``enable_pdl`` default decides
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the Triton interpreter runs no inline PTX, no griddepcontrol


@functools.cache
def capable(device: torch.device) -> bool:
    """Whether a launch on ``device`` can be a programmatic dependent launch."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] >= MIN_MAJOR
