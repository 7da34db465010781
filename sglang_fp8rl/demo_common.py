"""What the GPU and the CPU version of ``python -m sglang_fp8rl.demo`` share: the demo model (a small Qwen3 with random
BF16 weights, written as an HF checkpoint), the prompt, the work folder, and the printed report."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

# small but realistic for the blockwise scheme: every linear dimension is a multiple of 128
# (qkv 512 x 256, o_proj 256 x 256, gate_up 768 x 256, down 256 x 384)
DEMO_DIMS = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 4,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
PROMPT = [11, 42, 7, 300, 5, 99, 250, 3]
NEW_TOKENS = 12
SEED_BEFORE, SEED_AFTER = 0, 1  # W0 (loaded) and W1 (pushed)


def say(msg: str) -> None:
    """One progress line of the demo."""
    print(f"[demo] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# checkpoint


def random_state_dict(dims: dict, seed: int, device: str = "cpu", scale: float = 0.05) -> dict:
    """HF-named BF16 weights of a dense Qwen3 (norms near 1, linears ~N(0, scale), embeddings N(0, 1))."""
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


def write_checkpoint(out: str, dims: dict = DEMO_DIMS, seed: int = SEED_BEFORE, tokenizer: bool = True) -> dict:
    """config.json + model.safetensors (+ tokenizer); returns the state dict written (CPU, BF16)."""
    from safetensors.torch import save_file

    write_config(out, dims)
    sd = random_state_dict(dims, seed)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer:
        write_tokenizer(out, dims["vocab_size"])
    return sd


@contextlib.contextmanager
def work_dir(keep: str | None) -> Iterator[str]:
    """``keep`` (created, kept afterwards), or a temporary folder removed at the end."""
    if keep:
        os.makedirs(keep, exist_ok=True)
        yield keep
        return
    path = tempfile.mkdtemp(prefix="fp8rl_demo_")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# report (the same for the GPU and the CPU version)


def format_schemes(schemes: dict | None, log_lines: list[str]) -> str:
    """The scheme summary: counts per scheme, exception groups, and the engine's own [fp8rl] summary line(s)."""
    if not schemes:
        out = ["schemes: (no fp8rl telemetry)"]
    else:
        counts = ", ".join(f"{k}={v}" for k, v in (schemes.get("counts") or {}).items())
        out = [f"linear layers per scheme: {counts}"]
        exc = schemes.get("exceptions") or {}
        out.append("exceptions: " + (", ".join(f"{k}: {v} layer(s)" for k, v in exc.items()) or "none"))
    out += [line.strip() for line in log_lines]
    return "\n".join(out)


def format_update(last: dict | None) -> str:
    """One line of the last update's statistics (``last_update_stats()``, or /get_server_info's ``last_update``)."""
    if not last:
        return "last update: none recorded"
    layers = ", ".join(f"{k}={v}" for k, v in (last.get("fp8_layers_written") or {}).items()) or "none"
    return (f"last update #{last.get('index')}: ok={last.get('ok')} ({last.get('message')}); "
            f"{last.get('tensors')} tensors, {last.get('bytes', 0) / 2**20:.1f} MiB; "
            f"validate {last.get('validate_s', 0) * 1e3:.1f} ms, quantize+write {last.get('apply_s', 0) * 1e3:.1f} ms; "
            f"FP8 layers re-quantized: {layers}; BF16 params written: {last.get('bf16_params_written')}")


def report(before: list[int], after: list[int], state_before: dict, state_after: dict, pushed: str,
           log_lines: list[str]) -> bool:
    """Print the scheme summary, the update and the tokens before/after; True when the update was applied.

    ``state_*`` are the engine's fp8rl telemetry (``/get_server_info`` → ``internal_states[0]["fp8rl"]``)."""
    print("\n== scheme summary ==\n" + format_schemes(state_before.get("schemes"), log_lines))
    last = state_after.get("last_update")
    same_ptrs = state_before.get("fp8_param_ptr_digest") == state_after.get("fp8_param_ptr_digest")
    print(f"\n== update ==\n{pushed}\n{format_update(last)}")
    print(f"FP8 parameters updated in place (same storage): {same_ptrs}; engine consistent: "
          f"{state_after.get('consistent')}; updates so far: {state_after.get('updates')}")
    print(f"\n== greedy tokens for prompt {PROMPT} ==\nbefore (W0): {before}\nafter  (W1): {after}\n"
          f"changed: {before != after}", flush=True)
    return bool((last or {}).get("ok"))
