"""SGLang 0.5.21+'s weight-update sessions, through its real SchedulerWeightUpdaterManager on a CPU ModelRunner.

From 0.5.21 SGLang refuses tensor updates outside ``begin_weight_update`` / ``end_weight_update``. These tests run in
the CI environments of the releases that have sessions (scripts/cpu_matrix.sh) and are skipped on older ones.
"""

from __future__ import annotations

import pytest
import torch
from sgl_model import as_bytes, run_worker, write_w0_w1

from sglang_fp8rl.compat.versions import installed_sglang

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")


def has_sessions() -> bool:
    from sglang_fp8rl.cpu_runner import install_cpu_stubs

    install_cpu_stubs()
    from sglang_fp8rl.compat.updates import has_update_sessions

    return has_update_sessions()


requires_sessions = pytest.mark.skipif(not has_sessions(), reason=f"SGLang {installed_sglang()} has no sessions")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("sessions")
    w0, w1 = write_w0_w1(d)
    torch.save(w0, d / "w0.pt")
    torch.save(w1, d / "w1.pt")
    return d


def same_bytes(a: dict, b: dict) -> list[str]:
    return [name for name in a if not torch.equal(as_bytes(a[name]), as_bytes(b[name]))]


@requires_sessions
@pytest.mark.parametrize("kv", [False, True], ids=["bf16_kv", "fp8_kv"])
def test_sessions_through_sglangs_manager(models, kv):
    """A bare update is refused by SGLang; inside begin/end, a trainer's own calls and our client's push_state_dict
    are applied exactly (bytes of a cold load); end_weight_update's re-run of process_weights_after_loading changes
    no byte and moves no pointer; a refused bucket still closes the session and writes nothing; with an FP8 KV cache
    the session's end recalibrates."""
    d = models
    args = QUANT + (("--kv-cache-dtype", "fp8_e4m3") if kv else ())
    out = run_worker("sessions", str(d / "w0"), str(d / f"sessions_{kv}.pt"), *args,
                     extra={"w0": str(d / "w0.pt"), "w1": str(d / "w1.pt")})
    cold_w1 = run_worker("load", str(d / "w1"), str(d / f"cold_w1_{kv}.pt"), *args)["params"]
    cold_w0 = run_worker("load", str(d / "w0"), str(d / f"cold_w0_{kv}.pt"), *args)["params"]
    ok, message = out["bare"]
    assert not ok and "begin_weight_update" in message
    assert out["begin"][0] and out["update"][0] and out["end"][0], (out["begin"], out["update"], out["end"])
    assert out["end_changed"] == [] and not out["end_moved"]
    assert same_bytes(out["params_w1"], cold_w1) == []
    assert out["step"]["phase"] == "idle" and out["step"]["steps_ended"] >= 1
    assert all(a["success"] if isinstance(a, dict) else a[0] for a in out["client"])
    assert same_bytes(out["params_w0"], cold_w0) == []
    assert out["refused"] is not None and "NaN" in out["refused"]
    assert not out["session_open_after_refusal"]
    assert same_bytes(out["params_after_refusal"], cold_w0) == []
    if kv:
        before, after = out["calibrations"]
        assert after > before, out["calibrations"]
    # FP8 halves across the requests of a session: the scale never comes -> the end names both, nothing written
    half = "model.layers.1.mlp.down_proj.weight"
    assert out["half"][0] and out["half_step"]["held_halves"] == [half], (out["half"], out["half_step"])
    ok, message = out["half_end"]
    assert not ok and f"{half} without {half}_scale_inv" in message, message
    assert same_bytes(out["params_after_half"], cold_w0) == []
    # ... the scale comes in the next request -> the pair is written exactly as sent
    assert all(answer[0] for answer in out["split"]), out["split"]
    codes, scale = out["split_sent"]
    assert torch.equal(as_bytes(out["params_after_split"][half]), as_bytes(codes))
    assert torch.equal(out["params_after_split"][half + "_scale_inv"], scale)
