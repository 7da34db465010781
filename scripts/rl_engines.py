"""The rollout engines of scripts/rl_regression.py: the server kinds and their flags, the command line of a stock
SGLang server, ServerEngine (weights pushed by CUDA IPC, samples from /generate), and TorchEngine, the --dry-run
stand-in that samples in torch from a BF16 copy of the policy (FP8 round trip of the linears for fp8 kinds)."""

from __future__ import annotations

import shlex
import sys

import torch
import train_toy_policy as T
from rl_policy import sample_torch

# FP8: the toy's GEMMs are tiny, so no load-time GEMM measurement (SGLang's block-FP8 dispatch runs them) and one
# DeepGEMM JIT worker per linear shape (qkv, o_proj, gate_up, down), which keeps a cold start short
_FP8 = ["--quantization", "fp8_online_blockwise", "--fp8rl-gemm-select", "off", "--fp8rl-jit-workers", "4"]
SERVER_KINDS = {"bf16": [], "fp8": _FP8, "fp8kv": [*_FP8, "--kv-cache-dtype", "fp8_e4m3"]}
COMMON_SERVER_FLAGS = ["--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                       "--grammar-backend", "none", "--dtype", "bfloat16", "--cuda-graph-backend-prefill", "disabled",
                       "--host", "127.0.0.1"]


# ----------------------------------------------------------------------------------------------------------------
# rollout engines: the SGLang server, or torch sampling for --dry-run
# ----------------------------------------------------------------------------------------------------------------

def server_command(kind: str, model_dir: str, port: int, args) -> list[str]:
    """`python -m sglang.launch_server` for one server kind; one decode CUDA graph at the rollout batch size."""
    extra = shlex.split(args.server_args) + (shlex.split(args.fp8kv_server_args) if kind == "fp8kv" else [])
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port),
            "--mem-fraction-static", str(args.mem_fraction_static), "--max-total-tokens", str(args.max_total_tokens),
            "--cuda-graph-bs-decode", str(args.prompts_per_step * args.group_size), "--random-seed", str(args.seed),
            *COMMON_SERVER_FLAGS, *SERVER_KINDS[kind], *extra]


def parse_generate_output(out: dict) -> tuple[list[int], list[float]]:
    """One /generate answer -> (sampled token ids, their logprobs), from meta_info.output_token_logprobs."""
    rows = (out.get("meta_info") or {}).get("output_token_logprobs")
    if rows is None:
        raise KeyError("meta_info has no output_token_logprobs (was return_logprob honoured?)")
    toks, lps = [int(r[1]) for r in rows], [float(r[0]) for r in rows]
    if "output_ids" in out and list(out["output_ids"]) != toks:
        raise ValueError(f"output_ids {out['output_ids']} differ from the logprob rows' tokens {toks}")
    return toks, lps


class ServerEngine:
    """A stock SGLang HTTP server: weights pushed by CUDA IPC, samples from /generate."""

    def __init__(self, url: str, timeout: float = 300.0):
        self.url, self.timeout = url, timeout

    def push(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from sglang_fp8rl.trainer import push_state_dict

        torch.cuda.synchronize()  # the BF16 copies must be written before the server reads them through IPC
        push_state_dict(self.url, named)

    def generate(self, prompts: list[list[int]], max_new: int, temperature: float) -> list:
        import requests

        sp = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": max_new,
              "stop_token_ids": [T.EOS]}
        r = requests.post(self.url + "/generate", json={"input_ids": prompts, "sampling_params": sp,
                                                          "return_logprob": True}, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered HTTP {r.status_code}: {r.text[:500]}")
        outs = r.json()
        return [parse_generate_output(o) for o in (outs if isinstance(outs, list) else [outs])]


def fake_fp8(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Decoder linear weights through the blockwise FP8 round trip (sglang_fp8rl.quant); the rest unchanged."""
    from sglang_fp8rl import quant

    out = []
    for name, w in named:
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            w = quant.dequantize_blockwise(*quant.quantize_blockwise(w)).to(torch.bfloat16)
        out.append((name, w))
    return out


class TorchEngine:
    """--dry-run engine: a BF16 copy of the policy (FP8 round trip of the linears for fp8 kinds), sampled in torch."""

    def __init__(self, kind: str, model, seed: int):
        import copy

        self.kind, self.model = kind, copy.deepcopy(model).to(torch.bfloat16).eval()
        self.gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    @torch.no_grad()
    def push(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, w in (fake_fp8(named) if self.kind != "bf16" else named):
            params[name].copy_(w)

    def generate(self, prompts: list[list[int]], max_new: int, temperature: float) -> list:
        return sample_torch(self.model, prompts, max_new, temperature, self.gen)
