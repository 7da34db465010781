"""CPU-side pieces of scripts/gpu/check_kv.py: the function-preserving drift and the comparison."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu"))

import check_kv  # noqa: E402


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
    assert check_kv.same(a, [{"ids": [1, 2], "logprobs": [-0.5, -0.25]}])
    assert not check_kv.same(a, [{"ids": [1, 2], "logprobs": [-0.5, -0.2500001]}])
    assert not check_kv.same(a, [{"ids": [1, 3], "logprobs": [-0.5, -0.25]}])
