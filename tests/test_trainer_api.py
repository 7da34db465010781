"""The trainer's API, ``sglang_fp8rl.trainer``: its ``__all__`` is exactly the contract, each name importable from it
as the implementation's own object, and importing it loads neither SGLang nor anything of the engine side."""

from __future__ import annotations

import json
import subprocess
import sys

CONTRACT = ["push_state_dict", "push_distributed", "push_from_disk", "init_update_group", "recalibrate_kv_scales",
            "step_session", "WeightPushError", "SessionError"]
# everything of ours that importing the trainer's API may load: the client, its buckets, session and errors, the wire
# names, the numerics of its preflight check, and the adapters of the payload and sessions to SGLang's releases
TRAINER_SIDE = {"sglang_fp8rl", "sglang_fp8rl.trainer", "sglang_fp8rl.quant", "sglang_fp8rl.compat",
                "sglang_fp8rl.compat.updates", "sglang_fp8rl.weight_sync", "sglang_fp8rl.weight_sync.client",
                "sglang_fp8rl.weight_sync.buckets", "sglang_fp8rl.weight_sync.errors",
                "sglang_fp8rl.weight_sync.finite", "sglang_fp8rl.weight_sync.protocol",
                "sglang_fp8rl.weight_sync.session"}


def test_all_is_the_contract_and_each_name_imports():
    import sglang_fp8rl.trainer as trainer
    from sglang_fp8rl.weight_sync import client, errors, session

    assert trainer.__all__ == CONTRACT
    namespace: dict = {}
    exec("from sglang_fp8rl.trainer import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(CONTRACT)
    implementation = {**vars(client), **vars(session), **vars(errors)}
    for name in CONTRACT:
        assert namespace[name] is implementation[name], name
    assert issubclass(trainer.SessionError, trainer.WeightPushError)


def test_importing_the_trainer_api_loads_no_sglang_and_nothing_of_the_engine_side():
    """In a fresh interpreter (this one may have SGLang loaded already), where SGLang is installed: what is absent was
    not imported, rather than not found."""
    probe = ("import importlib.util, json, os, sys\n"
             "import sglang_fp8rl.trainer\n"
             "loaded = {'sglang': sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')),\n"
             "          'ours': sorted(m for m in sys.modules if m.startswith('sglang_fp8rl'))}\n"
             "spec = importlib.util.find_spec('sglang')  # found, not imported\n"
             "loaded['engine_installed'] = spec is not None and os.path.isfile(\n"
             "    os.path.join(spec.submodule_search_locations[0], 'srt', 'managers', 'scheduler.py'))\n"
             "print(json.dumps(loaded))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["engine_installed"]
    assert not any(m == "sglang.srt.managers" or m.startswith("sglang.srt.managers.") for m in loaded["sglang"])
    assert loaded["sglang"] == [], loaded["sglang"]
    assert set(loaded["ours"]) <= TRAINER_SIDE, sorted(set(loaded["ours"]) - TRAINER_SIDE)
    assert "sglang_fp8rl.trainer" in loaded["ours"]
