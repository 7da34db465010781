"""Run a snippet with TRITON_INTERPRET=1 in a fresh interpreter (Triton picks the interpreter at import time)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_under_interpreter(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a subprocess under the Triton interpreter, with this checkout first on the path."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)
