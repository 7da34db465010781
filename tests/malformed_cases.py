"""The malformed-request suite: case specs (plain data, known at collection time) and their requests (built in the
worker process from the tiny model's weights).

Every case is one request into SGLang's real ``WeightUpdater`` of a model served with `fp8_online_blockwise`.
Invariant (checked in tests/test_malformed_updates.py): either the request is applied exactly (every parameter equal
to the model after a reference full update to W1), or it is rejected with ``success False``, a message naming the
tensor or file and the reason, every parameter byte-identical and every pointer unchanged; the process stays alive.

A case is built from: the entry point (tensor list, flattened bucket, disk, distributed), the position of the bad
tensor in the request (alone, or last of a full update), and one defect (name, dtype, shape, values, format, bucket
layout, checkpoint file). Valid variants (other dtypes, buckets, disk) must apply.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Optional

import torch

from sglang_fp8rl.weight_sync.protocol import STEP_COMPLETE

# a tensor of the tiny model used as the carrier of most defects, and what the engine must say
VICTIM = "model.layers.1.mlp.down_proj.weight"  # [256, 384]: not square, so a transpose is a wrong shape
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
NORM = "model.layers.0.input_layernorm.weight"
# a linear kept in BF16 (test_malformed_updates.py serves the suite with this --fp8rl-ignore), shaped like VICTIM
BF16_KEPT = "model.layers.0.mlp.down_proj.weight"
BF16_KEPT_PATTERN = r"^model\.layers\.0\.mlp\.down_proj$"


@dataclasses.dataclass(frozen=True)
class Case:
    """One request and its expected outcome ("apply" or "reject", with words the message must contain)."""

    id: str
    entry: str  # tensor | bucket | disk | distributed
    defect: str  # key of DEFECTS (tensor-level), FORMATS, LAYOUTS or DISK
    position: str = "alone"  # alone | last (after every good tensor of W1)
    expect: str = "reject"
    says: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------------------------
# tensor-level defects: (name, tensor) from the good (name, tensor); None keeps the good one (valid variants)

def _f8(dtype_name: str) -> Callable:
    return lambda n, t: (n, t.float().clamp(-1, 1).to(getattr(torch, dtype_name)))


def _ending_step(make: Callable) -> Callable:
    """``make``'s entry in a request that ends the step (the marker): an FP8 half without its partner is held for a
    later request of the step, so only a request that ends the step can be refused for it (before writing)."""
    return lambda n, t: [make(n, t), (STEP_COMPLETE, torch.zeros(()))]


def _nan_at(index: int) -> Callable:
    def make(n: str, t: torch.Tensor):
        t = t.clone()
        t.view(-1)[index] = float("nan")
        return n, t
    return make


def _value(v: float, dtype: torch.dtype = torch.bfloat16) -> Callable:
    def make(n: str, t: torch.Tensor):
        t = t.to(dtype)
        t.view(-1)[-1] = v
        return n, t
    return make


def _short(name: str) -> str:
    return name.removeprefix("model.")


def _aliased(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``name`` and its other spelling, each with its own copy of the values (as two trainer tensors would be)."""
    return [(name, t), (_short(name), t.clone())]


def _both_named(name: str) -> tuple[str, ...]:
    return repr(name), repr(_short(name)), "write the same"


# defect -> (make(name, tensor) -> (name, tensor), expect, words the message must contain)
DEFECTS: dict[str, tuple[Callable, str, tuple[str, ...]]] = {
    # names
    "unknown_name": (lambda n, t: ("model.layers.1.mlp.nope.weight", t), "reject", ("nope", "not a parameter")),
    "name_none": (lambda n, t: (None, t), "reject", ("name must be a non-empty string",)),
    "name_int": (lambda n, t: (7, t), "reject", ("name must be a non-empty string",)),
    "name_empty": (lambda n, t: ("", t), "reject", ("name must be a non-empty string",)),
    "fused_qkv": (lambda n, t: ("model.layers.1.self_attn.qkv_proj.weight", torch.cat([t, t[:256]])), "reject",
                  ("qkv_proj",)),
    "scale_tensor": (_ending_step(lambda n, t: (n + "_scale_inv", torch.ones(4, 2))), "reject",
                     ("weight_scale_inv without", "ends the step")),
    "layer_out_of_range": (lambda n, t: (n.replace("layers.1.", "layers.9."), t), "reject", ("layers.9",)),
    # dtypes
    "fp64": (lambda n, t: (n, t.double()), "reject", ("float64", "not accepted")),
    "int8": (lambda n, t: (n, t.to(torch.int8)), "reject", ("int8", "not accepted")),
    "int32": (lambda n, t: (n, t.to(torch.int32)), "reject", ("int32", "not accepted")),
    "bool": (lambda n, t: (n, t > 0), "reject", ("bool", "not accepted")),
    "complex64": (lambda n, t: (n, t.float().to(torch.complex64)), "reject", ("complex64", "not accepted")),
    "e4m3fn": (_ending_step(_f8("float8_e4m3fn")), "reject", ("weight without", "weight_scale_inv")),
    "e5m2": (_f8("float8_e5m2"), "reject", ("float8_e5m2", "not accepted")),
    "e4m3fnuz": (_f8("float8_e4m3fnuz"), "reject", ("float8_e4m3fnuz", "not accepted")),
    "e5m2fnuz": (_f8("float8_e5m2fnuz"), "reject", ("float8_e5m2fnuz", "not accepted")),
    "e8m0fnu": (lambda n, t: (n, t.abs().float().clamp(min=2 ** -10).to(torch.float8_e8m0fnu)), "reject",
                ("float8_e8m0fnu", "not accepted")),
    "not_a_tensor": (lambda n, t: (n, t.tolist()), "reject", ("expected a torch.Tensor",)),
    "fp32": (lambda n, t: (n, t.float()), "apply", ()),
    "fp16": (lambda n, t: (n, t.half()), "apply", ()),
    "noncontiguous": (lambda n, t: (n, t.t().contiguous().t()), "apply", ()),
    # shapes
    "transposed": (lambda n, t: (n, t.t().contiguous()), "reject", ("shape",)),
    "extra_row": (lambda n, t: (n, torch.cat([t, t[:1]])), "reject", ("shape",)),
    "missing_row": (lambda n, t: (n, t[:-1]), "reject", ("shape",)),
    "three_d": (lambda n, t: (n, t[None]), "reject", ("shape",)),
    "flat": (lambda n, t: (n, t.reshape(-1)), "reject", ("shape",)),
    "scalar": (lambda n, t: (n, t.reshape(-1)[0]), "reject", ("shape",)),
    "empty": (lambda n, t: (n, t[:0]), "reject", ("shape",)),
    "embed_col": (lambda n, t: (EMBED, torch.ones(320, 1, dtype=torch.bfloat16)), "reject", (EMBED, "full shape")),
    "embed_vec": (lambda n, t: (EMBED, torch.ones(320, dtype=torch.bfloat16)), "reject", (EMBED, "full shape")),
    "lm_head_col": (lambda n, t: (LM_HEAD, torch.ones(320, 1, dtype=torch.bfloat16)), "reject",
                    (LM_HEAD, "full shape")),
    "embed_short": (lambda n, t: (EMBED, torch.ones(319, 256, dtype=torch.bfloat16)), "reject", (EMBED,)),
    "norm_wide": (lambda n, t: (NORM, torch.ones(257, dtype=torch.bfloat16)), "reject", (NORM, "dimension 0")),
    "norm_2d": (lambda n, t: (NORM, torch.ones(256, 1, dtype=torch.bfloat16)), "reject", (NORM, "1-D")),
    # values
    "nan_first": (_nan_at(0), "reject", ("NaN/Inf",)),
    "nan_last": (_nan_at(-1), "reject", ("NaN/Inf",)),
    "pos_inf": (_value(float("inf")), "reject", ("NaN/Inf",)),
    "neg_inf": (_value(float("-inf")), "reject", ("NaN/Inf",)),
    "fp32_overflow": (_value(3.4e38, torch.float32), "reject", ("NaN/Inf",)),  # finite in FP32, Inf in BF16
    "fp16_inf": (_value(float("inf"), torch.float16), "reject", ("NaN/Inf",)),
    "zeros": (lambda n, t: (n, torch.zeros_like(t)), "apply", ()),
    "huge_finite": (_value(3.0e38), "apply", ()),
    "tiny": (lambda n, t: (n, t * 1e-30), "apply", ()),
    # one parameter under two names (SGLang's Qwen3 loader also takes "layers.N..." without "model."): both would be
    # written, in one multi-tensor copy or grouped launch on CUDA, where which one lands is undefined
    "alias_fp8": (lambda n, t: _aliased(n, t), "reject", _both_named(VICTIM)),
    "alias_bf16": (lambda n, t: _aliased(BF16_KEPT, t), "reject", _both_named(BF16_KEPT)),
    "alias_norm": (lambda n, t: _aliased(NORM, torch.ones(256, dtype=torch.bfloat16)), "reject", _both_named(NORM)),
}

def _pair(mutate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]) -> Callable:
    """A pre-quantized pair (codes + power-of-two block scales of the good tensor), then ``mutate``d."""
    def make(n: str, t: torch.Tensor) -> list[tuple[str, Any]]:
        from sglang_fp8rl.quant import quantize_blockwise

        codes, scale = mutate(*quantize_blockwise(t, scale_format="pow2"))
        return [(n, codes), (n + "_scale_inv", scale)]
    return make


def _nan_code(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes = codes.clone()
    codes.view(torch.uint8)[3, 5] = 0x7F
    return codes, scale


def _scale_value(v: float) -> Callable:
    def mutate(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = scale.clone()
        scale[1, 2] = v
        return codes, scale
    return mutate


# pre-quantized FP8 pairs: defect -> (make(name, tensor) -> entries, expect, words)
FP8_PAIRS: dict[str, tuple[Callable, str, tuple[str, ...]]] = {
    "fp8_pair": (_pair(lambda c, s: (c, s)), "apply", ()),
    "fp8_scale_wrong_shape": (_pair(lambda c, s: (c, s[:-1])), "reject", ("_scale_inv", "expected float32 of shape")),
    "fp8_scale_bf16": (_pair(lambda c, s: (c, s.bfloat16())), "reject", ("_scale_inv", "expected float32")),
    "fp8_scale_nan": (_pair(_scale_value(float("nan"))), "reject", ("finite and > 0",)),
    "fp8_scale_inf": (_pair(_scale_value(float("inf"))), "reject", ("finite and > 0",)),
    "fp8_scale_zero": (_pair(_scale_value(0.0)), "reject", ("finite and > 0",)),
    "fp8_scale_negative": (_pair(_scale_value(-1.0)), "reject", ("finite and > 0",)),
    "fp8_nan_code": (_pair(_nan_code), "reject", ("NaN encoding",)),
    "fp8_e5m2_codes": (_pair(lambda c, s: (c.float().to(torch.float8_e5m2), s)), "reject", ("float8_e5m2",)),
    "fp8_codes_1d": (_pair(lambda c, s: (c.reshape(-1), s)), "reject", ("2-D",)),
}

# load_format values on the tensor path
FORMATS = {
    "direct": ("reject", ("direct",)),
    "safetensors": ("reject", ("safetensors",)),
    "custom_loader": ("reject", ("my_pkg.my_loader",)),
    "auto": ("reject", ("auto",)),
}

# flattened-bucket layouts: how the bucket of the full W1 update is damaged
LAYOUTS = {
    "good": ("apply", ()),
    "truncated_buffer": ("reject", ("outside", "truncated")),
    "misaligned_fp32": ("reject", ("aligned",)),
    "unknown_dtype": ("reject", ("dtype",)),
    "int_dtype": ("reject", ("int32", "not accepted")),
    "bytes_mismatch": ("reject", ("bytes",)),
    "negative_start": ("reject", ("outside",)),
    "end_before_start": ("reject", ("outside",)),
    "bad_shape": ("reject", ("shape",)),
    "metadata_not_list": ("reject", ("metadata",)),
    "empty_metadata": ("reject", ("metadata",)),
    "buffer_not_uint8": ("reject", ("uint8",)),
    "buffer_2d": ("reject", ("1-D",)),
    "not_a_dict": ("reject", ("dict",)),
    "name_none": ("reject", ("name must be a non-empty string",)),
    "nan_in_bucket": ("reject", ("NaN/Inf",)),
    "unknown_name": ("reject", ("not a parameter",)),
    "duplicate_name": ("reject", ("more than once",)),
}

# checkpoint folders for update_weights_from_disk
DISK = {
    "good": ("apply", ()),
    "two_shards": ("apply", ()),
    "truncated_file": ("reject", ("model.safetensors",)),
    "corrupt_second_shard": ("reject", ("model-00002",)),
    "garbage_file": ("reject", ("model.safetensors",)),
    "empty_folder": ("reject", ()),
    "missing_folder": ("reject", ("no such folder",)),
    "hub_id_offline": ("reject", ()),
    "nan_tensor": ("reject", ("NaN/Inf",)),
    "unknown_tensor": ("reject", ("not a parameter",)),
    "embed_col": ("reject", (EMBED, "full shape")),
    "fp8_tensor": ("reject", ("float8_e4m3fn",)),
    "int_tensor": ("reject", ("int32",)),
}

DISTRIBUTED = {
    "good": ("apply", ()),
    "good_bucket": ("apply", ()),
    "nan": ("reject", ("NaN/Inf",)),
    "unknown_name": ("reject", ("not a parameter",)),
    "wrong_shape": ("reject", ("shape",)),
    "bad_dtype": ("reject", ("dtype", "out of step")),  # cannot be sized: nothing received, the group is out of step
    "int32": ("reject", ("dtype", "received and dropped")),  # received in full first, so the group stays in step
    "float64": ("reject", ("dtype", "received and dropped")),
    "unknown_group": ("reject", ("group",)),
    "length_mismatch": ("reject", ("same length",)),
    "direct_format": ("reject", ("direct", "received and dropped")),
    "good_again": ("apply", ()),  # after every refusal above, the same group still carries a good update exactly
}


def all_cases() -> list[Case]:
    """Every case of the suite (ids are stable test ids)."""
    cases = []
    for defect, (_, expect, says) in {**DEFECTS, **FP8_PAIRS}.items():
        for entry in ("tensor", "bucket"):
            if entry == "bucket" and defect == "not_a_tensor":
                continue  # a bucket holds only tensors
            for position in ("alone", "last"):
                cases.append(Case(f"{entry}-{defect}-{position}", entry, defect, position, expect, says))
    for fmt, (expect, says) in FORMATS.items():
        cases.append(Case(f"format-{fmt}", "tensor", "format:" + fmt, "last", expect, says))
    for layout, (expect, says) in LAYOUTS.items():
        cases.append(Case(f"layout-{layout}", "bucket", "layout:" + layout, "last", expect, says))
    for kind, (expect, says) in DISK.items():
        cases.append(Case(f"disk-{kind}", "disk", "disk:" + kind, "last", expect, says))
    for kind, (expect, says) in DISTRIBUTED.items():
        cases.append(Case(f"distributed-{kind}", "distributed", "dist:" + kind, "last", expect, says))
    return cases


# ---------------------------------------------------------------------------------------------------------------------
# building requests (in the worker)


def tensor_request(case: Case, w1: dict[str, torch.Tensor]) -> list[tuple[Any, Any]]:
    """The (name, tensor) list of a tensor-level case."""
    make = {**DEFECTS, **FP8_PAIRS}[case.defect][0]
    made = make(VICTIM, w1[VICTIM].clone())
    bad = made if isinstance(made, list) else [made]
    if case.position == "alone":
        return bad
    names = {name for name, _ in bad}
    return [(n, t) for n, t in w1.items() if n not in names and n != VICTIM] + bad


def flattened(named: list[tuple[str, torch.Tensor]]) -> dict:
    """SGLang's own flattened bucket of ``named``."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=named)
    return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}


def damaged_bucket(layout: str, w1: dict[str, torch.Tensor]) -> Any:
    """The full W1 update as one flattened bucket, damaged as ``layout`` says."""
    named = list(w1.items())
    if layout == "nan_in_bucket":
        named[-1] = (named[-1][0], named[-1][1].clone().fill_(float("nan")))
    if layout == "unknown_name":
        named[-1] = ("model.nope.weight", named[-1][1])
    if layout == "duplicate_name":
        named.append(named[0])
    if layout == "misaligned_fp32":  # a 0-d BF16 tensor first: every later offset is 2 bytes off
        named = [("model.norm.weight_pad", torch.ones((), dtype=torch.bfloat16))] + [(n, t.float()) for n, t in named]
    bucket = flattened(named)
    meta = [dataclasses.replace(m) for m in bucket["metadata"]]
    buf = bucket["flattened_tensor"]
    if layout == "truncated_buffer":
        buf = buf[: buf.numel() - 1000]
    elif layout == "unknown_dtype":
        meta[-1] = dataclasses.replace(meta[-1], dtype="bfloat16")
    elif layout == "int_dtype":
        meta[-1] = dataclasses.replace(meta[-1], dtype=torch.int32, shape=torch.Size([meta[-1].numel // 4]))
    elif layout == "bytes_mismatch":
        meta[-1] = dataclasses.replace(meta[-1], end_idx=meta[-1].end_idx - 2)
    elif layout == "negative_start":
        meta[0] = dataclasses.replace(meta[0], start_idx=-2)
    elif layout == "end_before_start":
        meta[0] = dataclasses.replace(meta[0], end_idx=meta[0].start_idx - 2)
    elif layout == "bad_shape":
        meta[0] = dataclasses.replace(meta[0], shape=[-1, 2])
    elif layout == "metadata_not_list":
        return {"flattened_tensor": buf, "metadata": meta[0]}
    elif layout == "empty_metadata":
        meta = []
    elif layout == "buffer_not_uint8":
        buf = buf[: buf.numel() // 2 * 2].view(torch.bfloat16)
    elif layout == "buffer_2d":
        buf = buf.view(1, -1)
    elif layout == "not_a_dict":
        return named
    elif layout == "name_none":
        meta[1] = dataclasses.replace(meta[1], name=None)
    return {"flattened_tensor": buf, "metadata": meta}


def write_disk_case(kind: str, out: str, model_dir: str, w1: dict[str, torch.Tensor]) -> str:
    """A checkpoint folder (or path) for update_weights_from_disk."""
    from safetensors.torch import save_file

    if kind == "missing_folder":
        return os.path.join(out, "does-not-exist")
    if kind == "hub_id_offline":
        return "fp8rl-test-org/no-such-model"
    os.makedirs(out, exist_ok=True)
    if kind == "empty_folder":
        return out
    shutil.copy(os.path.join(model_dir, "config.json"), out)
    sd = dict(w1)
    if kind == "nan_tensor":
        sd[VICTIM] = sd[VICTIM].clone().fill_(float("nan"))
    elif kind == "unknown_tensor":
        sd["model.layers.0.mlp.nope.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
    elif kind == "embed_col":
        sd[EMBED] = torch.ones(320, 1, dtype=torch.bfloat16)
    elif kind == "fp8_tensor":
        sd[VICTIM] = sd[VICTIM].float().clamp(-1, 1).to(torch.float8_e4m3fn)
    elif kind == "int_tensor":
        sd[VICTIM] = sd[VICTIM].to(torch.int32)
    sd = {k: v.contiguous() for k, v in sd.items()}
    if kind in ("two_shards", "corrupt_second_shard"):
        names = sorted(sd)
        halves = [names[: len(names) // 2], names[len(names) // 2:]]
        files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        weight_map = {}
        for part, fname in zip(halves, files):
            save_file({k: sd[k] for k in part}, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        if kind == "corrupt_second_shard":
            _truncate(os.path.join(out, files[1]))
        return out
    path = os.path.join(out, "model.safetensors")
    save_file(sd, path, metadata={"format": "pt"})
    if kind == "truncated_file":
        _truncate(path)
    elif kind == "garbage_file":
        with open(path, "wb") as f:
            f.write(b"\x00\x10garbage" * 100)
    return out


def _truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size * 2 // 3)


def distributed_plan(kind: str, w1: dict[str, torch.Tensor]) -> tuple[dict, Optional[list[torch.Tensor]]]:
    """(update_weights_from_distributed kwargs, the tensors the trainer broadcasts or None if it must not)."""
    named = list(w1.items())
    if kind == "nan":
        named[-1] = (named[-1][0], named[-1][1].clone().fill_(float("nan")))
    elif kind == "unknown_name":
        named[-1] = ("model.nope.weight", named[-1][1])
    elif kind == "wrong_shape":
        named[-1] = (named[-1][0], named[-1][1].reshape(-1))
    kwargs = dict(names=[n for n, _ in named], dtypes=[str(t.dtype).replace("torch.", "") for _, t in named],
                  shapes=[list(t.shape) for _, t in named], group_name="fp8rl_test",
                  load_format="flattened_bucket" if kind == "good_bucket" else None)
    if kind == "bad_dtype":
        kwargs["dtypes"][0] = "bogus_dtype"
        return kwargs, None
    if kind == "unknown_group":
        kwargs["group_name"] = "no_such_group"
        return kwargs, None
    if kind == "length_mismatch":
        kwargs["shapes"] = kwargs["shapes"][:-1]
        return kwargs, None
    if kind == "direct_format":
        kwargs["load_format"] = "direct"  # the trainer broadcasts tensor by tensor; the engine receives, then refuses
    if kind in ("int32", "float64"):
        named[-1] = (named[-1][0], named[-1][1].to(getattr(torch, kind)))
        kwargs["dtypes"][-1] = kind
    if kind == "good_bucket":
        return kwargs, [flattened(named)["flattened_tensor"]]
    return kwargs, [t.contiguous() for _, t in named]
