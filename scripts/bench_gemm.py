#!/usr/bin/env python
"""Per-shape block-FP8 GEMM microbenchmark (issue 8): BF16 cuBLAS vs every gemm_select candidate.

For each Qwen3-8B linear shape (qkv 6144x4096, o_proj 4096x4096, gate_up 24576x4096, down 4096x12288; N x K) and
M in {1, 8, 32, 64, 96, 112, 128, 144, 192, 256}:

* bf16: ``F.linear(x, W)`` (cuBLAS);
* each candidate of ``sglang_fp8rl.kernels.gemm_select`` (``deepgemm_default`` = SGLang's dispatched block-FP8
  linear, ``deepgemm_sms_{n}`` = the same under ``deep_gemm.set_num_sms(n)``, ``triton_default``), each a full
  linear: 1x128 activation quant + GEMM, on a weight quantized by ``sglang_fp8rl.quant`` (128x128 fp32 scales);
* ``fp8rl_n{64,128}_sk{1,2,4}``: our swap-AB / split-K Triton kernel (``sglang_fp8rl.kernels.block_gemm``), M <= 128;
* ``fp8rl_fused_n64_sk4``: the same kernel quantizing the BF16 activation itself (one launch), M <= 16;
* with ``--prefetch``: ``fp8rl_n64_sk4_pf``, the same kernel with each program's weight slice prefetched to L2
  before its loop; ``_pfpdl``, that launched as a programmatic dependent launch waiting for the kernel before it
  (the activation quantizer) only after the prefetch; ``fp8rl_n64_sk{4,1}_pdl``, the dependent launch alone;
  ``fp8rl_n64_sk{4,1}_qpdl``, our own activation quantizer and the kernel, both dependent launches; M <= 16.

Timing: a CUDA graph of >= 48 back-to-back calls rotating over enough weight copies
(>= 200 MB) and activation sets that weights come from HBM, median of the replays / calls. Each (shape, M, method)
is first checked on a fresh x against the float64 block-scaled product (fp8 methods) or the float64 product (bf16):
rel. Frobenius error on one column per 16. Ceilings measured in the same run: a 1 GiB device-to-device copy
(read + write bytes), bf16 ``mm`` 8192^3, fp8 row-wise ``torch._scaled_mm`` 8192^3. Bytes = weight (+ scales) +
bf16 activation in + bf16 output, once each; "%BW" = bytes / time / copy BW; "%pk" = TFLOP/s / the matching peak.

Usage (GPU):  python scripts/bench_gemm.py [--ms 1,8,...] [--shapes qkv,gate_up | --shapes 24576x4096]
              [--sms 124,112] [--no-triton] [--no-ours] [--json out.json]
              python scripts/bench_gemm.py --tune [--max-m 256] [--cache PATH]   (fill the gemm_select cache)
Env: SGLANG_JIT_DEEPGEMM_PRECOMPILE defaults to 0 here (first calls JIT; their wall time is reported).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import _paths  # noqa: F401  (this checkout's sglang_fp8rl first on sys.path)

QWEN3_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 8, 32, 64, 96, 112, 128, 144, 192, 256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(QWEN3_8B),
                   help="comma list of Qwen3-8B names (qkv,o_proj,gate_up,down) or NxK (default: all four)")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="comma list of M (default: %(default)s)")
    p.add_argument("--sms", default=None, help="num_sms candidates (default: gemm_select.DEFAULT_SMS)")
    p.add_argument("--no-triton", action="store_true", help="leave out triton_default")
    p.add_argument("--no-ours", action="store_true", help="leave out our kernel (fp8rl_*)")
    p.add_argument("--prefetch", action="store_true",
                   help="also our kernel with its weight prefetched to L2 (_pf, _pfpdl), split-K 1 launched with PDL "
                        "(_sk1_pdl) and after our own quantizer (_qpdl); split-K 4 with PDL (_sk4_pdl) is a server "
                        "candidate, always measured")
    p.add_argument("--rot-mb", type=float, default=200.0, help="weight bytes rotated per graph (MB, default 200)")
    p.add_argument("--calls", type=int, default=48, help="calls per CUDA graph (default 48)")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed (median; default 20)")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--tune", action="store_true", help="run gemm_select.autotune on --shapes and write the cache")
    p.add_argument("--max-m", type=int, default=256, help="--tune: largest M bucket (default 256)")
    p.add_argument("--budget-s", type=float, default=600.0, help="--tune: wall budget (default 600 here)")
    p.add_argument("--points", default="upper", choices=("upper", "both"), help="--tune: M points per bucket")
    p.add_argument("--cache", default=None, help="--tune: cache path (default: FP8RL_GEMM_SELECT_CACHE or ~/.cache)")
    return p.parse_args(argv)


def parse_shapes(spec: str) -> list[tuple[str, int, int]]:
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in QWEN3_8B:
            out.append((item, *QWEN3_8B[item]))
        else:
            n, k = (int(v) for v in item.lower().split("x"))
            out.append((f"{n}x{k}", n, k))
    return out


def measure_ceilings(torch, time_us):
    nb = 1 << 30
    src = torch.randn(nb // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_us = min(time_us(lambda: dst.copy_(src)) for _ in range(2))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3
    bf16_tf = flops / (time_us(lambda: torch.mm(a, b)) * 1e-6) / 1e12
    fp8_tf = None
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(8192, 1, device="cuda")
        sb = torch.ones(1, 8192, device="cuda")
        fp8_tf = flops / (time_us(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                           out_dtype=torch.bfloat16)) * 1e-6) / 1e12
    except (RuntimeError, TypeError) as e:  # torch._scaled_mm's signature / support differs across versions
        print(f"fp8 peak not measured: {e!r}")
    return {"copy_GBs": 2 * nb / (copy_us * 1e-6) / 1e9, "bf16_tflops": bf16_tf, "fp8_tflops": fp8_tf}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("bench_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from sglang_fp8rl.kernels import deepgemm
    from sglang_fp8rl.kernels import gemm_select as gs
    from sglang_fp8rl.quant import quantize_activation_groups

    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = parse_shapes(args.shapes)
    sms = tuple(int(v) for v in args.sms.split(",")) if args.sms else gs.DEFAULT_SMS
    # the microbenchmark compares every candidate; --tune uses the server's own set, so the cache stays valid there
    launch_forms = args.prefetch and not args.no_ours  # prefetch and dependent-launch forms of our kernel
    cands = gs.make_candidates(sms, triton=not args.no_triton, ours=() if args.no_ours else gs.ALL_OURS_CONFIGS,
                               fused=() if args.no_ours else gs.FUSED_FORMS, pdl=() if args.no_ours else gs.PDL_CONFIGS,
                               prefetch=gs.PREFETCH_FORMS if launch_forms else (),
                               own_quant=gs.OWN_QUANT_FORMS if launch_forms else ())
    facts = deepgemm.detect()
    info = gs.env_info(facts)
    print("env:", json.dumps(info))

    if args.tune:
        settings = gs.TuneSettings(max_m=args.max_m, budget_s=args.budget_s, rot_bytes=args.rot_mb * 1e6,
                                   calls=args.calls, points=args.points)
        new = gs.autotune([(n, k) for _, n, k in shapes], gs.make_candidates(), settings,
                          bench=gs.Bench.create(facts=facts), log=print)
        path = gs.merge_entries(args.cache, info, new)
        print(f"wrote {len(new)} entries to {path}\n")
        print(gs.format_table(new))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"info": info, "entries": {key: e.to_json() for key, e in new.items()}}, f, indent=1)
        return 0

    from triton.testing import do_bench

    def time_us(fn):
        return float(do_bench(fn, warmup=10, rep=40)) * 1e3

    peaks = measure_ceilings(torch, time_us)
    torch.cuda.empty_cache()
    copy_bw = peaks["copy_GBs"] * 1e9
    print(f"ceilings: copy {peaks['copy_GBs']:.0f} GB/s, bf16 mm {peaks['bf16_tflops']:.0f} TFLOP/s, "
          f"fp8 rowwise mm {peaks['fp8_tflops'] or float('nan'):.0f} TFLOP/s")
    ms = [int(v) for v in args.ms.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {"info": info, "peaks": peaks, "args": vars(args), "rows": []}
    methods = ["bf16"] + list(cands)
    errors = deepgemm.candidate_errors()
    t0 = time.time()
    for name, n, k in shapes:
        nrot8 = int(min(16, max(2, math.ceil(args.rot_mb * 1e6 / (n * k)))))
        nrot16 = int(min(16, max(2, math.ceil(args.rot_mb * 1e6 / (2 * n * k)))))
        w16 = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        w16s = [w16] + [w16.clone() for _ in range(nrot16 - 1)]
        wq, ws = gs.random_block_weight(n, k, "cuda", gen)
        w8s = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(nrot8 - 1)]
        cols = gs.check_columns(n, generator=gen, device="cuda")
        for m in ms:
            row = {"shape": name, "N": n, "K": k, "M": m, "us": {}, "rel_err": {}, "first_call_s": {}, "errors": {}}
            nrot = max(nrot8, nrot16)
            xs = [torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(nrot)]
            xq, xsc = quantize_activation_groups(xs[0], 128)
            ref8 = gs.block_scaled_reference(xq, xsc, wq, ws, gs.BLOCK, cols)
            ref16 = xs[0].double() @ w16[cols].double().t()
            for meth in methods:
                if meth == "bf16":
                    def fn(j, xs=xs, w16s=w16s, nr=nrot16):
                        return F.linear(xs[j % nr], w16s[j % nr])
                    nr, ref = nrot16, ref16
                else:
                    c = cands[meth]
                    why = c.can_implement(n, k, facts, m)
                    if why:
                        row["errors"][meth] = why
                        continue
                    def fn(j, c=c, xs=xs, w8s=w8s, nr=nrot8):
                        return c.fn(xs[j % nr], w8s[j % nr][0], w8s[j % nr][1], None)
                    nr, ref = nrot8, ref8
                try:
                    t1 = time.time()
                    o = fn(0)
                    torch.cuda.synchronize()
                    row["first_call_s"][meth] = round(time.time() - t1, 3)
                    err = gs.rel_error(o[:, cols], ref)
                    row["rel_err"][meth] = err
                    del o
                    if not err <= gs.REL_TOL:
                        row["errors"][meth] = f"rel. error {err:.3g} > {gs.REL_TOL}"
                    row["us"][meth] = gs.time_graph(fn, nr, args.calls, args.reps)
                except errors as e:  # keep going; the error is in the table and the JSON
                    row["errors"][meth] = f"{type(e).__name__}: {e}"[:300]
                    torch.cuda.synchronize()
            for meth, us in row["us"].items():
                byts = (2 * n * k if meth == "bf16" else n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4)
                byts += 2 * m * k + 2 * m * n
                tf = 2 * m * n * k / (us * 1e-6) / 1e12
                peak = peaks["bf16_tflops"] if meth == "bf16" else peaks["fp8_tflops"]
                row.setdefault("derived", {})[meth] = {
                    "bytes": byts, "GBs": byts / (us * 1e-6) / 1e9, "frac_copy_bw": byts / (us * 1e-6) / copy_bw,
                    "tflops": tf, "frac_peak": tf / peak if peak else None,
                    "x_bf16": row["us"]["bf16"] / us if "bf16" in row["us"] else None}
            results["rows"].append(row)
            short = " | ".join(f"{mm} {row['us'][mm]:.1f}" for mm in methods if mm in row["us"])
            print(f"[{time.time() - t0:6.1f}s] {name} M={m}: {short} us; errors {row['errors'] or 'none'}", flush=True)
        w16s = w8s = w16 = wq = ws = None  # free before the next shape
        torch.cuda.empty_cache()
    print()
    print(markdown(results, methods))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0


def _cell(r: dict, m: str) -> str:
    us, d = r["us"], r.get("derived", {})
    if m not in us:
        return "n/a"
    flag = " FAIL" if m in r["errors"] else ""
    xb = d.get(m, {}).get("x_bf16")
    return f"{us[m]:.1f} (x{xb:.2f}){flag}" if xb else f"{us[m]:.1f}{flag}"


def markdown(results: dict, methods: list[str]) -> str:
    """Two markdown tables: us (x BF16), and %copy-BW / TFLOP/s (%peak) per method."""
    fp8 = [m for m in methods if m != "bf16"]
    head = "| shape | M | bf16 us | " + " | ".join(f"{m} us (x bf16)" for m in fp8) + " | best |"
    pk = results["peaks"]
    title = (f"copy {pk['copy_GBs']:.0f} GB/s; peaks bf16 {pk['bf16_tflops']:.0f}, "
             f"fp8 {pk['fp8_tflops'] or float('nan'):.0f} TFLOP/s")
    lines = [title, "", head, "|" + "---|" * (len(fp8) + 4)]
    for r in results["rows"]:
        us = r["us"]
        ok = {m: us[m] for m in fp8 if m in us and m not in r["errors"]}
        best = min(ok, key=ok.get) if ok else "-"
        b16 = f"{us['bf16']:.1f}" if "bf16" in us else "-"
        lines.append(f"| {r['shape']} | {r['M']} | {b16} | " + " | ".join(_cell(r, m) for m in fp8) + f" | {best} |")
    lines += ["", "| shape | M | " + " | ".join(f"{m} %BW, TF/s (%pk)" for m in methods) + " |",
              "|" + "---|" * (len(methods) + 2)]
    for r in results["rows"]:
        d = r.get("derived", {})
        cells = [f"{100 * d[m]['frac_copy_bw']:.0f}%, {d[m]['tflops']:.0f} ({100 * (d[m]['frac_peak'] or 0):.0f}%)"
                 if m in d else "n/a" for m in methods]
        lines.append(f"| {r['shape']} | {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
