"""The SGLang releases pyproject.toml admits are exactly the ones CI tests, and the ones the plugin accepts."""

from __future__ import annotations

import pathlib
import re

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from sglang_fp8rl.compat.versions import PRIMARY_SGLANG, SUPPORTED_SGLANG

ROOT = pathlib.Path(__file__).resolve().parent.parent
# every SGLang release of the 0.5 line from 0.5.10 on, as PyPI lists them (pip index versions sglang, 2026-11-25)
RELEASES = ("0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14",
            "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
            "0.6.0")


def declared_requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (sglang,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "sglang"]
    return sglang


def pinned_versions() -> set[str]:
    return {p.name.removeprefix("sglang-").removesuffix(".txt") for p in (ROOT / "requirements").glob("sglang-*.txt")}


def test_pyproject_admits_exactly_the_supported_releases():
    admitted = {v for v in RELEASES if declared_requirement().specifier.contains(Version(v), prereleases=True)}
    assert admitted == set(SUPPORTED_SGLANG), (admitted, SUPPORTED_SGLANG)


def test_every_supported_release_has_a_ci_environment():
    assert pinned_versions() == set(SUPPORTED_SGLANG)
    for version in SUPPORTED_SGLANG:
        pins = (ROOT / "requirements" / f"sglang-{version}.txt").read_text()
        assert re.search(rf"^sglang=={re.escape(version)}$", pins, re.M), f"sglang-{version}.txt pins another sglang"


def test_ci_runs_every_supported_release():
    ci = (ROOT / ".ci" / "run").read_text() + (ROOT / "scripts" / "cpu_matrix.sh").read_text()
    assert "scripts/cpu_test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "requirements/sglang-" in ci  # the matrix is the set of pin files, the same set checked above


def test_primary_release_is_the_default_env():
    script = (ROOT / "scripts" / "cpu_test.sh").read_text()
    assert "SUPPORTED_SGLANG" in script and PRIMARY_SGLANG == SUPPORTED_SGLANG[0]
