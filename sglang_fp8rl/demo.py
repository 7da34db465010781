"""End-to-end demo: serve a small random Qwen3 with ``--quantization fp8_online_blockwise`` and push one update.

    python -m sglang_fp8rl.demo [--port 30030] [--keep DIR] [--timeout 420]

Steps: write a small Qwen3 checkpoint (random BF16 weights, config.json, model.safetensors, a word-level tokenizer)
to a temporary folder; launch the stock server on it (``python -m sglang.launch_server ... --quantization
fp8_online_blockwise --skip-tokenizer-init``); generate greedy tokens; push new random weights (W1) by CUDA IPC
through :func:`sglang_fp8rl.weight_sync.client.push_state_dict`; generate again; print the per-layer scheme summary
(``/get_server_info`` internal_states[0]["fp8rl"]["schemes"] and the server's ``[fp8rl]`` log lines) and the update
statistics (``last_update``).

Needs a CUDA GPU: SGLang's HTTP server does not start on CPU with this install (its scheduler needs CUDA-only
kernels), so without CUDA the demo prints why and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

EXIT_NO_CUDA = 2
NO_CUDA_MESSAGE = (
    "sglang_fp8rl.demo needs a CUDA GPU: it serves the model with SGLang's HTTP server (python -m "
    "sglang.launch_server), which does not start on CPU, and pushes weights as CUDA IPC handles. "
    "torch.cuda.is_available() is False here. Run it on a machine with an NVIDIA GPU (Hopper for the FP8 block "
    "GEMMs); the CPU-side pieces are covered by tests/test_demo_cpu.py."
)

# small but realistic for the blockwise scheme: every linear dimension is a multiple of 128
# (qkv 512 x 256, o_proj 256 x 256, gate_up 768 x 256, down 256 x 384)
DEMO_DIMS = dict(vocab_size=1024, hidden_size=256, intermediate_size=384, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128)
PROMPT = [11, 42, 7, 300, 5, 99, 250, 3]
SERVER_FLAGS = ["--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                "--grammar-backend", "none", "--dtype", "bfloat16", "--cuda-graph-max-bs-decode", "8",
                "--cuda-graph-backend-prefill", "disabled", "--host", "127.0.0.1"]


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# checkpoint (CPU)


def random_state_dict(dims: dict, seed: int, device: str = "cpu", scale: float = 0.05) -> dict:
    """HF-named BF16 weights of a dense Qwen3 with these dims (norms near 1, linears ~N(0, scale), embeddings N(0, 1))."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, i, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    nh, nkv, hd = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]

    def randn(*shape, s=scale):
        return (torch.randn(*shape, generator=g, device=device) * s).to(torch.bfloat16)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": randn(v, h, s=1.0), "model.norm.weight": norm(h), "lm_head.weight": randn(v, h)}
    for layer in range(dims["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd.update({
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": randn(nh * hd, h),
            p + "self_attn.k_proj.weight": randn(nkv * hd, h),
            p + "self_attn.v_proj.weight": randn(nkv * hd, h),
            p + "self_attn.o_proj.weight": randn(h, nh * hd),
            p + "self_attn.q_norm.weight": norm(hd),
            p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": randn(i, h),
            p + "mlp.up_proj.weight": randn(i, h),
            p + "mlp.down_proj.weight": randn(h, i),
        })
    return sd


def write_tokenizer(out: str, vocab_size: int) -> None:
    """A word-level tokenizer t0..t{vocab-5} plus specials (the server runs with --skip-tokenizer-init; SGLang's
    config loading still likes a tokenizer next to the weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 4)}
    vocab.update({"<unk>": vocab_size - 4, "<s>": vocab_size - 3, "</s>": vocab_size - 2, "<pad>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)


def write_config(out: str, dims: dict) -> dict:
    """config.json of a Qwen3ForCausalLM: transformers' Qwen3Config (as the tests do); plain JSON without it."""
    v = dims["vocab_size"]
    os.makedirs(out, exist_ok=True)
    try:
        from transformers import Qwen3Config
    except ImportError:
        Qwen3Config = None
    if Qwen3Config is not None:
        cfg = Qwen3Config(max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16",
                          bos_token_id=v - 3, eos_token_id=v - 2, pad_token_id=v - 1, **dims)
        cfg.architectures = ["Qwen3ForCausalLM"]
        cfg.save_pretrained(out)
        with open(os.path.join(out, "config.json")) as f:
            return json.load(f)
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                  attention_dropout=0.0, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
                  use_sliding_window=False, sliding_window=None, max_window_layers=dims["num_hidden_layers"],
                  initializer_range=0.02, bos_token_id=v - 3, eos_token_id=v - 2, pad_token_id=v - 1, **dims)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config


def write_checkpoint(out: str, dims: dict = DEMO_DIMS, seed: int = 0, tokenizer: bool = True) -> dict:
    """config.json + model.safetensors (+ tokenizer); returns the state dict written (CPU, BF16)."""
    from safetensors.torch import save_file

    write_config(out, dims)
    sd = random_state_dict(dims, seed)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer:
        write_tokenizer(out, dims["vocab_size"])
    return sd


# ---------------------------------------------------------------------------------------------------------------------
# server (CUDA)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def launch(model_dir: str, port: int, log_path: str, mem: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port),
           "--quantization", "fp8_online_blockwise", "--mem-fraction-static", str(mem), *SERVER_FLAGS]
    say("launch: " + " ".join(cmd[1:]))
    env = dict(os.environ, SGLANG_JIT_DEEPGEMM_PRECOMPILE="0")
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server's process group (started by us)."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> float:
    import requests

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; last log lines:\n{tail(log_path)}")
        try:
            if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                return time.time() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout} s; last log lines:\n{tail(log_path)}")


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def generate(url: str, ids: list[int], n: int = 12) -> list[int]:
    import requests

    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": n, "temperature": 0}}, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"]


def fp8rl_state(url: str) -> dict:
    import requests

    info = requests.get(url + "/get_server_info", timeout=30).json()
    return (info.get("internal_states") or [{}])[0].get("fp8rl") or {}


def format_schemes(schemes: Optional[dict], log_lines: list[str]) -> str:
    """The scheme summary: counts per scheme, exception groups, and the server's own [fp8rl] summary line(s)."""
    if not schemes:
        out = ["schemes: (no fp8rl telemetry in /get_server_info)"]
    else:
        counts = ", ".join(f"{k}={v}" for k, v in (schemes.get("counts") or {}).items())
        out = [f"linear layers per scheme: {counts}"]
        exc = schemes.get("exceptions") or {}
        out.append("exceptions: " + (", ".join(f"{k}: {v} layer(s)" for k, v in exc.items()) or "none"))
    out += [line.strip() for line in log_lines]
    return "\n".join(out)


def format_update(last: Optional[dict]) -> str:
    if not last:
        return "last update: none recorded"
    layers = ", ".join(f"{k}={v}" for k, v in (last.get("fp8_layers_written") or {}).items()) or "none"
    return (f"last update #{last.get('index')}: ok={last.get('ok')} ({last.get('message')}); "
            f"{last.get('tensors')} tensors, {last.get('bytes', 0) / 2**20:.1f} MiB; "
            f"validate {last.get('validate_s', 0) * 1e3:.1f} ms, quantize+write {last.get('apply_s', 0) * 1e3:.1f} ms; "
            f"FP8 layers re-quantized: {layers}; BF16 params written: {last.get('bf16_params_written')}")


def fp8rl_log_lines(log_path: str) -> list[str]:
    try:
        with open(log_path, errors="replace") as f:
            return [line for line in f if "[fp8rl]" in line and "linear layers" in line][:4]
    except OSError:
        return []


def run(args: argparse.Namespace) -> int:
    import torch

    from sglang_fp8rl.weight_sync.client import push_state_dict

    work = args.keep or tempfile.mkdtemp(prefix="fp8rl_demo_")
    model_dir = os.path.join(work, "model")
    log_path = os.path.join(work, "server.log")
    url = f"http://127.0.0.1:{args.port}"
    say(f"writing a random Qwen3 ({DEMO_DIMS}) to {model_dir}")
    write_checkpoint(model_dir, DEMO_DIMS, seed=0)
    proc = launch(model_dir, args.port, log_path, args.mem)
    result: dict[str, Any] = {}
    try:
        startup = wait_healthy(url, proc, args.timeout, log_path)
        say(f"server healthy after {startup:.0f} s (log: {log_path})")
        before = generate(url, PROMPT)
        state0 = fp8rl_state(url)
        print("\n== scheme summary ==\n" + format_schemes(state0.get("schemes"), fp8rl_log_lines(log_path)))
        w1 = random_state_dict(DEMO_DIMS, seed=1, device="cuda")
        t = time.perf_counter()
        answers = push_state_dict(url, w1, bucket_bytes=args.bucket_mb << 20)
        push_s = time.perf_counter() - t
        after = generate(url, PROMPT)
        state1 = fp8rl_state(url)
        print(f"\n== update ==\npushed {len(w1)} tensors in {len(answers)} request(s), {push_s * 1e3:.0f} ms wall\n"
              + format_update(state1.get("last_update")))
        same_ptrs = state0.get("fp8_param_ptr_digest") == state1.get("fp8_param_ptr_digest")
        print(f"FP8 parameters updated in place (same storage): {same_ptrs}; engine consistent: "
              f"{state1.get('consistent')}; updates so far: {state1.get('updates')}")
        print(f"\n== greedy tokens for prompt {PROMPT} ==\nbefore (W0): {before}\nafter  (W1): {after}\n"
              f"changed: {before != after}")
        result = dict(before=before, after=after, schemes=state0.get("schemes"), last_update=state1.get("last_update"),
                      ptrs_unchanged=same_ptrs)
        del w1
        torch.cuda.empty_cache()
    finally:
        stop(proc)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = bool(result) and (result.get("last_update") or {}).get("ok", False)
    return 0 if ok else 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_fp8rl.demo", description=__doc__.split("\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=30030)
    p.add_argument("--mem", type=float, default=0.2, help="--mem-fraction-static (default 0.2)")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--timeout", type=float, default=420, help="seconds to wait for the server (default 420)")
    p.add_argument("--keep", metavar="DIR", default=None, help="work in DIR and keep the checkpoint and server log")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not cuda_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return EXIT_NO_CUDA
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
