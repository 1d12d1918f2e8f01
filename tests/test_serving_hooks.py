"""The cache reaches the serving loop above it only through the entry points the loop registers
(:mod:`gaac.cache.hooks`): ``update_layer``'s one-token append outside a plan and ``decode_plan`` call what
:mod:`gaac.serving` registered when it was imported; until then the cache has the package ``gaac``'s loader
import it on first need, and with no loader ``update_layer`` takes its general path (the same tokens) and
``decode_plan`` refuses, naming the module to import.  tests/test_layering.py checks the same from the source:
no module of the cache imports ``gaac.serving``.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch
from test_cache import synthetic

from gaac.cache import PagedKVCache, hooks
from gaac.calibration import calibrate

ROOT = Path(__file__).resolve().parent.parent

# A cache of one layer with one sequence, one token short of its first block end: the next token appended takes
# the one-token path, the one after it finishes the block.
SETUP = """
    import sys
    import numpy as np
    import torch
    from gaac.cache import hooks
    from gaac.cache.paged import PagedKVCache
    from gaac.calibration import calibrate
    from gaac.errors import InputError

    rng = np.random.default_rng(5)
    K, V = (((rng.integers(118, 130, size=(1, 1, 24, 64)) << 7) | rng.integers(0, 128, size=(1, 1, 24, 64)))
            .astype(np.uint16) for _ in range(2))
    cache = PagedKVCache(calibrate(K, V), max_blocks=4, raw_tiles=64, codec="reference")
    seq = cache.add_sequence(K[:, :, :14], V[:, :, :14])

    def token(pos):
        return tuple(torch.from_numpy(np.ascontiguousarray(x[:, :, pos:pos + 1]).view(np.int16)) for x in (K, V))

    def holds(n):
        k, v = cache.read(seq)
        assert np.array_equal(k, K[:, :, :n]) and np.array_equal(v, V[:, :, :n]), n

    assert "gaac.serving" not in sys.modules, "making and filling a cache imported the serving loop"
"""


def run_alone(script: str) -> str:
    """Run :data:`SETUP` then ``script`` in a fresh interpreter; fail with its output unless it exits 0."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_importing_the_serving_loop_registers_its_entry_points():
    from gaac.serving import append, plan

    assert hooks.append_token is append.append_token
    assert hooks.step_plan is plan.StepPlan


def test_update_layer_and_decode_plan_call_the_registered_entry_points(monkeypatch):
    """What ``hooks`` holds at the call is what runs: a stand-in registered there sees the cache's calls."""
    rng = np.random.default_rng(3)
    k, v = synthetic(rng, 1, 1, 20, 64), synthetic(rng, 1, 1, 20, 64)
    cache = PagedKVCache(calibrate(k, v), max_blocks=4, raw_tiles=64, codec="reference")
    seq = cache.add_sequence(k[:, :, :3], v[:, :, :3])
    appended, planned = [], []
    real = hooks.append_token

    def append_token(c, layer, seqs, kn, vn):
        appended.append((c, layer, list(seqs)))
        return real(c, layer, seqs, kn, vn)

    def step_plan(c, q_heads, **options):
        planned.append((c, q_heads, options))
        return "plan"

    monkeypatch.setattr(hooks, "append_token", append_token)
    monkeypatch.setattr(hooks, "step_plan", step_plan)
    kn, vn = (torch.from_numpy(np.ascontiguousarray(x[:, :, 3:4]).view(np.int16)) for x in (k, v))
    cache.update_layer(0, [seq], kn, vn)
    assert appended == [(cache, 0, [seq])]
    assert cache.seq_len(seq) == 4
    assert cache.decode_plan(2, seqs=[seq]) == "plan"
    assert planned == [(cache, 2, dict(append=1, seqs=[seq], scale=None, steps=None, bucket=None))]


def test_without_the_serving_loop_update_layer_takes_its_general_path_and_decode_plan_refuses():
    """A fresh interpreter whose cache has no loader: the one-token append is the general path's (same tokens,
    the serving loop still not imported), decode_plan is an InputError naming gaac.serving; importing it
    registers, and the plan and the one-token append are the serving loop's."""
    out = run_alone("""
        hooks.set_loader(None)
        cache.update_layer(0, [seq], *token(14))
        holds(15)
        assert "gaac.serving" not in sys.modules
        try:
            cache.decode_plan(1)
        except InputError as exc:
            assert "import gaac.serving" in str(exc), exc
        else:
            raise AssertionError("decode_plan planned with no serving loop registered")

        import gaac.serving
        from gaac.serving.plan import StepPlan
        assert hooks.step_plan is StepPlan
        plan = cache.decode_plan(1)
        assert type(plan) is StepPlan
        for pos in (15, 16):
            cache.update_layer(0, [seq], *token(pos))
        holds(17)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_loader_imports_the_serving_loop_on_first_need():
    """A fresh interpreter that made its cache from gaac.cache.paged alone: the first one-token append has the
    package's loader import gaac.serving, and decode_plan returns its StepPlan."""
    out = run_alone("""
        cache.update_layer(0, [seq], *token(14))
        holds(15)
        from gaac.serving.append import append_token
        assert hooks.append_token is append_token
        assert type(cache.decode_plan(1)).__name__ == "StepPlan"
        print("ok")
    """)
    assert out.strip() == "ok"
