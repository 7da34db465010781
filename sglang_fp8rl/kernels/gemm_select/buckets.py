"""M buckets and the (N, K, M bucket) keys of the selection.

Buckets: 1, 2, 4, 8, then multiples of 16 up to 256, then 320, 384, 448, 512, then powers of two. SGLang's decode
CUDA graphs use bs 1, 2, 4, 8, 12, 16, 24, ..., 256, so every captured bs maps to one bucket and the 128 / 129
DeepGEMM edge is a bucket edge. A bucket is measured at its upper edge (``points="upper"``) or at both ends.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_MAX_M = 256  # the largest M bucket measured at load
POINTS = ("upper", "both")

_SMALL = (1, 2, 4, 8)
_BUCKETS = _SMALL + tuple(range(16, 257, 16)) + (320, 384, 448, 512)


def m_bucket(m: int) -> int:
    """The bucket of ``m`` tokens: the smallest bucket >= m (powers of two above 512)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    for b in _BUCKETS:
        if m <= b:
            return b
    return 1 << (m - 1).bit_length()


def buckets_upto(max_m: int) -> list[int]:
    """All buckets <= m_bucket(max_m), ascending."""
    top = m_bucket(max_m)
    out = [b for b in _BUCKETS if b <= top]
    b = 1024
    while b <= top:
        out.append(b)
        b *= 2
    return out


def bucket_points(bucket: int, points: str = "upper") -> tuple[int, ...]:
    """The M values measured for a bucket: its upper edge, or (previous bucket + 1, upper edge)."""
    if points not in POINTS:
        raise ValueError(f"points must be one of {POINTS}, got {points!r}")
    lower = max([b for b in buckets_upto(bucket) if b < bucket], default=0) + 1
    return (bucket,) if points == "upper" or lower == bucket else (lower, bucket)


def captured_in(bucket: int, capture_ms: Iterable[int]) -> set[int]:
    """The captured token counts that fall in ``bucket``: what CUDA-graph capture launches with its choice."""
    return {m for m in capture_ms if m_bucket(m) == bucket}


def shape_key(n: int, k: int, bucket: int) -> str:
    """Cache key of one (N, K, M bucket)."""
    return f"N={n},K={k},M={bucket}"


def parse_shape_key(key: str) -> tuple[int, int, int]:
    """(N, K, M bucket) of a :func:`shape_key`."""
    d = dict(part.split("=") for part in key.split(","))
    return int(d["N"]), int(d["K"]), int(d["M"])


def wanted_keys(shapes: Iterable[tuple[int, int]], max_m: int = DEFAULT_MAX_M) -> set[str]:
    """Every key of ``shapes`` x the buckets up to ``max_m``: what a model needs a choice for."""
    return {shape_key(n, k, b) for n, k in shapes for b in buckets_upto(max_m)}
