#!/usr/bin/env python3
"""Write dummy-weight model folders (config.json + a tiny tokenizer, no weights) for `--load-format dummy`.

usage: python3 scripts/gpu/make_models.py OUT_DIR [NAME ...]      (default: every name below)

  qwen3-small          Qwen3-0.6B shape: hidden 1024, 28 layers, 16 q / 8 kv heads, head_dim 128, intermediate 3072,
                       vocab 151936, tied embeddings
  qwen3-8b             Qwen3-8B shape: hidden 4096, 36 layers, 32 q / 8 kv heads, head_dim 128, intermediate 12288,
                       vocab 151936
  qwen3-8b-block       qwen3-8b + quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                       "dynamic", "weight_block_size": [128, 128]}: SGLang's own pre-quantized block-FP8 path
  qwen3-30b-a3b        Qwen3MoeForCausalLM, Qwen3-30B-A3B shape: hidden 2048, 48 layers, 32 q / 4 kv heads,
                       head_dim 128, moe_intermediate_size 768, 128 experts, 8 per token, vocab 151936,
                       norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers []
  qwen3-30b-a3b-block  qwen3-30b-a3b + the same block-FP8 quantization_config
  qwen3-30b-a3b-24l    qwen3-30b-a3b with its first 24 layers: the same tensors a layer (9,459 in all), half the bytes,
                       so that a weight sync of 30B-A3B's per-tensor shape fits one 80 GB GPU beside its BF16 payload

Each folder gets a byte-level tokenizer (256 byte tokens + Qwen's three special tokens, no merges; ids do not match
real Qwen3): sglang.bench_one_batch needs *a* tokenizer to load.
The MoE config passes head_dim explicitly (transformers' Qwen3MoeConfig has no head_dim default and would derive 64).
Needs transformers + tokenizers (on the GPU machine: from the wheelhouse, after `source scripts/gpu/env.sh`).
"""
from __future__ import annotations

import json
import os
import sys

BLOCK_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    hidden_act="silu",
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
    use_cache=True,
    use_sliding_window=False,
)
QWEN3_SHAPES = {
    "qwen3-small": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                        intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=12288, tie_word_embeddings=False),
}
QWEN3_MOE = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,  # dense-MLP size of the real model; unused since every layer is sparse
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    attention_bias=False,
    attention_dropout=0.0,
    decoder_sparse_step=1,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    use_cache=True,
    use_sliding_window=False,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)
ALL = ["qwen3-small", "qwen3-8b", "qwen3-8b-block", "qwen3-30b-a3b", "qwen3-30b-a3b-block", "qwen3-30b-a3b-24l"]
MOE_LAYERS = {"qwen3-30b-a3b-24l": 24}  # MoE variants with fewer layers than QWEN3_MOE's


def write_tokenizer(path: str) -> None:
    """Byte-level: the 256 bytes are ids 0-255 and Qwen's three special tokens 256-258; no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": list(specials)})
    fast.eos_token = "<|im_end|>"
    fast.pad_token = "<|endoftext|>"
    fast.save_pretrained(path)


def add_block_quant_config(config_json: str) -> None:
    with open(config_json) as f:
        c = json.load(f)
    c["quantization_config"] = dict(BLOCK_QUANT_CONFIG)
    with open(config_json, "w") as f:
        json.dump(c, f, indent=2)


def write(out_dir: str, name: str) -> str:
    if name not in ALL:
        raise ValueError(f"unknown model {name!r}; choose from {ALL}")
    base = name[: -len("-block")] if name.endswith("-block") else name
    path = os.path.join(out_dir, name)
    os.makedirs(path, exist_ok=True)
    if base in QWEN3_SHAPES:
        from transformers import Qwen3Config

        cfg = Qwen3Config(**QWEN3_COMMON, **QWEN3_SHAPES[base])
        cfg.architectures = ["Qwen3ForCausalLM"]
    else:
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(**dict(QWEN3_MOE, num_hidden_layers=MOE_LAYERS.get(base, QWEN3_MOE["num_hidden_layers"])))
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(path)
    cj = os.path.join(path, "config.json")
    with open(cj) as f:
        c = json.load(f)
    # belt and braces for keys SGLang reads directly (transformers versions rename/drop some)
    if "dtype" not in c:
        c["torch_dtype"] = "bfloat16"
    c["head_dim"] = 128
    if base not in QWEN3_SHAPES:
        c["num_experts"] = QWEN3_MOE["num_experts"]
        c["norm_topk_prob"] = True
        c["decoder_sparse_step"] = 1
        c["mlp_only_layers"] = []
        c["moe_intermediate_size"] = 768
        c["num_experts_per_tok"] = 8
    with open(cj, "w") as f:
        json.dump(c, f, indent=2)
    if name.endswith("-block"):
        add_block_quant_config(cj)
    write_tokenizer(path)
    return path


def ensure(out_dir: str, names) -> list[str]:
    """Write the named models unless their config.json already exists; return their paths."""
    paths = []
    for n in names:
        p = os.path.join(out_dir, n)
        if not os.path.exists(os.path.join(p, "config.json")) or not os.path.exists(
                os.path.join(p, "tokenizer_config.json")):
            write(out_dir, n)
        paths.append(p)
    return paths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    out, names = argv[0], (argv[1:] or ALL)
    for n in names:
        print(write(out, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
