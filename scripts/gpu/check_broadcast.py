#!/usr/bin/env python3
"""GPU check of `/update_weights_from_distributed` over NCCL with the plugin: BF16 and pre-quantized FP8 broadcasts.

Needs two GPUs: the server (`--quantization fp8_online_blockwise`, qwen3-small, TP 1) on the first, this process (the
trainer, rank 0 of the update group) on the second; NCCL refuses two ranks on one GPU. Checks, each PASS/FAIL:
  1. reference outputs: W1 pre-quantized (FP8 codes + power-of-two scales) pushed by tensor (CUDA IPC, proven exact
     by check_server.py) -> R1; W2 in BF16 by tensor -> R2 (must differ from R1);
  2. the same W1 FP8 payload broadcast over NCCL (`push_distributed`, several buckets, the step-complete marker
     after the last) -> outputs equal R1 bit for bit (tokens and every logprob), FP8 parameter pointers unchanged;
  3. W2 in BF16 broadcast over NCCL -> R2 bit for bit;
  4. broadcasts the engine refuses: one float64 tensor among BF16 ones (refused from its metadata; sent past the
     client's own preflight) and an unknown name (refused from content) -> refused with a message naming it, the
     engine alive and unchanged; then W1 FP8 broadcast again over the same group -> R1 (the refused bytes were
     received and dropped, the group is in step);
  5. W1 FP8 with each weight and its scale in different buckets (verl's split) over NCCL -> R1.
usage: python3 scripts/gpu/check_broadcast.py --model-dir DIR --out OUT [--server-gpu 0 --trainer-gpu 1]
Scale-out (issue 36): the server in a layout of scripts/gpu/scale_out.py on the GPUs --server-gpu lists, the trainer
on another, the update group of tp_size + 1 ranks:
  ... --server-gpu 0,1 --trainer-gpu 2 --tp-size 2 --nnodes 2     TP 2 as two 'nodes' of one GPU, NCCL to both
  ... --server-gpu 0,1 --trainer-gpu 2 --tp-size 2 --ep-size 2 --moe    (or --enable-dp-attention --dp-size 2)
Writes OUT/check_broadcast.json; exit 0 when every check passed, 1 otherwise, 2 without tp_size + 1 GPUs.
(The first run, 2026-11-25, failed in the engine's receive with "Cuda failure 'invalid argument'": this process
then ran NCCL with NCCL_CUMEM_ENABLE unset (1) while SGLang's server sets 0. Matched since; 11/11 to a TP 2
server of two 'nodes', docs/RESULTS.md sec. 27e.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import scale_out

PORT = 30400
GROUP_PORT = 29611
BUCKET_BYTES = 16 << 20


def split_pairs(payload: dict) -> list[list[tuple[str, object]]]:
    """Two buckets: every FP8 weight's codes in the first, its scale in the second (BF16 tensors in the first)."""
    first = [(n, t) for n, t in payload.items() if not n.endswith("_scale_inv")]
    second = [(n, t) for n, t in payload.items() if n.endswith("_scale_inv")]
    return [first, second]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--server-gpu", default="0", help="the server's CUDA_VISIBLE_DEVICES (tp-size GPUs)")
    ap.add_argument("--trainer-gpu", type=int, default=1)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--moe", action="store_true", help="serve the small Qwen3-MoE of check_server.py --moe")
    scale_out.add_args(ap)
    args = ap.parse_args()
    scale_out.check_args(args, ap.error)
    if len(args.server_gpu.split(",")) != args.tp_size or str(args.trainer_gpu) in args.server_gpu.split(","):
        ap.error(f"--server-gpu {args.server_gpu}: list --tp-size ({args.tp_size}) GPUs, without --trainer-gpu "
                 f"{args.trainer_gpu} (NCCL refuses two ranks of one group on one GPU)")
    os.makedirs(args.out, exist_ok=True)
    from sglang_fp8rl.weight_sync.client import match_engine_nccl_env

    match_engine_nccl_env()  # before this process's first NCCL communicator (init_update_group also does it)
    import torch

    if torch.cuda.device_count() < args.tp_size + 1:
        print(f"check_broadcast needs {args.tp_size + 1} GPUs (the server's {args.tp_size} and the trainer's)")
        return 2
    import make_models
    from server_io import fp8rl_info, generate, launch, route_every_dp_rank, stop, url, wait_healthy
    from server_payloads import prepare
    from server_report import same_outputs

    from sglang_fp8rl.trainer import init_update_group, push_distributed, push_state_dict
    from sglang_fp8rl.weight_sync.client import _broadcast_bucket  # one bucket without the step's end: not the contract

    if args.moe:
        from server_payloads import write_small_moe

        model = write_small_moe(args.model_dir)
    else:
        make_models.ensure(args.model_dir, ["qwen3-small"])
        model = os.path.join(args.model_dir, "qwen3-small")
    route_every_dp_rank(PORT, args.dp_size if args.enable_dp_attention else 1)
    torch.cuda.set_device(args.trainer_gpu)
    dev = f"cuda:{args.trainer_gpu}"
    p = prepare(model, os.path.join(args.out, "ckpt"), device=dev)
    host = {name: t.cpu() for name, t in p.prequant.items()}  # by tensor: CPU copies (the server sees one GPU)
    host_w2 = {name: t.cpu() for name, t in p.w2.items()}
    results: list[dict] = []
    device_name = torch.cuda.get_device_name(args.trainer_gpu)

    def check(name: str, ok: bool, detail: str = "") -> None:
        results.append({"check": name, "pass": bool(ok), "detail": detail[:600]})
        print(f"[check_broadcast] {'PASS' if ok else 'FAIL'} {name} {detail[:300]}", flush=True)
        with open(os.path.join(args.out, "check_broadcast.json"), "w") as f:
            json.dump({"results": results, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "device": device_name}, f, indent=1)

    # the server sees only its GPUs; this process keeps its own view (changing it here would renumber our devices)
    server = scale_out.launch_server(launch, model, PORT, os.path.join(args.out, "server.log"), args,
                                     scale_out.dist_port(PORT, 0), "--load-format", "dummy", mem=0.5,
                                     env_extra={"CUDA_VISIBLE_DEVICES": args.server_gpu})
    target = url(PORT)
    try:
        check("server starts", True, f"{wait_healthy(PORT, server):.0f} s")
        push_state_dict(target, host, bucket_bytes=BUCKET_BYTES)
        r1 = generate(PORT)
        digest = fp8rl_info(PORT).get("fp8_param_ptr_digest")
        push_state_dict(target, host_w2, bucket_bytes=BUCKET_BYTES)
        r2 = generate(PORT)
        check("references R1 (FP8 by tensor) and R2 (BF16 by tensor) differ", not same_outputs(r1, r2))
        group = init_update_group(target, "127.0.0.1", GROUP_PORT, world_size=args.tp_size + 1,
                                  group_name="fp8rl_check")
        check("update group over NCCL", True)

        t0 = time.time()
        answers = push_distributed(target, p.prequant, group, group_name="fp8rl_check", bucket_bytes=BUCKET_BYTES)
        dt = time.time() - t0
        out = generate(PORT)
        check("W1 FP8 (codes + scales) over NCCL == R1", same_outputs(out, r1), f"{len(answers)} buckets, {dt:.2f} s")
        check("FP8 parameter pointers unchanged", fp8rl_info(PORT).get("fp8_param_ptr_digest") == digest)

        push_distributed(target, p.w2, group, group_name="fp8rl_check", bucket_bytes=BUCKET_BYTES)
        check("W2 BF16 over NCCL == R2", same_outputs(generate(PORT), r2))

        names = list(p.w1)[:4]
        victim = names[1]
        bucket = [(n, p.w1[n].to(torch.float64) if n == victim else p.w1[n]) for n in names]
        try:
            answer = str(_broadcast_bucket(target, bucket, group, "fp8rl_check", 120))
            check("float64 broadcast refused", False, "accepted: " + answer)
        except Exception as e:  # noqa: BLE001 - the check records whatever the client raised
            check("float64 broadcast received and refused, naming the tensor", victim in str(e), str(e))
        try:
            push_distributed(target, [("model.layers.0.not_a_param.weight", p.w1[names[0]])], group,
                             group_name="fp8rl_check")
            check("unknown-name broadcast refused", False, "accepted")
        except Exception as e:  # noqa: BLE001 - the check records whatever the client raised
            check("unknown-name broadcast refused, naming the tensor", "not_a_param" in str(e), str(e))
        check("engine alive and unchanged after the refusals", same_outputs(generate(PORT), r2))
        push_distributed(target, p.prequant, group, group_name="fp8rl_check", bucket_bytes=BUCKET_BYTES)
        check("the group stays in step: W1 FP8 over NCCL again == R1", same_outputs(generate(PORT), r1))

        push_state_dict(target, host_w2, bucket_bytes=BUCKET_BYTES)
        for k, bucket in enumerate(split_pairs(p.prequant)):
            push_distributed(target, bucket, group, group_name="fp8rl_check", bucket_bytes=1 << 40, complete=k == 1)
        check("W1 FP8 with weights and scales in different broadcasts == R1", same_outputs(generate(PORT), r1))
    except Exception as e:  # noqa: BLE001 - a failed step is a FAIL record, and the server is stopped
        check("no unexpected error", False, f"{type(e).__name__}: {e}")
    finally:
        stop(server)
    print("\n".join(f"| {r['check']} | {'PASS' if r['pass'] else 'FAIL'} |" for r in results))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
