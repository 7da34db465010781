"""``ModelRunner.load_model``: after SGLang loads a model served with `fp8_online_blockwise`, guard its updates and
prepare its block-FP8 GEMMs (before CUDA graphs are captured)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from sglang_fp8rl.kernels import gemm_select, jit_warmup
from sglang_fp8rl.layers.linear import block_shapes
from sglang_fp8rl.server_args import get_options
from sglang_fp8rl.weight_sync.update import attach

logger = logging.getLogger(__name__)


def ranks_on_node(server_args: Any) -> int:
    """Model ranks sharing this node's CPUs (tensor x pipeline parallel over the nodes)."""
    tp, pp = getattr(server_args, "tp_size", 1) or 1, getattr(server_args, "pp_size", 1) or 1
    return max(1, tp * pp // max(1, getattr(server_args, "nnodes", 1) or 1))


def prepare_gemms(model: torch.nn.Module, server_args: Any) -> None:
    """Compile and choose the block-FP8 GEMMs of the model's CUDA block shapes (nothing on CPU)."""
    shapes = block_shapes(model)
    if not shapes:
        return
    options = get_options()
    gemm_select.prepare_model(
        shapes,
        mode=options.gemm_select,
        budget_s=options.gemm_tune_budget_s,
        jit_workers=options.jit_workers,
        capture_ms=jit_warmup.capture_token_counts(server_args),
        ranks_on_node=ranks_on_node(server_args),
        fp8_gemm_backend=getattr(server_args, "fp8_gemm_backend", "auto") or "auto",
    )


def wrap_load_model(original: Callable) -> Callable:
    """ModelRunner.load_model, then attach our update guard and prepare the GEMMs."""
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if attach(self.model):
            logger.info("[fp8rl] weight updates of this model are validated and re-quantized in place")
            prepare_gemms(self.model, getattr(self, "server_args", None))
        return result

    return load_model
