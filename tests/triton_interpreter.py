"""Run a snippet with TRITON_INTERPRET=1 in a fresh interpreter (Triton picks the interpreter at import time)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_under_interpreter(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a subprocess under the Triton interpreter, with this checkout first on the path."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def check_under_interpreter(code: str, marker: str, timeout: int = 300) -> None:
    """Run ``code`` under the interpreter; fail with its output unless it exits 0 having printed ``marker``."""
    result = run_under_interpreter(code, timeout)
    assert result.returncode == 0 and marker in result.stdout, result.stdout + result.stderr


# The start of every quantizer check run under the interpreter: its FMA made exact (the kernels rely on a fused
# multiply-add; the interpreter rounds twice), a random seed, and BF16-exact weights with their reference quotients.
QUANTIZER_PREAMBLE = textwrap.dedent(
    """
    import numpy as np
    import torch
    from triton.runtime import interpreter

    from sglang_fp8rl import quant

    def fused_multiply_add(self, x, y, z):
        # the interpreter's fma rounds twice (x * y + z in float32); the kernel relies on a real FMA. In extended
        # precision the first residual is exact and the second sum double-rounds with negligible probability.
        exact = x.data.astype(np.longdouble) * y.data.astype(np.longdouble) + z.data.astype(np.longdouble)
        return interpreter.TensorHandle(exact.astype(z.data.dtype), z.dtype.scalar)

    interpreter.InterpreterBuilder.create_fma = fused_multiply_add

    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))

    def weight(n, k, dtype):
        # exact in BF16: the interpreter's FP32 -> BF16 cast truncates instead of rounding
        w = torch.randn(n, k) * torch.exp(torch.randn(n, 1).clamp(-2, 2) * 3)  # finite in FP16 too
        return w.to(torch.bfloat16).to(dtype)

    def quotient(w, s_expanded):
        return (quant.round_to_bf16(w).float() / s_expanded).clamp(-quant.FP8_MAX, quant.FP8_MAX)
    """
)


# The GPU's float32 -> E4M3 cast (cvt.rn.satfinite, round to nearest even, as torch's) for the interpreter, whose own
# cast rounds half up and never carries into the exponent (124.9 -> 64, not 128). Follows QUANTIZER_PREAMBLE.
E4M3_RNE_PREAMBLE = textwrap.dedent(
    """
    _fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar.name == "fp32" and dst_type.scalar.name == "fp8e4nv":
            codes = torch.from_numpy(src.data.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(codes, dst_type.scalar)
        return _fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.create_fp_to_fp = fp_to_fp
    """
)

# The GPU's float32 -> BF16 cast (cvt.rn.bf16, round to nearest even, as torch's) for the interpreter, whose own
# cast truncates. Follows QUANTIZER_PREAMBLE.
BF16_RNE_PREAMBLE = textwrap.dedent(
    """
    _fp_trunc = interpreter.InterpreterBuilder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if src.dtype.scalar.name == "fp32" and dst_type.scalar.name == "bf16":
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
        return _fp_trunc(self, src, dst_type)

    interpreter.InterpreterBuilder.create_fp_trunc = fp_trunc
    """
)
