"""FP8 KV scales wired into the engine (hooks/kv_cache.py, weight_sync/kv_updates.py) through SGLang's CPU
ModelRunner: calibrated at load, recalibrated after an update that completes a step, trainer scales validated and
written in place; with a BF16 KV cache nothing changes and trainer scales are refused.

(The torch-native CPU attention ignores KV scales, so these tests check the scales, not the attention outputs; the
GPU tests and scripts/gpu/check_kv.py cover the backends.)"""

from __future__ import annotations

import pytest
import torch
from sgl_model import TINY, run_worker, write_checkpoint

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv_engine")
    sd = write_checkpoint(str(d / "w0"), TINY, seed=60)
    torch.save(sd, d / "w0.pt")
    return d


def test_calibrated_kv_scales_follow_the_policy(model):
    out = run_worker("kv", str(model / "w0"), str(model / "kv.pt"), *QUANT, "--kv-cache-dtype", "fp8_e4m3",
                     extra={"state_dict": str(model / "w0.pt")})
    assert out["mode"] == "calibrate" and "tokenizer" in out["batch"]
    load = out["load"]
    assert load["writes"] == 1 and load["source"] == "calibration" and load["tokens"] == 512  # the CPU pool: 512
    assert out["update"][0] and out["due"]
    step = out["after_step"]
    assert step["writes"] == 2 and step["source"] == "calibration"
    # v_proj x 8 on layer 0: its V amax is exactly 8x (its input does not change), its power-of-two V scale too
    assert step["amax"]["0"][1] == 8 * load["amax"]["0"][1] and step["scales"]["0"][1] == 8 * load["scales"]["0"][1]
    assert step["scales"]["0"][0] == load["scales"]["0"][0]
    answers = out["answers"]
    assert answers["good"][0], answers["good"]
    k, v = answers["good_scales"][1]
    assert (k, v) == (0.5, 0.25)  # 0.3 rounded up to a power of two, like calibrated scales; v as sent
    for bad in ("nan", "zero", "negative"):
        ok, message = answers[bad]
        assert not ok and "nothing was written" in message and "KV scale" in message, message
        assert answers[bad + "_scales"] == answers["good_scales"]
    assert out["floats_match"] and out["ptrs"] == out["ptrs_after"]
    assert out["telemetry"]["mode"] == "calibrate" and out["telemetry"]["writes"] == 3


def test_static_mode_keeps_sglangs_scales_and_refuses_trainer_scales(model):
    out = run_worker("kv", str(model / "w0"), str(model / "kv_static.pt"), *QUANT,
                     extra={"state_dict": str(model / "w0.pt")})
    assert out["mode"] == "static" and out["load"] == {"writes": 0}
    assert out["update"][0] and not out["due"] and out["after_step"] == {"writes": 0}
    ok, message = out["answers"]["good"]
    assert not ok and "--fp8rl-kv-scales calibrate" in message


def test_calibration_batch_sources_and_limits(tmp_path):
    """The batch: the user's file, else the built-in text through the tokenizer, else seeded random ids; always cut
    to the context length, and to the free KV slots when it runs."""
    import json

    from sgl_model import write_tokenizer

    from sglang_fp8rl.kv_scales.engine import batch_within, calibration_batch

    path = tmp_path / "batch.json"
    path.write_text(json.dumps([[1, 2, 3, 4, 5], [6, 7]]))
    ids, source = calibration_batch(str(path), None, vocab_size=10, context_len=4)
    assert ids == [[1, 2, 3], [6, 7]] and source == str(path)
    ids, source = calibration_batch("", None, vocab_size=50, context_len=100)
    assert len(ids) == 4 and all(len(s) == 99 for s in ids) and "random" in source
    assert ids == calibration_batch("", None, vocab_size=50, context_len=100)[0]  # seeded: every start the same
    write_tokenizer(str(tmp_path), 320)
    ids, source = calibration_batch("", str(tmp_path), vocab_size=320, context_len=4096)
    assert "tokenizer" in source and len(ids) == 4 and all(len(s) == 512 for s in ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        calibration_batch(str(path), None, vocab_size=5, context_len=10)
    assert batch_within([[1, 2, 3, 4], [5, 6, 7, 8]], 6) == [[1, 2, 3], [5, 6, 7]]
    with pytest.raises(ValueError, match="too few"):
        batch_within([[1, 2], [3, 4], [5, 6]], 2)


def test_a_tokenizer_that_gives_no_tokens_falls_back_to_random_ids(tmp_path, caplog):
    """A model folder whose tokenizer turns the built-in text into no tokens: the seeded random batch, logged once
    with the reason, instead of an error at start."""
    import logging

    from tokenizers import Regex, Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from sglang_fp8rl.kv_scales.engine import calibration_batch, random_token_ids

    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(Regex(r"[\s\S]"), "")  # every character removed: no tokens at all
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="sglang_fp8rl.kv_scales.engine"):
        ids, source = calibration_batch("", str(tmp_path), vocab_size=320, context_len=4096)
    assert ids == random_token_ids(320) and "random" in source and "no tokens" in source
    logged = [r.getMessage() for r in caplog.records if "no tokens" in r.getMessage()]
    assert len(logged) == 1 and str(tmp_path) in logged[0], logged


@pytest.mark.parametrize("max_running", [1, 2])
def test_calibration_fits_few_request_slots(model, max_running):
    """--max-running-requests below the batch's 4 sequences: the batch is cut to the free request slots (fewer
    sequences, each as before), so the server starts, calibrates, and recalibrates after a step."""
    out = run_worker("kv", str(model / "w0"), str(model / f"kv_{max_running}.pt"), *QUANT, "--kv-cache-dtype",
                     "fp8_e4m3", "--max-running-requests", str(max_running), extra={"state_dict": str(model / "w0.pt")})
    assert out["mode"] == "calibrate" and out["load"]["writes"] == 1 and out["load"]["source"] == "calibration"
    assert out["update"][0] and out["after_step"]["writes"] == 2, out["after_step"]
    assert out["load"]["sequences"] == out["after_step"]["sequences"] == max_running  # at load and after the step


def test_batch_within_free_request_slots():
    """One sequence per free request slot, each unchanged (then cut alike to the free KV slots); none free: refused."""
    from sglang_fp8rl.kv_scales.engine import batch_within

    ids = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert batch_within(ids, 100, free_requests=2) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batch_within(ids, 100, free_requests=8) == ids
    assert batch_within(ids, 3, free_requests=1) == [[1, 2, 3]]
    assert batch_within(ids, 6, free_requests=2) == [[1, 2, 3], [5, 6, 7]]
    with pytest.raises(ValueError, match="no request slot"):
        batch_within(ids, 100, free_requests=0)


def test_a_refused_flush_after_an_update_does_not_kill_the_scheduler_and_is_retried_when_idle(monkeypatch):
    """Up to 0.5.21 SGLang asserts the cache flush after an update, so an update answered while requests run (its
    in-place pause) kills the scheduler; with the plugin the refusal is remembered and the flush runs when idle."""
    from types import SimpleNamespace

    from sglang_fp8rl.hooks import kv_cache

    flushes = []
    model = SimpleNamespace()
    manager = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
                              flush_cache=lambda empty_cache=False: flushes.append("flush") or len(flushes) > 1)

    def original(self, recv_req):  # SGLang's own, up to 0.5.21
        assert self.flush_cache(empty_cache=recv_req.torch_empty_cache), "Cache flush failed after updating weights"

    monkeypatch.setattr(kv_cache, "is_attached", lambda m: m is model)  # a model served by the plugin
    monkeypatch.setattr(kv_cache.updates, "scheduler_update_manager", lambda s: s.weight_updater)
    monkeypatch.setattr(kv_cache.cache_state(), "flush_due", False)
    request = SimpleNamespace(flush_cache=True, torch_empty_cache=False)
    kv_cache.wrap_flush_after_update(original)(manager, request)  # refused, no assert
    assert kv_cache.cache_state().flush_due and flushes == ["flush"]
    scheduler = SimpleNamespace(is_fully_idle=lambda: True, weight_updater=manager)
    kv_cache.wrap_on_idle(lambda self: None)(scheduler)
    assert not kv_cache.cache_state().flush_due and flushes == ["flush", "flush"]


@pytest.mark.parametrize("kv", [True, False], ids=["fp8_kv", "bf16_kv"])
def test_an_explicit_cache_flush_ends_a_step_without_marker_or_session(model, kv):
    """verl 0.9.1's sync (buckets with no step marker, no session, then /flush_cache) through SGLang's own flush
    handler: the flush ends the step and the calibrated KV scales follow the new weights; a flush with no step open
    changes nothing; a step holding an FP8 half for its partner stays open until the partner comes."""
    args = (*QUANT, "--kv-cache-dtype", "fp8_e4m3") if kv else QUANT
    out = run_worker("flush", str(model / "w0"), str(model / f"flush_{kv}.pt"), *args,
                     extra={"state_dict": str(model / "w0.pt")})
    assert out["flush_idle"] and out["step_idle"]["steps_ended"] == 0
    assert out["update"][0] and out["step_open"]["phase"] == "open" and not out["due_before_flush"]
    assert out["flush"] and out["step_after_flush"]["phase"] == "idle"
    assert out["step_after_flush"]["steps_ended"] == 1
    if kv:
        assert out["writes_after_flush"] == out["writes_load"] + 1
        assert out["record"]["source"] == "calibration"
    else:
        assert out["writes_after_flush"] is None
    assert out["flush_again"] and out["writes_after_again"] == out["writes_after_flush"]
    assert out["half"][0] and out["flush_held"]
    assert out["step_held"]["phase"] == "open" and out["step_held"]["held_halves"]
    assert out["partner"][0] and out["flush_paired"]
    assert out["step_paired"]["phase"] == "idle" and out["step_paired"]["steps_ended"] == 2
    if kv:
        assert out["writes_paired"] == out["writes_after_flush"] + 1


def test_the_flush_hook_never_raises_into_the_scheduler(caplog):
    """A failure inside the hook (here: no scheduler behind the handler) is logged; SGLang's answer goes out as is."""
    import logging
    from types import SimpleNamespace

    from sglang_fp8rl.hooks import sessions

    answer = SimpleNamespace(success=True)
    handle = sessions.wrap_flush_request(lambda self, recv_req: answer)
    with caplog.at_level(logging.WARNING, logger=sessions.__name__):
        assert handle(SimpleNamespace(), object()) is answer
    assert "the step stays open" in caplog.text
    refused = SimpleNamespace(success=False)
    assert sessions.wrap_flush_request(lambda self, recv_req: refused)(SimpleNamespace(), object()) is refused
