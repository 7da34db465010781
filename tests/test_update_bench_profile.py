"""scripts/update_bench_profile.py on CPU: the per-tensor reading of a profiled push from a trace (self time, the
package's functions counted once through recursion, GPU busy time), and the whole round trip against a stand-in
server that answers /start_profile and /stop_profile as SGLang does (rank 0's trace written after the stop)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import update_bench_profile as P
from update_bench_report import render


def ev(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


PKG = "sglang_fp8rl/weight_sync/validate.py(73): check_tensors"
TRACE = {"traceEvents": [
    ev("sglang/srt/managers/scheduler.py(10): update_weights_from_tensor", "python_function", 0, 1000),
    ev(PKG, "python_function", 100, 400),
    ev(PKG, "python_function", 150, 100),  # recursion: inside the call above, counted once
    ev("aten::_foreach_norm", "cpu_op", 160, 60),
    ev(PKG, "python_function", 600, 200),
    ev("other/module.py(1): helper", "python_function", 850, 50),
    ev("multi_tensor_apply_kernel", "kernel", 170, 30, tid=9),
    ev("multi_tensor_apply_kernel", "kernel", 210, 30, tid=9),
    {"ph": "i", "name": "marker", "ts": 5},  # not a complete event: ignored
]}


def test_summarize_reads_a_trace_per_tensor():
    rec = P.summarize(TRACE, tensors=10, wall_s=0.002)
    assert rec["wall_us_per_tensor"] == pytest.approx(200.0)
    assert rec["trace_span_s"] == pytest.approx(1000e-6)
    assert rec["gpu_busy_s"] == pytest.approx(60e-6)
    pkg = {r["name"]: r for r in rec["package_functions"]}
    assert list(pkg) == [PKG] and pkg[PKG]["calls"] == 3 and pkg[PKG]["total_us"] == pytest.approx(600.0)
    handler = rec["sglang_update_functions"][0]
    assert handler["total_us"] == pytest.approx(1000.0) and "update_weights_from_tensor" in handler["name"]
    selfs = {r["name"]: r["self_us"] for r in rec["top_host"]}
    # the handler's 1000 us less its two package calls (400 + 200) and the helper (50); the outer check_tensors
    # call less its recursive call (100)
    assert selfs["sglang/srt/managers/scheduler.py(10): update_weights_from_tensor"] == pytest.approx(350.0)
    assert selfs[PKG] == pytest.approx(300.0 + 200.0 + 40.0)
    assert selfs["aten::_foreach_norm"] == pytest.approx(60.0)
    assert rec["top_kernels"][0]["calls"] == 2


def test_a_trace_without_events_is_reported_not_raised():
    assert "error" in P.summarize({"traceEvents": []}, 1, 0.1)
    lines = P.format_profile("fp8", "flattened", {"error": "no TP-0 trace"})
    assert "not analysed: no TP-0 trace" in "\n".join(lines)


class StandIn(BaseHTTPRequestHandler):
    """/start_profile and /stop_profile as SGLang's HTTP server answers them; rank 0's (and 1's) trace appear in the
    output folder after the stop."""

    started: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/start_profile":
            StandIn.started = body
        elif self.path == "/stop_profile":
            d, pid = StandIn.started["output_dir"], StandIn.started["profile_id"]
            for rank in (0, 1):
                with gzip.open(os.path.join(d, f"{pid}-TP-{rank}.trace.json.gz"), "wt") as f:
                    json.dump(TRACE, f)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_profile_push_round_trip_and_summary(monkeypatch, tmp_path):
    import torch

    import sglang_fp8rl.trainer as trainer

    sent = []
    monkeypatch.setattr(trainer, "push_state_dict", lambda url, bucket, **kw: sent.append((list(bucket), kw)))
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        # 1 MiB, then 512 KiB each: buckets of 1, 2, 2, 1 tensors at 1 MiB
        weights = {"big": torch.zeros(1 << 18), **{f"w{i}": torch.zeros(1 << 17) for i in range(5)}}
        rec = P.profile_push(url, weights, 1 << 20, True, 2, str(tmp_path / "prof"), "fp8_flattened", timeout_s=30)
    finally:
        server.shutdown()
    assert StandIn.started["with_stack"] is True and StandIn.started["activities"] == ["CPU", "GPU"]
    assert "num_steps" not in StandIn.started  # recording until /stop_profile, not a number of forward steps
    assert [[n for n, _ in items] for items, _ in sent] == [["w0", "w1"], ["w2", "w3"]]  # most tensors, in order
    assert all(kw["flatten"] is True and kw["atomic"] is False and kw["complete"] is False for _, kw in sent)
    assert rec["trace"] == "fp8_flattened-TP-0.trace.json.gz" and (rec["buckets"], rec["tensors"]) == (2, 4)
    res = {"model": "m", "device": "d", "bucket_mb": 1, "d2d_copy_GBps": None,
           "payload": {"tensors": 6, "bytes": 7 << 19, "largest_name": "big", "largest_bytes": 1 << 20},
           "engines": {"fp8": {"profile_flattened": rec}}, "targets": [], "notes": []}
    md = render(res)
    assert "### profiled push: fp8, flattened" in md and "2 buckets, 4 tensors" in md
    assert f"| `{PKG}` | 3 |" in md


def test_bench_update_takes_the_profile_options():
    import bench_update

    args = bench_update.parse_args(["--model-dir", "m", "--out", "o", "--profile-buckets", "1",
                                    "--profile-path", "tensor"])
    assert (args.profile_buckets, args.profile_path) == (1, "tensor")
    assert bench_update.parse_args(["--model-dir", "m", "--out", "o"]).profile_buckets == 0
    with pytest.raises(SystemExit):
        bench_update.parse_args(["--model-dir", "m", "--out", "o", "--profile-path", "disk"])
    assert isinstance(args, argparse.Namespace)


def test_the_buckets_of_most_tensors_are_profiled_in_payload_order():
    sizes = [1, 3, 2, 3, 1]
    chosen = P.most_tensors([list(range(n)) for n in sizes], 2)
    assert [len(b) for b in chosen] == [3, 3]
    assert P.most_tensors([[1], [1, 2]], 5) == [[1], [1, 2]]  # fewer buckets than asked: all of them
