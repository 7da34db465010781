"""CPU tests of scripts/decode_roofline.py (issue 35, item 1): the bytes / FLOPs / floor model with numbers worked out
by hand for Qwen3-8B and Qwen3-30B-A3B shapes, the report rebuilt from a recorded run, the command line, the child's
per-cell bookkeeping and the profiler grouping. No SGLang process (tests/test_decode_roofline_runner.py drives the
child through SGLang's real ModelRunner)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
import types

import bench_rollout as BR
import decode_roofline as DR
import decode_roofline_child as DRC
import kernel_trace as KT
import make_models as MM
import pytest
import roofline_model as RM
import roofline_report as RP
from suite_stage import stage_command_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIXTURE = os.path.join(ROOT, "tests", "data", "roofline_recorded.json")
QWEN3_8B = RM.Shape.from_config({**MM.QWEN3_COMMON, **MM.QWEN3_SHAPES["qwen3-8b"]})
QWEN3_30B_A3B = RM.Shape.from_config(dict(MM.QWEN3_MOE))

# Qwen3-8B by hand: per layer qkv (32 + 2 x 8) x 128 = 6144 x 4096, o 4096 x 4096, gate_up 24576 x 4096,
# down 4096 x 12288: 192,937,984 weights, x 36 layers = 6,945,767,424; lm_head 151936 x 4096 = 622,329,856
LAYER_WEIGHTS = 36 * (6144 * 4096 + 4096 * 4096 + 24576 * 4096 + 4096 * 12288)
LM_HEAD = 151936 * 4096
# FP8 block scales, float32 per 128 x 128 block: qkv 48 x 32, o 32 x 32, gate_up 192 x 32, down 32 x 96
FP8_SCALE_BYTES = 36 * 4 * (48 * 32 + 32 * 32 + 192 * 32 + 32 * 96)
NORM_BYTES = 2 * (36 * (4096 + 4096 + 128 + 128) + 4096)  # input + post-attention + q/k norms, final norm
KV_TOKEN_BF16 = 36 * 2 * 8 * 128 * 2  # 147,456 B


def _load_fixture() -> dict:
    with open(FIXTURE) as f:
        data = json.load(f)
    data.pop("report", None)
    return data


# ----------------------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------------------

def test_shapes_come_from_the_dummy_models_config():
    assert (QWEN3_8B.hidden, QWEN3_8B.layers, QWEN3_8B.heads, QWEN3_8B.kv_heads, QWEN3_8B.head_dim,
            QWEN3_8B.intermediate, QWEN3_8B.vocab, QWEN3_8B.experts) == (4096, 36, 32, 8, 128, 12288, 151936, 0)
    assert (QWEN3_30B_A3B.layers, QWEN3_30B_A3B.kv_heads, QWEN3_30B_A3B.experts, QWEN3_30B_A3B.experts_per_token,
            QWEN3_30B_A3B.moe_intermediate) == (48, 4, 128, 8, 768)


def test_bf16_weights_of_a_step_are_15_1_gb():
    w = RM.weight_bytes(QWEN3_8B, "bf16", batch=1)
    assert LAYER_WEIGHTS == 6_945_767_424 and LM_HEAD == 622_329_856
    assert w["layers"] == 2 * LAYER_WEIGHTS == 13_891_534_848
    assert w["lm_head"] == 2 * LM_HEAD == 1_244_659_712
    assert w["norms"] == NORM_BYTES == 616_448
    assert w["embedding"] == 4096 * 2
    assert round((w["layers"] + w["lm_head"]) / 1e9, 1) == 15.1  # the issue's figure


def test_fp8_weights_are_codes_plus_block_scales_with_lm_head_bf16():
    w = RM.weight_bytes(QWEN3_8B, "fp8", batch=1)
    assert FP8_SCALE_BYTES == 1_695_744
    assert w["layers"] == LAYER_WEIGHTS + FP8_SCALE_BYTES == 6_947_463_168
    assert w["lm_head"] == 2 * LM_HEAD
    assert round((w["layers"] + w["lm_head"]) / 1e9, 1) == 8.2  # the issue's figure
    assert RM.matrix_bytes(100, 200, "fp8") == 100 * 200 + 4 * 1 * 2  # partial blocks count whole


def test_kv_bytes_read_and_written():
    assert RM.kv_bytes_per_token(QWEN3_8B, "bf16") == KV_TOKEN_BF16 == 147_456
    assert RM.kv_bytes_per_token(QWEN3_8B, "fp8") == KV_TOKEN_BF16 // 2
    kv = RM.kv_bytes(QWEN3_8B, "bf16", batch=8, context=10_000)
    assert kv == {"kv_read": 8 * 10_000 * 147_456, "kv_write": 8 * 147_456}
    assert round(kv["kv_read"] / 1e9, 1) == 11.8  # the issue: ~11.8 GB at 8 running with ~10k contexts


def test_flops_of_a_step():
    f = RM.step_flops(QWEN3_8B, batch=8, context=4096)
    assert f["linears"] == 2 * LAYER_WEIGHTS * 8 == 111_132_278_784
    assert f["lm_head"] == 2 * LM_HEAD * 8 == 9_957_277_696
    assert f["attention"] == 4 * 8 * 4096 * 32 * 128 * 36 == 19_327_352_832


def test_floor_matches_the_issues_rough_floors_on_an_h200():
    # the issue: 8 running, ~10k contexts, 4.8 TB/s: BF16 15.1 + 11.8 GB = 5.6 ms; FP8 + FP8 KV 8.2 + 5.9 GB = 2.9 ms
    bf16 = RM.step_model(QWEN3_8B, "bf16", "bf16", 8, 10_000, 4800.0, RM.PEAK_TFLOPS["H200 SXM"])
    fp8kv = RM.step_model(QWEN3_8B, "fp8", "fp8", 8, 10_000, 4800.0, RM.PEAK_TFLOPS["H200 SXM"])
    bf16_bytes = 2 * LAYER_WEIGHTS + 2 * LM_HEAD + NORM_BYTES + 8 * 8192 + 8 * 10_001 * KV_TOKEN_BF16
    assert bf16["bytes_total"] == bf16_bytes
    assert bf16["floor_s"] == pytest.approx(bf16_bytes / 4.8e12) and round(1e3 * bf16["floor_s"], 1) == 5.6
    assert round(1e3 * fp8kv["floor_s"], 1) == 2.9
    assert bf16["bound"] == fp8kv["bound"] == "memory"


def test_compute_side_uses_each_parts_dtype():
    f = RM.step_flops(QWEN3_8B, 384, 1024)
    want = (f["linears"] / 1978.9e12 + f["lm_head"] / 989.4e12 + f["attention"] / 989.4e12)
    got = RM.step_model(QWEN3_8B, "fp8", "bf16", 384, 1024, 1e12, RM.PEAK_TFLOPS["H100 SXM"])  # unlimited bandwidth
    assert got["compute_s"] == pytest.approx(want) and got["floor_s"] == got["compute_s"] and got["bound"] == "compute"
    assert RM.step_model(QWEN3_8B, "bf16", "bf16", 1, 1024, 3000.0, None)["compute_s"] is None


def test_group_floors_by_hand_and_their_sum_is_the_memory_floor():
    # FP8 weights + FP8 KV, 8 running at 4k, 3 TB/s: GEMMs read the layers' codes and block scales, attention the
    # K/V of every context token (and writes one token each), logits lm_head in BF16; quantization needs nothing
    kv_token_fp8 = KV_TOKEN_BF16 // 2
    got = RM.group_floors(QWEN3_8B, "fp8", "fp8", 8, 4096, 3000.0, RM.PEAK_TFLOPS["H100 SXM"])
    assert got["GEMMs"] == pytest.approx((LAYER_WEIGHTS + FP8_SCALE_BYTES) / 3e12)
    assert got["attention"] == pytest.approx(8 * 4097 * kv_token_fp8 / 3e12)
    assert got["logits/sampling"] == pytest.approx(2 * LM_HEAD / 3e12)
    assert got["norms/rotary"] == pytest.approx(NORM_BYTES / 3e12)
    assert got["activation quantization"] == 0.0 and got["other"] == pytest.approx(8 * 8192 / 3e12)
    whole = RM.step_model(QWEN3_8B, "fp8", "fp8", 8, 4096, 3000.0, RM.PEAK_TFLOPS["H100 SXM"])
    assert sum(got.values()) == pytest.approx(whole["memory_s"])  # every byte of the step in exactly one group
    # 384 running with unlimited bandwidth: each group at its FLOPs and its dtype's peak
    fast = RM.group_floors(QWEN3_8B, "fp8", "bf16", 384, 1024, 1e12, RM.PEAK_TFLOPS["H100 SXM"])
    f = RM.step_flops(QWEN3_8B, 384, 1024)
    assert fast["GEMMs"] == pytest.approx(f["linears"] / 1978.9e12)
    assert fast["attention"] == pytest.approx(f["attention"] / 989.4e12)
    assert fast["logits/sampling"] == pytest.approx(f["lm_head"] / 989.4e12)


def test_moe_counts_the_experts_the_batch_touches():
    s = QWEN3_30B_A3B
    attn = 5120 * 2048 + 2048 * 4096  # qkv (32 + 2 x 4) x 128, o
    expert = 1536 * 2048 + 2048 * 768
    assert RM.experts_touched(s, 1) == 8
    assert RM.experts_touched(s, 8) == pytest.approx(128 * (1 - (120 / 128) ** 8))
    assert RM.experts_touched(s, 384) == pytest.approx(128, abs=1e-6)
    w = RM.weight_bytes(s, "bf16", batch=1)
    assert w["layers"] == 2 * 48 * (attn + 8 * expert) and w["router"] == 2 * 48 * 128 * 2048
    assert RM.linear_params_per_token(s) == 48 * (attn + 8 * expert + 128 * 2048)


def test_card_table():
    assert RM.card_of("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert RM.card_of("NVIDIA H200") == "H200 SXM"
    assert RM.card_of("NVIDIA H100 PCIe") == "H100 PCIe"
    assert RM.card_of("NVIDIA H200 NVL") == "H200 NVL"
    assert RM.card_of("NVIDIA A100-SXM4-80GB") is None
    assert RM.PEAK_TFLOPS["H100 SXM"] == RM.PEAK_TFLOPS["H200 SXM"] == {"bf16": 989.4, "fp8": 1978.9}
    assert RM.fits(362_891, 32, 12288, 33) is False and RM.fits(362_891, 8, 12288, 33) is True


# ----------------------------------------------------------------------------------------------------------------
# the report from a recorded run
# ----------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    out = tmp_path_factory.mktemp("roofline")
    assert DR.main(["--dry-run", "--recorded", FIXTURE, "--out", str(out)]) == 0
    with open(out / "roofline.json") as f:
        saved = json.load(f)
    return saved, (out / "roofline.md").read_text()


def test_dry_run_rebuilds_both_files(rebuilt):
    saved, md = rebuilt
    assert set(saved) >= {"meta", "runs", "profiles", "report"}
    assert "SYNTHETIC TEST FIXTURE" in md
    for title in ("### BF16 (`bf16`)", "### FP8 weights (`fp8_online_blockwise`)",
                  "### FP8 + FP8 KV (`fp8_online_blockwise_kv`)", "### Step speed-up over BF16",
                  "### Targets", "### Where a step goes"):
        assert title in md
    assert "copy bandwidth: 3,010 GB/s" in md  # the best process's measurement
    assert "32 x 12k: KV pool: 32 x (12288 + 9) = 393,504 tokens > the pool's 362,891" in md


def test_dry_run_merges_the_configs_a_recorded_run_lacks(tmp_path):
    """--merge beside --recorded: BF16 from another run, so that the recorded FP8 run gets its speed-ups."""
    with open(FIXTURE) as f:
        full = json.load(f)
    fp8_only, bf16_only = json.loads(json.dumps(full)), json.loads(json.dumps(full))
    del fp8_only["runs"]["bf16"]
    fp8_only["meta"]["configs"].remove("bf16")
    fp8_only["profiles"].pop("bf16", None)
    bf16_only["runs"]["fp8_online_blockwise_kv"]["records"] = []  # a run of its own: the recorded one's wins
    paths = {}
    for name, data in (("fp8", fp8_only), ("bf16", bf16_only)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    alone, merged = tmp_path / "alone", tmp_path / "merged"
    assert DR.main(["--dry-run", "--recorded", str(paths["fp8"]), "--out", str(alone)]) == 0
    assert DR.main(["--dry-run", "--recorded", str(paths["fp8"]), "--merge", str(paths["bf16"]),
                    "--out", str(merged)]) == 0
    rep_alone = json.loads((alone / "roofline.json").read_text())["report"]
    saved = json.loads((merged / "roofline.json").read_text())
    assert not rep_alone["speedups"].get("128x1024", {}).get("fp8_online_blockwise_kv")
    assert saved["runs"]["bf16"]["merged_from"] == str(paths["bf16"])
    assert saved["runs"]["fp8_online_blockwise_kv"]["records"] == full["runs"]["fp8_online_blockwise_kv"]["records"]
    b = statistics.median(RP.cells_of(full["runs"]["bf16"])["128x1024"]["b2b_s"])
    k = statistics.median(RP.cells_of(full["runs"]["fp8_online_blockwise_kv"])["128x1024"]["b2b_s"])
    assert saved["report"]["speedups"]["128x1024"]["fp8_online_blockwise_kv"] == pytest.approx(b / k)


def test_floor_and_efficiency_of_a_recorded_cell(rebuilt):
    saved, _ = rebuilt
    rec = RP.cells_of(saved["runs"]["bf16"])["8x4096"]
    ctx = 4096 + (8 + 1) / 2  # 8 decode steps: step i reads 4096 + i + 1 tokens
    bytes_ = 2 * LAYER_WEIGHTS + 2 * LM_HEAD + NORM_BYTES + 8 * 8192 + 8 * (ctx + 1) * KV_TOKEN_BF16
    row = saved["report"]["tables"]["bf16"]["8x4096"]
    assert row["bytes_gb"] == pytest.approx(bytes_ / 1e9)
    assert row["floor_ms"] == pytest.approx(1e3 * bytes_ / 3010e9)
    step = statistics.median(rec["b2b_s"])
    assert row["step_ms"] == pytest.approx(1e3 * step)
    assert row["efficiency"] == pytest.approx(bytes_ / 3010e9 / step)
    kept = [s for i, s in enumerate(rec["steps_s"]) if i not in rec["excluded_steps"]]
    assert row["bench_ms"] == pytest.approx(1e3 * statistics.median(kept))


def test_speedups_and_skipped_cells(rebuilt):
    saved, _ = rebuilt
    runs, rep = saved["runs"], saved["report"]
    b = statistics.median(RP.cells_of(runs["bf16"])["128x1024"]["b2b_s"])
    k = statistics.median(RP.cells_of(runs["fp8_online_blockwise_kv"])["128x1024"]["b2b_s"])
    assert rep["speedups"]["128x1024"]["fp8_online_blockwise_kv"] == pytest.approx(b / k)
    assert rep["speedups"]["384x1024"]["fp8_online_blockwise_kv"] is None  # BF16's pool cannot hold it
    assert rep["tables"]["bf16"]["384x1024"]["status"] == "skipped"
    assert rep["tables"]["fp8_online_blockwise_kv"]["384x1024"]["status"] == "measured"


def test_targets_are_each_met_missed_or_na(rebuilt):
    saved, md = rebuilt
    targets = saved["report"]["targets"]
    assert [(t["config"], t["kind"], t["threshold"]) for t in targets] == [
        ("fp8_online_blockwise_kv", "speedup", 1.6), ("fp8_online_blockwise_kv", "speedup", 1.4),
        ("fp8_online_blockwise", "speedup", 1.3), ("fp8_online_blockwise_kv", "efficiency", 0.75)]
    first = targets[0]
    assert set(first["values"]) == {"1x4096", "1x12288", "8x4096", "8x12288", "32x4096"}
    assert first["not_measured"] == ["32x12288"]  # BF16 could not hold it
    for t in targets:
        assert t["status"] in ("met", "missed", "n/a")
        assert f"**{t['status']}**" in md


def test_target_status_rules():
    meta = {"batch_sizes": [1, 8], "contexts": [4096]}
    tables = {"fp8_online_blockwise_kv": {"8x4096": {"efficiency": 0.8}, "1x4096": {}}}
    ups = {"1x4096": {"fp8_online_blockwise_kv": 1.7, "fp8_online_blockwise": 1.2},
           "8x4096": {"fp8_online_blockwise_kv": 1.65, "fp8_online_blockwise": None}}
    got = {(t["config"], t["kind"], t["threshold"]): t for t in RP.evaluate_targets(tables, ups, meta)}
    assert got[("fp8_online_blockwise_kv", "speedup", 1.6)]["status"] == "met"
    assert got[("fp8_online_blockwise_kv", "speedup", 1.4)]["status"] == "n/a"  # no 128-384 cell in this grid
    fp8 = got[("fp8_online_blockwise", "speedup", 1.3)]
    assert (fp8["status"], fp8["below"], fp8["not_measured"]) == ("missed", ["1x4096"], ["8x4096"])
    assert fp8["needs"] == {"1x4096": [None, None]}  # no floor or BF16 step in these tables
    assert got[("fp8_online_blockwise_kv", "efficiency", 0.75)]["status"] == "met"


def test_a_missed_speedup_says_the_efficiency_it_needs():
    """BF16 6 ms a step, the FP8 floor 2.7 ms: 1.6x is 3.75 ms, so 72 % of the floor, where the step has 60 %."""
    meta = {"batch_sizes": [8], "contexts": [4096]}
    tables = {"bf16": {"8x4096": {"step_ms": 6.0, "floor_ms": 5.1, "efficiency": 0.85}},
              "fp8_online_blockwise_kv": {"8x4096": {"step_ms": 4.5, "floor_ms": 2.7, "efficiency": 0.6}}}
    ups = {"8x4096": {"fp8_online_blockwise_kv": 6.0 / 4.5}}
    first = RP.evaluate_targets(tables, ups, meta)[0]
    assert first["status"] == "missed"
    need, has = first["needs"]["8x4096"]
    assert need == pytest.approx(1.6 * 2.7 / 6.0) and has == 0.6
    assert RP.needed_efficiency(tables, "fp8_online_blockwise_kv", "8x4096", 6.0 / 4.5) == pytest.approx(0.6)
    assert "8 x 4k 1.33x (needs 72 % efficiency, has 60 %)" in RP._target_line(first)
    assert RP.evaluate_targets(tables, ups, meta)[3]["needs"] == {}  # an efficiency target says its own numbers


def test_prefill_check_and_breakdown_rows(rebuilt):
    saved, md = rebuilt
    checks = saved["report"]["checks"]
    assert {c["config"] for c in checks} == {"bf16", "fp8_online_blockwise", "fp8_online_blockwise_kv"}
    assert all(c["cell"] == "8x4096" and c["ratio"] == pytest.approx(c["real_ms"] / c["skipped_ms"]) for c in checks)
    rows = {(r["config"], r["cell"]): r for r in saved["report"]["breakdown"]}
    assert set(rows) == {(c, k) for c in ("bf16", "fp8_online_blockwise", "fp8_online_blockwise_kv")
                         for k in ("8x4096", "128x1024")}
    fp8 = rows[("fp8_online_blockwise", "8x4096")]["groups_ms"]
    assert fp8["activation quantization"] == pytest.approx(0.215)
    assert fp8["logits/sampling"] == pytest.approx(0.437 + 0.011)  # lm_head (1 launch a step) + argmax
    assert rows[("bf16", "8x4096")]["groups_ms"]["activation quantization"] == 0
    # each group against its floor at the cell's own mean context and the run's measured bandwidth
    rec = RP.cells_of(saved["runs"]["fp8_online_blockwise"])["8x4096"]
    want = RM.group_floors(QWEN3_8B, "fp8", "bf16", 8, RP.mean_context(rec), saved["report"]["bandwidth"]["gbps"],
                           saved["report"]["peak_tflops"])
    assert rows[("fp8_online_blockwise", "8x4096")]["floors_ms"] == pytest.approx({k: 1e3 * v for k, v in want.items()})
    assert "Each group against its floor" in md
    gemm = rows[("fp8_online_blockwise", "8x4096")]
    share = gemm["floors_ms"]["GEMMs"] / gemm["groups_ms"]["GEMMs"]
    assert f"| {gemm['groups_ms']['GEMMs']:.3f} ({share:.0%}, +" in md
    assert "prefill check, BF16 8 x 4k" in md


def test_overrides_reach_the_report(tmp_path):
    assert DR.main(["--dry-run", "--recorded", FIXTURE, "--out", str(tmp_path), "--bandwidth-gbps", "4000",
                    "--peak-tflops", "500", "1000"]) == 0
    with open(tmp_path / "roofline.json") as f:
        rep = json.load(f)["report"]
    assert rep["bandwidth"] == {"gbps": 4000.0, "source": "--bandwidth-gbps"}
    assert rep["peak_tflops"] == {"bf16": 500.0, "fp8": 1000.0}


def test_report_without_a_bandwidth_keeps_the_steps():
    data = _load_fixture()
    for run in data["runs"].values():
        run["records"] = [r for r in run["records"] if r["kind"] != "bandwidth"]
    rep = RP.build_report(data)
    row = rep["tables"]["bf16"]["8x4096"]
    assert rep["bandwidth"] is None and row["step_ms"] > 0 and "floor_ms" not in row
    assert "not measured (no floor)" in RP.format_report(data, rep)


def test_kernel_groups():
    layers, steps = 36, 2
    kernels = {
        "nvjet_sm90_tst_192x16_64x8_2x1_v_bz_TNT": {"us": 100.0 * 36 * 2 + 2 * 400.0, "n": 37 * 2,
                                                     "top_us": [400.0, 400.0]},  # 36 layer GEMMs + lm_head
        "void cutlass::device_kernel<flash::FlashAttnFwdSm90<cutlass::float_e4m3_t>>": {"us": 720.0, "n": 72},
        "per_token_group_quant_flat_kernel<QuantTrait<__nv_bfloat16, __nv_fp8_e4m3>>": {"us": 288.0, "n": 288},
        "void (anonymous namespace)::fused_qknorm_warp<128l, true, __nv_bfloat16>": {"us": 72.0, "n": 72},
        "void (anonymous namespace)::act_and_mul_kernel<__nv_bfloat16>": {"us": 36.0, "n": 72},
        "void at::native::reduce_kernel<ArgMaxOps<float>>": {"us": 20.0, "n": 2},
        "void (anonymous namespace)::store_kvcache<2048l>": {"us": 72.0, "n": 72},
        "void at::native::indexSelectSmallIndex<c10::BFloat16>": {"us": 10.0, "n": 2},
    }
    g = RP.kernel_groups(kernels, steps, layers)
    assert g == {"GEMMs": 3600.0, "activation quantization": 144.0, "attention": 396.0, "norms/rotary": 54.0,
                 "logits/sampling": 410.0, "other": 5.0}


@pytest.mark.parametrize("name, cls", [
    ("per_token_group_quant_flat_kernel<QuantTrait<__nv_bfloat16, __nv_fp8_e4m3>>", "act quant"),  # not a GEMM
    ("cutlass::device_kernel<flash::FlashAttnFwdSm90<cutlass::float_e4m3_t>>", "attention"),  # FA3 over FP8 KV
    ("_fwd_grouped_kernel_stage1", "attention"),  # Triton's decode attention
    ("void flash::prepare_varlen_num_blocks_kernel<1, true>", "attention"),
    ("store_kvcache<2048l>", "attention"),
    ("fused_qknorm_warp<128l>", "norm/rope/act"),
    ("_add_rmsnorm_quant_kernel", "norm/rope/act"),  # a norm that also quantizes its output
    ("_silu_mul_quant_kernel", "norm/rope/act"),
    ("fused_moe_kernel", "moe gemm"),
    ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0>", "fp8 gemm"),
])
def test_kernel_classes_extended_for_fp8_names(name, cls):
    assert KT.classify_kernel(name) == cls


def test_trace_summary_and_profile_collection(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "k_gemm", "dur": d} for d in (5.0, 9.0, 7.0)]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99.0}]
    path = tmp_path / "fp8_online_blockwise_kv_batch8_input4096_output33_decode.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    (tmp_path / "bf16_batch8_input4096_output33_prefill.trace.json.gz").write_text("not a decode trace")
    got = DR.collect_profiles(str(tmp_path), steps=2)
    assert got == {"fp8_online_blockwise_kv": {"8x4096": {
        "trace": path.name, "steps": 2, "kernels": {"k_gemm": {"us": 21.0, "n": 3, "top_us": [9.0, 7.0]}}}}}


# ----------------------------------------------------------------------------------------------------------------
# the command line and the plan
# ----------------------------------------------------------------------------------------------------------------

def test_parser_defaults():
    a = DR.parse_args([])
    assert a.configs == ["bf16", "fp8_online_blockwise", "fp8_online_blockwise_kv"]
    assert (a.batch_sizes, a.contexts, a.steps) == ([1, 8, 32, 128, 384], [1024, 4096, 12288], 32)
    assert a.profile_cells == [(8, 4096), (128, 1024)] and a.check_cells == [(8, 4096)]
    assert (a.attention_backend, a.prefill, a.mem_fraction_static, a.dry_run) == ("fa3", "skip", 0.88, False)


def test_parser_refusals(capsys):
    assert DR.parse_cell("128x1024") == (128, 1024) and DR.parse_cell(" 8X4096 ") == (8, 4096)
    with pytest.raises(argparse.ArgumentTypeError):
        DR.parse_cell("8-4096")
    for argv in (["--profile-cells", "16x4096"], ["--check-cells", "8x2048"], ["--recorded", FIXTURE],
                 ["--configs", "block_prequant"]):
        with pytest.raises(SystemExit):
            DR.parse_args(argv)
    assert DR.parse_args(["--profile-cells", "--check-cells"]).profile_cells == []


def test_a_smaller_grid_keeps_the_default_cells_it_holds():
    """The default profile / check cells outside a grid given on the command line are left out, not refused (a
    GPU call once ended at once on '--profile-cells 128x1024 is not in the grid'); named ones are still checked."""
    a = DR.parse_args(["--batch-sizes", "1", "8", "--contexts", "4096", "12288"])
    assert a.profile_cells == [(8, 4096)] and a.check_cells == [(8, 4096)]
    a = DR.parse_args(["--batch-sizes", "1", "--contexts", "4096"])
    assert a.profile_cells == [] and a.check_cells == []
    a = DR.parse_args(["--batch-sizes", "128", "--contexts", "1024", "4096"])
    assert a.profile_cells == [(128, 1024)] and a.check_cells == []
    with pytest.raises(SystemExit):
        DR.parse_args(["--batch-sizes", "1", "8", "--profile-cells", "128x1024"])


def test_dry_run_prints_one_bench_process_per_config(capsys, tmp_path):
    assert DR.main(["--dry-run", "--out", str(tmp_path), "--model-dir", "/m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = [ln for ln in lines if not ln.startswith("#") and ln.strip()]
    assert len(cmds) == 3 and not (tmp_path / "raw").exists()
    for cmd, flags in zip(cmds, ([], ["--quantization", "fp8_online_blockwise"],
                                 ["--quantization", "fp8_online_blockwise", "--kv-cache-dtype", "fp8_e4m3"])):
        words = cmd.split()
        assert words[1].endswith("scripts/decode_roofline.py") and words[2] == "_child"
        assert " --model-path /m/qwen3-8b --load-format dummy --attention-backend fa3 " in cmd
        assert " --batch-size 1 8 32 128 384 8 --input-len 1024 4096 12288 --output-len 33 " in cmd
        assert " --cuda-graph-bs-decode 1 8 32 128 384 --mem-fraction-static 0.88 " in cmd
        assert " --profile --profile-stage decode --profile-start-step 16 --profile-steps 3 " in cmd
        assert " ".join(flags) in cmd and ("--kv-cache-dtype" in cmd) == ("--kv-cache-dtype" in flags)
    settings = json.loads(lines[0].split(f"{DR.ENV}='")[1].rstrip("'"))
    assert settings["check_cells"] == [[8, 4096]] and settings["profile_cells"] == [[8, 4096], [128, 1024]]


def test_the_decode_attention_configs_pass_flags_our_parser_takes(capsys, tmp_path):
    from sglang_fp8rl.kernels.split_kv_plan import DEFAULT_FORMS, FORMS
    from sglang_fp8rl.server_args import parse_args

    assert DR.main(["--dry-run", "--out", str(tmp_path), "--model-dir", "/m", "--configs",
                    "fp8_online_blockwise_kv_bf16q", "fp8_online_blockwise_kv_forms",
                    "fp8_online_blockwise_kv_noforms", "fp8_online_blockwise_kv_lean"]) == 0
    cmds = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#") and ln.strip()]
    bf16q, forms, noforms, lean = (parse_args(cmd.split()) for cmd in cmds)
    assert lean.decode_query == "bf16" and lean.producer_quant == "on" and lean.split_kv_forms == DEFAULT_FORMS
    assert bf16q.decode_query == "bf16" and bf16q.split_kv_forms == DEFAULT_FORMS
    assert forms.split_kv_forms == FORMS and forms.decode_query == "fp8"
    assert noforms.split_kv_forms == () and noforms.decode_query == "fp8"


def test_config_timeouts_keep_time_for_later_configs(monkeypatch):
    a = DR.parse_args(["--deadline-s", "540", "--budget-s", "240", "--min-s", "75"])
    t0 = 1000.0
    monkeypatch.setattr(DR.time, "time", lambda: t0)
    assert DR.config_timeout(a, t0, configs_after=2) == 240
    monkeypatch.setattr(DR.time, "time", lambda: t0 + 300)
    assert DR.config_timeout(a, t0, configs_after=1) == 540 - 300 - 5 - 75
    assert DR.config_timeout(DR.parse_args([]), t0, 2) == 240  # no deadline: the budget


def test_merge_keeps_this_runs_configs(tmp_path):
    data = {"meta": {"configs": ["bf16"]}, "runs": {}, "profiles": {}}
    DR.merge_runs(data, [FIXTURE], measured=["bf16"])
    assert list(data["runs"]) == ["fp8_online_blockwise", "fp8_online_blockwise_kv"]
    assert data["meta"]["configs"] == ["bf16", "fp8_online_blockwise", "fp8_online_blockwise_kv"]
    assert all(r["merged_from"] == FIXTURE for r in data["runs"].values())


# ----------------------------------------------------------------------------------------------------------------
# the child's bookkeeping (no SGLang: its hooks get the arguments bench_one_batch passes)
# ----------------------------------------------------------------------------------------------------------------

def _runner(pool: int):
    return types.SimpleNamespace(torch_runner=types.SimpleNamespace(max_total_num_tokens=pool))


def _args(bs, il, ol=9, **kw):
    return {"batch_size": bs, "input_len": il, "output_len": ol, "model_runner": _runner(100_000), "profile": True,
            "profile_start_step": 4, "profile_steps": 3, **kw}


def test_recorder_cells(tmp_path):
    rec = DRC.Recorder({"records": str(tmp_path / "r.jsonl"), "profile_cells": [[8, 4096]],
                       "check_cells": [[8, 4096]], "b2b_timings": 3})
    warm = rec.start(_args(1, 1024, ol=9))
    assert warm["warmup"] and warm["b2b_at"] == [] and not warm["profiled"]
    rec.finish({"median_decode_latency": 0.01})
    cell = rec.start(_args(8, 4096))
    assert (cell["occurrence"], cell["prefill"], cell["profiled"]) == (1, "skip", True)
    # 8 steps (0..7): the profiler takes 4-6, the back-to-back timings the last three others
    assert cell["b2b_at"] == [2, 3, 7] and cell["excluded_steps"] == [2, 3, 4, 5, 6, 7]
    cell["steps_s"] = [0.01] * 8
    rec.finish({"median_decode_latency": 0.01})
    assert rec.start(_args(8, 1024))["profiled"] is False
    rec.finish(None)
    assert rec.start(_args(8, 1024))["skipped"].startswith("a repeat of batch 8")
    again = rec.start(_args(8, 4096))
    assert (again["occurrence"], again["prefill"], again["profiled"]) == (2, "real", False)
    rec.finish({"median_decode_latency": 0.01})
    too_big = rec.start({**_args(128, 1024), "model_runner": _runner(100_000)})
    assert too_big["skipped"] == "KV pool: 128 x (1024 + 9) = 132,224 tokens > the pool's 100,000"
    rec.stop_at = 1.0  # long past
    assert rec.start(_args(1, 4096))["skipped"].startswith("deadline")
    records = DR.read_jsonl(str(tmp_path / "r.jsonl"))
    assert [r["occurrence"] for r in records] == [0, 1, 1, 2]
    assert records[2]["skipped"] == "bench_one_batch did not run it (see its log)"


def test_patched_restores_instance_attributes():
    class Runner:
        def forward(self):
            return "class"

    r = Runner()
    with DRC.patched(r, forward=lambda: "hook"):
        assert r.forward() == "hook"
    assert r.forward() == "class" and "forward" not in r.__dict__
    r.forward = lambda: "instance"
    with DRC.patched(r, forward=lambda: "hook"):
        assert r.forward() == "hook"
    assert r.forward() == "instance"


# ----------------------------------------------------------------------------------------------------------------
# the driver with its bench processes faked, and the suite stage
# ----------------------------------------------------------------------------------------------------------------

def test_main_runs_configs_within_the_deadline(tmp_path, monkeypatch):
    """main(): the model folder, each config's process (faked: it writes the fixture's records where the child's
    settings say), the deadline that skips a config, roofline.json / .md rewritten from the records."""
    recorded = _load_fixture()
    started = []

    def fake_run(label, cmd, env, log_path, timeout_s):
        settings = json.loads(env[DR.ENV])
        started.append((label, timeout_s, settings["stop_at"] - DR.time.time()))
        with open(settings["records"], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recorded["runs"][label]["records"])
        with open(log_path, "w") as f:
            f.write("max_total_num_tokens=811924\n")
        return {"rc": 0, "timed_out": False, "wall_s": 1.0}

    monkeypatch.setattr(BR, "run_config", fake_run)
    monkeypatch.setattr(BR, "check_backends", lambda args: None)  # FA3 does not import on a CPU machine
    monkeypatch.setattr(BR, "_env_info", lambda: {"date": "d", "device": "NVIDIA H100 80GB HBM3", "versions": "v"})
    out = tmp_path / "out"
    rc = DR.main(["--configs", "bf16", "fp8_online_blockwise_kv", "--deadline-s", "120", "--min-s", "75",
                  "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    assert rc == 1  # bf16 could not get --min-s once fp8_online_blockwise_kv's was kept
    assert [s[0] for s in started] == ["fp8_online_blockwise_kv"]
    assert started[0][1] == pytest.approx(115, abs=2) and started[0][2] == pytest.approx(115 - DR.STOP_MARGIN_S, abs=2)
    data = json.loads((out / "roofline.json").read_text())
    assert data["meta"]["model_config"]["num_hidden_layers"] == 36  # read from the folder make_models.py wrote
    assert data["runs"]["bf16"]["status"] == "skipped (deadline)"
    kv = data["runs"]["fp8_online_blockwise_kv"]
    assert kv["status"] == "ok" and kv["kv_tokens"] == 811924 and kv["records"] == \
        recorded["runs"]["fp8_online_blockwise_kv"]["records"]
    rep = data["report"]
    assert rep["bandwidth"]["gbps"] == 2990.0 and rep["card"] == "H100 SXM"
    assert rep["tables"]["fp8_online_blockwise_kv"]["8x4096"]["efficiency"] > 0
    assert all(t["status"] == "n/a" for t in rep["targets"] if t["kind"] == "speedup")  # no BF16 step
    assert "not measured (config skipped (deadline))" in (out / "roofline.md").read_text()


def test_suite_stage_runs_the_script_with_a_deadline_and_its_args(tmp_path):
    (line,) = stage_command_lines(tmp_path, "roofline", "decode_roofline.py",
                                  ROOFLINE_ARGS="--configs fp8_online_blockwise_kv --steps 16")
    a = DR.parse_args(line.split("decode_roofline.py", 1)[1].split())
    assert a.out == f"{tmp_path}/work/roofline" and a.model_dir == f"{tmp_path}/work/models"
    assert 400 < a.deadline_s < 560 and a.configs == ["fp8_online_blockwise_kv"] and a.steps == 16


def test_the_suite_summary_leaves_out_a_report_an_earlier_call_left(tmp_path):
    """A stage that wrote nothing (its script refused its arguments) shows no report in the summary, nor in $OUT,
    though an earlier call of a warm machine left one in $WORK (a failed roofline once printed the call before's)."""
    old = tmp_path / "work" / "roofline" / "roofline.md"
    old.parent.mkdir(parents=True)
    old.write_text("## Decode roofline: THE CALL BEFORE\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    stage_command_lines(tmp_path, "roofline", "decode_roofline.py")
    assert "THE CALL BEFORE" not in (tmp_path / "out" / "suite_summary.md").read_text()
    assert not (tmp_path / "out" / "roofline.md").exists()
    stage_command_lines(tmp_path, "tests", "pytest")  # a stage log written during the call is shown
    assert "## tests (tail)" in (tmp_path / "out" / "suite_summary.md").read_text()


def test_hooks_drive_bench_one_batchs_cells(tmp_path):
    """install_hooks on a stand-in for bench_one_batch's module: profile only where asked, a failed real prefill of
    a check cell is recorded and skipped, a failure anywhere else still stops the process."""
    seen, fail = [], {"on": False}

    def run_once(run_name, model_runner, batch_size, input_len, output_len, profile=False, profile_start_step=None,
                 profile_steps=None):
        seen.append((batch_size, input_len, profile))
        if fail["on"]:
            raise RuntimeError("CUDA out of memory")
        return {"median_decode_latency": 0.01}

    ob = types.SimpleNamespace(latency_test_run_once=run_once, extend=None, decode=None)
    rec = DRC.Recorder({"records": str(tmp_path / "r.jsonl"), "check_cells": [[8, 4096]],
                       "profile_cells": [[8, 4096]]})
    DRC.install_hooks(ob, rec)
    runner = _runner(10**6)
    for bs, il in ((1, 1024), (8, 1024), (8, 4096)):
        assert ob.latency_test_run_once("x", runner, bs, il, 9, profile=True) == {"median_decode_latency": 0.01}
    assert seen == [(1, 1024, False), (8, 1024, False), (8, 4096, True)]
    fail["on"] = True
    assert ob.latency_test_run_once("x", runner, 8, 4096, 9, profile=True) is None  # the check cell's repeat
    assert rec.cell is None and seen[-1] == (8, 4096, False)
    with pytest.raises(RuntimeError):
        ob.latency_test_run_once("x", runner, 32, 1024, 9)
    last = DR.read_jsonl(str(tmp_path / "r.jsonl"))[-1]
    assert last["occurrence"] == 2 and last["skipped"].startswith("the real prefill failed: RuntimeError")
