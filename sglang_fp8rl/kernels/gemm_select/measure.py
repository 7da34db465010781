"""Measuring one candidate: a first eager call (JIT, wall time kept), a float64 check of the block-scaled product on
one output column per 16, then a CUDA-graph timing with the weights rotated out of L2.

A candidate that cannot run a point (:meth:`Candidate.can_implement`), fails the check or raises one of
:func:`~sglang_fp8rl.kernels.deepgemm.candidate_errors` is rejected for that entry, with the reason.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sglang_fp8rl.kernels import deepgemm
from sglang_fp8rl.kernels.deepgemm import DeepGemmFacts, candidate_errors
from sglang_fp8rl.kernels.dispatch import quantize_blockwise_into  # Triton on CUDA, quant.py elsewhere
from sglang_fp8rl.kernels.gemm_select.cache import Entry
from sglang_fp8rl.kernels.gemm_select.candidates import BLOCK, Candidate
from sglang_fp8rl.quant import FP8_DTYPE, blockwise_scale_shape, quantize_activation_groups

REL_TOL = 1e-2  # rel. Frobenius error vs the float64 block-scaled product; measured 1.7e-3 for DeepGEMM/Triton

Timer = Callable[[Callable[[int], Any], int, int, int], float]  # (call(j), nrot, calls, reps) -> us per call


# ---------------------------------------------------------------------------------------------------------------------
# float64 reference of the block-scaled product


def block_scaled_reference(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                           block: tuple[int, int] = BLOCK, cols: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``(xq * xs) @ (wq * ws)^T``: xq [M, K] fp8 with 1 x block[1] scales xs [M, ceil(K/b1)], wq [N, K] fp8
    with block scales ws [ceil(N/b0), ceil(K/b1)]. ``cols`` (LongTensor) restricts to those output columns."""
    k = xq.shape[1]
    x = xq.to(torch.float64) * xs.to(torch.float64).repeat_interleave(block[1], dim=1)[:, :k]
    rows = torch.arange(wq.shape[0], device=wq.device) if cols is None else cols
    # only the needed rows are expanded: a full float64 gate_up weight would be 805 MB
    w_scale = ws.to(torch.float64)[rows // block[0]].repeat_interleave(block[1], dim=1)[:, :k]
    return x @ (wq[rows].to(torch.float64) * w_scale).t()


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error in float64; inf when ``out`` has a NaN/Inf."""
    o = out.to(torch.float64)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float((o - ref).norm() / ref.norm().clamp_min(1e-300))


def check_columns(n: int, stride: int = 16, generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """One random column per ``stride`` columns, plus the last one: every output tile (>= 16 wide) is checked."""
    base = torch.arange(0, n, stride, device=device)
    off = torch.randint(0, stride, base.shape, generator=generator, device=device)
    cols = torch.minimum(base + off, torch.full_like(base, n - 1))
    return torch.unique(torch.cat([cols, torch.tensor([n - 1], device=device)]))


# ---------------------------------------------------------------------------------------------------------------------
# timing (CUDA graph replay, weights rotated out of L2)


def time_graph(call: Callable[[int], Any], nrot: int, calls: int = 48, reps: int = 7) -> float:
    """Median us per call of a CUDA graph of ``calls`` calls ``call(j)`` (j rotating over ``nrot`` operand sets)."""
    calls = nrot * max(1, math.ceil(calls / nrot))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for j in range(nrot):
            call(j)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(calls):
            call(j)
    g.replay()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    times.sort()
    return times[len(times) // 2] * 1e3 / calls


def measure_copy_gbs(device: torch.device | str, nbytes: int = 256 << 20) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second, GB/s): the bound a GEMM is compared with."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * src.element_size() / (start.elapsed_time(end) * 1e-3) / 1e9


def linear_bytes(m: int, n: int, k: int) -> int:
    """Bytes a block-FP8 linear must move at least: FP8 weight + fp32 block scales + BF16 input and output."""
    return n * k + math.ceil(n / BLOCK[0]) * math.ceil(k / BLOCK[1]) * 4 + 2 * m * k + 2 * m * n


def random_block_weight(n: int, k: int, device: torch.device | str, generator: torch.Generator | None = None,
                        std: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """A random bf16 weight quantized blockwise by sglang_fp8rl.quant: (wq [N, K] fp8, ws [N/128, K/128] fp32)."""
    w = (torch.randn(n, k, device=device, generator=generator) * std).to(torch.bfloat16)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=device)
    s = torch.empty(blockwise_scale_shape((n, k), BLOCK), dtype=torch.float32, device=device)
    quantize_blockwise_into(w, q, s, BLOCK)
    return q, s


# ---------------------------------------------------------------------------------------------------------------------
# one candidate on one entry


@dataclasses.dataclass
class Bench:
    """Where and how candidates are measured: device, DeepGEMM facts, copy bandwidth, timer, random source."""

    device: torch.device
    facts: DeepGemmFacts
    copy_gbs: float
    timer: Timer
    generator: torch.Generator
    errors: tuple[type[BaseException], ...] = dataclasses.field(default_factory=candidate_errors)

    @classmethod
    def create(cls, device: torch.device | str | None = None, facts: DeepGemmFacts | None = None,
               timer: Timer | None = None, copy_gbs: float | None = None, seed: int = 0) -> Bench:
        """A bench on ``device`` (this rank's GPU by default); on CPU (tests) DeepGEMM is off and the copy
        bandwidth infinite unless given, and ``timer`` must be given."""
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        on_cuda = dev.type == "cuda"
        if facts is None:
            facts = deepgemm.detect(dev) if on_cuda else DeepGemmFacts()
        if copy_gbs is None:
            copy_gbs = measure_copy_gbs(dev) if on_cuda else float("inf")
        return cls(dev, facts, copy_gbs, timer or time_graph, torch.Generator(device=dev).manual_seed(seed))

    def sync(self) -> None:
        """Wait for the device (nothing on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclasses.dataclass
class Operands:
    """``nrot`` copies of one random block-FP8 weight (read from HBM, not L2) and the output columns checked."""

    weights: list[tuple[torch.Tensor, torch.Tensor]]
    cols: torch.Tensor

    @property
    def nrot(self) -> int:
        return len(self.weights)


@dataclasses.dataclass
class Inputs:
    """Activations for one M (one per weight copy) and the float64 reference of the first one."""

    m: int
    xs: list[torch.Tensor]
    ref: torch.Tensor


def make_operands(n: int, k: int, rot_bytes: float, bench: Bench) -> Operands:
    """Weight copies worth >= ``rot_bytes`` in all (2 to 16) and the check columns of an [N, K] shape."""
    nrot = int(min(16, max(2, math.ceil(rot_bytes / (n * k)))))
    first = random_block_weight(n, k, bench.device, bench.generator)
    weights = [first] + [(first[0].clone(), first[1].clone()) for _ in range(nrot - 1)]
    return Operands(weights, check_columns(n, generator=bench.generator, device=bench.device))


def make_inputs(m: int, k: int, ops: Operands, bench: Bench) -> Inputs:
    """Fresh x ~ N(0, 1) for one M and its float64 block-scaled reference (shared by every candidate)."""
    xs = [torch.randn(m, k, device=bench.device, generator=bench.generator, dtype=torch.bfloat16)
          for _ in range(ops.nrot)]
    xq, xsc = quantize_activation_groups(xs[0], BLOCK[1])
    w0, s0 = ops.weights[0]
    return Inputs(m, xs, block_scaled_reference(xq, xsc, w0, s0, BLOCK, ops.cols))


def measure_candidate(c: Candidate, n: int, k: int, entry: Entry, ops: Operands, inputs: Sequence[Inputs],
                      bench: Bench, rel_tol: float, calls: int, reps: int) -> None:
    """Measure ``c`` at every point of ``entry`` (times summed into ``entry.us``), or record why it is rejected."""
    for inp in inputs:
        why = c.can_implement(n, k, bench.facts, inp.m)
        if why:
            entry.rejected[c.name] = why
            entry.us.pop(c.name, None)
            return
        try:
            us = _measure_point(c, inp, ops, bench, rel_tol, calls, reps, entry)
        except bench.errors as e:
            entry.rejected[c.name] = f"{type(e).__name__}: {e}"[:300]
            entry.us.pop(c.name, None)
            bench.sync()
            return
        entry.us[c.name] = entry.us.get(c.name, 0.0) + us


def _measure_point(c: Candidate, inp: Inputs, ops: Operands, bench: Bench, rel_tol: float, calls: int, reps: int,
                   entry: Entry) -> float:
    """First call (timed wall, JIT), float64 check, then the graph timing of one candidate at one M."""
    t1 = time.time()
    w0, s0 = ops.weights[0]
    o = c.fn(inp.xs[0], w0, s0, None)
    bench.sync()
    entry.first_call_s[c.name] = round(max(entry.first_call_s.get(c.name, 0), time.time() - t1), 3)
    err = rel_error(o[:, ops.cols], inp.ref)
    entry.rel_err[c.name] = max(err, entry.rel_err.get(c.name, 0.0))
    if not err <= rel_tol:
        raise ValueError(f"rel. error {err:.3g} > {rel_tol} at M={inp.m}")

    def call(j: int) -> None:
        w, s = ops.weights[j % ops.nrot]
        c.fn(inp.xs[j % ops.nrot], w, s, None)

    return bench.timer(call, ops.nrot, calls, reps)
