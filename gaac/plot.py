"""Exponent histograms with the calibrated windows: does the calibration fit the cache?

A calibration gives every (head, channel) its own narrow and wide exponent
window (8 and 16 exponents wide for BF16; FP8's widths are its mode set's),
so one histogram per layer would hide what matters.  Each panel is a layer's
histogram per channel instead: x is the channel (heads side by side), y the
exponent field, colour the count (log scale); the wide window is the light
band with orange edges and the narrow window the dark band with red edges
inside it.  Exponents outside both bands are the raw-mode groups' cause.  An
FP8 calibration draws the exponent fields of the cache converted to FP8 with
its scales.  A figure holds at most ``MAX_LAYERS`` layers; more layers are
drawn on several pages, one file each.  Needs matplotlib (``pip install
'gaac[plot]'``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .calibration import exponent_histograms
from .errors import InputError
from .io import check_output_file, write_files

MAX_LAYERS = 8      # layers per figure (page); by default this many, evenly spaced, are drawn
MARGIN = 4          # exponents shown beyond the outermost window


def shown_layers(layers: int, max_layers: int = MAX_LAYERS) -> list[int]:
    """All layers when they fit, else ``max_layers`` evenly spaced ones, first and last included."""
    if layers <= max_layers:
        return list(range(layers))
    return sorted({int(round(i)) for i in np.linspace(0, layers - 1, max_layers)})


def parse_layers(text: str, layer_ids: list[int]) -> list[int]:
    """``--plot-layers``: ``all``, or layer numbers and ranges such as ``0,5,10-12``, as the cache names its
    layers (``layer_ids``) -> indices into the cache, in the order of ``layer_ids``."""
    if text.strip().lower() == "all":
        return list(range(len(layer_ids)))
    wanted = set()
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        try:
            first, last = int(a), int(b or a)
        except ValueError:
            raise InputError(f"--plot-layers {text!r}: expected 'all' or layer numbers and ranges, "
                             "e.g. 0,5,10-12") from None
        if first > last:
            raise InputError(f"--plot-layers {text!r}: range {part.strip()} runs backwards")
        wanted.update(range(first, last + 1))
    missing = sorted(wanted - set(layer_ids))
    if missing:
        raise InputError(f"--plot-layers: the cache has no layer {missing[0]} (its layers: "
                         f"{_ranges(layer_ids)})")
    return [i for i, layer in enumerate(layer_ids) if layer in wanted]


def _ranges(ids: list[int]) -> str:
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def page_paths(path, pages: int) -> list[Path]:
    """``path`` itself for one page, else ``stem-1.png``, ``stem-2.png``, ... beside it."""
    path = Path(path)
    if pages <= 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(1, pages + 1)]


def window_coverage(hist: np.ndarray, base: np.ndarray, width: int) -> float:
    """Fraction of the counts ``hist[..., bins]`` inside ``[base, base + width)`` of their own channel."""
    e = np.arange(hist.shape[-1])
    inside = (e >= base[..., None]) & (e < base[..., None] + width)
    return float((hist * inside).sum() / hist.sum())


@dataclass
class _Windows:
    """What one kind's panels show: exponent histograms, the bases of both windows and their widths."""

    hist: np.ndarray             # [layers drawn, heads, head_dim, bins]
    narrow: list                 # per layer drawn: bases [heads, head_dim]
    wide: list
    narrow_width: int
    wide_width: int


def _windows(caches, calibration, layers) -> tuple[list[_Windows], str]:
    """Per kind, the histograms and windows of ``layers``; and the element format's name."""
    modes = calibration.modes
    out = []
    for kind, x in enumerate(caches):
        elements = x[layers]
        if calibration.scale_log2 is not None:      # an FP8 calibration: the cache it codes is the converted one
            from .fp8.convert import cache_to_fp8

            elements = cache_to_fp8(elements, modes.fmt, calibration.scale_log2[kind][layers])
        out.append(_Windows(exponent_histograms(elements, modes.fmt),
                            *zip(*(calibration.bases(layer, kind) for layer in layers)),
                            modes.narrow_window, modes.wide_window))
    return out, calibration.format.name.upper().replace("_", " ")


def check_plot_path(path) -> None:
    """Raise :class:`InputError` unless matplotlib is installed and can write ``path``'s image type, and
    ``path`` is a file that can be written (its folder exists; it is not a directory or a device).

    The ``gaac`` command checks its ``--plot`` path with this before any work, so that a
    misspelt extension or folder costs a second, not a whole measurement and a traceback."""
    check_output_file(path, "--plot")
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


def plot_windows(k: np.ndarray, v: np.ndarray, calibration, path, *, layer_ids=None, title: str = "",
                 layers=None) -> list[tuple[Path, list[int]]]:
    """Write the figure(s) to ``path`` (PNG): ``layers`` (indices into the cache; default: at most
    ``MAX_LAYERS`` evenly spaced), ``MAX_LAYERS`` per page.  ``calibration`` is a
    :class:`gaac.Calibration` of any element format.  Returns each file written
    with the indices of the layers it draws."""
    check_plot_path(path)
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    layers = shown_layers(k.shape[0]) if layers is None else list(layers)
    ids = list(range(k.shape[0])) if layer_ids is None else list(layer_ids)
    heads, dim = k.shape[1], k.shape[3]
    x = np.arange(heads * dim)
    pages = [layers[i:i + MAX_LAYERS] for i in range(0, len(layers), MAX_LAYERS)]
    written = []
    for page, (out, drawn) in enumerate(zip(page_paths(path, len(pages)), pages), start=1):
        kinds, element = _windows((k, v), calibration, drawn)
        fig, axes = plt.subplots(len(drawn), 2, figsize=(13, 2.6 * len(drawn) + 0.8), squeeze=False,
                                 sharex=True, constrained_layout=True)
        for col, (name, w) in enumerate(zip("KV", kinds)):
            bins = w.hist.shape[-1]
            for row, layer in enumerate(drawn):
                ax = axes[row, col]
                h = w.hist[row].reshape(heads * dim, bins)
                narrow, wide = (b.reshape(-1).astype(int) for b in (w.narrow[row], w.wide[row]))
                lo = max(int(wide.min()) - MARGIN, 0)
                hi = min(int(wide.max()) + w.wide_width + MARGIN, bins)
                image = np.ma.masked_equal(h[:, lo:hi].T, 0)
                mesh = ax.pcolormesh(np.arange(heads * dim + 1) - 0.5, np.arange(lo, hi + 1) - 0.5, image,
                                     cmap="viridis", norm=LogNorm(vmin=1, vmax=max(int(h.max()), 2)),
                                     shading="flat")
                for base, width, shade, edge in ((wide, w.wide_width, 0.10, "tab:orange"),
                                                 (narrow, w.narrow_width, 0.20, "red")):
                    ax.fill_between(x, base - 0.5, base + width - 0.5, step="mid", color="black", alpha=shade,
                                    linewidth=0)
                    for y in (base - 0.5, base + width - 0.5):
                        ax.step(x, y, where="mid", color=edge, linewidth=0.7)
                for head in range(1, heads):
                    ax.axvline(head * dim - 0.5, color="white", linewidth=0.8)
                outside = int(h[:, :lo].sum() + h[:, hi:].sum())
                cn = window_coverage(h, narrow, w.narrow_width)
                cw = window_coverage(h, wide, w.wide_width)
                ax.set_title(f"layer {ids[layer]} {name}: {100 * cn:.1f}% in {w.narrow_width}-window, "
                             f"{100 * cw:.2f}% in {w.wide_width}-window"
                             + (f", {outside} below/above view" if outside else ""), fontsize=9)
                ax.set_ylabel("exponent")
                ax.set_xlim(-0.5, heads * dim - 0.5)
                fig.colorbar(mesh, ax=ax, pad=0.01, label="count")
        for ax in axes[-1]:
            ax.set_xlabel(f"channel (heads of {dim} side by side)")
        shown = f"layers {', '.join(str(ids[i]) for i in drawn)} of {k.shape[0]}"
        if len(pages) > 1:
            shown += f" (page {page} of {len(pages)})"
        fig.suptitle((title + "\n" if title else "") + f"{element} {shown}; exponent counts per channel "
                     f"(colour); {kinds[0].narrow_width}-wide window: red edges, dark band; "
                     f"{kinds[0].wide_width}-wide window: orange edges, light band", fontsize=10)
        # through a temporary file (gaac.io.write_files): a failed write leaves no half-written image
        write_files([("--plot", out, lambda f: fig.savefig(f, dpi=90, format=out.suffix.lstrip(".").lower()))])
        plt.close(fig)
        written.append((out, drawn))
    return written
