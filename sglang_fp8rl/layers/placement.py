"""Where each TP rank puts an incoming full (unsharded, HF-named) weight: SGLang 0.5.17's placement, as plain ints.

An update tensor such as ``q_proj`` or ``up_proj`` arrives whole on every rank. SGLang's own loaders narrow it and
copy the slice into the rank's fused local parameter. The quantizer must do the same narrowing, but straight from the
incoming tensor into FP8 rows, so the rules are reproduced here as pure functions. Each is checked in
``tests/test_placement.py`` against SGLang's real loaders for TP 1..8. Line references are to
``sglang/srt/layers/linear.py`` (``linear.py``) and ``sglang/srt/layers/parameter.py`` (``parameter.py``) of the
0.5.17 wheel.

A :class:`ShardPlacement` says: rows ``src_rows`` and columns ``src_cols`` of the incoming tensor (which must have
shape ``full_shape``) go to rows ``dst_rows`` of the local ``[N_local, K_local]`` parameter, across all its columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from sglang_fp8rl.compat.runtime import linear_tp

QKV_SHARD_IDS = ("q", "k", "v")
# SGLang's loaded_shard_id: "q"/"k"/"v" (QKV), an int index (merged gate/up), None (unfused)
ShardId = Optional[Union[str, int]]


# ---------------------------------------------------------------------------------------------------------------------
# primitives


def _len(s: slice) -> int:
    return s.stop - s.start


def _check_range(s: slice, bound: int | None, what: str) -> None:
    """A placement slice is explicit ints, step 1, non-empty and (when ``bound`` is given) inside ``[0, bound]``."""
    if not (isinstance(s.start, int) and isinstance(s.stop, int)) or s.step not in (None, 1):
        raise ValueError(f"{what} must be slice(int, int) with step 1, got {s}")
    if not 0 <= s.start < s.stop or (bound is not None and s.stop > bound):
        where = "negative" if bound is None else f"outside [0, {bound}]"
        raise ValueError(f"{what}={s} is empty or {where}")


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")


def exact_divide(numerator: int, denominator: int, what: str, by: str = "tp_size") -> int:
    """Exact division, as SGLang's ``divide`` (which asserts); ValueError naming both numbers."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by {by}={denominator}")
    return numerator // denominator


def even_shard(full: int, tp_rank: int, tp_size: int, what: str = "dim") -> slice:
    """Rank ``tp_rank``'s contiguous 1/tp_size of ``range(full)``; ValueError if it does not divide evenly."""
    _check_tp(tp_rank, tp_size)
    size = exact_divide(full, tp_size, what)
    return slice(tp_rank * size, (tp_rank + 1) * size)


def kv_head_layout(total_num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(KV heads per rank, ranks sharing each KV head), as QKVParallelLinear (linear.py:979-984)."""
    if tp_size >= total_num_kv_heads:
        # fewer KV heads than ranks: each rank holds one whole head, replicated on tp_size/total ranks
        return 1, exact_divide(tp_size, total_num_kv_heads, "tp_size", "total_num_kv_heads")
    return exact_divide(total_num_kv_heads, tp_size, "total_num_kv_heads"), 1


def merged_output_partition_sizes(output_sizes: Sequence[int], tp_size: int) -> list[int]:
    """Local rows of each logical output of a column-parallel layer (linear.py:349-354)."""
    return [exact_divide(size, tp_size, f"output_sizes[{i}]") for i, size in enumerate(output_sizes)]


def qkv_output_partition_sizes(
    *, head_size: int, total_num_heads: int, total_num_kv_heads: int, tp_size: int, v_head_size: int | None = None
) -> list[int]:
    """Local [q, k, v] rows on every rank of a QKVParallelLinear (linear.py:978-987)."""
    v_head_size = head_size if v_head_size is None else v_head_size
    num_heads = exact_divide(total_num_heads, tp_size, "total_num_heads")
    num_kv_heads, _ = kv_head_layout(total_num_kv_heads, tp_size)
    return [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * v_head_size]


# ---------------------------------------------------------------------------------------------------------------------
# placement record


@dataclass(frozen=True)
class ShardPlacement:
    """One incoming tensor's slice on one TP rank, and the local rows it fills."""

    src_rows: slice  # rows of the incoming full tensor this rank keeps
    src_cols: slice  # cols of the incoming full tensor this rank keeps
    dst_rows: slice  # rows of the local [N_local, K_local] parameter they are written to (all K_local cols)
    full_shape: tuple[int, int]  # the shape the incoming tensor must have

    def __post_init__(self) -> None:
        n_full, k_full = self.full_shape
        for what, s, bound in (("src_rows", self.src_rows, n_full), ("src_cols", self.src_cols, k_full)):
            _check_range(s, bound, what)
        _check_range(self.dst_rows, None, "dst_rows")
        if _len(self.src_rows) != _len(self.dst_rows):
            raise ValueError(f"src_rows {self.src_rows} and dst_rows {self.dst_rows} differ in length")

    @property
    def shard_shape(self) -> tuple[int, int]:
        """Shape of the slice this rank writes: (rows, K_local)."""
        return _len(self.dst_rows), _len(self.src_cols)


# ---------------------------------------------------------------------------------------------------------------------
# placements, one per SGLang linear class


def column_placement(full_rows: int, k: int, tp_rank: int, tp_size: int) -> ShardPlacement:
    """ColumnParallelLinear: rank r keeps output rows [r*N_local, (r+1)*N_local).

    linear.py:408-430 (v1), 442-467 -> parameter.py:145-175 (v2).
    """
    src_rows = even_shard(full_rows, tp_rank, tp_size, "output rows")
    return ShardPlacement(src_rows, slice(0, k), slice(0, _len(src_rows)), (full_rows, k))


def row_placement(n: int, full_cols: int, tp_rank: int, tp_size: int) -> ShardPlacement:
    """RowParallelLinear: rank r keeps input cols [r*K_local, (r+1)*K_local), all rows.

    linear.py:1488-1521 (v1), 1533-1559 -> parameter.py:293-337 (v2).
    """
    src_cols = even_shard(full_cols, tp_rank, tp_size, "input cols")
    return ShardPlacement(slice(0, n), src_cols, slice(0, n), (n, full_cols))


def replicated_placement(n: int, k: int) -> ShardPlacement:
    """ReplicatedLinear: the whole tensor on every rank (linear.py:255-277)."""
    return ShardPlacement(slice(0, n), slice(0, k), slice(0, n), (n, k))


def merged_placement(
    output_sizes: Sequence[int], shard_index: int, k: int, tp_rank: int, tp_size: int
) -> ShardPlacement:
    """MergedColumnParallelLinear logical output ``shard_index`` (gate=0, up=1): its own 1/tp, after earlier shards.

    SGLang: local offset ``sum(output_sizes[:i]) // tp``, size ``output_sizes[i] // tp``, source start
    ``tp_rank * size`` (v1 linear.py:654-716, v2 linear.py:906-918 -> parameter.py:177-224).
    """
    if not 0 <= shard_index < len(output_sizes):
        raise ValueError(f"shard_index={shard_index} out of range for {len(output_sizes)} output_sizes")
    local = merged_output_partition_sizes(output_sizes, tp_size)
    src_rows = even_shard(output_sizes[shard_index], tp_rank, tp_size, f"output_sizes[{shard_index}]")
    offset = sum(local[:shard_index])
    return ShardPlacement(
        src_rows, slice(0, k), slice(offset, offset + local[shard_index]), (output_sizes[shard_index], k)
    )


def qkv_placement(
    shard_id: str,
    *,
    hidden_size: int,
    head_size: int,
    total_num_heads: int,
    total_num_kv_heads: int,
    tp_rank: int,
    tp_size: int,
    v_head_size: int | None = None,
) -> ShardPlacement:
    """QKVParallelLinear shard "q", "k" or "v": local rows [q | k | v]; with KV replication, k/v come from head
    ``tp_rank // replicas`` (v1 linear.py:1280-1355, v2 linear.py:1140-1161 -> parameter.py:226-275)."""
    if shard_id not in QKV_SHARD_IDS:
        raise ValueError(f"QKV shard_id must be one of {QKV_SHARD_IDS}, got {shard_id!r}")
    _check_tp(tp_rank, tp_size)
    v_head_size = head_size if v_head_size is None else v_head_size
    sizes = qkv_output_partition_sizes(
        head_size=head_size,
        total_num_heads=total_num_heads,
        total_num_kv_heads=total_num_kv_heads,
        tp_size=tp_size,
        v_head_size=v_head_size,
    )
    _, replicas = kv_head_layout(total_num_kv_heads, tp_size)
    index = QKV_SHARD_IDS.index(shard_id)
    # q is split across all ranks; k/v blocks are indexed by KV-head group, shared by `replicas` neighbouring ranks
    source_block = tp_rank if shard_id == "q" else tp_rank // replicas
    full_rows = (total_num_heads * head_size, total_num_kv_heads * head_size, total_num_kv_heads * v_head_size)[index]
    size, offset = sizes[index], sum(sizes[:index])
    src_rows = slice(source_block * size, (source_block + 1) * size)
    return ShardPlacement(src_rows, slice(0, hidden_size), slice(offset, offset + size), (full_rows, hidden_size))


# ---------------------------------------------------------------------------------------------------------------------
# dispatch on SGLang's layer classes


def _require_stock_loaders(layer: Any, base: type) -> None:
    """A subclass that overrides SGLang's loaders may place rows differently; refuse instead of guessing."""
    for name in ("weight_loader", "weight_loader_v2"):
        if getattr(type(layer), name, None) is not getattr(base, name, None):
            raise ValueError(
                f"{type(layer).__name__} overrides {base.__name__}.{name}; its placement is not known to sglang_fp8rl"
            )


def _require_unfused(layer: Any, shard_id: object) -> None:
    if shard_id is not None:
        raise ValueError(f"{type(layer).__name__} has one unfused weight; shard_id must be None, got {shard_id!r}")


def _refuse_fused(layer: Any, names: str) -> None:
    raise ValueError(
        f"{type(layer).__name__}: a fused-in-checkpoint tensor (shard_id None) is not accepted; "
        f"send the HF-unfused {names} tensors instead"
    )


def _check_fits(layer: Any, p: ShardPlacement, n_local: int, k_local: int) -> None:
    """Cross-check against the sizes the layer itself computed (guards subclasses that pad or resize)."""
    if p.dst_rows.stop > n_local or _len(p.src_cols) != k_local:
        raise ValueError(
            f"{type(layer).__name__}: placement {p} does not fit the local weight [{n_local}, {k_local}]"
        )


def placement_for_layer(layer: Any, shard_id: ShardId = None) -> ShardPlacement:
    """Placement of an incoming full tensor for one of SGLang's linear layers, read from the layer's own attributes."""
    from sglang.srt.layers import linear as sl  # lazy: the rest of this module needs no SGLang (or torch)

    if getattr(layer, "use_presharded_weights", False):
        raise ValueError(f"{type(layer).__name__}: presharded weights (use_presharded_weights=True) are not supported")
    tp_rank, tp_size = linear_tp(layer)
    # subclasses first: QKV and Merged are ColumnParallelLinear subclasses with different placement
    if isinstance(layer, sl.QKVParallelLinear):
        _require_stock_loaders(layer, sl.QKVParallelLinear)
        if shard_id is None:
            _refuse_fused(layer, "q_proj/k_proj/v_proj")
        p = qkv_placement(
            shard_id,
            hidden_size=layer.hidden_size,
            head_size=layer.head_size,
            total_num_heads=layer.total_num_heads,
            total_num_kv_heads=layer.total_num_kv_heads,
            tp_rank=tp_rank,
            tp_size=tp_size,
            v_head_size=layer.v_head_size,
        )
        _check_fits(layer, p, sum(layer.output_partition_sizes), layer.input_size)
        return p
    if isinstance(layer, sl.MergedColumnParallelLinear):
        _require_stock_loaders(layer, sl.MergedColumnParallelLinear)
        if shard_id is None:
            _refuse_fused(layer, "gate_proj/up_proj")
        if isinstance(shard_id, bool) or not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear shard_id must be an int index, got {shard_id!r}")
        p = merged_placement(layer.output_sizes, shard_id, layer.input_size, tp_rank, tp_size)
        _check_fits(layer, p, sum(layer.output_partition_sizes), layer.input_size)
        return p
    if isinstance(layer, sl.ColumnParallelLinear):
        _require_stock_loaders(layer, sl.ColumnParallelLinear)
        _require_unfused(layer, shard_id)
        p = column_placement(layer.output_size, layer.input_size, tp_rank, tp_size)
        _check_fits(layer, p, layer.output_size_per_partition, layer.input_size)
        return p
    if isinstance(layer, sl.RowParallelLinear):
        _require_stock_loaders(layer, sl.RowParallelLinear)
        _require_unfused(layer, shard_id)
        p = row_placement(layer.output_size, layer.input_size, tp_rank, tp_size)
        _check_fits(layer, p, layer.output_size, layer.input_size_per_partition)
        return p
    if isinstance(layer, sl.ReplicatedLinear):
        _require_stock_loaders(layer, sl.ReplicatedLinear)
        _require_unfused(layer, shard_id)
        return replicated_placement(layer.output_size, layer.input_size)
    raise ValueError(f"unsupported layer type {type(layer).__name__}: no known TP placement")


# ---------------------------------------------------------------------------------------------------------------------
# checks the writer runs before quantizing


def check_full_shape(p: ShardPlacement, shape: Sequence[int], what: str = "weight") -> None:
    """ValueError unless the incoming tensor has exactly ``p.full_shape`` (SGLang would silently take a wrong slice)."""
    if tuple(shape) != p.full_shape:
        raise ValueError(f"{what} has shape {tuple(shape)}, expected the full (unsharded) shape {p.full_shape}")


def scale_rows(dst_rows: slice, block_n: int, n_local: int) -> slice:
    """Rows of the [ceil(N_local/block_n), .] block scale that ``dst_rows`` covers exactly.

    The start must be block-aligned, and so must the stop unless it is the end of the parameter (a partial last
    block belongs to this shard alone). Otherwise a block would straddle two shards, whose scales are computed apart.
    """
    if block_n < 1:
        raise ValueError(f"block_n must be >= 1, got {block_n}")
    _check_range(dst_rows, n_local, "dst_rows")
    if dst_rows.start % block_n:
        raise ValueError(f"dst_rows.start={dst_rows.start} is not a multiple of block_n={block_n}")
    if dst_rows.stop % block_n and dst_rows.stop != n_local:
        raise ValueError(
            f"dst_rows.stop={dst_rows.stop} is neither a multiple of block_n={block_n} nor the end n_local={n_local}"
        )
    return slice(dst_rows.start // block_n, -(-dst_rows.stop // block_n))
