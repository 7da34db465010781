"""scripts/rollout_floor.py: each decode step of a served rollout against its floor, from the scheduler's log lines."""
from __future__ import annotations

import gzip
import json
import sys

import bench_rl_rollout as RR
import pytest
import rollout_floor as RF
import rollout_report as REP
import roofline_model as RM

QWEN3_8B = RF.model_shape("qwen3-8b")
FIXTURE_ARGS = ["--num-prompts", "8", "--input-len", "16", "--output-median", "100", "--output-cap", "400"]


def decode(running: int, tokens: int, ms: float) -> str:
    """A scheduler decode line of a step of ``ms`` milliseconds (gen throughput = running / step seconds)."""
    return (f"[2026-12-08 00:53:30] Decode batch, #running-req: {running}, #token: {tokens}, token usage: 0.57, "
            f"cuda graph: True, gen throughput (token/s): {running / (ms / 1e3):.6f}, #queue-req: 0")


PREFILL = "[2026-12-08 00:53:21] Prefill batch, #new-seq: 5, #new-token: 8192, #cached-token: 0, token usage: 0.01"


def test_the_8b_shape_and_its_bytes_per_step():
    """The dummy Qwen3-8B's bytes by hand: 36 layers x 8 KV heads x 128 x (K, V) a token; its linears and lm_head."""
    assert (QWEN3_8B.layers, QWEN3_8B.kv_heads, QWEN3_8B.head_dim, QWEN3_8B.hidden) == (36, 8, 128, 4096)
    assert RM.kv_bytes_per_token(QWEN3_8B, "fp8") == 36 * 2 * 8 * 128 == 73_728
    assert RM.kv_bytes_per_token(QWEN3_8B, "bf16") == 2 * 73_728
    # one step of 4 requests holding 40,000 tokens in all, FP8 weights and KV, at 3,000 GB/s, memory only
    w = RM.weight_bytes(QWEN3_8B, "fp8", 4)
    expected = (sum(w.values()) + 40_000 * 73_728 + 4 * 73_728) / 3e12
    assert RF.step_floor_s(QWEN3_8B, "fp8", "fp8", 4, 40_000, 3000.0, None) == pytest.approx(expected, rel=1e-12)
    assert 8.1e9 < w["layers"] + w["lm_head"] < 8.3e9  # the roofline's "8.19 GB of weights"


def test_precision_of_a_servers_flags():
    assert RF.precision([]) == ("bf16", "bf16")
    assert RF.precision(["--quantization", "fp8_online_blockwise"]) == ("fp8", "bf16")
    assert RF.precision(["--quantization", "fp8_online_blockwise", "--kv-cache-dtype", "fp8_e4m3"]) == ("fp8", "fp8")
    assert RF.precision(["--kv-cache-dtype=fp8_e5m2"]) == ("bf16", "fp8")
    assert RF.precision(["--kv-cache-dtype", "auto", "--quantization"]) == ("bf16", "bf16")  # a flag without value


def test_steps_carry_their_tokens_and_whether_a_prefill_came_before():
    log = [decode(8, 80_000, 7.0), PREFILL, "some other line", decode(9, 90_000, 9.0), decode(9, 90_009, 8.0),
           "Decode batch, #running-req: 4, #token: 4, token usage: 0.1, gen throughput (token/s): 0.00",  # no time
           "Decode batch, #running-req: 0, #token: 0, token usage: 0.0, gen throughput (token/s): 5.00",  # no request
           "Decode batch, #running-req: 3, token usage: 0.1, gen throughput (token/s): 300.0"]  # no #token: left out
    steps = RF.steps_with_tokens(log)
    assert [(n, round(s * 1e3, 6), t, p) for n, s, t, p in steps] == [
        (8, 7.0, 80_000, False), (9, 9.0, 90_000, True), (9, 8.0, 90_009, False)]


def test_band_floors_against_hand_arithmetic():
    """Efficiency = the steps' floors / their measured seconds, per band; a step with a prefill before it is counted
    apart, not in the efficiency."""
    flags = ["--quantization", "fp8_online_blockwise", "--kv-cache-dtype", "fp8_e4m3"]
    log = [decode(4, 40_000, 10.0), decode(4, 40_004, 10.0), PREFILL, decode(4, 40_008, 30.0),
           decode(20, 100_000, 20.0)]
    got = RF.band_floors(log, flags, QWEN3_8B, 3000.0, None)
    f = [RF.step_floor_s(QWEN3_8B, "fp8", "fp8", 4, t, 3000.0, None) for t in (40_000, 40_004)]
    band = got["3-4"]
    assert band["steps"] == 2 and band["prefill_steps"] == 1 and band["prefill_s"] == pytest.approx(0.030)
    assert band["seconds"] == pytest.approx(0.020) and band["floor_s"] == pytest.approx(sum(f))
    assert band["efficiency"] == pytest.approx(sum(f) / 0.020) and band["above_s"] == pytest.approx(0.020 - sum(f))
    assert band["mean_context"] == pytest.approx((40_000 + 40_004) / 8)
    assert 0.2 < band["efficiency"] < 0.5  # ~4.7 ms of floor (8.2 GB + 2.9 GB) against 10 ms
    assert list(got) == ["3-4", "17-32", "all"] and got["all"]["steps"] == 3 and got["all"]["prefill_steps"] == 1
    # BF16 moves about twice the bytes: the same steps are nearer their floor
    bf16 = RF.band_floors(log, [], QWEN3_8B, 3000.0, None)["3-4"]
    assert 1.8 < bf16["floor_s"] / band["floor_s"] < 2.1
    # with a card's peaks the floor is the larger of bytes and FLOPs: at 4 requests the bytes
    peaks = RM.PEAK_TFLOPS["H100 SXM"]
    assert RF.band_floors(log, flags, QWEN3_8B, 3000.0, peaks)["3-4"]["floor_s"] == pytest.approx(sum(f))
    only_prefill = RF.band_floors([PREFILL, decode(4, 40_000, 10.0)], flags, QWEN3_8B, 3000.0, None)["3-4"]
    assert only_prefill["steps"] == 0 and only_prefill["efficiency"] is None
    text = RF.format_floors({"fp8_kv": got, "bf16": {}}, 3000.0, None)
    assert "| 3-4 | 10,000, 0.0 / 0.0, 37%, 0.0 (+ 0.0) |" in text and "(+ 0.0)" in text and "bf16" not in text
    assert "FLOPs not counted (card unknown)" in text and "3,000 GB/s" in text
    assert "| all decode steps |" in text and "—" not in text
    assert RF.format_floors({"x": {}}, 3000.0, None) == ""
    assert "| 3-4 | — (+ 0.0) |" in RF.format_floors({"x": {"3-4": only_prefill}}, 3000.0, "H100 SXM")


def test_the_bandwidth_comes_from_the_flag_the_recorded_answers_or_the_gpu():
    meta: dict = {}
    RF.set_bandwidth(meta, 2900.0, 3100.0)
    assert (meta["bandwidth_gbps"], meta["bandwidth_source"]) == (2900.0, "--bandwidth-gbps")
    RF.set_bandwidth(meta, None, 3100.0)
    assert (meta["bandwidth_gbps"], meta["bandwidth_source"]) == (3100.0, "recorded with the answers")
    RF.set_bandwidth(meta, None, None)
    assert meta["bandwidth_gbps"] is None and "pass --bandwidth-gbps" in meta["bandwidth_source"]
    assert RF.context(meta) is None
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        pytest.skip("a GPU is here: the copy would run")
    # no GPU here: the child process's copy fails, and the report says why instead of a floor
    RF.set_bandwidth(meta, None, None, measure=True)
    assert meta["bandwidth_gbps"] is None and meta["bandwidth_source"].startswith("the copy failed: ")
    ctx = RF.context({"bandwidth_gbps": 3000.0, "model": "qwen3-30b-a3b", "device": "NVIDIA H100 80GB HBM3"})
    assert ctx["card"] == "H100 SXM" and ctx["peaks"] == RM.PEAK_TFLOPS["H100 SXM"] and ctx["shape"].experts == 128
    assert RF.context({"bandwidth_gbps": 3000.0, "model": "qwen3-8b", "recorded_device": "x"})["peaks"] is None


def test_a_dry_run_join_reports_the_floors_and_records_the_machine(tmp_path):
    """The fixture's answers joined with a bandwidth: a floor table; without one: the reason; a run's answers.json
    keeps the device and bandwidth, and a later join takes them."""
    fixture = RR.DEFAULT_RECORDED
    out = tmp_path / "floors"
    assert RR.main(["--dry-run", "--recorded", fixture, "--out", str(out), "--configs", "bf16", "fp8_kv",
                    "--bandwidth-gbps", "3000", *FIXTURE_ARGS]) == 0
    md = (out / "summary.md").read_text()
    assert "Decode steps against their floor" in md and "3,000 GB/s" in md and "| all decode steps |" in md
    res = json.loads((out / "results.json").read_text())["results"]
    assert res["fp8_kv"]["floors"]["all"]["steps"] >= 1 and res["bf16"]["floors"]["all"]["floor_s"] > 0
    plain = tmp_path / "plain"
    assert RR.main(["--dry-run", "--recorded", fixture, "--out", str(plain), "--configs", "bf16", *FIXTURE_ARGS]) == 0
    assert "No floors: no copy bandwidth (pass --bandwidth-gbps)." in (plain / "summary.md").read_text()
    # answers recorded with a machine: a join takes its bandwidth and device (peaks of its card)
    with open(fixture) as f:
        data = json.load(f)
    data.update(device="NVIDIA H100 80GB HBM3", bandwidth_gbps=3029.0)
    recorded = tmp_path / "machine.json.gz"
    with gzip.open(recorded, "wt") as f:
        json.dump(data, f)
    assert REP.load_recorded([str(recorded)], ["bf16"])["machine"] == {"device": "NVIDIA H100 80GB HBM3",
                                                                       "bandwidth_gbps": 3029.0}
    joined = tmp_path / "joined"
    assert RR.main(["--dry-run", "--recorded", str(recorded), "--out", str(joined), "--configs", "bf16",
                    *FIXTURE_ARGS]) == 0
    md = (joined / "summary.md").read_text()
    assert "3,029 GB/s copy bandwidth, FLOPs at the H100 SXM dense peak" in md
