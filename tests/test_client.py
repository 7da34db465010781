"""The trainer-side client (`sglang_fp8rl.weight_sync.client`) against SGLang's real update path on CPU."""

from __future__ import annotations

import pytest
import torch
from sgl_model import TINY, assert_same_params, random_state_dict, run_worker, write_checkpoint

from sglang_fp8rl.weight_sync.client import WeightPushError, buckets, named_items, serialize_for_ranks

QUANT = ("--quantization", "fp8_online_blockwise")


def test_buckets_respect_the_byte_budget_and_order():
    """Consecutive buckets of at most bucket_bytes; a larger tensor travels alone; nothing lost or reordered."""
    sd = {f"t{i}": torch.zeros(n, dtype=torch.bfloat16) for i, n in enumerate([10, 20, 300, 5, 5, 40])}
    groups = list(buckets(sd, bucket_bytes=64))
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert all(sum(t.numel() * 2 for _, t in g) <= 64 or len(g) == 1 for g in groups)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        list(buckets(sd, 0))


def test_named_items_accepts_named_parameters_and_detaches():
    """named_parameters() works as well as a state_dict, and nothing keeps autograd history."""
    lin = torch.nn.Linear(4, 3)
    items = list(named_items(lin.named_parameters()))
    assert [n for n, _ in items] == ["weight", "bias"] and not any(t.requires_grad for _, t in items)


def test_payload_is_sglangs_per_rank_format():
    """One payload per TP rank that SGLang's own (safe) deserializer reads back exactly."""
    from sglang.srt.utils import MultiprocessingSerializer

    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7, dtype=torch.float64).to(torch.bfloat16))]
    payloads = serialize_for_ranks(named, tp_size=2)
    assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
    back = MultiprocessingSerializer.deserialize(payloads[1])
    assert [n for n, _ in back] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(back, named))


@pytest.mark.slow
def test_push_state_dict_to_an_engine(tmp_path):
    """Bucketed push of a full state dict equals a cold load; a NaN push raises WeightPushError naming the tensor
    and leaves every parameter as it was; push_from_disk works; no pointer moves."""
    write_checkpoint(str(tmp_path / "w0"), TINY, seed=30)
    w1 = random_state_dict(TINY, seed=31)
    write_checkpoint(str(tmp_path / "w1"), TINY, seed=31, state_dict=w1)
    torch.save(w1, tmp_path / "w1.pt")
    cold = run_worker("load", str(tmp_path / "w1"), str(tmp_path / "cold.pt"), *QUANT)
    out = run_worker("client", str(tmp_path / "w0"), str(tmp_path / "client.pt"), *QUANT,
                     extra={"state_dict": str(tmp_path / "w1.pt"), "bucket_bytes": 256 << 10,
                            "disk": str(tmp_path / "w1")})
    assert len(out["answers"]) > 3  # really bucketed
    assert_same_params(out["after_push"], cold["params"])
    assert out["bad_error"] is not None and "contains NaN/Inf" in out["bad_error"]
    assert "update_weights_from_tensor" in out["bad_error"]
    assert_same_params(out["after_bad"], cold["params"])
    assert out["disk_answer"][0]
    assert_same_params(out["final_params"], cold["params"])
    assert out["ptrs_before"] == out["ptrs_after"]
    assert issubclass(WeightPushError, RuntimeError)
