"""Where an SGLang server's start goes: its log lines mapped to start-up phases, live and as a table at the end.

The server's log (``launch_server`` and its scheduler process, SGLang 0.5.17 wording) marks the end of each phase
with a known line; each line starts with a ``[YYYY-mm-dd HH:MM:SS ...]`` timestamp. :class:`StartupWatcher` follows
the log file while the server starts (what it is doing now, for progress lines) and :func:`phase_table` turns the
marks into "phase, took s" rows. Pure text processing, no SGLang import.
"""

from __future__ import annotations

import dataclasses
import re
import time
from datetime import datetime

_STAMP = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})[^\]]*\]\s?(.*)$")
STAMP_FORMAT = "%Y-%m-%d %H:%M:%S"  # SGLang's configure_logger datefmt (local time)
FIRST_PHASE = "launcher: Python start and SGLang import"


@dataclasses.dataclass(frozen=True)
class Mark:
    """A log line that ends a phase: ``done`` is the phase it ends, ``next`` what the server does after it."""

    pattern: str
    done: str
    next: str
    show_line: bool = False  # print the line's text in the table (our own summary lines)


MARKS = (
    Mark(r"server_args=ServerArgs", FIRST_PHASE, "starting the scheduler process (it imports SGLang again)"),
    Mark(r"Init torch distributed begin", "scheduler process: start and SGLang import",
         "setting up torch.distributed and the model config"),
    Mark(r"Load weight begin", "torch.distributed and model set-up", "loading the BF16 weights, quantizing to FP8"),
    Mark(r"Load weight end", "loading the weights and quantizing them to FP8",
         "compiling the DeepGEMM kernels CUDA-graph capture will launch (parallel workers; gemm_select after)"),
    Mark(r"\[fp8rl\] DeepGEMM JIT warm-up for \d+ CUDA-graph", "DeepGEMM JIT warm-up (parallel nvcc compiles)",
         "gemm_select (unless off), then the KV cache", show_line=True),
    Mark(r"\[fp8rl\] DeepGEMM JIT warm-up for the num_sms", "gemm_select measuring, phase 1; num_sms variants compiled",
         "gemm_select measuring, phase 2", show_line=True),
    Mark(r"\[fp8rl\] gemm_select: measured", "gemm_select measuring", "writing the GEMM choices", show_line=True),
    Mark(r"\[fp8rl\] gemm_select \(", "gemm_select lookup", "allocating the KV cache"),
    Mark(r"Memory pool end", "rest of the load-time GEMM preparation (if any), KV cache allocation",
         "attention backend, then CUDA-graph capture"),
    Mark(r"Capture target prefill CUDA graph begin", "attention backend set-up",
         "capturing prefill CUDA graphs (first launches JIT-compile Triton and SGLang kernels)"),
    Mark(r"Capture target prefill CUDA graph end", "prefill CUDA-graph capture (with kernel JIT)",
         "capturing decode CUDA graphs"),
    Mark(r"Capture target decode CUDA graph begin", "attention backend set-up",
         "capturing decode CUDA graphs (first launches JIT-compile Triton attention and SGLang kernels)"),
    Mark(r"Capture target decode CUDA graph end", "decode CUDA-graph capture (with kernel JIT)",
         "HTTP server start and SGLang's warm-up request (first prefill: more kernel JIT)"),
    Mark(r"fired up and ready to roll", "HTTP server start and warm-up request (first prefill: kernel JIT)",
         "answering the first /health_generate"),
)
_COMPILED = tuple((re.compile(m.pattern), m) for m in MARKS)


@dataclasses.dataclass(frozen=True)
class Event:
    """A mark seen in the log, ``at`` seconds after launch."""

    at: float
    mark: Mark
    text: str


def parse_stamp(line: str) -> tuple[float | None, str]:
    """(epoch seconds of the line's timestamp or None, the message after it)."""
    m = _STAMP.match(line)
    if not m:
        return None, line.rstrip("\n")
    try:
        return datetime.strptime(m.group(1), STAMP_FORMAT).timestamp(), m.group(2).rstrip("\n")
    except ValueError:
        return None, m.group(2).rstrip("\n")


def match_mark(message: str) -> Mark | None:
    """The mark this log message is, if any."""
    for pattern, mark in _COMPILED:
        if pattern.search(message):
            return mark
    return None


class StartupWatcher:
    """Follows a server log from its launch: the phase marks seen so far, with their times."""

    def __init__(self, log_path: str, launched_at: float | None = None) -> None:
        self.log_path = log_path
        self.launched_at = time.time() if launched_at is None else launched_at
        self.events: list[Event] = []
        self.last_line = ""
        self._offset = 0
        self._partial = ""
        self._seen: set[str] = set()

    def feed(self, line: str, seen_at: float) -> Event | None:
        """Take one log line (seen at epoch ``seen_at``); the new event if it is a phase mark seen for the first time.

        The line's own timestamp (whole seconds) is used when it has one, kept between the previous event and the
        time the line was read."""
        stamp, message = parse_stamp(line)
        shown = message.split("\r")[-1].strip()  # progress bars redraw with carriage returns
        if shown:
            self.last_line = shown
        mark = match_mark(message)
        if mark is None or mark.pattern in self._seen:
            return None
        self._seen.add(mark.pattern)
        floor = self.events[-1].at if self.events else 0.0
        at = min(max(stamp - self.launched_at if stamp is not None else seen_at - self.launched_at, floor),
                 max(seen_at - self.launched_at, floor))
        event = Event(at, mark, message.strip())
        self.events.append(event)
        return event

    def poll(self, now: float | None = None) -> list[Event]:
        """Read what the log gained since the last call; the new events."""
        now = time.time() if now is None else now
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except OSError:
            return []
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        return [e for e in (self.feed(line, now) for line in lines) if e is not None]

    def doing_now(self) -> str:
        """What the server is doing according to the last mark seen."""
        return self.events[-1].mark.next if self.events else FIRST_PHASE


def phase_table(events: list[Event], ready_at: float | None = None, ready_what: str = "") -> str:
    """Rows "ends at s | took s | phase" from launch through every event (and ``ready_at``, if given)."""
    rows = ["| ends at s | took s | phase |", "| ---: | ---: | --- |"]
    previous = 0.0
    for event in events:
        detail = f": {event.text.split('[fp8rl] ', 1)[-1]}" if event.mark.show_line else ""
        rows.append(f"| {event.at:.0f} | {event.at - previous:.0f} | {event.mark.done}{detail} |")
        previous = event.at
    if ready_at is not None:
        rows.append(f"| {ready_at:.0f} | {ready_at - previous:.0f} | {ready_what} |")
    return "\n".join(rows)
