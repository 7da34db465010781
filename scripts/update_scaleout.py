"""Scale-out part of scripts/bench_update.py: the engine at TP N, where the payload lives, the NCCL broadcast path,
the KV recalibration each update triggers, and issue 36's targets. The plan and the targets need no GPU
(``bench_update.py --dry-run``; tests/test_scale_out_scripts.py).

Placement (a plan, printed by --dry-run): the engine takes GPUs 0..tp-1. The trainer of the broadcast path is one
process of its own on a GPU outside them (``--trainer-gpu``, default the first free one): NCCL refuses two ranks of
one communicator on one GPU, so at TP 4 on a four-GPU machine there is no broadcast path (it needs a fifth GPU). The
BF16 payload lives on the trainer's GPU when the broadcast path runs (its broadcasts go from there), else spread over
the free GPUs, else over all of them (30B-A3B: 61 GB of BF16 does not fit next to an engine rank on one 80 GB card);
the pre-quantized payload on the free GPUs other than the trainer's where there are any.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any, Callable, Optional

import scale_out  # scripts/gpu (on sys.path through scripts/_paths.py)

# "flattened": by tensor with each bucket as one flattened buffer (push_state_dict(flatten=True))
PATHS = ("tensor", "flattened", "atomic", "validate_only", "prequant", "broadcast", "disk")
TARGET_S = 1.0  # issue 36: FP8 engine, one full update of Qwen3-30B-A3B shapes at TP 4, by broadcast and by tensor
TARGET_MODEL, TARGET_TP = "qwen3-30b-a3b", 4
TARGET_PATHS = ("tensor", "flattened", "broadcast")
GROUP_PORT = 29650  # the update group's rendezvous; +1 for the FP8 engine (a fresh port per group)
GB = 1e9
MOE_MODELS = ("qwen3-30b-a3b",)


def add_args(p: argparse.ArgumentParser) -> None:
    """The scale-out options of bench_update.py."""
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism of both engines (GPUs 0..N-1)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS,
                   help="update paths to measure (default: all; broadcast needs a GPU outside the engine's)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="passed to both engines (fp8_e4m3: the FP8 engine recalibrates its KV scales after every "
                        "complete step; the time is reported)")
    p.add_argument("--trainer-gpu", type=int, default=None,
                   help="GPU of the broadcasting trainer (default: the first one the engine does not use)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (GPUs, payload placement, launch flags, paths, targets) and exit; no GPU")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to plan for with --dry-run (default: --tp-size)")


@dataclasses.dataclass
class Plan:
    """Where everything of one run goes, and which paths run."""

    tp: int
    gpus: int
    trainer_gpu: Optional[int]
    payload_gpus: list[int]
    prequant_gpus: list[int]
    paths: list[str]
    skipped: dict[str, str]  # path -> why it does not run
    server_flags: list[str]

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


def make_plan(args: argparse.Namespace, gpus: int) -> Plan:
    """The run's plan on a machine with ``gpus`` GPUs; ValueError naming the option for a layout that cannot run."""
    tp = args.tp_size
    if tp < 1 or tp > gpus:
        raise ValueError(f"--tp-size {tp}: this machine has {gpus} GPU(s); pass --tp-size between 1 and {gpus}")
    free = list(range(tp, gpus))
    paths = [p for p in PATHS if p in args.paths and not (p == "disk" and args.skip_disk)]
    skipped = {p: "not in --paths" for p in PATHS if p not in args.paths}
    if args.skip_disk:
        skipped["disk"] = "--skip-disk"
    trainer = args.trainer_gpu if args.trainer_gpu is not None else (free[0] if free else None)
    if trainer is not None and not 0 <= trainer < gpus:
        raise ValueError(f"--trainer-gpu {trainer}: this machine has GPUs 0..{gpus - 1}")
    if trainer is not None and trainer < tp:
        raise ValueError(f"--trainer-gpu {trainer} is one of the engine's GPUs (0..{tp - 1}): NCCL refuses two ranks "
                         "of one communicator on one GPU; pick a GPU >= --tp-size")
    if "broadcast" in paths and trainer is None:
        paths.remove("broadcast")
        skipped["broadcast"] = (f"no GPU outside the engine's {tp} for the trainer (NCCL refuses two ranks of one "
                                f"communicator on one GPU); needs {tp + 1} GPUs, this machine has {gpus}")
    if "broadcast" in paths:
        payload = [trainer]
    else:
        payload = free or list(range(gpus))
    prequant = [g for g in free if g != trainer] or payload
    flags = (["--tp-size", str(tp)] if tp > 1 else []) + \
        (["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []) + \
        scale_out.start_flags(args.model in MOE_MODELS, tp)
    return Plan(tp, gpus, trainer if "broadcast" in paths else None, payload, prequant, paths, skipped, flags)


def spread(sizes: dict[str, int], devices: list[int]) -> dict[str, int]:
    """Each tensor to the device with the fewest bytes so far (in name order): a deterministic balanced placement."""
    load = {d: 0 for d in devices}
    out = {}
    for name, size in sizes.items():
        d = min(devices, key=lambda x: (load[x], x))
        out[name] = d
        load[d] += size
    return out


def bytes_per_gpu(shapes: dict[str, tuple[int, ...]], devices: list[int], element_size: int = 2) -> dict[int, int]:
    """Payload bytes each device holds under :func:`spread`."""
    sizes = {n: element_size * math.prod(s) for n, s in shapes.items()}
    out = {d: 0 for d in devices}
    for name, d in spread(sizes, devices).items():
        out[d] += sizes[name]
    return out


def make_payload(shapes: dict[str, tuple[int, ...]], plan: Plan, make_weights: Callable[..., dict],
                 seed: int) -> dict[str, Any]:
    """The BF16 payload (server_payloads.make_weights per device), in the order of ``shapes``."""
    where = spread({n: math.prod(s) for n, s in shapes.items()}, plan.payload_gpus)
    parts: dict[str, Any] = {}
    for d in plan.payload_gpus:
        mine = {n: s for n, s in shapes.items() if where[n] == d}
        if mine:
            parts.update(make_weights(mine, f"cuda:{d}", seed + d))
    return {n: parts[n] for n in shapes}


def prequant_payload(sd: dict[str, Any], plan: Plan, prequantize: Callable[..., dict]) -> dict[str, Any]:
    """The pre-quantized payload (server_payloads.prequantize) built tensor by tensor on the plan's prequant GPUs."""
    where = spread({n: t.numel() for n, t in sd.items()}, plan.prequant_gpus)
    out: dict[str, Any] = {}
    for name, tensor in sd.items():
        out.update(prequantize({name: tensor.to(f"cuda:{where[name]}")}, scale_format="pow2"))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the broadcast path and the KV recalibration


def kv_writes(info: dict) -> tuple[int, Optional[float]]:
    """(KV-scale writes so far, seconds of the last one) from a server's plugin telemetry."""
    kv = info.get("kv_scales") or {}
    return int(kv.get("writes") or 0), kv.get("seconds")


def kv_since(before: tuple[int, Optional[float]], info: dict) -> dict[str, Any]:
    """The KV recalibrations a path triggered: how many, and the seconds of the last one (kv_scales telemetry)."""
    writes, seconds = kv_writes(info)
    return {"writes": writes - before[0], "last_s": seconds if writes > before[0] else None}


def broadcast_path(bench: Any, eng: str, e: dict, url: str, sd: dict, phase_end: float,
                   info: Callable[[str], dict], sum_stats: Callable[[list], dict]) -> None:
    """The broadcast path of one engine: this process joins an update group as the trainer (rank 0, on the plan's
    trainer GPU) and pushes the whole payload with push_distributed; on the FP8 engine one extra push bucket by
    bucket gives the validate / write split. An error here is recorded and the engine's other paths still run."""
    plan = bench.plan
    if "broadcast" not in plan.paths:
        e["broadcast"] = {"status": f"skipped: {plan.skipped.get('broadcast', 'not planned')}"}
        return
    import torch

    from sglang_fp8rl.trainer import init_update_group, push_distributed
    from sglang_fp8rl.weight_sync.buckets import buckets

    name, bucket_bytes = f"fp8rl_bench_{eng}", bench.args.bucket_mb << 20
    torch.cuda.set_device(plan.trainer_gpu)
    group = None
    try:
        t = time.time()
        group = init_update_group(url, "127.0.0.1", GROUP_PORT + (eng == "fp8"), world_size=plan.tp + 1,
                                  group_name=name)
        e["broadcast_group_init_s"] = time.time() - t
        e["broadcast"] = bench.run_path(eng, "broadcast", lambda: push_distributed(
            url, sd, group, group_name=name, bucket_bytes=bucket_bytes), phase_end)
        if eng == "fp8" and time.time() + 2 * (e["broadcast"].get("mean_s") or 30) + 5 < phase_end:
            per, chunks = [], list(buckets(sd, bucket_bytes))
            for i, bucket in enumerate(chunks):
                push_distributed(url, bucket, group, group_name=name, bucket_bytes=1 << 62,
                                 complete=i == len(chunks) - 1)
                per.append(info(url).get("last_update") or {})
            e["broadcast"]["server_telemetry"] = sum_stats(per)
    except (OSError, RuntimeError, ValueError, TimeoutError) as ex:  # WeightPushError, NCCL and requests errors
        e["broadcast"] = dict(e.get("broadcast") or {}, status=f"error: {type(ex).__name__}: {ex}")
    finally:
        if group is not None:
            try:
                torch.distributed.destroy_process_group(group)
            except (RuntimeError, ValueError) as ex:  # the engine may already be gone; the next group has its port
                e["broadcast_group_teardown"] = str(ex)
        torch.cuda.set_device(0)


# ---------------------------------------------------------------------------------------------------------------------
# targets and breakdown


def _mean(res: dict, eng: str, path: str) -> Optional[float]:
    return (res.get("engines", {}).get(eng, {}).get(path) or {}).get("mean_s")


def scale_targets(res: dict) -> list[str]:
    """Issue 36's targets as PASS / FAIL / UNKNOWN lines, each path's engine-side breakdown, and the KV
    recalibration time of each path that triggered one."""
    plan = res.get("plan") or {}
    model, tp = res.get("model"), plan.get("tp")
    skipped = plan.get("skipped") or {}
    out = []
    for path in TARGET_PATHS:
        what = f"FP8 {path} <= {TARGET_S:.1f} s per full update ({TARGET_MODEL}, TP {TARGET_TP})"
        f = _mean(res, "fp8", path)
        if f is None:
            out.append(f"{what}: UNKNOWN ({skipped.get(path) or 'not measured'})")
        elif (model, tp) != (TARGET_MODEL, TARGET_TP):
            out.append(f"{what}: {f:.2f} s here ({model}, TP {tp}; the target is set at {TARGET_MODEL} TP "
                       f"{TARGET_TP})")
        else:
            out.append(f"{what}: {f:.2f} s -> {'PASS' if f <= TARGET_S else 'FAIL'}")
        b = _mean(res, "bf16", path)
        what = f"FP8 {path} no slower than BF16 {path} (same run)"
        out.append(f"{what}: UNKNOWN (not measured on both engines)" if f is None or b is None else
                   f"{what}: {f:.2f} s / {b:.2f} s = {f / b:.2f}x -> {'PASS' if f <= b else 'FAIL'}")
    for eng, paths in (res.get("engines") or {}).items():
        for path, rec in paths.items():
            if not isinstance(rec, dict):
                continue
            tele, mean = rec.get("server_telemetry") or {}, rec.get("mean_s")
            if tele.get("buckets") and mean:
                rest = mean - tele.get("validate_s", 0.0) - tele.get("apply_s", 0.0)
                out.append(f"{eng} {path} breakdown: {mean:.2f} s per update = validate {tele['validate_s']:.3f} s + "
                           f"quantize and write {tele['apply_s']:.3f} s + transfer and the rest {rest:.3f} s "
                           "(engine telemetry of one extra push, summed over its buckets)")
            kv = rec.get("kv_recalibration") or {}
            if kv.get("writes"):
                out.append(f"{eng} {path}: {kv['writes']} KV-scale recalibrations after its pushes, the last "
                           f"{kv['last_s']:.3f} s (kv_scales telemetry; inside the update's answer)")
    return out


def dry_run(args: argparse.Namespace, shapes: dict[str, tuple[int, ...]], commands: dict[str, str]) -> dict:
    """What a run would do, without a GPU: the plan, the payload per GPU, each engine's launch command, the
    targets it will report."""
    gpus = args.gpus or args.tp_size
    plan = make_plan(args, gpus)
    res = {"model": args.model, "plan": plan.as_dict(), "engines": {}}
    return {"plan": plan.as_dict(), "model": args.model,
            "payload_gb_per_gpu": {d: round(b / GB, 2) for d, b in bytes_per_gpu(shapes, plan.payload_gpus).items()},
            "launch": commands, "targets": scale_targets(res)}
