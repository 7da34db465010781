"""The per-config subprocess of scripts/bench_rollout.py (``bench_rollout.py _child FLAGS``): SGLang's bench_one_batch
with the plugin loaded, GEMM calls counted, and a hook after dummy init that reports (and, with FP8RL_BENCH_REFILL=1,
refills) the FP8 dummy weights."""

from __future__ import annotations

import collections
import os
import sys

import kv_measure as KV  # scripts/kv_measure.py: whether the plugin has --fp8rl-kv-scales


def _clog(*a):
    print("[bench_rollout]", *a, flush=True)


def _after_dummy_init(model):
    import torch

    methods = collections.Counter()
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        key = f"{type(m).__name__}:{type(qm).__name__}"
        if getattr(qm, "block_quant", False):
            f = getattr(qm, "w8a8_block_fp8_linear", None)
            key += f" block={getattr(qm, 'weight_block_size', None)} fn={getattr(f, '__name__', f)}"
        methods[key] += 1
    _clog("quant methods:", dict(methods))
    fp8 = [(n, p) for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    scales = [(n, p) for n, p in model.named_parameters() if n.endswith("weight_scale_inv")]
    if not fp8:
        _clog("no fp8 parameters at dummy init")
        return

    def nonzero(p):
        return (p.data.view(torch.uint8) & 0x7F).ne(0).float().mean().item()

    n0, p0 = fp8[0]
    _clog(f"{len(fp8)} fp8 params, {len(scales)} weight_scale_inv at dummy init; {n0} {tuple(p0.shape)} "
          f"nonzero fraction {nonzero(p0):.4f}")
    if os.environ.get("FP8RL_BENCH_REFILL", "0") != "1":
        _clog("FP8 dummy weights left as they are (FP8RL_BENCH_REFILL != 1)")
        return
    g = torch.Generator(device=p0.device)
    for i, (_, p) in enumerate(fp8):
        g.manual_seed(1234 + i)
        tmp = torch.empty(p.shape, dtype=torch.float16, device=p.device).uniform_(-2.0, 2.0, generator=g)
        p.data.copy_(tmp.to(p.dtype))
        del tmp
    for _, p in scales:
        p.data.fill_(5e-4)
    torch.cuda.synchronize()
    _clog(f"refilled fp8 weights with U(-2,2) in e4m3 (nonzero fraction {nonzero(p0):.4f}), weight_scale_inv := 5e-4")


def _check_kv_scales_option(argv: list[str]) -> None:
    """With an FP8 KV cache: say once whether the plugin calibrates K/V scales; stop a config that needs the option."""
    if "--kv-cache-dtype" not in argv:
        return
    try:
        supported = KV.kv_scales_supported()
    except ImportError as e:
        _clog(f"cannot read the plugin's options: {e!r}")
        supported = False
    if supported:
        return
    if KV.KV_SCALES_FLAG in argv:
        _clog(f"ERROR {KV.KV_OPTION_MISSING}; this config passes {KV.KV_SCALES_FLAG} and cannot run")
        sys.exit(3)
    _clog(f"WARNING {KV.KV_OPTION_MISSING}: the FP8 KV cache runs with SGLang's static scale 1.0")


def child_main(argv: list[str]) -> None:
    # bench_one_batch never calls load_plugins(); without it `--quantization fp8_online_blockwise` is not an
    # argparse choice and the plugin's layers are not registered.
    from sglang.srt.plugins import load_plugins

    load_plugins()
    _check_kv_scales_option(argv)
    import sglang.benchmark.one_batch as OB

    counts = collections.Counter()

    def counted(mod, name, label):
        fn = getattr(mod, name, None)
        if fn is None:
            return

        def wrapper(*a, **k):
            counts[label] += 1
            return fn(*a, **k)

        setattr(mod, name, wrapper)

    try:
        import sglang.srt.layers.quantization.fp8 as F8
        import sglang.srt.layers.quantization.fp8_utils as FU

        counted(FU, "w8a8_block_fp8_matmul_deepgemm", "deepgemm block")
        counted(FU, "w8a8_block_fp8_matmul_triton", "triton block")
        counted(FU, "fp8_scaled_mm", "cutlass fp8_scaled_mm")
        counted(FU, "triton_scaled_mm", "triton_scaled_mm")
        counted(F8, "apply_fp8_linear", "apply_fp8_linear (non-block)")
        counted(FU, "sglang_per_token_group_quant_fp8", "sglang_per_token_group_quant_fp8")
        counted(FU, "per_token_group_quant_fp8", "per_token_group_quant_fp8")
    except (ImportError, AttributeError) as e:  # bookkeeping must never break the bench
        _clog(f"GEMM call counting not installed: {e!r}")
    try:
        import sglang.srt.model_loader.loader as L

        orig = L.initialize_dummy_weights

        def init(model, *a, **k):
            orig(model, *a, **k)
            try:
                _after_dummy_init(model)
            except (RuntimeError, ValueError, AttributeError, TypeError) as e:
                _clog(f"after-dummy-init hook failed: {e!r}")

        L.initialize_dummy_weights = init
    except (ImportError, AttributeError) as e:
        _clog(f"dummy-init hook not installed: {e!r}")

    sys.argv = ["sglang.benchmark.one_batch"] + list(argv)
    try:
        OB.cli_main()
    finally:
        _clog("gemm calls (eager + CUDA-graph capture; replays run no Python):", dict(counts) if counts else "none")
