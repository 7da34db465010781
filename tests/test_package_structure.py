"""The package's shape: no import cycle (imports inside functions count), imports point one way down the layers,
modules stay small, and public functions carry type hints. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "sglang_fp8rl"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE
MAX_LINES = 400
KERNEL_FILES = {"sglang_fp8rl.kernels.triton_quant", "sglang_fp8rl.kernels.block_gemm"}  # Triton kernels: exempt

# Layers, lowest first: a module may import from its own layer or a lower one, never from a higher one
# (docs/ARCHITECTURE.md). The first matching prefix wins.
LAYERS: list[tuple[str, int]] = [
    ("sglang_fp8rl.compat", 0),  # SGLang version differences: imports SGLang, nothing of ours
    ("sglang_fp8rl.quant", 0),
    ("sglang_fp8rl.rollout_correction", 0),
    ("sglang_fp8rl.kernels", 1),
    ("sglang_fp8rl.server_args", 2),
    ("sglang_fp8rl.layers", 3),
    ("sglang_fp8rl.kv_scales", 3),
    # TP verdicts over SGLang's CPU group, nothing of ours imported: the KV calibration agrees with it too
    ("sglang_fp8rl.weight_sync.consensus", 3),
    ("sglang_fp8rl.weight_sync", 4),
    ("sglang_fp8rl.hooks", 5),
    ("sglang_fp8rl.plugin", 6),
    # RL frameworks' glue (Ray worker hook, slime's parser): SGLang's plugin loader and our option names only
    ("sglang_fp8rl.integrations", 6),
    ("sglang_fp8rl.demo", 7),
    ("sglang_fp8rl.cpu_runner", 7),
    ("sglang_fp8rl.startup_phases", 7),
    ("sglang_fp8rl", 7),  # the package's own __init__
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_modules(path: pathlib.Path, known: set[str]) -> set[str]:
    """Our modules that ``path`` imports anywhere (module level, functions, TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name.startswith(PACKAGE):
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in known:
                    found.add(name)
    if path.is_relative_to(ROOT):
        found.discard(module_name(path))
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        targets = imported_modules(path, known)
        # importing a submodule runs its package's __init__ first: no edge needed, Python resolves that order
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def layer_of(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{module} has no layer in tests/test_package_structure.py LAYERS: add it")


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_are_seen(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from sglang_fp8rl.kernels import dispatch\n")
    known = {"sglang_fp8rl.kernels", "sglang_fp8rl.kernels.dispatch", "sglang_fp8rl.quant"}
    assert imported_modules(src, known) == {"sglang_fp8rl.kernels", "sglang_fp8rl.kernels.dispatch"}


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers():
    upward = [f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
              for src, targets in import_graph().items() for dst in targets if layer_of(dst) > layer_of(src)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("name", sorted(set(modules()) - KERNEL_FILES))
def test_module_is_small(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it by job"


def public_functions_without_hints() -> list[str]:
    missing = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())

        def visit(body: list[ast.stmt], owner: str, name: str = name) -> None:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                    params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                    bare = [a.arg for a in params if a.annotation is None and a.arg not in ("self", "cls")]
                    if bare or node.returns is None:
                        missing.append(f"{name}:{node.lineno} {owner}{node.name}: params {bare}, "
                                       f"return {'ok' if node.returns else 'missing'}")
                elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    visit(node.body, node.name + ".", name)

        visit(tree.body, "")
    return missing


def test_public_functions_have_type_hints():
    missing = public_functions_without_hints()
    assert not missing, "\n".join(missing)
