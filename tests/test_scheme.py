"""Block vs per-channel decisions for real model shapes; expectations are written by hand, not recomputed."""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.layers.scheme import (
    DEFAULT_BLOCK_SIZE,
    Scheme,
    SchemeDecision,
    choose_scheme,
    decision_table,
    dense_layer_local_shapes,
    format_decision_table,
)

B, C = Scheme.BLOCK, Scheme.CHANNEL
MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def dims(hidden, inter, heads, kv, hd):
    return dict(hidden_size=hidden, intermediate_size=inter, num_heads=heads, num_kv_heads=kv, head_dim=hd)


QWEN3_0_6B = dims(1024, 3072, 16, 8, 128)
QWEN3_8B = dims(4096, 12288, 32, 8, 128)
QWEN3_32B = dims(5120, 25600, 64, 8, 128)
LLAMA3_8B = dims(4096, 14336, 32, 8, 128)
QWEN25_1_5B = dims(1536, 8960, 12, 2, 128)
INTER_8960_16H = dims(2048, 8960, 16, 2, 128)  # Qwen2.5-1.5B's MLP with 16 heads, so that TP 8 exists
TINY = dims(256, 384, 2, 1, 128)
LLAMA32_1B = dims(2048, 8192, 32, 8, 64)  # head_dim 64
HD64_4KV = dims(1024, 4096, 16, 4, 64)


def schemes(model, tp):
    """{module: scheme} of one table slice."""
    return {r["module"]: r["scheme"] for r in decision_table(model, [tp])}


@pytest.mark.parametrize("bad", [(128,), (0, 128), (128, -1), (True, 128), (128.5, 128), (128, 128, 1)])
def test_one_block_size_rule(bad):
    """The scheme choice and the quantizer refuse the same block sizes, with the same message."""
    from sglang_fp8rl import quant

    w = torch.zeros(128, 128)
    with pytest.raises(ValueError, match="block_size must be two positive ints") as from_quant:
        quant.quantize_blockwise(w, bad)
    with pytest.raises(ValueError, match="block_size must be two positive ints") as from_scheme:
        choose_scheme(128, [128], block_size=bad)
    assert str(from_quant.value) == str(from_scheme.value)
    assert DEFAULT_BLOCK_SIZE == quant.DEFAULT_BLOCK_SIZE == (128, 128)


# ---------------------------------------------------------------------------------------------------------------------
# choose_scheme


def test_choose_block():
    assert choose_scheme(4096, [512, 128, 128]) == SchemeDecision(Scheme.BLOCK, "")


def test_choose_k_not_aligned():
    assert choose_scheme(1120, [4096], shard_names=["down"]) == SchemeDecision(
        Scheme.CHANNEL, "K_local=1120 not a multiple of 128"
    )


def test_choose_shard_not_aligned_names_every_shard():
    d = choose_scheme(2048, [1120, 1120], shard_names=["gate", "up"])
    assert d.scheme is Scheme.CHANNEL
    assert d.reason == "output shard 'gate'=1120 not a multiple of 128; output shard 'up'=1120 not a multiple of 128"


def test_choose_sum_aligned_but_shard_not():
    # q=192 + k=64 = 256 rows total would fill two blocks, but the k/v blocks would straddle shards
    d = choose_scheme(256, [192, 64], shard_names=["q", "k"])
    assert d.scheme is Scheme.CHANNEL and "'q'=192" in d.reason and "'k'=64" in d.reason


def test_choose_unnamed_shards_and_other_block():
    assert choose_scheme(256, [64, 128]).reason == "output shard 0=64 not a multiple of 128"
    assert choose_scheme(256, [64, 128], block_size=(64, 64)).scheme is Scheme.BLOCK
    assert choose_scheme(96, [128], block_size=(128, 64)).reason == "K_local=96 not a multiple of 64"


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(k_local=0, output_partition_sizes=[128]), "k_local"),
        (dict(k_local=128, output_partition_sizes=[]), "output shards"),
        (dict(k_local=128, output_partition_sizes=[128, 0]), "output shards"),
        (dict(k_local=128, output_partition_sizes=[128], block_size=(128,)), "block_size"),
        (dict(k_local=128, output_partition_sizes=[128], block_size=(0, 128)), "block_size"),
        (dict(k_local=128, output_partition_sizes=[128, 128], shard_names=["gate"]), "shard_names"),
    ],
)
def test_choose_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        choose_scheme(**args)


# ---------------------------------------------------------------------------------------------------------------------
# local shapes


def test_local_shapes_qwen3_8b_tp8():
    assert dense_layer_local_shapes(**QWEN3_8B, tp_size=8) == {
        "qkv_proj": (4096, [512, 128, 128]),  # 8 kv heads / 8 ranks: one each
        "o_proj": (512, [4096]),
        "gate_up_proj": (4096, [1536, 1536]),
        "down_proj": (1536, [4096]),
    }


def test_local_shapes_kv_replicated():
    # 1 kv head at TP 2: every rank keeps the whole (replicated) head
    assert dense_layer_local_shapes(**TINY, tp_size=2)["qkv_proj"] == (256, [128, 128, 128])
    # 2 kv heads at TP 4: one head per rank, shared by 2 ranks
    assert dense_layer_local_shapes(**QWEN25_1_5B, tp_size=4)["qkv_proj"] == (1536, [384, 128, 128])


def test_local_shapes_impossible_tp():
    with pytest.raises(ValueError, match="total_num_heads=12 is not divisible by tp_size=8"):
        dense_layer_local_shapes(**QWEN25_1_5B, tp_size=8)
    with pytest.raises(ValueError, match="tp_size=8 is not divisible by total_num_kv_heads=3"):
        dense_layer_local_shapes(**dims(1024, 4096, 24, 3, 128), tp_size=8)  # heads 24/8 ok, kv 3 vs 8 not


# ---------------------------------------------------------------------------------------------------------------------
# decision tables of real models (hand-written expectations)

ALL_BLOCK = {m: B for m in MODULES}


@pytest.mark.parametrize(
    "model", [QWEN3_0_6B, QWEN3_8B, QWEN3_32B, LLAMA3_8B], ids=["qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama3-8b"]
)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_mainstream_models_all_block(model, tp):
    assert schemes(model, tp) == ALL_BLOCK


@pytest.mark.parametrize(
    "model, tp, expected",
    [
        # Qwen2.5-1.5B: 8960/4 = 2240 = 17.5 blocks -> MLP falls back at TP 4; 12 heads forbid TP 8 altogether
        (QWEN25_1_5B, 1, ALL_BLOCK),
        (QWEN25_1_5B, 2, ALL_BLOCK),
        (QWEN25_1_5B, 4, {"qkv_proj": B, "o_proj": B, "gate_up_proj": C, "down_proj": C}),
        # its MLP at TP 8: 8960/8 = 1120
        (INTER_8960_16H, 8, {"qkv_proj": B, "o_proj": B, "gate_up_proj": C, "down_proj": C}),
        (INTER_8960_16H, 2, ALL_BLOCK),
        # tiny: 384 = 3 blocks at TP 1, 192 at TP 2
        (TINY, 1, ALL_BLOCK),
        (TINY, 2, {"qkv_proj": B, "o_proj": B, "gate_up_proj": C, "down_proj": C}),
        # head_dim 64: q = 64*heads/tp, k = v = 64*kv_heads/tp (one 64-row head once kv <= tp)
        (LLAMA32_1B, 4, ALL_BLOCK),
        (LLAMA32_1B, 8, {"qkv_proj": C, "o_proj": B, "gate_up_proj": B, "down_proj": B}),
        (HD64_4KV, 1, ALL_BLOCK),  # q=1024, k=v=256
        (HD64_4KV, 2, ALL_BLOCK),  # q=512, k=v=128
        (HD64_4KV, 4, {"qkv_proj": C, "o_proj": B, "gate_up_proj": B, "down_proj": B}),  # k=v=64
        (HD64_4KV, 8, {"qkv_proj": C, "o_proj": B, "gate_up_proj": B, "down_proj": B}),  # q=128, k=v=64 replicated
    ],
    ids=lambda v: v if isinstance(v, int) else None,
)
def test_fallback_models(model, tp, expected):
    assert schemes(model, tp) == expected


def test_fallback_reasons():
    rows = {r["module"]: r for r in decision_table(INTER_8960_16H, [8])}
    assert rows["gate_up_proj"]["reason"] == (
        "output shard 'gate'=1120 not a multiple of 128; output shard 'up'=1120 not a multiple of 128"
    )
    assert rows["down_proj"]["reason"] == "K_local=1120 not a multiple of 128"
    assert rows["down_proj"]["shards"] == {"down": 2048}
    assert rows["qkv_proj"]["reason"] == ""
    qkv = {r["module"]: r for r in decision_table(LLAMA32_1B, [8])}["qkv_proj"]
    assert qkv["shards"] == {"q": 256, "k": 64, "v": 64}
    assert qkv["reason"] == "output shard 'k'=64 not a multiple of 128; output shard 'v'=64 not a multiple of 128"


def test_table_rows_and_markdown():
    rows = decision_table(TINY, [1, 2])
    assert [(r["tp"], r["module"]) for r in rows] == [(tp, m) for tp in (1, 2) for m in MODULES]
    assert set(rows[0]) == {"tp", "module", "k_local", "shards", "scheme", "reason"}
    md = format_decision_table(rows)
    lines = md.splitlines()
    assert lines[0] == "| tp | module | K_local | shards | scheme | reason |"
    assert len(lines) == 2 + len(rows)
    assert "| 2 | down_proj | 192 | down=256 | channel | K_local=192 not a multiple of 128 |" in lines
    print("\n" + md)


def test_main_prints_known_models(capsys):
    from sglang_fp8rl.layers import scheme

    scheme.main()
    out = capsys.readouterr().out
    assert "### Qwen3-8B" in out and "TP 8 impossible: total_num_heads=12 is not divisible by tp_size=8" in out
