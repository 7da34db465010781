"""decode_roofline.py's child: SGLang's bench_one_batch (bench_rollout_child.py's, with the plugin's loading and
dummy-init hooks) with the roofline's hooks on its module. The prefill is skipped (random next tokens, the KV slots
allocated as a real prefill allocates them) except in the check cells' repeats; every decode step is timed, the last
ones also as back-to-back forward + sample calls; once per process the copy bandwidth is measured and the KV pool
filled with random values; a cell the deadline or the KV pool leaves no room for is skipped with the reason; each cell
is appended to the records file as a JSON line. Settings in $FP8RL_ROOFLINE (JSON, from the driver's child_settings);
the driver runs it as `decode_roofline.py _child <bench_one_batch flags>` (decode_roofline.py's docstring tells how a
step is measured).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
import types

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import bench_rollout_child as CHILD  # scripts/bench_rollout_child.py: bench_one_batch with the plugin's hooks
import roofline_report as RP  # scripts/roofline_report.py: cell keys, a cell's step times

ENV = "FP8RL_ROOFLINE"  # the child's settings (JSON)


# ----------------------------------------------------------------------------------------------------------------
# the child: bench_one_batch with the hooks above
# ----------------------------------------------------------------------------------------------------------------

def _clog(*a) -> None:
    print("[roofline]", *a, flush=True)


@contextlib.contextmanager
def patched(obj, **attrs):
    """Set instance attributes for the duration (e.g. a ModelRunner's ``forward``), then restore what was there."""
    saved = {k: obj.__dict__[k] for k in attrs if k in obj.__dict__}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k in attrs:
            if k in saved:
                setattr(obj, k, saved[k])
            else:
                obj.__dict__.pop(k, None)


def _sync(runner) -> None:
    import torch

    torch.get_device_module(runner.device).synchronize()


def skipped_prefill(runner):
    """The runner with its forward and sampling replaced for one extend: no model work, random next tokens."""
    import torch

    vocab = runner.model_config.vocab_size

    def forward(forward_batch, *a, **k):
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(next_token_logits=None))

    def sample(logits_output, forward_batch, *a, **k):
        return torch.randint(0, vocab, (forward_batch.batch_size,), device=runner.device)

    return patched(runner, forward=forward, sample=sample)


def time_calls(fn, calls: int, device: str) -> float:
    """Seconds per call of ``calls`` back-to-back calls (CUDA events on a GPU)."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def back_to_back(runner, calls: int, sink: list):
    """The runner with a forward that, after the step's own call, times ``calls`` more forward + sample calls of the
    same batch into ``sink``."""
    real = runner.forward

    def forward(forward_batch, *a, **k):
        out = real(forward_batch, *a, **k)

        def one():
            runner.sample(real(forward_batch, *a, **k).logits_output, forward_batch)

        try:
            sink.append(time_calls(one, calls, runner.device))
        except (RuntimeError, AttributeError, TypeError) as e:  # a timing must never break the bench
            _clog(f"back-to-back timing failed: {e!r}")
        return out

    return patched(runner, forward=forward)


def _copy_samples(nbytes: int, iters: int, repeats: int) -> list[float]:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    return [2 * nbytes / time_calls(lambda: dst.copy_(src), iters, "cuda") / 1e9 for _ in range(repeats + 1)][1:]


def copy_bandwidth(nbytes: int, iters: int = 10, repeats: int = 5) -> dict:
    """Device-to-device copy bandwidth (GB/s, read + write counted), best of ``repeats`` after one warm-up."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    free, _ = torch.cuda.mem_get_info()
    nbytes = int(min(nbytes, (free - (512 << 20)) // 2))
    if nbytes < (128 << 20):
        return {"skipped": f"only {free / 2**30:.2f} GiB free"}
    samples = _copy_samples(nbytes, iters, repeats)
    torch.cuda.empty_cache()  # the two buffers go back before SGLang's next allocation
    return {"gbps": max(samples), "samples_gbps": samples, "bytes": nbytes, "iters": iters}


def fill_kv_pool(runner) -> dict:
    """Random values in every K/V buffer's slots (BF16 N(0, 1); one-byte FP8 codes 0..0x77, i.e. 0..240)."""
    import torch

    pool = runner.token_to_kv_pool
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return {"skipped": f"KV layout {pool.kv_cache_layout}"}
    slots = int(pool.size) + int(pool.page_size)  # the backed slots (a post-capture pool reserves more)
    filled = 0
    for name in ("k_buffer", "v_buffer"):
        bufs = getattr(pool, name, None)
        for buf in (bufs if isinstance(bufs, (list, tuple)) else [bufs] if bufs is not None else []):
            region = buf[:slots]
            if region.element_size() == 1:
                region.view(torch.uint8).random_(0, 0x78)
            elif region.is_floating_point():
                region.normal_()
            else:
                continue
            filled += region.numel() * region.element_size()
    _sync(runner)
    return {"bytes": filled, "slots": slots}


def kv_slots(batch, runner, input_len: int) -> dict:
    """The KV slots the batch's requests hold for their first ``input_len`` tokens: how many distinct, lowest,
    highest."""
    import torch

    table = runner.req_to_token_pool.req_to_token
    slots = table[batch.req_pool_indices.to(table.device).long(), :input_len]
    return {"kv_slots": int(torch.unique(slots).numel()), "kv_slot_range": [int(slots.min()), int(slots.max())]}


class Recorder:
    """What the child's hooks measure, cell by cell, appended to the records file as JSON lines."""

    def __init__(self, cfg: dict):
        self.path = cfg.get("records")
        self.profile_cells = {tuple(c) for c in cfg.get("profile_cells", [])}
        self.check_cells = {tuple(c) for c in cfg.get("check_cells", [])}
        self.prefill = cfg.get("prefill", "skip")
        self.stop_at = cfg.get("stop_at")
        self.fill_kv = cfg.get("fill_kv", True)
        self.bandwidth_bytes = int(cfg.get("bandwidth_bytes", 1 << 30))
        self.b2b_calls, self.b2b_timings = int(cfg.get("b2b_calls", 8)), int(cfg.get("b2b_timings", 3))
        self.seen: dict[tuple[int, int], int] = {}
        self.started = self.once_done = False
        self.cell = None

    def write(self, rec: dict) -> None:
        """Append one record (flushed at once: a killed process keeps what it measured)."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def once(self, runner) -> None:
        """At the first prefill: the copy bandwidth, then random values in the KV pool."""
        if self.once_done:
            return
        self.once_done = True
        for kind, fn in (("bandwidth", lambda: copy_bandwidth(self.bandwidth_bytes)),
                         ("kv_fill", lambda: fill_kv_pool(runner) if self.fill_kv else {"skipped": "off"})):
            try:
                rec = {"kind": kind, **fn()}
            except (RuntimeError, AttributeError, TypeError, ValueError) as e:
                rec = {"kind": kind, "error": repr(e)}
            _clog(kind, json.dumps(rec)[:300])
            self.write(rec)

    def why_skip(self, runner, bs: int, il: int, ol: int, occurrence: int, warmup: bool) -> str | None:
        """Why a cell must not run (a repeat that is no check cell, the deadline, the KV pool), or None."""
        if occurrence > 1 and (bs, il) not in self.check_cells:
            return f"a repeat of batch {bs} (for the check cells)"
        if not warmup and self.stop_at and time.time() > self.stop_at:
            return "deadline: this config's time ran out before the cell started"
        pool = getattr(getattr(runner, "torch_runner", runner), "max_total_num_tokens", None)
        if pool is not None and bs * (il + ol) > pool:
            return f"KV pool: {bs} x ({il} + {ol}) = {bs * (il + ol):,} tokens > the pool's {pool:,}"
        return None

    def start(self, args: dict) -> dict:
        """The record of the cell bench_one_batch is about to run (with ``skipped`` set if it must not run)."""
        bs, il, ol = int(args["batch_size"]), int(args["input_len"]), int(args["output_len"])
        warmup, self.started = not self.started, True
        occurrence = 0 if warmup else self.seen.get((bs, il), 0) + 1
        if not warmup:
            self.seen[(bs, il)] = occurrence
        cell = {"kind": "cell", "bs": bs, "input_len": il, "output_len": ol, "warmup": warmup,
                "occurrence": occurrence}
        why = self.why_skip(args.get("model_runner"), bs, il, ol, occurrence, warmup)
        if why:
            return {**cell, "skipped": why}
        real = self.prefill == "real" or occurrence > 1
        profiled = bool(args.get("profile")) and not warmup and occurrence == 1 and (bs, il) in self.profile_cells
        excluded = set()
        if profiled:
            start = args.get("profile_start_step")
            start = ol // 2 if start is None else int(start)
            excluded |= set(range(start, start + int(args.get("profile_steps") or 1)))
        b2b = [] if warmup else [i for i in range(ol - 2, -1, -1) if i not in excluded][:self.b2b_timings]
        self.cell = {**cell, "prefill": "real" if real else "skip", "profiled": profiled, "b2b_at": sorted(b2b),
                     "excluded_steps": sorted(excluded | set(b2b)), "steps_s": [], "b2b_s": []}
        return self.cell

    def finish(self, ret: dict | None) -> None:
        """Record the cell bench_one_batch just ran (``ret``: its result row, None if it skipped the cell)."""
        cell, self.cell = self.cell, None
        cell["bench_median_s"] = (ret or {}).get("median_decode_latency")
        if ret is None:
            cell["skipped"] = "bench_one_batch did not run it (see its log)"
        times = RP.step_seconds(cell)
        _clog(f"cell {RP.cell_key(cell['bs'], cell['input_len'])} ({cell['prefill']} prefill): step "
              f"{times['step'] and 1e3 * times['step']} ms, bench step {times['bench'] and 1e3 * times['bench']} ms, "
              f"{cell.get('kv_slots')} distinct KV slots")
        self.write(cell)


def install_hooks(ob, rec: Recorder) -> None:
    """Wrap bench_one_batch's latency_test_run_once, extend and decode (module globals its runner calls)."""
    run_once, extend, decode = ob.latency_test_run_once, ob.extend, ob.decode
    sig = inspect.signature(run_once)

    def run_cell(*a, **k):
        bound = sig.bind(*a, **k)
        cell = rec.start(bound.arguments)
        if cell.get("skipped"):
            _clog(f"skip {RP.cell_key(cell['bs'], cell['input_len'])}: {cell['skipped']}")
            rec.write(cell)
            return None
        if "profile" in bound.arguments:
            bound.arguments["profile"] = cell["profiled"]
        try:
            ret = run_once(*bound.args, **bound.kwargs)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if cell["occurrence"] < 2:
                raise
            # a check cell's real prefill of B x C tokens may not fit beside the pool: the grid is already recorded
            rec.cell = None
            rec.write({**cell, "skipped": f"the real prefill failed: {e!r}"[:300]})
            _clog(f"check cell {RP.cell_key(cell['bs'], cell['input_len'])}: real prefill failed: {e!r}"[:300])
            return None
        rec.finish(ret)
        return ret

    def extend_hook(reqs, model_runner):
        rec.once(model_runner)
        cell = rec.cell or {}
        skip = cell.get("prefill", rec.prefill) == "skip"
        with skipped_prefill(model_runner) if skip else contextlib.nullcontext():
            out = extend(reqs, model_runner)
        if cell:
            cell.update(kv_slots(out[2], model_runner, cell["input_len"]))
        return out

    def decode_hook(input_token_ids, batch, model_runner):
        cell = rec.cell
        i = len(cell["steps_s"]) if cell else -1
        timed = cell is not None and i in cell["b2b_at"]
        _sync(model_runner)
        t0 = time.perf_counter()
        with back_to_back(model_runner, rec.b2b_calls, cell["b2b_s"]) if timed else contextlib.nullcontext():
            out = decode(input_token_ids, batch, model_runner)
        _sync(model_runner)
        if cell is not None:
            cell["steps_s"].append(time.perf_counter() - t0)
            if i == 0:
                cell["seq_lens"] = [int(batch.seq_lens.min()), int(batch.seq_lens.max())]
        return out

    ob.latency_test_run_once, ob.extend, ob.decode = run_cell, extend_hook, decode_hook


def _cpu_setup() -> None:
    """SGLang on a machine without CUDA (the CPU test): the torchvision stand-in, RoPE's native path."""
    from sglang_fp8rl.cpu_runner import install_cpu_stubs

    install_cpu_stubs()
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True  # else RotaryEmbedding imports vllm's op on a platform SGLang does not know


def child_main(argv: list[str]) -> None:
    """bench_one_batch (bench_rollout.py's child) with this script's hooks; settings in $FP8RL_ROOFLINE."""
    rec = Recorder(json.loads(os.environ.get(ENV) or "{}"))
    if "--device" in argv and argv[argv.index("--device") + 1] == "cpu":
        _cpu_setup()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before the module import below, as bench_rollout's child does (idempotent)
    from sglang_fp8rl.compat.runtime import one_batch

    install_hooks(one_batch(), rec)
    CHILD.child_main(argv)
