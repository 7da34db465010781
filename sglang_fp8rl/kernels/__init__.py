"""Fast FP8 quantizers: a Triton kernel on CUDA, the torch reference (sglang_fp8rl.quant) elsewhere.

Import from :mod:`sglang_fp8rl.kernels.dispatch`; importing this package never imports Triton.
"""
