"""Quantization config of `fp8_online_blockwise`: which module gets which method, and the per-layer scheme report."""

from __future__ import annotations

import collections
import logging
import re
from typing import Any, Optional

import torch
from sglang.srt.layers.deep_gemm_wrapper import configurer as deep_gemm_configurer
from sglang.srt.layers.linear import LinearBase, ReplicatedLinear
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
from sglang.srt.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils.hf_transformers.config import get_config

from sglang_fp8rl.compat.runtime import server_args as current_server_args
from sglang_fp8rl.layers.ignored import ignored_layers_from, ignored_match
from sglang_fp8rl.layers.linear import Fp8OnlineBlockwiseLinearMethod
from sglang_fp8rl.layers.moe import Fp8OnlineBlockwiseMoEMethod
from sglang_fp8rl.layers.quant_source import (
    accept_injected_request,
    is_rollout_fp8_request,
    reject_quantized_checkpoint,
)
from sglang_fp8rl.layers.scheme import Scheme, SchemeDecision
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE
from sglang_fp8rl.server_args import QUANTIZATION_NAME, Fp8rlOptions, get_options

logger = logging.getLogger(__name__)

NAME = QUANTIZATION_NAME
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class SchemeReport:
    """Per-layer scheme decisions of one model on one rank; logs one summary when loading has finished."""

    def __init__(self) -> None:
        self.decisions: dict[str, SchemeDecision] = {}
        self.dummy_filled: set[str] = set()  # layers (or MoE layers with experts) never loaded: random values
        self._pending: set[str] = set()
        self.logged = False

    def record(self, prefix: str, decision: SchemeDecision) -> None:
        """Remember a layer's decision; quantized layers are awaited by :meth:`mark_processed`."""
        self.decisions[prefix] = decision
        if decision.scheme is not Scheme.BF16:
            self._pending.add(prefix)

    def record_dummy_fill(self, prefix: str) -> None:
        """A layer got deterministic random values because no weight reached it (--load-format dummy)."""
        self.dummy_filled.add(prefix)

    def mark_processed(self, prefix: str) -> None:
        """Called from process_weights_after_loading; the last quantized layer triggers the summary line."""
        self._pending.discard(prefix)
        if not self._pending and not self.logged:
            self.logged = True
            logger.info("%s", self.summary())

    def counts(self) -> dict[str, int]:
        """Number of linear layers per scheme."""
        counter = collections.Counter(d.scheme.value for d in self.decisions.values())
        return {scheme.value: counter.get(scheme.value, 0) for scheme in Scheme}

    def exceptions(self) -> dict[str, list[str]]:
        """Non-blockwise layers grouped by (module kind, reason): {"mlp.down_proj: <reason>": [prefixes]}."""
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for prefix, decision in self.decisions.items():
            if decision.scheme is not Scheme.BLOCK:
                kind = _LAYER_INDEX.sub(".layers.*.", "." + prefix).lstrip(".")
                groups[f"{decision.scheme.value} {kind}: {decision.reason}"].append(prefix)
        return dict(groups)

    def summary(self) -> str:
        """One line: layer counts per scheme, and each group of exceptions with its reason."""
        counts = ", ".join(f"{k}={v}" for k, v in self.counts().items())
        parts = [f"[fp8rl] {NAME}: linear layers {counts}"]
        for group, prefixes in self.exceptions().items():
            parts.append(f"{group} (x{len(prefixes)})")
        if self.dummy_filled:
            parts.append(f"{len(self.dummy_filled)} layers never loaded, filled with dummy values "
                         "(expected only with --load-format dummy)")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form for telemetry."""
        return {"counts": self.counts(), "exceptions": {k: len(v) for k, v in self.exceptions().items()},
                "dummy_filled": len(self.dummy_filled)}


def layer_index(prefix: str) -> Optional[int]:
    """Decoder-layer index in a module name such as ``model.layers.3.mlp.down_proj``, else None."""
    match = _LAYER_INDEX.search(prefix)
    return int(match.group(1)) if match else None


def num_hidden_layers_of_served_model() -> int:
    """``num_hidden_layers`` of the model this process serves, from the config SGLang loaded (local or model hub)."""
    args = current_server_args()
    try:
        config = get_config(args.model_path, trust_remote_code=args.trust_remote_code, revision=args.revision)
    except (OSError, ValueError) as e:
        raise ValueError(f"--fp8rl-bf16-last-layers needs num_hidden_layers, but the config of {args.model_path!r} "
                         f"does not load: {e}") from e
    config = getattr(config, "text_config", None) or config
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise ValueError(f"--fp8rl-bf16-last-layers needs num_hidden_layers, which the config of {args.model_path!r} "
                         "does not define")
    return layers


def refuse_unsupported_setup(server_args: Optional[Any]) -> None:
    """ValueError, at start, for setups this method would serve wrongly: pipeline parallelism (each stage would
    refuse every full update: it holds only its own layers), an MoE all-to-all dispatcher or MoE runner our expert
    method cannot take (:func:`refuse_moe_backends`) and DeepGEMM's UE8M0 scales (Blackwell), which our float32
    scales do not follow."""
    if server_args is not None and (getattr(server_args, "pp_size", 1) or 1) > 1:
        raise ValueError(f"--quantization {NAME} does not support pipeline parallelism (--pp-size "
                         f"{server_args.pp_size}); serve with --tp-size instead")
    if server_args is not None:
        refuse_moe_backends(server_args)
    if deep_gemm_configurer.DEEPGEMM_SCALE_UE8M0:
        raise ValueError(f"--quantization {NAME} writes float32 block scales, but SGLang's DeepGEMM path on this GPU "
                         "(Blackwell, SM100) expects UE8M0 scales; not supported yet")


# the MoE runners our FP8 expert method serves: it always builds SGLang's Triton runner (layers/moe.py)
MOE_RUNNERS = ("auto", "triton")


def refuse_moe_backends(server_args: Any) -> None:
    """ValueError for ``--moe-a2a-backend`` other than ``none`` and ``--moe-runner-backend`` other than auto / triton.

    Our expert method runs SGLang's Triton MoE runner on the standard dispatcher's output. An all-to-all backend
    (DeepEP, Mooncake, NIXL, MORI, PPLX, FlashInfer) hands it another dispatch format, for which the Triton runner
    has no permute step (0.5.17: an assertion at the first MoE forward, ``moe_runner/base.py:209``). Another runner
    would be replaced by Triton without a word, and some make the standard dispatcher keep global expert ids under
    expert parallelism (``token_dispatcher/standard.py:118-126``: the flashinfer runners, hpc_ops) or change the
    top-k output format (triton_kernel), so tokens would reach the wrong experts."""
    a2a = getattr(server_args, "moe_a2a_backend", "none")  # a str in every supported release, as is the runner
    if a2a != "none":
        raise ValueError(f"--quantization {NAME} does not support --moe-a2a-backend {a2a}: its FP8 expert layers run "
                         "SGLang's Triton MoE runner, which takes only the standard dispatcher's output; serve expert "
                         "parallelism with --ep-size N and --moe-a2a-backend none (the default)")
    runner = getattr(server_args, "moe_runner_backend", "auto")
    if runner not in MOE_RUNNERS:
        raise ValueError(f"--quantization {NAME} does not support --moe-runner-backend {runner}: its FP8 expert "
                         "layers always run SGLang's Triton MoE runner, so this runner would not be used, and under "
                         "expert parallelism it can change which expert ids the layers receive; serve with "
                         "--moe-runner-backend auto (the default) or triton")


def bf16_reason(prefix: str, options: Fp8rlOptions, num_layers: Optional[int]) -> Optional[str]:
    """Why the user's options keep this linear layer in BF16, or None if they do not."""
    for pattern in options.ignore:
        if re.search(pattern, prefix):
            return f"--fp8rl-ignore {pattern!r}"
    index = layer_index(prefix)
    if index is None:
        return None
    if index < options.bf16_first_layers:
        return f"--fp8rl-bf16-first-layers {options.bf16_first_layers}"
    if options.bf16_last_layers and num_layers is not None and index >= num_layers - options.bf16_last_layers:
        return f"--fp8rl-bf16-last-layers {options.bf16_last_layers}"
    return None


def trainer_ignored_reason(prefix: str, ignored_layers: tuple[str, ...], num_experts: Optional[int] = None
                           ) -> Optional[str]:
    """Why a trainer's ignored layers (verl's rule, layers/ignored.py) keep this module in BF16, or None."""
    hit = ignored_match(prefix, ignored_layers, num_experts)
    return None if hit is None else f"ignored layer {hit!r}"


class Fp8OnlineBlockwiseConfig(QuantizationConfig):
    """DeepSeek-style blockwise FP8 (128x128 weights, dynamic 1x128 activations) from a BF16/FP32 checkpoint."""

    def __init__(self, options: Optional[Fp8rlOptions] = None, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
                 ignored_layers: Optional[tuple[str, ...]] = None):
        super().__init__()
        refuse_unsupported_setup(current_server_args())
        self.options = options if options is not None else get_options()
        # a trainer's BF16 layers (verl's matching, layers/ignored.py): the injected config's, else the env var's
        self.ignored_layers = ignored_layers if ignored_layers is not None else ignored_layers_from(None)
        # deliberately not named `weight_block_size`: SGLang's CPU path pads intermediate sizes of configs that have
        # one (configs/update_config.py), which would hide the per-channel fallback this package is built for
        self.block_size = tuple(block_size)
        self.report = SchemeReport()
        self._num_layers: Optional[int] = None

    def __repr__(self) -> str:
        return f"Fp8OnlineBlockwiseConfig(block_size={self.block_size}, options={self.options})"

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 89  # FP8 tensor cores (Ada, Hopper)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8OnlineBlockwiseConfig:
        # SGLang calls this only when the model config carries a quantization_config: served only when a trainer
        # injected it on a BF16 checkpoint (verl's FP8 rollout mode), refused when it came with the checkpoint
        return cls(ignored_layers=accept_injected_request(config, current_server_args()))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Optional[str]) -> Optional[str]:
        # runs in every process that builds a ModelConfig, after hooks/model_config.py judged where the config came
        # from (layers/quant_source.py); what reaches here unjudged (a standalone hf_quant_config.json) is the
        # checkpoint's own
        if user_quant != NAME or not hf_quant_cfg:
            return None
        if not is_rollout_fp8_request(hf_quant_cfg):
            reject_quantized_checkpoint(hf_quant_cfg)
        return NAME

    def get_scaled_act_names(self) -> list[str]:
        return []

    def _layers_total(self) -> Optional[int]:
        if self.options.bf16_last_layers and self._num_layers is None:
            self._num_layers = num_hidden_layers_of_served_model()
        return self._num_layers

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, LinearBase):
            # replicated linears are routers / small gates: BF16 by type, whatever their name
            reason = "replicated linear (router/gate)" if isinstance(layer, ReplicatedLinear) else None
            reason = reason or bf16_reason(prefix, self.options, self._layers_total())
            reason = reason or trainer_ignored_reason(prefix, self.ignored_layers)
            if reason is not None:
                self.report.record(prefix, SchemeDecision(Scheme.BF16, reason))
                return UnquantizedLinearMethod()
            return Fp8OnlineBlockwiseLinearMethod(self, prefix)
        if isinstance(layer, FusedMoE):
            reason = bf16_reason(prefix, self.options, self._layers_total())
            reason = reason or trainer_ignored_reason(prefix, self.ignored_layers, getattr(layer, "num_experts", None))
            if reason is not None:
                self.report.record(prefix, SchemeDecision(Scheme.BF16, reason))
                return None  # FusedMoE then builds SGLang's UnquantizedFusedMoEMethod
            return Fp8OnlineBlockwiseMoEMethod(self, prefix)
        # embeddings, lm_head, norms, attention (KV cache) stay in the model dtype
        return None


def scheme_report(model: torch.nn.Module) -> Optional[SchemeReport]:
    """The scheme report of a model quantized by this package, or None."""
    for module in model.modules():
        config = getattr(getattr(module, "quant_method", None), "quant_config", None)
        if isinstance(config, Fp8OnlineBlockwiseConfig):
            return config.report
    return None
