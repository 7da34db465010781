"""The guarded update in-process: answers, the dirty-tensor bookkeeping behind 'inconsistent', TP verdicts, refusals
while inconsistent (waiting and grammar queues, /health), and the setups refused at start.

End-to-end behaviour through SGLang's real WeightUpdater is in test_malformed_updates.py and test_tp2_cpu.py."""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.engine import OWNERS, reset
from sglang_fp8rl.hooks import scheduler as scheduler_hooks
from sglang_fp8rl.hooks import tokenizer as tokenizer_hooks
from sglang_fp8rl.parallel import Verdict, combine
from sglang_fp8rl.weight_sync import guard
from sglang_fp8rl.weight_sync.engine_state import EVERYTHING, engine_state
from sglang_fp8rl.weight_sync.request import Validated
from sglang_fp8rl.weight_sync.validate import UpdateRejected


@pytest.fixture(autouse=True)
def fresh_state():
    reset("engine_state")
    yield
    reset("engine_state")


def prepared(*names: str, full: bool = False) -> guard.Prepared:
    return guard.Prepared(Validated(names=list(names)), tensors=len(names), full=full)


def write_ok(_: guard.Prepared) -> None:
    pass


def write_fails(_: guard.Prepared) -> None:
    raise RuntimeError("simulated CUDA error")


MODEL = torch.nn.Linear(2, 2)


def test_rejection_and_unexpected_errors_are_answers_not_exceptions():
    def rejects() -> guard.Prepared:
        raise UpdateRejected("x.weight: bad")

    def breaks() -> guard.Prepared:
        raise KeyError("surprise")

    ok, message = guard.run(MODEL, "tensor", rejects, write_ok)
    assert not ok and message == guard.REJECTED + "x.weight: bad"
    ok, message = guard.run(MODEL, "disk", breaks, write_ok, context="checkpoint '/ckpt'")
    assert not ok and message == guard.REJECTED + "checkpoint '/ckpt': KeyError: 'surprise'"
    assert engine_state().consistent and engine_state().writes == 0


def test_dirty_tensors_keep_the_engine_inconsistent_until_all_are_resent():
    """A failed write marks its tensors dirty; an update of other tensors does not clear that (it used to), one that
    re-sends them does; every answer in between carries the mark the HTTP process reads."""
    ok, message = guard.run(MODEL, "tensor", lambda: prepared("a", "b"), write_fails)
    assert not ok and guard.INCONSISTENT_MARK in message and "simulated CUDA error" in message
    state = engine_state()
    assert not state.consistent and state.dirty == {"a", "b"}
    ok, message = guard.run(MODEL, "tensor", lambda: prepared("c"), write_ok)
    assert ok and guard.INCONSISTENT_MARK in message and state.dirty == {"a", "b"}
    ok, message = guard.run(MODEL, "tensor", lambda: prepared("a"), write_ok)
    assert ok and state.dirty == {"b"}
    ok, message = guard.run(MODEL, "tensor", lambda: prepared("b", "c"), write_ok)
    assert ok and message == "Success" and state.consistent and state.inconsistent_reason == ""


def test_a_full_disk_update_clears_any_inconsistency():
    state = engine_state()
    state.mark_dirty((), "an IPC update failed on some rank")
    assert state.dirty == {EVERYTHING}
    ok, _ = guard.run(MODEL, "disk", lambda: prepared("a", full=False), write_ok)
    assert ok and not state.consistent  # a filtered disk update is not complete
    ok, message = guard.run(MODEL, "disk", lambda: prepared("a", full=True), write_ok)
    assert ok and message == "Success" and state.consistent


def test_verdicts_combine_across_ranks():
    assert combine([Verdict(True), Verdict(True, wrote=True)]) == Verdict(True, wrote=True)
    both = combine([Verdict(False, "oom"), Verdict(True, wrote=True), Verdict(False, "x")])
    assert not both.ok and both.wrote and both.message == "TP rank 0: oom; TP rank 2: x"
    assert combine([Verdict(False, "alone")]) == Verdict(False, "alone")


def test_unvalidated_entry_points_agree_on_the_outcome():
    """checkpoint-engine IPC: SGLang's own method; a failure after a write marks the engine inconsistent."""
    def wrote_then_failed() -> tuple[bool, str]:
        engine_state().writes += 1
        return False, "ipc broke"

    ok, message = guard.run_unvalidated(MODEL, "ipc", wrote_then_failed)
    assert not ok and guard.INCONSISTENT_MARK in message and not engine_state().consistent
    engine_state().mark_written((), full=True)
    ok, message = guard.run_unvalidated(MODEL, "ipc", lambda: (False, "refused before writing"))
    assert not ok and message.startswith(guard.REJECTED) and engine_state().consistent
    ok, _ = guard.run_unvalidated(MODEL, "ipc", lambda: (_ for _ in ()).throw(ConnectionError("zmq")))
    assert not ok


# ---------------------------------------------------------------------------------------------------------------------
# refusal while inconsistent


class QueuedReq:
    def __init__(self, rid: str):
        self.rid, self.abort_message = rid, None

    def set_finish_with_abort(self, message: str) -> None:
        self.abort_message = message


def test_refusal_reaches_requests_waiting_for_their_grammar():
    """A grammar-constrained request waits in the grammar queue, not the waiting queue: it is refused too."""
    class GrammarManager:
        grammar_queue: list = []

    class SchedulerLike:
        waiting_queue: list = []
        grammar_manager = GrammarManager()

    def handle(self, recv):  # SGLang puts a request with a regex into the grammar queue
        self.grammar_manager.grammar_queue.append(QueuedReq(recv.rid))

    class Recv:
        rid = "grammar-1"

    engine_state().mark_dirty(["a"], "update #3 failed")
    sched = SchedulerLike()
    scheduler_hooks.wrap_generate(handle)(sched, Recv())
    refused = sched.grammar_manager.grammar_queue[-1]
    assert "refusing to serve" in refused.abort_message and "update #3" in refused.abort_message


def test_health_follows_update_answers():
    """The HTTP process holds /health at 503 (server status Starting) while answers carry the inconsistency mark."""
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    class Manager:
        server_status = ServerStatus.Up

    manager = Manager()
    tokenizer_hooks.follow_answer(manager, (False, guard.PARTIAL + "x"))
    assert manager.server_status == ServerStatus.Starting
    tokenizer_hooks.follow_answer(manager, (True, "Success " + guard.INCONSISTENT_MARK + " still inconsistent"))
    assert manager.server_status == ServerStatus.Starting
    tokenizer_hooks.follow_answer(manager, (True, "Success"))
    assert manager.server_status == ServerStatus.Up
    manager.server_status = ServerStatus.UnHealthy
    tokenizer_hooks.follow_answer(manager, (True, "Success"))  # not ours to change
    assert manager.server_status == ServerStatus.UnHealthy


# ---------------------------------------------------------------------------------------------------------------------
# setups refused at start


def test_pipeline_parallelism_is_refused_at_start(tmp_path):
    """Each pipeline stage holds only its own layers, so every full update would be refused: refused at start."""
    import argparse

    from sgl_model import TINY, write_checkpoint
    from sglang.srt.server_args import ServerArgs

    from sglang_fp8rl.plugin import register

    register()
    write_checkpoint(str(tmp_path), TINY, seed=1)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", str(tmp_path), "--device", "cpu", "--quantization",
                              "fp8_online_blockwise", "--pp-size", "2"])
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        ServerArgs.from_cli_args(args)


def test_ue8m0_scales_are_refused(monkeypatch):
    from sglang_fp8rl.layers import config

    monkeypatch.setattr(config.deep_gemm_configurer, "DEEPGEMM_SCALE_UE8M0", True)
    with pytest.raises(ValueError, match="UE8M0"):
        config.refuse_unsupported_setup(None)
    monkeypatch.setattr(config.deep_gemm_configurer, "DEEPGEMM_SCALE_UE8M0", False)
    config.refuse_unsupported_setup(None)


def test_last_layers_count_comes_from_sglangs_config_loader(monkeypatch):
    """--fp8rl-bf16-last-layers with a model-hub id: the layer count comes from SGLang's (cached) config loader,
    not from a config.json next to the model path."""
    from types import SimpleNamespace

    from sglang_fp8rl.layers import config

    seen = {}

    def get_config(model, trust_remote_code, revision=None):
        seen.update(model=model, trust_remote_code=trust_remote_code, revision=revision)
        return SimpleNamespace(text_config=None, num_hidden_layers=36)

    args = SimpleNamespace(model_path="Qwen/Qwen3-8B", trust_remote_code=False, revision="main")
    monkeypatch.setattr(config, "current_server_args", lambda: args)
    monkeypatch.setattr(config, "get_config", get_config)
    assert config.num_hidden_layers_of_served_model() == 36
    assert seen == {"model": "Qwen/Qwen3-8B", "trust_remote_code": False, "revision": "main"}


def test_sglangs_not_optimized_warning_is_filtered_for_our_method_only(caplog):
    import logging

    from sglang_fp8rl.hooks.sglang_logs import SGLANG_LOGGER, install_log_filter

    install_log_filter()
    install_log_filter()
    logger = logging.getLogger(SGLANG_LOGGER)
    message = "%s quantization is not fully optimized yet. The speed can be slower than non-quantized models."
    with caplog.at_level(logging.WARNING, logger=SGLANG_LOGGER):
        logger.warning(message, "fp8_online_blockwise")
        logger.warning(message, "awq")
    assert [r.getMessage().split()[0] for r in caplog.records] == ["awq"]
    assert len(logger.filters) == 1


def test_calibrated_kv_write_saturates_instead_of_overflowing(monkeypatch):
    """SGLang's real MHA pool on CPU: with calibrated scales the K/V write divides by the scale tensors in place, as
    SGLang does, and clamps to +-448 before the E4M3 cast (on CUDA an overflowing cast gives NaN)."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_fp8rl.hooks import kv_cache
    from sglang_fp8rl.kv_scales import engine

    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate"))
    pool = MHATokenToKVPool(size=16, page_size=1, dtype=torch.float8_e4m3fn, head_num=1, head_dim=4, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    layer = RadixAttention(num_heads=1, head_dim=4, scaling=1.0, num_kv_heads=1, layer_id=0)
    write = kv_cache.wrap_set_kv_buffer(MHATokenToKVPool.set_kv_buffer)
    k = torch.tensor([[[1.0, -2.0, 500.0, -900.0]]], dtype=torch.bfloat16)
    v = torch.tensor([[[0.5, 0.25, 3.0, -3.0]]], dtype=torch.bfloat16)
    write(pool, layer, torch.tensor([3]), k, v, torch.tensor(2.0), torch.tensor(0.5))
    assert k.float().tolist() == [[[0.5, -1.0, 250.0, -448.0]]]  # divided in place (as SGLang), then saturated
    assert pool.get_key_buffer(0)[3].float().tolist() == [[0.5, -1.0, 256.0, -448.0]]  # E4M3 of 250 is 256
    assert pool.get_value_buffer(0)[3].float().tolist() == [[1.0, 0.5, 6.0, -6.0]]
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="static"))
    k2 = torch.tensor([[[1.0, -2.0, 500.0, -900.0]]], dtype=torch.bfloat16)
    write(pool, layer, torch.tensor([4]), k2, v.clone(), torch.tensor(2.0), torch.tensor(0.5))
    assert k2.float().tolist() == [[[0.5, -1.0, 250.0, -450.0]]]  # static: SGLang's own write, untouched


def test_calibrated_kv_write_path_choice(monkeypatch):
    """The one-launch K/V write (kernels/kv_store.py, the default --fp8rl-kv-write fused) is taken where it is exact
    and where SGLang's own write would be a plain NHD store; otherwise the reason says why."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_fp8rl.hooks import kv_cache
    from sglang_fp8rl.kv_scales import engine
    from sglang_fp8rl.kv_scales.numerics import ScalePolicy

    pool = MHATokenToKVPool(size=16, page_size=1, dtype=torch.float8_e4m3fn, head_num=2, head_dim=4, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    k = v = torch.zeros(3, 2, 4, dtype=torch.bfloat16)
    args = (pool, 0, k, v, torch.tensor(1.0), torch.tensor(1.0), torch.arange(3))
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate"))
    assert "--fp8rl-kv-write sglang" in kv_cache.fused_write_reason(*args, {})  # asked for SGLang's write
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", fused_write=True))
    # before 0.5.15 SGLang's pool stores inline, without the _store_kv_layer the kernel replaces: never fused there
    from sglang_fp8rl.compat.kv_pool import stores_kv_like_mha
    assert ("CUDA" if stores_kv_like_mha(pool) else "MHATokenToKVPool stores its layers its own way") in \
        kv_cache.fused_write_reason(*args, {})
    assert "DCP mask" in kv_cache.fused_write_reason(*args, {"dcp_kv_mask": torch.ones(3, dtype=torch.bool)})
    monkeypatch.setattr(pool, "kv_cache_layout", "vectorized_5d", raising=False)  # 0.5.12 has no layouts
    assert "vectorized_5d" in kv_cache.fused_write_reason(*args, {})
    fp32 = ScalePolicy(scale_format="fp32")
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", policy=fp32, fused_write=True))
    assert "pow2" in kv_cache.fused_write_reason(*args, {})

    # asked for but unable to run (CPU): the write falls back to the saturating division, and a call without a layer
    # object (SGLang's layer_id_override) still works
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", fused_write=True))
    monkeypatch.setattr(pool, "kv_cache_layout", "nhd", raising=False)
    write = kv_cache.wrap_set_kv_buffer(MHATokenToKVPool.set_kv_buffer)
    k = torch.tensor([[[1.0, -2.0, 500.0, -900.0], [0.5, 0.25, 3.0, -3.0]]], dtype=torch.bfloat16)
    write(pool, RadixAttention(num_heads=2, head_dim=4, scaling=1.0, num_kv_heads=2, layer_id=0), torch.tensor([5]),
          k.clone(), k.clone(), torch.tensor(2.0), torch.tensor(1.0))
    assert pool.get_key_buffer(0)[5].float().tolist() == [[0.5, -1.0, 256.0, -448.0], [0.25, 0.125, 1.5, -1.5]]
    write(pool, None, torch.tensor([6]), k.clone(), k.clone(), torch.tensor(1.0), torch.tensor(1.0),
          layer_id_override=0)
    assert pool.get_value_buffer(0)[6].float().tolist() == [[1.0, -2.0, 448.0, -448.0], [0.5, 0.25, 3.0, -3.0]]


def test_kv_calibration_only_on_verified_backends(monkeypatch):
    """Triton and FlashInfer passed the GPU check (recalibrated == fresh server, bit for bit); FlashAttention-3 was not
    checked: there, auto falls back to static scales and an explicit --fp8rl-kv-scales calibrate is refused at start,
    unless the verification switch is set (what scripts/gpu/check_kv.py does to run the check)."""
    from types import SimpleNamespace

    from sglang.srt.layers.radix_attention import RadixAttention

    from sglang_fp8rl.hooks import kv_cache
    from sglang_fp8rl.kv_scales import engine

    class TritonAttnBackend:
        def forward_decode(self, *args, **kwargs):
            return None

    class FlashInferAttnBackend:
        def forward_decode(self, *args, **kwargs):
            return None

    class FlashAttentionBackend:
        def forward_decode(self, *args, **kwargs):
            return None

    def runner(backend, **args):
        model = torch.nn.Module()
        model.attn = RadixAttention(num_heads=1, head_dim=4, scaling=1.0, num_kv_heads=1, layer_id=0)
        return SimpleNamespace(attn_backend=backend, model=model, device="cpu", server_args=SimpleNamespace(**args))

    class TRTLLMHAAttnBackend:  # a backend of SGLang's whose use of KV scales this package has not verified
        def forward_decode(self, *args, **kwargs):
            return None

    for explicit in (False, True):
        monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", explicit=explicit))
        other = runner(TRTLLMHAAttnBackend())
        if explicit:
            with pytest.raises(ValueError, match="not verified"):
                kv_cache.use_backend(other)
        else:
            kv_cache.use_backend(other)
            assert engine.kv_state().mode == "static" and other.model.attn.k_scale is None
    # the verification switch lets calibration try such a backend, which then needs a known way of reading scales
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", explicit=True))
    monkeypatch.setenv("FP8RL_KV_ALLOW_UNVERIFIED_BACKEND", "1")
    with pytest.raises(ValueError, match="not known to read FP8 KV scales"):
        kv_cache.use_backend(runner(TRTLLMHAAttnBackend()))
    # FlashAttention-3 (SGLang's default on Hopper) is verified: it reads the scale tensors, so no fold
    monkeypatch.delenv("FP8RL_KV_ALLOW_UNVERIFIED_BACKEND")
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", explicit=True))
    fa3 = runner(FlashAttentionBackend())
    kv_cache.use_backend(fa3)
    assert isinstance(fa3.model.attn.k_scale, torch.Tensor) and engine.kv_state().calibrated_under == {0: (1.0, 1.0)}
    assert not getattr(fa3.attn_backend.forward_decode, "_fp8rl_kv_fold", False)
    assert engine.kv_state().mode == "calibrate"
    flashinfer = runner(FlashInferAttnBackend())
    kv_cache.use_backend(flashinfer)
    assert getattr(flashinfer.attn_backend.forward_decode, "_fp8rl_kv_fold", False)
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", explicit=True))
    with pytest.raises(ValueError, match="speculative decoding"):
        kv_cache.use_backend(runner(TritonAttnBackend(), speculative_algorithm="EAGLE"))
    triton = runner(TritonAttnBackend())
    kv_cache.use_backend(triton)
    assert isinstance(triton.model.attn.k_scale, torch.Tensor)
    assert getattr(triton.attn_backend.forward_decode, "_fp8rl_kv_fold", False)  # the decode reads the tensors
