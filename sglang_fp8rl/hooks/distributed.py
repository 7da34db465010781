"""``update_weights_from_distributed``: the trainer's broadcast, received in full before anything is refused.

The trainer (rank 0 of the update group) broadcasts every tensor it announced, whatever the engine thinks of them.
An engine that refused from the announcement alone would leave those bytes in flight, and the next update would
receive them (gloo aborts, NCCL hangs or delivers wrong bytes). So every announced tensor that can be sized is
received first (into tensors of the announced dtype, which are dropped if refused), and only then judged. An
announcement that cannot be sized (unknown dtype, malformed shape) cannot be received: it is refused with a message
saying the group is out of step and must be re-created.

Up to 0.5.20 SGLang calls one method (``update_weights_from_distributed``); from 0.5.21 it calls
``receive_weights_from_distributed`` and then ``load_weights_from_distributed`` (:mod:`sglang_fp8rl.compat.updates`).
The receive never raises (:func:`~sglang_fp8rl.hooks.transport.receive_checked`): a refusal travels to the load as a
:class:`~sglang_fp8rl.hooks.transport.RefusedBroadcast`, so every TP rank reaches the guard's agreement (a rank that
returned early would leave the others waiting in it); the load runs the update pipeline on what was received.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_fp8rl.compat.updates import updater_model
from sglang_fp8rl.hooks.transport import RefusedBroadcast, receive_checked
from sglang_fp8rl.weight_sync import pipeline
from sglang_fp8rl.weight_sync.load_guard import is_attached

OP = "update_weights_from_distributed"


def run_received(updater: Any, source: str, named: Any) -> tuple[bool, str]:
    """What was received (or its refusal) through the update pipeline; SGLang's ``(success, message)``."""
    refused = named.message if isinstance(named, RefusedBroadcast) else None
    return pipeline.run(updater_model(updater), source, updater, OP, lambda: named, refused=refused)


def wrap_update_from_distributed(original: Callable) -> Callable:
    """``update_weights_from_distributed`` (up to 0.5.20): receive everything, then validate, agree and write."""
    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        if not is_attached(updater_model(self)):
            return original(self, names, dtypes, shapes, group_name, load_format)
        named = receive_checked(self, names, dtypes, shapes, group_name, load_format)
        return run_received(self, f"distributed/{load_format or 'list'}", named)

    return update_weights_from_distributed


def wrap_receive_from_distributed(original: Callable) -> Callable:
    """``receive_weights_from_distributed`` (0.5.21+): receive everything; a refusal travels to the load."""
    def receive_weights_from_distributed(self, *, names, dtypes, shapes, group_name, load_format=None):
        if not is_attached(updater_model(self)):
            return original(self, names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                            load_format=load_format)
        return receive_checked(self, names, dtypes, shapes, group_name, load_format)

    return receive_weights_from_distributed


def wrap_load_from_distributed(original: Callable) -> Callable:
    """``load_weights_from_distributed`` (0.5.21+): validate, agree and write what was received."""
    def load_weights_from_distributed(self, named_tensors):
        if not is_attached(updater_model(self)):
            return original(self, named_tensors)
        return run_received(self, "distributed", named_tensors)

    return load_weights_from_distributed
