"""Where a ``quantization_config`` under ``--quantization fp8_online_blockwise`` comes from, judged at start.

Served: a block-128 dynamic E4M3 config a trainer injected with ``--json-model-override-args`` on a BF16 checkpoint
(verl's FP8 rollout mode). Refused, each with what to run instead: a checkpoint quantized on disk (its own
config.json, or FP8 tensors in its safetensors), whatever was injected; and an injected config of another scheme.
SGLang applies the override over the checkpoint's config before any quantization method sees it, so the checkpoint's
own files are read here to tell the two apart.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
from typing import Any, NoReturn

from sglang_fp8rl.layers.ignored import ignored_layers_from
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE
from sglang_fp8rl.server_args import QUANTIZATION_NAME

logger = logging.getLogger(__name__)

NAME = QUANTIZATION_NAME
# the quantization_config that asks for exactly this method's scheme (verl's block-128 FP8 rollout config)
ROLLOUT_REQUEST = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(DEFAULT_BLOCK_SIZE)}
_QUANT_KEYS = ("quantization_config", "compression_config")  # compressed-tensors checkpoints use the second
_MAX_HEADER_BYTES = 100 << 20  # a larger safetensors header is not one: the file is skipped


def _block(value: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        return None


def rollout_request_problems(hf_quant_config: Any) -> list[str]:
    """What keeps a quantization_config from asking for this method's scheme (``fp8``, dynamic activations, E4M3,
    blocks of :data:`DEFAULT_BLOCK_SIZE`); empty when it asks for exactly that."""
    if not isinstance(hf_quant_config, dict):
        return [f"a {type(hf_quant_config).__name__} instead of a JSON object"]
    problems = []
    for key, needed in (("quant_method", "fp8"), ("activation_scheme", "dynamic"), ("fmt", "e4m3")):
        # SGLang's own defaults for an absent activation_scheme / fmt are dynamic / e4m3
        value = hf_quant_config.get(key, None if key == "quant_method" else needed)
        if str(value).lower() != needed:
            problems.append(f"{key} {value!r} (needs {needed!r})")
    block = hf_quant_config.get("weight_block_size")
    if block is None:
        problems.append(f"no weight_block_size (per-tensor or per-channel scales; needs {list(DEFAULT_BLOCK_SIZE)})")
    elif _block(block) != tuple(DEFAULT_BLOCK_SIZE):
        problems.append(f"weight_block_size {block} (needs {list(DEFAULT_BLOCK_SIZE)})")
    return problems


def is_rollout_fp8_request(hf_quant_config: Any) -> bool:
    """A quantization_config that asks for exactly this method's scheme (what verl's FP8 rollout mode injects)."""
    return not rollout_request_problems(hf_quant_config)


def injected_quantization_config(overrides: Any) -> dict | None:
    """The quantization_config in ``--json-model-override-args`` (its JSON text or SGLang's parsed dict), or None."""
    try:
        parsed = json.loads(overrides or "{}") if isinstance(overrides, (str, bytes)) else dict(overrides or {})
    except (TypeError, ValueError):
        return None
    config = parsed.get("quantization_config") if isinstance(parsed, dict) else None
    return config if isinstance(config, dict) else None


def reject_quantized_checkpoint(hf_quant_config: Any, why: str = "this checkpoint is already quantized") -> NoReturn:
    """ValueError: this method quantizes BF16/FP32 checkpoints, not already-quantized ones (where the source of the
    config is not known: :func:`check_quantization_source` says more where it is)."""
    method = hf_quant_config.get("quant_method", "?") if isinstance(hf_quant_config, dict) else "?"
    raise ValueError(
        f"--quantization {NAME} quantizes a BF16/FP32 checkpoint online, but {why} "
        f"(quantization_config quant_method={method!r}). Serve it without --quantization to use its own "
        f"scales, or point --model-path at the BF16 checkpoint."
    )


def refuse_injected_config(problems: list[str]) -> NoReturn:
    """ValueError for an injected quantization_config this method cannot serve: what is unsupported, what to send."""
    raise ValueError(
        f"--quantization {NAME} serves a quantization_config injected with --json-model-override-args only when it "
        f"asks for this method's scheme, and the injected one has {'; '.join(problems)}. Inject "
        f"{json.dumps(ROLLOUT_REQUEST)} instead (verl's block-128 FP8 rollout config), or drop the injected "
        f"quantization_config and pass --quantization {NAME} alone: the plugin then quantizes the BF16 checkpoint "
        f"itself."
    )


def refuse_quantized_on_disk(model_path: str, own_config: dict | None, fp8_tensor: str | None,
                             injected: bool) -> NoReturn:
    """ValueError for a checkpoint quantized on disk: what shows it, and SGLang's own method or the BF16 checkpoint."""
    if own_config is not None:
        method = own_config.get("quant_method")
        evidence = f"its config.json has a quantization_config (quant_method {method!r})"
        serve = (f"--quantization {method}, or no --quantization: SGLang reads that quantization_config" if method
                 else "no --quantization: SGLang reads that quantization_config")
    else:
        evidence = f"its safetensors hold FP8 weights ({fp8_tensor}) though its config.json has no quantization_config"
        serve = "--quantization fp8, with the quantization_config its weights were written with in its config.json"
    also = (" (a quantization_config injected with --json-model-override-args does not change what its files hold; "
            "drop it)") if injected else ""
    raise ValueError(
        f"--quantization {NAME} quantizes a BF16/FP32 checkpoint online, but the checkpoint at {model_path!r} is "
        f"already quantized on disk: {evidence}{also}. Serve it with its own weights and scales through SGLang's "
        f"method ({serve}), or point --model-path at its BF16 checkpoint."
    )


def checkpoint_quantization_config(model_path: str, revision: str | None = None) -> dict | None:
    """The quantization_config (or compression_config) of the checkpoint's own config.json, no override applied
    (its text_config's for a multimodal model); None when it has none or the file cannot be read as JSON here."""
    from transformers import PretrainedConfig

    try:
        raw, _ = PretrainedConfig.get_config_dict(model_path, revision=revision)
    except (OSError, ValueError, TypeError) as e:  # GGUF, Mistral's params.json: SGLang's own checks still run
        logger.debug("[fp8rl] config.json of %r not read: %s", model_path, e)
        return None
    for holder in (raw, raw.get("text_config")):
        for key in _QUANT_KEYS:
            found = holder.get(key) if isinstance(holder, dict) else None
            if found:
                return found if isinstance(found, dict) else {"quant_method": str(found)}
    return None


def _safetensors_header(path: str) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > _MAX_HEADER_BYTES:
            return {}
        return json.loads(f.read(size))


def _fp8_tensor_in(header: dict) -> str | None:
    tensors = {name: str(info.get("dtype", "")) for name, info in header.items()
               if name != "__metadata__" and isinstance(info, dict)}
    hit = next((f"{name}: {dtype}" for name, dtype in tensors.items() if dtype.startswith("F8")), None)
    return hit or next((name for name in tensors if name.endswith("_scale_inv")), None)


def fp8_tensor_on_disk(model_path: str) -> str | None:
    """A tensor showing that a local checkpoint's safetensors already hold FP8 weights, or None: a ``*_scale_inv``
    name in the index (which names every tensor: a sharded checkpoint's headers are not opened), else a float8 or
    ``*_scale_inv`` tensor in a file's header. Only names and headers are read."""
    if not os.path.isdir(model_path):
        return None
    index = os.path.join(model_path, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index) as f:
                names = json.load(f).get("weight_map", {})
            hit = next((name for name in names if name.endswith("_scale_inv")), None)
            return None if hit is None else f"{hit} in {os.path.basename(index)}"
        for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
            hit = _fp8_tensor_in(_safetensors_header(path))
            if hit is not None:
                return f"{hit} in {os.path.basename(path)}"
    except (OSError, ValueError, struct.error) as e:  # unreadable: the loader's own checks still run
        logger.debug("[fp8rl] safetensors of %r not read: %s", model_path, e)
    return None


def check_quantization_source(model_path: str, revision: str | None, overrides: Any) -> None:
    """ValueError at start unless this method would quantize a BF16/FP32 checkpoint: one quantized on disk is
    refused whatever was injected, and an injected quantization_config must ask for this method's scheme."""
    injected = injected_quantization_config(overrides)
    own = checkpoint_quantization_config(model_path, revision)
    fp8_tensor = fp8_tensor_on_disk(model_path) if own is None else None
    if own is not None or fp8_tensor is not None:
        refuse_quantized_on_disk(model_path, own, fp8_tensor, injected=injected is not None)
    if injected is not None and rollout_request_problems(injected):
        refuse_injected_config(rollout_request_problems(injected))


def accept_injected_request(hf_quant_config: dict, server_args: Any | None) -> tuple[str, ...]:
    """The trainer's ignored layers of an injected rollout-FP8 request; ValueError for anything else."""
    injected = injected_quantization_config(getattr(server_args, "json_model_override_args", None))
    if injected is None:
        reject_quantized_checkpoint(hf_quant_config)
    problems = rollout_request_problems(injected)
    if problems:
        refuse_injected_config(problems)
    return ignored_layers_from(injected)
