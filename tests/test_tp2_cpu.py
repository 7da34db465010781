"""Tensor parallelism 2 on CPU: two SGLang ModelRunner processes in one gloo world, load and update.

SGLang's CPU engine pads KV heads up to the TP size when there are fewer (a CPU-only config adjustment), so this
model has 2 KV heads: at TP 2 each rank holds one q head and one KV head. The intermediate size 384 gives each rank
192 rows, so gate_up and down fall back to per-channel on every rank while attention stays blockwise.
"""

from __future__ import annotations

import pytest
import torch
from sgl_model import TINY, random_state_dict, run_tp_workers, write_checkpoint

from sglang_fp8rl import quant

pytestmark = pytest.mark.slow

DIMS = dict(TINY, num_key_value_heads=2)
QUANT = ("--quantization", "fp8_online_blockwise")


def expected_local(sd: dict, layer: int, rank: int) -> dict[str, tuple]:
    """This rank's FP8 weights and scales, from hand-written TP-2 slices of the HF tensors."""
    p = f"model.layers.{layer}."
    rows = slice(rank * 128, (rank + 1) * 128)  # one q head / one kv head of 128 per rank
    inter = slice(rank * 192, (rank + 1) * 192)
    qkv = torch.cat([sd[p + "self_attn.q_proj.weight"][rows], sd[p + "self_attn.k_proj.weight"][rows],
                     sd[p + "self_attn.v_proj.weight"][rows]])
    gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"][inter], sd[p + "mlp.up_proj.weight"][inter]])
    return {
        p + "self_attn.qkv_proj": ("block", quant.quantize_blockwise(qkv)),
        p + "self_attn.o_proj": ("block", quant.quantize_blockwise(sd[p + "self_attn.o_proj.weight"][:, rows])),
        p + "mlp.gate_up_proj": ("channel", quant.quantize_per_channel(gate_up)),
        p + "mlp.down_proj": ("channel", quant.quantize_per_channel(sd[p + "mlp.down_proj.weight"][:, inter])),
    }


def check_rank(params: dict, sd: dict, rank: int) -> None:
    for layer in range(DIMS["num_hidden_layers"]):
        for module, (scheme, (q, s)) in expected_local(sd, layer, rank).items():
            scale_name = module + (".weight_scale_inv" if scheme == "block" else ".weight_scale")
            assert torch.equal(params[module + ".weight"].view(torch.uint8), q.view(torch.uint8)), (rank, module)
            assert torch.equal(params[scale_name], s), (rank, module)
        norm = f"model.layers.{layer}.input_layernorm.weight"
        assert torch.equal(params[norm], sd[norm])


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2")
    w0 = write_checkpoint(str(d / "w0"), DIMS, seed=20)
    w1 = random_state_dict(DIMS, seed=21)
    requests = str(d / "req.pt")
    torch.save([{"kind": "tensor", "tensors": list(w1.items())}], requests)
    cold = run_tp_workers("load", str(d / "w0"), str(d / "cold"), 2, *QUANT)
    updated = run_tp_workers("updates", str(d / "w0"), str(d / "upd"), 2, *QUANT,
                             extra={"requests": requests, "params_each": False})
    return {"w0": w0, "w1": w1, "cold": cold, "updated": updated}


def test_tp2_load_is_bit_identical_per_rank(tp2):
    """Each rank holds exactly the reference quantization of its own TP-2 slices; the fallback is per rank."""
    for rank, result in enumerate(tp2["cold"]):
        check_rank(result["params"], tp2["w0"], rank)
        summary = result["report"]["summary"]
        assert "block=6, channel=6" in summary and "output shard 'gate'=192 not a multiple of 128" in summary


def test_tp2_update_equals_cold_slices_and_keeps_pointers(tp2):
    """A full W1 update on both ranks gives each rank the reference quantization of its W1 slices, in place."""
    for rank, result in enumerate(tp2["updated"]):
        assert all(ok for ok, _ in result["answers"]), result["answers"]
        check_rank(result["final_params"], tp2["w1"], rank)
        assert result["ptrs_before"] == result["ptrs_after"]


@pytest.fixture(scope="module")
def tp2_fault(tmp_path_factory, tp2):
    d = tmp_path_factory.mktemp("tp2fault")
    write_checkpoint(str(d / "w0"), DIMS, seed=20)
    requests = str(d / "req.pt")
    torch.save([{"kind": "tensor", "tensors": list(tp2["w1"].items())}], requests)
    return run_tp_workers("tp_fault", str(d / "w0"), str(d / "fault"), 2, *QUANT, extra={"requests": requests})


def test_tp2_rank_local_validation_failure_rejects_on_every_rank(tp2_fault):
    """Rank 1 runs out of memory while validating: both ranks answer 'rejected' naming rank 1, and neither wrote."""
    for rank, result in enumerate(tp2_fault):
        step = result["steps"][0]
        ok, message = step["answer"]
        assert not ok and "nothing was written" in message and "TP rank 1" in message and "out of memory" in message
        for name, before in result["params_before"].items():
            assert torch.equal(step["params"][name].view(torch.uint8), before.view(torch.uint8)), (rank, name)
        assert step["consistent"]


def test_tp2_rank_local_write_failure_marks_every_rank_inconsistent(tp2, tp2_fault):
    """Rank 1 fails while writing: both ranks answer the partial failure and both refuse to serve, with the same
    dirty tensors (every tensor of the request), although rank 0 wrote everything; a complete update then makes
    both consistent and exact."""
    for rank, result in enumerate(tp2_fault):
        step = result["steps"][1]
        ok, message = step["answer"]
        assert not ok and "mix of old and new weights" in message and "TP rank 1" in message, message
        assert not step["consistent"] and step["dirty"] == sorted(tp2["w1"])
        complete = result["steps"][2]
        assert complete["answer"][0] and complete["consistent"], complete["answer"]
        check_rank(complete["params"], tp2["w1"], rank)
