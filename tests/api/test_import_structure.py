"""The package's imports flow one way, with no cycles.

errors/config -> cluster -> strategy -> coordinator -> training (fit) ->
callbacks; the Keras hooks (keras_ps/_keras) sit below the strategy, which
hands them what they need; elastic sits beside the coordinator, which knows
only `keras_ps.cluster.MembershipWatcher`.
"""

import ast
import functools
import json
import os
import pickle
import subprocess
import sys

import pytest

from _paths import REPO

pytestmark = pytest.mark.timeout(180)

# Lower layers never import higher ones. A module's layer is that of the
# longest prefix listed.
LAYERS = {
    "keras_ps._config_errors": 0, "keras_ps._constants": 0,
    "keras_ps.backups._chain": 0, "keras_ps.errors": 0, "keras_ps.partitioners": 0,
    "keras_ps._tf_adapter": 0, "keras_ps.cluster._network": 0, "keras_ps.cluster": 1,
    "keras_ps.cluster._connection": 1, "keras_ps.tables._sharded_variable_ops": 1,
    "keras_ps.strategy._ps_state": 1,
    "keras_ps.tables._row_chunks": 0, "keras_ps.tables._rowwise": 0,
    "keras_ps.tables._blockwise_init": 0, "keras_ps.tables._row_chunks": 0,
    "keras_ps.tables._dirty_rows": 0, "keras_ps.backups._row_files": 0,
    "keras_ps.backups._chain": 0, "keras_ps.backups._io": 0,
    "keras_ps.backups._catalog": 1,
    "keras_ps.backups.incremental_backup": 4,
    "keras_ps.optimizers": 5, "keras_ps.shards": 4, "keras_ps.training.sharded_fit": 4,
    "keras_ps.training._fit_epochs": 4, "keras_ps.training._fit_epochs": 4, "keras_ps.server": 2,
    "keras_ps.elastic": 2, "keras_ps.strategy._per_worker": 1,
    "keras_ps.tables.sharded_variable": 1, "keras_ps.tables._sharded_weights": 1,
    "keras_ps._keras": 1, "keras_ps.strategy": 2, "keras_ps.coordinator": 3,
    "keras_ps.training.inputs": 4, "keras_ps.training.logs": 4,
    "keras_ps.training.exact_evaluation": 4, "keras_ps.training": 5,
    "keras_ps.callbacks": 6, "keras_ps.sidecar": 6, "keras_ps.evaluator": 7,
    "keras_ps.demo": 7, "keras_ps": 8,
}
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


def _layer(module):
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")),
               key=len)
    return LAYERS[best]


def test_imports_flow_down_the_layers_without_cycles():
    modules = _modules()
    graph, misplaced, lazy_found = {}, [], []
    for module, path in modules.items():
        top, lazy = _imports(path, modules)
        graph[module] = {m for m in top if m != module}
        for target in graph[module]:
            # A package's __init__ re-exports its own modules.
            if target.startswith(module + "."):
                continue
            if _layer(target) > _layer(module):
                misplaced.append(f"{module} -> {target}")
        if lazy and os.path.relpath(path, REPO) not in LAZY_IMPORTS_ALLOWED:
            lazy_found.append(f"{module}: {sorted(lazy)}")
    assert not misplaced, misplaced
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
