#!/usr/bin/env python3
"""The split-KV decode-attention kernel compiled for Hopper (sm90) on a machine without a GPU: what its main loop
issues per 128-token tile, read from the PTX and from the SASS (the machine code, disassembled with the nvdisasm
Triton ships). ``--kernel norm``: the fused add-RMSNorm-quantize kernel of one row (``norm_quant``), its SASS
instructions a thread at ``--warps`` (docs/RESULTS.md 39: 16 warps, 616 against 4 warps' 1,632, were slower).

The arguments get the specializations Triton's launcher gives a served call (pointers and the strides of a page-size-1
cache, 1024 bytes a token, divisible by 16), so the code is the one a GPU runs, up to the Triton version. Printed: the
shared memory, whether the cache reads are asynchronous copies (software-pipelined) and vectorized, and the
instruction mix of the loop in SASS (per thread, and per tile for all warps). A kernel bound by bandwidth needs few
instructions per byte; this is how many it has (docs/RESULTS.md 28f).

  python scripts/kernel_asm.py [--block-n 128] [--warps 4] [--stages 3] [--v-widen-tile]
  python scripts/kernel_asm.py --kernel norm [--hidden 4096] [--warps 4]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
from typing import Optional

import _paths  # noqa: F401  (the checkout on sys.path)

# launcher specialization: the integer arguments a served page-size-1 call passes as multiples of 16
_DIVISIBLE = ("stride_q_tok", "stride_q_head", "stride_k_page", "stride_k_head", "stride_v_page", "stride_v_head",
              "stride_pt", "num_heads")
_POINTER_TYPES = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "page_table_ptr": "*i32",
                  "seqlens_ptr": "*i32", "plan_ptr": "*i32", "counts_ptr": "*i32", "out_ptr": "*bf16",
                  "codes_ptr": "*fp8e4nv"}


@functools.cache  # a compile takes seconds: once per configuration and process
def compile_split_kernel(block_n: int = 128, warps: int = 4, stages: int = 3, group: int = 4,
                         v_widen_tile: bool = False, pdl: bool = False, single: bool = False,
                         fused_merge: bool = False) -> dict:
    """The split kernel's sm90 TTGIR, PTX, cubin and shared memory, as the default served call specializes it."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_fp8rl.kernels import fp8_decode_attention as FDA

    kernel = FDA._decode_attn_split_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    constexprs = dict(PAGE_SIZE=1, GROUP=group, BLOCK_H=max(FDA.MIN_BLOCK_H, group), HEAD_DIM=128, BLOCK_N=block_n,
                      BLOCK_B=1 if single else 8, MAX_SPLITS=FDA.MAX_SPLITS, FINE=FDA.FINE, PREPLAN=not single,
                      V_WIDEN_TILE=v_widen_tile, PDL=pdl, SINGLE=single, FUSED_MERGE=fused_merge, SPLITS_P2=64,
                      FP8_MAX=FDA.FP8_MAX, AMAX_FLOOR_BITS=FDA._AMAX_FLOOR_BITS, QUANT_OUT=False)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER_TYPES.get(name, "*fp32")
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    aligned = [n for n in names if n.endswith("_ptr") or n in _DIVISIBLE]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return {"ttgir": compiled.asm["ttgir"], "ptx": compiled.asm["ptx"], "cubin": compiled.asm["cubin"],
            "shared": compiled.metadata.shared}


@functools.cache
def compile_norm_kernel(hidden: int = 4096, warps: int = 4, pdl: bool = False) -> dict:
    """The fused add-RMSNorm-quantize kernel's sm90 PTX and cubin for rows of ``hidden`` (residual added)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_fp8rl.kernels import norm_quant as NQ

    kernel = NQ._add_rmsnorm_quant_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    groups = hidden // NQ.GROUP_K
    constexprs = dict(GROUP=NQ.GROUP_K, GROUPS_P2=triton.next_power_of_2(groups), HAS_RESIDUAL=True,
                      FP8_MAX=NQ.FP8_MAX, AMAX_FLOOR_BITS=NQ._AMAX_FLOOR_BITS, PDL=pdl)
    pointers = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32")
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "eps" else "i32")
                 for n in names}
    aligned = [n for n in names if n in pointers or n in ("stride_xm", "stride_rm", "stride_om", "stride_qm")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return {"ptx": compiled.asm["ptx"], "cubin": compiled.asm["cubin"], "shared": compiled.metadata.shared}


def instructions(sass: str) -> list[str]:
    """Every instruction of a SASS listing, in order (labels and blank lines dropped)."""
    return [x for x in (ln.split("\t", 1)[-1].strip() for ln in sass.split("\n") if "\t" in ln) if x]


def sass_of(cubin: bytes) -> str:
    """The cubin disassembled (Triton's nvdisasm wrapper): one line per instruction, control codes first."""
    from triton.tools.disasm import get_sass

    return get_sass(cubin)


def loop_body(sass: str) -> list[str]:
    """The instructions (without predicate guards) of the longest block that a branch jumps back to: the main loop.
    Triton's SASS listing labels blocks ``LBBn:`` and writes each instruction after a tab (its control codes before)."""
    lines = sass.split("\n")
    labels = {ln.rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^LBB\d+:$", ln.strip())}
    best: list[str] = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\s+(LBB\d+)", ln)
        if m and labels.get(m.group(1), i) < i:
            body = [x.split("\t", 1)[-1].strip() for x in lines[labels[m.group(1)] + 1:i + 1] if "\t" in x]
            best = max(best, [x for x in body if x], key=len)
    return best


def opcode(instruction: str) -> str:
    """'@!P0 LDS.U8 R1, [R2];' -> 'LDS.U8' (the predicate guard skipped)."""
    parts = instruction.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].rstrip(";") if parts else ""


def report(asm: dict, warps: int, block_n: int) -> dict:
    """Shared memory, pipelining (TTGIR, PTX) and the SASS loop's instruction mix."""
    body = loop_body(sass_of(asm["cubin"]))
    ops = collections.Counter(opcode(x) for x in body)
    return {"shared_bytes": asm["shared"], "async_copies_in_ttgir": asm["ttgir"].count("async_copy_global_to_local"),
            "byte_global_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b8\b", asm["ptx"])),
            "loop_instructions_per_thread": len(body), "loop_warp_instructions_per_tile": len(body) * warps,
            "tile_tokens": block_n, "top_opcodes": ops.most_common(14)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", choices=("split", "norm"), default="split")
    p.add_argument("--hidden", type=int, default=4096, help="--kernel norm: the row's width")
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--v-widen-tile", action="store_true",
                   help="V widened on its tile (fp8_decode_attention.V_WIDEN_TILE)")
    a = p.parse_args(argv)
    if a.kernel == "norm":
        asm = compile_norm_kernel(a.hidden, a.warps)
        ops = collections.Counter(opcode(x) for x in instructions(sass_of(asm["cubin"])))
        print(json.dumps({"shared_bytes": asm["shared"], "warps": a.warps,
                          "instructions_per_thread": sum(ops.values()), "top_opcodes": ops.most_common(10)}, indent=1))
        return 0
    asm = compile_split_kernel(a.block_n, a.warps, a.stages, v_widen_tile=a.v_widen_tile)
    print(json.dumps(report(asm, a.warps, a.block_n), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
