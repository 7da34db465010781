"""Decode attention over an FP8 KV cache: this package's split-KV kernel against FlashAttention-3, per cell.

One query token per sequence, Qwen3-8B's attention (32 query heads, 8 KV heads, head dim 128), SGLang's paged cache
with page size 1 (each sequence's slots contiguous, the sequences in shuffled order), KV scales as SGLang passes them
to FA3 (a [1] tensor expanded to [batch, kv_heads]). Per cell (running batch x context):

  fa3_bf16    FA3 on a BF16 cache (SGLang's BF16 decode), with SGLang's precomputed scheduler metadata
  fa3_fp8     FA3 on the FP8 cache, the query cast to E4M3 (SGLang's FP8-KV decode today)
  split_kv    sglang_fp8rl.kernels.fp8_decode_attention with its defaults, and each variant of the sweep
              (BLOCK_N x warps x stages x work budget: the programs per KV head sharing the step's tiles)
  fi_fp8      with --flashinfer: FlashInfer's batch decode on the FP8 cache as SGLang's flashinfer backend calls it
              (tensor cores, a BF16 query, k_scale / v_scale as floats, a CUDA-graph wrapper planned once per cell);
              its first use JIT-compiles the module (the seconds it took are recorded)
  split_kv_vtile  with --v-widen-tile: the split-KV kernel's default with V widened on its tile (V_WIDEN_TILE),
              and whether its output has the default's bits
  split_kv_plain / split_kv_pdl  with --pdl: the default with its three launches in the other form, plain where
              the default is programmatic dependent launches (fp8_decode_attention.PDL, on), else dependent (the
              graph's copies run back to back, so each call's launch overlaps the one before), and its bits
  split_kv_single / split_kv_planned  with --single-plan, at one sequence: the plan form the default does not use
              (fp8_decode_attention.SINGLE_PLAN): planned in closed form inside its two kernels, without the plan
              launch, or by the plan launch; and its bits
  split_kv_step  with --step-plan: the default with one plan for all the graph's calls (the layers of a step), as the
              dispatcher keeps it (kernels/step_plan.py): written by the first call, read by the others
  split_kv_fused / split_kv_fused_step  with --fused-merge: the default with the last split of each sequence merging
              (fp8_decode_attention.FUSED_MERGE, no merge launch), alone and with one plan a step, and their bits

A cell's contexts are all equal, or ragged ("r" cells): lognormal (sigma 1, as an RL batch's contexts spread) with
the cell's context as their mean, each between 64 tokens and 8x the mean, the same draw for every kernel.

Each kernel runs over several copies of the cache (one per "layer", so that a small cell does not live in L2),
captured in one CUDA graph and replayed: microseconds per call, the bytes it must read (K + V of every context token,
the query and the output) and the bandwidth that makes, against the device's copy bandwidth measured in the same
run as the roofline measures it (scripts/decode_roofline.py: 1 GiB, read + write, the best of its timed loops).
Accuracy: each kernel's output against a float64 reference computed from the same E4M3 query and cache.

  python scripts/gpu/bench_decode_attention.py --out /tmp/attn [--quick] [--deadline-s 400] [--flashinfer]
      [--v-widen-tile] [--pdl] [--single-plan] [--step-plan] [--fused-merge]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
import _paths  # noqa: E402,F401  (scripts/gpu and the checkout on sys.path)
from attention_cells import (  # noqa: E402  (scripts/gpu/attention_cells.py: the cells, FA3's call, timing, the loop)
    DIM,
    HEADS,
    KV_HEADS,
    Cell,
    cell_label,
    cells_of,
    error_vs,
    fa3_calls,
    new_result,
    run_cells,
    time_graph,
    write_report,
)

from sglang_fp8rl.kernels import fp8_decode_attention as FDA  # noqa: E402
from sglang_fp8rl.kernels.step_plan import StepPlan  # noqa: E402

# "fine" 1 is the grid of the plan's first form (budget + batch programs per KV head, no several-wave plans) and
# "preplan" False the plan computed in every program: they separated the two costs the H200 run of RESULTS 25b found
# at 1-8 sequences (a larger grid of idle programs, the plan in every program); RESULTS 26a made preplan the default
SWEEP = {"block_n": (64, 128), "num_warps": (4,), "num_stages": (2, 3, 4), "per_sm": (1, 2, 3, 4, 6),
         "fine": (FDA.FINE, 1), "preplan": (False, True)}
QUICK_SWEEP = {"block_n": (128,), "num_warps": (4,), "num_stages": (3,), "per_sm": (1, 2, 4), "fine": (FDA.FINE, 1),
               "preplan": (False, True)}


# optional kernels of a row (options --flashinfer, --v-widen-tile) and their column names
OPTIONAL_KERNELS = {"fi_fp8": "FlashInfer FP8", "split_kv_vtile": "split-KV, V widened on its tile",
                    "split_kv_pdl": "split-KV, dependent launches", "split_kv_plain": "split-KV, plain launches",
                    "split_kv_single": "split-KV, one sequence planned in the kernels",
                    "split_kv_planned": "split-KV, one sequence planned by its own launch",
                    "split_kv_step": "split-KV, one plan a step",
                    "split_kv_fused": "split-KV, merged by the last split",
                    "split_kv_fused_step": "split-KV, merged by the last split, one plan a step"}
# the split-KV kernel's optional forms: (column, option, the keywords that make it): V widened on its tile, and the
# launch form the default does not use (dependent launches are the default on Hopper since docs/RESULTS.md 35d)
SPLIT_KV_FORMS = (("split_kv_vtile", "v_widen_tile", {"v_widen_tile": True}),
                  ("split_kv_plain" if FDA.PDL else "split_kv_pdl", "pdl", {"pdl": not FDA.PDL}),
                  ("split_kv_planned" if FDA.SINGLE_PLAN else "split_kv_single", "single_plan",
                   {"single_plan": not FDA.SINGLE_PLAN}),
                  ("split_kv_step", "step_plan", {"step_plan": True}),
                  ("split_kv_fused", "fused_merge", {"fused_merge": True}),
                  ("split_kv_fused_step", "fused_merge", {"fused_merge": True, "step_plan": True}))
# the command-line options that add the forms (--v-widen-tile ...), and what each adds
FORM_OPTIONS = {
    "v_widen_tile": "with V widened on its tile (fp8_decode_attention.V_WIDEN_TILE)",
    "pdl": "with its launches in the form the default does not use (plain or programmatic dependent launches, "
           "fp8_decode_attention.PDL)",
    "single_plan": "at one sequence, in the plan form the default does not use: planned in closed form inside its "
                   "two kernels, or by the plan launch (fp8_decode_attention.SINGLE_PLAN)",
    "step_plan": "with one plan for all the calls of a graph, the layers of a step (kernels/step_plan.py)",
    "fused_merge": "with the last split of each sequence merging, no merge launch (fp8_decode_attention.FUSED_MERGE), "
                   "alone and with one plan a step",
}
FI_WORKSPACE_BYTES = 256 << 20  # SGLang's flashinfer backend allocates this much float workspace (its default)


def fi_calls(cell: Cell):
    """FlashInfer's FP8-KV decode on a cell, as SGLang's flashinfer backend makes it (planned once, graph-safe)."""
    import flashinfer

    dev = cell.q.device
    lengths = torch.tensor(cell.lengths, dtype=torch.int32)
    indptr = torch.zeros(cell.batch + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lengths, 0)
    indptr = indptr.to(dev)
    indices = torch.cat([cell.page_table[b, :n] for b, n in enumerate(cell.lengths)]).to(torch.int32)
    last_page_len = torch.ones(cell.batch, dtype=torch.int32, device=dev)  # page size 1: every page is full
    workspace = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len)
    wrapper.plan(indptr, indices, last_page_len, HEADS, KV_HEADS, DIM, 1, q_data_type=torch.bfloat16,
                 kv_data_type=torch.float8_e4m3fn, sm_scale=cell.scale)
    k_scale, v_scale = float(cell.k_scale), float(cell.v_scale)
    q = cell.q8.to(torch.bfloat16)  # SGLang passes its BF16 query; these values are the reference's E4M3 query

    def call(i: int) -> torch.Tensor:
        return wrapper.run(q, (cell.k[i], cell.v[i]), k_scale=k_scale, v_scale=v_scale)
    return call


def split_kv_call(cell: Cell, cfg: dict, sms: int):
    """The kernel's call on a cell with ``cfg``'s variant, its work budget and its plan's largest split count."""
    budget = FDA.work_budget(KV_HEADS, sms, cfg.get("per_sm", FDA.RESIDENT_PER_SM))
    kw = {k: cfg[k] for k in ("block_n", "num_warps", "num_stages", "fine", "preplan", "v_widen_tile", "pdl",
                              "single_plan", "fused_merge") if k in cfg}
    splits = max(FDA.plan_splits(cell.lengths, budget, kw.get("block_n", FDA.DEFAULT_BLOCK_N),
                                 kw.get("fine", FDA.FINE)))
    # the dispatcher's step plan (the default budget and tile only): the graph's first call writes it
    plans = StepPlan() if cfg.get("step_plan") else None

    def call(i: int) -> torch.Tensor:
        plan = plans.plan(cell.q8, cell.k[i], cell.seqlens) if plans is not None else None
        return FDA.fp8_decode_attention(cell.q8, cell.k[i], cell.v[i], cell.page_table, cell.seqlens, cell.scale,
                                        cell.k_scale, cell.v_scale, budget=budget, plan=plan, **kw)
    return call, {"budget": budget, "splits": splits}


def variants(sweep: dict) -> list[dict]:
    """Every combination of the sweep's values, as keyword dicts; none for an empty sweep (--no-sweep)."""
    if not sweep:
        return []
    keys = list(sweep)
    return [dict(zip(keys, values)) for values in itertools.product(*(sweep[k] for k in keys))]


def run_cell(cell: Cell, sweep: dict, sms: int, bw: float, deadline: float, flashinfer: bool = False,
             forms: dict | None = None) -> dict:
    """One cell: FA3 (BF16 and FP8 caches), the split-KV default, its forms asked for (``forms``: option -> bool, the
    options of FORM_OPTIONS) and the sweep."""
    ref = cell.reference()
    row = {"batch": cell.batch, "context": cell.context, "ragged": cell.ragged, "max_context": max(cell.lengths),
           "copies": cell.copies, "kernels": {}, "sweep": []}
    kernels = [("fa3_bf16", False), ("fa3_fp8", True)] + ([("fi_fp8", True)] if flashinfer else [])
    for name, fp8 in kernels:
        try:
            if name == "fi_fp8":
                started = time.time()
                call = fi_calls(cell)
                call(0)  # the first call JIT-compiles FlashInfer's module: timed apart from the kernel
                torch.cuda.synchronize()
                row["fi_first_call_s"] = time.time() - started
            else:
                call = fa3_calls(cell, fp8)
            us = time_graph(call, cell.copies)
            nbytes = cell.read_bytes(1 if fp8 else 2, 1 if name == "fa3_fp8" else 2)
            row["kernels"][name] = {"us": us, "gbps": nbytes / us / 1e3, "of_copy_bw": nbytes / us / 1e3 / bw}
            if fp8:  # the BF16 cache holds the codes unscaled: not comparable with the reference
                row["kernels"][name]["error"] = error_vs(ref, call(0))
        except Exception as e:  # FA3 / FlashInfer missing or refusing a shape: recorded, the sweep goes on
            row["kernels"][name] = {"error_text": f"{type(e).__name__}: {e}"[:300]}
    nbytes = cell.read_bytes(1, 1)
    default_call, plan = split_kv_call(cell, {}, sms)
    us = time_graph(default_call, cell.copies)
    default_out = default_call(0)
    row["kernels"]["split_kv"] = {"us": us, **plan, "gbps": nbytes / us / 1e3,
                                  "of_copy_bw": nbytes / us / 1e3 / bw, "error": error_vs(ref, default_out)}
    wanted = dict.fromkeys(FORM_OPTIONS, False) | (forms or {})
    wanted["single_plan"] = wanted["single_plan"] and cell.batch == 1  # a form of batches of one only
    for column, option, keywords in SPLIT_KV_FORMS:  # the default with one change; whether its bits are the default's
        if not wanted[option]:
            continue
        form_call, _ = split_kv_call(cell, keywords, sms)
        us = time_graph(form_call, cell.copies)
        form_out = form_call(0)
        row["kernels"][column] = {"us": us, "gbps": nbytes / us / 1e3, "of_copy_bw": nbytes / us / 1e3 / bw,
                                  "error": error_vs(ref, form_out),
                                  "same_bits": bool(torch.equal(form_out, default_out))}
    for cfg in variants(sweep):
        if time.time() > deadline:
            row["sweep_cut"] = True
            break
        try:
            call, plan = split_kv_call(cell, cfg, sms)
            us = time_graph(call, cell.copies)
            row["sweep"].append({**cfg, **plan, "us": us, "gbps": nbytes / us / 1e3})
        except Exception as e:  # a config Triton cannot compile (shared memory): recorded
            row["sweep"].append({**cfg, "error_text": f"{type(e).__name__}: {e}"[:200]})
    ok = [s for s in row["sweep"] if "us" in s]
    if ok:
        row["best"] = min(ok, key=lambda s: s["us"])
    return row


def work_of(variant: dict) -> str:
    """How a variant shared the work: its budget (programs per KV head) or, in runs before the plan, its splits."""
    if "budget" in variant:
        fine = f", fine {variant['fine']}" if "fine" in variant else ""  # runs before these options had none
        preplan = ", preplan" if variant.get("preplan") else ""
        return f"budget {variant['budget']}{fine}{preplan} ({variant['splits']} splits at most)"
    return f"{variant['splits']} splits"


def report(result: dict) -> str:
    bw = result["copy_gbps"]
    lines = [f"## FP8-KV decode attention: split-KV (this package) vs FlashAttention-3, {result['device']}",
             f"copy bandwidth {bw:,.0f} GB/s; {HEADS} query heads, {KV_HEADS} KV heads, head dim {DIM}, page size 1; "
             f"{result['date']}", ""]
    extra = [name for name in OPTIONAL_KERNELS if any(name in row["kernels"] for row in result["cells"])]
    names = [OPTIONAL_KERNELS[name] for name in extra]
    header = (["bs x context", "FA3 BF16 us (% copy BW)", "FA3 FP8 us (%)", "split-KV default us (%)"]
              + [f"{x} us (%)" for x in names] + ["best sweep us (%)", "best config", "FA3 FP8 / split-KV"]
              + [f"FA3 FP8 / {x}" for x in names] + ["max abs err " + " / ".join(["FA3 FP8", "split-KV", *names])])
    align = ["---"] + ["---:"] * (4 + len(extra)) + ["---"] + ["---:"] * (1 + len(extra)) + ["---"]
    lines += ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    for row in result["cells"]:
        k = row["kernels"]

        def cellfmt(name, k=k):
            d = k.get(name, {})
            return f"{d['us']:.1f} ({100 * d['of_copy_bw']:.0f} %)" if "us" in d else "-"

        def fa3_over(name, k=k):
            return f"{k['fa3_fp8']['us'] / k[name]['us']:.2f}x" if "us" in k.get("fa3_fp8", {}) and \
                "us" in k.get(name, {}) else "-"
        best = row.get("best")
        best_txt = f"{best['us']:.1f} ({100 * best['gbps'] / bw:.0f} %)" if best else "-"
        cfg = f"n{best['block_n']} w{best['num_warps']} s{best['num_stages']}, {work_of(best)}" if best else "-"
        errs = "/".join(f"{k[n]['error']['max_abs']:.2e}" if "error" in k.get(n, {}) else "-"
                        for n in ("fa3_fp8", "split_kv", *extra))
        times = "".join(f" {cellfmt(n)} |" for n in extra)
        ratios = " | ".join([fa3_over("split_kv"), *(fa3_over(n) for n in extra)])
        lines.append(f"| {cell_label(row)} | {cellfmt('fa3_bf16')} | {cellfmt('fa3_fp8')} | "
                     f"{cellfmt('split_kv')} |{times} {best_txt} | {cfg} | {ratios} | {errs} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="four cells and a small sweep")
    p.add_argument("--deadline-s", type=float, default=400.0, help="stop sweeping after this many seconds")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--cells", choices=("all", "equal", "ragged"), default="all",
                   help="equal contexts, ragged ones (lognormal), or both (default)")
    p.add_argument("--flashinfer", action="store_true",
                   help="also FlashInfer's FP8-KV decode as SGLang's flashinfer backend calls it (JIT on first use)")
    for option, text in FORM_OPTIONS.items():
        p.add_argument(f"--{option.replace('_', '-')}", action="store_true", help=f"also the split-KV kernel {text}")
    args = p.parse_args()
    t0, dev = time.time(), torch.device("cuda")
    result = new_result("bench_decode_attention", dev)
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    sweep = {} if args.no_sweep else (QUICK_SWEEP if args.quick else SWEEP)
    forms = {option: getattr(args, option) for option in FORM_OPTIONS}
    run_cells(cells_of(args.cells, args.quick), dev, t0, args.deadline_s, result, report,
              os.path.join(args.out, "decode_attention.json"),
              lambda cell, deadline: run_cell(cell, sweep, result["sms"], result["copy_gbps"], deadline,
                                              flashinfer=args.flashinfer, forms=forms))
    write_report(report(result), os.path.join(args.out, "decode_attention.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
