"""The engine's fixed host costs per update request (RESULTS 29b): what a request no longer pays, and that the
shortcuts keep the same meaning. The bytes written through them are compared with the model's own loaders in
tests/test_replayed_writes.py (the MoE routers among them)."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear
from sglang.srt.model_loader.weight_utils import default_weight_loader

from sglang_fp8rl.layers import fp8_storage
from sglang_fp8rl.layers.fp8_storage import layer_states
from sglang_fp8rl.weight_sync import telemetry
from sglang_fp8rl.weight_sync.validate import loader_copies_whole


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)


def test_layer_states_are_found_once_per_model(monkeypatch):
    """One walk of the model's modules, the first time; every later request gets the same states without one."""
    model = _Model()
    states = {model.a: object(), model.c: object()}
    monkeypatch.setattr(fp8_storage, "layer_state", lambda m: states.get(m))
    first = layer_states(model)
    assert first == (states[model.a], states[model.c])

    def no_walk():
        raise AssertionError("walked the model's modules again")

    monkeypatch.setattr(model, "modules", no_walk)
    assert layer_states(model) is first
    assert layer_states(_Model()) == ()  # another model: its own walk


class _Bound:
    """Stands for the layer a loader is bound to (only the function identity matters)."""


@pytest.mark.parametrize("loader, args, kwargs, loaded_shape, gguf, whole", [
    (default_weight_loader, (), {}, (4, 2), None, True),
    (ReplicatedLinear.weight_loader.__get__(_Bound()), (), {}, (4, 2), None, True),  # a MoE router's loader
    (ReplicatedLinear.weight_loader.__get__(_Bound()), (), {}, (2, 4), None, False),  # not the same size
    (ReplicatedLinear.weight_loader.__get__(_Bound()), (), {}, (4, 2), "is_gguf_weight", False),
    (ReplicatedLinear.weight_loader.__get__(_Bound()), (), {}, (4, 2), "is_gguf_weight_type", False),
    (default_weight_loader, ("q",), {}, (4, 2), None, False),  # a shard id: not a whole copy
    (default_weight_loader, (), {"shard_id": 0}, (4, 2), None, False),
    (ColumnParallelLinear.weight_loader.__get__(_Bound()), (), {}, (4, 2), None, False),  # shards by TP rank
])
def test_which_loader_calls_are_a_whole_copy(loader, args, kwargs, loaded_shape, gguf, whole):
    param = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
    if gguf:
        setattr(param, gguf, True)
    assert loader_copies_whole(loader, param, torch.ones(loaded_shape), args, kwargs) is whole


def _on_cuda(monkeypatch, nested: dict) -> list:
    """telemetry.measured as on a CUDA engine, with the allocator's counters given; records the calls made."""
    calls = []
    monkeypatch.setattr(telemetry, "model_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append("reset"))

    def nested_stats(device):
        calls.append("stats")
        return nested

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested_stats)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: pytest.fail("the flattened stats were read"))
    return calls


def test_the_peak_extra_memory_of_a_request_is_read_from_the_allocators_counters(monkeypatch):
    counters = {"allocated_bytes": {"all": {"current": 1000, "peak": 1000}}}
    calls = _on_cuda(monkeypatch, counters)
    with telemetry.measured("tensor", torch.nn.Module()) as stats:
        counters["allocated_bytes"]["all"].update(current=1500, peak=4000)
    assert stats.peak_extra_bytes == 3000 and calls == ["reset", "stats", "stats"]


def test_missing_counters_read_as_zero_not_an_error(monkeypatch):
    """torch returns {} before CUDA is initialized: the request goes on (nothing may raise into the scheduler)."""
    _on_cuda(monkeypatch, {})
    with telemetry.measured("tensor", torch.nn.Module()) as stats:
        pass
    assert stats.peak_extra_bytes == 0
