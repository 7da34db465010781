"""Replayed writes: an update's FP8 tensors written at the placement their dry run found, without the model's
load_weights (grouped quantizer launches on CUDA), give the same bytes as the model's own loaders.

Each case runs the same requests twice through SGLang's real WeightUpdater on CPU, once as shipped and once with
every tensor through load_weights, and compares every parameter byte for byte after every request: dense (block,
per-channel fallback, BF16 layers), MoE, pre-quantized payloads, FP32 and flattened buckets.
"""

from __future__ import annotations

import re

import pytest
from sgl_model import (
    TINY,
    TINY_FALLBACK,
    TINY_MOE,
    TINY_MOE_FALLBACK,
    assert_same_params,
    random_moe_state_dict,
    random_state_dict,
    run_update_requests,
    split_randomly,
    write_checkpoint,
    write_moe_checkpoint,
)
from test_prequantized_updates import prequantized
from test_weight_updates import bucket

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")


def both_ways(model_dir: str, work, requests: list[dict], *args: str) -> tuple[dict, dict]:
    replayed = run_update_requests(model_dir, work, "replayed", requests, *QUANT, *args)
    loaders = run_update_requests(model_dir, work, "loaders", requests, *QUANT, *args, no_replay=True)
    for out in (replayed, loaders):
        assert all(ok for ok, _ in out["answers"]), out["answers"]
        assert out["ptrs_before"] == out["ptrs_after"]
    for step, (got, want) in enumerate(zip(replayed["params_after"], loaders["params_after"])):
        assert got.keys() == want.keys(), step
        assert_same_params(got, want)  # after every request, not only at the end
    return replayed, loaders


def replayed_counts(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"replayed without load_weights: (\d+)", log)]


def dense_requests(w1: dict, prequantized_w2: dict) -> list[dict]:
    parts = split_randomly(w1, 3, seed=1)
    return [{"kind": "tensor", "tensors": parts[0]},
            {"kind": "tensor", "tensors": [(n, t.float()) for n, t in parts[1]]},  # FP32 from a trainer
            {"kind": "bucket", "bucket": bucket(parts[2])},
            {"kind": "tensor", "tensors": list(prequantized_w2.items())}]  # codes + scales, BF16 elsewhere


@pytest.mark.parametrize("dims, args", [
    (TINY, ()),
    (TINY_FALLBACK, ()),
    (TINY, ("--fp8rl-ignore", r"layers\.1\.self_attn\.o_proj")),
], ids=["block", "fallback", "bf16-layer"])
def test_dense_replayed_writes_equal_the_model_loaders(tmp_path, dims, args):
    write_checkpoint(str(tmp_path / "w0"), dims, seed=60)
    requests = dense_requests(random_state_dict(dims, seed=61), prequantized(random_state_dict(dims, seed=62)))
    replayed, loaders = both_ways(str(tmp_path / "w0"), tmp_path, requests, *args)
    linears = 7 * dims["num_hidden_layers"] - (1 if args else 0)  # the ignored o_proj is a BF16 layer
    norms = 4 * dims["num_hidden_layers"] + 1  # input / post-attention, q / k norms, final norm: copied
    counts = replayed_counts(replayed["_log"])
    assert sum(counts[:3]) == linears + norms and counts[3] == linears + norms
    assert sum(replayed_counts(loaders["_log"])) == 0


@pytest.mark.parametrize("dims", [TINY_MOE, TINY_MOE_FALLBACK], ids=["block", "fallback"])
def test_moe_replayed_writes_equal_the_model_loaders(tmp_path, dims):
    write_moe_checkpoint(str(tmp_path / "w0"), dims, seed=64)
    w1 = random_moe_state_dict(dims, seed=65)
    replayed, _ = both_ways(str(tmp_path / "w0"), tmp_path, [{"tensors": list(w1.items())}])
    experts = 3 * dims["num_experts"] * dims["num_hidden_layers"]
    norms = 4 * dims["num_hidden_layers"] + 1
    routers = dims["num_hidden_layers"]  # ReplicatedLinear's loader copies whole: one multi-tensor copy
    assert replayed_counts(replayed["_log"]) == [experts + 4 * dims["num_hidden_layers"] + norms + routers]  # + qkvo
