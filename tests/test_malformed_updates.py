"""The malformed-request suite through SGLang's real WeightUpdater (one worker process runs every case).

For each case (tests/malformed_cases.py): no exception escapes the entry point; either the request is applied
exactly (every parameter equal to the expected bytes: W1 after a full update, W0 plus the victim otherwise, the
victim quantized from what was sent) or it is rejected with success False, a message naming the tensor or file and
the reason, every parameter byte-identical and every pointer unchanged.
"""

from __future__ import annotations

import pytest
import torch
from malformed_cases import BF16_KEPT_PATTERN, all_cases
from sgl_model import TINY, random_state_dict, run_worker, write_checkpoint

QUANT = ("--quantization", "fp8_online_blockwise")
KEEP_BF16 = ("--fp8rl-ignore", BF16_KEPT_PATTERN)  # one linear in BF16, for the cases that write it
CASES = all_cases()


def test_the_suite_is_large_and_its_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) >= 150
    assert {c.entry for c in CASES} == {"tensor", "bucket", "disk", "distributed"}
    assert {c.expect for c in CASES} == {"apply", "reject"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("malformed")
    write_checkpoint(str(d / "w0"), TINY, seed=40)
    torch.save(random_state_dict(TINY, seed=40), d / "w0.pt")
    torch.save(random_state_dict(TINY, seed=41), d / "w1.pt")
    # an unreachable model hub: a hub id must be refused, not hang or crash (air-gapped cluster)
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "2"}
    return run_worker("malformed", str(d / "w0"), str(d / "out.pt"), *QUANT, *KEEP_BF16, env=env, timeout=600,
                      extra={"w0": str(d / "w0.pt"), "w1": str(d / "w1.pt"), "work": str(d),
                             "model_dir": str(d / "w0")})


@pytest.mark.slow
def test_trainer_followed_the_plan(results):
    trainer = results["_trainer"]
    assert trainer["returncode"] == 0, trainer["log"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(results, case):
    record = results[case.id]
    assert "raised" not in record, record["raised"]
    ok, message = record["answer"]
    assert record["pointers_same"]
    if case.expect == "apply":
        assert ok, message
        assert record["differing"] == [], record["differing"]
        assert record["restored"]
        return
    assert not ok, f"accepted: {message}"
    assert record["differing"] == [], f"rejected but changed {record['differing']}"
    assert message.startswith("[fp8rl] update rejected, nothing was written"), message
    for word in case.says:
        assert word in message, f"{word!r} not in {message!r}"
    if record["path"]:
        assert record["path"] in message, message


def test_the_suites_step_marker_is_the_packages():
    """The marker the lone-half cases end their step with is the name the engine knows."""
    import malformed_cases

    from sglang_fp8rl.weight_sync.protocol import STEP_COMPLETE

    assert malformed_cases.STEP_COMPLETE == STEP_COMPLETE
