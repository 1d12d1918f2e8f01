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
