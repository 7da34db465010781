"""CPU tests of scripts/gpu/profile_server_step.py and its trace analysis scripts/gpu/step_trace.py: a synthetic torch
profiler trace of three served decode steps (host markers, runtime launches with correlation ids, a CUDA-graph replay,
torch sampling and a D2H copy on the GPU), worked out by hand; the fallbacks of the step-boundary finder; the server
log windows; the report; the /start_profile body against SGLang's ProfileReq; the command line."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import step_trace as ST
from suite_stage import stage_command_lines

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts/gpu/profile_server_step.py"

HOST, GPU = (100, 1), (0, 7)  # (pid, tid) of the scheduler thread and of the compute stream; copies on stream 9
MARKERS = [0.0, 1000.0, 2050.0, 3000.0]  # host starts of four step annotations: three steps and a partial fourth
GPU_LAG = 400.0  # the GPU runs each step 400 us after its host marker (the overlap scheduler runs ahead)
DEEP_GEMM = "void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0>"
NVJET = "nvjet_sm90_tst_192x16_64x8_2x1_v_bz_TNT"  # lm_head: one launch per step, layers x 0 + 1
QUANT = "per_token_group_quant_flat_kernel<QuantTrait<__nv_bfloat16, __nv_fp8_e4m3>>"
FA3 = "void cutlass::device_kernel<flash::FlashAttnFwdSm90<cutlass::float_e4m3_t>>"
NORM = "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, at::detail::Array<char*, 1> >"
SOFTMAX = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>"
EXPONENTIAL = ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
               "at::native::templates::cuda::exponential_kernel>")
ARGMAX = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, int, 4> >"
MEMCPY = "Memcpy DtoH (Device -> Pinned)"
# one step's graph (two layers), back to back from the step's GPU start: (name, us)
GRAPH = [(QUANT, 10), (DEEP_GEMM, 80), (FA3, 60), (NORM, 5), (QUANT, 10), (DEEP_GEMM, 80), (FA3, 60), (NORM, 5),
         (FILL, 4), (NVJET, 150)]  # 464 us
# after the graph: (name, category, GPU offset from the step's GPU start, us, tid)
SAMPLING = [(SOFTMAX, "kernel", 500, 20, 7), (EXPONENTIAL, "kernel", 550, 10, 7), (ARGMAX, "kernel", 560, 10, 7),
            (MEMCPY, "gpu_memcpy", 570, 5, 9)]
STEP_GROUPS = {"GEMMs": 160.0, "activation quantization": 20.0, "attention": 120.0, "norms/rotary": 10.0,
               "logits/sampling": 190.0, "other": 4.0, "memcpy/memset": 5.0}  # 509 us: lm_head 150 + 40 sampling
LOG = """\
[2026-11-27 10:00:00] Prefill batch, #new-seq: 8, #new-token: 8192, #cached-token: 0, token usage: 0.01
[2026-11-27 10:00:01] Decode batch, #running-req: 5, #token: 20480, token usage: 0.03, cuda graph: True, gen throughput (token/s): 500.00, #queue-req: 0
[2026-11-27 10:00:01] Decode batch, #running-req: 8, #token: 32800, token usage: 0.05, cuda graph: True, gen throughput (token/s): 1000.00, #queue-req: 0
[2026-11-27 10:00:01] Decode batch, #running-req: 8, #token: 32808, token usage: 0.05, cuda graph: True, gen throughput (token/s): 800.00, #queue-req: 0
[2026-11-27 10:00:02] Profiling starts. Traces will be saved to: /tmp/prof/traces/bf16 (with profile id: bf16)
[2026-11-27 10:00:02] Decode batch, #running-req: 8, #token: 32816, token usage: 0.05, cuda graph: True, gen throughput (token/s): 800.00, #queue-req: 0
[2026-11-27 10:00:02] Decode batch, #running-req: 8, #token: 32824, token usage: 0.05, cuda graph: True, gen throughput (token/s): 640.00, #queue-req: 0
[2026-11-27 10:00:02] Stop profiling...
[2026-11-27 10:00:05] Profiling done. Traces are saved to: /tmp/prof/traces/bf16
[2026-11-27 10:00:05] Decode batch, #running-req: 8, #token: 32832, token usage: 0.05, cuda graph: True, gen throughput (token/s): 2.00, #queue-req: 0
"""  # noqa: E501


def script():
    spec = importlib.util.spec_from_file_location("profile_server_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _x(name: str, cat: str, ts: float, dur: float, where: tuple, corr: int | None = None) -> dict:
    ev = {"ph": "X", "cat": cat, "name": name, "pid": where[0], "tid": where[1], "ts": ts, "dur": dur, "args": {}}
    if corr is not None:
        ev["args"]["correlation"] = corr
    return ev


def step_events(k: int, host: bool = True, runtime: bool = True) -> list[dict]:
    """Step k: its annotation and host ops, its launches (correlation 10 k + 1..5) and its GPU work."""
    b, g = MARKERS[k], MARKERS[k] + GPU_LAG
    ev = []
    if host:
        ev += [_x("step[DECODE bs=8]", "user_annotation", b, 300, HOST),
               _x("aten::softmax", "cpu_op", b + 245, 10, HOST), _x("aten::multinomial", "cpu_op", b + 258, 20, HOST)]
    if runtime:
        ev += [_x("cudaGraphLaunch", "cuda_runtime", b + 10, 20, HOST, 10 * k + 1),
               *(_x("cudaLaunchKernel", "cuda_runtime", b + t, 5, HOST, 10 * k + c) for t, c in ((250, 2), (260, 3),
                                                                                                  (270, 4))),
               _x("cudaMemcpyAsync", "cuda_runtime", b + 280, 5, HOST, 10 * k + 5)]
    t = g
    for name, us in GRAPH:
        ev.append(_x(name, "kernel", t, us, GPU, 10 * k + 1))
        t += us
    for c, (name, cat, off, us, tid) in enumerate(SAMPLING, start=2):
        ev.append(_x(name, cat, g + off, us, (0, tid), 10 * k + c))
    return ev


def trace(host: bool = True, runtime: bool = True, before: bool = True) -> dict:
    """Four steps (the fourth partial), metadata events, a flow event and a kernel launched before the first marker."""
    events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
              {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 100, "tid": 1, "ts": 10.0},
              _x("step[DECODE bs=8]", "gpu_user_annotation", 400.0, 464.0, GPU)]  # not GPU work of its own
    if before:
        events += [_x("cudaLaunchKernel", "cuda_runtime", -500.0, 5, HOST, 99), _x(FILL, "kernel", -100.0, 50, GPU, 99)]
    for k in range(len(MARKERS)):
        events += step_events(k, host, runtime)
    return {"traceEvents": events}


# ----------------------------------------------------------------------------------------------------------------
# the analysis
# ----------------------------------------------------------------------------------------------------------------

def test_steps_from_sglang_step_annotations():
    a = ST.analyze(trace(), batch=8, layers=2)
    assert (a["marker"], a["markers"], a["steps_found"]) == ("step annotation", 4, 3)
    assert a["labels"] == ["step[DECODE bs=8]"]
    assert [s["wall_us"] for s in a["steps"]] == [1000.0, 1050.0, 950.0]
    assert [s["gpu_start_us"] for s in a["steps"]] == [400.0, 1400.0, 2450.0]
    assert [s["gpu_period_us"] for s in a["steps"]] == [1000.0, 1050.0, 950.0]
    assert [s["gpu_busy_us"] for s in a["steps"]] == [509.0] * 3
    assert [s["gpu_idle_us"] for s in a["steps"]] == [491.0, 541.0, 441.0]
    assert [s["gpu_events"] for s in a["steps"]] == [14] * 3
    assert all(s["groups_us"] == STEP_GROUPS for s in a["steps"])
    s = a["summary"]
    assert (s["n"], s["median_wall_us"], s["mean_wall_us"], s["median_gpu_busy_us"], s["median_gpu_idle_us"]) == \
        (3, 1000.0, 1000.0, 509.0, 491.0)
    assert s["idle_share"] == pytest.approx(1473 / 3000)
    assert s["groups_us"] == STEP_GROUPS


def test_gpu_timeline_over_the_steps():
    t = ST.analyze(trace(), batch=8, layers=2)["timeline"]
    assert (t["window_us"], t["busy_us"], t["idle_us"]) == (3000.0, 1527.0, 1473.0)
    assert t["idle_fraction"] == pytest.approx(0.491)
    # per step: 36 us after the graph, 30 us after softmax, then 425 / 475 / 375 us to the next step
    assert t["gaps"] == {"threshold_us": 50.0, "all_count": 9, "all_us": 1473.0, "count": 3, "total_us": 1275.0,
                         "median_us": 425.0, "longest_us": 475.0}


def test_gpu_timeline_unions_streams_and_clips_to_the_window():
    ev = [{"ts": 0.0, "end": 10.0}, {"ts": 5.0, "end": 20.0}, {"ts": 30.0, "end": 40.0}]
    t = ST.gpu_timeline(ev, gap_us=5.0)
    assert (t["window_us"], t["busy_us"], t["idle_us"], t["idle_fraction"]) == (40.0, 30.0, 10.0, 0.25)
    assert (t["gaps"]["count"], t["gaps"]["longest_us"]) == (1, 10.0)
    t = ST.gpu_timeline(ev, window=(-10.0, 35.0), gap_us=5.0)
    assert (t["busy_us"], t["idle_us"], t["gaps"]["all_count"], t["gaps"]["total_us"]) == (25.0, 20.0, 2, 20.0)
    assert ST.gpu_timeline([], gap_us=5.0)["idle_fraction"] is None


def test_top_kernels_in_the_window():
    top = ST.analyze(trace(), batch=8, layers=2)["top_kernels"]
    assert [(k["name"], k["calls"], k["total_us"]) for k in top[:4]] == \
        [(DEEP_GEMM, 6, 480.0), (NVJET, 3, 450.0), (FA3, 6, 360.0), (QUANT, 6, 60.0)]
    assert [k["group"] for k in top[:4]] == ["GEMMs", "GEMMs", "attention", "activation quantization"]
    assert top[0]["share"] == pytest.approx(480 / 1527)
    by_name = {k["name"]: k for k in top}
    assert len(top) == 10 and by_name[FILL]["total_us"] == 12.0  # the launch before the first marker is outside
    assert (by_name[EXPONENTIAL]["group"], by_name[MEMCPY]["group"]) == ("logits/sampling", "memcpy/memset")
    assert len(ST.analyze(trace(), batch=8, layers=2, top=3)["top_kernels"]) == 3


def test_top_host_ops_by_self_time():
    top = ST.analyze(trace(), batch=8, layers=2)["top_host_ops"]
    assert [(h["name"], h["cat"], h["calls"], h["self_us"], h["total_us"]) for h in top] == [
        ("step[DECODE bs=8]", "user_annotation", 3, 735.0, 900.0),  # 300 - 20 - 10 - 20 - 5 per step
        ("cudaGraphLaunch", "cuda_runtime", 3, 60.0, 60.0),
        ("cudaLaunchKernel", "cuda_runtime", 9, 45.0, 45.0),
        ("aten::multinomial", "cpu_op", 3, 30.0, 60.0),
        ("aten::softmax", "cpu_op", 3, 15.0, 30.0),
        ("cudaMemcpyAsync", "cuda_runtime", 3, 15.0, 15.0)]


@pytest.mark.parametrize("name, group", [
    (DEEP_GEMM, "GEMMs"), (NVJET, "GEMMs"), (QUANT, "activation quantization"), (FA3, "attention"),
    (NORM, "norms/rotary"), ("void (anonymous namespace)::act_and_mul_kernel<__nv_bfloat16>", "norms/rotary"),
    (SOFTMAX, "logits/sampling"), (ARGMAX, "logits/sampling"), (EXPONENTIAL, "logits/sampling"),
    ("at::native::sampleMultinomialOnce<float, 4>", "logits/sampling"),
    ("void cub::DeviceRadixSortOnesweepKernel<float>", "logits/sampling"), (FILL, "other")])
def test_kernel_group(name, group):
    assert ST.kernel_group(name) == group


def test_kernel_group_of_copies_and_lm_head_rule():
    assert ST.kernel_group("Memset (Device)", "gpu_memset") == "memcpy/memset"
    ev = [{"name": NVJET, "cat": "kernel", "dur": d} for d in (100.0, 100.0, 100.0, 100.0, 300.0)]
    assert ST.step_groups(ev, layers=4)["logits/sampling"] == 300.0  # 4 layers x 1 + 1 launches: the longest
    assert ST.step_groups(ev[:4], layers=4)["GEMMs"] == 400.0  # 4 x 1 + 0: no lm_head


# ----------------------------------------------------------------------------------------------------------------
# the step-boundary finder and its fallbacks
# ----------------------------------------------------------------------------------------------------------------

def test_run_batch_annotation_when_there_is_no_step_annotation():
    tr = trace()
    for ev in tr["traceEvents"]:
        if ev.get("cat") == "user_annotation":
            ev["name"] = "scheduler.run_batch"
    a = ST.analyze(tr, batch=8, layers=2)
    assert (a["marker"], a["steps_found"], a["summary"]["n"]) == ("scheduler.run_batch", 3, 3)
    assert a["summary"]["groups_us"] == STEP_GROUPS


def test_graph_launches_without_host_annotations():
    a = ST.analyze(trace(host=False), batch=8, layers=2)
    assert (a["marker"], a["markers"], a["steps_found"]) == ("cudaGraphLaunch", 4, 3)
    assert [s["wall_us"] for s in a["steps"]] == [1000.0, 1050.0, 950.0]
    assert [s["gpu_busy_us"] for s in a["steps"]] == [509.0] * 3
    assert a["summary"]["groups_us"] == STEP_GROUPS
    assert [h["name"] for h in a["top_host_ops"]][:2] == ["cudaGraphLaunch", "cudaLaunchKernel"]


def test_gpu_busy_clusters_as_the_last_fallback():
    a = ST.analyze(trace(host=False, runtime=False, before=False), batch=8, layers=2, cluster_gap_us=100.0)
    assert (a["marker"], a["markers"], a["steps_found"]) == ("GPU busy clusters", 4, 3)
    assert [s["wall_us"] for s in a["steps"]] == [1000.0, 1050.0, 950.0]  # GPU periods: the markers are GPU times
    assert [s["gpu_idle_us"] for s in a["steps"]] == [491.0, 541.0, 441.0]
    assert a["summary"]["groups_us"] == STEP_GROUPS
    assert a["top_host_ops"] == []
    # gaps of 30 and 36 us inside a step split it at 30 us; no gap reaches 500 us: one cluster, no step
    assert ST.analyze(trace(host=False, runtime=False, before=False), cluster_gap_us=30.0)["markers"] == 12
    none = ST.analyze(trace(host=False, runtime=False, before=False), cluster_gap_us=500.0)
    assert (none["markers"], none["steps_found"], none["summary"]["n"], none["timeline"]["busy_us"]) == (1, 0, 0, 0.0)


def test_step_annotations_take_precedence_and_one_is_not_enough():
    ev = ST.complete_events(trace())
    assert ST.find_markers(ev)[0] == "step annotation"
    one = [e for e in ev if not (e["cat"] == "user_annotation" and e["ts"] > 0)]
    kind, markers = ST.find_markers(one)
    assert (kind, len(markers)) == ("cudaGraphLaunch", 4)  # a single step annotation: the graph launches
    assert ST.find_markers([]) == (None, [])


def test_select_steps_keeps_decode_steps_at_the_batch():
    recs = [{"label": x} for x in ("step[EXTEND bs=8 toks=32768]", "step[DECODE bs=7]", "step[DECODE bs=8]",
                                   "step[DECODE bs=8]")]
    assert ST.select_steps(recs, "step annotation", 8) == recs[2:]
    assert ST.select_steps(recs, "step annotation", 16) == recs[1:]
    assert ST.select_steps(recs, "step annotation") == recs[1:]
    assert ST.select_steps(recs, "cudaGraphLaunch", 8) == recs


def test_launch_time_decides_the_step_not_the_gpu_start():
    """A kernel of step 0 that the GPU runs after step 1's marker still belongs to step 0 (overlap scheduler)."""
    tr = trace()
    late = [_x(SOFTMAX, "kernel", 1300.0, 40.0, (0, 8), 77), _x("cudaLaunchKernel", "cuda_runtime", 290.0, 5, HOST, 77)]
    tr["traceEvents"] += late
    a = ST.analyze(tr, batch=8, layers=2)
    assert [s["gpu_events"] for s in a["steps"]] == [15, 14, 14]
    assert a["steps"][0]["groups_us"]["logits/sampling"] == 230.0


# ----------------------------------------------------------------------------------------------------------------
# the script: log windows, report, /start_profile body, command line
# ----------------------------------------------------------------------------------------------------------------

def test_log_windows_and_step_times():
    m = script()
    before, during = m.log_windows(LOG)
    assert m.log_steps(before, 8) == {"decode_lines": 3, "running": [5, 8], "full_batch_steps": 2,
                                      "median_step_ms": 9.0, "mean_step_ms": 9.0}
    assert m.log_steps(during, 8) == {"decode_lines": 2, "running": [8], "full_batch_steps": 2,
                                      "median_step_ms": 11.25, "mean_step_ms": 11.25}
    assert m.log_steps(during, 16)["median_step_ms"] is None


def test_wait_for_full_batch_and_trace(tmp_path):
    m = script()
    log = tmp_path / "server.log"
    log.write_text("startup\n" + LOG)
    assert m.wait_for_full_batch(str(log), len("startup\n"), 8, 2, timeout_s=5) == 5  # every line after offset
    assert m.wait_for_full_batch(str(log), len("startup\n"), 8, 99, timeout_s=0.3) == 5
    prof = tmp_path / "traces"
    prof.mkdir()
    assert m.wait_for_trace(str(prof), str(log), 0, timeout_s=0.6) is None
    (prof / "bf16-TP-0.trace.json.gz").write_bytes(b"x")
    assert m.wait_for_trace(str(prof), str(log), 0, timeout_s=5) == str(prof / "bf16-TP-0.trace.json.gz")


def _records() -> dict:
    rec = {"flags": ["--quantization", "fp8_online_blockwise"], "status": "ok", "start_s": 61.0,
           "trace": "traces/fp8_kv/fp8_kv-TP-0.trace.json.gz", "analysis": ST.analyze(trace(), batch=8, layers=2),
           "log": {"unprofiled": {"median_step_ms": 9.0}, "profiled": {"median_step_ms": 11.25}}}
    return {"fp8_kv": rec, "bf16": {"flags": [], "status": "server did not start: boom"}}


def test_report_has_the_numbers(tmp_path):
    m = script()
    meta = {"model": "qwen3-8b-shaped dummy weights (2 layers)", "workload": "8 requests", "device": "NVIDIA H200"}
    text = m.write_outputs(str(tmp_path), _records(), meta)
    assert (tmp_path / "profile_server_step.md").read_text() == text + "\n"
    assert "| fp8_kv | 3 | 1.00 | 1.00 | 0.51 | 0.49 | 49.1 % | 9.00 / 11.25 | 0.160 | 0.020 | 0.120 | 0.010 | " \
           "0.190 | 0.004 | 0.005 |" in text
    assert "| bf16 | server did not start: boom |" in text
    assert ("GPU timeline over the steps: 3.00 ms, busy 1.53 ms, idle 1.47 ms (49.1 %); gaps > 50 us: 3 (1.0 per "
            "step), 1.27 ms in all (0.425 ms per step), median 0.425 ms, longest 0.475 ms") in text
    assert "| logits/sampling | 0.190 | 37.3 % |" in text
    assert f"| 1 | `{DEEP_GEMM}` | GEMMs | 6 | 0.480 | 31.4 % |" in text
    assert "| `step[DECODE bs=8]` | user_annotation | 3 | 0.735 | 0.900 |" in text
    data = json.loads((tmp_path / "profile_server_step.json").read_text())
    assert data["configs"]["fp8_kv"]["analysis"]["summary"]["median_gpu_busy_us"] == 509.0
    assert data["meta"]["device"] == "NVIDIA H200"


def _profile_req_fields() -> set[str]:
    spec = importlib.util.find_spec("sglang")  # the installed SGLang's files; nothing of it is imported
    path = os.path.join(list(spec.submodule_search_locations)[0], "srt", "managers", "io_struct.py")
    tree = ast.parse(pathlib.Path(path).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ProfileReq")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def test_start_profile_body_uses_sglangs_profile_request_fields():
    m = script()
    args = m.parse_args(["--steps", "12", "--activities", "GPU"])
    body = m.profile_body("/tmp/p", args, "bf16")
    assert body == {"output_dir": "/tmp/p", "num_steps": 12, "activities": ["GPU"], "with_stack": False,
                    "record_shapes": False, "profile_id": "bf16"}
    assert set(body) <= _profile_req_fields()


def test_arguments_and_server_flags_come_from_bench_rl_rollout():
    import bench_rl_rollout as RL

    m = script()
    a = m.parse_args([])
    assert (a.configs, a.batch, a.prompt_len, a.new_tokens, a.steps, a.warmup_s, a.deadline_s) == \
        (["bf16", "fp8_kv"], 8, 4096, 2048, 30, 60.0, 400.0)
    assert m.RL.CONFIGS is RL.CONFIGS
    with pytest.raises(SystemExit):
        m.parse_args(["--configs", "nope"])
    with pytest.raises(SystemExit):
        m.parse_args(["--batch", "0"])


def test_ragged_prompts_set_the_batch():
    """--prompt-lens: one prompt per length (a rollout's tail: one long context among short ones), --batch follows."""
    m = script()
    a = m.parse_args(["--prompt-lens", "300", "20", "7", "--new-tokens", "5"])
    assert a.batch == 3 and m.prompt_lengths(a) == [300, 20, 7]
    work = m.batch_workload(a)
    assert [len(p) for p in work["input_ids"]] == [300, 20, 7] and work["max_new_tokens"] == [5, 5, 5]
    assert m.prompt_desc(a) == "3 requests of 300, 20, 7"
    even = m.parse_args(["--batch", "2", "--prompt-len", "9"])
    assert [len(p) for p in m.batch_workload(even)["input_ids"]] == [9, 9] and m.prompt_desc(even) == "2 requests x 9"
    with pytest.raises(SystemExit):
        m.parse_args(["--prompt-lens", "5", "0"])


def test_command_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--configs", "--gpu", "--out", "--batch", "--prompt-len", "--new-tokens", "--steps", "--warmup-s",
                 "--deadline-s", "--activities", "--gap-us"):
        assert flag in proc.stdout


# ----------------------------------------------------------------------------------------------------------------
# one config end to end against a stand-in server (stdlib HTTP, no SGLang): health, the batch, /start_profile, trace
# ----------------------------------------------------------------------------------------------------------------

FAKE_SERVER = r'''
import json, os, shutil, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, trace_path, body_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
lock, running = threading.Lock(), [0]


def log(msg):
    with lock:
        print(msg, flush=True)


def decode_lines():
    while True:
        time.sleep(0.02)
        if running[0]:
            log(f"Decode batch, #running-req: {running[0]}, #token: 100, token usage: 0.01, cuda graph: True, "
                "gen throughput (token/s): 1000.00, #queue-req: 0")


def finish(body):
    time.sleep(0.3)
    log("Stop profiling...")
    shutil.copy(trace_path, os.path.join(body["output_dir"], body["profile_id"] + "-TP-0.trace.json.gz"))
    log("Profiling done. Traces are saved to: " + body["output_dir"])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, text):
        self.send_response(200)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def do_GET(self):
        self.answer(b"ok")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/generate":
            with lock:
                running[0] += 1
            time.sleep(3600)  # decodes until the server is stopped
        elif self.path == "/start_profile":
            json.dump(body, open(body_path, "w"))
            log("Profiling starts. Traces will be saved to: " + body["output_dir"])
            threading.Thread(target=finish, args=(body,), daemon=True).start()
            self.answer(b"Start profiling.\n")


threading.Thread(target=decode_lines, daemon=True).start()
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _item(port: int, cmd: list[str]) -> dict:
    return {"name": "bf16", "flags": [], "port": port, "cmd": cmd, "env": {"PYTHONUNBUFFERED": "1"},
            "fa3_fallback": False}


def test_one_config_against_a_stand_in_server(tmp_path):
    from conftest import free_port

    m = script()
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    with gzip.open(tmp_path / "trace.json.gz", "wt") as f:
        json.dump(trace(), f)
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    args = m.parse_args(["--min-full-steps", "3", "--warmup-s", "20", "--steps", "5", "--layers", "2"])
    cmd = [sys.executable, str(tmp_path / "fake.py"), str(port), str(tmp_path / "trace.json.gz"),
           str(tmp_path / "body.json")]
    t0 = time.time()
    rec = m.run_config(_item(port, cmd), args, str(out), deadline_at=time.time() + 90)
    assert rec["status"] == "ok", rec
    assert time.time() - t0 < 60
    assert rec["start_profile"] == "HTTP 200: Start profiling."
    assert json.loads((tmp_path / "body.json").read_text()) == m.profile_body(str(out / "traces" / "bf16"), args,
                                                                               "bf16")
    assert rec["trace"] == "traces/bf16/bf16-TP-0.trace.json.gz"
    assert rec["warmup_full_batch_steps"] >= 3 and rec["log"]["unprofiled"]["median_step_ms"] == 8.0
    assert rec["log"]["profiled"]["full_batch_steps"] == len(rec["log_lines"]) > 0
    assert rec["analysis"]["summary"]["groups_us"] == STEP_GROUPS
    assert rec["requests"] == {"sent": 8, "finished": 0}  # ended by the stop
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # the server is gone


def test_a_server_that_exits_is_recorded_with_its_log(tmp_path):
    m = script()
    args = m.parse_args([])
    cmd = [sys.executable, "-c", "import sys; print('boom: no GPU', flush=True); sys.exit(3)"]
    rec = m.run_config(_item(1, cmd), args, str(tmp_path), deadline_at=time.time() + 60)
    assert rec["status"].startswith("RuntimeError: server on 1 exited with 3")
    assert rec["log_tail"] == ["boom: no GPU"] and rec["requests"] == {"sent": 0, "finished": 0}


def test_suite_stage_runs_the_script_with_a_deadline_and_its_args(tmp_path):
    (line,) = stage_command_lines(tmp_path, "server_step", "profile_server_step.py",
                                  SERVER_STEP_ARGS="--configs fp8 --gpu 0")
    a = script().parse_args(line.split("profile_server_step.py", 1)[1].split())
    assert a.out == f"{tmp_path}/work/server_step" and a.model_dir == f"{tmp_path}/work/models"
    assert 400 < a.deadline_s < 560 and a.configs == ["fp8"] and a.gpu == 0


def test_report_from_the_recorded_h100_run():
    """The report rebuilt from docs/results (RESULTS 24a): the numbers RESULTS quotes, from the recorded analysis."""
    rec = json.loads((REPO / "docs/results/profile_server_step_h100_2026-11-28.json").read_text())
    text = ST.format_report(rec["configs"], rec["meta"])
    assert text.rstrip() == (REPO / "docs/results/profile_server_step_h100_2026-11-28.md").read_text().rstrip()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| bf16 |")
            or line.startswith("| fp8_kv |")}
    assert "| 8.66 |" in rows["bf16"] and "| 3.7 % |" in rows["bf16"]
    assert "| 6.22 |" in rows["fp8_kv"] and "| 3.6 % |" in rows["fp8_kv"]
    fp8 = rec["configs"]["fp8_kv"]["analysis"]["top_kernels"][0]
    assert fp8["name"] == "_decode_attn_split_kernel" and round(fp8["total_us"] / fp8["calls"], 1) == 44.9
