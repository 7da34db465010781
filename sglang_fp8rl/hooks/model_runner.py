"""``ModelRunner.load_model``: after SGLang loads a model served with `fp8_online_blockwise`, guard its updates and
prepare its block-FP8 GEMMs (before CUDA graphs are captured)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from sglang_fp8rl import parallel
from sglang_fp8rl.hooks import producers
from sglang_fp8rl.hooks.kv_cache import set_up_kv_scales
from sglang_fp8rl.kernels import deepgemm, gemm_select, jit_warmup
from sglang_fp8rl.layers.linear import block_shapes
from sglang_fp8rl.server_args import get_options
from sglang_fp8rl.weight_sync.load_guard import attach

logger = logging.getLogger(__name__)


def ranks_on_node(server_args: Any) -> int:
    """Model ranks sharing this node's CPUs (tensor x pipeline parallel over the nodes)."""
    tp, pp = getattr(server_args, "tp_size", 1) or 1, getattr(server_args, "pp_size", 1) or 1
    return max(1, tp * pp // max(1, getattr(server_args, "nnodes", 1) or 1))


def prepare_gemms(runner: Any) -> None:
    """Compile and choose the block-FP8 GEMMs of the model's CUDA block shapes (nothing on CPU), one table for every
    TP rank. Every rank takes part in the table's exchange exactly once, whatever happens to it before (no shapes, a
    failure), so that no rank waits forever at start; a rank that failed makes every rank keep SGLang's dispatch."""
    exchanged: list[bool] = []

    def agree(table: Optional[dict]) -> Optional[dict]:
        exchanged.append(True)
        return gemm_select.agreed_entries(parallel.gather(table))

    try:
        _prepare_gemms(runner, agree)
    except Exception:  # noqa: BLE001 - an optimisation: its failure must not stop the server from starting
        logger.exception("[fp8rl] block-FP8 GEMM selection failed; every shape uses SGLang's own dispatch")
        gemm_select.install({}, {})
        if not exchanged:
            agree(None)
        return
    if not exchanged:  # selection off, or no block shapes on this rank
        agree({})


def _prepare_gemms(runner: Any, agree: gemm_select.Agree) -> None:
    """gemm_select.prepare_model with SGLang's settings of this runner."""
    shapes = block_shapes(runner.model)
    if not shapes:
        return
    options, server_args = get_options(), getattr(runner, "server_args", None)
    pre_load_gib = getattr(runner, "pre_model_load_memory", None)  # SGLang records it in GiB
    gemm_select.prepare_model(
        shapes,
        mode=options.gemm_select,
        budget_s=options.gemm_tune_budget_s,
        jit_workers=options.jit_workers,
        capture_ms=jit_warmup.capture_token_counts(server_args),
        ranks_on_node=ranks_on_node(server_args),
        # the ServerArgs field behind --fp8-gemm-backend
        fp8_gemm_backend=getattr(server_args, "fp8_gemm_runner_backend", None) or deepgemm.AUTO_BACKEND,
        mem_fraction_static=getattr(runner, "mem_fraction_static", None),
        pre_load_free_bytes=int(pre_load_gib * (1 << 30)) if pre_load_gib else None,
        exclude=options.gemm_exclude,
        agree=agree,
    )


def wire_producers(runner: Any) -> None:
    """``--fp8rl-producer-quant on``: the norms and SiLUs before block-FP8 linears quantize their output. An
    optimisation: its failure leaves SGLang's own forwards in place and the server starting."""
    if get_options().producer_quant != "on":
        return
    try:
        producers.install(runner.model, getattr(runner, "server_args", None))
    except Exception:  # noqa: BLE001 - the model is unchanged where install did not get to
        logger.exception("[fp8rl] producer quantization could not be set up; SGLang's norm and SiLU kernels run")


def wrap_load_model(original: Callable) -> Callable:
    """ModelRunner.load_model, then attach our update guard, prepare the GEMMs and wire the producers."""
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if attach(self.model):
            logger.info("[fp8rl] weight updates of this model are validated and re-quantized in place")
            set_up_kv_scales(self)
            prepare_gemms(self)
            wire_producers(self)
        return result

    return load_model
