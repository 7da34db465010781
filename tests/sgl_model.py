"""Tiny Qwen3 checkpoints written by the tests, and a subprocess runner around SGLang's real ModelRunner on CPU.

SGLang's ModelRunner owns process-global state (torch.distributed, parallel groups), so every model-level scenario
runs in a fresh process (`python tests/sgl_worker.py ...`) and hands its results back through a torch.save file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from rank_pair import run_ranks, stacks_env

from sglang_fp8rl.demo_common import random_state_dict, write_tokenizer  # noqa: F401  (shared with the demo)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "sgl_worker.py")

# hidden 256, 2 heads of 128, 1 KV head, intermediate 384: qkv (256+128+128) and o_proj are blockwise, and
# gate_up/down (384 = 3 x 128) are blockwise at TP 1 but fall back at TP 2 (192 rows per rank).
TINY = dict(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128)
# an intermediate size that is not a multiple of 128 forces the per-channel fallback already at TP 1
TINY_FALLBACK = dict(TINY, intermediate_size=320)


def write_checkpoint(out: str, dims: dict, seed: int, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """Write config.json, model.safetensors and a tokenizer; returns the state dict written."""
    from transformers import Qwen3Config

    config = Qwen3Config(max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16", **dims)
    config.architectures = ["Qwen3ForCausalLM"]
    sd = state_dict if state_dict is not None else random_state_dict(dims, seed)
    return save_checkpoint(out, config, sd)


def save_checkpoint(out: str, config, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """config.json, model.safetensors and a tokenizer in ``out``; returns ``sd``."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(out, config.vocab_size)
    return sd


# SGLang's own block-FP8 checkpoint format (DeepSeek-V3's): what `--quantization fp8` serves
SGLANG_BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def write_fp8_checkpoint(out: str, dims: dict, seed: int, with_config: bool = True) -> dict[str, torch.Tensor]:
    """A checkpoint quantized on disk as SGLang's ``fp8`` method stores it: each linear weight as float8_e4m3fn codes
    with its ``weight_scale_inv`` (one float32 per 128x128 block); its config.json carries :data:`SGLANG_BLOCK_FP8`
    unless ``with_config`` is False (FP8 tensors under a BF16 config)."""
    import re

    from transformers import Qwen3Config

    from sglang_fp8rl.quant import quantize_blockwise

    config = Qwen3Config(max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16", **dims)
    config.architectures = ["Qwen3ForCausalLM"]
    sd: dict[str, torch.Tensor] = {}
    for name, w in random_state_dict(dims, seed).items():
        if re.search(r"_proj\.weight$", name):
            sd[name], sd[name + "_scale_inv"] = quantize_blockwise(w.float())
        else:
            sd[name] = w
    save_checkpoint(out, config, sd)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        written = json.load(f)
    written.pop("quantization_config", None)
    if with_config:
        written["quantization_config"] = dict(SGLANG_BLOCK_FP8)
    with open(path, "w") as f:
        json.dump(written, f, indent=2)
    return sd


def write_w0_w1(d, config=None) -> tuple[dict, dict]:
    """The pair most update tests use: checkpoint folders ``d/w0`` (seed 10) and ``d/w1`` (seed 11); their state
    dicts."""
    config = TINY if config is None else config
    w0 = write_checkpoint(str(d / "w0"), config, seed=10)
    w1 = random_state_dict(config, seed=11)
    write_checkpoint(str(d / "w1"), config, seed=11, state_dict=w1)
    return w0, w1


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def run_worker(scenario: str, model_dir: str, out_path: str, *server_args: str, env: dict | None = None,
               timeout: int = 600, extra: dict | None = None) -> dict:
    """Run one scenario of tests/sgl_worker.py in a fresh process; return what it saved."""
    cmd = [sys.executable, WORKER, scenario, model_dir, out_path, json.dumps(extra or {}), *server_args]
    proc_env = dict(os.environ)
    proc_env.pop("FP8RL_OPTIONS", None)
    proc_env.update(env or {})
    # the worker prints every thread's stack and exits shortly before it would be killed: a hang names its line
    proc_env.update(stacks_env(timeout))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=proc_env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"worker {scenario} still ran after {timeout} s:\n{_text(e.stdout)[-4000:]}\n"
                             f"{_text(e.stderr)[-8000:]}") from None
    if res.returncode != 0:
        raise AssertionError(
            f"worker {scenario} failed (rc={res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-8000:]}")
    result = torch.load(out_path, weights_only=False)
    result["_log"] = res.stdout + res.stderr
    return result


# ---------------------------------------------------------------------------------------------------------------------
# tiny Qwen3-MoE (every decoder layer sparse)

# moe_intermediate_size 256 (= 2 x 128): every expert is blockwise at TP 1
TINY_MOE = dict(vocab_size=320, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_experts=4, num_experts_per_tok=2)
# 192 is not a multiple of 128: the experts fall back to per-channel at TP 1
TINY_MOE_FALLBACK = dict(TINY_MOE, moe_intermediate_size=192)


def random_moe_state_dict(dims: dict, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """HF-named BF16 weights of a Qwen3-MoE model: attention as Qwen3, a router and per-expert gate/up/down."""
    dense = dict(dims, intermediate_size=dims["moe_intermediate_size"])
    sd = {k: v for k, v in random_state_dict(dense, seed, scale=scale).items() if ".mlp." not in k}
    g = torch.Generator().manual_seed(seed + 1000)
    h, i, n = dims["hidden_size"], dims["moe_intermediate_size"], dims["num_experts"]

    def randn(*shape, s=scale):
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)

    for layer in range(dims["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp."
        sd[p + "gate.weight"] = randn(n, h, s=0.5)
        for e in range(n):
            sd.update({p + f"experts.{e}.gate_proj.weight": randn(i, h), p + f"experts.{e}.up_proj.weight": randn(i, h),
                       p + f"experts.{e}.down_proj.weight": randn(h, i)})
    return sd


def write_moe_checkpoint(out: str, dims: dict, seed: int, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a Qwen3MoeForCausalLM config.json, model.safetensors and a tokenizer; returns the state dict written."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16",
                            intermediate_size=dims["moe_intermediate_size"], decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True, **dims)
    config.architectures = ["Qwen3MoeForCausalLM"]
    sd = state_dict if state_dict is not None else random_moe_state_dict(dims, seed)
    return save_checkpoint(out, config, sd)


def run_tp_workers(scenario: str, model_dir: str, out_prefix: str, tp_size: int, *server_args: str,
                   extra: dict | None = None, timeout: int = 600) -> list[dict]:
    """Run one scenario as ``tp_size`` concurrent worker processes (one per TP rank, gloo on CPU)."""
    env = dict(os.environ, SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r % os.cpu_count()) for r in range(tp_size)))
    env.pop("FP8RL_OPTIONS", None)

    def command(rank: int, port: int) -> list[str]:
        return [sys.executable, WORKER, scenario, model_dir, f"{out_prefix}.rank{rank}.pt",
                json.dumps({**(extra or {}), "tp_rank": rank}), *server_args, "--tp-size", str(tp_size),
                "--nccl-port", str(port)]

    try:
        logs = run_ranks(command, env, timeout, ranks=tp_size)
    except AssertionError as e:
        raise AssertionError(f"TP workers of {scenario}: {e}") from None
    results = []
    for rank, log in enumerate(logs):
        result = torch.load(f"{out_prefix}.rank{rank}.pt", weights_only=False)
        result["_log"] = log
        results.append(result)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# helpers shared by the update tests


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors compared by their bytes (torch.equal on float8 is not bit-exact for NaN encodings)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_params(a: dict, b: dict) -> None:
    """Same parameter names, and every parameter byte-identical."""
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(as_bytes(value), as_bytes(b[name])), name


def split_randomly(sd: dict, k: int, seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The state dict in k shuffled requests (fused shards of one layer land in different requests and orders)."""
    import random

    items = list(sd.items())
    random.Random(seed).shuffle(items)
    return [items[i::k] for i in range(k)]


def run_update_requests(model_dir: str, work_dir, name: str, requests: list[dict], *server_args: str,
                        **extra) -> dict:
    """Load ``model_dir`` and push ``requests`` through SGLang's WeightUpdater in a fresh worker."""
    path = os.path.join(str(work_dir), f"{name}.req.pt")
    torch.save(requests, path)
    return run_worker("updates", model_dir, os.path.join(str(work_dir), f"{name}.out.pt"), *server_args,
                      extra={"requests": path, **extra})


def assert_update_matches_cold_load(out: dict, cold: dict) -> None:
    """Every answer ok, no pointer moved, parameters and logits bit-identical to a cold load of the new weights."""
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    assert out["ptrs_before"] == out["ptrs_after"]
    assert_same_params(out["final_params"], cold["params"])
    for got, want in zip(out["logits"], cold["logits"]):
        assert torch.equal(got, want)
