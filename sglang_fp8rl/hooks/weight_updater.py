"""``WeightUpdater`` patches (the ModelRunner component behind every update endpoint).

Turn our rejections into ``(False, message)`` answers with an accurate message, validate flattened-bucket metadata
before SGLang slices the buffer, and validate a disk checkpoint in a first streaming pass before SGLang's own pass
writes anything.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable, Optional

import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

from sglang_fp8rl.weight_sync.update import (
    PartialUpdateError,
    UpdateRejected,
    engine_state,
    is_attached,
    validate_stream,
)

logger = logging.getLogger(__name__)


def answer_rejection(error: Exception) -> tuple[bool, str]:
    """The (success, message) answer for an update we refused or that failed part-way."""
    if isinstance(error, UpdateRejected):
        return False, f"[fp8rl] update rejected, nothing was written, previous weights kept: {error}"
    return False, f"[fp8rl] {error}"


def wrap_update(original: Callable) -> Callable:
    """update_weights_from_tensor / _distributed: our exceptions become (False, message)."""
    def update(self, *args, **kwargs):
        updates_before = engine_state().updates
        try:
            success, message = original(self, *args, **kwargs)
        except (UpdateRejected, PartialUpdateError) as e:
            return answer_rejection(e)
        if not success and engine_state().updates > updates_before:
            # SGLang's distributed path catches every exception and says "partially updated"; say what happened
            last = engine_state().last
            if last is not None and not last.ok:
                rejected = UpdateRejected(last.message) if engine_state().consistent else PartialUpdateError(last.message)
                return answer_rejection(rejected)
        return success, message

    return update


def check_bucket_metadata(flattened: torch.Tensor, metadata: list) -> None:
    """Reject a flattened bucket whose metadata does not fit its buffer (e.g. a truncated bucket)."""
    size = flattened.numel() * flattened.element_size()
    for meta in metadata:
        nbytes = int(torch.Size(meta.shape).numel()) * torch.empty((), dtype=meta.dtype).element_size()
        if not 0 <= meta.start_idx <= meta.end_idx <= size:
            raise UpdateRejected(
                f"{meta.name}: bucket bytes [{meta.start_idx}, {meta.end_idx}) lie outside the {size}-byte buffer "
                "(truncated bucket?)"
            )
        if meta.end_idx - meta.start_idx != nbytes:
            raise UpdateRejected(
                f"{meta.name}: bucket holds {meta.end_idx - meta.start_idx} bytes but shape {tuple(meta.shape)} "
                f"of {meta.dtype} needs {nbytes}"
            )


def wrap_flattened_bucket(original: Callable) -> Callable:
    """_update_weights_from_flattened_bucket: check the metadata before SGLang slices the buffer."""
    def update_from_bucket(self, flattened_tensor_bucket_dict, *args, **kwargs):
        if is_attached(self.get_model()):
            check_bucket_metadata(
                flattened_tensor_bucket_dict["flattened_tensor"], list(flattened_tensor_bucket_dict["metadata"])
            )
        return original(self, flattened_tensor_bucket_dict, *args, **kwargs)

    return update_from_bucket


def validate_checkpoint_on_disk(updater, model_path: str, load_format: str,
                                weight_name_filter: Optional[Callable[[str], bool]]) -> int:
    """Stream a checkpoint through validation with SGLang's own loader and weight iterator; nothing is written."""
    model_config = copy.copy(updater.model_config)
    model_config.model_path = model_path
    loader = get_model_loader(LoadConfig(load_format=load_format), model_config)
    if not isinstance(loader, DefaultModelLoader):
        return 0  # SGLang itself refuses this case with a clear message
    model = updater.get_model()
    weights = loader._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, model))
    if weight_name_filter is not None:
        weights = ((name, w) for name, w in weights if weight_name_filter(name))
    return validate_stream(model, weights)


def wrap_update_from_disk(original: Callable) -> Callable:
    """update_weights_from_disk: validate the whole checkpoint in a first pass."""
    def update_from_disk(self, model_path, load_format, *args, **kwargs):
        weight_name_filter = kwargs.get("weight_name_filter", args[0] if args else None)
        if is_attached(self.get_model()):
            try:
                count = validate_checkpoint_on_disk(self, model_path, load_format, weight_name_filter)
            except UpdateRejected as e:
                return answer_rejection(e)
            except (OSError, RuntimeError, ValueError) as e:
                return False, f"[fp8rl] cannot read checkpoint {model_path!r}, nothing was written: {e}"
            logger.info("[fp8rl] disk checkpoint %s validated (%d tensors); loading", model_path, count)
        return original(self, model_path, load_format, *args, **kwargs)

    return update_from_disk
