"""The one atomic JSON writer of the package (the GEMM-selection cache and the record of warmed JIT kernels)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any


def write_json_atomic(path: str, data: Any) -> str:
    """Write ``data`` as JSON through a temp file and a rename: readers see the old file or the new one, whole."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        # a failed dump (disk full, a value JSON cannot hold) must not leave its temp file beside the real one
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
