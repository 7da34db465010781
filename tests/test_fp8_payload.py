"""Pre-quantized payloads: how a weight's codes and its block scale are paired and checked (pure, no SGLang model)."""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.weight_sync.fp8_payload import SCALE_ATTR, attach_scales, pair_stream
from sglang_fp8rl.weight_sync.validate import UpdateRejected


def codes(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k).clamp(-400, 400).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("pairing", [attach_scales, lambda named: list(pair_stream(named))])
def test_a_one_dimensional_scale_of_a_single_column_block_is_that_column(pairing):
    """verl's Triton quantizer gives a weight with K <= 128 a 1-D scale [ceil(N/128)]: taken as [ceil(N/128), 1]."""
    w, scale = codes(256, 64), torch.tensor([0.5, 0.25])
    ((name, attached),) = pairing([("a.weight", w), ("a.weight_scale_inv", scale)])
    assert name == "a.weight" and tuple(getattr(attached, SCALE_ATTR).shape) == (2, 1)
    assert torch.equal(getattr(attached, SCALE_ATTR)[:, 0], scale)


@pytest.mark.parametrize("k,scale_shape", [(256, (2,)), (64, (3,)), (64, (1, 2))])
def test_an_ambiguous_or_wrong_scale_is_still_refused(k, scale_shape):
    """1-D with two column blocks (which dimension?), the wrong length, or a transposed shape: refused, named."""
    with pytest.raises(UpdateRejected, match="a.weight_scale_inv: expected float32 of shape"):
        attach_scales([("a.weight", codes(256, k)), ("a.weight_scale_inv", torch.ones(scale_shape))])
