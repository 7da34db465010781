"""FlashAttention-3's own knobs on an FP8 KV cache: does any split count or GQA packing read the cache (above all a
ragged one over many sequences) nearer the copy bandwidth than FA3's heuristics, which SGLang runs?

Why (docs/RESULTS.md 41e): in the longer-tailed RL rollout the FP8 + FP8 KV decode steps run at 62-64 % of their
floor on an H100, against 83 % with FP8 weights and a BF16 cache; per call FA3 reads an FP8 cache at 49-72 % of the
copy bandwidth and a BF16 one at 83-104 % (36d), and FA3 serves every decode batch above `auto`'s limit. FA3 takes
``num_splits`` (0: its heuristic) and ``pack_gqa`` (None: its heuristic) in each call and in its scheduler metadata;
the dispatcher (sglang_fp8rl/kernels/attention_select.py) sees both keywords on every FA3 call, so a pair that wins
here could be set there.

Per cell of scripts/gpu/bench_decode_attention.py (scripts/gpu/attention_cells.py: the same cache, query, scales,
CUDA-graph timing over layer copies and copy-bandwidth measurement): FA3 on the BF16 cache, FA3's FP8 decode with its
heuristics, and with every pair of KNOBS; per pair the time, the share of the copy bandwidth and the largest error
against the float64 reference (a split count changes the order of the sums, not the arithmetic); per cell the fastest
pair and its gain over the heuristics.

  python3 scripts/gpu/fa3_knobs.py --out /tmp/fa3_knobs [--cells all|equal|ragged] [--deadline-s 300]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
import _paths  # noqa: E402,F401  (scripts/gpu and the checkout on sys.path)
import attention_cells as AC  # noqa: E402  (bench_decode_attention.py's cells, FA3's call, timing, reference, loop)

SPLITS = (0, 1, 2, 4, 8, 16, 32, 64)  # FA3's num_splits: 0 = its heuristic
PACKINGS = (None, True, False)  # FA3's pack_gqa: None = its heuristic
KNOBS = [(n, p) for n in SPLITS for p in PACKINGS if (n, p) != (0, None)]  # (0, None) is the default


def knob_label(num_splits: int, pack_gqa: bool | None) -> str:
    """'splits 8, pack_gqa True'; the heuristics' values as 'auto'."""
    return f"splits {num_splits or 'auto'}, pack_gqa {'auto' if pack_gqa is None else pack_gqa}"


def time_pair(cell, bw: float, ref: torch.Tensor, num_splits: int, pack_gqa: bool | None) -> dict:
    """One FA3 FP8 configuration on a cell: us a call, share of the copy bandwidth, error against the reference."""
    call = AC.fa3_calls(cell, True, num_splits, pack_gqa)
    us = AC.time_graph(call, cell.copies)
    nbytes = cell.read_bytes(1, 1)
    return {"num_splits": num_splits, "pack_gqa": pack_gqa, "us": us, "of_copy_bw": nbytes / us / 1e3 / bw,
            "max_abs": AC.error_vs(ref, call(0))["max_abs"]}


def run_cell(cell, bw: float, deadline: float) -> dict:
    """FA3 BF16, FA3 FP8 with its heuristics, and each pair of KNOBS while ``deadline`` allows."""
    ref = cell.reference()
    row = {"batch": cell.batch, "context": cell.context, "ragged": cell.ragged, "max_context": max(cell.lengths),
           "pairs": []}
    us = AC.time_graph(AC.fa3_calls(cell, False), cell.copies)
    row["bf16"] = {"us": us, "of_copy_bw": cell.read_bytes(2, 2) / us / 1e3 / bw}
    row["default"] = time_pair(cell, bw, ref, 0, None)
    for num_splits, pack_gqa in KNOBS:
        if time.time() > deadline:
            row["cut"] = True
            break
        try:
            row["pairs"].append(time_pair(cell, bw, ref, num_splits, pack_gqa))
        except Exception as e:  # a pair FA3 refuses for this shape: recorded, the others go on
            row["pairs"].append({"num_splits": num_splits, "pack_gqa": pack_gqa,
                                 "error_text": f"{type(e).__name__}: {e}"[:200]})
    timed = [p for p in row["pairs"] if "us" in p]
    if timed:
        row["best"] = min(timed, key=lambda p: p["us"])
    return row


def report(result: dict) -> str:
    """Markdown: per cell FA3 BF16, FA3 FP8 with its heuristics, the fastest pair of knobs and its gain."""
    lines = [f"## FA3's FP8 decode with its knobs, {result['device']}",
             f"copy bandwidth {result['copy_gbps']:,.0f} GB/s; {AC.HEADS} query heads, {AC.KV_HEADS} KV heads, head "
             f"dim {AC.DIM}, page size 1; {len(KNOBS)} pairs of num_splits x pack_gqa besides the heuristics; "
             f"{result['date']}", "",
             "| bs x context | FA3 BF16 us (% copy BW) | FA3 FP8, heuristics us (%) | fastest pair | its us (%) | "
             "heuristics / fastest | pairs timed | max abs err, heuristics / fastest |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for row in result["cells"]:
        b, d, best = row["bf16"], row["default"], row.get("best")
        timed = sum("us" in p for p in row["pairs"])
        cut = " (cut)" if row.get("cut") else ""
        if best:
            pair = knob_label(best["num_splits"], best["pack_gqa"])
            best_cells = (f"{pair} | {best['us']:.1f} ({100 * best['of_copy_bw']:.0f} %) | "
                          f"{d['us'] / best['us']:.2f}x | {timed}{cut} | {d['max_abs']:.2e} / {best['max_abs']:.2e}")
        else:
            best_cells = f"- | - | - | {timed}{cut} | {d['max_abs']:.2e} / -"
        lines.append(f"| {AC.cell_label(row)} | {b['us']:.1f} ({100 * b['of_copy_bw']:.0f} %) | "
                     f"{d['us']:.1f} ({100 * d['of_copy_bw']:.0f} %) | {best_cells} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cells", choices=("all", "equal", "ragged"), default="all",
                   help="bench_decode_attention.py's cells of equal contexts, its ragged ones, or both")
    p.add_argument("--deadline-s", type=float, default=300.0, help="stop timing pairs after this many seconds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0, dev = time.time(), torch.device("cuda")
    result = AC.new_result("fa3_knobs", dev)
    AC.run_cells(AC.cells_of(args.cells), dev, t0, args.deadline_s, result, report,
                  os.path.join(args.out, "fa3_knobs.json"),
                  lambda cell, deadline: run_cell(cell, result["copy_gbps"], deadline))
    AC.write_report(report(result), os.path.join(args.out, "fa3_knobs.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
