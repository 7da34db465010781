"""Which SGLang releases this package supports; checked before any SGLang internal is imported."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# Exactly the releases CI tests (requirements/sglang-<version>.txt); pyproject.toml admits exactly these
# (tests/test_version_matrix.py). The first is the primary one: the full suite runs on it.
SUPPORTED_SGLANG: tuple[str, ...] = ("0.5.17", "0.5.12", "0.5.15.post1", "0.5.21", "0.5.23")
PRIMARY_SGLANG = SUPPORTED_SGLANG[0]


def installed_sglang() -> str:
    """The installed SGLang version string; RuntimeError if SGLang is not installed."""
    try:
        return version("sglang")
    except PackageNotFoundError as e:
        raise RuntimeError("SGLang is not installed") from e


def imports_kvcacheio_unguarded(installed: str | None = None) -> bool:
    """Whether SGLang imports ``sgl_kernel.kvcacheio`` (host KV offload copies, CUDA-only) at module level on every
    non-NPU/XPU/MPS device: 0.5.12-0.5.14; 0.5.15 guards the import. Read from the installed version, not the feature:
    the answer is needed before SGLang can be imported (cpu_runner.py stubs the module on CPU)."""
    from packaging.version import Version

    return Version(installed_sglang() if installed is None else installed) < Version("0.5.15")


def check_sglang_version(installed: str | None = None) -> str:
    """Return the installed SGLang version; RuntimeError naming it and the supported ones if it is not supported."""
    installed = installed_sglang() if installed is None else installed
    if installed.split("+")[0] not in SUPPORTED_SGLANG:
        raise RuntimeError(
            f"SGLang {installed} is not supported by sglang-fp8rl; supported: {', '.join(SUPPORTED_SGLANG)} "
            f"(pip install 'sglang=={PRIMARY_SGLANG}')"
        )
    return installed
