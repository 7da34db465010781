"""Triton kernels compile for Hopper (sm90) on a machine without a GPU: front-end errors (an unsupported global, a
type mismatch) show up in CI instead of at the first launch on a server. Numerics are tested on the GPU
(tests/gpu/test_kv_store.py)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sglang_fp8rl.kernels import kv_store  # noqa: E402
from sglang_fp8rl.quant import FP8_MAX  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


@pytest.mark.parametrize("loc_type", ["*i64", "*i32"])
def test_kv_store_kernel_compiles_for_sm90_with_rtne_satfinite_e4m3(loc_type):
    pointers = {"k": "*bf16", "v": "*bf16", "k_scale": "*fp32", "v_scale": "*fp32", "k_cache": "*fp8e4nv",
                "v_cache": "*fp8e4nv", "loc": loc_type}
    strides = dict.fromkeys(["k_token_stride", "k_head_stride", "v_token_stride", "v_head_stride", "k_row_stride",
                             "v_row_stride"], "i64")
    constexprs = {"K_HEAD_DIM": 128, "K_ROW": 1024, "K_BLOCK": 1024, "V_HEAD_DIM": 128, "V_ROW": 1024,
                  "V_BLOCK": 1024, "FP8_MAX": FP8_MAX, "SKIP_SLOT": kv_store.RESERVED_SLOT}
    signature = {**pointers, **strides, **dict.fromkeys(constexprs, "constexpr")}
    compiled = triton.compile(ASTSource(fn=kv_store._scaled_store_kernel, signature=signature, constexprs=constexprs),
                              target=HOPPER)
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2" in ptx  # round-to-nearest-even E4M3, like torch's cast after the clamp
    assert "div.rn.f32" in ptx  # the correctly rounded division, like torch's


@pytest.mark.parametrize("in_kind", [0, 2])
def test_grouped_quantizer_compiles_for_sm90_with_16_byte_accesses(in_kind):
    from sglang_fp8rl.kernels import triton_grouped

    constexprs = {"IN_KIND": in_kind, "OUT_KIND": 0, "BLOCK_N": 128, "BLOCK_K": 128, "POW2": False, "USE_FLAG": True,
                  "FP8_MAX": FP8_MAX, "AMAX_FLOOR_BITS": triton_grouped._AMAX_FLOOR_BITS,
                  "COLUMNS": triton_grouped.TABLE_COLUMNS}
    signature = {"table_ptr": "*i64", "flag_ptr": "*i32", **dict.fromkeys(constexprs, "constexpr")}
    compiled = triton.compile(ASTSource(fn=triton_grouped._grouped_blockwise_kernel, signature=signature,
                                        constexprs=constexprs), target=HOPPER)
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2" in ptx and "div.rn.f32" in ptx
    # the alignment promises reach the code generator: 16-byte vector loads of the input and stores of the codes
    # (the table's addresses carry no alignment of their own; a hint lost on the way gives 2-byte loads, 1-byte stores)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "ld.global.b16" not in ptx and "st.global.b8" not in ptx


def compile_block_gemm(split_k: int, quant_x: bool = False, prefetch: bool = False, pdl: bool = False):
    """block_gemm's kernel for sm90 as gemm_select launches it at M <= 16 (64 weight rows x 16 tokens)."""
    from sglang_fp8rl.kernels import block_gemm

    constexprs = {"GROUP": 128, "W_BLOCK_N": 128, "BLOCK_N": 64, "BLOCK_M": 16, "SPLIT_K": split_k,
                  "HAS_BIAS": False, "QUANT_X": quant_x, "FP8_MAX": FP8_MAX,
                  "AMAX_FLOOR_BITS": block_gemm._AMAX_FLOOR_BITS, "PREFETCH": prefetch, "PDL": pdl}
    pointers = {"x_ptr": "*bf16" if quant_x else "*fp8e4nv", "xs_ptr": "*bf16" if quant_x else "*fp32",
                "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16", "bias_ptr": "*bf16", "part_ptr": "*fp32",
                "count_ptr": "*i32"}
    ints = dict.fromkeys(["M", "N", "K_GROUPS", "GROUPS_PER_SPLIT", "stride_xm", "stride_xsm", "stride_xsg",
                          "stride_wn", "stride_wsn", "stride_wsg", "stride_om"], "i32")
    signature = {**pointers, **ints, **dict.fromkeys(constexprs, "constexpr")}
    return triton.compile(ASTSource(fn=block_gemm._block_fp8_gemm_kernel, signature=signature, constexprs=constexprs),
                          target=HOPPER, options={"num_warps": 4, "num_stages": 4, "launch_pdl": pdl})


@pytest.mark.parametrize("split_k", [1, 4])
def test_block_gemm_with_the_activation_quantized_inside_compiles_for_sm90(split_k):
    """block_fp8_linear's kernel (QUANT_X): the quantizer's arithmetic is there (correctly rounded divisions, RNE
    E4M3 codes) and the product is Hopper's FP8 warpgroup MMA (64 weight rows x 16 tokens, as the unfused kernel's)."""
    ptx = compile_block_gemm(split_k, quant_x=True).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2" in ptx and "div.rn.f32" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in ptx  # the codes go to the MMA as E4M3


@pytest.mark.parametrize("split_k", [1, 4])
def test_block_gemm_prefetches_its_weight_before_it_waits_for_the_kernel_before_it(split_k):
    """PREFETCH + PDL: one bulk L2 prefetch a weight row, then griddepcontrol.wait before anything reads the
    activation, launch_dependents after the loop, a kernel marked for programmatic dependent launch; the default has
    none of them."""
    plain = compile_block_gemm(split_k)
    assert "cp.async.bulk.prefetch" not in plain.asm["ptx"] and "griddepcontrol" not in plain.asm["ptx"]
    assert not plain.metadata.launch_pdl
    both = compile_block_gemm(split_k, prefetch=True, pdl=True)
    ptx = both.asm["ptx"]
    prefetch, wait = ptx.index("cp.async.bulk.prefetch.L2.global"), ptx.index("griddepcontrol.wait")
    first_mma = ptx.index("wgmma.mma_async")
    assert prefetch < wait < first_mma < ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1  # one row a thread (64 rows, 128 threads)
    assert "ld.global" not in ptx[:wait]  # nothing is loaded before the wait: the activation, scales and partials
    assert both.metadata.launch_pdl
    prefetch_only = compile_block_gemm(split_k, prefetch=True).asm["ptx"]
    assert "cp.async.bulk.prefetch.L2.global" in prefetch_only and "griddepcontrol" not in prefetch_only
    pdl_only = compile_block_gemm(split_k, pdl=True).asm["ptx"]  # the wait before any load, no prefetch
    assert "cp.async.bulk.prefetch" not in pdl_only
    assert "ld.global" not in pdl_only[:pdl_only.index("griddepcontrol.wait")]


def test_split_kv_attention_reads_its_cache_pipelined_and_vectorized_for_sm90():
    """The decode-attention kernel as a served call specializes it (scripts/kernel_asm.py): the K/V tiles and page
    slots are asynchronous copies issued ahead of the tile being computed (Triton's software pipeline), never byte
    loads from global memory; its loop is about a thousand SASS instructions per thread per 128-token tile
    (docs/RESULTS.md 28f reads it). A change that loses the pipelining or the vector loads fails here, before any GPU
    run."""
    import kernel_asm

    asm = kernel_asm.compile_split_kernel()
    rep = kernel_asm.report(asm, warps=4, block_n=128)
    assert rep["async_copies_in_ttgir"] >= 3  # page slots, K and V (prologue and loop)
    assert "cp.async.cg.shared.global" in asm["ptx"]  # 16-byte asynchronous copies of the cache
    assert rep["byte_global_loads"] == 0
    assert 100 < rep["loop_instructions_per_thread"] < 5000
    ops = dict(rep["top_opcodes"])
    assert "HMMA.16816.F32" in ops  # FP16 MMAs (mma.sync) on K and V widened in registers


def test_split_kv_attention_as_a_dependent_launch_waits_first_and_lets_the_merge_launch_after_its_stores():
    """fp8_decode_attention's PDL form: griddepcontrol.wait before any read of the plan, the query or the cache, and
    launch_dependents only after the partial results are stored (the merge must not take this grid's SM slots)."""
    import kernel_asm

    plain = kernel_asm.compile_split_kernel()["ptx"]
    ptx = kernel_asm.compile_split_kernel(pdl=True)["ptx"]
    assert "griddepcontrol" not in plain
    wait, trigger = ptx.index("griddepcontrol.wait"), ptx.rindex("griddepcontrol.launch_dependents")
    assert "ld.global" not in ptx[:wait] and "cp.async" not in ptx[:wait]
    assert ptx.rindex("st.global") < trigger


def test_one_sequence_planned_in_the_kernel_compiles_and_waits_before_it_reads():
    """single_plan: the batch-1 split kernel computes its splits from the length it loads, after griddepcontrol.wait,
    with the served form's pipelined, vectorized loop."""
    import kernel_asm

    asm = kernel_asm.compile_split_kernel(single=True, pdl=True)
    ptx = asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" not in ptx[:wait] and "cp.async" not in ptx[:wait]
    rep = kernel_asm.report(asm, warps=4, block_n=128)
    assert rep["byte_global_loads"] == 0 and "cp.async.cg.shared.global" in ptx


def test_the_split_kernel_merging_its_own_results_releases_them_before_it_counts_and_reads_them_from_l2():
    """fused_merge: the partial results stored, a barrier of the whole program, then one thread's acquire-release
    count at GPU scope; the last split reads every split's partial results from L2 (``.cg``: other programs wrote
    them), and lets the next kernel launch only after the merged output is stored."""
    import kernel_asm

    ptx = kernel_asm.compile_split_kernel(fused_merge=True, pdl=True)["ptx"]
    atom = ptx.index("atom.global.gpu.acq_rel.add")
    assert ptx.count("atom.global") == 1 and "atom" not in kernel_asm.compile_split_kernel()["ptx"]
    last_partial = ptx.rindex("st.global", 0, atom)
    assert "bar.sync" in ptx[last_partial:atom]
    assert ptx.index("ld.global.cg") > atom and "ld.global.cg" not in ptx[:atom]
    assert ptx.rindex("st.global") < ptx.rindex("griddepcontrol.launch_dependents")


def test_v_widened_on_its_tile_takes_no_byte_loads_and_fewer_instructions():
    """fp8_decode_attention's V_WIDEN_TILE form: V widened on its loaded tile (an opaque cvt.rn.f16x2.e4m3x2), so the
    MMA reads FP16 from shared memory and the loop has no LDS.U8 and about a third fewer instructions than the default
    (1,105 -> 734 with Triton 3.7.1), for more shared memory."""
    import kernel_asm

    default = kernel_asm.report(kernel_asm.compile_split_kernel(), warps=4, block_n=128)
    tile_asm = kernel_asm.compile_split_kernel(v_widen_tile=True)
    tile = kernel_asm.report(tile_asm, warps=4, block_n=128)
    assert "cvt.rn.f16x2.e4m3x2" in tile_asm["ptx"]

    def byte_loads(asm):
        return sum(kernel_asm.opcode(x) == "LDS.U8" for x in kernel_asm.loop_body(kernel_asm.sass_of(asm["cubin"])))

    assert byte_loads(kernel_asm.compile_split_kernel()) > 0 and byte_loads(tile_asm) == 0
    assert tile["loop_instructions_per_thread"] < 0.8 * default["loop_instructions_per_thread"]
    assert tile["byte_global_loads"] == 0 and "HMMA.16816.F32" in dict(tile["top_opcodes"])
    assert tile_asm["shared"] <= 100 * 1024  # two programs a SM still fit (RESIDENT_PER_SM)


def test_kernel_asm_finds_the_loop_of_a_listing():
    import kernel_asm

    sass = "\n".join(["Function:k", "--:-:1:-:1\tLDC R1, c[0x0][0x28];", "LBB0:", "--:-:-:-:1\tIADD3 R1, R1, 1, RZ;",
                      "--:-:2:-:1\t@P1 LDS.U8 R2, [R3];", "LBB1:", "02:-:-:-:1\tF2FP.F16.E4M3.UNPACK_B R4, R2;",
                      "--:-:-:-:5\t@!P0 BRA LBB1;", "--:-:-:-:5\t@!P2 BRA LBB0;", "--:-:-:-:5\tEXIT;"])
    body = kernel_asm.loop_body(sass)  # the longer of the two loops, the inner one nested in it
    assert [kernel_asm.opcode(x) for x in body] == ["IADD3", "LDS.U8", "F2FP.F16.E4M3.UNPACK_B", "BRA", "BRA"]


@pytest.mark.parametrize("pdl", [False, True])
def test_own_activation_quantizer_compiles_for_sm90_and_waits_before_it_reads(pdl):
    """quantize_activation's kernel: correctly rounded divisions, RNE E4M3 codes; as a dependent launch,
    griddepcontrol.wait then launch_dependents before the activation is read, and a kernel marked for it."""
    from sglang_fp8rl.kernels import block_gemm

    constexprs = {"GROUP": 128, "GROUPS": block_gemm.ACT_QUANT_GROUPS, "FP8_MAX": FP8_MAX,
                  "AMAX_FLOOR_BITS": block_gemm._AMAX_FLOOR_BITS, "PDL": pdl}
    pointers = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    ints = dict.fromkeys(["K_GROUPS", "stride_xm", "stride_qm", "stride_sm"], "i32")
    signature = {**pointers, **ints, **dict.fromkeys(constexprs, "constexpr")}
    compiled = triton.compile(ASTSource(fn=block_gemm._quantize_activation_kernel, signature=signature,
                                        constexprs=constexprs), target=HOPPER,
                              options={"num_warps": 4, "launch_pdl": pdl})
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2" in ptx and "div.rn.f32" in ptx
    assert compiled.metadata.launch_pdl == pdl
    if pdl:
        wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        assert wait < trigger < ptx.index("ld.global")
    else:
        assert "griddepcontrol" not in ptx


def test_the_fused_norm_compiles_for_sm90_at_its_served_warps_and_the_wider_form_of_the_benchmark():
    """scripts/kernel_asm.py --kernel norm: the fused add-RMSNorm-quantize kernel of a 4096-wide row compiles at the
    warps norm_warps serves and at the benchmark's 16 (docs/RESULTS.md 39: a thread of the wider form issues fewer
    instructions, yet the call is slower); each count is that compile's SASS, so a change that breaks either fails."""
    import kernel_asm
    from bench_norm_quant import WIDE_WARPS

    from sglang_fp8rl.kernels.norm_quant import GROUP_K, NORM_WARPS, WIDE_NORM_GROUPS, WIDE_NORM_WARPS, norm_warps

    assert norm_warps(4096 // GROUP_K) == NORM_WARPS and norm_warps(WIDE_NORM_GROUPS + 1) == WIDE_NORM_WARPS

    def per_thread(warps: int) -> int:
        return len(kernel_asm.instructions(kernel_asm.sass_of(kernel_asm.compile_norm_kernel(4096, warps)["cubin"])))

    served, wide = per_thread(NORM_WARPS), per_thread(WIDE_WARPS)
    assert 0 < wide < served
