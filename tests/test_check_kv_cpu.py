"""CPU-side pieces of scripts/gpu/check_kv.py: the function-preserving drift and the comparison."""

from __future__ import annotations

import os

import check_kv
import torch

from sglang_fp8rl.kv_scales.decode_fold import ALLOW_UNVERIFIED_ENV


def test_drift_scales_v_and_o_by_a_power_of_two_and_nothing_else():
    sd = {"model.layers.0.self_attn.v_proj.weight": torch.randn(4, 4).bfloat16(),
          "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 4).bfloat16(),
          "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 4).bfloat16()}
    out = check_kv.drifted(sd, 256.0)
    v, o, k = (f"model.layers.0.self_attn.{x}_proj.weight" for x in "vok")
    assert torch.equal(out[v], sd[v] * 256) and torch.equal(out[o] * 256, sd[o])  # exact in BF16
    assert out[k] is sd[k]
    x = torch.randn(3, 4).bfloat16()
    assert torch.equal((x @ out[v].t()) @ out[o].t(), ((x @ sd[v].t()) * 256) @ (sd[o] / 256).t())


def test_same_compares_ids_and_every_logprob():
    a = [{"ids": [1, 2], "logprobs": [-0.5, -0.25]}]
    assert check_kv.same_outputs(a, [{"ids": [1, 2], "logprobs": [-0.5, -0.25]}])
    assert not check_kv.same_outputs(a, [{"ids": [1, 2], "logprobs": [-0.5, -0.2500001]}])
    assert not check_kv.same_outputs(a, [{"ids": [1, 3], "logprobs": [-0.5, -0.25]}])


def test_check_backend_runs_end_to_end_against_stand_in_servers(tmp_path, monkeypatch):
    """The whole check with the server I/O stubbed: log paths, the verdict's inputs (a GPU run once died reading
    a log file under an old name after both servers had run)."""
    from sglang_fp8rl import trainer as client  # what check_kv.py imports its push from

    launched = []

    def launch(model, port, log, *flags, mem, env_extra=None):
        with open(log, "w") as f:
            f.write("Capture cuda graph end\n")
        launched.append((model, port, log, flags, env_extra))
        return port

    scales = {"scales": {"0": [1.0, 2.0]}, "seconds": 0.05, "changed_layers": 1}
    outputs = {"stale": [{"ids": [1], "logprobs": [-1.0]}], "fresh": [{"ids": [1], "logprobs": [-0.5]}]}
    state = {"recalibrated": False}
    monkeypatch.setattr(check_kv, "launch", launch)
    monkeypatch.setattr(check_kv, "wait_healthy", lambda port, proc: 1.0)
    monkeypatch.setattr(check_kv, "stop", lambda proc: None)
    monkeypatch.setattr(check_kv, "kv_scales", lambda port: scales)
    monkeypatch.setattr(check_kv, "fp8rl_info", lambda port: {"fp8_param_ptr_digest": "d"})
    monkeypatch.setattr(check_kv, "generate", lambda port: outputs[
        "fresh" if port == 9001 or state["recalibrated"] else "stale"])
    monkeypatch.setattr(client, "push_state_dict", lambda url, sd, complete: None)
    monkeypatch.setattr(client, "recalibrate_kv_scales", lambda url: state.update(recalibrated=True))

    r = check_kv.check_backend("triton", str(tmp_path), "w0", "w1", {}, 9000, kv_write="fused")
    assert [entry[2] for entry in launched] == [str(tmp_path / "kv_triton_fused_a.log"),
                                                 str(tmp_path / "kv_triton_fused_b.log")]
    assert ("--fp8rl-kv-write", "fused") == launched[0][3][-2:]
    # the fresh server takes server A's measured GEMM kernels: a re-measured selection may round differently
    assert launched[1][3][-4:] == ("--fp8rl-kv-write", "fused", "--fp8rl-gemm-select", "cache")
    # the verification switch goes to the servers it launches, never into this process (a leak would let later
    # code here calibrate on unverified backends)
    assert all(entry[4] == {ALLOW_UNVERIFIED_ENV: "1"} for entry in launched)
    assert ALLOW_UNVERIFIED_ENV not in os.environ
    assert r["a_capture_lines"] == 1
    assert r["recalibrated_equals_fresh"] and r["stale_differs_from_fresh"]
    assert r["verdict"] == "PASS"


def test_diagnosis_finds_a_k_scale_that_never_reaches_the_kernel(tmp_path, monkeypatch):
    """--diagnose against stand-in servers whose outputs follow the V scale only (the kind of fault it looks for):
    it reports the K write as ineffective, the V write as effective, the restore, and the two fresh-start checks."""
    from sglang_fp8rl import trainer as client  # what check_kv.py imports its push from

    pushed = {}
    monkeypatch.setattr(check_kv, "launch", lambda model, port, log, *flags, mem, env_extra=None: (
        open(log, "w").close(), port)[1])
    monkeypatch.setattr(check_kv, "wait_healthy", lambda port, proc: 1.0)
    monkeypatch.setattr(check_kv, "stop", lambda proc: None)
    monkeypatch.setattr(check_kv, "kv_scales", lambda port: {"scales": {"0": [1.0, 2.0], "1": [0.5, 4.0]}})
    monkeypatch.setattr(check_kv, "fp8rl_info", lambda port: {"fp8_param_ptr_digest": "d"})
    monkeypatch.setattr(check_kv, "generate", lambda port: [{"ids": [1], "logprobs": [
        -float(pushed.get("model.layers.1.self_attn.v_scale", 4.0))]}])

    def push(url, sd, complete):
        pushed.update({name: float(t) for name, t in sd.items()})

    monkeypatch.setattr(client, "push_state_dict", push)
    monkeypatch.setattr(client, "recalibrate_kv_scales", lambda url: None)
    r = check_kv.check_backend("fa3", str(tmp_path), "w0", "w1", {}, 9000, kv_write="fused", diagnose=True)
    assert r["diagnosis"] == {"k_scale_x64_moves_outputs": False, "v_scale_x64_moves_outputs": True,
                              "restored_equals_recalibrated": True, "probe_layer": "1",
                              "fresh_repeatable": True, "fresh_w0_equals_o0": True}
    assert pushed == {"model.layers.1.self_attn.k_scale": 0.5, "model.layers.1.self_attn.v_scale": 4.0}
