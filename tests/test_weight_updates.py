"""Weight updates through SGLang's real WeightUpdater on a CPU ModelRunner: equivalence, pointers, atomic rejection.

SGLang's HTTP server does not start on this CPU machine (its scheduler needs CUDA-only kernels), so these tests drive
`ModelRunner.weight_updater.update_weights_from_{tensor,disk}` — the exact methods the endpoints and `sglang.Engine`
reach in the scheduler process — with the plugin's engine hooks installed by SGLang's own plugin loader.
"""

from __future__ import annotations

import pytest
import torch
from sgl_model import (
    TINY,
    as_bytes,
    assert_same_params,
    assert_update_matches_cold_load,
    random_state_dict,
    run_update_requests,
    run_worker,
    split_randomly,
    write_checkpoint,
    write_w0_w1,
)

pytestmark = pytest.mark.slow

QUANT = ("--quantization", "fp8_online_blockwise")


def bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """The flattened_bucket payload SGLang's trainer-side helpers send."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    b = FlattenedTensorBucket(named_tensors=named)
    return {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("upd")
    w0, w1 = write_w0_w1(d)
    cold_w1 = run_worker("load", str(d / "w1"), str(d / "cold_w1.pt"), *QUANT)
    cold_w0 = run_worker("load", str(d / "w0"), str(d / "cold_w0.pt"), *QUANT)
    return {"dir": d, "w0": w0, "w1": w1, "cold_w1": cold_w1, "cold_w0": cold_w0}


def run_requests(models, name: str, requests: list[dict], **extra) -> dict:
    return run_update_requests(str(models["dir"] / "w0"), models["dir"], name, requests, *QUANT, **extra)


def test_update_equivalence_buckets_orders_and_paths(models):
    """W0 loaded, W1 pushed in 4 shuffled requests (lists and flattened buckets, FP32 and BF16): every parameter is
    bit-identical to a cold load of W1, no pointer moved, and logits equal the cold load's."""
    parts = split_randomly(models["w1"], 4, seed=0)
    requests = [
        {"kind": "tensor", "tensors": parts[0]},
        {"kind": "bucket", "bucket": bucket(parts[1])},
        # FP32 from a trainer: rounded to BF16 first, so identical to the BF16 checkpoint
        {"kind": "tensor", "tensors": [(n, t.float()) for n, t in parts[2]]},
        {"kind": "bucket", "bucket": bucket(parts[3])},
    ]
    out = run_requests(models, "equiv", requests, params_each=False)
    assert_update_matches_cold_load(out, models["cold_w1"])
    assert "[fp8rl] weight update #4" in out["_log"]


def test_partial_update_changes_exactly_its_rows(models):
    """A new k_proj of layer 1 changes rows 256:384 of that qkv weight and scale row 2, nothing else."""
    name = "model.layers.1.self_attn.k_proj.weight"
    out = run_requests(models, "partial", [{"kind": "tensor", "tensors": [(name, models["w1"][name])]}])
    assert out["answers"][0][0], out["answers"]
    after, before = out["final_params"], models["cold_w0"]["params"]
    qkv, scale = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.weight_scale_inv"
    for param in after:
        if param not in (qkv, scale):
            assert torch.equal(as_bytes(after[param]), as_bytes(before[param])), param
    changed_rows = (after[qkv].view(torch.uint8) != before[qkv].view(torch.uint8)).any(dim=1).nonzero().flatten()
    assert changed_rows.min() >= 256 and changed_rows.max() < 384 and len(changed_rows) > 100
    assert torch.equal(after[qkv][256:384].view(torch.uint8),
                       models["cold_w1"]["params"][qkv][256:384].view(torch.uint8))
    assert torch.equal(after[scale][[0, 1, 3]], before[scale][[0, 1, 3]])
    assert torch.equal(after[scale][2], models["cold_w1"]["params"][scale][2])
    assert out["ptrs_before"] == out["ptrs_after"]


def test_an_empty_flattened_bucket_is_a_no_op(models):
    """slime pads a rank that has no tensors (expert parallelism) with an empty flattened bucket: stock SGLang answers
    success and writes nothing, and so does the plugin; a bucket with bytes but no metadata is still refused."""
    empty = {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []}
    unexplained = {"flattened_tensor": torch.zeros(16, dtype=torch.uint8), "metadata": []}
    out = run_requests(models, "empty_bucket", [{"kind": "bucket", "bucket": empty},
                                                {"kind": "bucket", "bucket": unexplained}])
    (ok, message), (ok_bad, message_bad) = out["answers"]
    assert ok, message
    assert not ok_bad and "no metadata holds 16 bytes" in message_bad
    for name, value in out["final_params"].items():
        assert torch.equal(as_bytes(value), as_bytes(models["cold_w0"]["params"][name])), name
    assert out["ptrs_before"] == out["ptrs_after"] and out["state"]["consistent"]


MARKER = ("fp8rl.step_complete", torch.zeros(()))  # the step-complete control entry (weight_sync/protocol.py)


def bad_requests(models) -> list[tuple[str, dict, str]]:
    """(case, request, expected message fragment): each must be refused with nothing written."""
    w1 = models["w1"]
    good = ("model.layers.0.self_attn.q_proj.weight", w1["model.layers.0.self_attn.q_proj.weight"])
    k = "model.layers.0.self_attn.k_proj.weight"
    nan = w1[k].clone()
    nan[5, 7] = float("nan")
    inf = w1["model.norm.weight"].clone()
    inf[3] = float("inf")
    overflow = w1[k].float()
    overflow[1, 2] = 3.4e38  # finite in FP32, Inf once rounded to BF16
    truncated = bucket([good, (k, w1[k])])
    truncated["flattened_tensor"] = truncated["flattened_tensor"][:-64]
    return [
        ("unknown name", {"tensors": [good, ("model.layers.0.mlp.bogus_proj.weight", w1[k])]}, "not a parameter"),
        ("wrong shape", {"tensors": [good, (k, w1[k][:64])]}, "expected an unsharded tensor of shape (128, 256)"),
        ("wrong shape bf16 param", {"tensors": [good, ("model.norm.weight", w1["model.norm.weight"][:10])]},
         "model.norm.weight"),
        ("wrong dtype int", {"tensors": [good, (k, w1[k].to(torch.int32))]}, "dtype torch.int32 is not accepted"),
        # an FP8 half alone is held for a later request of the step: refused when the request ends the step
        ("fp8 without scale", {"tensors": [good, (k, w1[k].to(torch.float8_e4m3fn)), MARKER]},
         "k_proj.weight without model.layers.0.self_attn.k_proj.weight_scale_inv"),
        ("nan", {"tensors": [good, (k, nan)]}, "contains NaN/Inf in BF16 (first at index [5, 7])"),
        ("inf in a bf16 param", {"tensors": [good, ("model.norm.weight", inf)]},
         "contains NaN/Inf in BF16 (first at index [3])"),
        ("fp32 overflowing bf16", {"tensors": [good, (k, overflow)]},
         "contains NaN/Inf in BF16 (first at index [1, 2])"),
        ("duplicate", {"tensors": [good, good]}, "appears more than once"),
        ("fused name", {"tensors": [good, ("model.layers.0.self_attn.qkv_proj.weight",
                                           torch.cat([w1[good[0]], w1[k], w1[k]]))]}, "not accepted"),
        ("scale tensor", {"tensors": [good, ("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(2, 2)),
                                      MARKER]},
         "o_proj.weight_scale_inv without model.layers.0.self_attn.o_proj.weight"),
        ("scale of a bf16 weight", {"tensors": [good, (k, w1[k]), (k + "_scale_inv", torch.ones(1, 2))]},
         "a scale needs model.layers.0.self_attn.k_proj.weight as float8_e4m3fn codes"),
        ("truncated bucket", {"kind": "bucket", "bucket": truncated}, "truncated bucket"),
    ]


def test_bad_updates_are_rejected_atomically(models):
    """Each bad request answers success=False naming the tensor and reason, and every parameter stays
    byte-identical (the valid tensor in the same request is not applied either); the engine stays consistent."""
    cases = bad_requests(models)
    requests = [{"kind": "tensor", **req} if "kind" not in req else req for _, req, _ in cases]
    out = run_requests(models, "bad", requests)
    before = models["cold_w0"]["params"]
    for (case, _, fragment), (ok, message), params in zip(cases, out["answers"], out["params_after"]):
        assert not ok, case
        assert fragment in message, (case, message)
        assert "nothing was written" in message or "truncated" in message, (case, message)
        assert_same_params(params, before)
    assert out["ptrs_before"] == out["ptrs_after"]
    assert out["state"]["consistent"]


def test_disk_update_equivalence_and_rejection(models, tmp_path):
    """update_weights_from_disk of W1 equals a cold load of W1; a checkpoint with a NaN is refused up front."""
    bad = dict(models["w1"])
    bad["model.layers.2.mlp.down_proj.weight"] = bad["model.layers.2.mlp.down_proj.weight"].clone()
    bad["model.layers.2.mlp.down_proj.weight"][0, 0] = float("nan")
    write_checkpoint(str(tmp_path / "bad"), TINY, seed=0, state_dict=bad)
    d = models["dir"]
    out = run_requests(models, "disk", [{"kind": "disk", "path": str(tmp_path / "bad")},
                                        {"kind": "disk", "path": str(d / "w1")}])
    (ok_bad, msg_bad), (ok_good, msg_good) = out["answers"]
    assert not ok_bad and "model.layers.2.mlp.down_proj.weight: contains NaN/Inf in BF16" in msg_bad
    assert_same_params(out["params_after"][0], models["cold_w0"]["params"])
    assert ok_good, msg_good
    assert_same_params(out["final_params"], models["cold_w1"]["params"])
    assert out["ptrs_before"] == out["ptrs_after"]


def test_1000_updates_do_not_grow_live_tensors_or_bytes(models):
    """A 1000-update soak: the live tensors and the bytes they hold after update 10 and after update 1000 are the
    same, and no parameter pointer moved."""
    d = models["dir"]
    path = str(d / "leak.req.pt")
    torch.save([{"tensors": list(models["w1"].items())}], path)
    out = run_worker("leak", str(d / "w0"), str(d / "leak.out.pt"), *QUANT, extra={"requests": path, "n": 1000},
                     timeout=1200)
    (count_10, bytes_10), (count_1000, bytes_1000) = out["live"]
    assert count_1000 <= count_10 and bytes_1000 <= bytes_10, out["live"]
    assert out["ptrs_before"] == out["ptrs_after"]


def test_failure_after_writing_started_marks_engine_inconsistent(models):
    """A device error in the middle of applying an update is reported as a partial update (not as 'nothing was
    written'), the engine state says inconsistent, and the next complete update restores a consistent model
    bit-identical to a cold load."""
    d = models["dir"]
    path = str(d / "fail.req.pt")
    torch.save([{"tensors": list(models["w1"].items())}], path)
    out = run_worker("device_failure", str(d / "w0"), str(d / "fail.out.pt"), *QUANT, extra={"requests": path})
    ok, message = out["first"]
    assert not ok
    assert "failed after writing started" in message and "mix of old and new weights" in message
    assert "nothing was written" not in message
    assert out["state_after_failure"]["consistent"] is False
    assert "simulated CUDA error" in out["state_after_failure"]["reason"]
    assert out["second"][0] and out["consistent_after_second"]
    assert_same_params(out["final_params"], models["cold_w1"]["params"])


def test_generation_refused_while_inconsistent(monkeypatch):
    """While the engine is inconsistent, a generate request is finished with an error (Req.set_finish_with_abort,
    SGLang's own abort path) and a health-check request gets no answer; when consistent, requests pass untouched.
    The Scheduler and Req need a CUDA/TP world, so a queue and a request stand-in are used here."""
    from sglang_fp8rl.engine import OWNERS
    from sglang_fp8rl.hooks import scheduler as scheduler_hooks
    from sglang_fp8rl.weight_sync.engine_state import EngineState

    class Recv:
        def __init__(self, rid):
            self.rid = rid

    class QueuedReq:
        def __init__(self, rid):
            self.rid, self.abort_message = rid, None

        def set_finish_with_abort(self, message):
            self.abort_message = message

    class SchedulerLike:
        def __init__(self):
            self.waiting_queue = []

    def original(self, recv):
        self.waiting_queue.append(QueuedReq(recv.rid))

    handle = scheduler_hooks.wrap_generate(original)
    sched = SchedulerLike()
    handle(sched, Recv("ok-1"))
    assert sched.waiting_queue[-1].abort_message is None

    monkeypatch.setattr(OWNERS, "engine_state",
                        EngineState(dirty={"x.weight"}, inconsistent_reason="update #7 failed"))
    handle(sched, Recv("r-2"))
    aborted = sched.waiting_queue[-1]
    assert aborted.rid == "r-2"
    assert "refusing to serve" in aborted.abort_message and "update #7" in aborted.abort_message
    queued = len(sched.waiting_queue)
    handle(sched, Recv("HEALTH_CHECK_abc"))
    assert len(sched.waiting_queue) == queued


def test_bf16_engine_answers_the_clients_step_protocol(models, tmp_path):
    """A model served without our quantization (the BF16 baseline of an RL run): validate-only requests are checked
    and write nothing, pre-quantized FP8 is refused, and the step marker is dropped before SGLang's own update."""
    from sgl_model import run_update_requests

    w1 = list(models["w1"].items())
    bad = w1[:-1] + [(w1[-1][0], torch.full_like(w1[-1][1], float("nan")))]
    fp8 = [(w1[-1][0], w1[-1][1].float().clamp(-1, 1).to(torch.float8_e4m3fn))]
    marker = ("fp8rl.step_complete", torch.zeros(()))
    requests = [{"tensors": w1, "load_format": "fp8rl.validate"}, {"tensors": bad, "load_format": "fp8rl.validate"},
                {"tensors": fp8, "load_format": "fp8rl.validate"}, {"tensors": w1 + [marker]}]
    out = run_update_requests(str(models["dir"] / "w0"), tmp_path, "bf16_steps", requests)
    (ok1, m1), (ok2, m2), (ok3, m3), (ok4, m4) = out["answers"]
    assert ok1 and "validated, nothing written" in m1
    assert not ok2 and "NaN/Inf" in m2 and not ok3 and "fp8_online_blockwise" in m3
    assert ok4, m4
    first = out["params_after"][0]  # after the first validate-only request, which writes nothing
    for later in out["params_after"][1:3]:
        assert_same_params(later, first)
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(out["final_params"][norm], models["w1"][norm])
    assert not torch.equal(first[norm], models["w1"][norm])


def test_two_names_for_one_parameter_are_refused(tmp_path):
    """SGLang's Qwen3 loader takes ``model.layers.N...`` and ``layers.N...``: one request naming a parameter both ways
    would write it twice (on CUDA in one multi-tensor copy or one grouped launch, where which one lands is undefined).
    Refused, naming both tensors, for an FP8 layer, a layer kept in BF16 and a norm, as lists and flattened buckets;
    the same name twice is still refused; one name of either spelling alone is applied."""
    keep = ("--fp8rl-ignore", r"^model\.layers\.0\.mlp\.down_proj$")
    write_checkpoint(str(tmp_path / "w0"), TINY, seed=12)
    w1 = random_state_dict(TINY, seed=13)
    targets = ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
               "model.layers.0.input_layernorm.weight"]
    pairs = [[(name, w1[name]), (name.removeprefix("model."), w1[name].clone())] for name in targets]
    requests = [{"kind": "tensor", "tensors": pair} for pair in pairs]
    requests += [{"kind": "bucket", "bucket": bucket(pair)} for pair in pairs]
    same_name_twice, short_name_alone = [pairs[0][0], pairs[0][0]], [pairs[0][1]]
    requests += [{"kind": "tensor", "tensors": same_name_twice}, {"kind": "tensor", "tensors": short_name_alone}]
    out = run_update_requests(str(tmp_path / "w0"), tmp_path, "alias", requests, *QUANT, *keep)
    cold = run_worker("load", str(tmp_path / "w0"), str(tmp_path / "cold.pt"), *QUANT, *keep)
    assert cold["report"]["decisions"]["model.layers.0.mlp.down_proj"][0] == "bf16"
    answers, params = out["answers"], out["params_after"]
    for (ok, message), after, name in zip(answers[:6], params[:6], targets * 2):
        assert not ok and "nothing was written" in message, message
        assert repr(name) in message and repr(name.removeprefix("model.")) in message, message
        assert_same_params(after, cold["params"])
    assert not answers[6][0] and "more than once" in answers[6][1], answers[6]
    assert answers[7][0], answers[7]
    changed = {n for n, p in params[7].items() if not torch.equal(as_bytes(p), as_bytes(cold["params"][n]))}
    assert changed == {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale_inv"}
    assert out["state"]["consistent"]
