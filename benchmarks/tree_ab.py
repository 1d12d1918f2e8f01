"""``prefill_layers.py`` with the gaac of another tree: two trees side by side on a prompt's host path.

    python benchmarks/tree_ab.py path/to/tree -- --joins 8 --runs 4 --out /tmp/a.md
    python benchmarks/tree_ab.py .            -- --joins 8 --runs 4 --out /tmp/b.md

``tree`` is a folder holding a ``gaac`` package (``git archive <rev> gaac | tar -x -C <folder>`` makes one); it is
imported from there before ``prefill_layers.py`` runs with the arguments after ``--`` (its joins into a batch
and its 128K-token prompt), the benchmarks' helpers coming from this checkout.  Alternate the trees, a process
each, in one call of one machine: a host's speed moves a join by milliseconds between runs.
"""
import os
import runpy
import sys

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    raise SystemExit(__doc__)
tree = os.path.abspath(sys.argv[1])
rest = sys.argv[2:]
sys.path.insert(0, tree)
import gaac  # noqa: E402  (the tree's: prefill_layers.py's own import finds it loaded)

if not os.path.abspath(gaac.__file__).startswith(tree + os.sep):
    raise SystemExit(f"gaac came from {gaac.__file__}, not from {tree}")
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefill_layers.py")
sys.argv = [script] + (rest[1:] if rest[:1] == ["--"] else rest)
runpy.run_path(script, run_name="__main__")
