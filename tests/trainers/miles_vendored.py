"""Miles' (radixark/miles) SGLang argument parser and weight senders, copied verbatim for the integration tests.

Snapshot radixark/miles @ 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (2026-08-21); every copy below names its file and the commit
that last changed that file. Nothing in a copied body is edited. What Miles imports from Megatron, Ray and its own
helpers is replaced by the shims in the SHIMS section, each marked "SHIM (not Miles code)". Miles' FP8 kernel
(miles/utils/fp8_kernel.py @ 0e2733d41e386686feb38d6b50775c8f5ff012be) is byte-identical to slime's and is taken from
:mod:`trainers.slime_vendored` (see there for running it under the Triton interpreter).
"""

# ruff: noqa

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainers.slime_vendored import RayActor, _Dist, blockwise_cast_to_fp8_triton  # SHIMS and the identical kernel

from sglang.srt.server_args import ServerArgs  # as in miles/backends/sglang_utils/arguments.py

logger = logging.getLogger(__name__)

# radixark/miles miles/backends/megatron_utils/sglang.py @ d3aef3cf1751a89d2383258ba818e9222b060d57, verbatim (the SGLang symbols Miles' trainer uses)
try:
    from sglang.srt.layers.quantization.fp8_utils import quant_weight_ue8m0, transform_scale_ue8m0
    from sglang.srt.model_loader.utils import should_deepgemm_weight_requant_ue8m0
except ImportError:
    quant_weight_ue8m0 = None
    transform_scale_ue8m0 = None
    should_deepgemm_weight_requant_ue8m0 = None

try:
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8
except ImportError:
    per_block_cast_to_fp8 = None

try:
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
except ImportError:
    from sglang.srt.patch_torch import monkey_patch_torch_reductions

from sglang.srt.utils import MultiprocessingSerializer

try:
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # type: ignore[import]
except ImportError:
    from sglang.srt.model_executor.model_runner import FlattenedTensorBucket  # type: ignore[import]

__all__ = [
    "per_block_cast_to_fp8",
    "quant_weight_ue8m0",
    "transform_scale_ue8m0",
    "should_deepgemm_weight_requant_ue8m0",
    "monkey_patch_torch_reductions",
    "MultiprocessingSerializer",
    "FlattenedTensorBucket",
]

# =====================================================================================================================
# SHIMS (not Miles code): what Miles imports from Megatron, Ray and its own helpers


class _Group:
    def __init__(self, size=1, rank=0):
        self.size, self.rank = size, rank


class _ParallelState:
    """SHIM (not Miles code): miles.backends.training_utils.parallel.get_parallel_state() of a one-rank trainer."""

    tp = etp = pp = intra_dp_cp = _Group()


def get_parallel_state():
    return _ParallelState()


dist = _Dist()  # SHIM (not Miles code): torch.distributed, a one-rank trainer without a default group (slime_vendored)


class _Ray:
    """SHIM (not Miles code): ``ray.get`` of the in-place "ObjectRefs" RayActor returns (their results)."""

    @staticmethod
    def get(refs):
        return refs


ray = _Ray()
ObjectRef = Any  # SHIM (not Miles code): ray.ObjectRef
ActorHandle = Any  # SHIM (not Miles code): ray.actor.ActorHandle


def _not_vendored(*args, **kwargs):
    """SHIM (not Miles code): converters of other model families and the non-FP8 quantizers, not copied."""
    raise NotImplementedError("only Miles' Qwen2/Qwen3 converter and FP8 quantizer are vendored")


convert_deepseekv3_to_hf = convert_glm4_to_hf = convert_glm4moe_to_hf = convert_qwen3moe_to_hf = _not_vendored
convert_qwen3_next_to_hf = convert_qwen3_5_to_hf = convert_deepseekv4_to_hf = convert_inkling_to_hf = _not_vendored
convert_llama_to_hf = convert_mimo_to_hf = convert_kimivl_to_hf = convert_kimi_k25_to_hf = _not_vendored
quantize_params_mxfp8 = quantize_params_nvfp4 = quantize_params_compressed_tensors = _not_vendored

# =====================================================================================================================
# Launch: the `--sglang-*` / `--eval-sglang-*` parser

# radixark/miles miles/backends/sglang_utils/arguments.py @ 1a661812f077b24e7681ea529f1185a942168618: `add_sglang_router_arguments`, verbatim
def add_sglang_router_arguments(parser):
    """
    Add arguments to the parser for the SGLang router.
    """
    parser.add_argument(
        "--sglang-router-ip",
        type=str,
        default=None,
        help="IP address of the SGLang router",
    )
    parser.add_argument(
        "--sglang-router-port",
        type=int,
        default=None,
        help="Port of the SGLang router",
    )
    parser.add_argument(
        "--sglang-router-policy",
        type=str,
        default=None,
        help="Routing policy for the SGLang router (e.g., 'consistent_hashing', 'round_robin')",
    )
    parser.add_argument(
        "--sglang-router-request-timeout-secs",
        type=int,
        default=14400,
        help="Timeout for requests to the SGLang router in seconds",
    )
    return parser


# radixark/miles miles/backends/sglang_utils/arguments.py @ 1a661812f077b24e7681ea529f1185a942168618: `_SKIPPED_SERVER_ARGS`, verbatim
_SKIPPED_SERVER_ARGS = [
    "model_path",
    "config",
    "trust_remote_code",
    "random_seed",
    # memory
    "enable_memory_saver",
    # distributed
    # tp_size stays exposed: scripts pass --sglang-tp-size, but the value is
    # overridden from --rollout-num-gpus-per-engine in validate_args below.
    "port",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "gpu_id_step",
    "base_gpu_id",
    "nccl_port",
    "skip_server_warmup",
    "enable_return_routed_experts",
    "enable_return_indexer_topk",
]


# radixark/miles miles/backends/sglang_utils/arguments.py @ 1a661812f077b24e7681ea529f1185a942168618: `_EVAL_SKIPPED_SERVER_ARGS`, verbatim
_EVAL_SKIPPED_SERVER_ARGS = _SKIPPED_SERVER_ARGS + ["tp_size"]


# radixark/miles miles/backends/sglang_utils/arguments.py @ 1a661812f077b24e7681ea529f1185a942168618: `_add_prefixed_server_args`, verbatim
def _add_prefixed_server_args(parser, *, flag_prefix: str, dest_prefix: str, skipped_args: list[str], inherit: bool):
    """Register ``ServerArgs.add_cli_args`` as ``--{flag_prefix}-*`` -> ``args.{dest_prefix}*``.

    ``inherit=True`` defaults to SUPPRESS, so an unset flag leaves no attribute to inherit over.
    """
    old_add_argument = parser.add_argument

    def new_add_argument_wrapper(*name_or_flags, **kwargs):
        """
        Add arguments to the parser, ensuring that the server arguments are prefixed and skippable.
        """
        # Determine the canonical name for skip check (e.g., "model_path")
        canonical_name_for_skip_check = None
        if "dest" in kwargs:
            canonical_name_for_skip_check = kwargs["dest"]
        else:
            for flag_name_candidate in name_or_flags:
                if isinstance(flag_name_candidate, str) and flag_name_candidate.startswith("--"):
                    # Derive from first long flag: --foo-bar -> foo_bar
                    stem = flag_name_candidate[2:]
                    canonical_name_for_skip_check = stem.replace("-", "_")
                    break
            # If no long flag and no dest, skip logic might not catch it unless short flags imply a dest.

        if canonical_name_for_skip_check and canonical_name_for_skip_check in skipped_args:
            return  # Skip this entire argument definition

        # If not skipped, proceed to prefix flags and dest
        new_name_or_flags_list = []
        for item_flag in name_or_flags:
            if isinstance(item_flag, str) and item_flag.startswith("-"):
                original_flag_stem = item_flag.lstrip("-")  # "foo-bar" from "--foo-bar", or "f" from "-f"
                prefixed_item = f"--{flag_prefix}-{original_flag_stem}"
                new_name_or_flags_list.append(prefixed_item)
            else:
                # Positional arguments or non-string items
                new_name_or_flags_list.append(item_flag)

        # Prepare kwargs for the actual add_argument call.
        # Make a copy to avoid modifying the original kwargs dict.
        final_kwargs = kwargs.copy()

        # If 'dest' is explicitly provided and is a string, prefix it.
        # This ensures the attribute on the args namespace becomes, e.g., args.sglang_dest_name.
        if "dest" in final_kwargs and isinstance(final_kwargs["dest"], str):
            original_dest = final_kwargs["dest"]
            # Avoid double prefixing if dest somehow already starts with the prefix
            if not original_dest.startswith(dest_prefix):
                final_kwargs["dest"] = f"{dest_prefix}{original_dest}"
        elif "dest" not in final_kwargs:
            # argparse derives dest from the first alias, so store parallel sizes under SGLang's short field names.
            for item_flag in name_or_flags:
                if not isinstance(item_flag, str) or not item_flag.startswith("--"):
                    continue
                canonical_dest = item_flag[2:].replace("-", "_")
                if canonical_dest in ("tp_size", "dp_size", "pp_size", "ep_size"):
                    final_kwargs["dest"] = f"{dest_prefix}{canonical_dest}"
                    break

        if inherit:
            final_kwargs["default"] = argparse.SUPPRESS
            if final_kwargs.get("action") in ("store_true", "store_false"):
                # store_true can only turn a field on; an override must also turn one off.
                final_kwargs["action"] = argparse.BooleanOptionalAction
                final_kwargs.pop("const", None)
                final_kwargs.pop("nargs", None)

        old_add_argument(*new_name_or_flags_list, **final_kwargs)

    parser.add_argument = new_add_argument_wrapper
    ServerArgs.add_cli_args(parser)
    parser.add_argument = old_add_argument


# radixark/miles miles/backends/sglang_utils/arguments.py @ 1a661812f077b24e7681ea529f1185a942168618: `add_sglang_arguments`, verbatim
def add_sglang_arguments(parser):
    """
    Add arguments to the parser for the SGLang server.
    """
    parser = add_sglang_router_arguments(parser)
    parser.add_argument("--sglang-server-concurrency", type=int, default=512)

    _add_prefixed_server_args(
        parser, flag_prefix="sglang", dest_prefix="sglang_", skipped_args=_SKIPPED_SERVER_ARGS, inherit=False
    )
    _add_prefixed_server_args(
        parser,
        flag_prefix="eval-sglang",
        dest_prefix="eval_sglang_",
        skipped_args=_EVAL_SKIPPED_SERVER_ARGS,
        inherit=True,
    )

    parser.add_argument(
        "--sglang-config",
        type=str,
        default=None,
        help=(
            "Path to a YAML config for SGLang engine deployment. "
            "Defines server_groups with worker_type (regular/prefill/decode/placeholder), "
            "num_gpus per group, and optional per-group 'overrides' dict of "
            "ServerArgs field names that override the base --sglang-* CLI args. "
            "Placeholder groups reserve GPU slots without creating engines. "
            "A 'name: eval' model is filled in from the --eval-* args (model_path, "
            "num_gpus_per_engine, --eval-sglang-* overrides) wherever the YAML leaves them unset. "
            "Mutually exclusive with --prefill-num-servers."
        ),
    )

    return parser


class SGLangEngine:
    """SHIM (not Miles code) around verbatim methods: Miles' SGLangEngine (miles/backends/sglang_utils/sglang_engine.py
    @ 0428a450ba0693675ddab9059b15bf71041e3137) reduced to its weight-update request builders;
    ``_make_request`` records (endpoint, JSON body as sent over HTTP) instead of POSTing it."""

    def __init__(self):
        self.node_rank = 0
        self.requests = []

    def _make_request(self, endpoint: str, payload: dict | None = None):
        self.requests.append((endpoint, json.loads(json.dumps(payload or {}))))
        return {"success": True, "message": "recorded"}

    # radixark/miles miles/backends/sglang_utils/sglang_engine.py @ 0428a450ba0693675ddab9059b15bf71041e3137: `SGLangEngine.update_weights_from_tensor`, verbatim
    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str = "all",
    ):
        """
        Update model weights from tensor data. The HTTP server will only post meta data, and the real weights will be copied directly from GPUs.

        Note: The model should be on GPUs rather than CPU for this functionality to work properly.
        If you encounter issues, ensure your model is loaded on GPU devices rather than CPU.
        """
        payload = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "selector": selector,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request(
            "update_weights_from_tensor",
            payload,
        )


    # radixark/miles miles/backends/sglang_utils/sglang_engine.py @ 0428a450ba0693675ddab9059b15bf71041e3137: `SGLangEngine.update_weights_from_distributed`, verbatim
    def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        group_name,
        flush_cache=False,
        weight_version: str | None = None,
        selector: str = "all",
    ):
        payload = {
            "names": names,
            "dtypes": [str(dtype).replace("torch.", "") for dtype in dtypes],
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "selector": selector,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request(
            "update_weights_from_distributed",
            payload,
        )


    # radixark/miles miles/backends/sglang_utils/sglang_engine.py @ 0428a450ba0693675ddab9059b15bf71041e3137: `SGLangEngine.begin_weight_update`, verbatim
    def begin_weight_update(self, selector: str = "all"):
        """Open a weight-update session on the engine (restores packed weights for loading)."""
        return self._make_request("begin_weight_update", {"selector": selector})


    # radixark/miles miles/backends/sglang_utils/sglang_engine.py @ 0428a450ba0693675ddab9059b15bf71041e3137: `SGLangEngine.end_weight_update`, verbatim
    def end_weight_update(self):
        """Close the weight-update session (post-load + quant post-process on the full model)."""
        return self._make_request("end_weight_update", {})


# =====================================================================================================================
# Weight senders: sessions, Megatron -> HF names (+ FP8 quantization), buckets, and the two transports

# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `begin_weight_update`, verbatim
def begin_weight_update(rollout_engines: Sequence[ActorHandle], selector: str = "all"):
    """Open a weight-update session on the selected rollout engines (restore packed weights)."""
    ray.get([engine.begin_weight_update.remote(selector=selector) for engine in rollout_engines])


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `weight_update_selector`, verbatim
def weight_update_selector(args) -> str:
    """Exclude the draft only when the trainer provably has no MTP block to send it."""
    if (
        getattr(args, "sglang_speculative_algorithm", None)
        and not getattr(args, "mtp_num_layers", None)
        and getattr(args, "megatron_to_hf_mode", "raw") != "bridge"
    ):
        return "target"
    return "all"


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `end_weight_update`, verbatim
def end_weight_update(rollout_engines: Sequence[ActorHandle]):
    """Close the weight-update session (post-load + quant post-process on the full model)."""
    ray.get([engine.end_weight_update.remote() for engine in rollout_engines])


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `_check_weight_sync_results`, verbatim
def _check_weight_sync_results(results: list, *, is_lora: bool) -> None:
    """Validate return values from rollout engine weight-sync RPCs.

    Raises RuntimeError if any engine reports failure, preventing silent
    failures when SGLang versions are incompatible.
    """
    sync_type = "LoRA" if is_lora else "Base model"
    for result in results:
        if isinstance(result, Mapping):
            success = result.get("success")
            error_msg = result.get("error_message") or result.get("error") or "unknown error"
        elif hasattr(result, "success"):
            success = result.success
            error_msg = getattr(result, "error_message", "unknown error")
        else:
            continue

        if success is False:
            raise RuntimeError(
                f"{sync_type} weight sync failed on rollout engine: {error_msg}. "
                f"Check SGLang version compatibility."
            )


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `AtomicUpdateGroup`, verbatim
@dataclasses.dataclass(frozen=True)
class AtomicUpdateGroup:
    key: str
    suffixes: tuple[str, ...]
    optional: bool = False


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `get_atomic_update_groups`, verbatim
def get_atomic_update_groups(args, model_name) -> list[AtomicUpdateGroup]:
    model_groups = _get_model_atomic_update_groups(args, model_name)
    if model_groups:
        return model_groups
    return _get_q_lora_atomic_update_groups(args)


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `_get_q_lora_atomic_update_groups`, verbatim
def _get_q_lora_atomic_update_groups(args) -> list[AtomicUpdateGroup]:
    if args.q_lora_rank is None:
        return []

    return [
        AtomicUpdateGroup(
            key="q_lora_a_proj",
            suffixes=(
                ".self_attention.linear_q_down_proj.weight",
                ".self_attention.linear_kv_down_proj.weight",
            ),
        )
    ]


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `_get_model_atomic_update_groups`, verbatim
def _get_model_atomic_update_groups(args, model_name) -> list[AtomicUpdateGroup]:
    model_name = model_name.lower()
    if "inkling" in model_name:
        from ..megatron_to_hf.inkling import get_inkling_atomic_update_groups

        return get_inkling_atomic_update_groups(args)
    if "deepseekv4" in model_name:
        from ..megatron_to_hf.deepseekv4 import get_deepseek_v4_atomic_update_groups

        return get_deepseek_v4_atomic_update_groups()
    return []


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `NamedUpdateUnit`, verbatim
@dataclasses.dataclass(frozen=True)
class NamedUpdateUnit:
    """A set of params that must be transferred and packed together."""

    names: tuple[str, ...]


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `get_named_update_units`, verbatim
def get_named_update_units(param_names: Sequence[str], atomic_update_groups) -> list[NamedUpdateUnit]:
    position = {}
    for i, name in enumerate(param_names):
        assert name not in position, f"Duplicate param name: {name}"
        position[name] = i

    grouped_names: set[str] = set()
    group_keys: set[str] = set()
    ordered_units: list[tuple[int, NamedUpdateUnit]] = []
    pending_groups: dict[tuple[str, str], list[str | None]] = {}
    matched_group_keys: set[str] = set()

    for group in atomic_update_groups:
        key = group.key
        suffixes = group.suffixes
        assert key not in group_keys, f"Duplicate atomic update group: {key}"
        assert suffixes, f"Atomic update group {key} has no suffixes"
        assert all(suffixes), f"Atomic update group {key} contains empty suffix"
        assert len(set(suffixes)) == len(suffixes), f"Atomic update group {key} contains duplicate suffixes"
        group_keys.add(key)

    for name in param_names:
        matches = [
            (group, suffix_idx, suffix)
            for group in atomic_update_groups
            for suffix_idx, suffix in enumerate(group.suffixes)
            if name.endswith(suffix)
        ]
        assert len(matches) <= 1, f"Param {name} matches multiple atomic update groups"
        if not matches:
            continue

        group, suffix_idx, suffix = matches[0]
        prefix = name[: -len(suffix)]
        names = pending_groups.setdefault((prefix, group.key), [None] * len(group.suffixes))
        names[suffix_idx] = name
        grouped_names.add(name)
        matched_group_keys.add(group.key)

    for group in atomic_update_groups:
        assert (
            group.optional or group.key in matched_group_keys
        ), f"Atomic update group {group.key} references no params matching suffixes {group.suffixes}"

    for (prefix, key), names in pending_groups.items():
        assert all(names), f"Atomic update group {prefix}:{key} is incomplete: {names}"
        resolved_names = tuple(names)
        ordered_units.append((min(position[name] for name in resolved_names), NamedUpdateUnit(names=resolved_names)))

    for name in param_names:
        if name not in grouped_names:
            ordered_units.append((position[name], NamedUpdateUnit(names=(name,))))

    return [unit for _position, unit in sorted(ordered_units, key=lambda item: item[0])]


# radixark/miles miles/backends/megatron_utils/update_weight/common.py @ 52ac174d9747aa4598eb45d05eef4176ca9e64f1: `is_routed_expert_param`, verbatim
def is_routed_expert_param(name: str) -> bool:
    """Whether a Megatron param name belongs to the routed (expert-parallel) experts.

    Routed experts live under ".experts.", but shared experts may nest an inner
    ModuleList (e.g. Inkling's "mlp.shared_experts.experts.N.") whose params are
    regular-TP sharded and EP-replicated, so they must not match.
    """
    return ".experts." in name and ".shared_experts." not in name


# radixark/miles miles/utils/types.py @ 11cc23263d2c4c6247857bb29a8abcf81691bde8: `ParamInfo`, verbatim
@dataclass(frozen=True)
class ParamInfo:
    name: str
    dtype: torch.dtype
    shape: torch.Size
    attrs: dict
    size: int
    src_rank: int


# radixark/miles miles/backends/megatron_utils/update_weight/hf_weight_iterator_direct.py @ 92ccb87de8f5e8ad00df25444a24e95595c2654f: `_get_param_full_size`, verbatim
def _get_param_full_size(info: ParamInfo) -> int:
    if is_routed_expert_param(info.name):
        tp_size = get_parallel_state().etp.size
    else:
        tp_size = get_parallel_state().tp.size
    return info.size * tp_size


# radixark/miles miles/backends/megatron_utils/update_weight/hf_weight_iterator_direct.py @ 92ccb87de8f5e8ad00df25444a24e95595c2654f: `_pack_update_units`, verbatim
def _pack_update_units(
    args: Namespace, param_infos: list[ParamInfo], update_units: list[NamedUpdateUnit]
) -> list[list[ParamInfo]]:
    by_name = {info.name: info for info in param_infos}
    param_info_buckets: list[list[ParamInfo]] = [[]]
    buffer_size = 0

    for unit in update_units:
        params = [by_name[name] for name in unit.names]
        unit_size = sum(_get_param_full_size(param) for param in params)
        if buffer_size + unit_size > args.update_weight_buffer_size and param_info_buckets[-1]:
            param_info_buckets.append([])
            buffer_size = 0
        param_info_buckets[-1].extend(params)
        buffer_size += unit_size

    return param_info_buckets


# radixark/miles miles/backends/megatron_utils/misc_utils.py @ 6ccc2cab6da076b311149db614dfc57b6169049f: `strip_param_name_prefix`, verbatim
def strip_param_name_prefix(name: str | None) -> str | None:
    if name is None:
        return None
    prefix = "module."
    while name.startswith(prefix):
        name = name.removeprefix(prefix)
    return name


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/processors/padding_remover.py @ 4469524729b476ae29c983880ccec012d38690d6: `remove_padding`, verbatim
def remove_padding(name: str, param: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """
    Remove vocab padding: param[:vocab_size] for embedding/output layers, else unchanged.
    """
    if strip_param_name_prefix(name) in {"embedding.word_embeddings.weight", "output_layer.weight"}:
        return param[:vocab_size]
    return param


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/__init__.py @ 5c517599fb55c2528a55c749e6eda5f99f51f0ad: `convert_to_hf`, verbatim
def convert_to_hf(args, model_name, name, param, quantization_config=None):
    param = remove_padding(name, param, args.vocab_size)

    converted_named_tensors = _convert_to_hf_core(args, model_name, name, param)

    return quantize_params(args, name, converted_named_tensors, quantization_config)


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/__init__.py @ 5c517599fb55c2528a55c749e6eda5f99f51f0ad: `_convert_to_hf_core`, verbatim
def _convert_to_hf_core(args, model_name, name, param):
    model_name = model_name.lower()
    if (
        "glm4moelite" in model_name
        or "deepseekv3" in model_name
        or "glmmoedsa" in model_name
        or "glm_moe_dsa" in model_name
    ):
        converted_named_tensors = convert_deepseekv3_to_hf(args, name, param)
    elif "glm4moe" in model_name:
        converted_named_tensors = convert_glm4moe_to_hf(args, name, param)
    elif "glm4" in model_name:
        converted_named_tensors = convert_glm4_to_hf(args, name, param)
    elif "qwen3moe" in model_name:
        converted_named_tensors = convert_qwen3moe_to_hf(args, name, param)
    elif "qwen3next" in model_name:
        converted_named_tensors = convert_qwen3_next_to_hf(args, name, param)
    elif "qwen3_5" in model_name or "qwen3_6" in model_name:
        converted_named_tensors = convert_qwen3_5_to_hf(args, name, param)
    elif "qwen2" in model_name or "qwen3" in model_name:
        converted_named_tensors = convert_qwen2_to_hf(args, name, param)
    elif "deepseekv4" in model_name:
        converted_named_tensors = convert_deepseekv4_to_hf(args, name, param)
    elif "inkling" in model_name:
        converted_named_tensors = convert_inkling_to_hf(args, name, param)
    elif "llama" in model_name:
        converted_named_tensors = convert_llama_to_hf(args, name, param)
    elif "mimo" in model_name:
        converted_named_tensors = convert_mimo_to_hf(args, name, param)
    elif "kimivl" in model_name:
        converted_named_tensors = convert_kimivl_to_hf(args, name, param)
    elif "kimi_k25" in model_name:
        converted_named_tensors = convert_kimi_k25_to_hf(args, name, param)
    else:
        raise ValueError(f"Unsupported model: {model_name}")

    return converted_named_tensors


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/qwen2.py @ b8649e6cd2a5772ec7461baa22d6cdb42b9f5564: `convert_qwen2_to_hf`, verbatim
def convert_qwen2_to_hf(args, name, param):
    if name == "module.module.embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", param)]
    if name == "module.module.output_layer.weight":
        return [("lm_head.weight", param)]
    if name == "module.module.decoder.final_layernorm.weight":
        return [("model.norm.weight", param)]

    try:
        head_dim = args.kv_channels if args.kv_channels is not None else args.hidden_size // args.num_attention_heads
    except AttributeError:
        head_dim = args.hidden_size // args.num_attention_heads
    value_num_per_group = args.num_attention_heads // args.num_query_groups

    decoder_layers_pattern = r"module\.module\.decoder\.layers\.(\d+)\.(.+)"
    match = re.match(decoder_layers_pattern, name)
    if match:
        layer_idx, rest = match.groups()
        if rest == "self_attention.linear_proj.weight":
            return [(f"model.layers.{layer_idx}.self_attn.o_proj.weight", param)]
        elif rest == "self_attention.linear_qkv.weight":

            param = param.view(args.num_query_groups, -1, head_dim, args.hidden_size)
            q_param, k_param, v_param = torch.split(param, split_size_or_sections=[value_num_per_group, 1, 1], dim=1)
            q_param = q_param.reshape(-1, args.hidden_size)
            k_param = k_param.reshape(-1, args.hidden_size)
            v_param = v_param.reshape(-1, args.hidden_size)
            return [
                (f"model.layers.{layer_idx}.self_attn.q_proj.weight", q_param),
                (f"model.layers.{layer_idx}.self_attn.k_proj.weight", k_param),
                (f"model.layers.{layer_idx}.self_attn.v_proj.weight", v_param),
            ]
        elif rest == "self_attention.linear_qkv.bias":
            param = param.view(args.num_query_groups, -1)
            q_bias, k_bias, v_bias = torch.split(
                param,
                split_size_or_sections=[value_num_per_group * head_dim, head_dim, head_dim],
                dim=1,
            )
            q_bias = q_bias.contiguous().flatten()
            k_bias = k_bias.contiguous().flatten()
            v_bias = v_bias.contiguous().flatten()
            return [
                (f"model.layers.{layer_idx}.self_attn.q_proj.bias", q_bias),
                (f"model.layers.{layer_idx}.self_attn.k_proj.bias", k_bias),
                (f"model.layers.{layer_idx}.self_attn.v_proj.bias", v_bias),
            ]
        elif rest == "mlp.linear_fc1.weight":
            gate_weight, up_weight = param.chunk(2, dim=0)
            return [
                (f"model.layers.{layer_idx}.mlp.gate_proj.weight", gate_weight),
                (f"model.layers.{layer_idx}.mlp.up_proj.weight", up_weight),
            ]
        elif rest == "mlp.linear_fc2.weight":
            return [(f"model.layers.{layer_idx}.mlp.down_proj.weight", param)]
        elif rest == "self_attention.linear_qkv.layer_norm_weight":
            return [(f"model.layers.{layer_idx}.input_layernorm.weight", param)]
        elif rest == "input_layernorm.weight":
            return [(f"model.layers.{layer_idx}.input_layernorm.weight", param)]
        elif rest == "mlp.linear_fc1.layer_norm_weight":
            return [(f"model.layers.{layer_idx}.post_attention_layernorm.weight", param)]
        elif rest == "pre_mlp_layernorm.weight":
            return [(f"model.layers.{layer_idx}.post_attention_layernorm.weight", param)]

        # qk norm
        elif rest == "self_attention.q_layernorm.weight":
            return [(f"model.layers.{layer_idx}.self_attn.q_norm.weight", param)]
        elif rest == "self_attention.k_layernorm.weight":
            return [(f"model.layers.{layer_idx}.self_attn.k_norm.weight", param)]

    raise ValueError(f"Unknown parameter name: {name}")


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/processors/__init__.py @ 1fca8f8b6f023a76f984f0fdc7d8c2c44bb09d4c: `quantize_params`, verbatim
def quantize_params(args, megatron_name, converted_named_params, quantization_config):
    if quantization_config is None:
        return converted_named_params
    elif quantization_config["quant_method"] == "fp8":
        return quantize_params_fp8(args, megatron_name, converted_named_params, quantization_config)
    elif quantization_config["quant_method"] == "mxfp8":
        return quantize_params_mxfp8(args, megatron_name, converted_named_params, quantization_config)
    elif quantization_config.get("quant_algo") == "NVFP4" or quantization_config["quant_method"] == "nvfp4":
        return quantize_params_nvfp4(args, megatron_name, converted_named_params, quantization_config)
    elif quantization_config["quant_method"] == "compressed-tensors":
        # only int4 at the moment.
        return quantize_params_compressed_tensors(converted_named_params, quantization_config)


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/processors/quantizer_fp8.py @ 5c0c52f3869af4f210631e5158c81673a3df7eea: `quantize_params_fp8`, verbatim
def quantize_params_fp8(args, megatron_name, converted_named_params, quantization_config):
    assert quantization_config["quant_method"] == "fp8"
    fmt = quantization_config.get("fmt", "e4m3")
    assert fmt == "e4m3", f"Unsupported FP8 format: {fmt}"
    assert quantization_config["activation_scheme"] == "dynamic"
    weight_block_size = quantization_config.get("weight_block_size", None)

    decoder_layers_pattern = r"module\.module\.decoder\.layers\.(\d+)\.(.+)"
    match = re.match(decoder_layers_pattern, megatron_name)

    if not match:
        # check mtp layers
        mtp_layer_pattern = r"module\.module\.mtp\.layers\.(\d+)\.(.+)"
        match = re.match(mtp_layer_pattern, megatron_name)
        if not match:
            return converted_named_params
        layer_idx, rest = match.groups()
        rest = rest.replace("transformer_layer.", "")
    else:
        layer_idx, rest = match.groups()

    # experts
    expert_pattern = r"mlp.experts\.(.+)\.weight(\d+)"
    match = re.match(expert_pattern, rest)
    if match:
        rest, expert_idx = match.groups()
        if rest in [
            "linear_fc1",
            "linear_fc2",
        ]:
            quantize_named_params = []
            for converted_name, param in converted_named_params:
                # skip bf16 weight_scale and input_scale
                # TODO: find a clearer way.
                if converted_name.endswith("_scale"):
                    continue
                quantize_named_params.extend(_quantize_param(args, converted_name, param, weight_block_size))

            return quantize_named_params

    # shared expert
    shared_expert_pattern = r"mlp.shared_experts\.(.+)"
    match = re.match(shared_expert_pattern, rest)
    if match:
        rest = match.groups()[0]
        if rest in [
            "linear_fc1.weight",
            "linear_fc2.weight",
        ]:
            quantize_named_params = []
            for converted_name, param in converted_named_params:
                quantize_named_params.extend(_quantize_param(args, converted_name, param, weight_block_size))

            return quantize_named_params

    fp8_param_names = [
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        # mla
        "self_attention.linear_q_proj.weight",
        "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_q_up_proj.weight",
        "self_attention.linear_kv_down_proj.weight",
        "self_attention.linear_kv_up_proj.weight",
        # DSA indexer
        "self_attention.wq_b.weight",
        # linear attention
        "self_attention.linear_attn.in_proj_qkv.weight",
        "self_attention.linear_attn.in_proj_z.weight",
        "self_attention.linear_attn.out_proj.weight",
        # DeepSeek V4 attention
        "self_attention.wq_a.weight",
        "self_attention.wkv.weight",
        "self_attention.wo_b.weight",
        "self_attention.indexer.linear_wq_b.weight",
    ]
    if not getattr(args, "indexer_rope_interleave", False):
        # Non-interleaved indexers keep wk as a standalone FP8 parameter in SGLang.
        fp8_param_names.extend(
            [
                "self_attention.wk.weight",
                "self_attention.indexer.linear_wk.weight",
            ]
        )

    if rest in fp8_param_names:
        quantize_named_params = []
        for converted_name, param in converted_named_params:
            quantize_named_params.extend(_quantize_param(args, converted_name, param, weight_block_size))

        return quantize_named_params

    # for other parameters, we just return the original converted_named_params
    return converted_named_params


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/processors/quantizer_fp8.py @ 5c0c52f3869af4f210631e5158c81673a3df7eea: `_quantize_param`, verbatim
def _quantize_param(args, name, weight, weight_block_size):
    assert name.endswith(".weight"), f"Expected weight parameter, got {name}"
    FP8_MIN = torch.finfo(torch.float8_e4m3fn).min
    FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
    if weight_block_size is not None:
        if _get_scale_format(args, name, weight_block_size) == "ue8m0":
            qweight, scale = quant_weight_ue8m0(weight, weight_block_size=weight_block_size)
            scale = transform_scale_ue8m0(scale, mn=qweight.shape[-2])
        # TODO: this [128, 128] is hacky. need improve
        elif (
            os.environ["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "0"
            and per_block_cast_to_fp8 is not None
            and list(weight_block_size) == [128, 128]
        ):
            qweight, scale = per_block_cast_to_fp8(weight)
        else:
            qweight, scale = blockwise_cast_to_fp8_triton(weight, weight_block_size)
        scale_name = name.replace(".weight", ".weight_scale_inv")
    else:
        # per tensor quant
        scale = weight.abs().max().clamp(min=1e-12).to(torch.float32) / FP8_MAX
        qweight = (weight / scale).clamp(min=FP8_MIN, max=FP8_MAX).to(torch.float8_e4m3fn)
        scale = scale.view(1)
        scale_name = name.replace(".weight", ".weight_scale")
    return [(name, qweight), (scale_name, scale)]


# radixark/miles miles/backends/megatron_utils/megatron_to_hf/processors/quantizer_fp8.py @ 5c0c52f3869af4f210631e5158c81673a3df7eea: `_get_scale_format`, verbatim
def _get_scale_format(args, name, weight_block_size):
    if not (
        should_deepgemm_weight_requant_ue8m0
        and should_deepgemm_weight_requant_ue8m0(weight_block_size=weight_block_size)
    ):
        return None  # use default fp32 scale format

    if ".experts." not in name:
        # Non-MoE linear weights: ue8m0 when deepgemm is enabled
        return "ue8m0"

    # MoE expert weights: only ue8m0 when runner is deep_gemm
    is_deepgemm_moe_backend = args.sglang_moe_runner_backend == "deep_gemm" or (
        args.sglang_moe_runner_backend == "auto" and args.sglang_moe_a2a_backend in ["deepep", "mooncake"]
    )
    return "ue8m0" if is_deepgemm_moe_backend else None


# radixark/miles miles/backends/megatron_utils/update_weight/update_weight_from_tensor.py @ 92ccb87de8f5e8ad00df25444a24e95595c2654f: `_repack_onto_fresh_storage`, verbatim
def _repack_onto_fresh_storage(
    named_tensors: list[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Copy CUDA tensors into freshly allocated flat buffers and return views onto them.

    ``torch_memory_saver.region()`` is a ``torch.cuda.use_mem_pool`` context, so anything
    allocated while building the model -- the LoRA adapter parameters included -- lives in
    a MemPool the preloaded hook backs with cuMem. cuMem allocations cannot be exported
    over the legacy CUDA IPC API that ``MultiprocessingSerializer`` uses, so handing their
    storages straight to the engine fails with "CUDA error: invalid argument" on the first
    sync. Allocating here, outside any region, gets normal caching-allocator memory whose
    handles export fine. (This is also why the FlattenedTensorBucket path works: its
    flattened tensor is likewise allocated at sync time.)

    One buffer per (dtype, device) rather than one clone per tensor: the direct-dict
    transport relies on the pickler memoizing storages so the engine receives a handful of
    IPC handles instead of one per adapter tensor.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        if tensor.is_cuda:
            groups.setdefault((tensor.dtype, tensor.device), []).append((name, tensor))

    views: dict[str, torch.Tensor] = {}
    for (dtype, device), items in groups.items():
        flat = torch.empty(sum(t.numel() for _, t in items), dtype=dtype, device=device)
        offset = 0
        for name, tensor in items:
            view = flat[offset : offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            views[name] = view
            offset += tensor.numel()

    return {name: views.get(name, tensor) for name, tensor in named_tensors}


# radixark/miles miles/backends/megatron_utils/update_weight/update_weight_from_tensor.py @ 92ccb87de8f5e8ad00df25444a24e95595c2654f: `_send_to_colocated_engine`, verbatim
def _send_to_colocated_engine(
    hf_named_tensors: list[tuple[str, torch.Tensor]],
    *,
    ipc_engine,
    ipc_gather_src,
    ipc_gather_group,
    weight_version=None,
    lora_config: dict | None = None,
    lora_name: str | None = None,
    lora_loaded: bool = False,
    check_equal: bool = False,
    selector: str = "all",
    repack_lora_for_ipc: bool = False,
) -> tuple[list[ObjectRef], Any]:
    # Placeholder ranks (GPU slots reserved but no engine) have no gather group.
    # gather_object is only collective among group members, so we skip entirely.
    if ipc_gather_group is None:
        return [], None

    is_lora = lora_config is not None
    is_gather_src = dist.get_rank() == ipc_gather_src
    long_live_tensors = []

    if is_lora:
        payload = _repack_onto_fresh_storage(hf_named_tensors) if repack_lora_for_ipc else dict(hf_named_tensors)
        long_live_tensors.append(payload)
        converted_named_tensors_by_dtypes = {}
        serialized_lora = MultiprocessingSerializer.serialize(payload, output_str=True)
    elif getattr(FlattenedTensorBucket, "supports_multi_dtypes", False):
        converted_named_tensors_by_dtypes = {"dtype": hf_named_tensors}
    else:
        converted_named_tensors_by_dtypes = {}
        for name, tensor in hf_named_tensors:
            dtype = tensor.dtype
            if dtype not in converted_named_tensors_by_dtypes:
                converted_named_tensors_by_dtypes[dtype] = []
            converted_named_tensors_by_dtypes[dtype].append((name, tensor))

    serialized_tensors: list = [serialized_lora] if is_lora else []
    for _dtype, named_tensors in converted_named_tensors_by_dtypes.items():
        flattened_tensor_bucket = FlattenedTensorBucket(named_tensors=named_tensors)
        flattened_tensor_data = {
            "flattened_tensor": flattened_tensor_bucket.get_flattened_tensor(),
            "metadata": flattened_tensor_bucket.get_metadata(),
        }
        long_live_tensors.append(flattened_tensor_data)
        serialized_tensors.append(MultiprocessingSerializer.serialize(flattened_tensor_data, output_str=True))

    serialized_named_tensors = [None] * dist.get_world_size(ipc_gather_group) if is_gather_src else None
    dist.gather_object(
        serialized_tensors,
        object_gather_list=serialized_named_tensors,
        dst=ipc_gather_src,
        group=ipc_gather_group,
    )

    refs = []
    if is_gather_src:
        if is_lora:
            try:
                ray.get(ipc_engine.unload_lora_adapter.remote(lora_name=lora_name))
            except Exception as _unload_err:
                logger.debug("lora unload before load skipped: %s", _unload_err)

            expected_checksums = None
            if check_equal:
                expected_checksums = {
                    n: hashlib.sha256(
                        t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
                    ).hexdigest()
                    for n, t in hf_named_tensors
                }

            refs.append(
                ipc_engine.load_lora_adapter_from_tensors.remote(
                    lora_name=lora_name,
                    config_dict=lora_config,
                    serialized_named_tensors=[
                        per_rank[0] if per_rank else None for per_rank in serialized_named_tensors
                    ],
                    expected_checksums=expected_checksums,
                )
            )

        else:
            num_dtypes = len(serialized_named_tensors[0])
            for i in range(num_dtypes):
                kwargs = {
                    "serialized_named_tensors": [tensors[i] for tensors in serialized_named_tensors],
                    "load_format": "flattened_bucket",
                    "weight_version": str(weight_version),
                    "selector": selector,
                }
                refs.append(ipc_engine.update_weights_from_tensor.remote(**kwargs))

    return refs, long_live_tensors


# radixark/miles miles/backends/megatron_utils/update_weight/update_weight_from_distributed/broadcast.py @ 571612c0b4c66dc2f5ae5cce4d8a1eb75c854182: `update_weights_from_distributed`, verbatim
def update_weights_from_distributed(
    group_name: str,
    group: dist.ProcessGroup,
    weight_version: int,
    rollout_engines: Sequence[ActorHandle],
    converted_named_tensors: Sequence[tuple[str, torch.Tensor]],
    selector: str = "all",
) -> list[ObjectRef]:
    """
    Send metadata (Ray), broadcast tensors (NCCL rank 0 → engines).
    """
    refs = [
        engine.update_weights_from_distributed.remote(
            names=[name for name, _ in converted_named_tensors],
            dtypes=[param.dtype for _, param in converted_named_tensors],
            shapes=[param.shape for _, param in converted_named_tensors],
            selector=selector,
            group_name=group_name,
            weight_version=str(weight_version),
        )
        for engine in rollout_engines
    ]

    contiguous_tensors = [
        param.data if param.data.is_contiguous() else param.data.contiguous() for _, param in converted_named_tensors
    ]
    handles = []
    for tensor in contiguous_tensors:
        handles.append(dist.broadcast(tensor, 0, group=group, async_op=True))
    for handle in handles:
        handle.wait()

    return refs
