"""The compat adapters that read only what they are given (no SGLang import): each release's layout, on stand-ins."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_fp8rl.compat import kv_pool, runtime, updates, versions


def test_kvcacheio_is_stubbed_only_before_0_5_15():
    assert versions.imports_kvcacheio_unguarded("0.5.12")
    assert not versions.imports_kvcacheio_unguarded("0.5.15.post1")
    assert not versions.imports_kvcacheio_unguarded("0.5.23")


def test_decode_graph_max_is_ours_to_fill_only_where_the_command_line_left_the_capture_alone():
    old = SimpleNamespace(cuda_graph_max_bs=None, cuda_graph_bs=None, disable_cuda_graph=False)  # before 0.5.15
    new = SimpleNamespace(cuda_graph_max_bs_decode=None, cuda_graph_bs_decode=None, cuda_graph_config=None,
                          cuda_graph_backend_decode=None, disable_cuda_graph=False, disable_decode_cuda_graph=False)
    assert runtime.decode_graph_max_to_fill(old) == "cuda_graph_max_bs"
    assert runtime.decode_graph_max_to_fill(new) == "cuda_graph_max_bs_decode"
    assert runtime.decode_graph_max_to_fill(SimpleNamespace(**{**vars(old), "cuda_graph_bs": [1, 2]})) is None
    for field, value in (("disable_decode_cuda_graph", True), ("cuda_graph_backend_decode", "full")):
        assert runtime.decode_graph_max_to_fill(SimpleNamespace(**{**vars(new), field: value})) is None
    assert runtime.decode_graph_max_to_fill(SimpleNamespace()) is None  # no such field to set


def test_internal_state_dict_of_either_answer():
    state: dict = {}
    assert runtime.internal_state_dict(SimpleNamespace(internal_state=state)) is state
    assert runtime.internal_state_dict(state) is state


def test_kv_pool_layout_quantization_and_store_on_stand_ins():
    assert kv_pool.kv_pool_layout(SimpleNamespace()) == "nhd"  # before 0.5.15
    assert kv_pool.kv_pool_layout(SimpleNamespace(kv_cache_layout="nhd", use_hnd=True)) == "hnd"
    assert kv_pool.kv_pool_layout(SimpleNamespace(kv_cache_layout="vectorized_5d", use_hnd=False)) == "vectorized_5d"
    assert not kv_pool.kv_pool_quantized(SimpleNamespace())
    assert kv_pool.kv_pool_quantized(SimpleNamespace(is_quantized_kv_cache=True))
    assert not kv_pool.stores_kv_like_mha(SimpleNamespace())  # no _store_kv_layer (before 0.5.15)


def test_kv_write_location_and_overrides_before_0_5_15():
    loc = torch.arange(3)
    assert kv_pool.kv_write_location({"loc": loc}) is loc
    assert kv_pool.kv_write_location({"loc_info": None}) is None and kv_pool.kv_write_location({}) is None
    assert kv_pool.kv_write_overrides({"layer_id_override": 2}) == {"layer_id_override": 2, "dcp_kv_mask": None}


def test_engine_session_call_and_host_tensor_payload():
    assert updates.engine_session_call(object(), "begin_weight_update") is None  # an engine before 0.5.21
    engine = SimpleNamespace(begin_weight_update=lambda: (True, ""))
    assert updates.engine_session_call(engine, "begin_weight_update")() == (True, "")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)[1:]  # a view of a larger storage
    rebuild, args = updates.reduce_host_tensor(t)
    storage_bytes = args[0]
    load, load_args = storage_bytes.__reduce__()
    back = rebuild(load(*load_args), *args[1:])
    assert torch.equal(back, t) and back.untyped_storage().nbytes() == t.numel() * t.element_size()
