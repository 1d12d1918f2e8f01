"""Exponent histograms with the calibrated windows: does the calibration fit the cache?

A calibration gives every (head, channel) its own 8- and 16-wide exponent
window, so one histogram per layer would hide what matters.  Each panel is a
layer's histogram per channel instead: x is the channel (heads side by side),
y the exponent, colour the count (log scale); the 16-wide window is the light
band with orange edges and the 8-wide window the dark band with red edges
inside it.  Exponents outside both
bands are the raw-mode groups' cause.  Needs matplotlib (``pip install 'gaac[plot]'``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import layout as L
from .calibration import Calibration, exponent_histograms
from .errors import InputError

MAX_LAYERS = 8      # panels per kind; more layers are sampled evenly
MARGIN = 4          # exponents shown beyond the outermost window


def shown_layers(layers: int, max_layers: int = MAX_LAYERS) -> list[int]:
    """All layers when they fit, else ``max_layers`` evenly spaced ones, first and last included."""
    if layers <= max_layers:
        return list(range(layers))
    return sorted({int(round(i)) for i in np.linspace(0, layers - 1, max_layers)})


def window_coverage(hist: np.ndarray, base: np.ndarray, width: int) -> float:
    """Fraction of the counts ``hist[..., 256]`` inside ``[base, base + width)`` of their own channel."""
    e = np.arange(256)
    inside = (e >= base[..., None]) & (e < base[..., None] + width)
    return float((hist * inside).sum() / hist.sum())


def check_plot_path(path) -> None:
    """Raise :class:`InputError` unless matplotlib is installed and can write ``path``'s image type.

    The ``gaac`` command checks its ``--plot`` path with this before any work, so that a
    misspelt extension costs a second, not a whole measurement and a traceback."""
    try:
        import matplotlib
    except ImportError as exc:
        raise InputError("--plot needs matplotlib: pip install 'gaac[plot]'") from exc
    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    types = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in types:
        raise InputError(f"--plot {path}: {'no' if not suffix else 'unknown'} image type "
                         f"{'(no extension)' if not suffix else repr('.' + suffix)}; name the file .png or one of "
                         f"{', '.join('.' + t for t in sorted(types))}")


def plot_windows(k: np.ndarray, v: np.ndarray, calibration: Calibration, path, *, layer_ids=None,
                 title: str = "") -> list[int]:
    """Write the figure to ``path`` (its extension says the image type); return the indices of the layers drawn."""
    check_plot_path(path)
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    layers = shown_layers(k.shape[0])
    ids = list(range(k.shape[0])) if layer_ids is None else list(layer_ids)
    heads, dim = k.shape[1], k.shape[3]
    x = np.arange(heads * dim)
    fig, axes = plt.subplots(len(layers), 2, figsize=(13, 2.6 * len(layers) + 0.8), squeeze=False,
                             sharex=True, constrained_layout=True)
    for col, (kind, name, cache) in enumerate(((L.KIND_K, "K", k), (L.KIND_V, "V", v))):
        hist = exponent_histograms(cache[layers])                              # [n, heads, dim, 256]
        for row, layer in enumerate(layers):
            ax = axes[row, col]
            h = hist[row].reshape(heads * dim, 256)
            b3, b4 = (b.reshape(-1).astype(int) for b in calibration.bases(layer, kind))
            lo = max(int(b4.min()) - MARGIN, 0)
            hi = min(int(b4.max()) + L.WINDOW_4BIT + MARGIN, 256)
            image = np.ma.masked_equal(h[:, lo:hi].T, 0)
            mesh = ax.pcolormesh(np.arange(heads * dim + 1) - 0.5, np.arange(lo, hi + 1) - 0.5, image,
                                 cmap="viridis", norm=LogNorm(vmin=1, vmax=max(int(h.max()), 2)),
                                 shading="flat")
            for base, width, shade, edge in ((b4, L.WINDOW_4BIT, 0.10, "tab:orange"),
                                             (b3, L.WINDOW_3BIT, 0.20, "red")):
                ax.fill_between(x, base - 0.5, base + width - 0.5, step="mid", color="black", alpha=shade,
                                linewidth=0)
                for y in (base - 0.5, base + width - 0.5):
                    ax.step(x, y, where="mid", color=edge, linewidth=0.7)
            for head in range(1, heads):
                ax.axvline(head * dim - 0.5, color="white", linewidth=0.8)
            outside = int(h[:, :lo].sum() + h[:, hi:].sum())
            c3 = window_coverage(h, b3, L.WINDOW_3BIT)
            c4 = window_coverage(h, b4, L.WINDOW_4BIT)
            ax.set_title(f"layer {ids[layer]} {name}: {100 * c3:.1f}% in 8-window, {100 * c4:.2f}% in 16-window"
                         + (f", {outside} below/above view" if outside else ""), fontsize=9)
            ax.set_ylabel("exponent")
            ax.set_xlim(-0.5, heads * dim - 0.5)
            fig.colorbar(mesh, ax=ax, pad=0.01, label="count")
    for ax in axes[-1]:
        ax.set_xlabel(f"channel (heads of {dim} side by side)")
    sampled = f"{len(layers)} of {k.shape[0]} layers shown; " if len(layers) < k.shape[0] else ""
    fig.suptitle((title + "\n" if title else "") + sampled + "exponent counts per channel (colour); "
                 "8-wide window: red edges, dark band; 16-wide window: orange edges, light band", fontsize=10)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return layers
