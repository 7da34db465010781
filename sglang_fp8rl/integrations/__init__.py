"""Glue for RL frameworks that drive SGLang in ways its plugin loader does not cover.

verl and slime build SGLang's ``ServerArgs`` in their own (Ray actor) processes before SGLang's plugin loader has run
there, and slime builds an argparse parser from SGLang's flags in its driver: :func:`ray_worker_setup` (the job's Ray
``worker_process_setup_hook``) and :func:`register_quantization_choice` make ``fp8_online_blockwise`` known there;
:mod:`.slime` runs slime's unmodified ``train.py`` with the choice registered. docs/INTEGRATIONS.md has the settings.
"""

from __future__ import annotations

from sglang_fp8rl.server_args import QUANTIZATION_NAME

RAY_SETUP_HOOK = "sglang_fp8rl.integrations.ray_worker_setup"  # for runtime_env["worker_process_setup_hook"]


def register_quantization_choice() -> None:
    """Make `fp8_online_blockwise` a valid SGLang `--quantization` choice in this process (idempotent)."""
    from sglang.srt import server_args

    if QUANTIZATION_NAME not in server_args.QUANTIZATION_CHOICES:
        server_args.add_quantization_method_choices([QUANTIZATION_NAME])


def ray_worker_setup() -> None:
    """Ray `worker_process_setup_hook`: load SGLang's plugins (this one included) in each worker process of the job."""
    register_quantization_choice()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # idempotent; honours SGLANG_PLUGINS; logs (does not raise) a plugin's failure, as SGLang does
