"""The CPU side of scripts/gpu/check_colocated.py: its command line, its plan (launch flags that SGLang's own parser
takes, with the plugin loaded), and its verdicts and report rebuilt from a file of the shape it records
(tests/data/check_colocated_synthetic.json, written by hand before the first GPU run), good and damaged."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))

import check_colocated  # noqa: E402
import colocated_checks  # noqa: E402

RECORDED = os.path.join(ROOT, "tests", "data", "check_colocated_synthetic.json")


@pytest.fixture
def recorded() -> dict:
    with open(RECORDED) as f:
        return json.load(f)


def verdicts(report: dict) -> dict[str, str]:
    return {c.name: c.verdict for c in check_colocated.all_checks(report["observations"])}


def test_command_line():
    args = check_colocated.parse_args(["--out", "o", "--model-dir", "m"])
    assert args.passes == ["no_backup", "backup"] and args.port == 30060
    assert check_colocated.parse_args(["--out", "o", "--dry-run", "--passes", "backup", "backup"]).passes == ["backup"]
    with pytest.raises(SystemExit):
        check_colocated.parse_args(["--out", "o"])  # a GPU run needs the model folder
    with pytest.raises(SystemExit):
        check_colocated.parse_args(["--out", "o", "--dry-run", "--passes", "cpu"])


def test_servers_start_first_pass_then_its_reference():
    assert check_colocated.server_order(["no_backup", "backup"]) == [("pass", "no_backup"), ("cold", None),
                                                                     ("pass", "backup")]
    assert check_colocated.server_order(["backup"]) == [("pass", "backup"), ("cold", None)]
    assert check_colocated.parse_args(["--out", "o", "--model-dir", "m", "--deadline-s", "400"]).deadline_s == 400


def test_dry_run_prints_the_plan_without_a_gpu(capsys):
    assert check_colocated.main(["--out", "o", "--dry-run", "--passes", "backup"]) == 0
    plan = json.loads(capsys.readouterr().out)
    a, cold = plan["servers"]["A (backup)"]["flags"], plan["servers"]["cold (W1 from disk)"]["flags"]
    assert {"--enable-memory-saver", "--enable-weights-cpu-backup", "--load-format"} <= set(a)
    assert "fp8_e4m3" in a and "fp8_e4m3" in cold and "--enable-memory-saver" in cold
    assert list(plan["servers"]) == ["A (backup)", "cold (W1 from disk)"]


def test_the_launch_flags_are_sglangs(tmp_path):
    """Every flag of the plan parses with SGLang's ServerArgs once the plugin is loaded (as launch_server does)."""
    from sgl_model import TINY, write_checkpoint

    from sglang_fp8rl.compat.runtime import no_graph_flags
    from sglang_fp8rl.cpu_runner import CPU_SERVER_ARGS, install_cpu_stubs

    install_cpu_stubs()
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    write_checkpoint(str(tmp_path / "m"), TINY, seed=0)
    plan = check_colocated.plan(check_colocated.parse_args(["--out", "o", "--dry-run"]))
    for server in plan["servers"].values():
        args = prepare_server_args(["--model-path", str(tmp_path / "m"), *CPU_SERVER_ARGS, *no_graph_flags(),
                                    "--quantization", "fp8_online_blockwise", *server["flags"]])
        assert args.enable_memory_saver and args.kv_cache_dtype == "fp8_e4m3"
        assert args.enable_weights_cpu_backup == ("--enable-weights-cpu-backup" in server["flags"])


def test_report_from_a_recorded_run(recorded, tmp_path, capsys):
    """Every check passes on the recorded observations; the JSON and the markdown table are written."""
    path = tmp_path / "in.json"
    path.write_text(json.dumps(recorded))
    assert check_colocated.main(["--out", str(tmp_path / "out"), "--report-from", str(path)]) == 0
    written = json.loads((tmp_path / "out" / "check_colocated.json").read_text())
    assert written["passed"] == written["total"] == 2 * 10
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "no_backup.params_equal_cold_start | PASS" in summary and "20/20 checks passed" in summary
    assert "20/20 checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("damage, failed", [
    # the engine served weights resumed without their bytes as if consistent
    (lambda p, c: p["no_backup"]["info_resumed"].update(consistent=True), "no_backup.resume_weights"),
    # a backup that came back marked inconsistent
    (lambda p, c: p["backup"]["info_resumed"].update(consistent=False), "backup.resume_weights"),
    (lambda p, c: p["backup"]["push_released"].update(ok=True), "backup.push_refused_while_released"),
    (lambda p, c: p["backup"]["generate_released"].update(status=200, text='{"text": "served"}'),
     "backup.generate_refused_while_released"),
    # the recalibration ran while the KV cache was still released
    (lambda p, c: p["no_backup"]["info_pushed"]["kv_scales"].update(writes=2), "no_backup.push_w1 no_backup.resume_kv"),
    (lambda p, c: p["no_backup"]["info_end"].update(fp8_param_ptr_digest=1), "no_backup.fp8_pointers_unchanged"),
    (lambda p, c: p["backup"]["checksums_end"]["0"].update({"model.norm.weight": "0"}),
     "backup.params_equal_cold_start"),
    (lambda p, c: p["backup"].update(checksums_end=None), "backup.params_equal_cold_start"),
    (lambda p, c: c["info"]["kv_scales"]["scales"].update({"0": [1.0, 1.0]}),
     "no_backup.kv_scales_equal_cold_start backup.kv_scales_equal_cold_start"),
    (lambda p, c: p["no_backup"]["outputs_end"][0]["logprobs"].__setitem__(0, -1.0),
     "no_backup.outputs_equal_cold_start"),
])
def test_a_damaged_record_fails_the_checks_it_concerns_and_no_other(recorded, damage, failed):
    report = copy.deepcopy(recorded)
    damage(report["observations"]["passes"], report["observations"]["cold"])
    got = verdicts(report)
    assert [name for name, verdict in got.items() if verdict == "FAIL"] == failed.split(), got


def test_a_pass_or_cold_start_that_did_not_run_is_a_failure(recorded):
    report = copy.deepcopy(recorded)
    report["observations"]["passes"]["backup"] = {"pass": "backup", "error": "TimeoutError: server on 30060"}
    report["observations"]["cold"] = {"error": "RuntimeError: server on 30061 exited with 1"}
    got = verdicts(report)
    assert got["backup.cycle"] == "FAIL" and got["no_backup.equals_cold_start"] == "FAIL"
    assert got["no_backup.resume_weights"] == "PASS"
    assert verdicts({"observations": {"error": "OSError: no space"}}) == {"colocated": "FAIL"}
    assert colocated_checks.differing_checksums({"0": {"a": "1"}}, {"0": {"a": "1", "b": "2"}}) == ["0/b"]
