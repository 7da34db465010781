"""scripts/gpu/jit_cache.sh: a machine's kernel compilation caches saved in parts and restored on the next one."""

from __future__ import annotations

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "jit_cache.sh"


def _run(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_every_cache_saved_then_restored_where_it_was(tmp_path):
    home = tmp_path / "home"
    caches = {tmp_path / "triton": "kernel.cubin", tmp_path / "dg": "gemm.so", home / ".cache" / "deep_gemm": "a.so",
              home / ".cache" / "tvm-ffi": "b.so"}
    for folder, name in caches.items():
        folder.mkdir(parents=True)
        (folder / name).write_bytes(os.urandom(4096) + folder.name.encode())
    before = {folder / name: (folder / name).read_bytes() for folder, name in caches.items()}
    env = {**os.environ, "HOME": str(home), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "SGLANG_DG_CACHE_DIR": str(tmp_path / "dg")}
    out = tmp_path / "out"
    saved = _run("save", str(out), env=env)
    assert saved.returncode == 0 and "saved" in saved.stdout, saved.stdout + saved.stderr
    assert sorted(p.name for p in out.iterdir()) == ["jit_cache.tgz.0"]
    for path in before:
        path.unlink()
    restored = _run("restore", str(out), env=env)
    assert restored.returncode == 0 and "restored 1 parts" in restored.stdout, restored.stdout + restored.stderr
    assert {path: path.read_bytes() for path in before} == before


def test_nothing_to_save_or_restore_is_said_not_failed(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TRITON_CACHE_DIR": str(tmp_path / "none"),
           "SGLANG_DG_CACHE_DIR": str(tmp_path / "none2")}
    assert "nothing to save" in _run("save", str(tmp_path / "out"), env=env).stdout
    assert "no parts" in _run("restore", str(tmp_path / "empty"), env=env).stdout
    assert _run("bogus", "x", env=env).returncode == 2
