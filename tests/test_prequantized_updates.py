"""Pre-quantized (checkpoint-format) FP8 updates through SGLang's real WeightUpdater on CPU, and all-or-nothing steps.

The request carries ``<x>_proj.weight`` as float8_e4m3fn codes and ``<x>_proj.weight_scale_inv`` (float32, one per
128x128 block), mixed with BF16 tensors. Expected bytes are written out by hand from the rules:
* a blockwise layer on this rank stores exactly the sent codes and scales (here power-of-two scales, which our own
  quantizer would not produce, so a re-quantization would show);
* a per-channel (fallback) layer stores the per-channel quantization of BF16(codes x block scale);
* a layer kept in BF16 stores BF16(codes x block scale).
Refusals of malformed pairs are cases of the malformed-request suite (tests/malformed_cases.py).
"""

from __future__ import annotations

import pytest
import torch
from sgl_model import (
    TINY,
    TINY_FALLBACK,
    TINY_MOE,
    TINY_MOE_FALLBACK,
    as_bytes,
    random_moe_state_dict,
    random_state_dict,
    run_tp_workers,
    run_update_requests,
    run_worker,
    write_checkpoint,
    write_moe_checkpoint,
)

from sglang_fp8rl import quant
from sglang_fp8rl.weight_sync.protocol import VALIDATE_ONLY, VALIDATE_ONLY_FLATTENED

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prequantized(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with every linear / expert weight as FP8 codes + power-of-two block scales (the trainer's side)."""
    out = {}
    for name, w in sd.items():
        if name.endswith(".weight") and any(f".{lin}." in name for lin in LINEARS):
            codes, scale = quant.quantize_blockwise(w, scale_format="pow2")
            out[name], out[name + "_scale_inv"] = codes, scale
        else:
            out[name] = w
    return out


def value_of(payload: dict, name: str) -> torch.Tensor:
    """The BF16 weight the codes stand for: codes x block scale in float32, rounded to BF16."""
    return quant.dequantize_blockwise(payload[name], payload[name + "_scale_inv"]).to(torch.bfloat16)


def assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    assert torch.equal(as_bytes(got), as_bytes(want)), what


def check_dense_layer(params: dict, payload: dict, layer: int, fallback_mlp: bool, bf16_o: bool) -> None:
    p = f"model.layers.{layer}."
    q, k, v = (p + f"self_attn.{x}_proj.weight" for x in "qkv")
    assert_bytes(params[p + "self_attn.qkv_proj.weight"], torch.cat([payload[q], payload[k], payload[v]]), q)
    assert_bytes(params[p + "self_attn.qkv_proj.weight_scale_inv"],
                 torch.cat([payload[q + "_scale_inv"], payload[k + "_scale_inv"], payload[v + "_scale_inv"]]), q)
    o = p + "self_attn.o_proj.weight"
    if bf16_o:  # kept in BF16 by --fp8rl-ignore
        assert_bytes(params[o], value_of(payload, o), o)
    else:
        assert_bytes(params[o], payload[o], o)
    gate, up, down = (p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))
    if fallback_mlp:
        codes, scale = quant.quantize_per_channel(torch.cat([value_of(payload, gate), value_of(payload, up)]))
        assert_bytes(params[p + "mlp.gate_up_proj.weight"], codes, gate)
        assert_bytes(params[p + "mlp.gate_up_proj.weight_scale"], scale, gate)
        codes, scale = quant.quantize_per_channel(value_of(payload, down))
        assert_bytes(params[p + "mlp.down_proj.weight"], codes, down)
        assert_bytes(params[p + "mlp.down_proj.weight_scale"], scale, down)
    else:
        assert_bytes(params[p + "mlp.gate_up_proj.weight"], torch.cat([payload[gate], payload[up]]), gate)
        assert_bytes(params[p + "mlp.gate_up_proj.weight_scale_inv"],
                     torch.cat([payload[gate + "_scale_inv"], payload[up + "_scale_inv"]]), gate)
        assert_bytes(params[p + "mlp.down_proj.weight"], payload[down], down)
        assert_bytes(params[p + "mlp.down_proj.weight_scale_inv"], payload[down + "_scale_inv"], down)


@pytest.mark.parametrize("dims,fallback,extra_args", [
    (TINY, False, ("--fp8rl-ignore", r"layers\.\d+\.self_attn\.o_proj")),
    (TINY_FALLBACK, True, ()),
], ids=["block+bf16", "fallback"])
def test_dense_prequantized_update(tmp_path, dims, fallback, extra_args):
    """One request mixing FP8 codes+scales (every linear) and BF16 (norms, embeddings, lm_head)."""
    write_checkpoint(str(tmp_path / "w0"), dims, seed=50)
    w1 = random_state_dict(dims, seed=51)
    payload = prequantized(w1)
    out = run_update_requests(str(tmp_path / "w0"), tmp_path, "pq", [{"tensors": list(payload.items())}], *QUANT,
                              *extra_args, params_each=False)
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    assert out["ptrs_before"] == out["ptrs_after"]
    params = out["final_params"]
    for layer in range(dims["num_hidden_layers"]):
        check_dense_layer(params, payload, layer, fallback, bf16_o=bool(extra_args))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert_bytes(params[name], w1[name], name)


def test_prequantized_update_from_disk(tmp_path):
    """A checkpoint folder holding FP8 codes and scales (as trainers save them) updates the engine from disk."""
    write_checkpoint(str(tmp_path / "w0"), TINY, seed=52)
    w1 = random_state_dict(TINY, seed=53)
    payload = prequantized(w1)
    write_checkpoint(str(tmp_path / "w1fp8"), TINY, seed=53, state_dict=payload)
    out = run_update_requests(str(tmp_path / "w0"), tmp_path, "pqdisk",
                              [{"kind": "disk", "path": str(tmp_path / "w1fp8")}], *QUANT, params_each=False)
    assert out["answers"][0][0], out["answers"]
    for layer in range(TINY["num_hidden_layers"]):
        check_dense_layer(out["final_params"], payload, layer, fallback_mlp=False, bf16_o=False)


@pytest.mark.parametrize("dims,scheme", [(TINY_MOE, "block"), (TINY_MOE_FALLBACK, "channel")])
def test_moe_prequantized_update(tmp_path, dims, scheme):
    """Experts follow the same rules, per expert: stored as sent (block) or re-quantized from their value."""
    write_moe_checkpoint(str(tmp_path / "w0"), dims, seed=54)
    payload = prequantized(random_moe_state_dict(dims, seed=55))
    out = run_update_requests(str(tmp_path / "w0"), tmp_path, "pqmoe", [{"tensors": list(payload.items())}],
                              *QUANT, params_each=False)
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    params = out["final_params"]
    for layer in range(dims["num_hidden_layers"]):
        experts = f"model.layers.{layer}.mlp.experts"
        for e in range(dims["num_experts"]):
            gate, up, down = (f"{experts}.{e}.{x}_proj.weight" for x in ("gate", "up", "down"))
            if scheme == "block":
                assert_bytes(params[experts + ".w13_weight"][e], torch.cat([payload[gate], payload[up]]), gate)
                assert_bytes(params[experts + ".w13_weight_scale_inv"][e],
                             torch.cat([payload[gate + "_scale_inv"], payload[up + "_scale_inv"]]), gate)
                assert_bytes(params[experts + ".w2_weight"][e], payload[down], down)
                assert_bytes(params[experts + ".w2_weight_scale_inv"][e], payload[down + "_scale_inv"], down)
            else:
                codes, scale = quant.quantize_per_channel(torch.cat([value_of(payload, gate), value_of(payload, up)]))
                assert_bytes(params[experts + ".w13_weight"][e], codes, gate)
                assert_bytes(params[experts + ".w13_weight_scale"][e, :, 0], scale, gate)
                codes, scale = quant.quantize_per_channel(value_of(payload, down))
                assert_bytes(params[experts + ".w2_weight"][e], codes, down)


def test_tp2_prequantized_update_slices_along_blocks(tmp_path):
    """TP 2: q/k/v rows and o_proj columns (with their scale rows / columns) are the rank's blocks of the sent
    codes; gate/up/down (192 rows per rank: fallback) are re-quantized per channel from the codes' value."""
    dims = dict(TINY, num_key_value_heads=2)
    write_checkpoint(str(tmp_path / "w0"), dims, seed=56)
    payload = prequantized(random_state_dict(dims, seed=57))
    path = str(tmp_path / "req.pt")
    torch.save([{"kind": "tensor", "tensors": list(payload.items())}], path)
    results = run_tp_workers("updates", str(tmp_path / "w0"), str(tmp_path / "tp"), 2, *QUANT,
                             extra={"requests": path, "params_each": False})
    for rank, result in enumerate(results):
        assert all(ok for ok, _ in result["answers"]), result["answers"]
        params = result["final_params"]
        rows, blk = slice(128 * rank, 128 * rank + 128), slice(rank, rank + 1)
        inter = slice(192 * rank, 192 * rank + 192)
        for layer in range(dims["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            q, k, v, o = (p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o"))
            assert_bytes(params[p + "self_attn.qkv_proj.weight"],
                         torch.cat([payload[q][rows], payload[k][rows], payload[v][rows]]), (rank, q))
            assert_bytes(params[p + "self_attn.qkv_proj.weight_scale_inv"],
                         torch.cat([payload[x + "_scale_inv"][blk] for x in (q, k, v)]), (rank, q))
            assert_bytes(params[p + "self_attn.o_proj.weight"], payload[o][:, rows], (rank, o))
            assert_bytes(params[p + "self_attn.o_proj.weight_scale_inv"], payload[o + "_scale_inv"][:, blk], (rank, o))
            gate, up, down = (p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))
            codes, scale = quant.quantize_per_channel(value_of(payload, down)[:, inter])
            assert_bytes(params[p + "mlp.down_proj.weight"], codes, (rank, down))
            codes, scale = quant.quantize_per_channel(
                torch.cat([value_of(payload, gate)[inter], value_of(payload, up)[inter]]))
            assert_bytes(params[p + "mlp.gate_up_proj.weight_scale"], scale, (rank, gate))


@pytest.mark.parametrize("flatten", [False, True], ids=["pairs", "flattened"])
def test_atomic_step_with_a_bad_last_bucket_writes_nothing(tmp_path, flatten):
    """push_state_dict(atomic=True): every bucket is validated before any is written, so a bad last bucket leaves
    every parameter byte-identical; a good step then equals a cold load, and it ends with the step marker. With
    flatten=True every bucket travels as one flattened buffer (FP32 and BF16 tensors together), validated as
    such, and the step marker follows in a request of its own, which alone flushes the cache."""
    write_checkpoint(str(tmp_path / "w0"), TINY, seed=58)
    w1 = random_state_dict(TINY, seed=59)
    write_checkpoint(str(tmp_path / "w1"), TINY, seed=59, state_dict=w1)
    # norms in FP32 (exactly the checkpoint's BF16 values) beside BF16 weights: FP32 and BF16 in one bucket
    pushed = {n: t.float() if "norm" in n else t for n, t in w1.items()}
    assert {t.dtype for t in pushed.values()} == {torch.float32, torch.bfloat16}
    torch.save(pushed, tmp_path / "w1.pt")
    cold = run_worker("load", str(tmp_path / "w1"), str(tmp_path / "cold.pt"), *QUANT)
    out = run_worker("atomic", str(tmp_path / "w0"), str(tmp_path / "atomic.pt"), *QUANT,
                     extra={"state_dict": str(tmp_path / "w1.pt"), "bucket_bytes": 256 << 10, "flatten": flatten})
    assert "step validation" in out["bad_error"] and "not a parameter" in out["bad_error"]
    assert out["writes_after_bad"] == 0  # not one writing request reached the engine
    for name, before in out["before"].items():
        assert_bytes(out["after_bad"][name], before, name)
    assert out["good_answers"] and all(ok for ok, _ in out["good_answers"])
    for name, want in cold["params"].items():
        assert_bytes(out["after_good"][name], want, name)
    assert out["last_request_names"][-1] == "fp8rl.step_complete"
    assert out["pointers_kept"] and out["consistent"]
    formats, flushes = out["formats"], out["flushes"]
    if flatten:
        buckets = formats.count("flattened_bucket")
        assert set(out["bad_formats"]) == {VALIDATE_ONLY_FLATTENED}
        assert formats == [VALIDATE_ONLY_FLATTENED] * buckets + ["flattened_bucket"] * buckets + [None], formats
        assert out["last_request_names"] == ["fp8rl.step_complete"] and buckets > 3  # really bucketed
    else:
        assert set(out["bad_formats"]) == {VALIDATE_ONLY}
        assert formats[: len(formats) // 2] == [VALIDATE_ONLY] * (len(formats) // 2)
    assert flushes == [False] * (len(flushes) - 1) + [True]  # the cache is flushed once, by the last request


def split_pairs(payload: dict) -> list[list[tuple[str, torch.Tensor]]]:
    """verl-style buckets that split pairs: each weight's codes in one request, its scale in the next, with the
    BF16 tensors spread over both (the scale of the last weight arrives with the step marker)."""
    codes = [(n, t) for n, t in payload.items() if t.dtype == torch.float8_e4m3fn]
    plain = [(n, t) for n, t in payload.items() if t.dtype != torch.float8_e4m3fn and not n.endswith("_scale_inv")]
    first = codes[: len(codes) // 2] + plain[: len(plain) // 2]
    second = ([(n + "_scale_inv", payload[n + "_scale_inv"]) for n, _ in codes[: len(codes) // 2]]
              + codes[len(codes) // 2:] + plain[len(plain) // 2:])
    third = [(n + "_scale_inv", payload[n + "_scale_inv"]) for n, _ in codes[len(codes) // 2:]]
    return [first, second, third + [("fp8rl.step_complete", torch.empty(0))]]


def test_pairs_split_across_requests_are_held_and_written_with_their_partner(tmp_path):
    """A weight's codes in one request, its scale in a later one of the same step: the engine holds the half that
    came first (telemetry names it), writes the pair when the partner comes, and the step's end finds nothing
    unpaired: every byte as if each pair had come together."""
    write_checkpoint(str(tmp_path / "w0"), TINY, seed=60)
    w1 = random_state_dict(TINY, seed=61)
    payload = prequantized(w1)
    requests = [{"tensors": r} for r in split_pairs(payload)]
    out = run_update_requests(str(tmp_path / "w0"), tmp_path, "split", requests, *QUANT, step_each=True)
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    held = [s["held_halves"] for s in out["steps"]]
    codes = [n for n, t in payload.items() if t.dtype == torch.float8_e4m3fn]
    assert held[0] == sorted(codes[: len(codes) // 2])
    assert held[1] == sorted(codes[len(codes) // 2:])  # the first half written, the second half waiting
    assert out["steps"][2]["steps_ended"] == 1 and held[2] == []
    assert out["state"]["consistent"]
    for layer in range(TINY["num_hidden_layers"]):
        check_dense_layer(out["final_params"], payload, layer, fallback_mlp=False, bf16_o=False)


def test_a_step_that_would_end_with_an_unpaired_half_is_refused_naming_both(tmp_path):
    """The scale has not come when the request with the step marker arrives: that request is refused before any of
    it is written, naming the weight and the scale it waits for; the half stays held, and a request bringing the
    scale (with the marker) then ends the step with every byte as sent."""
    write_checkpoint(str(tmp_path / "w0"), TINY, seed=62)
    payload = prequantized(random_state_dict(TINY, seed=63))
    name = "model.layers.1.mlp.down_proj.weight"
    rest = [(n, t) for n, t in payload.items() if n not in (name, name + "_scale_inv")]
    marker = ("fp8rl.step_complete", torch.empty(0))
    requests = [{"tensors": [(name, payload[name])]}, {"tensors": rest + [marker]},
                {"tensors": rest + [(name + "_scale_inv", payload[name + "_scale_inv"]), marker]}]
    out = run_update_requests(str(tmp_path / "w0"), tmp_path, "unpaired", requests, *QUANT, step_each=True)
    assert out["answers"][0][0], out["answers"]
    ok, message = out["answers"][1]
    assert not ok and name in message and name + "_scale_inv" in message and "nothing was written" in message
    assert out["steps"][1]["held_halves"] == [name] and out["steps"][1]["steps_ended"] == 0
    for key, before in out["params_after"][0].items():  # the refused request wrote nothing
        assert_bytes(out["params_after"][1][key], before, key)
    assert out["answers"][2][0], out["answers"]
    assert out["steps"][2]["held_halves"] == [] and out["steps"][2]["steps_ended"] == 1
    assert out["state"]["consistent"]
    for layer in range(TINY["num_hidden_layers"]):
        check_dense_layer(out["final_params"], payload, layer, fallback_mlp=False, bf16_o=False)
