"""Progress bars for long work: tqdm on a terminal, silent in pipes and tests unless asked."""
from __future__ import annotations

import sys


def progress(iterable, *, desc: str, unit: str = "it", enable: bool | None = None, total: int | None = None):
    """Wrap ``iterable`` in a tqdm bar when ``enable`` (default: stderr is a terminal)."""
    if enable is None:
        enable = sys.stderr.isatty()
    if not enable:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit=unit, total=total, leave=False)


def bar(total: int, *, desc: str, unit: str = "it", enable: bool | None = None):
    """A tqdm bar of ``total`` steps that the caller advances (``.update(n)``, ``.close()``), or None when
    not ``enable`` (default: stderr is a terminal)."""
    if enable is None:
        enable = sys.stderr.isatty()
    if not enable:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)
