"""Verdicts and the report of scripts/gpu/check_server.py: one record per check (PASS/FAIL, why, the engine's message),
output comparisons, the scheme summary lines of the server log, and the PASS/FAIL table. No GPU, no server: tested in
tests/test_check_server_cpu.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Optional, Sequence

PASS, FAIL = "PASS", "FAIL"
MESSAGE_CHARS = 600  # of the engine's message kept per check
SCHEME_LINE = "[fp8rl] fp8_online_blockwise: linear layers"
NOT_OPTIMIZED = "not fully optimized yet"  # SGLang's start-up warning that the plugin replaces with SCHEME_LINE
_TP_RANK = re.compile(r"\bTP(\d+)\b")


@dataclasses.dataclass
class Check:
    """One check: its verdict, why (the first failed condition, or what passed), the engine's message."""

    name: str
    verdict: str
    why: str
    message: str = ""
    data: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether it passed."""
        return self.verdict == PASS

    def as_dict(self) -> dict[str, Any]:
        """JSON form (data merged in)."""
        return {"name": self.name, "verdict": self.verdict, "why": self.why, "message": self.message, **self.data}


def check(name: str, conditions: Sequence[tuple[bool, str]], message: str = "", **data: Any) -> Check:
    """PASS when every (condition, description) holds; else FAIL naming the first that does not."""
    failed = [what for ok, what in conditions if not ok]
    why = ("not " + failed[0]) if failed else "; ".join(what for _, what in conditions)
    return Check(name, FAIL if failed else PASS, why, str(message)[:MESSAGE_CHARS], data)


def not_run(name: str, reason: str) -> Check:
    """A check that could not run (e.g. the server died before it)."""
    return Check(name, FAIL, f"not run: {reason}")


# ---------------------------------------------------------------------------------------------------------------------
# outputs


def same_outputs(a: Optional[list[dict]], b: Optional[list[dict]]) -> bool:
    """Greedy outputs bit-identical: the same token ids and the same logprobs, for every prompt."""
    return a is not None and b is not None and len(a) == len(b) and all(
        x["ids"] == y["ids"] and x["logprobs"] == y["logprobs"] for x, y in zip(a, b))


def max_logprob_diff(a: list[dict], b: list[dict]) -> Optional[float]:
    """Largest |logprob difference| over aligned tokens (None when the token ids differ anywhere)."""
    if any(x["ids"] != y["ids"] for x, y in zip(a, b)) or len(a) != len(b):
        return None
    diffs = [abs(p - q) for x, y in zip(a, b) for p, q in zip(x["logprobs"], y["logprobs"])]
    return max(diffs, default=0.0)


def says_all(message: str, words: Sequence[str]) -> bool:
    """Every word occurs in the message (case-insensitive)."""
    low = message.lower()
    return all(w.lower() in low for w in words)


def refusal(name: str, answer: Optional[dict], error: Optional[str], says: Sequence[str], alive: bool,
            outputs_same: bool, digest_same: bool, consistent: Optional[bool], **data: Any) -> Check:
    """A bad update: refused with success false and a message that names what ``says`` lists, while the server stays
    alive and consistent, its outputs equal the reference and its FP8 parameters keep their storage."""
    message = (answer or {}).get("message", "") if error is None else error
    return check(name, [
        (error is None, "answered (no transport error)"),
        (answer is not None and answer.get("success") is False, "refused (success false)"),
        (says_all(message, says), f"message names {list(says)}"),
        (alive, "server alive (/health_generate 200)"),
        (consistent is True, "engine consistent"),
        (outputs_same, "outputs unchanged"),
        (digest_same, "FP8 pointers unchanged"),
    ], message, **data)


# ---------------------------------------------------------------------------------------------------------------------
# server log


def scheme_lines(log_text: str) -> dict[str, str]:
    """The plugin's per-rank scheme summary lines of a server log, keyed "TP<rank>" (SGLang's log prefix names the
    rank only at TP > 1: an unnamed line is rank 0's); the last line per rank wins."""
    lines: dict[str, str] = {}
    for line in log_text.splitlines():
        if SCHEME_LINE in line:
            match = _TP_RANK.search(line[: line.index(SCHEME_LINE)])
            lines[f"TP{match.group(1) if match else 0}"] = line[line.index(SCHEME_LINE):].strip()
    return lines


def read_log(path: str) -> str:
    """A server log's text ('' when missing)."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------------------------------
# report


def table(checks: Sequence[Check]) -> str:
    """The compact PASS/FAIL table (markdown) and a totals line."""
    rows = ["| check | verdict | why |", "| --- | --- | --- |"]
    for c in checks:
        why = c.why.replace("|", "/")
        rows.append(f"| {c.name} | {c.verdict} | {why[:160]} |")
    passed = sum(c.ok for c in checks)
    failed = [c.name for c in checks if not c.ok]
    rows.append("")
    rows.append(f"{passed}/{len(checks)} checks passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return "\n".join(rows) + "\n"


def write_report(out_dir: str, report: dict, checks: Sequence[Check], json_name: str = "check_server.json",
                 title: Optional[str] = None) -> dict:
    """OUT/<json_name> (report + checks + totals) and OUT/summary.md (``title`` and the table); returns the JSON dict.
    The title defaults to check_server.py's."""
    full = dict(report, checks=[c.as_dict() for c in checks], passed=sum(c.ok for c in checks), total=len(checks))
    with open(os.path.join(out_dir, json_name), "w") as f:
        json.dump(full, f, indent=1, default=str)
    head = (title or f"## server check: {report.get('model_name')} at TP {report.get('tp_size')}") + \
        f" ({report.get('device', '?')}, {report.get('date', '?')})\n\n"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(head + table(checks))
    return full
