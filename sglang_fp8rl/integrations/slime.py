"""slime (THUDM/slime) and Miles (radixark/miles): `--sglang-quantization fp8_online_blockwise` with their own train.py.

Both frameworks touch SGLang in two processes before SGLang's plugin loader has run there:

* the driver builds one argparse parser from ``ServerArgs.add_cli_args`` (every flag prefixed ``--sglang-``), so our
  name is an "invalid choice" unless it is in ``QUANTIZATION_CHOICES`` first: :func:`register_quantization_choice`,
  which ``python -m sglang_fp8rl.integrations.slime train.py ...`` (:func:`main`) calls before running the script;
* each rollout Ray actor builds ``ServerArgs(**kwargs)``, whose ``__post_init__`` validates the quantization against
  ``QUANTIZATION_METHODS`` (so also with ``--sglang-config`` overrides, which skip argparse): :func:`ray_worker_setup`,
  installed as the job's Ray ``worker_process_setup_hook``, loads SGLang's plugins in every worker first (the same
  hook serves verl, whose rollout actor builds ``ServerArgs(**args)`` too).

From there SGLang's own launcher loads the plugin in every server process, as with ``python -m sglang.launch_server``.
Only ``sglang`` and :mod:`sglang_fp8rl.server_args` are imported here and in :mod:`sglang_fp8rl.integrations`; the
plugin itself (its version check, hooks and layers) is loaded by SGLang's loader only.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from sglang_fp8rl.integrations import RAY_SETUP_HOOK, ray_worker_setup, register_quantization_choice

__all__ = ["RAY_SETUP_HOOK", "main", "ray_worker_setup", "register_quantization_choice"]
MODULE = "sglang_fp8rl.integrations.slime"  # this module's name, also when run with `python -m`
USAGE = f"usage: python -m {MODULE} TRAIN_SCRIPT.py [train script arguments...]"


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m sglang_fp8rl.integrations.slime train.py ARGS...`: register the choice, then run the script as
    `python train.py ARGS...` would (``sys.argv``, ``sys.path[0]`` and ``__main__`` set the same way)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or not argv[0].endswith(".py"):
        raise SystemExit(USAGE)
    script = argv[0]
    register_quantization_choice()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
