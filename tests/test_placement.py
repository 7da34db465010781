"""TP placement helpers, checked against SGLang 0.5.17's real linear layers and loaders for TP 1..8.

How the rank reaches SGLang's loaders: every linear class takes ``tp_rank``/``tp_size`` kwargs, stores them on the layer
(linear.py:343-347, 530-534, 974-977, 1434-1437), and its loaders read ``self.tp_rank`` (v1) or pass
``tp_rank=self.tp_rank`` to the parameter (v2, parameter.py:145-337). Nothing calls ``get_tensor_model_parallel_rank()``
or ``get_parallel()`` once tp_rank/tp_size are given, so no distributed world, ServerArgs or monkeypatching is needed:
a rank-r layer is built on one CPU process by passing ``tp_rank=r``.

Both loader generations are covered: v1 (``quant_config=None`` -> UnquantizedLinearMethod, plain Parameter with
``layer.weight_loader``) and v2 (a test linear method whose class name is added to ``WEIGHT_LOADER_V2_SUPPORTED``, as
the plugin does, so the weight is a ``ModelWeightParameter`` loaded through ``layer.weight_loader_v2``).
"""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.layers.placement import (
    ShardPlacement,
    check_full_shape,
    column_placement,
    even_shard,
    kv_head_layout,
    merged_output_partition_sizes,
    merged_placement,
    placement_for_layer,
    qkv_output_partition_sizes,
    qkv_placement,
    replicated_placement,
    row_placement,
    scale_rows,
)

TPS = range(1, 9)
HIDDEN = 256
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------------
# pure helpers: hand-written expectations


def test_even_shard():
    assert even_shard(10, 0, 1) == slice(0, 10)
    assert even_shard(840, 3, 8) == slice(315, 420)


@pytest.mark.parametrize(
    "args, match",
    [
        ((10, 0, 3), "dim=10 is not divisible by tp_size=3"),
        ((10, 2, 2), "tp_rank=2, tp_size=2"),
        ((10, -1, 2), "tp_rank=-1"),
        ((10, 0, 0), "tp_size=0"),
    ],
)
def test_even_shard_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        even_shard(*args)


def test_kv_head_layout():
    assert kv_head_layout(8, 2) == (4, 1)
    assert kv_head_layout(8, 8) == (1, 1)
    assert kv_head_layout(2, 8) == (1, 4)  # each kv head on 4 ranks
    with pytest.raises(ValueError, match="total_num_kv_heads=8 is not divisible by tp_size=3"):
        kv_head_layout(8, 3)
    with pytest.raises(ValueError, match="tp_size=6 is not divisible by total_num_kv_heads=4"):
        kv_head_layout(4, 6)


def test_partition_sizes():
    assert merged_output_partition_sizes([840, 840], 8) == [105, 105]
    with pytest.raises(ValueError, match=r"output_sizes\[1\]=100 is not divisible by tp_size=8"):
        merged_output_partition_sizes([800, 100], 8)
    kw = dict(head_size=128, total_num_heads=8, total_num_kv_heads=2)
    assert qkv_output_partition_sizes(**kw, tp_size=8) == [128, 128, 128]
    assert qkv_output_partition_sizes(**kw, tp_size=2, v_head_size=64) == [512, 128, 64]


def test_column_row_replicated():
    assert column_placement(840, 256, 3, 8) == ShardPlacement(slice(315, 420), slice(0, 256), slice(0, 105), (840, 256))
    assert row_placement(256, 840, 7, 8) == ShardPlacement(slice(0, 256), slice(735, 840), slice(0, 256), (256, 840))
    assert replicated_placement(96, 256) == ShardPlacement(slice(0, 96), slice(0, 256), slice(0, 96), (96, 256))
    assert column_placement(840, 256, 3, 8).shard_shape == (105, 256)
    assert row_placement(256, 840, 7, 8).shard_shape == (256, 105)


def test_merged():
    # up (index 1) of [840, 840] at rank 3 of 8: after the local gate's 105 rows
    assert merged_placement([840, 840], 1, 256, 3, 8) == ShardPlacement(
        slice(315, 420), slice(0, 256), slice(105, 210), (840, 256)
    )
    assert merged_placement([256, 512], 1, 64, 1, 2).dst_rows == slice(128, 384)
    with pytest.raises(ValueError, match="shard_index=2 out of range"):
        merged_placement([840, 840], 2, 256, 0, 1)


def test_qkv_replicated_kv():
    kw = dict(hidden_size=256, head_size=128, total_num_heads=8, total_num_kv_heads=2, tp_size=8)
    # rank 5: q head 5; kv head 5 // 4 = 1 (4 ranks per kv head); local rows [q 128 | k 128 | v 128]
    cols = slice(0, 256)
    assert qkv_placement("q", **kw, tp_rank=5) == ShardPlacement(slice(640, 768), cols, slice(0, 128), (1024, 256))
    assert qkv_placement("k", **kw, tp_rank=5) == ShardPlacement(slice(128, 256), cols, slice(128, 256), (256, 256))
    assert qkv_placement("v", **kw, tp_rank=5) == ShardPlacement(slice(128, 256), cols, slice(256, 384), (256, 256))
    assert qkv_placement("k", **kw, tp_rank=3).src_rows == slice(0, 128)


def test_qkv_unequal_v_head():
    kw = dict(hidden_size=256, head_size=128, total_num_heads=4, total_num_kv_heads=2, v_head_size=64, tp_size=2)
    # rank 1: q 2 heads (256) | k 1 head (128) | v 1 head (64)
    expected = ShardPlacement(slice(64, 128), slice(0, 256), slice(384, 448), (128, 256))
    assert qkv_placement("v", **kw, tp_rank=1) == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shard_id="x"), "shard_id must be one of"),
        (dict(shard_id="q", total_num_heads=6), "total_num_heads=6 is not divisible by tp_size=4"),
        (dict(shard_id="k", total_num_kv_heads=3), "tp_size=4 is not divisible by total_num_kv_heads=3"),
        (dict(shard_id="q", tp_rank=4), "tp_rank=4"),
    ],
)
def test_qkv_rejects(kwargs, match):
    kw = dict(hidden_size=256, head_size=64, total_num_heads=8, total_num_kv_heads=2, tp_rank=0, tp_size=4) | kwargs
    with pytest.raises(ValueError, match=match):
        qkv_placement(kw.pop("shard_id"), **kw)


@pytest.mark.parametrize(
    "args, match",
    [
        ((slice(0, 4), slice(0, 8), slice(0, 5), (4, 8)), "differ in length"),
        ((slice(0, 5), slice(0, 8), slice(0, 5), (4, 8)), r"src_rows=slice\(0, 5, None\) is empty or outside \[0, 4\]"),
        ((slice(0, 4), slice(0, 9), slice(0, 4), (4, 8)), "src_cols"),
        ((slice(2, 2), slice(0, 8), slice(0, 0), (4, 8)), "empty"),
        ((slice(0, 4, 2), slice(0, 8), slice(0, 4), (4, 8)), "step 1"),
        ((slice(None, 4), slice(0, 8), slice(0, 4), (4, 8)), "slice\\(int, int\\)"),
    ],
)
def test_placement_rejects_bad_slices(args, match):
    with pytest.raises(ValueError, match=match):
        ShardPlacement(*args)


def test_check_full_shape():
    p = column_placement(840, 256, 0, 8)
    check_full_shape(p, (840, 256))
    check_full_shape(p, torch.Size([840, 256]))
    with pytest.raises(ValueError, match=r"up_proj has shape \(105, 256\), expected the full \(unsharded\) shape"):
        check_full_shape(p, (105, 256), "up_proj")  # a pre-sharded tensor
    with pytest.raises(ValueError, match="expected"):
        check_full_shape(p, (256, 840))  # transposed


def test_scale_rows():
    assert scale_rows(slice(0, 128), 128, 384) == slice(0, 1)
    assert scale_rows(slice(128, 384), 128, 384) == slice(1, 3)
    assert scale_rows(slice(256, 300), 128, 300) == slice(2, 3)  # partial last block at the end of the param


@pytest.mark.parametrize(
    "rows, block_n, n_local, match",
    [
        (slice(64, 192), 128, 384, "dst_rows.start=64 is not a multiple of block_n=128"),
        (slice(0, 192), 128, 384, "dst_rows.stop=192 is neither a multiple of block_n=128 nor the end n_local=384"),
        (slice(0, 512), 128, 384, "outside"),
        (slice(0, 128), 0, 384, "block_n must be >= 1"),
    ],
)
def test_scale_rows_rejects(rows, block_n, n_local, match):
    with pytest.raises(ValueError, match=match):
        scale_rows(rows, block_n, n_local)


def test_scale_rows_on_real_shapes():
    """Every Qwen3-8B TP 8 qkv shard is block-aligned; Llama-3.2-1B's 64-row k/v shards at TP 8 are not."""
    kw = dict(hidden_size=4096, head_size=128, total_num_heads=32, total_num_kv_heads=8, tp_rank=7, tp_size=8)
    n_local = 512 + 128 + 128
    assert [scale_rows(qkv_placement(s, **kw).dst_rows, 128, n_local) for s in "qkv"] == [
        slice(0, 4),
        slice(4, 5),
        slice(5, 6),
    ]
    kw = dict(hidden_size=2048, head_size=64, total_num_heads=32, total_num_kv_heads=8, tp_rank=0, tp_size=8)
    with pytest.raises(ValueError, match="dst_rows.stop=320"):
        scale_rows(qkv_placement("k", **kw).dst_rows, 128, 256 + 64 + 64)


# ---------------------------------------------------------------------------------------------------------------------
# against SGLang's real layers


class Fp8rlTestV2LinearMethod:
    """Allocates a ModelWeightParameter, as the plugin's method does, so layers route loads to weight_loader_v2."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra):
        from sglang.srt.layers.parameter import ModelWeightParameter

        data = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        weight = ModelWeightParameter(data=data, input_dim=1, output_dim=0, weight_loader=extra["weight_loader"])
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        raise NotImplementedError("placement tests never run forward")


class _V2Config:
    def get_quant_method(self, layer, prefix=""):
        return Fp8rlTestV2LinearMethod()


@pytest.fixture(scope="module")
def sl():
    """sglang.srt.layers.linear, checked to be on its CUDA code path (SGLANG_USE_CPU_ENGINE pads and narrows
    differently)."""
    import sglang.srt.layers.linear as linear
    import sglang.srt.layers.parameter as parameter

    assert not linear._is_cpu and not parameter._is_cpu, "SGLANG_USE_CPU_ENGINE=1 selects SGLang's CPU loaders"
    return linear


@pytest.fixture(params=["v1", "v2"])
def quant_config(request, sl, monkeypatch):
    """None (v1 loaders) or a config whose linear method is registered for the v2 loaders."""
    if request.param == "v1":
        return None
    monkeypatch.setattr(sl, "WEIGHT_LOADER_V2_SUPPORTED", [*sl.WEIGHT_LOADER_V2_SUPPORTED, "Fp8rlTestV2LinearMethod"])
    return _V2Config()


def _full(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(BF16)


def load_and_check(layer, fulls: dict) -> None:
    """Load each full HF tensor through the layer's own weight_loader, then rebuild the local weight from placements."""
    from sglang.srt.layers.linear import ReplicatedLinear

    w = layer.weight
    # the v2 method really routes loads to weight_loader_v2 (ReplicatedLinear only has v1, linear.py:231-239)
    is_v2 = isinstance(layer.quant_method, Fp8rlTestV2LinearMethod) and not isinstance(layer, ReplicatedLinear)
    assert w.weight_loader.__name__ == ("weight_loader_v2" if is_v2 else "weight_loader")
    w.data.fill_(float("nan"))
    expected = torch.zeros_like(w.data)
    hits = torch.zeros(w.shape[0], dtype=torch.int32)
    for shard_id, full in fulls.items():
        # exactly what Qwen3/Llama load_weights do: stacked -> (param, w, shard_id), others -> (param, w)
        if shard_id is None:
            w.weight_loader(w, full)
        else:
            w.weight_loader(w, full, shard_id)
        p = placement_for_layer(layer, shard_id)
        check_full_shape(p, full.shape)
        expected[p.dst_rows] = full[p.src_rows, p.src_cols]
        hits[p.dst_rows] += 1
    assert torch.equal(hits, torch.ones_like(hits)), f"dst_rows do not tile the local weight once: {hits.tolist()}"
    assert not w.data.isnan().any(), "SGLang's loaders left rows unwritten"
    assert torch.equal(w.data, expected)


QKV_CASES = [
    # (total_num_heads, total_num_kv_heads, head_size, v_head_size)
    *[(8, kv, hs, None) for hs in (128, 64) for kv in (1, 2, 4, 8)],
    (12, 2, 64, None),  # TP 3 impossible, TP 6 replicates each kv head 3x
    (12, 3, 128, None),  # TP 3 one kv head per rank, TP 6 replicated 2x
    (4, 2, 128, 64),  # v_head_size != head_size
    (8, 2, 64, 128),
]


@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: "h{}kv{}hs{}v{}".format(*c))
@pytest.mark.parametrize("tp", TPS)
def test_qkv_matches_sglang(sl, quant_config, case, tp):
    heads, kv, hs, vhs = case
    kw = dict(head_size=hs, total_num_heads=heads, total_num_kv_heads=kv, tp_size=tp, v_head_size=vhs)
    if heads % tp or (kv % tp if tp < kv else tp % kv):
        with pytest.raises(AssertionError):  # SGLang's divide() asserts
            sl.QKVParallelLinear(HIDDEN, hs, heads, kv, bias=False, params_dtype=BF16, quant_config=quant_config,
                                 tp_rank=0, tp_size=tp, v_head_size=vhs)
        with pytest.raises(ValueError, match="not divisible"):
            qkv_placement("q", hidden_size=HIDDEN, tp_rank=0, **kw)
        return
    v_rows = kv * (vhs or hs)
    fulls = {"q": _full(heads * hs, HIDDEN, 1), "k": _full(kv * hs, HIDDEN, 2), "v": _full(v_rows, HIDDEN, 3)}
    for rank in range(tp):
        layer = sl.QKVParallelLinear(HIDDEN, hs, heads, kv, bias=False, params_dtype=BF16, quant_config=quant_config,
                                     tp_rank=rank, tp_size=tp, v_head_size=vhs)
        assert kv_head_layout(kv, tp) == (layer.num_kv_heads, layer.num_kv_head_replicas)
        assert qkv_output_partition_sizes(**kw) == layer.output_partition_sizes
        load_and_check(layer, fulls)
        for s in "qkv":
            assert placement_for_layer(layer, s) == qkv_placement(s, hidden_size=HIDDEN, tp_rank=rank, **kw)


@pytest.mark.parametrize("output_sizes", [[840, 840], [256, 512]], ids=["gate_up_840", "unequal_256_512"])
@pytest.mark.parametrize("tp", TPS)
def test_merged_matches_sglang(sl, quant_config, output_sizes, tp):
    if any(size % tp for size in output_sizes):
        with pytest.raises(AssertionError):
            sl.MergedColumnParallelLinear(HIDDEN, output_sizes, bias=False, params_dtype=BF16,
                                          quant_config=quant_config, tp_rank=0, tp_size=tp)
        with pytest.raises(ValueError, match="not divisible by tp_size"):
            merged_placement(output_sizes, 0, HIDDEN, 0, tp)
        return
    fulls = {i: _full(size, HIDDEN, 10 + i) for i, size in enumerate(output_sizes)}
    for rank in range(tp):
        layer = sl.MergedColumnParallelLinear(HIDDEN, output_sizes, bias=False, params_dtype=BF16,
                                              quant_config=quant_config, tp_rank=rank, tp_size=tp)
        assert merged_output_partition_sizes(output_sizes, tp) == layer.output_partition_sizes
        load_and_check(layer, fulls)


@pytest.mark.parametrize("n", [840, 96])
@pytest.mark.parametrize("tp", TPS)
def test_column_matches_sglang(sl, quant_config, n, tp):
    if n % tp:
        with pytest.raises(AssertionError):
            sl.ColumnParallelLinear(HIDDEN, n, bias=False, params_dtype=BF16, quant_config=quant_config,
                                    tp_rank=0, tp_size=tp)
        with pytest.raises(ValueError, match=f"output rows={n} is not divisible by tp_size={tp}"):
            column_placement(n, HIDDEN, 0, tp)
        return
    full = _full(n, HIDDEN, 20)
    for rank in range(tp):
        layer = sl.ColumnParallelLinear(HIDDEN, n, bias=False, params_dtype=BF16, quant_config=quant_config,
                                        tp_rank=rank, tp_size=tp)
        load_and_check(layer, {None: full})


@pytest.mark.parametrize("k", [840, 96])
@pytest.mark.parametrize("tp", TPS)
def test_row_matches_sglang(sl, quant_config, k, tp):
    if k % tp:
        with pytest.raises(AssertionError):
            sl.RowParallelLinear(k, HIDDEN, bias=False, params_dtype=BF16, quant_config=quant_config,
                                 tp_rank=0, tp_size=tp)
        with pytest.raises(ValueError, match=f"input cols={k} is not divisible by tp_size={tp}"):
            row_placement(HIDDEN, k, 0, tp)
        return
    full = _full(HIDDEN, k, 30)
    for rank in range(tp):
        layer = sl.RowParallelLinear(k, HIDDEN, bias=False, params_dtype=BF16, quant_config=quant_config,
                                     tp_rank=rank, tp_size=tp)
        load_and_check(layer, {None: full})


def test_replicated_matches_sglang(sl, quant_config):
    layer = sl.ReplicatedLinear(HIDDEN, 96, bias=False, params_dtype=BF16, quant_config=quant_config)
    load_and_check(layer, {None: _full(96, HIDDEN, 40)})


# ---------------------------------------------------------------------------------------------------------------------
# placement_for_layer refusals


def _qkv(sl, **kw):
    return sl.QKVParallelLinear(HIDDEN, 64, 4, 2, bias=False, params_dtype=BF16, quant_config=None,
                                tp_rank=0, tp_size=2, **kw)


def _merged(sl):
    return sl.MergedColumnParallelLinear(HIDDEN, [128, 128], bias=False, params_dtype=BF16, quant_config=None,
                                         tp_rank=0, tp_size=2)


def test_fused_names_rejected(sl):
    with pytest.raises(ValueError, match="fused-in-checkpoint.*q_proj/k_proj/v_proj"):
        placement_for_layer(_qkv(sl), None)
    with pytest.raises(ValueError, match="fused-in-checkpoint.*gate_proj/up_proj"):
        placement_for_layer(_merged(sl), None)


@pytest.mark.parametrize("shard_id", ["0", (0, 1), True, 2])
def test_merged_bad_shard_ids(sl, shard_id):
    with pytest.raises(ValueError, match="shard_id|shard_index"):
        placement_for_layer(_merged(sl), shard_id)


def test_qkv_bad_shard_id(sl):
    with pytest.raises(ValueError, match="shard_id must be one of"):
        placement_for_layer(_qkv(sl), 0)


def test_unfused_with_shard_id_rejected(sl):
    row = sl.RowParallelLinear(128, HIDDEN, bias=False, params_dtype=BF16, quant_config=None, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="RowParallelLinear has one unfused weight; shard_id must be None"):
        placement_for_layer(row, "q")


def test_presharded_rejected(sl):
    with pytest.raises(ValueError, match="presharded"):
        placement_for_layer(_qkv(sl, load_presharded_attn=True), "q")
    col = sl.ColumnParallelLinear(HIDDEN, 128, bias=False, params_dtype=BF16, quant_config=None, tp_rank=0, tp_size=2,
                                  use_presharded_weights=True)
    with pytest.raises(ValueError, match="use_presharded_weights"):
        placement_for_layer(col)


def test_unknown_layers_rejected(sl):
    with pytest.raises(ValueError, match="unsupported layer type Linear"):
        placement_for_layer(torch.nn.Linear(4, 4))

    class PaddedColumn(sl.ColumnParallelLinear):
        def weight_loader(self, param, loaded_weight):  # a different placement we cannot know
            raise NotImplementedError

    layer = PaddedColumn(HIDDEN, 128, bias=False, params_dtype=BF16, quant_config=None, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="PaddedColumn overrides ColumnParallelLinear.weight_loader"):
        placement_for_layer(layer)


def test_subclass_with_stock_loaders_accepted(sl):
    class Tagged(sl.MergedColumnParallelLinear):
        pass

    layer = Tagged(HIDDEN, [128, 128], bias=False, params_dtype=BF16, quant_config=None, tp_rank=1, tp_size=2)
    assert placement_for_layer(layer, 1) == merged_placement([128, 128], 1, HIDDEN, 1, 2)
