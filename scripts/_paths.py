"""`import _paths` first in a script of scripts/: the modules it shares with the others become importable.

A script run by path (`python scripts/X.py`) has scripts/ on sys.path already; this adds, right after it,
scripts/gpu/ (the server helpers and the model writer, which also run on their own there) and the checkout's root, so
that a script measures this checkout's sglang_fp8rl even where another copy is installed, and runs where none is (a
CPU dry run on a bare machine). tests/conftest.py puts scripts/ and scripts/gpu/ on sys.path for the tests.
"""
from __future__ import annotations

import os
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
GPU = os.path.join(SCRIPTS, "gpu")
ROOT = os.path.dirname(SCRIPTS)

for _i, _path in enumerate((GPU, ROOT), start=1):
    if _path not in sys.path:
        sys.path.insert(_i, _path)
