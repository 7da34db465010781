"""slime's (THUDM/slime) SGLang argument parser, server-args builder and weight senders, copied verbatim.

Snapshot THUDM/slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21); every copy below names its file and the commit
that last changed that file. Nothing in a copied body is edited. What slime imports from Megatron, Ray, sglang_router
and its own helpers is replaced by the shims in the SHIMS section, each marked "SHIM (not slime code)"; a trainer of
one rank (TP=PP=EP=1), as in a single-GPU slime run, runs without a torch.distributed default group.

The FP8 quantizer is slime's Triton kernel: on CPU run it under the Triton interpreter (TRITON_INTERPRET=1 before
anything imports triton), where its FP8 rounding may differ from a GPU's; the tests compare the engine with what this
sender produced, whatever the codes are.
"""

# ruff: noqa

import argparse
import dataclasses
import json
import logging
import re
from argparse import Namespace
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed
import triton
import triton.language as tl
import yaml

from sglang_fp8rl.cpu_runner import install_cpu_stubs

install_cpu_stubs()  # SHIM (not slime code): lets SGLang import without torchvision on this CPU-only machine

from sglang.srt.server_args import ServerArgs  # as in slime/backends/sglang_utils/arguments.py

logger = logging.getLogger(__name__)

# THUDM/slime slime/backends/megatron_utils/sglang.py @ af3d7fff60f62450588ff8b7854c294a681248b8, verbatim (the SGLang symbols slime's trainer uses)
try:
    from sglang.srt.layers.quantization.fp8_utils import quant_weight_ue8m0, transform_scale_ue8m0
    from sglang.srt.model_loader.utils import should_deepgemm_weight_requant_ue8m0
except ImportError:
    quant_weight_ue8m0 = None
    transform_scale_ue8m0 = None
    should_deepgemm_weight_requant_ue8m0 = None

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
    "quant_weight_ue8m0",
    "transform_scale_ue8m0",
    "should_deepgemm_weight_requant_ue8m0",
    "monkey_patch_torch_reductions",
    "MultiprocessingSerializer",
    "FlattenedTensorBucket",
]

# =====================================================================================================================
# SHIMS (not slime code): what slime imports from Megatron, Ray, sglang_router and its own helpers


class RouterArgs:
    """SHIM (not slime code): sglang_router.launch_router.RouterArgs; its `--router-*` flags are not SGLang's and
    sglang_router is not installed here."""

    @staticmethod
    def add_cli_args(parser, use_router_prefix=False, exclude_host_port=False):
        return parser


def _wrap_ipv6(host):
    """SHIM (not slime code): slime.utils.http_utils._wrap_ipv6 for the IPv4 hosts of these tests."""
    return host


class _Accelerator:
    """SHIM (not slime code): slime.utils.accelerator on the CPU."""

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def resolve_visible_device_id(device_id):
        return device_id


accelerator = _Accelerator()


class _Mpu:
    """SHIM (not slime code): megatron.core.mpu of a one-rank trainer."""

    @staticmethod
    def get_tensor_model_parallel_world_size():
        return 1

    @staticmethod
    def get_expert_tensor_parallel_world_size():
        return 1


mpu = _Mpu()


class _Dist:
    """SHIM (not slime code): torch.distributed, where a process without a default group is trainer rank 0 and its IPC
    gather group (``gather_world_size`` colocated ranks, 1 by default) collects from ranks that had nothing to send
    in this chunk (``serialized_tensors == []``, as an expert-parallel rank without experts in it sends)."""

    gather_world_size = 1

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def get_rank(self, group=None):
        return torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0

    def get_world_size(self, group=None):
        return torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else self.gather_world_size

    def gather_object(self, obj, object_gather_list=None, dst=0, group=None):
        if torch.distributed.is_initialized():
            return torch.distributed.gather_object(obj, object_gather_list, dst=dst, group=group)
        object_gather_list[0] = obj
        for rank in range(1, len(object_gather_list)):
            object_gather_list[rank] = []


dist = _Dist()


class _RemoteMethod:
    def __init__(self, method):
        self.method = method

    def remote(self, *args, **kwargs):
        return self.method(*args, **kwargs)


class RayActor:
    """SHIM (not slime code): a Ray actor handle; ``handle.method.remote(...)`` runs the method in place and returns its
    result where Ray returns an ObjectRef."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        return _RemoteMethod(getattr(self.actor, name))


ObjectRef = Any  # SHIM (not slime code): ray.ObjectRef
ActorHandle = Any  # SHIM (not slime code): ray.actor.ActorHandle


def _not_vendored(*args, **kwargs):
    """SHIM (not slime code): the converters of other model families, not copied."""
    raise NotImplementedError("only slime's Qwen2/Qwen3 converter is vendored")


convert_deepseekv3_to_hf = convert_glm4_to_hf = convert_glm4moe_to_hf = convert_llama_to_hf = _not_vendored
convert_mimo_to_hf = convert_minimax_m2_to_hf = convert_qwen3_5_to_hf = convert_qwen3_next_to_hf = _not_vendored
convert_qwen3vl_to_hf = convert_qwen3moe_to_hf = _not_vendored

# =====================================================================================================================
# Launch: the `--sglang-*` parser, --sglang-config, and the ServerArgs kwargs of each rollout engine

# THUDM/slime slime/backends/sglang_utils/arguments.py @ 1494c50069a3cdef24aaf5f8b94c1eb378c72e2c: `add_sglang_router_arguments`, verbatim
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
        "--sglang-router-request-timeout-secs",
        type=int,
        default=14400,
        help="Timeout for requests to the SGLang router in seconds",
    )
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    # Keep driver logs quiet by default while allowing --router-log-level to
    # expose router dispatch and retry details when needed.
    parser.set_defaults(router_log_level="warn")
    return parser


# THUDM/slime slime/backends/sglang_utils/arguments.py @ 1494c50069a3cdef24aaf5f8b94c1eb378c72e2c: `add_sglang_arguments`, verbatim
def add_sglang_arguments(parser):
    """
    Add arguments to the parser for the SGLang server.
    """
    parser = add_sglang_router_arguments(parser)
    parser.set_defaults(router_balance_abs_threshold=10, router_balance_rel_threshold=1.2)
    parser.add_argument("--sglang-server-concurrency", type=int, default=512)

    old_add_argument = parser.add_argument

    skipped_args = [
        "model_path",
        "config",
        "trust_remote_code",
        "random_seed",
        # memory
        "enable_memory_saver",
        # distributed
        "tp_size",
        "port",
        "nnodes",
        "node_rank",
        "dist_init_addr",
        "gpu_id_step",
        "base_gpu_id",
        "nccl_port",
        "skip_server_warmup",
        "enable_return_routed_experts",
    ]

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
                prefixed_item = f"--sglang-{original_flag_stem}"
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
            # Avoid double prefixing if dest somehow already starts with sglang_
            if not original_dest.startswith("sglang_"):
                final_kwargs["dest"] = f"sglang_{original_dest}"
        # If 'dest' is not explicitly provided (or is None/not a string),
        # argparse will derive 'dest' from the (now prefixed) flag names.
        # E.g., if the first flag is "--sglang-foo-bar", argparse sets dest to "sglang_foo_bar".

        old_add_argument(*new_name_or_flags_list, **final_kwargs)

    parser.add_argument = new_add_argument_wrapper
    ServerArgs.add_cli_args(parser)
    parser.add_argument = old_add_argument

    # PD disaggregation / multi-group config
    parser.add_argument(
        "--prefill-num-servers",
        type=int,
        default=None,
        help="Number of prefill servers for disaggregation.",
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
            "Mutually exclusive with --prefill-num-servers."
        ),
    )

    return parser


# THUDM/slime slime/backends/sglang_utils/arguments.py @ 1494c50069a3cdef24aaf5f8b94c1eb378c72e2c: `validate_args`, verbatim
def validate_args(args):
    # Older SGLang versions stored these CLI aliases under their long names,
    # while newer versions use the short ServerArgs field names as argparse dests.
    # Keep both attributes available for user code, preferring the newer names
    # when a namespace happens to contain both.
    for current_name, legacy_name in (
        ("sglang_dp_size", "sglang_data_parallel_size"),
        ("sglang_pp_size", "sglang_pipeline_parallel_size"),
        ("sglang_ep_size", "sglang_expert_parallel_size"),
        ("sglang_moe_dp_size", "sglang_moe_data_parallel_size"),
    ):
        if hasattr(args, current_name):
            value = getattr(args, current_name)
        elif hasattr(args, legacy_name):
            value = getattr(args, legacy_name)
        else:
            logger.warning(
                "The installed SGLang registered neither %s nor %s; "
                "skipping compatibility alias normalization for this parameter.",
                current_name,
                legacy_name,
            )
            continue
        setattr(args, current_name, value)
        setattr(args, legacy_name, value)

    # Compute effective TP size considering PP size
    if args.sglang_pp_size > 1:
        assert args.rollout_num_gpus_per_engine % args.sglang_pp_size == 0, (
            f"rollout_num_gpus_per_engine ({args.rollout_num_gpus_per_engine}) must be divisible by "
            f"sglang_pipeline_parallel_size ({args.sglang_pp_size})"
        )
        args.sglang_tp_size = args.rollout_num_gpus_per_engine // args.sglang_pp_size
    else:
        args.sglang_tp_size = args.rollout_num_gpus_per_engine

    if args.sglang_dp_size > 1:
        assert args.sglang_enable_dp_attention

    if getattr(args, "sglang_router_ip", None):
        args.sglang_router_ip = _wrap_ipv6(args.sglang_router_ip)

    # Mutual-exclusion checks for PD disaggregation / sglang-config.
    assert not (
        getattr(args, "prefill_num_servers", None) is not None and getattr(args, "rollout_external", False)
    ), "prefill_num_servers cannot be set with --rollout-external-engine-addrs."

    assert not (
        getattr(args, "sglang_config", None) is not None and getattr(args, "rollout_external", False)
    ), "sglang_config cannot be set with --rollout-external-engine-addrs."

    assert not (
        getattr(args, "sglang_config", None) is not None and getattr(args, "prefill_num_servers", None) is not None
    ), "sglang_config and prefill_num_servers are mutually exclusive. Use server_groups in the YAML config instead."


# THUDM/slime slime/backends/sglang_utils/arguments.py @ 1494c50069a3cdef24aaf5f8b94c1eb378c72e2c: `sglang_parse_args`, verbatim
def sglang_parse_args():
    """
    Parse sglang server arguments independently using a separate ArgumentParser.
    Uses parse_known_args() to only consume sglang-related arguments from sys.argv,
    allowing the remaining arguments to be parsed by megatron separately.

    Returns:
        argparse.Namespace: Parsed sglang arguments (all attributes prefixed with sglang_).
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_sglang_arguments(parser)

    # Compute default sglang_tensor_parallel_size from CLI args
    temp_parser = argparse.ArgumentParser(add_help=False)
    temp_parser.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    temp_parser.add_argument("--sglang-pp-size", type=int, default=1)
    temp_parser.add_argument("--sglang-pipeline-parallel-size", type=int, default=1)
    temp_args, _ = temp_parser.parse_known_args()
    pp_size = temp_args.sglang_pp_size if temp_args.sglang_pp_size != 1 else temp_args.sglang_pipeline_parallel_size
    sglang_tp_size = temp_args.rollout_num_gpus_per_engine // pp_size
    parser.set_defaults(sglang_tensor_parallel_size=sglang_tp_size)

    args, _ = parser.parse_known_args()
    return args


# THUDM/slime slime/backends/sglang_utils/sglang_config.py @ 6f11313004dbe71f4194536335b891371eefd0e9: `ServerGroupConfig`, verbatim
@dataclasses.dataclass
class ServerGroupConfig:
    """Configuration for a single server group.

    Attributes:
        worker_type: One of "regular", "prefill", "decode", "placeholder",
                     or "encoder".
                     "placeholder" reserves GPU slots without creating engines.
                     "encoder" creates encoder-only engines for EPD
                     (Encoder-Prefill-Decode) disaggregation; encoder engines
                     are started first and their URLs are automatically
                     injected into prefill groups as ``encoder_urls``.
        num_gpus: Total number of GPUs for this group.
        num_gpus_per_engine: GPUs per engine for this group.  Overrides the
                             model-level or global ``--rollout-num-gpus-per-engine``.
        overrides: Optional dict of SGLang ``ServerArgs`` field overrides.
                   These are applied on top of the base CLI ``--sglang-*``
                   arguments in ``_compute_server_args``.
    """

    worker_type: str
    num_gpus: int
    num_gpus_per_engine: int | None = None
    overrides: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        valid_types = {"regular", "prefill", "decode", "placeholder", "encoder"}
        assert (
            self.worker_type in valid_types
        ), f"Invalid worker_type '{self.worker_type}', must be one of {valid_types}"
        assert self.num_gpus > 0, f"num_gpus must be > 0, got {self.num_gpus}"


# THUDM/slime slime/backends/sglang_utils/sglang_config.py @ 6f11313004dbe71f4194536335b891371eefd0e9: `ModelConfig`, verbatim
@dataclasses.dataclass
class ModelConfig:
    """Configuration for a single model deployment.

    Attributes:
        name: Unique name for this model (e.g. "actor", "reward").
        model_path: HF checkpoint path.  Falls back to ``args.hf_checkpoint``.
        num_gpus_per_engine: Default GPUs per engine for all groups in this
                             model.  Individual groups can override.
        server_groups: Server group configurations for this model.
        update_weights: Whether this model receives weight updates from
                        training.  Set to ``False`` for frozen models
                        (reference, reward, etc.).  When ``None`` (default),
                        automatically inferred in ``resolve()``: ``True`` if
                        model_path matches ``args.hf_checkpoint``, ``False``
                        otherwise.
    """

    name: str
    model_path: str | None = None
    num_gpus_per_engine: int | None = None
    server_groups: list[ServerGroupConfig] = dataclasses.field(default_factory=list)
    update_weights: bool | None = None

    def resolve(self, args) -> None:
        """Resolve per-group defaults from model-level then args-level values."""
        default_gpus_per_engine = self.num_gpus_per_engine or args.rollout_num_gpus_per_engine
        default_model_path = self.model_path or args.hf_checkpoint
        for g in self.server_groups:
            if g.num_gpus_per_engine is None:
                g.num_gpus_per_engine = default_gpus_per_engine
            # Inject model_path into overrides so _compute_server_args picks it up.
            if "model_path" not in g.overrides:
                g.overrides["model_path"] = default_model_path

        # Validate: all server groups within a model must share the same model_path.
        if self.server_groups:
            model_paths = {g.overrides["model_path"] for g in self.server_groups}
            assert len(model_paths) == 1, (
                f"Model '{self.name}' has server groups with different model_path values: "
                f"{model_paths}. All server groups within a model must use the same model_path."
            )
            effective_model_path = model_paths.pop()
        else:
            effective_model_path = default_model_path

        # Auto-infer update_weights when not explicitly set.
        if self.update_weights is None:
            if effective_model_path != args.hf_checkpoint:
                logger.warning(
                    f"Model '{self.name}' uses model_path='{effective_model_path}' which differs "
                    f"from hf_checkpoint='{args.hf_checkpoint}'. Defaulting update_weights to False. "
                    f"Set update_weights explicitly in the config to suppress this warning."
                )
                self.update_weights = False
            else:
                self.update_weights = True

    @property
    def has_pd_disaggregation(self) -> bool:
        return any(g.worker_type in ("prefill", "decode") for g in self.server_groups)

    @property
    def has_encoder_disaggregation(self) -> bool:
        return any(g.worker_type == "encoder" for g in self.server_groups)

    @property
    def total_num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.server_groups)


# THUDM/slime slime/backends/sglang_utils/sglang_config.py @ 6f11313004dbe71f4194536335b891371eefd0e9: `SglangConfig`, verbatim
@dataclasses.dataclass
class SglangConfig:
    """Configuration for SGLang engine deployment.

    Loaded from ``--sglang-config`` YAML file.

    **Config format**::

        sglang:
          - name: actor
            model_path: /path/to/actor
            update_weights: true          # receives training weight updates (default)
            num_gpus_per_engine: 2
            server_groups:
              - worker_type: prefill
                num_gpus: 4
                num_gpus_per_engine: 2
              - worker_type: decode
                num_gpus: 8
                num_gpus_per_engine: 4
          - name: ref
            model_path: /path/to/ref
            update_weights: false          # frozen, no weight updates
            server_groups:
              - worker_type: regular
                num_gpus: 4

    Each model gets its own router.  ``placeholder`` groups reserve GPU
    slots without creating engines.  ``overrides`` are ``ServerArgs``
    field names applied on top of the base ``--sglang-*`` CLI args.

    Set ``update_weights: false`` for frozen models (reference, reward,
    etc.) that should not receive weight updates from training.

    .. note::

       ``engine_groups`` is accepted as a backward-compatible alias for
       ``server_groups`` in the YAML config.
    """

    models: list[ModelConfig]

    @staticmethod
    def from_yaml(path: str) -> "SglangConfig":
        with open(path) as f:
            data = yaml.safe_load(f)

        assert "sglang" in data, (
            f"sglang config must have a 'sglang' key, got {list(data.keys())}. "
            f"Wrap your server_groups inside a model entry under 'sglang'."
        )
        models = []
        for m in data["sglang"]:
            # Accept both "server_groups" and legacy "engine_groups".
            raw_groups = m.get("server_groups") or m.get("engine_groups") or []
            groups = [ServerGroupConfig(**g) for g in raw_groups]
            models.append(
                ModelConfig(
                    name=m["name"],
                    model_path=m.get("model_path"),
                    num_gpus_per_engine=m.get("num_gpus_per_engine"),
                    server_groups=groups,
                    update_weights=m.get("update_weights"),
                )
            )
        return SglangConfig(models=models)

    @staticmethod
    def from_prefill_num_servers(args) -> "SglangConfig":
        """Build a config equivalent to the legacy --prefill-num-servers flag."""
        total_gpus = args.rollout_num_gpus
        prefill_gpus = args.prefill_num_servers * args.rollout_num_gpus_per_engine
        decode_gpus = total_gpus - prefill_gpus
        assert decode_gpus > 0, f"No decode GPUs: total {total_gpus}, prefill {prefill_gpus}"
        return SglangConfig(
            models=[
                ModelConfig(
                    name="default",
                    server_groups=[
                        ServerGroupConfig(worker_type="prefill", num_gpus=prefill_gpus),
                        ServerGroupConfig(worker_type="decode", num_gpus=decode_gpus),
                    ],
                )
            ]
        )

    @property
    def has_pd_disaggregation(self) -> bool:
        return any(m.has_pd_disaggregation for m in self.models)

    @property
    def total_num_gpus(self) -> int:
        return sum(m.total_num_gpus for m in self.models)


# THUDM/slime slime/backends/sglang_utils/sglang_engine.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `get_base_gpu_id`, verbatim
def get_base_gpu_id(args, rank):
    num_gpus = min(args.num_gpus_per_node, args.rollout_num_gpus_per_engine)
    if args.colocate:
        start_index = (rank * num_gpus) % args.num_gpus_per_node
    else:
        num_actor_gpus = 0 if args.debug_rollout_only else args.actor_num_gpus_per_node * args.actor_num_nodes
        start_index = (num_actor_gpus + rank * num_gpus) % args.num_gpus_per_node
    return start_index


# THUDM/slime slime/backends/sglang_utils/sglang_engine.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `_compute_server_args`, verbatim
def _compute_server_args(
    args,
    rank,
    dist_init_addr,
    nccl_port,
    host,
    port,
    worker_type: str = "regular",
    disaggregation_bootstrap_port: int | None = None,
    base_gpu_id: int | None = None,
    sglang_overrides: dict | None = None,
    num_gpus_per_engine: int | None = None,
):
    _gpus_per_engine = num_gpus_per_engine or args.rollout_num_gpus_per_engine
    normalized_overrides = {key.replace("-", "_"): value for key, value in (sglang_overrides or {}).items()}
    pp_size = int(normalized_overrides.get("pp_size", args.sglang_pp_size))
    tp_size = int(normalized_overrides.get("tp_size", _gpus_per_engine // pp_size))
    nnodes = max(1, _gpus_per_engine // args.num_gpus_per_node)
    node_rank = rank % nnodes
    base = base_gpu_id if base_gpu_id is not None else get_base_gpu_id(args, rank)
    base = accelerator.resolve_visible_device_id(base)
    kwargs = {
        "model_path": args.hf_checkpoint,
        "trust_remote_code": True,
        "random_seed": args.seed + rank * args.num_gpus_per_node,
        # memory
        "enable_memory_saver": args.offload_rollout,
        # distributed
        "host": host,
        "port": port,
        "nccl_port": nccl_port,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "dist_init_addr": dist_init_addr,
        "gpu_id_step": 1,
        "base_gpu_id": base,
        # parallel
        "tp_size": tp_size,
        "dp_size": args.sglang_dp_size,
        "pp_size": pp_size,
        "ep_size": args.sglang_ep_size,
        # always skip warmup to prevent warmup timeout.
        "skip_server_warmup": True,
        # always enable draft weights cpu backup so that we run training without mtp weights.
        "enable_draft_weights_cpu_backup": True,
        # Always enable Prometheus metrics so the router /engine_metrics endpoint
        # is available for external scraping.
        "enable_metrics": True,
    }

    if worker_type == "prefill":
        kwargs["disaggregation_mode"] = "prefill"
        kwargs["load_balance_method"] = "follow_bootstrap_room"
        assert (
            disaggregation_bootstrap_port is not None
        ), "disaggregation_bootstrap_port must be set for prefill worker"
        kwargs["disaggregation_bootstrap_port"] = disaggregation_bootstrap_port
    elif worker_type == "decode":
        kwargs["disaggregation_mode"] = "decode"
        kwargs["prefill_round_robin_balance"] = True
    elif worker_type == "encoder":
        kwargs["encoder_only"] = True

    if args.use_rollout_routing_replay:
        kwargs["enable_return_routed_experts"] = True
    if args.fp16:
        kwargs["dtype"] = "float16"
    external_engine_need_check_fields = [k for k in kwargs.keys() if k not in _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS]

    server_arg_fields = dataclasses.fields(ServerArgs)
    server_arg_field_names = {attr.name for attr in server_arg_fields}
    unused_keys = set(kwargs.keys())
    for attr in server_arg_fields:
        if worker_type == "decode" and attr.name == "enable_hierarchical_cache":
            continue
        if hasattr(args, f"sglang_{attr.name}") and attr.name not in kwargs:
            kwargs[attr.name] = getattr(args, f"sglang_{attr.name}")
        unused_keys.discard(attr.name)

    # Per-server-group overrides from --sglang-config YAML.
    # Applied after base args so they take highest priority.
    if sglang_overrides:
        for key, value in sglang_overrides.items():
            normalized_key = key.replace("-", "_")
            if normalized_key != key:
                logger.warning(
                    f"sglang_overrides key '{key}' normalized to '{normalized_key}' (rank={rank}). "
                    "Please use underscore style in YAML overrides."
                )
            if normalized_key in kwargs:
                logger.info(
                    f"sglang_overrides: overriding {normalized_key}={kwargs[normalized_key]} -> {value} (rank={rank})"
                )
            kwargs[normalized_key] = value
            if normalized_key in server_arg_field_names:
                unused_keys.discard(normalized_key)
            else:
                unused_keys.add(normalized_key)

    if (
        "cuda_graph_backend_prefill" in server_arg_field_names
        and kwargs.get("enable_memory_saver")
        and kwargs.get("cuda_graph_backend_prefill") is None
    ):
        # Breakable is SGLang's default prefill backend on CUDA, but it is incompatible with memory saver mode.
        kwargs["cuda_graph_backend_prefill"] = "disabled"

    # for compatibility with old args
    if len(unused_keys) > 0:
        logger.info(f"Warning: The following arguments is not supported in the current sglang: {unused_keys}.")
        for key in unused_keys:
            kwargs.pop(key)

    return kwargs, external_engine_need_check_fields


# THUDM/slime slime/backends/sglang_utils/sglang_engine.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `_EXTERNAL_ENGINE_SKIP_CHECK_FIELDS`, verbatim
_EXTERNAL_ENGINE_SKIP_CHECK_FIELDS = [
    "model_path",
    "trust_remote_code",
    "random_seed",
    "host",
    "port",
    "nccl_port",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "gpu_id_step",
    "base_gpu_id",
    "tp_size",
    "dp_size",
    "pp_size",
    "ep_size",
    "skip_server_warmup",
    "enable_draft_weights_cpu_backup",
    "enable_metrics",
    "mem_fraction_static",
]


class SGLangEngine:
    """SHIM (not slime code) around verbatim methods: slime's SGLangEngine (slime/backends/sglang_utils/sglang_engine.py
    @ e593fa0a02135d79848c08dcf96d25eb20227c18) reduced to its weight-update request builders;
    ``_make_request`` records (endpoint, JSON body as sent over HTTP) instead of POSTing it."""

    def __init__(self):
        self.node_rank = 0
        self.requests = []

    def _make_request(self, endpoint: str, payload: dict | None = None):
        self.requests.append((endpoint, json.loads(json.dumps(payload or {}))))
        return {"success": True, "message": "recorded"}

    # THUDM/slime slime/backends/sglang_utils/sglang_engine.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `SGLangEngine.update_weights_from_tensor`, verbatim
    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
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
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request(
            "update_weights_from_tensor",
            payload,
        )


    # THUDM/slime slime/backends/sglang_utils/sglang_engine.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `SGLangEngine.update_weights_from_distributed`, verbatim
    def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        group_name,
        flush_cache=False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ):
        payload = {
            "names": names,
            "dtypes": [str(dtype).replace("torch.", "") for dtype in dtypes],
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        return self._make_request(
            "update_weights_from_distributed",
            payload,
        )


# =====================================================================================================================
# Weight senders: Megatron -> HF names (+ FP8 quantization), buckets, and the two transports

# THUDM/slime slime/utils/types.py @ 680824dd5e01a2e83750bf87fc366ec6fa98766c: `ParamInfo`, verbatim
@dataclass(frozen=True)
class ParamInfo:
    name: str
    dtype: torch.dtype
    shape: torch.Size
    attrs: dict
    size: int
    src_rank: int


# THUDM/slime slime/backends/megatron_utils/update_weight/hf_weight_iterator_direct.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `pack_param_info_buckets`, verbatim
def pack_param_info_buckets(
    param_infos: Sequence[ParamInfo],
    update_weight_buffer_size: int,
) -> list[list[ParamInfo]]:
    param_info_buckets = [[]]  # Start with one empty bucket
    buffer_size = 0  # Track current bucket size in bytes

    for info in param_infos:
        # Expert params use expert-TP size, others use regular-TP size
        if ".experts." in info.name:
            tp_size = mpu.get_expert_tensor_parallel_world_size()
        else:
            tp_size = mpu.get_tensor_model_parallel_world_size()

        # Full param size = shard size × TP replicas (all-gather will reconstruct full param)
        param_size = info.size * tp_size

        # If adding this param exceeds limit AND current bucket has params: start new bucket
        if buffer_size + param_size > update_weight_buffer_size and len(param_info_buckets[-1]) > 0:
            param_info_buckets.append([])
            buffer_size = 0

        # Add param to current bucket and update size
        param_info_buckets[-1].append(info)
        buffer_size += param_size

    return param_info_buckets


# THUDM/slime slime/backends/megatron_utils/misc_utils.py @ b7be61dc114634e2cea82d2926098bc3f089fd6a: `strip_param_name_prefix`, verbatim
def strip_param_name_prefix(name: str):
    prefix = "module."
    while name.startswith(prefix):
        name = name.removeprefix(prefix)
    return name


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/processors/padding_remover.py @ b7be61dc114634e2cea82d2926098bc3f089fd6a: `remove_padding`, verbatim
def remove_padding(name: str, param: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """
    Remove vocab padding: param[:vocab_size] for embedding/output layers, else unchanged.
    """
    if strip_param_name_prefix(name) in {"embedding.word_embeddings.weight", "output_layer.weight"}:
        return param[:vocab_size]
    return param


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/__init__.py @ 2fa9a442f2f4d4e6ec4041fe110e0319af56ba4d: `convert_to_hf`, verbatim
def convert_to_hf(args, model_name, name, param, quantization_config=None, transform_ue8m0=True):
    hf_name = name
    while hf_name.startswith("module."):
        hf_name = hf_name.removeprefix("module.")
    if hf_name.startswith("model.visual."):
        return [(hf_name, param)]

    param = remove_padding(name, param, args.vocab_size)
    converted_named_tensors = _convert_to_hf_core(args, model_name, name, param)

    return quantize_params(args, name, converted_named_tensors, quantization_config, transform_ue8m0)


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/__init__.py @ 2fa9a442f2f4d4e6ec4041fe110e0319af56ba4d: `_cached_tensors`, verbatim
_cached_tensors = {}


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/__init__.py @ 2fa9a442f2f4d4e6ec4041fe110e0319af56ba4d: `_convert_to_hf_core`, verbatim
def _convert_to_hf_core(args, model_name, name, param):
    model_name = model_name.lower().replace("_", "").replace("-", "")
    if "minimaxm2" in model_name:
        converted_named_tensors = convert_minimax_m2_to_hf(args, name, param)
    elif any(family in model_name for family in ("glm4moelite", "deepseekv3", "deepseekv32", "glmmoedsa", "kimi")):
        converted_named_tensors = convert_deepseekv3_to_hf(args, name, param)
    elif "glm4moe" in model_name:
        converted_named_tensors = convert_glm4moe_to_hf(args, name, param)
    elif "glm4" in model_name:
        converted_named_tensors = convert_glm4_to_hf(args, name, param)
    elif "qwen3next" in model_name:
        converted_named_tensors = convert_qwen3_next_to_hf(args, name, param)
    elif "qwen35" in model_name:
        converted_named_tensors = convert_qwen3_5_to_hf(args, name, param)
    elif "qwen3vl" in model_name:
        converted_named_tensors = convert_qwen3vl_to_hf(args, name, param)
    elif "qwen2moe" in model_name or "qwen3moe" in model_name:
        converted_named_tensors = convert_qwen3moe_to_hf(args, name, param)
    elif "qwen2" in model_name or "qwen3" in model_name:
        converted_named_tensors = convert_qwen2_to_hf(args, name, param)
    elif "llama" in model_name:
        converted_named_tensors = convert_llama_to_hf(args, name, param)
    elif "mimo" in model_name:
        converted_named_tensors = convert_mimo_to_hf(args, name, param)
    else:
        raise ValueError(f"Unsupported model: {model_name}")

    # to compatible with sglang implementation
    if args.q_lora_rank is not None:
        old_converted_named_tensors = converted_named_tensors
        converted_named_tensors = []
        for converted_name, converted_param in old_converted_named_tensors:
            if "q_a_proj" in converted_name:
                pair_name = converted_name.replace("q_a_proj", "kv_a_proj_with_mqa")
                if pair_name in _cached_tensors:
                    converted_named_tensors += [
                        (converted_name, converted_param),
                        (pair_name, _cached_tensors[pair_name]),
                    ]
                    del _cached_tensors[pair_name]
                else:
                    _cached_tensors[converted_name] = converted_param
            elif "kv_a_proj_with_mqa" in converted_name:
                pair_name = converted_name.replace("kv_a_proj_with_mqa", "q_a_proj")
                if pair_name in _cached_tensors:
                    converted_named_tensors += [
                        (converted_name, converted_param),
                        (pair_name, _cached_tensors[pair_name]),
                    ]
                    del _cached_tensors[pair_name]
                else:
                    _cached_tensors[converted_name] = converted_param
            else:
                converted_named_tensors.append((converted_name, converted_param))
    return converted_named_tensors


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/qwen2.py @ f829eb2314a0b5055e2fd0058ab07cb34941810d: `convert_qwen2_to_hf`, verbatim
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
        elif rest == "mlp.linear_fc1.layer_norm_weight":
            return [(f"model.layers.{layer_idx}.post_attention_layernorm.weight", param)]

        # qk norm
        elif rest == "self_attention.q_layernorm.weight":
            return [(f"model.layers.{layer_idx}.self_attn.q_norm.weight", param)]
        elif rest == "self_attention.k_layernorm.weight":
            return [(f"model.layers.{layer_idx}.self_attn.k_norm.weight", param)]

    raise ValueError(f"Unknown parameter name: {name}")


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/processors/__init__.py @ 2fa9a442f2f4d4e6ec4041fe110e0319af56ba4d: `quantize_params`, verbatim but for one relative import (marked)
def quantize_params(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0=True):
    if quantization_config is None:
        return converted_named_params

    if quantization_config["quant_method"] == "fp8":
        pass  # vendored: `from .quantizer_fp8 import quantize_params_fp8` (defined below in this module)

        return quantize_params_fp8(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0)

    if quantization_config["quant_method"] == "compressed-tensors":
        from .quantizer_compressed_tensors import quantize_params_compressed_tensors

        # only int4 at the moment.
        return quantize_params_compressed_tensors(converted_named_params, quantization_config)

    # Unknown quant method (e.g. mxfp4) — pass through BF16 params as-is
    return converted_named_params


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/processors/quantizer_fp8.py @ 2fa9a442f2f4d4e6ec4041fe110e0319af56ba4d: `quantize_params_fp8`, verbatim
def quantize_params_fp8(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0=True):
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
                quantize_named_params.extend(
                    _quantize_param(converted_name, param, weight_block_size, transform_ue8m0)
                )

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
                quantize_named_params.extend(
                    _quantize_param(converted_name, param, weight_block_size, transform_ue8m0)
                )

            return quantize_named_params

    if rest in [
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
        # indexer
        "self_attention.wq_b.weight",
        "self_attention.wk.weight",
        # linear attention
        "self_attention.linear_attn.in_proj_qkv.weight",
        "self_attention.linear_attn.in_proj_z.weight",
        "self_attention.linear_attn.out_proj.weight",
    ]:
        quantize_named_params = []
        for converted_name, param in converted_named_params:
            quantize_named_params.extend(_quantize_param(converted_name, param, weight_block_size, transform_ue8m0))

        return quantize_named_params

    # for other parameters, we just return the original converted_named_params
    return converted_named_params


# THUDM/slime slime/backends/megatron_utils/megatron_to_hf/processors/quantizer_fp8.py @ 2fa9a442f2f4d4e6ec4041fe110e0319af56ba4d: `_quantize_param`, verbatim
def _quantize_param(name, weight, weight_block_size, transform_ue8m0=True):
    assert name.endswith(".weight"), f"Expected weight parameter, got {name}"
    FP8_MIN = torch.finfo(torch.float8_e4m3fn).min
    FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
    if weight_block_size is not None:
        if should_deepgemm_weight_requant_ue8m0 and should_deepgemm_weight_requant_ue8m0(
            weight_block_size=weight_block_size
        ):
            qweight, scale = quant_weight_ue8m0(weight, weight_block_size=weight_block_size)
            if transform_ue8m0:
                scale = transform_scale_ue8m0(scale, mn=qweight.shape[-2])
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


# THUDM/slime slime/backends/megatron_utils/kernels/fp8_kernel.py @ ccf6330c7fa09d486e7fe48cc0f17e14a7e61e6e: `fp8_dtype`, verbatim
fp8_dtype = torch.float8_e4m3fn


# THUDM/slime slime/backends/megatron_utils/kernels/fp8_kernel.py @ ccf6330c7fa09d486e7fe48cc0f17e14a7e61e6e: `fp8_max`, verbatim
fp8_max = torch.finfo(fp8_dtype).max


# THUDM/slime slime/backends/megatron_utils/kernels/fp8_kernel.py @ ccf6330c7fa09d486e7fe48cc0f17e14a7e61e6e: `fp8_min`, verbatim
fp8_min = -fp8_max


# THUDM/slime slime/backends/megatron_utils/kernels/fp8_kernel.py @ ccf6330c7fa09d486e7fe48cc0f17e14a7e61e6e: `ceil_div`, verbatim
def ceil_div(x: int, y: int) -> int:
    """
    Perform ceiling division of two integers.

    Args:
            x: the dividend.
            y: the divisor.

    Returns:
            The result of the ceiling division.
    """
    return (x + y - 1) // y


# THUDM/slime slime/backends/megatron_utils/kernels/fp8_kernel.py @ ccf6330c7fa09d486e7fe48cc0f17e14a7e61e6e: `_blockwise_cast_to_fp8_triton`, verbatim
@triton.jit
def _blockwise_cast_to_fp8_triton(
    X,
    Y,
    S,
    stride_xm,
    stride_xn,
    stride_ym,
    stride_yn,
    stride_sm,
    stride_sn,
    M,
    N,
    eps,
    fp8_min,
    fp8_max,
    BLOCK_M: tl.constexpr = 32,
    BLOCK_N: tl.constexpr = 128,
):
    pid_m = tl.cast(tl.program_id(axis=0), tl.int64)
    pid_n = tl.cast(tl.program_id(axis=1), tl.int64)
    off_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    off_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = off_m < M
    mask_n = off_n < N
    mask = mask_m[:, None] & mask_n[None, :]

    x = tl.load(X + off_m[:, None] * stride_xm + off_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    _absmax = tl.maximum(tl.max(tl.abs(x)), eps)
    x_s = _absmax / fp8_max
    s_inv = 1.0 / x_s
    y_q = tl.clamp(x * s_inv, fp8_min, fp8_max).to(Y.dtype.element_ty)

    tl.store(Y + off_m[:, None] * stride_ym + off_n[None, :] * stride_yn, y_q, mask=mask)
    tl.store(S + pid_m * stride_sm + pid_n * stride_sn, x_s)


# THUDM/slime slime/backends/megatron_utils/kernels/fp8_kernel.py @ ccf6330c7fa09d486e7fe48cc0f17e14a7e61e6e: `blockwise_cast_to_fp8_triton`, verbatim
def blockwise_cast_to_fp8_triton(x: torch.Tensor, block_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    BLOCK_M, BLOCK_N = 128, 128
    if block_size:
        BLOCK_M, BLOCK_N = block_size[0], block_size[1]
    M, N = x.shape
    y = torch.empty(M, N, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(ceil_div(M, BLOCK_M), ceil_div(N, BLOCK_N), dtype=torch.float32, device=x.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

    if x.is_contiguous():
        kwargs = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": 8, "num_stages": 2}
    else:
        kwargs = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": 1, "num_stages": 4}
    _blockwise_cast_to_fp8_triton[grid](
        x, y, s, *x.stride(), *y.stride(), *s.stride(), M, N, 1e-10, fp8_min, fp8_max, **kwargs
    )
    return y, s


# THUDM/slime slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `_build_flattened_tensor_data`, verbatim
def _build_flattened_tensor_data(
    named_tensors: list[tuple[str, torch.Tensor]],
) -> dict[str, Any]:
    if not named_tensors:
        return {
            "flattened_tensor": torch.empty(0, dtype=torch.uint8, device=accelerator.current_device()),
            "metadata": [],
        }

    # Do not reuse the IPC-facing flattened tensor. SGLang returns from the
    # HTTP/Ray request after enqueueing GPU copies into model weights, but it
    # does not guarantee a CUDA-device sync before the response. Reusing and
    # overwriting the same producer buffer immediately after ray.get can race
    # with the consumer-side copy and corrupt weights.
    flattened_tensor_bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    return {
        "flattened_tensor": flattened_tensor_bucket.get_flattened_tensor(),
        "metadata": flattened_tensor_bucket.get_metadata(),
    }


# THUDM/slime slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `_send_to_colocated_engine`, verbatim
def _send_to_colocated_engine(
    hf_named_tensors: list[tuple[str, torch.Tensor]],
    *,
    ipc_engine,
    ipc_gather_src,
    ipc_gather_group,
    weight_version,
) -> tuple[list[ObjectRef], Any]:
    # Placeholder ranks (GPU slots reserved but no engine) have no gather group.
    # gather_object is only collective among group members, so we skip entirely.
    if ipc_gather_group is None:
        return [], None

    long_live_tensors = []

    if getattr(FlattenedTensorBucket, "supports_multi_dtypes", False):
        converted_named_tensors_by_dtypes = {"dtype": hf_named_tensors} if hf_named_tensors else {}
    else:
        converted_named_tensors_by_dtypes = {}
        for name, tensor in hf_named_tensors:
            dtype = tensor.dtype
            if dtype not in converted_named_tensors_by_dtypes:
                converted_named_tensors_by_dtypes[dtype] = []
            converted_named_tensors_by_dtypes[dtype].append((name, tensor))

    serialized_tensors = []
    for _dtype, named_tensors in converted_named_tensors_by_dtypes.items():
        flattened_tensor_data = _build_flattened_tensor_data(named_tensors)
        long_live_tensors.append(flattened_tensor_data)
        serialized_tensors.append(MultiprocessingSerializer.serialize(flattened_tensor_data, output_str=True))

    serialized_named_tensors = (
        [None] * dist.get_world_size(ipc_gather_group) if ipc_gather_src == dist.get_rank() else None
    )
    dist.gather_object(
        serialized_tensors,
        object_gather_list=serialized_named_tensors,
        dst=ipc_gather_src,
        group=ipc_gather_group,
    )

    refs = []
    if dist.get_rank() == ipc_gather_src:
        num_buckets = max(len(tensors) for tensors in serialized_named_tensors)
        empty_serialized_tensor = None
        for i in range(num_buckets):
            serialized_tensors_for_dtype = []
            for tensors in serialized_named_tensors:
                if i < len(tensors):
                    serialized_tensors_for_dtype.append(tensors[i])
                    continue

                if empty_serialized_tensor is None:
                    empty_tensor_data = _empty_flattened_tensor_data()
                    long_live_tensors.append(empty_tensor_data)
                    empty_serialized_tensor = MultiprocessingSerializer.serialize(empty_tensor_data, output_str=True)
                serialized_tensors_for_dtype.append(empty_serialized_tensor)

            kwargs = {
                "serialized_named_tensors": serialized_tensors_for_dtype,
                "load_format": "flattened_bucket",
                "weight_version": str(weight_version),
            }
            refs.append(ipc_engine.update_weights_from_tensor.remote(**kwargs))

    return refs, long_live_tensors


# THUDM/slime slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `_empty_flattened_tensor_data`, verbatim
def _empty_flattened_tensor_data():
    return {
        "flattened_tensor": torch.empty(0, dtype=torch.uint8, device=accelerator.current_device()),
        "metadata": [],
    }


# THUDM/slime slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py @ e593fa0a02135d79848c08dcf96d25eb20227c18: `update_weights_from_distributed`, verbatim
def update_weights_from_distributed(
    group_name: str,
    group: dist.ProcessGroup,
    weight_version: int,
    rollout_engines: Sequence[ActorHandle],
    converted_named_tensors: Sequence[tuple[str, torch.Tensor]],
    load_format: str | None = None,
) -> list[ObjectRef]:
    """
    Send metadata through Ray and tensors through the configured transport.
    """
    refs = [
        engine.update_weights_from_distributed.remote(
            names=[name for name, _ in converted_named_tensors],
            dtypes=[param.dtype for _, param in converted_named_tensors],
            shapes=[param.shape for _, param in converted_named_tensors],
            group_name=group_name,
            weight_version=str(weight_version),
            load_format=load_format,
        )
        for engine in rollout_engines
    ]
    handles = []
    for _, param in converted_named_tensors:
        handles.append(dist.broadcast(param.data, 0, group=group, async_op=True))
    for handle in handles:
        handle.wait()

    return refs
