"""The package's imports flow one way, down a table of layers, with no cycles.

The layers, their packages and what each owns are drawn in
docs/architecture.md; `LAYERS` below is the same table and a test checks
that the two agree. A module imports its own package and the packages of
strictly lower layers only: a new import that climbs (a back edge) or
crosses within a layer fails here.
"""

import ast
import functools
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

from _paths import REPO

pytestmark = pytest.mark.timeout(180)

# Layer -> its units. A unit is a package (all its modules) or a top-level
# module; a module's unit is the longest listed prefix of its name.
LAYERS = [
    # 0: foundations without TensorFlow's Python API at import.
    ["keras_ps._base_errors", "keras_ps._constants", "keras_ps._tf_adapter"],
    ["keras_ps.errors", "keras_ps._native", "keras_ps._exit_guard"],
    ["keras_ps.cluster", "keras_ps.tables"],
    ["keras_ps._keras"],
    ["keras_ps.strategy", "keras_ps.backups"],
    ["keras_ps.coordinator", "keras_ps.elastic", "keras_ps.dynamic_embedding"],
    ["keras_ps.shards"],
    ["keras_ps.training"],
    ["keras_ps.sidecar"],
    ["keras_ps.callbacks"],
    # Public entry modules, then the commands (`python -m ...`).
    ["keras_ps", "keras_ps.layers", "keras_ps.optimizers",
     "keras_ps.partitioners"],
    ["keras_ps.demo", "keras_ps.evaluator", "keras_ps.server"],
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}
# Private top-level modules (everything else at the top is public or a package).
PRIVATE_TOP_LEVEL = {"keras_ps._base_errors", "keras_ps._constants",
                     "keras_ps._tf_adapter", "keras_ps._exit_guard"}
# In-function imports of keras_ps modules allowed, each to keep TensorFlow
# out of a process that must start without it (a comment there says so).
LAZY_IMPORTS_ALLOWED = {
    "keras_ps/__init__.py", "keras_ps/demo.py",
    "keras_ps/elastic/__init__.py", "keras_ps/elastic/agent.py",
    "keras_ps/elastic/launch.py",
}


def _modules():
    """{module name: source path} of keras_ps and keras_ps.callbacks."""
    found = {}
    for package, folder in (("keras_ps", "keras_ps"),
                            ("keras_ps.callbacks", "callbacks")):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.join(REPO, folder))
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([package, *parts])] = path
    return found


_PARSE = ("import ast, pickle, sys; sys.stdout.buffer.write(pickle.dumps("
          "{p: ast.parse(open(p).read()) for p in sys.argv[1:]}))")


@functools.lru_cache(maxsize=None)
def _trees():
    """{path: syntax tree} of every module, parsed in a fresh process.

    Python 3.11's AST constructor keeps one recursion counter for all
    threads: a parse in another thread (TF's autograph parses the source of
    the functions it converts, in the coordinator's threads left by earlier
    tests) can make a parse here fail with "AST constructor recursion depth
    mismatch"."""
    paths = sorted(_modules().values())
    out = subprocess.run([sys.executable, "-c", _PARSE, *paths],
                         capture_output=True, check=True)
    return pickle.loads(out.stdout)


def _imports(path, modules):
    """(top-level imports, in-function imports) of keras_ps modules."""
    tree = _trees()[path]
    top, lazy = set(), set()
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from package import module` imports the module; `from module
            # import name` the module.
            names = [f"{node.module}.{a.name}"
                     if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        names = [n for n in names if n in modules]
        if not names:
            continue
        in_function = False
        parent = parents.get(node)
        while parent is not None:
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function = True
            parent = parents.get(parent)
        (lazy if in_function else top).update(names)
    return top, lazy


def _unit(module):
    """The listed unit `module` belongs to (None if unlisted)."""
    found = [u for u in LAYER_OF if module == u or
             (u != "keras_ps" and module.startswith(u + "."))]
    return max(found, key=len, default=None)


def test_imports_flow_down_the_layers_without_cycles():
    modules = _modules()
    graph, back_edges, lazy_found = {}, [], []
    for module, path in modules.items():
        top, lazy = _imports(path, modules)
        graph[module] = {m for m in top if m != module}
        for target in graph[module]:
            source_unit, target_unit = _unit(module), _unit(target)
            if source_unit == target_unit:
                continue
            if LAYER_OF[target_unit] >= LAYER_OF[source_unit]:
                back_edges.append(f"{module} -> {target} (layer "
                                  f"{LAYER_OF[source_unit]} -> "
                                  f"{LAYER_OF[target_unit]})")
        if lazy and os.path.relpath(path, REPO) not in LAZY_IMPORTS_ALLOWED:
            lazy_found.append(f"{module}: {sorted(lazy)}")
    assert not back_edges, back_edges
    assert not lazy_found, lazy_found
    # No cycles (depth-first search).
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in graph.get(module, ()):
            if state.get(target) == "open":
                raise AssertionError(" -> ".join(path + [module, target]))
            if target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])


def test_every_module_has_a_layer():
    # A new package or top-level module is placed in the table (and in
    # docs/architecture.md) before it is imported.
    assert sorted(m for m in _modules() if _unit(m) is None) == []


def test_top_level_holds_public_modules_and_packages():
    private = {m for m, p in _modules().items()
               if m.count(".") == 1 and m.split(".")[1].startswith("_")
               and not p.endswith("__init__.py")}
    assert private == PRIVATE_TOP_LEVEL


def test_each_package_says_what_it_owns():
    missing = []
    for module, path in _modules().items():
        if path.endswith("__init__.py"):
            doc = ast.get_docstring(_trees()[path])
            if not doc or len(doc.split()) < 15:
                missing.append(module)
    assert missing == []


def test_architecture_doc_draws_the_same_layers():
    # docs/architecture.md lists the layers as a table, one row per layer:
    # | 2 | `keras_ps.cluster`, `keras_ps.tables` | ... |
    with open(os.path.join(REPO, "docs", "architecture.md")) as f:
        text = f.read()
    documented = {}
    for match in re.finditer(r"^\| *(\d+) *\|([^|]*)\|", text, re.M):
        documented[int(match.group(1))] = sorted(
            re.findall(r"`(keras_ps[\w.]*)`", match.group(2)))
    assert documented == {i: sorted(units) for i, units in enumerate(LAYERS)}


def test_no_fragments_and_no_long_modules():
    sizes = {m: sum(1 for _ in open(p)) for m, p in _modules().items()}
    short = {m: n for m, n in sizes.items() if n < 40
             and not _modules()[m].endswith("__init__.py")
             and not m.endswith("_pb2")}
    assert short == {}


def _run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=150, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_module_imports_first_in_a_fresh_state():
    # One process (TensorFlow loads once); before each import every keras_ps
    # module is dropped, so each is imported first, as in a fresh process:
    # a cycle shows as an ImportError of a partially initialised module.
    names = sorted(n for n in _modules() if n != "keras_ps.demo")
    failures = _run(
        "import importlib, json, sys, traceback\n"
        f"names = {names!r}\n"
        "failures = {}\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'keras_ps' or "
        "m.startswith('keras_ps.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failures[name] = traceback.format_exc()[-800:]\n"
        "print(json.dumps(failures))\n")
    assert failures == {}


def test_coordinator_loads_no_grpc_and_no_elastic():
    loaded = _run(
        "import json, sys\n"
        "import keras_ps.coordinator\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == "
        "'grpc' or m.startswith('keras_ps.elastic'))))\n")
    assert loaded == []


def test_no_module_is_longer_than_450_lines():
    long = {m: n for m, p in _modules().items()
            if (n := sum(1 for _ in open(p))) > 450}
    assert long == {}
