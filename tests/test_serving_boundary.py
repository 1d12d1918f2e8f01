"""The boundary between the paged cache and the code around it: no module under gaac/ other than the cache's
own reads a private name of a :class:`gaac.PagedKVCache`.

The serving loop (:mod:`gaac.serving`) and everything else reach the cache through its public storage
interface (the class docstring, docs/design/serving.md).  The check reads the source with :mod:`ast`: the
cache's private names are those the modules of the ``gaac/cache/`` package give ``PagedKVCache`` and the
classes it is made from there (methods, properties, class attributes, and every ``self._name`` they
assign), and a module outside the package breaks the boundary where it reads one of them as an attribute
of anything but ``self``/``cls``.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "gaac" / "cache"
# The cache's own modules (its update transaction, its side of a transfer) reach into its storage; every other
# module, gaac/transfer.py included, keeps to the public interface.
ALLOWED = {path.relative_to(ROOT).as_posix() for path in CACHE.glob("*.py")}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cache_sources() -> list[str]:
    """The text of every module of the gaac/cache/ package."""
    return [path.read_text() for path in sorted(CACHE.glob("*.py"))]


def cache_private_names(sources: list[str]) -> set[str]:
    """The private names ``PagedKVCache`` has in ``sources`` (the text of the gaac/cache/ modules): its own and
    those of the classes it derives from that the same modules define."""
    classes = {node.name: node for source in sources for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef)}
    names, todo, seen = set(), ["PagedKVCache"], set()
    while todo:
        cls = classes[todo.pop()]
        seen.add(cls.name)
        todo += [base.id for base in cls.bases if isinstance(base, ast.Name) and base.id in classes
                 and base.id not in seen]
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return {name for name in names if _is_private(name)}


def private_reads(source: str, private: set[str], filename: str = "<source>") -> list[str]:
    """``file:line: expr._name`` for each read (or write) of one of ``private`` on anything but self or cls."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            out.append(f"{filename}:{node.lineno}: {ast.unparse(owner)}.{node.attr}")
    return out


def test_the_cache_has_private_names_to_guard():
    private = cache_private_names(cache_sources())
    # names the serving loop once read, and ones it must keep away from
    assert {"_store", "_lens", "_seq_lens", "_to_device", "_check_seqs", "_flush_due", "_encoder"} <= private
    # the update transaction's, which the cache derives from gaac/cache/update.py
    assert {"_apply", "_prepare", "_reserve", "_commit", "_publish"} <= private
    assert "stores" not in private and "host_lengths" not in private


def test_the_check_finds_a_private_read():
    """The scan flags a module that reads the cache's privates (and not one that reads its own)."""
    private = cache_private_names(cache_sources())
    bad = "def f(cache, plan):\n    x = cache._lens[0]\n    plan.cache._store[0][0].tail\n    cache._lens[0] += 1\n"
    assert sorted(private_reads(bad, private, "bad.py")) == ["bad.py:2: cache._lens", "bad.py:3: plan.cache._store",
                                                             "bad.py:4: cache._lens"]
    good = "class A:\n    def f(self, cache):\n        self._lens = cache.host_lengths\n        return self._store\n"
    assert private_reads(good, private) == []


def test_no_module_outside_the_cache_reads_its_private_names():
    private = cache_private_names(cache_sources())
    found = []
    for path in sorted((ROOT / "gaac").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        found += private_reads(path.read_text(), private, rel)
    assert not found, "modules read private names of PagedKVCache (use its storage interface):\n" + "\n".join(found)
