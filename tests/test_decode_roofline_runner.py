"""decode_roofline.py end to end on CPU: the driver's own command line for one config, its child inside SGLang's real
bench_one_batch and ModelRunner (a tiny Qwen3 in place of the Qwen3-8B folder), the records and the report.

What it shows about the skipped prefill: every cell's requests hold B x C distinct KV slots, the same ones a real
prefill of the cell holds (the check cell runs both), the first decode step sees sequence length C + 1, and the
decode steps run through bench_one_batch's own decode and ModelRunner.forward (each cell has its timed steps)."""

from __future__ import annotations

import json

import decode_roofline as DR
import pytest
import roofline_report as RP
from sgl_model import TINY, write_checkpoint

pytestmark = pytest.mark.slow

STEPS = 4
# the cells need 2 x (64 + 5) .. 16 x (16 + 5) tokens; 16 x (64 + 5) = 1,104 does not fit a pool of 1,024
CPU_ARGS = "--device cpu --attention-backend torch_native --mem-fraction-static 0.05 --max-total-tokens 1024"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from sglang_fp8rl.compat.runtime import no_graph_flags

    d = tmp_path_factory.mktemp("roofline_cpu")
    # bench_one_batch's prompts are random ids below 10,000: the check cell's real prefill embeds them
    write_checkpoint(str(d / "models" / "qwen3-8b"), dict(TINY, vocab_size=10240), seed=3)
    extra = " ".join([CPU_ARGS, *no_graph_flags()])
    rc = DR.main(["--configs", "bf16", "--batch-sizes", "1", "2", "16", "--contexts", "16", "64", "--steps",
                  str(STEPS), "--profile-cells", "--check-cells", "2x64", "--b2b-calls", "2", "--b2b-timings", "2",
                  "--attention-backend", "triton", "--model-dir", str(d / "models"), "--out", str(d / "out"),
                  "--budget-s", "500", f"--extra-args={extra}"])
    with open(d / "out" / "roofline.json") as f:
        data = json.load(f)
    return rc, data, (d / "out" / "roofline.md").read_text()


def test_the_process_ran_every_cell_that_fits(run):
    rc, data, _ = run
    bf16 = data["runs"]["bf16"]
    assert rc == 0 and bf16["status"] == "ok", bf16.get("error_tail")
    cells = RP.cells_of(bf16)
    assert set(cells) == {f"{b}x{c}" for b in (1, 2, 16) for c in (16, 64)}
    assert cells["16x64"]["skipped"] == "KV pool: 16 x (64 + 5) = 1,104 tokens > the pool's 1,024"
    assert bf16["kv_tokens"] == 1024


def test_a_skipped_prefill_leaves_the_cache_a_real_one_leaves(run):
    _, data, _ = run
    cells = RP.cells_of(data["runs"]["bf16"])
    for key, rec in cells.items():
        if rec.get("skipped"):
            continue
        bs, ctx = rec["bs"], rec["input_len"]
        assert rec["prefill"] == "skip"
        assert rec["kv_slots"] == bs * ctx, key  # no two requests share a slot
        assert rec["seq_lens"] == [ctx + 1, ctx + 1], key
        assert len(rec["steps_s"]) == STEPS and len(rec["b2b_s"]) == 2 and rec["bench_median_s"] > 0
    real = RP.check_records(data["runs"]["bf16"])["2x64"]
    assert real["prefill"] == "real" and real["occurrence"] == 2
    for field in ("kv_slots", "kv_slot_range", "seq_lens"):
        assert real[field] == cells["2x64"][field], field


def test_the_process_records_its_kv_fill_and_the_report_builds(run):
    _, data, md = run
    kinds = {r["kind"]: r for r in data["runs"]["bf16"]["records"]}
    assert kinds["bandwidth"] == {"kind": "bandwidth", "skipped": "no CUDA"}
    # TINY: 3 layers, 1 KV head of 128, BF16: K and V of the 1,024 + 1 backed slots
    assert kinds["kv_fill"] == {"kind": "kv_fill", "bytes": 2 * 3 * 1025 * 128 * 2, "slots": 1025}
    assert data["report"]["bandwidth"] is None  # no copy bandwidth on a CPU: steps without floors
    assert data["report"]["tables"]["bf16"]["2x64"]["step_ms"] > 0
    assert "prefill check, BF16 2 x 64" in md
