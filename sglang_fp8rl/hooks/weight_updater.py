"""Every weight-update entry point of SGLang's ``WeightUpdater`` (and the payload decoding of ``TpModelWorker``), for
models served with `fp8_online_blockwise`: obtain the request from its transport (:mod:`.transport`), run it through
the update pipeline (:mod:`sglang_fp8rl.weight_sync.pipeline`), answer as SGLang does.

Models that do not use this package take SGLang's methods unchanged (validate-only requests are answered for any
model, so the client's all-or-nothing steps work against BF16 engines too). The broadcast's entry points are
:mod:`.distributed`'s.
"""

from __future__ import annotations

import functools
from typing import Callable

from sglang_fp8rl.compat.updates import decode_own_rank, updater_model
from sglang_fp8rl.hooks.transport import checkpoint_weights, decoded_or_refused, stock_request, tensors_of_request
from sglang_fp8rl.weight_sync import pipeline
from sglang_fp8rl.weight_sync.load_guard import is_attached
from sglang_fp8rl.weight_sync.protocol import VALIDATE_FORMATS


def wrap_update_from_tensor(original: Callable) -> Callable:
    """WeightUpdater.update_weights_from_tensor: the pairs or bucket of the request, through the pipeline."""
    def update_weights_from_tensor(self, named_tensors, load_format=None):
        model = updater_model(self)
        if not is_attached(model) and load_format not in VALIDATE_FORMATS:
            return original(self, stock_request(named_tensors, load_format), load_format)
        return pipeline.run(model, f"tensor/{load_format or 'list'}", self, "update_weights_from_tensor",
                            functools.partial(tensors_of_request, self, named_tensors, load_format),
                            validate_only=load_format in VALIDATE_FORMATS)

    return update_weights_from_tensor


def wrap_deserialize_own_rank(original: Callable) -> Callable:
    """TpModelWorker's per-rank payload decoding (0.5.17+): an undecodable payload becomes a rejection, not a
    crash."""
    def deserialize(self, serialized_named_tensors):
        if not is_attached(self.model_runner.model):
            return original(self, serialized_named_tensors)
        return decoded_or_refused(lambda: original(self, serialized_named_tensors))

    return deserialize


def wrap_worker_update_from_tensor(original: Callable) -> Callable:
    """TpModelWorker.update_weights_from_tensor where it decodes the payload inline (up to 0.5.15): the same call,
    with an undecodable payload handed on as a rejection."""
    def update_weights_from_tensor(self, recv_req):
        if not is_attached(self.model_runner.model):
            return original(self, recv_req)
        named = decoded_or_refused(lambda: decode_own_rank(recv_req.serialized_named_tensors, self.tp_rank))
        return self.model_runner.update_weights_from_tensor(named_tensors=named, load_format=recv_req.load_format)

    return update_weights_from_tensor


def wrap_update_from_disk(original: Callable) -> Callable:
    """WeightUpdater.update_weights_from_disk: a full validating pass over the checkpoint, then SGLang's own loading
    pass."""
    def update_weights_from_disk(self, model_path, load_format, weight_name_filter=None, recapture_cuda_graph=False):
        model = updater_model(self)
        if not is_attached(model):
            return original(self, model_path, load_format, weight_name_filter, recapture_cuda_graph)
        return pipeline.run_checkpoint(
            model, self, model_path,
            functools.partial(checkpoint_weights, self, model_path, load_format, weight_name_filter),
            functools.partial(original, self, model_path, load_format, weight_name_filter, recapture_cuda_graph),
            filtered=weight_name_filter is not None)

    return update_weights_from_disk


def wrap_update_from_ipc(original: Callable) -> Callable:
    """WeightUpdater.update_weights_from_ipc: checkpoint-engine drives ``load_weights`` itself, through the model's
    guard."""
    def update_weights_from_ipc(self, recv_req):
        model = updater_model(self)
        if not is_attached(model):
            return original(self, recv_req)
        return pipeline.run_ipc(model, functools.partial(original, self, recv_req))

    return update_weights_from_ipc
