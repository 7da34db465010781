"""`fp8_online_blockwise` on a tiny Qwen3-MoE through SGLang's real CPU ModelRunner: expert quantization, the
per-channel fallback, the router left in BF16, update equivalence, pointer stability and atomic rejection."""

from __future__ import annotations

import pytest
import torch
from sgl_model import (
    TINY_MOE,
    TINY_MOE_FALLBACK,
    as_bytes,
    assert_same_params,
    assert_update_matches_cold_load,
    random_moe_state_dict,
    run_tp_workers,
    run_update_requests,
    run_worker,
    split_randomly,
    write_moe_checkpoint,
)

from sglang_fp8rl import quant

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")
EXPERTS = "model.layers.{layer}.mlp.experts"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """W0/W1 of the block model and W0 of the fallback model, with cold loads (FP8 and BF16)."""
    d = tmp_path_factory.mktemp("moe")
    w0 = write_moe_checkpoint(str(d / "w0"), TINY_MOE, seed=20)
    w1 = write_moe_checkpoint(str(d / "w1"), TINY_MOE, seed=21)
    fb = write_moe_checkpoint(str(d / "fb"), TINY_MOE_FALLBACK, seed=22)
    return {
        "dir": d, "w0": w0, "w1": w1, "fb": fb,
        "cold_w0": run_worker("load", str(d / "w0"), str(d / "cold_w0.pt"), *QUANT),
        "cold_w1": run_worker("load", str(d / "w1"), str(d / "cold_w1.pt"), *QUANT),
        "cold_fb": run_worker("load", str(d / "fb"), str(d / "cold_fb.pt"), *QUANT),
        "bf16_w0": run_worker("load", str(d / "w0"), str(d / "bf16_w0.pt")),
    }


def run_requests(models: dict, name: str, requests: list[dict], model: str = "w0", **extra) -> dict:
    """Load ``model`` and push ``requests`` through SGLang's WeightUpdater in a fresh worker."""
    return run_update_requests(str(models["dir"] / model), models["dir"], name, requests, *QUANT, **extra)


def check_experts_match_reference(result: dict, sd: dict, dims: dict, scheme: str) -> None:
    """Every expert slice of w13/w2 equals the reference quantizer of cat(gate, up) / down; the router is BF16."""
    params, decisions = result["params"], result["report"]["decisions"]
    for layer in range(dims["num_hidden_layers"]):
        prefix = EXPERTS.format(layer=layer)
        assert decisions[prefix][0] == scheme, decisions[prefix]
        for e in range(dims["num_experts"]):
            ckpt = f"{prefix}.{e}."
            w13 = torch.cat([sd[ckpt + "gate_proj.weight"], sd[ckpt + "up_proj.weight"]])
            for fused, w in (("w13", w13), ("w2", sd[ckpt + "down_proj.weight"])):
                if scheme == "block":
                    q, s = quant.quantize_blockwise(w)
                    got_s = params[f"{prefix}.{fused}_weight_scale_inv"][e]
                else:
                    q, s = quant.quantize_per_channel(w)
                    s, got_s = s[:, None], params[f"{prefix}.{fused}_weight_scale"][e]
                assert torch.equal(params[f"{prefix}.{fused}_weight"][e].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(got_s, s), (prefix, e, fused)
        router = f"model.layers.{layer}.mlp.gate.weight"
        assert params[router].dtype == torch.bfloat16 and torch.equal(params[router], sd[router]), router


def test_block_experts_bit_identical_to_reference(models):
    """I=256: w13 [E, 512, 256] / w2 [E, 256, 256] FP8 with block scales [E, 4, 2] / [E, 2, 2], each expert slice
    exactly quant.quantize_blockwise of the checkpoint; the router stays the checkpoint's BF16 tensor."""
    params = models["cold_w0"]["params"]
    prefix = EXPERTS.format(layer=0)
    assert params[f"{prefix}.w13_weight"].shape == (4, 512, 256)
    assert params[f"{prefix}.w13_weight_scale_inv"].shape == (4, 4, 2)
    assert params[f"{prefix}.w2_weight_scale_inv"].shape == (4, 2, 2)
    check_experts_match_reference(models["cold_w0"], models["w0"], TINY_MOE, "block")


def test_fallback_experts_are_per_channel(models):
    """I=192 is not a multiple of 128: the whole MoE layer is per-channel ([E, 2I, 1] / [E, H, 1] scales), with the
    reason in the report; attention stays blockwise."""
    result = models["cold_fb"]
    params, decisions = result["params"], result["report"]["decisions"]
    prefix = EXPERTS.format(layer=1)
    assert params[f"{prefix}.w13_weight_scale"].shape == (4, 384, 1)
    assert params[f"{prefix}.w2_weight_scale"].shape == (4, 256, 1)
    assert "not a multiple of 128" in decisions[prefix][1]
    assert decisions["model.layers.0.self_attn.qkv_proj"][0] == "block"
    check_experts_match_reference(result, models["fb"], TINY_MOE_FALLBACK, "channel")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_logits_close_to_bf16_model(models):
    """FP8 vs the same MoE model in BF16. E4M3 keeps 3 mantissa bits (relative rounding <= 1/16, RMS ~3.6% per
    operand), so each GEMM carries ~5% RMS error from weights and activations; through 2 layers (attention + 2 of 4
    experts each) and lm_head the logits must stay within 15% relative L2 and agree on the argmax. Routing itself is
    BF16, so a near-tie between two experts may flip; the bound leaves room for that."""
    for got, want in zip(models["cold_w0"]["logits"], models["bf16_w0"]["logits"]):
        print("fp8 vs bf16", rel_err(got, want))
        assert torch.isfinite(got).all()
        assert 1e-4 < rel_err(got, want) < 0.15  # > 1e-4: the FP8 path really ran
        assert got.argmax() == want.argmax()


def test_update_equivalence_and_pointers(models):
    """W0 loaded, W1 pushed in 3 shuffled requests (BF16 and FP32): every parameter bit-identical to a cold load
    of W1, no pointer moved, logits equal."""
    parts = split_randomly(models["w1"], 3, seed=1)
    requests = [{"tensors": parts[0]}, {"tensors": [(n, t.float()) for n, t in parts[1]]}, {"tensors": parts[2]}]
    out = run_requests(models, "equiv", requests, params_each=False)
    assert_update_matches_cold_load(out, models["cold_w1"])


MARKER = ("fp8rl.step_complete", torch.zeros(()))  # the step-complete control entry (weight_sync/protocol.py)


def bad_requests(models: dict) -> list[tuple[str, dict, str]]:
    """(case, request, expected message fragments separated by '|'): each must be refused with nothing written."""
    w1 = models["w1"]
    good = ("model.layers.0.mlp.experts.2.down_proj.weight", w1["model.layers.0.mlp.experts.2.down_proj.weight"])
    up, router = "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.gate.weight"
    nan = w1[up].clone()
    nan[9, 4] = float("nan")
    return [
        ("wrong expert shape", {"tensors": [good, (up, w1[up][:128])]},
         "expected an unsharded tensor of shape (256, 256)"),
        ("nan in an expert", {"tensors": [good, (up, nan)]}, "contains NaN/Inf|first at index [9, 4]"),
        ("expert id out of range", {"tensors": [good, ("model.layers.1.mlp.experts.4.up_proj.weight", w1[up])]},
         "not a parameter"),
        # FP8 is accepted only as codes with their scales (pre-quantized updates, test_prequantized_updates.py); a half
        # alone is held for a later request of the step, so a request that ends the step with one is refused
        ("fp8 expert", {"tensors": [good, (up, w1[up].to(torch.float8_e4m3fn)), MARKER]},
         "ends the step|up_proj.weight without model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"),
        ("expert scale", {"tensors": [good, ("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv",
                                             torch.ones(2, 2)), MARKER]},
         "ends the step|up_proj.weight_scale_inv without"),
        ("scale of a bf16 expert", {"tensors": [good, (up, w1[up]), (up + "_scale_inv", torch.ones(2, 2))]},
         "a scale needs|as float8_e4m3fn codes"),
        ("router shape", {"tensors": [good, (router, w1[router][:2])]}, router),
    ]


def test_bad_updates_rejected_then_partial_update(models):
    """Each bad request is refused naming tensor and reason, all parameters byte-identical; then one expert's
    up_proj changes exactly rows I:2I of that expert's w13 (and its scale rows), nothing else."""
    cases = bad_requests(models)
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    requests = [req for _, req, _ in cases] + [{"tensors": [(up, models["w1"][up])]}]
    out = run_requests(models, "bad", requests)
    before = models["cold_w0"]["params"]
    for (case, _, fragment), (ok, message), params in zip(cases, out["answers"], out["params_after"]):
        assert not ok, case
        assert all(part in message for part in fragment.split("|")), (case, message)
        assert "nothing was written" in message, (case, message)
        assert_same_params(params, before)
    assert out["answers"][-1][0], out["answers"][-1]
    after, w1_cold = out["params_after"][-1], models["cold_w1"]["params"]
    w13, scale = "model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w13_weight_scale_inv"
    for name in after:
        if name not in (w13, scale):
            assert torch.equal(as_bytes(after[name]), as_bytes(before[name])), name
    changed = (as_bytes(after[w13]) != as_bytes(before[w13])).any(dim=2).nonzero().tolist()
    assert {e for e, _ in changed} == {3} and min(r for _, r in changed) >= 256
    assert torch.equal(as_bytes(after[w13][3, 256:]), as_bytes(w1_cold[w13][3, 256:]))
    assert torch.equal(after[scale][3, 2:], w1_cold[scale][3, 2:])
    assert torch.equal(after[scale][3, :2], before[scale][3, :2]) and torch.equal(after[scale][:3], before[scale][:3])
    assert out["ptrs_before"] == out["ptrs_after"]
    assert out["state"]["consistent"]


def test_fallback_update_equivalence(models, tmp_path):
    """The per-channel fallback model: W0 -> W1 by update equals a cold load of W1 (checked against the reference
    quantizer directly, to avoid a second cold load)."""
    w1 = random_moe_state_dict(TINY_MOE_FALLBACK, seed=23)
    experts = [(n, t) for n, t in w1.items() if ".mlp." in n]
    out = run_requests(models, "fb_equiv", [{"tensors": part} for part in split_randomly(dict(experts), 2, seed=2)],
                       model="fb", params_each=False)
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    assert out["ptrs_before"] == out["ptrs_after"]
    check_experts_match_reference({"params": out["final_params"], "report": models["cold_fb"]["report"]},
                                  w1, TINY_MOE_FALLBACK, "channel")


def test_tp2_update_slices_experts_per_rank(models):
    """TP 2 (MoE TP 2, I_local 128): after W0 -> W1 by update, rank r holds exactly the reference quantization of
    cat(gate[r], up[r]) and down[:, r] (r = rows/columns 128r:128r+128) for every expert; pointers unchanged.
    Two KV heads here: Qwen3-MoE attention with 1 KV head at TP 2 is refused by the dense qkv loader (see report)."""
    d = models["dir"]
    dims = dict(TINY_MOE, num_key_value_heads=2)
    write_moe_checkpoint(str(d / "tp2_w0"), dims, seed=24)
    sd = random_moe_state_dict(dims, seed=25)
    path = str(d / "tp2.req.pt")
    torch.save([{"tensors": list(sd.items())}], path)
    ranks = run_tp_workers("updates", str(d / "tp2_w0"), str(d / "tp2"), 2, *QUANT,
                           extra={"requests": path, "params_each": False})
    for rank, out in enumerate(ranks):
        assert all(ok for ok, _ in out["answers"]), out["answers"]
        assert out["ptrs_before"] == out["ptrs_after"]
        part = slice(128 * rank, 128 * (rank + 1))
        params = out["final_params"]
        for layer in range(TINY_MOE["num_hidden_layers"]):
            prefix = EXPERTS.format(layer=layer)
            for e in range(TINY_MOE["num_experts"]):
                ckpt = f"{prefix}.{e}."
                w13 = torch.cat([sd[ckpt + "gate_proj.weight"][part], sd[ckpt + "up_proj.weight"][part]])
                for fused, w in (("w13", w13), ("w2", sd[ckpt + "down_proj.weight"][:, part])):
                    q, s = quant.quantize_blockwise(w)
                    assert torch.equal(params[f"{prefix}.{fused}_weight"][e].view(torch.uint8), q.view(torch.uint8))
                    assert torch.equal(params[f"{prefix}.{fused}_weight_scale_inv"][e], s), (rank, prefix, e, fused)
    for got, other in zip(ranks[0]["logits"], ranks[1]["logits"]):
        assert torch.isfinite(got).all() and torch.equal(got, other)


# ---------------------------------------------------------------------------------------------------------------------
# a MoE layer kept in BF16 (SGLang's UnquantizedFusedMoEMethod: w13 [E, 2I, H], w2 [E, H, I])

BF16_FIRST = ("--fp8rl-bf16-first-layers", "1")
WRONG_EXPERT = "model.layers.0.mlp.experts.1.gate_proj.weight"


def experts_of(sd: dict, layer: int) -> list[tuple[str, torch.Tensor]]:
    """Every expert tensor of one layer (gate/up/down of each expert)."""
    prefix = EXPERTS.format(layer=layer) + "."
    return [(n, t) for n, t in sd.items() if n.startswith(prefix)]


def wrong_expert_request(sd: dict) -> dict:
    """One expert tensor of half its hidden size: SGLang's loader alone would fill only part of the expert's slice."""
    return {"tensors": [(WRONG_EXPERT, sd[WRONG_EXPERT][:, :128])]}


def assert_refused_naming_the_expert(answer: tuple) -> None:
    ok, message = answer
    assert not ok and WRONG_EXPERT in message and "(256, 128)" in message and "nothing was written" in message, message


def test_bf16_kept_moe_layer_takes_expert_updates(models):
    """--fp8rl-bf16-first-layers 1: every expert of layer 0 (BF16) in one update is accepted and leaves exactly what
    a fresh load of those weights gives (layer 1 stays FP8 and untouched); a wrong-shape expert tensor is refused."""
    d = models["dir"]
    experts = experts_of(models["w1"], 0)
    write_moe_checkpoint(str(d / "mixed"), TINY_MOE, seed=0, state_dict={**models["w0"], **dict(experts)})
    cold = run_worker("load", str(d / "mixed"), str(d / "cold_mixed.pt"), *QUANT, *BF16_FIRST)
    assert cold["report"]["decisions"][EXPERTS.format(layer=0)][0] == "bf16"
    requests = [wrong_expert_request(models["w1"]), {"tensors": experts}]
    out = run_update_requests(str(d / "w0"), d, "bf16_moe", requests, *QUANT, *BF16_FIRST)
    assert_refused_naming_the_expert(out["answers"][0])
    w13 = out["params_after"][0][EXPERTS.format(layer=0) + ".w13_weight"]
    w0_expert = EXPERTS.format(layer=0) + ".1."
    assert torch.equal(w13[1], torch.cat([models["w0"][w0_expert + "gate_proj.weight"],
                                          models["w0"][w0_expert + "up_proj.weight"]]))  # nothing written
    assert out["answers"][1][0], out["answers"][1]
    assert_same_params(out["final_params"], cold["params"])
    assert out["ptrs_before"] == out["ptrs_after"] and out["state"]["consistent"]


def test_bf16_kept_moe_layer_tp2_writes_each_ranks_slice(models):
    """TP 2, layer 0 in BF16: each rank's w13[e] / w2[e] hold exactly its half of cat(gate, up) / down after an
    update of every expert of layer 0; a wrong-shape expert tensor is refused on both ranks."""
    d = models["dir"]
    dims = dict(TINY_MOE, num_key_value_heads=2)
    write_moe_checkpoint(str(d / "bf16_tp2_w0"), dims, seed=26)
    sd = random_moe_state_dict(dims, seed=27)
    path = str(d / "bf16_tp2.req.pt")
    torch.save([wrong_expert_request(sd), {"tensors": experts_of(sd, 0)}], path)
    ranks = run_tp_workers("updates", str(d / "bf16_tp2_w0"), str(d / "bf16_tp2"), 2, *QUANT, *BF16_FIRST,
                           extra={"requests": path, "params_each": False})
    prefix = EXPERTS.format(layer=0)
    for rank, out in enumerate(ranks):
        assert_refused_naming_the_expert(out["answers"][0])
        assert out["answers"][1][0], out["answers"][1]
        part = slice(128 * rank, 128 * (rank + 1))
        params = out["final_params"]
        for e in range(TINY_MOE["num_experts"]):
            ckpt = f"{prefix}.{e}."
            w13 = torch.cat([sd[ckpt + "gate_proj.weight"][part], sd[ckpt + "up_proj.weight"][part]])
            assert torch.equal(params[prefix + ".w13_weight"][e], w13), (rank, e)
            assert torch.equal(params[prefix + ".w2_weight"][e], sd[ckpt + "down_proj.weight"][:, part]), (rank, e)


def test_validate_only_round_against_a_stock_bf16_moe_engine(models):
    """The client's all-or-nothing step first sends every bucket as load_format="fp8rl.validate"; a stock BF16 MoE
    engine (no --quantization) validates every expert tensor, refuses a wrong-shape one, and writes nothing."""
    d = models["dir"]
    validate = "fp8rl.validate"
    requests = [{"tensors": experts_of(models["w1"], 0) + experts_of(models["w1"], 1), "load_format": validate},
                {**wrong_expert_request(models["w1"]), "load_format": validate}]
    out = run_update_requests(str(d / "w0"), d, "stock_validate", requests)
    assert out["answers"][0][0] and "validated" in out["answers"][0][1], out["answers"][0]
    assert_refused_naming_the_expert(out["answers"][1])
    assert_same_params(out["final_params"], models["bf16_w0"]["params"])
