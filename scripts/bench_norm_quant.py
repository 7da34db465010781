#!/usr/bin/env python
"""What fusing the 1x128 activation quantizer into the kernel that makes a decode linear's input would save (GPU).

For Qwen3-8B's producers at M (running sequences) in ``--ms``, under CUDA graphs (``gemm_select.time_graph``: 48
back-to-back calls rotating over operand sets, median of the replays):

* norm: SGLang's ``RMSNorm`` (its CUDA forward, the residual added in place, as before qkv and gate_up) alone; then
  followed by SGLang's 1x128 quantizer as its DeepGEMM linear calls it (``deepgemm.quantize_for_deepgemm``); then
  ``norm_quant.add_rmsnorm_quant`` (one launch, the same scale layout), as a plain and as a programmatic dependent
  launch (``pdl``, as served on Hopper, where SGLang's own norm is one too), and as a dependent launch at 16 warps a
  program (fewer instructions a thread than ``norm_quant.norm_warps``' choice, docs/RESULTS.md 39; its output is
  checked against the served form's too);
* silu: SGLang's ``SiluAndMul`` alone, followed by the quantizer, and ``norm_quant.silu_mul_quant`` (plain, pdl).

Each fused output is checked against SGLang's unfused one: the BF16 outputs (the share of equal values, the largest
difference in BF16 steps) and the codes (the fused kernel's are ``quant.quantize_activation_groups`` of its own BF16
output, bit for bit), and the dependent launch's bits are the plain launch's. The per-step estimate: 36 layers x
(2 norms + 1 SiLU) x (unfused pair - fused pdl).

Usage (GPU): python scripts/bench_norm_quant.py [--ms 1,8,32,128,384] [--hidden 4096] [--intermediate 12288]
             [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import _paths  # noqa: F401  (this checkout's sglang_fp8rl first on sys.path)

LAYERS = 36  # Qwen3-8B
WIDE_WARPS = 16  # the fused norm's alternative: 616 SASS instructions a thread at 4096 wide against 4 warps' 1,632
EPS = 1e-6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,8,32,128,384", help="comma list of M (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=4096, help="the norm's width (default: Qwen3-8B's 4096)")
    p.add_argument("--intermediate", type=int, default=12288, help="the SiLU output's width (default 12288)")
    p.add_argument("--nrot", type=int, default=8, help="operand sets rotated in a graph (default 8)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def bf16_steps(a, b) -> int:
    """The largest distance between two BF16 tensors in BF16 steps (ordered bit patterns)."""
    import torch

    def ordered(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def compare(fused, unfused) -> dict:
    """How the fused kernel's (out, codes, scales) relate to the unfused pair's and to its own output's quantization."""
    import torch

    from sglang_fp8rl.quant import DEFAULT_GROUP_SIZE, quantize_activation_groups

    out, q, s = (t.cpu() for t in fused)  # the reference on the CPU: quant.py's stated division (tests/gpu)
    ref_out = unfused[0].cpu()
    own_q, own_s = quantize_activation_groups(out, DEFAULT_GROUP_SIZE)
    return {"out_equal_share": float((out == ref_out).float().mean()), "out_max_steps": bf16_steps(out, ref_out),
            "codes_are_own_quantization": bool(torch.equal(q.view(torch.uint8), own_q.view(torch.uint8))
                                               and torch.equal(s.contiguous(), own_s))}


def same_bits(a, b) -> bool:
    """Whether two (out, codes, multipliers) triples are equal bit for bit."""
    import torch

    return all(torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8))
               for x, y in zip(a, b))


def bare_silu_and_mul(cls):
    """SGLang's SiluAndMul without its __init__, which reads the published server args from 0.5.17 (none in a
    benchmark process); its CUDA forward reads nothing of the instance."""
    import torch

    silu = cls.__new__(cls)
    torch.nn.Module.__init__(silu)
    return silu


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_norm_quant.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    from sglang_fp8rl.kernels.deepgemm import quantize_for_deepgemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, inter, nrot = args.hidden, args.intermediate, args.nrot
    norm = RMSNorm(h, eps=EPS).cuda().to(torch.bfloat16)
    norm.weight.data = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(torch.bfloat16)
    silu = bare_silu_and_mul(SiluAndMul)
    results = {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": []}
    for m in [int(v) for v in args.ms.split(",")]:
        row = measure_m(m, h, inter, nrot, gen, norm, silu, quantize_for_deepgemm)
        results["rows"].append(row)
        print(f"M={m}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["us"].items())
              + f" us; a step would save {row['step_saving_ms']:.3f} ms; checks {json.dumps(row['checks'])}",
              flush=True)
    print()
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


def measure_m(m: int, h: int, inter: int, nrot: int, gen, norm, silu, sglang_quant) -> dict:
    """One M: us a call of every form (the norm's x clone taken off), the checks, the per-step saving."""
    import torch

    from sglang_fp8rl.kernels.gemm_select import time_graph
    from sglang_fp8rl.kernels.norm_quant import add_rmsnorm_quant, silu_mul_quant

    xs = [torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(nrot)]
    rs = [torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(nrot)]
    gus = [torch.randn(m, 2 * inter, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(nrot)]
    w = norm.weight.data

    def norm_then_quant(j):  # SGLang's kernel writes x in place: a clone each call (its time is taken off)
        out, _ = norm.forward_cuda(xs[j % nrot].clone(), rs[j % nrot])
        return (out, *sglang_quant(out))

    def silu_then_quant(j):
        out = silu.forward_cuda(gus[j % nrot])
        return (out, *sglang_quant(out))

    forms = {
        "norm": lambda j: norm.forward_cuda(xs[j % nrot].clone(), rs[j % nrot]),
        "norm+quant": norm_then_quant,
        "norm_quant fused": lambda j: add_rmsnorm_quant(xs[j % nrot], w, EPS, rs[j % nrot], scale_layout="tma"),
        "norm_quant fused pdl": lambda j: add_rmsnorm_quant(xs[j % nrot], w, EPS, rs[j % nrot], scale_layout="tma",
                                                             pdl=True),
        "norm_quant fused pdl 16 warps": lambda j: add_rmsnorm_quant(xs[j % nrot], w, EPS, rs[j % nrot],
                                                                      scale_layout="tma", pdl=True,
                                                                      num_warps=WIDE_WARPS),
        "silu": lambda j: silu.forward_cuda(gus[j % nrot]),
        "silu+quant": silu_then_quant,
        "silu_quant fused": lambda j: silu_mul_quant(gus[j % nrot], scale_layout="tma"),
        "silu_quant fused pdl": lambda j: silu_mul_quant(gus[j % nrot], scale_layout="tma", pdl=True),
    }
    r0 = rs[0].clone()
    unfused_norm = norm_then_quant(0)
    rs[0].copy_(r0)
    fused_norm = forms["norm_quant fused"](0)
    rs[0].copy_(r0)
    checks = {"norm": compare(fused_norm, unfused_norm), "silu": compare(forms["silu_quant fused"](0),
                                                                         silu_then_quant(0)),
              "pdl_bits_equal": same_bits(forms["norm_quant fused pdl"](0), fused_norm)
              and same_bits(forms["silu_quant fused pdl"](0), forms["silu_quant fused"](0))}
    rs[0].copy_(r0)
    checks["norm_16_warps"] = compare(forms["norm_quant fused pdl 16 warps"](0), fused_norm)
    rs[0].copy_(r0)
    clone_us = time_graph(lambda j: xs[j % nrot].clone(), nrot)
    us = {name: time_graph(fn, nrot) for name, fn in forms.items()}
    for name in ("norm", "norm+quant"):
        us[name] -= clone_us
    saved = LAYERS * (2 * (us["norm+quant"] - us["norm_quant fused pdl"])
                      + (us["silu+quant"] - us["silu_quant fused pdl"]))
    return {"M": m, "us": us, "clone_us": clone_us, "step_saving_ms": saved / 1e3, "checks": checks}


def markdown(results: dict) -> str:
    """The results as a table: us a call of each form, and the estimated saving per decode step."""
    names = list(results["rows"][0]["us"]) if results["rows"] else []
    lines = [f"device: {results['device']}", "", "| M | " + " | ".join(names) + " | step saving (ms) |",
             "| ---: |" + " ---: |" * (len(names) + 1)]
    for row in results["rows"]:
        cells = " | ".join(f"{row['us'][n]:.2f}" for n in names)
        lines.append(f"| {row['M']} | {cells} | {row['step_saving_ms']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
