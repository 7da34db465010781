"""One run of scripts/bench_update.py on a GPU machine (class Bench): the payload generated and saved, the engines
one after the other with each one's share of the deadline, every planned update path timed with its memory peak and
telemetry, the results rewritten after every step and the summary written at the end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
from typing import Any, Callable, Optional

import update_bench_profile
import update_scaleout
from update_bench_report import (
    GB,
    apply_bandwidth,
    apply_bytes,
    payload_stats,
    ratios,
    render,
    sum_bucket_stats,
    targets,
)
from update_bench_server import (
    MemPoller,
    fp8rl_info,
    generate_ids,
    launch,
    measure_d2d_copy,
    push_one_bucket,
    save_payload,
    say,
    stop,
    telemetry_of,
    validate_only_push,
)

TIME_SHARE = {"bf16": 2, "fp8": 3}  # of the deadline, per engine (unused time passes on to the next engine)


class Bench:
    """One run: the engines one after the other, every path of each, the results saved after every step."""

    def __init__(self, args: argparse.Namespace, argv: Optional[list[str]], plan: update_scaleout.Plan):
        self.args = args
        self.argv = list(argv or [])
        self.t0 = time.time()
        self.res: dict[str, Any] = {"engines": {}, "notes": [], "targets": []}
        self.plan = plan  # on this machine's GPUs
        self.url = ""  # the engine running now

    def left(self) -> float:
        """Seconds left of the deadline."""
        return self.args.deadline_s - (time.time() - self.t0)

    def save(self) -> None:
        """Targets and ratios recomputed, OUT/update_results.json rewritten."""
        self.res["elapsed_s"] = time.time() - self.t0
        if "payload" in self.res:
            self.res["targets"] = targets(self.res) + update_scaleout.scale_targets(self.res)
            self.res["ratios"] = ratios(self.res)
        with open(os.path.join(self.args.out, "update_results.json"), "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    def timed(self, fn: Callable[[], Any], poller_period: float) -> tuple[float, int, Any]:
        """(wall s, peak extra bytes over the pre-push level, answer) of one update."""
        import torch

        torch.cuda.synchronize()
        base = MemPoller.baseline()
        with MemPoller(poller_period) as poll:
            t = time.perf_counter()
            answer = fn()
            wall = time.perf_counter() - t
        return wall, max(0, poll.peak - base), answer

    def run_path(self, eng: str, path: str, push: Callable[[], Any], phase_end: float) -> dict:
        """Warm-up + repeats of one path, within this engine's share of the deadline."""
        a = self.args
        if path not in self.plan.paths:
            return {"status": f"skipped ({self.plan.skipped.get(path, 'not planned')})"}
        rec: dict[str, Any] = {"status": "ok", "timed_s": [], "peak_extra_timed_bytes": None}
        kv_before = update_scaleout.kv_writes(fp8rl_info(self.url)) if a.kv_cache_dtype else None
        period = a.poll_ms / 1e3
        reps = a.disk_repeats if path == "disk" else a.repeats
        warm = a.disk_warmup if path == "disk" else a.warmup
        # first guess without a measurement: 2 GB/s by tensor, 1 GB/s from disk
        est = self.res.setdefault("est_s", {}).get(path) or \
            self.res["payload"]["bytes"] / GB / (1.0 if path == "disk" else 2.0)
        for i in range(warm + reps):
            if time.time() + est * 1.2 + 5 > phase_end:
                rec["status"] = f"deadline: stopped after {i} of {warm + reps} pushes"
                say(f"{eng}/{path}: {rec['status']}")
                break
            wall, extra, _ = self.timed(push, period)
            est = wall
            label = "warm-up" if i < warm else f"timed {i - warm + 1}/{reps}"
            say(f"{eng}/{path} {label}: {wall:.2f} s, peak extra {extra / GB:.3f} GB")
            if i == 0:
                rec["peak_extra_first_bytes"] = extra
            if i < warm:
                rec["warmup_s"] = wall
            else:
                rec["timed_s"].append(wall)
                rec["peak_extra_timed_bytes"] = max(rec["peak_extra_timed_bytes"] or 0, extra)
        if rec["timed_s"]:
            rec["mean_s"] = statistics.mean(rec["timed_s"])
            rec["payload_GBps"] = self.res["payload"]["bytes"] / GB / rec["mean_s"]
            self.res["est_s"].setdefault(path, rec["timed_s"][0])
        if kv_before is not None:
            rec["kv_recalibration"] = update_scaleout.kv_since(kv_before, fp8rl_info(self.url))
        self.save()
        return rec

    def telemetry_push(self, url: str, weights: dict, flatten: bool = False) -> Optional[dict]:
        """One extra push bucket by bucket (atomic=False; flattened buckets with ``flatten``), reading last_update
        after each (FP8 engine only)."""
        from sglang_fp8rl.weight_sync.buckets import buckets

        per = []
        for bucket in buckets(weights, self.args.bucket_mb << 20):
            push_one_bucket(url, bucket, flatten)
            last = fp8rl_info(url).get("last_update")
            if last is None:
                return None
            per.append(last)
        return sum_bucket_stats(per)

    def add_telemetry(self, rec: dict, url: str, weights: dict, prequant: bool, phase_end: float,
                      flatten: bool = False) -> None:
        """The validate / apply split and the apply bandwidth of one path (FP8 engine), if time allows."""
        if time.time() + (rec.get("mean_s") or 30) * 2 + 5 >= phase_end:
            return
        rec["server_telemetry"] = self.telemetry_push(url, weights, flatten)
        apply_bandwidth(rec, apply_bytes(self.shapes, prequant=prequant), self.res.get("d2d_copy_GBps"))
        self.save()

    def fp8_paths(self, e: dict, url: str, sd: dict, push: Callable[..., Any], phase_end: float) -> None:
        """The FP8 engine's own paths: telemetry of by tensor, the atomic step, its validate-only phase, and the
        pre-quantized update (payload built here and freed after)."""
        import torch
        from server_payloads import prequantize

        a = self.args
        if "tensor" in self.plan.paths:
            self.add_telemetry(e["tensor"], url, sd, False, phase_end)
        if "flattened" in self.plan.paths:
            self.add_telemetry(e["flattened"], url, sd, False, phase_end, flatten=True)
        e["atomic"] = self.run_path("fp8", "atomic", lambda: push(sd, True), phase_end)
        e["validate_only"] = self.run_path("fp8", "validate_only",
                                           lambda: validate_only_push(url, sd, a.bucket_mb << 20), phase_end)
        if "prequant" not in self.plan.paths:
            return
        t = time.time()
        held = {"pq": update_scaleout.prequant_payload(sd, self.plan, prequantize)}  # codes + scales
        torch.cuda.synchronize()
        e["prequant_build_s"] = time.time() - t
        try:
            e["prequant"] = self.run_path("fp8", "prequant", lambda: push(held["pq"], False), phase_end)
            self.add_telemetry(e["prequant"], url, held["pq"], True, phase_end)
        finally:
            held.clear()
            torch.cuda.empty_cache()

    def disk_path(self, eng: str, e: dict, url: str, phase_end: float, disk_box: dict, w1_dir: str) -> None:
        """push_from_disk of the saved payload; on the FP8 engine also its last_update split."""
        from sglang_fp8rl.trainer import push_from_disk

        if self.args.skip_disk:
            e["disk"] = {"status": "skipped (--skip-disk)"}
            return
        if disk_box.get("thread") is not None:
            disk_box["thread"].join(max(1.0, phase_end - time.time() - 30))
        if not disk_box.get("ok"):
            e["disk"] = {"status": f"skipped: checkpoint not written ({disk_box.get('error', 'not ready')})"}
            return
        e["disk"] = self.run_path(eng, "disk", lambda: push_from_disk(url, w1_dir), phase_end)
        if eng == "fp8":
            e["disk"]["server_telemetry"] = telemetry_of(fp8rl_info(url).get("last_update"))

    def run_engine(self, eng: str, sd: dict, model: str, phase_end: float, disk_box: dict, w1_dir: str) -> None:
        """Start one engine's server, run its paths, stop it (its error is recorded; the other engine still runs)."""
        from sglang_fp8rl.trainer import push_state_dict

        a = self.args
        e: dict[str, Any] = {}
        self.res["engines"][eng] = e
        url = self.url = f"http://127.0.0.1:{a.port}"
        pre_used = MemPoller.used()
        proc = launch(model, a.port, os.path.join(a.out, f"server_{eng}.log"), eng, a.mem, self.plan.server_flags)
        try:
            from server_io import wait_healthy

            e["startup_s"] = wait_healthy(a.port, proc, timeout=max(60.0, phase_end - time.time()))
            say(f"{eng}: healthy after {e['startup_s']:.0f} s")
            e["server_used_bytes"] = MemPoller.used() - pre_used
            e["schemes"] = fp8rl_info(url).get("schemes")
            self.save()

            if disk_box.get("thread") is not None and disk_box["thread"].is_alive():
                # the checkpoint write (host copies, disk) must not overlap the timed pushes
                t = time.time()
                disk_box["thread"].join(max(1.0, phase_end - time.time() - 60))
                e["waited_for_disk_save_s"] = time.time() - t

            def push(weights: dict, atomic: bool, flatten: bool = False) -> list:
                return push_state_dict(url, weights, bucket_bytes=a.bucket_mb << 20, atomic=atomic, flatten=flatten)

            # atomic=False: a BF16 server does not know the validate-only format of the atomic step
            e["tensor"] = self.run_path(eng, "tensor", lambda: push(sd, False), phase_end)
            e["flattened"] = self.run_path(eng, "flattened", lambda: push(sd, False, True), phase_end)
            update_bench_profile.attach(self, eng, e, url, sd, phase_end)
            if eng == "fp8":
                self.fp8_paths(e, url, sd, push, phase_end)
            update_scaleout.broadcast_path(self, eng, e, url, sd, phase_end, fp8rl_info, sum_bucket_stats)
            try:
                e["tokens_after_update"] = generate_ids(url)
            except (OSError, RuntimeError, ValueError, KeyError) as ex:  # informative only (requests: OSError)
                e["tokens_after_update"] = f"generate failed: {ex}"
            self.disk_path(eng, e, url, phase_end, disk_box, w1_dir)
            self.save()
        except (OSError, RuntimeError, ValueError, KeyError, TimeoutError) as ex:  # this engine's numbers are lost, the
            # other engine still runs; WeightPushError is a RuntimeError, requests' errors are OSErrors
            e["error"] = f"{type(ex).__name__}: {ex}"
            say(f"{eng}: ERROR {e['error']}")
            self.save()
        finally:
            stop(proc, pre_used)

    def run(self) -> int:
        """The whole benchmark; 0 when no engine failed."""
        import torch

        a = self.args
        from make_models import ensure
        from server_payloads import W1_SEED, hf_shapes, make_weights

        a.skip_disk = "disk" not in self.plan.paths  # no checkpoint written for a path that does not run
        os.makedirs(a.out, exist_ok=True)
        model = ensure(a.model_dir, [a.model])[0]
        config = json.load(open(os.path.join(model, "config.json")))
        self.shapes = hf_shapes(config)
        self.res.update(command=" ".join(["python3 scripts/bench_update.py", *self.argv]),
                        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        model=a.model, model_path=model, bucket_mb=a.bucket_mb, repeats=a.repeats,
                        disk_repeats=a.disk_repeats, mem_fraction_static=a.mem, payload=payload_stats(self.shapes),
                        device=f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", deadline_s=a.deadline_s,
                        tp_size=a.tp_size, plan=self.plan.as_dict())
        self.res["notes"].append("peak extra = max device-wide used memory during the push minus the level right "
                                 "before it (server steady state + client payload); the server's caching "
                                 "allocator hides reuse of blocks it reserved earlier, so this is a lower bound")
        self.res["notes"].append("validate/apply: sum over the buckets of one extra push (atomic=False) read from "
                                 "last_update after each bucket; the disk path: the last_update of its last update "
                                 "(one streaming update)")
        self.res["d2d_copy_GBps"] = measure_d2d_copy() / GB
        say(f"d2d copy {self.res['d2d_copy_GBps']:.0f} GB/s (read + write)")

        t = time.time()
        sd = update_scaleout.make_payload(self.shapes, self.plan, make_weights, W1_SEED)
        torch.cuda.synchronize()
        self.res["payload_gen_s"] = time.time() - t
        say(f"payload: {self.res['payload']['bytes'] / GB:.2f} GB on GPU(s) {self.plan.payload_gpus} in "
            f"{self.res['payload_gen_s']:.1f} s")
        self.save()

        w1_dir = os.path.join(a.out, "tmp", "w1")
        disk_box: dict[str, Any] = {}
        if not a.skip_disk:
            os.makedirs(os.path.dirname(w1_dir), exist_ok=True)
            free = shutil.disk_usage(os.path.dirname(w1_dir)).free
            need = int(self.res["payload"]["bytes"] * 1.1)
            if free < need:
                a.skip_disk = True
                self.res["notes"].append(f"disk path skipped: {free / GB:.1f} GB free < {need / GB:.1f} GB needed")
            else:
                disk_box["thread"] = threading.Thread(target=save_payload, args=(sd, model, w1_dir, disk_box),
                                                      daemon=True)
                disk_box["thread"].start()

        try:
            engines = [x for x in ("bf16", "fp8") if x in a.engines]
            for idx, eng in enumerate(engines):
                # shares of the time left for the engines still to run (the FP8 engine has more paths)
                share = TIME_SHARE[eng] / sum(TIME_SHARE[x] for x in engines[idx:])
                phase_end = time.time() + self.left() * share
                self.run_engine(eng, sd, model, phase_end, disk_box, w1_dir)
                if disk_box.get("save_s") and "disk_save_s" not in self.res:
                    self.res["disk_save_s"] = disk_box["save_s"]
        finally:
            if disk_box.get("thread") is not None:
                disk_box["thread"].join(120)
            if disk_box.get("save_s"):
                self.res["disk_save_s"] = disk_box["save_s"]
            if not a.keep_tmp:
                shutil.rmtree(os.path.join(a.out, "tmp"), ignore_errors=True)
            self.save()
            md = render(self.res)
            with open(os.path.join(a.out, "summary.md"), "w") as f:
                f.write(md)
            print(md, flush=True)
        ok = all("error" not in e for e in self.res["engines"].values())
        return 0 if ok else 1
