"""harmpi's layers (issues 23 and 40).

``import harmpi`` imports harmpi and nothing else, and changes nothing of
the interpreter's: torch stays out of ``sys.modules`` unless the program
imported it, ``sys.exit`` and ``sys.excepthook`` stay Python's (also under
mpirun, where the launcher variables are set), and torch's rendezvous table
keeps torch's handlers.

The source reads top to bottom: every module belongs to one band of LAYERS
and imports (at the top or inside a function) only modules of its own band
or of bands below; no import cycle; no private name used across modules; no
module over MAX_LINES lines."""

import ast
import os
import subprocess
import sys

import pytest
from support import REPO
from support.jobs import job_env, job_limit_s, job_script

pytestmark = pytest.mark.timeout(300)

#: a fresh interpreter's view of ``import harmpi``
IMPORT_ONLY = """
import sys
exit0, hook0 = sys.exit, sys.excepthook
import harmpi
assert "torch" not in sys.modules, "import harmpi imported torch"
assert sys.exit is exit0, "import harmpi replaced sys.exit"
assert sys.excepthook is hook0, "import harmpi replaced sys.excepthook"
print("clean import", flush=True)
"""

#: torch first: ``import harmpi`` registers the backend; harmpi.distributed
#: registers mpi:// through torch's public call and leaves env:// as it was
TORCH_FIRST = """
import importlib
import torch, torch.distributed as dist
rendezvous = importlib.import_module("torch.distributed.rendezvous")  # (not dist.rendezvous)
env0 = rendezvous._rendezvous_handlers["env"]
import harmpi
assert "harmpi" in dist.Backend.backend_list, dist.Backend.backend_list
import harmpi.distributed
assert rendezvous._rendezvous_handlers["env"] is env0, "env:// was replaced"
assert "mpi" in rendezvous._rendezvous_handlers
print("registered", flush=True)
"""

HARMPI_DISTRIBUTED = """
import sys
import harmpi.distributed
import torch.distributed as dist
assert "harmpi" in dist.Backend.backend_list
print("registered", flush=True)
"""


def _singleton_env():
    env = job_env()
    for name in list(env):
        if name.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_")):
            del env[name]
    return env


@pytest.mark.parametrize("code, says", [(IMPORT_ONLY, "clean import"),
                                        (TORCH_FIRST, "registered"),
                                        (HARMPI_DISTRIBUTED, "registered")],
                         ids=["import-harmpi", "torch-first", "harmpi.distributed"])
def test_import_in_a_fresh_interpreter(code, says):
    proc = subprocess.run([sys.executable, "-c", code], env=_singleton_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and says in proc.stdout, proc.stderr[-3000:]


def test_import_harmpi_under_mpirun_changes_nothing(tmp_path):
    """The launcher's variables are set (mpirun -np 2): still no torch, no hooks."""
    argv, env, shm = job_script(tmp_path, IMPORT_ONLY)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                          timeout=job_limit_s(10))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("clean import") == 2, proc.stdout
    assert os.listdir(shm) == []


UNDER_THE_RUNNER = """
import sys
assert "torch" not in sys.modules, "the runner imported torch"
if sys.argv[1:] == ["torch"]:
    import torch, harmpi, torch.distributed as dist   # torch first, as a torchrun script
    assert "harmpi" in dist.Backend.backend_list, dist.Backend.backend_list
print("ran", *sys.argv[1:], flush=True)
"""


@pytest.mark.parametrize("arg", ["plain", "torch"])
def test_the_runner_imports_torch_only_when_the_program_does(tmp_path, arg):
    """``python -m harmpi.run`` imports harmpi first; a program that imports
    torch and then harmpi still gets the backend (registered after its
    ``import torch``), and one that never imports torch does not get it."""
    (tmp_path / "prog.py").write_text(UNDER_THE_RUNNER)
    proc = subprocess.run([sys.executable, "-m", "harmpi.run", str(tmp_path / "prog.py"), arg],
                          env=_singleton_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and f"ran {arg}" in proc.stdout, proc.stderr[-3000:]


# -- no import cycle ---------------------------------------------------------------

PACKAGE = os.path.join(REPO, "harmpi")


def _module_name(path):
    rel = os.path.relpath(path, REPO)[:-len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _modules(package=PACKAGE):
    """The module names of a package of the checkout (harmpi, bench) -> file paths."""
    found = {}
    for root, _dirs, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                found[_module_name(path)] = path
    return found


def _from_target(node, here):
    """The module a ``from ... import`` names (``here``: the importing
    module's package, as a list of names)."""
    if not node.level:
        return node.module or ""
    return ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))


def _imported(module, path, modules):
    """The harmpi modules ``module`` imports anywhere in its file (inside
    functions too), relative or absolute: ``from X import Y`` counts Y when
    Y is a module, else X."""
    is_package = path.endswith("__init__.py")
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, here)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif _imports_by_name(node):
            found.add(node.args[0].value)
    return {m for m in found if m in modules and m != module}


def _imports_by_name(node):
    """``importlib.import_module("harmpi.x")``: an import spelled as a call."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module" and len(node.args) == 1
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def _cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            on_stack.difference_update(part)
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_harmpi():
    modules = _modules()
    edges = {m: _imported(m, p, modules) for m, p in modules.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles (module -> what it imports within the cycle):\n" + "\n".join(
        f"  {m} -> {sorted(edges[m] & set(c))}" for c in cycles for m in c)


def test_no_import_cycle_in_bench():
    """bench/ too; its scripts run from bench/ import their siblings as
    top-level modules (``import vllm_model``), which count as bench's."""
    modules = _modules(os.path.join(REPO, "bench"))
    edges = {}
    for m, p in modules.items():
        found = _imported(m, p, modules)
        siblings = {f"bench.{name}" for name in _top_level_imports(p)}
        edges[m] = found | (siblings & set(modules)) - {m}
    cycles = _cycles(edges)
    assert not cycles, f"import cycles in bench/: {cycles}"


def _top_level_imports(path):
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def _dangling(modules):
    """(module, what it imports) for every relative import, inside functions
    too, that names no module of the package: an import a move left behind
    fails only when its line runs."""
    found = []
    for module, path in sorted(modules.items()):
        here = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _from_target(node, here)
                if target not in modules and not all(
                        f"{target}.{a.name}" in modules for a in node.names):
                    found.append((module, target))
    return found


def test_every_relative_import_names_a_module():
    assert not _dangling(_modules()), _dangling(_modules())


def test_the_dangling_import_check_finds_one(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..gone import x\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("")
    modules = {name.replace(str(tmp_path) + os.sep, "").replace(os.sep, "."): path
               for name, path in ((p[:-3] if not p.endswith("__init__.py") else
                                   os.path.dirname(p), p)
                                  for p in map(str, pkg.rglob("*.py")))}
    assert _dangling(modules) == [("p.sub.a", "p.gone")]


def test_the_cycle_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(edges) == [["a", "b", "c"]]


def test_the_import_reader_sees_lazy_imports(tmp_path):
    """An import inside a function, relative or absolute, or spelled
    importlib.import_module("..."), is an arrow like one at the top."""
    (tmp_path / "low.py").write_text(
        "def late():\n"
        "    from . import high\n"
        "    import pkg.other\n"
        "    importlib.import_module('pkg.third')\n")
    modules = {name: "" for name in ("pkg.low", "pkg.high", "pkg.other", "pkg.third")}
    assert _imported("pkg.low", str(tmp_path / "low.py"), modules) == {
        "pkg.high", "pkg.other", "pkg.third"}


# -- layers: the folders, bottom to top ----------------------------------------------

#: harmpi's bands, bottom first: a module belongs to the band of its longest
#: matching name (a package and its modules, or one module); it may import
#: its own band and the bands below, never one above
LAYERS = (
    ("errors, config, version: what every layer may name",
     ("harmpi.errors", "harmpi.config", "harmpi.version")),
    ("platform: OS, MPI and interpreter shims", ("harmpi.platform",)),
    ("base: dtypes, kind, control block, sync, arena, topology", ("harmpi.base",)),
    ("kernels, transports, profiling records",
     ("harmpi.reduce", "harmpi.transports", "harmpi.record")),
    ("node: compiled one-node steps", ("harmpi.node",)),
    ("algorithms", ("harmpi.algorithms",)),
    ("runtime: contexts, registry, compile, native", ("harmpi.runtime",)),
    ("the API", ("harmpi.api", "harmpi.args", "harmpi.logits", "harmpi.gatherdim", "harmpi.profile",
                 "harmpi.allreduce", "harmpi.allgather", "harmpi.alltoall", "harmpi._callable")),
    ("torch.distributed backend", ("harmpi.distributed",)),
    ("command lines", ("harmpi.cli", "harmpi.run", "harmpi.precompile", "harmpi.report",
                       "harmpi.tune")),
    ("the package: import harmpi", ("harmpi",)),
)


def _band(module, layers=LAYERS):
    """The index of ``module``'s band in ``layers``, or None."""
    best, band = "", None
    for i, (_what, names) in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, band = name, i
    return band


def _upward(edges, layers=LAYERS):
    """Every arrow from a module to one in a band above its own."""
    return sorted(f"{m} ({layers[_band(m, layers)][0]}) -> {n} ({layers[_band(n, layers)][0]})"
                  for m, targets in edges.items() for n in targets
                  if _band(n, layers) > _band(m, layers))


def test_every_module_has_a_band():
    missing = sorted(m for m in _modules() if _band(m) is None)
    assert not missing, f"modules in no band of LAYERS (add them where they belong): {missing}"


def test_no_import_runs_up_the_layers():
    modules = _modules()
    edges = {m: _imported(m, p, modules) for m, p in modules.items()}
    up = _upward(edges)
    assert not up, "imports from a lower layer to a higher one:\n  " + "\n  ".join(up)


def test_the_layer_check_finds_an_upward_import():
    layers = (("low", ("p.low",)), ("high", ("p.high", "p")))
    edges = {"p.low.a": {"p.high"}, "p.high": {"p.low.b"}, "p.low.b": set(), "p": {"p.low.a"}}
    assert _upward(edges, layers) == ["p.low.a (low) -> p.high (high)"]
    assert _band("p.low.b", layers) == 0 and _band("p.other", layers) == 1


# -- module size ----------------------------------------------------------------------

MAX_LINES = 600
#: the trees whose modules MAX_LINES bounds
SIZED = ("harmpi", "launch", "harmpi_vllm", "bench")


def _long_modules(root, limit=MAX_LINES):
    """(path relative to root, lines) of every .py file over ``limit`` lines."""
    found = []
    for tree in SIZED:
        for where, _dirs, files in os.walk(os.path.join(root, tree)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(where, name)
                    with open(path) as f:
                        lines = sum(1 for _ in f)
                    if lines > limit:
                        found.append((os.path.relpath(path, root), lines))
    return sorted(found)


def test_no_module_is_over_the_line_limit():
    long = [f"{path}: {n} lines" for path, n in _long_modules(REPO)]
    assert not long, f"modules over {MAX_LINES} lines (split them by concept):\n  " + \
        "\n  ".join(long)


def test_the_size_check_finds_a_long_module(tmp_path):
    (tmp_path / "harmpi").mkdir()
    (tmp_path / "harmpi" / "long.py").write_text("x = 1\n" * 601)
    (tmp_path / "harmpi" / "short.py").write_text("x = 1\n" * 600)
    assert _long_modules(str(tmp_path)) == [(os.path.join("harmpi", "long.py"), 601)]


def _private_uses(module, path, modules):
    """``from harmpi.X import _name`` and ``X._name`` (X a harmpi module
    imported as a name) in ``module``'s file: another module's private names."""
    is_package = path.endswith("__init__.py")
    here = module.split(".") if is_package else module.split(".")[:-1]
    tree = ast.parse(open(path).read(), path)
    bound, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(node, here)
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{target}.{alias.name}"
                elif target in modules and _private(alias.name):
                    found.append(f"from {target} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
    return found + _private_attributes(tree, bound)


def _private_attributes(tree, bound):
    """``X._name`` where X is a name ``bound`` to a harmpi module."""
    return [f"{bound[node.value.id]}.{node.attr} (line {node.lineno})"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in bound and _private(node.attr)]


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    found = [f"{m}: {use}" for m, p in sorted(modules.items())
             for use in _private_uses(m, p, modules)]
    assert not found, "private names used across modules:\n  " + "\n  ".join(found)
