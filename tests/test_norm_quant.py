"""CPU checks of the producer kernels that also quantize their output (sglang_fp8rl.kernels.norm_quant).

Under the Triton interpreter: the codes and multipliers are quant.quantize_activation_groups' of the kernel's own BF16
output, bit for bit, in both scale layouts; that output is within one BF16 step of a float64 reference (its float32
arithmetic rounds once more before the BF16 rounding); the residual is left as torch's BF16 sum, bit for bit (the
interpreter's float32 -> BF16 and E4M3 casts are made the GPU's round-to-nearest-even ones). On sm90: the kernels
compile with correctly rounded divisions and RNE E4M3 codes. Bad operands are refused naming the operand. The GPU
comparison with SGLang's own norm and SiLU kernels: tests/gpu/test_norm_quant_gpu.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import BF16_RNE_PREAMBLE, E4M3_RNE_PREAMBLE, QUANTIZER_PREAMBLE, check_under_interpreter

from sglang_fp8rl.quant import FP8_MAX

NORM_QUANT_CHECK = QUANTIZER_PREAMBLE + E4M3_RNE_PREAMBLE + BF16_RNE_PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels import norm_quant as nq

    def within_one_bf16_step(out, ref):
        # |out - ref| <= the BF16 spacing at ref (2**-133 below the normal range): out is a BF16 neighbour of ref
        spacing = torch.ldexp(torch.ones_like(ref), (torch.frexp(ref)[1] - 8).clamp(min=-133))
        return bool(((out.double() - ref).abs() <= spacing).all())

    def check_codes(out, q, s):
        ref_q, ref_s = quant.quantize_activation_groups(out, 128)
        assert torch.equal(s, ref_s) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))

    eps = 1e-6
    for m, k in [(1, 4096), (3, 640), (5, 128), (2, 8192)]:
        x, r = weight(m, k, torch.bfloat16), weight(m, k, torch.bfloat16)
        w = (1 + 0.1 * torch.randn(k)).to(torch.bfloat16)
        for layout in nq.SCALE_LAYOUTS:
            residual = r.clone()
            out, q, s = nq.add_rmsnorm_quant(x, w, eps, residual, scale_layout=layout)
            assert torch.equal(residual, (x.float() + r.float()).to(torch.bfloat16)), (m, k, layout)
            total = x.double() + r.double()
            ref = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * w.double()
            assert within_one_bf16_step(out, ref), (m, k, layout, (out.double() - ref).abs().max())
            if layout == "tma":
                assert s.stride() == (1, (m + 3) // 4 * 4), s.stride()
            check_codes(out, q, s.contiguous())
        out, q, s = nq.add_rmsnorm_quant(x, w, eps)  # no residual: x alone, x unchanged
        ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * w.double()
        assert within_one_bf16_step(out, ref), (m, k, "no residual")
        check_codes(out, q, s)

    for m, k in [(1, 1536), (4, 384), (2, 128)]:
        # gates of |g| < ~25: beyond ~88, exp(-g) overflows float32 (as in SGLang's CUDA kernel) and silu(g) is 0
        # where the float64 reference still has a value near the BF16 underflow (checked on its own below)
        gate_up = (torch.randn(m, 2 * k) * 5).to(torch.bfloat16)
        gate_up[0, :128] = 0.0  # an all-zero group: the amax floor
        for layout in nq.SCALE_LAYOUTS:
            out, q, s = nq.silu_mul_quant(gate_up, scale_layout=layout)
            g, u = gate_up[:, :k].double(), gate_up[:, k:].double()
            ref = g * torch.sigmoid(g) * u
            assert within_one_bf16_step(out, ref), (m, k, layout, (out.double() - ref).abs().max())
            check_codes(out, q, s.contiguous())
    assert nq.silu_mul_quant(gate_up[:0])[0].shape == (0, k)
    extreme = torch.tensor([[-100.0] * 128 + [100.0] * 128 + [3.0] * 128 + [-2.0] * 128]).to(torch.bfloat16)
    out = nq.silu_mul_quant(extreme)[0]
    assert torch.equal(out, torch.tensor([[0.0] * 128 + [-200.0] * 128]).to(torch.bfloat16)), out
    print("norm_quant interpreter ok")
    """
)


def test_producers_quantize_their_own_output_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    check_under_interpreter(NORM_QUANT_CHECK, "norm_quant interpreter ok")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda nq: nq.add_rmsnorm_quant(torch.zeros(2, 200, dtype=torch.bfloat16),
                                         torch.ones(200, dtype=torch.bfloat16), 1e-6), "x must be"),
        (lambda nq: nq.add_rmsnorm_quant(torch.zeros(2, 256), torch.ones(256, dtype=torch.bfloat16), 1e-6),
         "x must be a 2-D BF16"),
        (lambda nq: nq.add_rmsnorm_quant(torch.zeros(2, 256, dtype=torch.bfloat16),
                                         torch.ones(128, dtype=torch.bfloat16), 1e-6), "weight must be"),
        (lambda nq: nq.add_rmsnorm_quant(torch.zeros(2, 256, dtype=torch.bfloat16),
                                         torch.ones(256, dtype=torch.bfloat16), 1e-6,
                                         torch.zeros(3, 256, dtype=torch.bfloat16)), "residual has 3 rows"),
        (lambda nq: nq.add_rmsnorm_quant(torch.zeros(1, 16384, dtype=torch.bfloat16),
                                         torch.ones(16384, dtype=torch.bfloat16), 1e-6), "rows wider than 8192"),
        (lambda nq: nq.silu_mul_quant(torch.zeros(2, 384, dtype=torch.bfloat16)), "halves must be a multiple"),
        (lambda nq: nq.silu_mul_quant(torch.zeros(2, 256, dtype=torch.bfloat16), scale_layout="col"),
         "scale_layout must be one of"),
    ],
)
def test_bad_operands_are_refused_naming_the_operand(call, message) -> None:
    nq = pytest.importorskip("sglang_fp8rl.kernels.norm_quant")
    with pytest.raises(ValueError, match=message):
        call(nq)


def _compile_for_sm90(kernel: str, pdl: bool) -> str:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_fp8rl.kernels import norm_quant as nq

    if kernel == "_add_rmsnorm_quant_kernel":  # a 4096-wide row, as scripts/kernel_asm.py --kernel norm builds it
        import kernel_asm

        return kernel_asm.compile_norm_kernel(4096, 4, pdl)["ptx"]
    constexprs = {"GROUP": 128, "FP8_MAX": FP8_MAX, "AMAX_FLOOR_BITS": nq._AMAX_FLOOR_BITS, "PDL": pdl,
                  "GROUPS": nq.ACT_QUANT_GROUPS}
    pointers = dict(gu_ptr="*bf16", out_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32")
    scalars = dict.fromkeys(["k_groups", "half", "stride_gm", "stride_om", "stride_qm", "stride_sm", "stride_sg"],
                            "i32")
    signature = {**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")}
    compiled = triton.compile(ASTSource(fn=getattr(nq, kernel), signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return compiled.asm["ptx"]


@pytest.mark.parametrize("kernel", ["_add_rmsnorm_quant_kernel", "_silu_mul_quant_kernel"])
def test_producer_kernels_compile_for_sm90_with_rne_codes_and_correct_divisions(kernel) -> None:
    ptx = _compile_for_sm90(kernel, pdl=False)
    assert "cvt.rn.satfinite.e4m3x2" in ptx and "div.rn.f32" in ptx
    assert "cvt.rn.bf16" in ptx  # the BF16 output rounds to nearest even, as torch and SGLang's kernels do
    assert "griddepcontrol" not in ptx


@pytest.mark.parametrize("kernel,share_read_before_wait", [("_add_rmsnorm_quant_kernel", 1 / 3),
                                                            ("_silu_mul_quant_kernel", 0)])
def test_dependent_launch_forms_wait_before_reading_the_kernel_befores_output(kernel, share_read_before_wait) -> None:
    """PDL: griddepcontrol.wait, then launch_dependents, before any load but the norm's weight vector (a parameter
    no kernel of the step writes: one of its three row-shaped operands, w / x / residual), and before every store."""
    ptx = _compile_for_sm90(kernel, pdl=True)
    wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert wait < trigger
    before, total = ptx[:wait].count("ld.global"), ptx.count("ld.global")
    assert total > 0 and before == share_read_before_wait * total
    assert "st.global" not in ptx[:wait]


def test_the_benchmarks_cpu_parts_measure_steps_and_codes() -> None:
    """scripts/bench_norm_quant.py: arguments, the BF16-step distance, the check of codes, the table."""
    import bench_norm_quant as bench

    from sglang_fp8rl.quant import quantize_activation_groups

    args = bench.parse_args(["--ms", "1,8", "--json", "x.json"])
    assert (args.ms, args.hidden, args.intermediate, args.json) == ("1,8", 4096, 12288, "x.json")
    a = torch.tensor([1.0, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    b = a.view(torch.int16).clone()
    b[0] += 1  # one step up from 1.0
    b[1] += 2  # two steps away from zero from -1.0
    assert bench.bf16_steps(a, b.view(torch.bfloat16)) == 2
    assert bench.bf16_steps(torch.tensor([0.0], dtype=torch.bfloat16), torch.tensor([-0.0], dtype=torch.bfloat16)) == 0
    out = torch.randn(3, 256).to(torch.bfloat16)
    q, s = quantize_activation_groups(out, 128)
    checks = bench.compare((out, q, s), (out.clone(),))
    assert checks == {"out_equal_share": 1.0, "out_max_steps": 0, "codes_are_own_quantization": True}
    assert not bench.compare((out, q, s * 2), (out,))["codes_are_own_quantization"]
    table = bench.markdown({"device": "cpu", "rows": [{"M": 1, "us": {"norm": 2.0, "norm_quant fused": 2.5},
                                                       "step_saving_ms": 0.1}]})
    assert "| 1 | 2.00 | 2.50 | 0.100 |" in table
