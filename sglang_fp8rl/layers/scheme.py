"""Per-layer choice of FP8 weight scheme: 128x128 blockwise where every shard is block-aligned, per-channel otherwise.

A 128-row block must never straddle two logical output shards (q|k|v, gate|up): they arrive as separate tensors and
are quantized apart. A block must never straddle the TP cut of K either. So a layer is blockwise only if ``K_local``
and every logical output shard on this rank are multiples of the block. This is the same rule SGLang applies to
serialized block-FP8 checkpoints (``validate_block_quant_shapes``, fp8.py:478-516), except that we fall back to
per-channel instead of raising.

``choose_scheme`` never returns ``BF16``: that is the decision for layers the config leaves unquantized (lm_head,
embeddings, ignored layers). Run ``python -m sglang_fp8rl.layers.scheme`` for the table of some known models.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sglang_fp8rl.layers.placement import (
    exact_divide,
    merged_output_partition_sizes,
    qkv_output_partition_sizes,
)
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE, check_block_size

# logical output shards of each module of a dense decoder layer, in local row order
SHARD_NAMES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q", "k", "v"),
    "o_proj": ("o",),
    "gate_up_proj": ("gate", "up"),
    "down_proj": ("down",),
}


class Scheme(str, enum.Enum):
    """How a linear layer's weight is stored and multiplied."""

    BLOCK = "block"  # FP8 e4m3, one fp32 scale per 128x128 block
    CHANNEL = "channel"  # FP8 e4m3, one fp32 scale per output row
    BF16 = "bf16"  # left unquantized


@dataclass(frozen=True)
class SchemeDecision:
    """The scheme and, for a fallback, why blockwise was not possible ('' for block)."""

    scheme: Scheme
    reason: str


def choose_scheme(
    k_local: int,
    output_partition_sizes: Sequence[int],
    block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
    shard_names: Sequence[str] | None = None,
) -> SchemeDecision:
    """BLOCK if K_local and every local logical output shard are multiples of the block, else CHANNEL with reasons."""
    block_n, block_k = check_block_size(block_size)
    if k_local < 1 or not output_partition_sizes or min(output_partition_sizes) < 1:
        raise ValueError(f"need k_local >= 1 and positive output shards, got {k_local}, {list(output_partition_sizes)}")
    if shard_names is not None and len(shard_names) != len(output_partition_sizes):
        raise ValueError(f"shard_names {list(shard_names)} do not match {list(output_partition_sizes)} output shards")
    if shard_names is None:
        names = [str(i) for i in range(len(output_partition_sizes))]
    else:
        names = [repr(n) for n in shard_names]
    reasons = [f"K_local={k_local} not a multiple of {block_k}"] if k_local % block_k else []
    reasons += [
        f"output shard {name}={size} not a multiple of {block_n}"
        for name, size in zip(names, output_partition_sizes)
        if size % block_n
    ]
    return SchemeDecision(Scheme.CHANNEL, "; ".join(reasons)) if reasons else SchemeDecision(Scheme.BLOCK, "")


def dense_layer_local_shapes(
    *, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int
) -> dict[str, tuple[int, list[int]]]:
    """{module: (K_local, local output shard sizes)} for one rank of a Llama/Qwen-style dense decoder layer."""
    qkv = qkv_output_partition_sizes(
        head_size=head_dim, total_num_heads=num_heads, total_num_kv_heads=num_kv_heads, tp_size=tp_size
    )
    return {
        "qkv_proj": (hidden_size, qkv),  # QKVParallelLinear: K whole, heads split
        "o_proj": (exact_divide(num_heads * head_dim, tp_size, "o_proj input num_heads*head_dim"), [hidden_size]),
        "gate_up_proj": (hidden_size, merged_output_partition_sizes([intermediate_size] * 2, tp_size)),
        "down_proj": (exact_divide(intermediate_size, tp_size, "down_proj input intermediate_size"), [hidden_size]),
    }


def decision_table(model_dims: dict, tp_sizes: Iterable[int] = (1, 2, 4, 8)) -> list[dict]:
    """Rows {tp, module, k_local, shards, scheme, reason}; ``model_dims`` are dense_layer_local_shapes' kwargs."""
    rows = []
    for tp in tp_sizes:
        for module, (k_local, sizes) in dense_layer_local_shapes(**model_dims, tp_size=tp).items():
            names = SHARD_NAMES[module]
            decision = choose_scheme(k_local, sizes, shard_names=names)
            shards = dict(zip(names, sizes))
            row = dict(tp=tp, module=module, k_local=k_local, shards=shards)
            rows.append(row | dict(scheme=decision.scheme, reason=decision.reason))
    return rows


def format_decision_table(rows: Sequence[dict]) -> str:
    """Markdown table of decision_table rows."""
    lines = ["| tp | module | K_local | shards | scheme | reason |", "|---:|---|---:|---|---|---|"]
    for r in rows:
        shards = ", ".join(f"{name}={size}" for name, size in r["shards"].items())
        scheme = Scheme(r["scheme"]).value
        lines.append(f"| {r['tp']} | {r['module']} | {r['k_local']} | {shards} | {scheme} | {r['reason']} |")
    return "\n".join(lines)


# (hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim) from each model's HF config.json
KNOWN_MODELS: dict[str, dict[str, int]] = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128),
    "Qwen3-32B": dict(hidden_size=5120, intermediate_size=25600, num_heads=64, num_kv_heads=8, head_dim=128),
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128),
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64),
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_heads=12, num_kv_heads=2, head_dim=128),
}


def main() -> None:
    """Print the decision table of every KNOWN_MODELS entry for TP 1, 2, 4, 8."""
    for name, dims in KNOWN_MODELS.items():
        print(f"### {name} ({', '.join(f'{k}={v}' for k, v in dims.items())})\n")
        rows, impossible = [], []
        for tp in (1, 2, 4, 8):
            try:
                rows += decision_table(dims, [tp])
            except ValueError as e:  # SGLang itself cannot shard this model at this TP
                impossible.append(f"TP {tp} impossible: {e}")
        print("\n".join([format_decision_table(rows), *impossible]) + "\n")


if __name__ == "__main__":
    main()
