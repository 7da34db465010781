"""What scripts/gpu/check_server.py sends: model shapes, random weights, pre-quantized FP8, SGLang flattened buckets
(good and damaged), the HTTP bodies of SGLang's update routes, checkpoint folders (good and damaged), and the small
Qwen3-MoE model folder. Device-agnostic: everything here also runs on CPU (tests/test_check_server_cpu.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Iterable, Optional, Sequence

import torch

from sglang_fp8rl.weight_sync.protocol import FLATTENED_BUCKET, SCALE_SUFFIX, STEP_COMPLETE

W1_SEED = 1234
W2_SEED = 4321
ROUTER_SUFFIX = ".mlp.gate.weight"  # Qwen3-MoE router: a replicated linear, kept in BF16 by the engine
EMBED = "model.embed_tokens.weight"
UNKNOWN_NAME = "model.layers.0.mlp.nope.weight"
PAD_NAME = "model.norm.weight_pad"  # the 0-d BF16 entry that misaligns a flattened bucket
SHARD_FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SINGLE_FILE = "model.safetensors"
STEP_BUCKET_BYTES = 128 << 20  # the atomic-step refusal: several buckets, the bad name in the last one
SMALL_MOE_NAME = "qwen3-moe-small"
# a small Qwen3-MoE: every per-rank shape still fits 128-blocks at TP 2 (moe_intermediate 256 -> 128 per rank)
SMALL_MOE = dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                 moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, intermediate_size=3072)
NamedList = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------------------------------
# shapes and weights


def num_experts(config: dict) -> int:
    """Experts per MoE layer (0: dense). transformers 5 writes the key as num_local_experts."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def is_sparse_layer(config: dict, layer: int) -> bool:
    """Qwen3-MoE's rule: a layer has experts unless listed in mlp_only_layers or off the decoder_sparse_step."""
    step = config.get("decoder_sparse_step") or 1
    return num_experts(config) > 0 and layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Qwen3 (dense) or Qwen3-MoE config."""
    h, v = config["hidden_size"], config["vocab_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {EMBED: (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
                       p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if is_sparse_layer(config, layer):
            mi = config["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (num_experts(config), h)
            for e in range(num_experts(config)):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (mi, h), q + "up_proj.weight": (mi, h),
                               q + "down_proj.weight": (h, mi)})
        else:
            i = config["intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                           p + "mlp.down_proj.weight": (h, i)})
    return shapes


def fp8_linear_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The weights the engine serves as FP8 linears (2-D; not embeddings, lm_head or the MoE router)."""
    return [n for n, s in shapes.items()
            if len(s) == 2 and n != EMBED and n != "lm_head.weight" and not n.endswith(ROUTER_SUFFIX)]


def victim_name(shapes: dict[str, tuple[int, ...]]) -> str:
    """The linear weight that carries the tensor-level defects: the first down_proj (dense MLP or expert 0)."""
    return next(n for n in shapes if n.endswith("down_proj.weight"))


# Embeddings of N(0, 0.02) in the checks: with N(0, 1) a random model with tied embeddings only repeats its last
# input token (logprob 0.0) whatever its other weights, so two different models give identical outputs and an
# output comparison proves nothing (measured on CPU with transformers; seen on the GPU).
CHECK_EMBED_STD = 0.02


def make_weights(shapes: dict[str, tuple[int, ...]], device: str, seed: int,
                 embed_std: float = 1.0) -> dict[str, torch.Tensor]:
    """Deterministic random BF16 weights (norms ~1, linears ~N(0, 0.02), embeddings ~N(0, embed_std))."""
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = 1 + 0.05 * torch.randn(shape, generator=g, device=device)
        else:
            std = embed_std if name in (EMBED, "lm_head.weight") else 0.02
            t = torch.randn(shape, generator=g, device=device) * std
        sd[name] = t.to(torch.bfloat16)
    return sd


def make_w1(config: dict, device: str) -> dict[str, torch.Tensor]:
    """W1 of the checks (and of scripts/bench_update.py): every HF tensor of ``config``, seed W1_SEED."""
    return make_weights(hf_shapes(config), device, W1_SEED)


def prequantize(sd: dict[str, torch.Tensor], scale_format: str = "pow2") -> dict[str, torch.Tensor]:
    """Checkpoint-format FP8 of ``sd``: every FP8 linear as float8_e4m3fn codes followed by its float32
    ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]; the other tensors unchanged. Same order as ``sd``."""
    from sglang_fp8rl.quant import quantize_blockwise

    linears = set(fp8_linear_names({n: tuple(t.shape) for n, t in sd.items()}))
    out = {}
    for name, tensor in sd.items():
        if name in linears:
            out[name], out[name + SCALE_SUFFIX] = quantize_blockwise(tensor, scale_format=scale_format)
        else:
            out[name] = tensor
    return out


# ---------------------------------------------------------------------------------------------------------------------
# flattened buckets (SGLang's own class) and the HTTP bodies of the update routes


def flattened(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's flattened bucket of ``named``, as its callers send it: {"flattened_tensor", "metadata"}."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=list(named))
    return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}


def aligned(named: Iterable[tuple[str, torch.Tensor]]) -> NamedList:
    """Entries by element size, largest first (stable): every entry of the bucket starts aligned to its dtype."""
    return sorted(named, key=lambda item: -item[1].element_size())


def buckets_of(weights: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, Any]]:
    """The step as flattened buckets of at most ``bucket_bytes`` (the client's split: a pre-quantized weight and its
    scale stay together), each aligned."""
    return [flattened(aligned(bucket)) for bucket in client_buckets(weights, bucket_bytes)]


def misaligned_bucket(sd: dict[str, torch.Tensor], victim: str) -> dict[str, Any]:
    """A 0-d BF16 tensor before an FP32 one: the FP32 entry starts 2 bytes into the buffer."""
    pad = torch.ones((), dtype=torch.bfloat16, device=sd[victim].device)
    return flattened([(PAD_NAME, pad), (victim, sd[victim].float())])


def unknown_dtype_bucket(sd: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, Any]:
    """A good bucket whose last metadata entry names its dtype as a string (no torch dtype)."""
    bucket = flattened([(n, sd[n]) for n in names])
    meta = list(bucket["metadata"])
    meta[-1] = dataclasses.replace(meta[-1], dtype="bfloat16")
    return {"flattened_tensor": bucket["flattened_tensor"], "metadata": meta}


def tensor_body(named: Sequence[tuple[str, Any]], tp_size: int, load_format: Optional[str] = None,
                flush_cache: bool = True) -> dict[str, Any]:
    """/update_weights_from_tensor body of a (name, tensor) list: one serialized copy per TP rank (CUDA IPC)."""
    from sglang_fp8rl.weight_sync.client import serialize_for_ranks

    return {"serialized_named_tensors": serialize_for_ranks(list(named), tp_size), "load_format": load_format,
            "flush_cache": flush_cache}


def bucket_body(bucket: dict[str, Any], tp_size: int, flush_cache: bool = True) -> dict[str, Any]:
    """/update_weights_from_tensor body of a flattened bucket: the {"flattened_tensor", "metadata"} dict serialized
    once per TP rank in SGLang's MultiprocessingSerializer format, load_format "flattened_bucket"."""
    from sglang_fp8rl.weight_sync.client import serialize

    return {"serialized_named_tensors": [serialize(bucket) for _ in range(tp_size)], "load_format": FLATTENED_BUCKET,
            "flush_cache": flush_cache}


def disk_body(path: str) -> dict[str, Any]:
    """/update_weights_from_disk body; "auto" because a server started with --load-format dummy would otherwise use
    the dummy loader for the update too."""
    return {"model_path": path, "load_format": "auto"}


# ---------------------------------------------------------------------------------------------------------------------
# checkpoint folders


def _host(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def copy_config(model_dir: str, folder: str) -> None:
    """config.json and the tokenizer files of the served model into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(model_dir):
        if f.endswith(".json") or f.startswith("tokenizer"):
            shutil.copy(os.path.join(model_dir, f), folder)


def write_checkpoint(folder: str, sd: dict[str, torch.Tensor], model_dir: str, shards: int = 1) -> list[str]:
    """A loadable checkpoint folder (config + safetensors, one file or two shards with an index); returns the
    paths of the safetensors files."""
    from safetensors.torch import save_file

    copy_config(model_dir, folder)
    host = _host(sd)
    if shards == 1:
        path = os.path.join(folder, SINGLE_FILE)
        save_file(host, path, metadata={"format": "pt"})
        return [path]
    names = list(host)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, paths = {}, []
    for part, fname in zip(halves, SHARD_FILES):
        paths.append(os.path.join(folder, fname))
        save_file({k: host[k] for k in part}, paths[-1], metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return paths


def truncate(path: str, keep: float = 2 / 3) -> int:
    """Cut a file to ``keep`` of its size (a checkpoint copy that stopped half-way); returns the new size."""
    size = int(os.path.getsize(path) * keep)
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def write_truncated(folder: str, sd: dict[str, torch.Tensor], model_dir: str) -> str:
    """A folder whose model.safetensors is truncated."""
    truncate(write_checkpoint(folder, sd, model_dir)[0])
    return folder


def write_corrupt_second_shard(folder: str, sd: dict[str, torch.Tensor], model_dir: str) -> str:
    """A two-shard checkpoint whose second shard is truncated."""
    truncate(write_checkpoint(folder, sd, model_dir, shards=2)[1])
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# one run's payloads, and the bad updates built from them


@dataclasses.dataclass
class Payloads:
    """W1, W2 and pre-quantized W1 (on the run's device), and the checkpoint folders written from them."""

    shapes: dict[str, tuple[int, ...]]
    victim: str
    w1: dict[str, torch.Tensor]
    w2: dict[str, torch.Tensor]
    prequant: dict[str, torch.Tensor]
    folders: dict[str, str]  # w1, truncated, corrupt_shard, embed_v1, prequant


def prepare(model: str, tmp: str, device: str = "cuda") -> Payloads:
    """The weights of a run and every checkpoint folder under ``tmp`` (config.json read from ``model``)."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    shapes = hf_shapes(config)
    w1 = make_weights(shapes, device, W1_SEED, CHECK_EMBED_STD)
    w2 = make_weights(shapes, device, W2_SEED, CHECK_EMBED_STD)
    prequant = prequantize(w1, scale_format="pow2")
    folders = {k: os.path.join(tmp, k) for k in ("w1", "truncated", "corrupt_shard", "embed_v1", "prequant")}
    write_checkpoint(folders["w1"], w1, model)
    write_truncated(folders["truncated"], w1, model)
    write_corrupt_second_shard(folders["corrupt_shard"], w1, model)
    write_checkpoint(folders["embed_v1"], {EMBED: torch.ones(shapes[EMBED][0], 1, dtype=torch.bfloat16)}, model)
    write_checkpoint(folders["prequant"], prequant, model)
    return Payloads(shapes, victim_name(shapes), w1, w2, prequant, folders)


@dataclasses.dataclass
class BadUpdate:
    """One bad update: how it travels, and the words the engine's refusal must contain."""

    name: str
    kind: str  # tensor: a (name, tensor) list | bucket: a flattened bucket | disk: a folder | step: an atomic step
    content: Any
    says: tuple[str, ...]
    load_format: Optional[str] = None
    data: dict = dataclasses.field(default_factory=dict)


def bad_updates(p: Payloads, step_bucket_bytes: int = STEP_BUCKET_BYTES) -> list[BadUpdate]:
    """Every bad update of the check, in order; the W2 values they carry would change the outputs if applied."""
    v = p.victim
    dev = p.w2[v].device
    codes, scale = p.prequant[v], p.prequant[v + SCALE_SUFFIX]
    vocab = p.shapes[EMBED][0]
    embed_v1 = torch.ones(vocab, 1, dtype=torch.bfloat16, device=dev)  # broadcastable: SGLang's loader would take it
    few = [n for n in p.shapes if n.startswith("model.layers.0.")][:4]
    step = dict(p.w2, **{UNKNOWN_NAME: torch.ones(4, 4, dtype=torch.bfloat16, device=dev)})
    return [
        BadUpdate("refuse_nan_by_tensor", "tensor",
                  [(v, torch.full(p.shapes[v], float("nan"), dtype=torch.bfloat16, device=dev))], (v, "NaN")),
        BadUpdate("refuse_disk_truncated", "disk", p.folders["truncated"], (SINGLE_FILE,)),
        BadUpdate("refuse_disk_corrupt_second_shard", "disk", p.folders["corrupt_shard"], (SHARD_FILES[1],)),
        BadUpdate("refuse_embed_v1_by_tensor", "tensor", [(EMBED, embed_v1)], (EMBED,), data={"shape": [vocab, 1]}),
        BadUpdate("refuse_embed_v1_from_disk", "disk", p.folders["embed_v1"], (EMBED,), data={"shape": [vocab, 1]}),
        BadUpdate("refuse_e5m2_by_tensor", "tensor", [(v, p.w2[v].float().to(torch.float8_e5m2))], (v, "float8_e5m2")),
        # codes whose scale never comes: the request that ends the step (the marker) is refused before writing
        BadUpdate("refuse_fp8_without_scale", "tensor", [(v, codes), (STEP_COMPLETE, torch.zeros((), device=dev))],
                  (v, v + SCALE_SUFFIX)),
        BadUpdate("refuse_fp8_scale_wrong_shape", "tensor", [(v, codes), (v + SCALE_SUFFIX, scale[:-1].contiguous())],
                  (v + SCALE_SUFFIX, "shape"), data={"scale_shape": list(scale[:-1].shape)}),
        BadUpdate("refuse_bucket_misaligned", "bucket", misaligned_bucket(p.w2, v), (v, "aligned")),
        BadUpdate("refuse_bucket_unknown_dtype", "bucket", unknown_dtype_bucket(p.w2, few), (few[-1], "dtype")),
        BadUpdate("refuse_load_format_direct", "tensor", [(v, p.w2[v])], ("direct",), load_format="direct"),
        BadUpdate("refuse_atomic_step_unknown_last", "step", step, (UNKNOWN_NAME,),
                  data={"bucket_bytes": step_bucket_bytes,
                        "buckets": sum(1 for _ in client_buckets(step, step_bucket_bytes))}),
    ]


def client_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> Iterable[NamedList]:
    """The client's split of a step into buckets."""
    from sglang_fp8rl.weight_sync.buckets import buckets

    return buckets(weights, bucket_bytes)


# ---------------------------------------------------------------------------------------------------------------------
# the small Qwen3-MoE model folder (dummy weights)


def write_small_moe(model_dir: str) -> str:
    """MODEL_DIR/qwen3-moe-small: config + make_models.py's byte-level tokenizer (written once)."""
    from make_models import QWEN3_MOE, write_tokenizer

    path = os.path.join(model_dir, SMALL_MOE_NAME)
    if all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "tokenizer_config.json")):
        return path
    from transformers import Qwen3MoeConfig

    values = dict(QWEN3_MOE, **SMALL_MOE)
    cfg = Qwen3MoeConfig(**values)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(path)
    config_json = os.path.join(path, "config.json")
    with open(config_json) as f:
        saved = json.load(f)
    # keys SGLang reads directly, whatever this transformers version wrote
    for key in ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers"):
        saved[key] = values[key]
    saved.setdefault("torch_dtype", "bfloat16")
    with open(config_json, "w") as f:
        json.dump(saved, f, indent=2)
    write_tokenizer(path)
    return path
