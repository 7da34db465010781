"""Host time per tensor of the FP8 engine's by-tensor weight update, measured on CPU through SGLang's real ModelRunner.

A tiny Qwen3-MoE with many experts (thousands of small tensors, like Qwen3-30B-A3B's 18,867) is served with
``--quantization fp8_online_blockwise`` in this process; ``push_state_dict(..., atomic=False)`` pushes it bucket by
bucket into SGLang's WeightUpdater, and the engine's own telemetry (``last_update``: validate_s, apply_s) is read
after every request. With tensors this small the engine's time is its host (Python) overhead, which is what a GPU
engine pays per tensor on top of its bandwidth. ``--flatten`` pushes flattened buckets (``flatten=True``: serialized
per rank as sglang.Engine takes them, decoded as a TP worker decodes them) instead of (name, tensor) lists.
``--profile`` adds one push under cProfile and prints its top functions by cumulative and by own time.

  python scripts/profile_update_host.py                                  # 8 layers x 128 experts, 5 MiB buckets
  python scripts/profile_update_host.py --profile --top 30
  python scripts/profile_update_host.py --flatten --digest                  # flattened buckets (the same bits)
  python scripts/profile_update_host.py --layers 1 --experts 8 --pushes 1   # a quick check (tests/ runs this)

The first ``--warmup`` pushes fill the engine's dry-run cache (one per request signature, as a trainer's first
step does); the measured pushes are the steady state. ``--digest`` prints a hash of every parameter's bytes after
the pushes (to compare two versions of the engine bit for bit).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import _paths  # noqa: F401  (this checkout's sglang_fp8rl first on sys.path)

QUANT = ("--quantization", "fp8_online_blockwise")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers, every one sparse (default 8)")
    p.add_argument("--experts", type=int, default=128, help="experts per layer (default 128)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 128 (default 128)")
    p.add_argument("--moe-intermediate", type=int, default=128,
                   help="expert intermediate size; a multiple of 128 keeps experts blockwise (default 128)")
    p.add_argument("--bucket-mb", type=float, default=5.0,
                   help="bucket size in MiB (default 5: ~160 expert tensors a bucket, as 512 MB buckets of 30B-A3B)")
    p.add_argument("--flatten", action="store_true", help="push flattened buckets (push_state_dict(flatten=True))")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured pushes first (fill the dry-run cache)")
    p.add_argument("--pushes", type=int, default=3, help="measured pushes (default 3)")
    p.add_argument("--profile", action="store_true", help="one more push under cProfile; print its top functions")
    p.add_argument("--profile-out", help="with --profile: also dump the raw cProfile stats here (pstats, snakeviz)")
    p.add_argument("--top", type=int, default=25, help="functions listed per profile ordering (default 25)")
    p.add_argument("--digest", action="store_true", help="print a SHA-256 of every parameter's bytes at the end")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--keep", help="write the checkpoint here and keep it (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("layers", "experts", "pushes", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.bucket_mb <= 0:
        p.error("--warmup must be >= 0 and --bucket-mb positive")
    if args.hidden % 128:
        p.error("--hidden must be a multiple of 128 (one head of 128)")
    return args


def dims_of(args: argparse.Namespace) -> dict:
    """The Qwen3-MoE dimensions of the command line (one attention head of 128, one KV head)."""
    return dict(vocab_size=320, hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128, num_key_value_heads=1,
                head_dim=128, num_experts=args.experts, num_experts_per_tok=2)


def moe_state_dict(dims: dict, seed: int) -> dict:
    """HF-named BF16 weights of a Qwen3-MoE: the dense parts of a Qwen3, a router and per-expert gate/up/down."""
    import torch

    from sglang_fp8rl.demo_common import random_state_dict

    sd = {k: v for k, v in random_state_dict(dict(dims, intermediate_size=dims["moe_intermediate_size"]), seed).items()
          if ".mlp." not in k}
    g = torch.Generator().manual_seed(seed + 1000)
    h, i = dims["hidden_size"], dims["moe_intermediate_size"]
    for layer in range(dims["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp."
        sd[p + "gate.weight"] = (torch.randn(dims["num_experts"], h, generator=g) * 0.5).to(torch.bfloat16)
        for e in range(dims["num_experts"]):
            for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                sd[p + f"experts.{e}.{proj}.weight"] = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    return sd


def write_moe_checkpoint(out: str, dims: dict, sd: dict) -> None:
    """config.json (Qwen3MoeForCausalLM), model.safetensors and a tokenizer."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    from sglang_fp8rl.demo_common import write_tokenizer

    config = Qwen3MoeConfig(max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16",
                            intermediate_size=dims["moe_intermediate_size"], decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True, **dims)
    config.architectures = ["Qwen3MoeForCausalLM"]
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    save_file(dict(sd), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, dims["vocab_size"])


class TelemetryEngine:
    """The ``sglang.Engine`` update method our client calls, straight into SGLang's WeightUpdater; it keeps the
    engine's ``last_update`` stats of every request. One TP rank: a flattened bucket arrives serialized per rank and
    is decoded here as SGLang's TP worker decodes it (its time counts in the push's wall time, as on an engine)."""

    server_args = SimpleNamespace(tp_size=1)

    def __init__(self, updater: Any) -> None:
        self.updater = updater
        self.stats: list[dict] = []

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """One request; its answer, after noting its stats."""
        from sglang_fp8rl.compat.updates import decode_own_rank
        from sglang_fp8rl.weight_sync.protocol import FLATTENED_BUCKET
        from sglang_fp8rl.weight_sync.telemetry import last_update_stats

        request = decode_own_rank(named_tensors, 0) if load_format == FLATTENED_BUCKET else list(named_tensors)
        answer = self.updater.update_weights_from_tensor(request, load_format=load_format)
        self.stats.append(last_update_stats() or {})
        return answer


def push_once(engine: TelemetryEngine, sd: dict, bucket_bytes: int, flatten: bool = False) -> dict:
    """One by-tensor push of ``sd``; its wall time and the engine's summed telemetry."""
    from sglang_fp8rl.weight_sync.client import push_state_dict

    engine.stats.clear()
    t0 = time.perf_counter()
    push_state_dict(engine, sd, bucket_bytes=bucket_bytes, atomic=False, flatten=flatten)
    wall = time.perf_counter() - t0
    stats = list(engine.stats)
    return {"wall_s": wall, "buckets": len(stats), "tensors": sum(s.get("tensors", 0) for s in stats),
            "validate_s": sum(s.get("validate_s", 0.0) for s in stats),
            "apply_s": sum(s.get("apply_s", 0.0) for s in stats)}


def per_tensor_us(push: dict) -> dict:
    """Microseconds per tensor of validate, apply and the push's wall time."""
    n = max(push["tensors"], 1)
    return {key: push[key + "_s"] * 1e6 / n for key in ("validate", "apply", "wall")}


def profile_text(profiler: cProfile.Profile, top: int) -> str:
    """The profile's top functions by cumulative and by own time."""
    out = io.StringIO()
    for order in ("cumulative", "tottime"):
        out.write(f"\n--- top {top} by {order} ---\n")
        pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(order).print_stats(top)
    return out.getvalue()


def params_digest(model: Any) -> str:
    """SHA-256 over every parameter's name and bytes (FP8 codes as bytes)."""
    import torch

    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(name.encode())
        h.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def measure(args: argparse.Namespace, work: str) -> dict:
    """Write the checkpoint, serve it, push it; the per-push results (and the profile's text)."""
    from sglang_fp8rl.cpu_runner import build_runner, install_cpu_stubs

    install_cpu_stubs()  # before transformers and SGLang import torchvision's stand-in
    import torch

    dims = dims_of(args)
    w0 = moe_state_dict(dims, args.seed)
    write_moe_checkpoint(work, dims, w0)
    w1 = moe_state_dict(dims, args.seed + 1)

    from sglang_fp8rl.compat.updates import updater_of

    t0 = time.perf_counter()
    runner = build_runner(work, QUANT)
    load_s = time.perf_counter() - t0
    engine = TelemetryEngine(updater_of(runner.torch_runner))
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    payloads = [w1, w0]  # alternate, so that every push changes every weight
    result: dict = {"dims": dims, "bucket_bytes": bucket_bytes, "flatten": args.flatten, "load_s": load_s,
                    "warmup": [], "pushes": []}
    with torch.no_grad():
        for i in range(args.warmup):
            result["warmup"].append(push_once(engine, payloads[i % 2], bucket_bytes, args.flatten))
        for i in range(args.pushes):
            result["pushes"].append(push_once(engine, payloads[(args.warmup + i) % 2], bucket_bytes, args.flatten))
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            result["profiled"] = push_once(engine, payloads[(args.warmup + args.pushes) % 2], bucket_bytes,
                                           args.flatten)
            profiler.disable()
            result["profile"] = profile_text(profiler, args.top)
            if args.profile_out:
                profiler.dump_stats(args.profile_out)
        if args.digest:
            result["digest"] = params_digest(runner.torch_runner.model)
    return result


def report(result: dict) -> str:
    """The results as text."""
    kind = "flattened buckets" if result.get("flatten") else "buckets"
    lines = [f"config: {json.dumps(result['dims'])}, {kind} of {result['bucket_bytes'] / 2**20:.2f} MiB; "
             f"model load {result['load_s']:.1f} s"]
    for label in ("warmup", "pushes"):
        for i, push in enumerate(result[label]):
            us = per_tensor_us(push)
            lines.append(f"{'push' if label == 'pushes' else label} {i}: {push['tensors']} tensors in "
                         f"{push['buckets']} requests; wall {push['wall_s']:.3f} s, validate {push['validate_s']:.3f} s"
                         f", apply {push['apply_s']:.3f} s; per tensor: validate {us['validate']:.1f} us, apply "
                         f"{us['apply']:.1f} us, wall {us['wall']:.1f} us")
    pushes = result["pushes"]
    best = {key: min(per_tensor_us(p)[key] for p in pushes) for key in ("validate", "apply", "wall")}
    lines.append(f"best of {len(pushes)} (us per tensor): validate {best['validate']:.1f}, apply {best['apply']:.1f}, "
                 f"push wall {best['wall']:.1f}")
    if "digest" in result:
        lines.append(f"params digest: {result['digest']}")
    if "profile" in result:
        lines.append(f"profiled push: {json.dumps(result['profiled'])}" + result["profile"])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the measurement and print it."""
    args = parse_args(argv)
    if args.keep:
        result = measure(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="fp8rl_update_host_") as work:
            result = measure(args, work)
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in result.items() if k != "profile"}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
