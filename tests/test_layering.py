"""The layers of the gaac package, read from its import graph: each rule below is a test here that fails
where the source breaks it, and each rule's checker is tried on a graph or files made up here too.

1. No import cycles among gaac's modules: the graph's modules stand on levels, each importing only
   modules below it.
2. ``gaac.format`` reads and writes the sequence container with NumPy alone: neither it nor any module
   it reaches through the graph imports torch or numba, at import time or inside a function.  The
   exceptions (:data:`LAZY_TORCH`) import torch inside a function that runs only for a torch tensor the
   caller passes, so torch is loaded already.  tests/test_format.py checks the import-time half again by
   importing ``gaac.format`` in a fresh interpreter.
3. The serving loop sits above the kernels, the container format, the cache and attention: only
   ``gaac.serving``'s own modules and the integrations and command line above it (:data:`SERVING_USERS`:
   the package's ``__init__``, ``gaac.hf``, ``gaac.lmcache``, ``gaac.cli``, ``gaac.capture``) import
   ``gaac.serving``.  The cache below it holds the loop's state and calls the entry points the loop
   registers when it is imported (:mod:`gaac.cache.hooks`), so it imports none of it.
4. Nothing shipped or tested leans on research code: no module under gaac/ or tests/ imports
   ``benchmarks`` or ``studies``.

The graph is read from the source with :mod:`ast`, not by importing: a node per module under gaac/ (a
package is its ``__init__``), an arrow per module another one imports -- at the top of the file or inside a
function, relative imports resolved, ``from package import submodule`` counted as an arrow to the
submodule, ``importlib.import_module("gaac.x")`` with a literal name counted as an import.  A lazy import
inside a function is an arrow like any other: it is still a dependency, and two modules that reach each
other that way are a cycle.

Run as a script it prints the graph's numbers (modules, import levels, arrows, cycles)::

    python tests/test_layering.py            # the numbers
    python tests/test_layering.py --arrows   # and every arrow, level by level
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gaac"
FORBIDDEN = ("benchmarks", "studies")      # research code: gaac and its tests never import it
IMPORT_CALLS = ("importlib.import_module", "import_module", "__import__")   # with a literal name: an arrow too

FORMAT = "gaac.format"
FORMAT_BANNED = ("torch", "numba")         # what a reader of the container never needs
LAZY_TORCH = {
    # as_bits takes a torch tensor as well as NumPy bits: torch is imported once type(x) says it is one.
    "gaac.arrays": "a torch tensor the caller passes (as_bits)",
    # exponent_fields and fit_windows take a torch tensor of bits as well as NumPy bits, and fit on its device.
    "gaac.calibration": "a torch tensor the caller passes (exponent_fields, fit_windows)",
}
"""Modules reached from ``gaac.format`` that import torch inside a function, and for what: the one way a
module of rule 2 may name torch.  An import at module level is never excused."""

SERVING = "gaac.serving"
SERVING_USERS = ("gaac", "gaac.hf", "gaac.lmcache", "gaac.cli", "gaac.capture")


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name of the module at ``path`` (``gaac/cuda/__init__.py`` -> ``gaac.cuda``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, name: str, is_package: bool, modules=frozenset()) -> set[str]:
    """Every dotted name module ``name`` imports, anywhere in ``tree`` (top level and inside functions), with
    relative imports resolved.  ``from X import a``: ``X.a`` where that is one of ``modules`` (a submodule),
    else ``X``."""
    return {imported for imported, _ in scoped_imports(tree, name, is_package, modules)}


def scoped_imports(tree: ast.AST, name: str, is_package: bool, modules=frozenset()) -> set[tuple[str, bool]]:
    """``(dotted name, inside a function)`` for every import in module ``name``'s ``tree``, named as
    :func:`imported_names` names them.  Inside a function (or a lambda) is an import that runs when it is
    called; anywhere else -- the top level, a class body, an ``if`` or ``try`` at the top -- runs when the
    module is imported."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    out = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            out.update((imported, in_function) for imported in _names_of(child, package, modules))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def _names_of(node: ast.AST, package: list[str], modules) -> list[str]:
    """The dotted names one node imports: an ``import``, a ``from ... import``, or a call of one of
    :data:`IMPORT_CALLS` with a literal name; none for any other node."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            base = ".".join(base + ([node.module] if node.module else []))
        else:
            base = node.module
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str) and _call_name(node.func) in IMPORT_CALLS:
        return [node.args[0].value]        # importlib.import_module("gaac.x"): an import by another name
    return []


def _call_name(func: ast.expr) -> str:
    """``importlib.import_module`` / ``import_module`` / ``__import__`` as called, else ''."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` for every module under ``root / package``."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        names = imported_names(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", files)
        graph[name] = {n for n in names if n in files and n != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (or a module importing
    itself), each sorted, in sorted order: every cycle of the graph lies inside one of them (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the first module of ``component`` (a strongly connected component), as the modules
    along it, the first repeated at the end: what a failure names."""
    start, members = component[0], set(component)
    paths, seen = {start: [start]}, {start}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in seen:
                seen.add(w)
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise ValueError(f"{component} is not a cycle of the graph")


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's import level: 0 for a module that imports none of the package, else one more than the
    highest level it imports.  The modules of a cycle share one level (the graph's condensation is layered)."""
    component_of = {v: tuple(c) for c in cycles(graph) for v in c}
    level: dict[str, int] = {}

    def of(v: str, active: frozenset) -> int:
        if v in level:
            return level[v]
        members = component_of.get(v, (v,))
        below = {w for m in members for w in graph[m]} - set(members)
        value = max((of(w, active | set(members)) + 1 for w in below), default=0)
        for m in members:
            level[m] = value
        return value

    for v in sorted(graph):
        of(v, frozenset())
    return level


def numbers(graph: dict[str, set[str]]) -> dict:
    """Modules, import levels, arrows and cycles of ``graph``."""
    lv = levels(graph)
    return {"modules": len(graph), "levels": 1 + max(lv.values(), default=-1),
            "arrows": sum(len(v) for v in graph.values()), "cycles": len(cycles(graph))}


def forbidden_imports(root: Path = ROOT) -> list[str]:
    """``path: name`` for each import of benchmarks or studies in a module under gaac/ or tests/."""
    out = []
    for path in sorted([*(root / PACKAGE).rglob("*.py"), *(root / "tests").rglob("*.py")]):
        name = module_name(path, root)
        for imported in sorted(imported_names(ast.parse(path.read_text(), str(path)), name,
                                              path.name == "__init__.py")):
            if imported.split(".")[0] in FORBIDDEN:
                out.append(f"{path.relative_to(root)}: {imported}")
    return out


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """``start`` and every module it imports, directly or through others."""
    seen, stack = set(), [start]
    while stack:
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            stack.extend(graph.get(v, ()))
    return seen


def outside_imports(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[tuple[str, bool]]]:
    """``{module: {(dotted name, inside a function)}}``: what each module under ``root / package`` imports
    from outside the package (:func:`scoped_imports`)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        name = module_name(path, root)
        found = scoped_imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py")
        out[name] = {(n, inside) for n, inside in found if n.split(".")[0] != package}
    return out


def banned_imports(graph: dict[str, set[str]], imports: dict[str, set[tuple[str, bool]]], start: str,
                   banned=FORMAT_BANNED, lazy_allowed=LAZY_TORCH) -> list[str]:
    """``module: name (at import | in a function)`` for each import of a ``banned`` package by ``start`` or a
    module it reaches in ``graph``, except one inside a function of a module in ``lazy_allowed``."""
    out = []
    for module in sorted(reached(graph, start)):
        for name, inside in sorted(imports.get(module, ())):
            if name.split(".")[0] in banned and not (inside and module in lazy_allowed):
                out.append(f"{module}: {name} ({'in a function' if inside else 'at import'})")
    return out


def covers(entry: str, module: str) -> bool:
    """Whether ``entry`` of a rule's list names ``module``: itself, or a submodule of it -- except that a
    top-level name (the package's ``__init__``) names itself alone."""
    return module == entry or ("." in entry and module.startswith(entry + "."))


def imports_into(graph: dict[str, set[str]], target: str, allowed=()) -> list[str]:
    """``importer -> imported`` for each arrow into ``target`` or a submodule of it from a module that is
    neither inside ``target`` nor named by ``allowed`` (:func:`covers`)."""
    return [f"{v} -> {w}" for v in sorted(graph) for w in sorted(graph[v])
            if covers(target, w) and not covers(target, v) and not any(covers(a, v) for a in allowed)]


# ----------------------------------------------------------------------------------------------
# The rules on gaac itself.

def test_gaac_has_no_import_cycles():
    graph = import_graph()
    found = [" -> ".join(cycle_path(graph, c)) for c in cycles(graph)]
    assert not found, "import cycles among gaac's modules (lazy imports count):\n  " + "\n  ".join(found)


def test_gaac_format_reaches_no_torch_and_no_numba():
    found = banned_imports(import_graph(), outside_imports(), FORMAT)
    assert not found, (f"{FORMAT} or a module it imports imports {' or '.join(FORMAT_BANNED)} (LAZY_TORCH names "
                       "the imports in a function it allows):\n  " + "\n  ".join(found))


def test_only_the_integrations_import_the_serving_loop():
    found = imports_into(import_graph(), SERVING, SERVING_USERS)
    assert not found, (f"{SERVING} imported from below it (only {', '.join(SERVING_USERS)} and its own modules "
                       "import it):\n  " + "\n  ".join(found))


def test_gaac_and_its_tests_do_not_import_benchmarks_or_studies():
    found = forbidden_imports()
    assert not found, "research code imported by the package or its tests:\n  " + "\n  ".join(found)


# ----------------------------------------------------------------------------------------------
# The finders themselves, on graphs and files made up here: each rule can fail.

def test_cycle_finder_names_each_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set(), "g": {"g"}}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"], ["g"]]
    assert cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert cycle_path(graph, ["d", "e"]) == ["d", "e", "d"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_levels_and_numbers():
    dag = {"top": {"mid", "low"}, "mid": {"low"}, "low": set()}
    assert levels(dag) == {"top": 2, "mid": 1, "low": 0}
    assert numbers(dag) == {"modules": 3, "levels": 3, "arrows": 3, "cycles": 0}
    looped = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"a"}}
    assert levels(looped) == {"a": 1, "b": 1, "c": 0, "d": 2}


def test_graph_reads_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .low import x\n")
    (pkg / "low.py").write_text("def f():\n    from .high import y\n    return y\n")
    (pkg / "high.py").write_text("from . import low\nfrom .sub import deep\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("import pkg.low\nfrom ..high import z\n")
    (pkg / "sub" / "named.py").write_text("import importlib\ndef f():\n    return importlib.import_module('pkg')\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.low"}, "pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low", "pkg.sub.deep"},
                     "pkg.sub": set(), "pkg.sub.deep": {"pkg.low", "pkg.high"}, "pkg.sub.named": {"pkg"}}
    assert cycles(graph) == [["pkg.high", "pkg.low", "pkg.sub.deep"]]


def test_forbidden_finder_sees_imports_in_functions(tmp_path):
    (tmp_path / PACKAGE).mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_x.py").write_text("def test():\n    from benchmarks.real_kv import f\n")
    assert forbidden_imports(tmp_path) == ["tests/test_x.py: benchmarks.real_kv"]


def test_scoped_imports_tell_import_time_from_a_call(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "m.py").write_text(
        "import numpy\nimport torch.nn as nn\ntry:\n    import numba\nexcept ImportError:\n    numba = None\n"
        "class C:\n    from llvmlite import ir\n    def f(self):\n        from torch import cuda\n"
        "def g():\n    return lambda: __import__('numba.cuda')\n"
        "async def h():\n    from . import low\n")
    assert outside_imports(tmp_path, "pkg") == {
        "pkg": set(),
        "pkg.m": {("numpy", False), ("torch.nn", False), ("numba", False), ("llvmlite", False), ("torch", True),
                  ("numba.cuda", True)}}
    tree = ast.parse((tmp_path / "pkg" / "m.py").read_text())
    assert ("pkg", True) in scoped_imports(tree, "pkg.m", False)


def test_banned_finder_follows_the_graph_and_excuses_only_lazy_imports():
    graph = {"p.format": {"p.a"}, "p.a": {"p.b"}, "p.b": set(), "p.c": {"p.format"}}
    imports = {"p.format": {("numpy", False)}, "p.a": {("numba.cuda", True), ("zlib", False)},
               "p.b": {("torch", False)}, "p.c": {("torch", False)}}
    assert reached(graph, "p.format") == {"p.format", "p.a", "p.b"}
    assert banned_imports(graph, imports, "p.format", ("torch", "numba"), {}) == [
        "p.a: numba.cuda (in a function)", "p.b: torch (at import)"]
    assert banned_imports(graph, imports, "p.format", ("torch", "numba"), {"p.a": "why"}) == ["p.b: torch (at import)"]
    assert banned_imports(graph, imports, "p.format", ("torch", "numba"), {"p.a": "", "p.b": ""}) == [
        "p.b: torch (at import)"]                     # an import at module level is never excused
    assert banned_imports(graph, imports, "p.b", ("numba",), {}) == []


def test_importer_finder_names_arrows_from_below():
    graph = {"p": {"p.serving"}, "p.serving": {"p.serving.plan"}, "p.serving.plan": {"p.kernels"},
             "p.kernels": set(), "p.cache": {"p.serving.plan"}, "p.cache.paged": {"p.serving"},
             "p.cache_x": {"p.serving.plan"}, "p.hf": {"p.serving"}, "p.hf.sub": {"p.serving.plan"},
             "p.attention": {"p.kernels"}, "p.format": {"p.serving_like"}, "p.serving_like": set()}
    assert imports_into(graph, "p.serving") == [
        "p -> p.serving", "p.cache -> p.serving.plan", "p.cache.paged -> p.serving", "p.cache_x -> p.serving.plan",
        "p.hf -> p.serving", "p.hf.sub -> p.serving.plan"]
    assert imports_into(graph, "p.serving", ("p", "p.hf", "p.cache")) == ["p.cache_x -> p.serving.plan"]
    assert covers("p", "p") and not covers("p", "p.cache") and covers("p.cache", "p.cache.paged")
    assert not covers("p.cache", "p.cache_x")


def main(argv: list[str]) -> None:
    graph = import_graph()
    n = numbers(graph)
    print(f"{n['modules']} modules on {n['levels']} import levels, {n['arrows']} arrows, {n['cycles']} cycles")
    for c in cycles(graph):
        print("  cycle: " + " -> ".join(cycle_path(graph, c)))
    if "--arrows" in argv:
        lv = levels(graph)
        for level in range(n["levels"]):
            for v in sorted(m for m in graph if lv[m] == level):
                print(f"{level:3d} {v}: {', '.join(sorted(graph[v]))}")


if __name__ == "__main__":
    main(sys.argv[1:])
