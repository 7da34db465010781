"""The package's shape: no import cycle (imports inside functions count), imports point one way down the layers,
modules stay small, public functions carry type hints, and every difference between SGLang releases is an adapter in
``compat/`` (no version comparison or attribute probe elsewhere). Read from the source with ``ast``; nothing is
imported."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "sglang_fp8rl"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE
MAX_LINES = 400

# Layers, lowest first: a module may import from its own layer or a lower one, never from a higher one
# (docs/ARCHITECTURE.md). The first matching prefix wins.
LAYERS: list[tuple[str, int]] = [
    ("sglang_fp8rl.compat", 0),  # SGLang version differences: imports SGLang, nothing of ours
    # this process's engine-wide state, one owner per concern: every layer reaches it, it imports nothing of ours
    ("sglang_fp8rl.engine", 0),
    ("sglang_fp8rl.quant", 0),
    ("sglang_fp8rl.rollout_correction", 0),
    # SGLang's TP groups and the verdict every TP rank agrees on: weight_sync/ and kv_scales/ both use it
    ("sglang_fp8rl.parallel", 1),
    ("sglang_fp8rl.kernels", 1),
    ("sglang_fp8rl.server_args", 2),
    ("sglang_fp8rl.layers", 3),
    ("sglang_fp8rl.kv_scales", 3),
    ("sglang_fp8rl.weight_sync", 4),
    ("sglang_fp8rl.hooks", 5),
    ("sglang_fp8rl.plugin", 6),
    # the trainer's API: the trainer side of weight_sync/, re-exported (its __all__ is the contract)
    ("sglang_fp8rl.trainer", 6),
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


@pytest.mark.parametrize("name", sorted(modules()))  # Triton kernel modules too
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


def test_leaf_modules_import_nothing_of_ours():
    """The wire protocol imports nothing at all (either side, and a script, may use it); the TP agreement imports
    nothing of ours (both weight_sync/ and kv_scales/ use it)."""
    mods = modules()
    protocol = ast.parse(mods["sglang_fp8rl.weight_sync.protocol"].read_text())
    assert not [n for n in ast.walk(protocol) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imported_modules(mods["sglang_fp8rl.parallel"], set(mods)) == set()


# ---------------------------------------------------------------------------------------------------------------------
# compat: every difference between the supported SGLang releases is one named adapter in compat/ (the release where
# it starts, one line why). Elsewhere: no version comparison, and no probe that tells two layouts apart by what an
# object has. A probe, as read here: any hasattr(); a getattr(obj, name, None) whose result is tested against None
# (directly, or through the name it was assigned to in the same function) or passed to callable(); a getattr whose
# default is another object (getattr(m, "new", m.old)); a mapping read under one key, else another
# (arguments.get("loc_info", arguments.get("loc"))). A value read with a constant default (getattr(args, "x",
# False)) is not a probe: the field exists in every release, the default serves stand-ins and partial objects.

# (file under sglang_fp8rl/, the probe's line stripped) -> why it is not a difference between SGLang releases
PROBE_ALLOWLIST: dict[tuple[str, str], str] = {
    ("kernels/jit_warmup.py",
     'cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)'):
        "Python's os module: sched_getaffinity exists on Linux only",
    ("layers/fp8_storage.py", "return t.dtype == FP8_DTYPE and getattr(t, SCALE_ATTR, None) is not None"):
        "our own attribute (fp8rl_scale_inv) on a tensor: pre-quantized codes carry their scale",
    ("server_args.py", 'value = getattr(args, "fp8rl_" + field.name, None)'):
        "our own --fp8rl-* options on an argparse namespace (absent where our parser hook did not run)",
    ("weight_sync/validate.py",
     'return args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))'):
        "two loaders' keyword for the shard (a linear's loaded_shard_id, other loaders' shard_id), in every release",
    ("weight_sync/request.py", 'if hasattr(module, "w13_weight"):'):
        "w13_weight is the expert parameter our MoE method creates (layers/moe.py): which of our layers this is",
    ("weight_sync/client.py",
     'reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)  # SGLang may have patched it'):
        "torch's reductions module: its own reduce_tensor, which SGLang's monkey_patch_torch_reductions keeps aside "
        "in every supported release (in a trainer process that ran it)",
    ("hooks/scheduler.py",
     'model = getattr(getattr(getattr(self, "tp_worker", None), "model_runner", None), "model", None)'):
        "every supported Scheduler has tp_worker.model_runner.model: a None-safe read, not a release difference "
        "(a worker without a model of ours gets no telemetry)",
    ("hooks/scheduler.py",
     'grammar_queue = getattr(getattr(scheduler, "grammar_manager", None), "grammar_queue", None)'):
        "every supported Scheduler has grammar_manager.grammar_queue: a None-safe read, not a release difference "
        "(tests/test_weight_updates.py's scheduler stand-in has none)",
}
VERSION_CALLS = {"Version", "parse_version", "LooseVersion", "StrictVersion"}


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _is_call(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _getattr_none(node: ast.AST) -> bool:
    return _is_call(node, "getattr") and len(node.args) == 3 and _is_none(node.args[2])


def _reads_sglang_version(node: ast.AST) -> bool:
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            names_sglang = bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value == "sglang"
            if func == "installed_sglang" or (func.endswith("version") and names_sglang):
                return True
    return False


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a module or function, without those of the functions defined in it."""
    nodes, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))
    return nodes


def release_probes(source: str) -> list[tuple[int, str]]:
    """(line, what) of every version comparison and attribute probe in ``source`` (see above)."""
    tree = ast.parse(source)
    found: set[tuple[int, str]] = set()
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        nodes = _own_nodes(scope)
        assigned = {t.id: node.lineno for node in nodes if isinstance(node, ast.Assign)
                    and _getattr_none(node.value) for t in node.targets if isinstance(t, ast.Name)}
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(n == "packaging" or n.startswith("packaging.") for n in names):
                    found.add((node.lineno, "packaging imported"))
            elif isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in VERSION_CALLS:
                    found.add((node.lineno, f"{func}() compared"))
                elif func == "hasattr":
                    found.add((node.lineno, "hasattr probe"))
                elif func == "callable" and node.args and (_getattr_none(node.args[0]) or (
                        isinstance(node.args[0], ast.Name) and node.args[0].id in assigned)):
                    found.add((assigned.get(getattr(node.args[0], "id", ""), node.lineno), "callable(getattr) probe"))
                elif func == "getattr" and len(node.args) == 3 and not isinstance(node.args[2], ast.Constant):
                    found.add((node.lineno, "getattr with a fallback object"))
                elif func == "get" and len(node.args) == 2 and isinstance(node.args[1], ast.Call) and \
                        isinstance(node.args[1].func, ast.Attribute) and node.args[1].func.attr == "get":
                    found.add((node.lineno, "one key, else another (a renamed argument or field)"))
            elif isinstance(node, ast.Compare):
                if _reads_sglang_version(node):
                    found.add((node.lineno, "SGLang's version compared"))
                none_test = isinstance(node.ops[0], (ast.Is, ast.IsNot)) and _is_none(node.comparators[0])
                if len(node.ops) == 1 and none_test:
                    if _getattr_none(node.left):
                        found.add((node.lineno, "getattr(..., None) tested against None"))
                    elif isinstance(node.left, ast.Name) and node.left.id in assigned:
                        found.add((assigned[node.left.id], "getattr(..., None) tested against None"))
    return sorted(found)


def test_release_probe_finder_finds_each_form():
    probes = release_probes(
        "from packaging.version import Version\n"                              # 1
        "old = Version(v) < Version('0.5.15')\n"                               # 2
        "old = installed_sglang() < '0.5.15'\n"                                # 3
        "has = hasattr(runner, 'init_cuda_graphs')\n"                          # 4
        "def f(m):\n"
        "    method = getattr(m, 'begin_weight_update', None)\n"               # 6
        "    if method is None:\n"
        "        return getattr(m, 'new', m.old)\n"                            # 8
        "    return getattr(m, 'x', None) is not None or callable(getattr(m, 'y', None))\n"  # 9
        "loc = arguments.get('loc_info', arguments.get('loc'))\n"             # 10
        "def g(args, method):\n"
        "    return getattr(args, 'quantization', None) == 'fp8', getattr(args, 'tp_size', 1), method is None\n")
    assert [line for line, _ in probes] == [1, 2, 3, 4, 6, 8, 9, 9, 10]  # value reads are not probes; nor is g's None


def test_release_differences_live_in_compat():
    """Outside compat/: no version comparison and no attribute probe, but for PROBE_ALLOWLIST (each with its reason);
    an allowlist entry that no longer matches a probe is stale."""
    found, seen = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("compat/"):
            continue
        lines = path.read_text().splitlines()
        for line, what in release_probes(path.read_text()):
            key = (rel, lines[line - 1].strip())
            if key in PROBE_ALLOWLIST:
                seen.add(key)
            else:
                found.append(f"{rel}:{line}: {what}: {key[1]}")
    assert not found, "a difference between SGLang releases outside compat/ (make it a named adapter there):\n" + \
        "\n".join(found)
    assert not set(PROBE_ALLOWLIST) - seen, f"stale PROBE_ALLOWLIST entries: {sorted(set(PROBE_ALLOWLIST) - seen)}"

