"""verl's colocated weight sync (issue 36, item 6) through SGLang's real release/resume methods on a CPU ModelRunner,
one worker process per variant, without and with a CPU backup of the weights (tests/colocated.py; torch_memory_saver
emulated there, since it needs CUDA). CI runs it on the primary, the oldest and the newest
release (scripts/cpu_matrix.sh).

Per step: release (KV cache and weights) -> a push, refused saying why -> resume the weights -> a push without one
tensor -> the full push of W1 -> resume the KV cache. Without a CPU backup the resumed weights are garbage, so the
engine stays inconsistent until every parameter has been rewritten; with one, nothing is marked. Both end bit for bit
on a cold W1 start, pointers unchanged, the KV scales recalibrated to the cold start's once the KV cache is back.
"""

from __future__ import annotations

import pytest
import torch
from sgl_model import as_bytes, run_worker, write_w0_w1

from sglang_fp8rl.engine import reset
from sglang_fp8rl.hooks import scheduler as scheduler_hooks
from sglang_fp8rl.weight_sync.engine_state import EVERYTHING, engine_state
from sglang_fp8rl.weight_sync.request import Destinations

pytestmark = pytest.mark.slow

ARGS = ("--quantization", "fp8_online_blockwise", "--kv-cache-dtype", "fp8_e4m3")
KV_CACHE, WEIGHTS = "kv_cache", "weights"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("colocated")
    w0, w1 = write_w0_w1(d)
    # V x 8 in W0 (Qwen3 normalizes K, not V): its KV scales differ from W1's, so that ending on W1's means something
    torch.save({k: v * 8 if k.endswith("v_proj.weight") else v for k, v in w0.items()}, d / "w0.pt")
    torch.save(w1, d / "w1.pt")
    return d


def colocated_step(d, backup: bool) -> dict:
    """One worker; it starts on W1: its cold start is the reference the colocated step must end on."""
    out = run_worker("colocated", str(d / "w1"), str(d / f"backup_{backup}.pt"), *ARGS,
                     *(("--enable-weights-cpu-backup",) if backup else ()),
                     extra={"w0": str(d / "w0.pt"), "w1": str(d / "w1.pt"), "w1_dir": str(d / "w1")})
    assert out["backup"] is backup
    return out


@pytest.fixture(scope="module")
def no_backup(models):
    return colocated_step(models, backup=False)


@pytest.fixture(scope="module")
def backup(models):
    return colocated_step(models, backup=True)


@pytest.fixture(params=["no_backup", "backup"])
def run(request):
    return request.getfixturevalue(request.param)


def differing(a: dict, b: dict) -> list[str]:
    return [name for name in a if not torch.equal(as_bytes(a[name]), as_bytes(b[name]))]


def test_w0_is_served_before_the_colocated_steps(run):
    assert all(answer is True or "Success" in str(answer) for answer in run["push_w0"]), run["push_w0"]
    assert run["on_w0"]["consistent"] and not run["on_w0"]["kv_due"]
    assert run["kv_w0"] != run["cold"]["kv_scales"]  # the W0 step was recalibrated


def test_a_push_between_release_and_resume_is_refused_saying_why(run):
    step = run
    assert step["released"]["released"] == [KV_CACHE, WEIGHTS] and step["saver_paused"] == [KV_CACHE, WEIGHTS]
    (message,) = step["push_released"]
    assert "released" in message and "/resume_memory_occupation" in message and "nothing was written" in message
    ok, message = step["disk_released"]
    assert not ok and "released" in message and "/resume_memory_occupation" in message
    assert step["after_refusal"]["consistent"], step["after_refusal"]  # nothing written: nothing dirty
    # a recalibration due while memory is released waits (its forward would read and write released memory)
    assert step["due_while_released"]["kv_due"]
    assert step["due_while_released"]["kv_writes"] == step["released"]["kv_writes"]


def test_weights_resumed_without_backup_are_not_served_until_every_parameter_is_rewritten(no_backup):
    step = no_backup
    resumed = step["resumed_weights"]
    assert not resumed["consistent"] and resumed["dirty"] == ["*"], resumed
    assert "without a CPU backup" in resumed["reason"] and resumed["released"] == [KV_CACHE]
    assert step["changed_by_resume"], "the emulated release left the weights as they were"
    # every tensor but the final norm: the norm still holds what the release left
    assert all(a is True or "Success" in str(a) for a in step["push_partial"]), step["push_partial"]
    assert not step["after_partial"]["consistent"] and step["after_partial"]["dirty"] == ["*"]
    assert all(a is True or "Success" in str(a) for a in step["push_full"]), step["push_full"]
    assert step["after_full"]["consistent"] and step["after_full"]["reason"] == ""
    # the step ended (the flush) with the KV cache still released: the recalibration waited for its resume
    assert step["after_full"]["kv_due"] and step["after_full"]["kv_writes"] == step["released"]["kv_writes"]


def test_weights_resumed_from_a_cpu_backup_are_served_as_they_were(backup):
    step = backup
    assert step["resumed_weights"]["consistent"] and step["resumed_weights"]["dirty"] == []
    assert step["changed_by_resume"] == []
    assert step["after_partial"]["consistent"] and step["after_full"]["consistent"]


def test_a_colocated_step_ends_on_a_cold_start(run):
    """Bit for bit (FP8 codes, scales, BF16 parameters), pointers unchanged (captured graphs stay valid), the KV
    scales recalibrated on the resume of the KV cache to what a cold W1 start calibrates, the same logits."""
    step, cold = run, run["cold"]
    assert differing(step["params"], cold["params"]) == []
    assert step["ptrs_after"] == step["ptrs_before"]
    end = step["resumed_kv"]
    assert end["consistent"] and end["released"] == [] and step["saver_paused_end"] == []
    assert not end["kv_due"] and end["kv_writes"] > step["after_full"]["kv_writes"]
    assert end["step"]["phase"] == "idle"
    assert step["kv_after"] == cold["kv_scales"]
    assert all(torch.equal(a, b) for a, b in zip(step["logits"], cold["logits"], strict=True))


# ---------------------------------------------------------------------------------------------------------------------
# in-process: the rule that clears EVERYTHING, and generation while memory is released


@pytest.fixture
def fresh_state():
    reset("engine_state")
    yield engine_state()
    reset("engine_state")


def writes_to(*params: torch.nn.Parameter) -> Destinations:
    """Where a request that copies ``params`` whole writes (what its dry run records)."""
    destinations = Destinations()
    destinations.plain.update({id(p): [("", "x")] for p in params})
    return destinations


def test_everything_goes_once_every_parameter_was_rewritten_since_it_was_marked(fresh_state):
    """Writes before the mark do not count; the decision is taken only where every TP rank takes it (agreed calls);
    a new mark forgets what was written before it."""
    state = fresh_state
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    params = list(model.parameters())
    state.note_written(model, writes_to(*params))  # nothing marked yet: not counted
    state.mark_dirty((), EVERYTHING)
    state.note_written(model, writes_to(*params[:2]))
    state.mark_written(["a"])
    assert state.dirty == {EVERYTHING} and "2 other parameters" in state.unwritten_summary()
    state.note_written(model, writes_to(*params[2:]))
    state.mark_written([], agreed=False)  # rank-local (a guarded load_weights): no decision
    assert not state.consistent
    state.mark_written([])
    assert state.consistent and state.inconsistent_reason == "" and state.unwritten is None
    state.mark_dirty((), "resumed again")
    state.mark_written([])
    assert not state.consistent and state.unwritten_summary() == "all of them (nothing written yet)"


def test_generation_is_refused_while_memory_is_released(fresh_state):
    """The request leaves the queue through SGLang's abort (no forward: even an aborted request runs a one-token
    prefill while queued, which would read released memory); a health check gets no answer (/health_generate: 503).
    The scheduler is a stand-in: SGLang's own needs CUDA."""
    class SchedulerLike:
        def __init__(self) -> None:
            self.waiting_queue: list = []
            self.aborted: list = []

        def abort_request(self, recv) -> None:
            self.aborted.append(recv.rid)
            self.waiting_queue = [rid for rid in self.waiting_queue if rid != recv.rid]

    class Recv:
        def __init__(self, rid: str) -> None:
            self.rid = rid

    def handle(self, recv):
        self.waiting_queue.append(recv.rid)

    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    fresh_state.released = {KV_CACHE}
    sched = SchedulerLike()
    refuse = scheduler_hooks.wrap_generate(handle)
    refuse(sched, Recv("gen-1"))
    assert sched.aborted == ["gen-1"] and sched.waiting_queue == []
    refuse(sched, Recv(HEALTH_CHECK_RID_PREFIX + "_1"))
    assert sched.waiting_queue == [] and sched.aborted == ["gen-1"]
    fresh_state.released = set()
    refuse(sched, Recv("gen-2"))
    assert sched.waiting_queue == ["gen-2"]


def test_the_hooks_sit_on_the_release_and_resume_sglang_calls():
    """SGLang's plugin loader installs them on this release's owner of release/resume (compat.updates)."""
    from sglang_fp8rl.cpu_runner import install_cpu_stubs

    install_cpu_stubs()
    from sglang.srt.plugins import load_plugins

    from sglang_fp8rl.compat import updates

    load_plugins()
    owner = updates.memory_occupation_owner()
    for name in ("release_memory_occupation", "resume_memory_occupation"):
        assert getattr(getattr(owner, name), "_fp8rl_patched", False), (owner, name)
