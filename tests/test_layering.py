"""The import graph of the gaac package: no cycles, and nothing shipped or tested leans on benchmarks/ or studies/.

The graph is read from the source with :mod:`ast`, not by importing: a node per module under gaac/ (a
package is its ``__init__``), an arrow per module another one imports -- at the top of the file or inside a
function, relative imports resolved, ``from package import submodule`` counted as an arrow to the
submodule, ``importlib.import_module("gaac.x")`` with a literal name counted as an import.  A lazy import inside a function is an arrow like any other: it is still a dependency, and
two modules that reach each other that way are a cycle.

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
    package = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and _call_name(node.func) in IMPORT_CALLS:
            out.add(node.args[0].value)       # importlib.import_module("gaac.x"): an import by another name
    return out


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


# ----------------------------------------------------------------------------------------------
# The rules on gaac itself.

def test_gaac_has_no_import_cycles():
    graph = import_graph()
    found = [" -> ".join(cycle_path(graph, c)) for c in cycles(graph)]
    assert not found, "import cycles among gaac's modules (lazy imports count):\n  " + "\n  ".join(found)


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
