"""Hypothesis strategies for GAAC data: BF16 bit patterns, bases, calibrations and blocks.

Shared by the reference-codec tests and the kernel tests, so that every
implementation is exercised by the same inputs.

Importing.  ``tests/`` has no ``__init__.py`` and there is no pytest
configuration that changes the import mode, so pytest uses its default
``prepend`` mode: before importing ``tests/conftest.py`` and each
``tests/test_*.py`` it puts their folder (``tests/``) at the front of
``sys.path``.  In a test file write::

    from strategies import block_cases, bf16_bits

``python -m pytest`` (the README's test command) also puts the working
directory on ``sys.path``, so ``from tests.strategies import ...`` works from
the repository root as well; prefer the first form, which does not depend on
how pytest was started (both forms at once would load the module twice, which
is harmless but wasteful).  If someone switches pytest to
``--import-mode=importlib`` the first form breaks: add ``tests`` to
``pythonpath`` in the pytest configuration then.

Design.  Arrays come from a NumPy generator seeded by a drawn integer (fast
for thousands of elements), and Hypothesis then overwrites a few drawn
positions with drawn patterns -- any of the 65536, with the edge patterns of
:data:`EDGE_PATTERNS` offered explicitly -- so shrinking still reaches the
element that matters.  Modes are never left to chance where a test needs
them: :func:`forced_blocks` builds every group's exponents so that the
encoder must choose the mode the strategy drew (``case.modes``), and
:func:`overflow_blocks` picks a capacity that at least one tile exceeds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from gaac import layout as L
from gaac.calibration import Calibration
from gaac.reference.bits import join_bf16
from gaac.tiles import tile_bases, untile

# BF16 patterns at the edges of the format: +-0, the smallest and largest
# subnormals, the smallest normal, the largest finite, 1.0, +-Inf, quiet and
# signalling NaNs with payloads, and the all-ones pattern (exponent 255).
EDGE_PATTERNS = (
    0x0000, 0x8000,            # +0, -0
    0x0001, 0x8001, 0x007F, 0x807F,  # subnormals (exponent 0)
    0x0080, 0x8080,            # smallest normals (exponent 1)
    0x3F80, 0xBF80,            # +-1.0
    0x7F7F, 0xFF7F,            # largest finite (exponent 254)
    0x7F80, 0xFF80,            # +-Inf (exponent 255)
    0x7FC0, 0xFFC0,            # quiet NaNs
    0x7F81, 0x7FA5, 0xFF81,    # signalling NaNs with payloads
    0x7FFF, 0xFFFF,            # NaNs with all payload bits set
)

head_dims = st.sampled_from(L.SUPPORTED_HEAD_DIMS)
kv_heads = st.integers(1, 4)
kinds = st.sampled_from(("k", "v"))
seeds = st.integers(0, 2**32 - 1)
bf16_patterns = st.one_of(st.sampled_from(EDGE_PATTERNS), st.integers(0, 0xFFFF))


def max_tile_escapes(head_dim: int) -> int:
    """Escape bytes of a tile whose every group is raw: the most a slot can ever need."""
    return L.geometry(head_dim).groups * L.ESCAPE_BYTES[L.MODE_RAW]


def capacities(head_dim: int, below: int | None = None) -> st.SearchStrategy[int]:
    """Escape capacities (multiples of ``SLOT_ALIGN``, 0 included) up to one past what any tile needs.

    With ``below`` only capacities ``< below`` (at least one must exist, i.e. ``below >= 1``).
    """
    top = max_tile_escapes(head_dim) + L.SLOT_ALIGN if below is None else below - 1
    return st.integers(0, top // L.SLOT_ALIGN).map(lambda k: k * L.SLOT_ALIGN)


def _overlay(draw, x: np.ndarray, max_count: int = 16) -> np.ndarray:
    """Overwrite up to ``max_count`` drawn positions of ``x`` (in place) with drawn BF16 patterns."""
    flat = x.reshape(-1)
    for _ in range(draw(st.integers(0, min(max_count, flat.size)))):
        flat[draw(st.integers(0, flat.size - 1))] = draw(bf16_patterns)
    return x


@st.composite
def exponent_centres(draw, heads: int, head_dim: int) -> np.ndarray:
    """Per-(head, channel) exponent centres ``int64[heads, head_dim]``, as a real cache has them."""
    rng = np.random.default_rng(draw(seeds))
    lo = draw(st.integers(0, 255))
    hi = draw(st.integers(lo, 255))
    return rng.integers(lo, hi + 1, size=(heads, head_dim))


@st.composite
def bf16_bits(draw, shape: tuple, centres: np.ndarray | None = None) -> np.ndarray:
    """``uint16`` BF16 bit patterns of ``shape`` (last axis = channels); every pattern is reachable.

    Without ``centres`` the patterns are uniform over all 65536.  With
    ``centres`` (``[..., channels]``, broadcast against ``shape`` without its
    token axis, e.g. ``[heads, head_dim]`` for ``[heads, tokens, head_dim]``)
    each channel's exponents scatter around its centre with a drawn spread, so
    windows chosen near the centres give a realistic mix of modes.
    """
    rng = np.random.default_rng(draw(seeds))
    if centres is None:
        x = rng.integers(0, 0x10000, size=shape, dtype=np.uint16)
    else:
        spread = draw(st.sampled_from((0.0, 0.3, 0.6, 1.0, 2.0, 4.0, 16.0)))
        c = np.asarray(centres)[..., None, :]
        e = np.clip(np.rint(c + rng.normal(0.0, spread, size=shape)), 0, 255).astype(np.uint8)
        sm = rng.integers(0, 0x100, size=shape, dtype=np.uint8)
        x = join_bf16(sm, e).astype(np.uint16)
    return _overlay(draw, x)


@st.composite
def bases(draw, heads: int, head_dim: int, centres: np.ndarray | None = None):
    """``(b3, b4)``, each ``uint8[heads, head_dim]`` within ``0..B3_MAX`` / ``0..B4_MAX``.

    With ``centres`` the windows start a drawn distance below them (so most
    values fall inside); without, anywhere in range.
    """
    rng = np.random.default_rng(draw(seeds))
    if centres is None:
        b3 = rng.integers(0, L.B3_MAX + 1, size=(heads, head_dim))
        b4 = rng.integers(0, L.B4_MAX + 1, size=(heads, head_dim))
    else:
        c = np.asarray(centres)
        b3 = np.clip(c - rng.integers(0, L.WINDOW_3BIT, size=c.shape), 0, L.B3_MAX)
        b4 = np.clip(c - rng.integers(0, L.WINDOW_4BIT, size=c.shape), 0, L.B4_MAX)
    edge = draw(st.integers(0, 7))      # now and then, windows at the ends of the exponent range
    if edge == 0:
        b3[...] = 0
        b4[...] = 0
    elif edge == 1:
        b3[...] = L.B3_MAX
        b4[...] = L.B4_MAX
    return b3.astype(np.uint8), b4.astype(np.uint8)


@st.composite
def calibrations(draw, layers: int, heads: int, head_dim: int, *, layer: int | None = None,
                 kind: int | None = None, layer_bases=None, capacity: int | None = None) -> Calibration:
    """A valid :class:`Calibration` with random bases and capacities.

    ``layer_bases=(b3, b4)`` and ``capacity`` pin the bases and capacity of
    one ``(kind, layer)``; everything else is drawn.
    """
    rng = np.random.default_rng(draw(seeds))
    b3 = rng.integers(0, L.B3_MAX + 1, size=(2, layers, heads, head_dim)).astype(np.uint8)
    b4 = rng.integers(0, L.B4_MAX + 1, size=b3.shape).astype(np.uint8)
    cap = np.array([[draw(capacities(head_dim)) for _ in range(layers)] for _ in range(2)])
    if layer_bases is not None:
        b3[kind, layer], b4[kind, layer] = layer_bases
    if capacity is not None:
        cap[kind, layer] = capacity
    return Calibration(b3=b3, b4=b4, capacity=cap, model=draw(st.sampled_from((None, "test-model"))))


@dataclass
class BlockCase:
    """One block to encode and everything needed to encode it.

    ``modes`` (``[n_tiles, groups]``) and ``raw_tiles`` are what the encoder
    must produce when the strategy forced them, else ``None``.
    """

    bits: np.ndarray              # uint16 [kv_heads, 16, head_dim]
    calibration: Calibration
    layer: int
    kind: str
    modes: np.ndarray | None = None
    raw_tiles: tuple | None = None

    @property
    def kind_index(self) -> int:
        return L.KIND_K if self.kind == "k" else L.KIND_V

    @property
    def capacity(self) -> int:
        return int(self.calibration.capacity[self.kind_index, self.layer])

    @property
    def kv_heads(self) -> int:
        return self.bits.shape[0]

    @property
    def head_dim(self) -> int:
        return self.bits.shape[2]


@st.composite
def _block_frame(draw, head_dim=None, heads=None):
    """The shape and address of a block: ``(heads, head_dim, layers, layer, kind)``."""
    dim = draw(head_dims) if head_dim is None else head_dim
    h = draw(kv_heads) if heads is None else heads
    layers = draw(st.integers(1, 3))
    return h, dim, layers, draw(st.integers(0, layers - 1)), draw(kinds)


@st.composite
def block_cases(draw, head_dim: int | None = None, heads: int | None = None) -> BlockCase:
    """Any block: any patterns, any supported shape, any bases in range, any capacity (0 included).

    Three draws in four place the data near the bases so that 3-bit, 4-bit and
    raw groups mix; the others are uniform patterns against uniform bases.
    """
    h, dim, layers, layer, kind = draw(_block_frame(head_dim, heads))
    centres = None if draw(st.integers(0, 3)) == 0 else draw(exponent_centres(h, dim))
    bits = draw(bf16_bits((h, L.BLOCK_TOKENS, dim), centres))
    kd = L.KIND_K if kind == "k" else L.KIND_V
    cal = draw(calibrations(layers, h, dim, layer=layer, kind=kd, layer_bases=draw(bases(h, dim, centres))))
    return BlockCase(bits=bits, calibration=cal, layer=layer, kind=kind)


def forced_exponents(rng: np.random.Generator, modes: np.ndarray, b3: np.ndarray, b4: np.ndarray) -> np.ndarray:
    """Exponents ``uint8[n, 16*C]`` (element order) whose groups need exactly ``modes`` ``[n, groups]``.

    ``b3``/``b4`` are per-tile bases ``[n, C]``.  A 3-bit group takes all 8
    exponents from its channels' 3-bit windows.  A 4-bit group takes them from
    the 4-bit windows with one drawn element (the witness) outside the 3-bit
    window; a raw group takes any exponents with one witness outside both
    windows.  A witness always exists: a 16-wide window has values outside an
    8-wide one, and two windows cover at most 24 of the 256 exponents.
    """
    n, groups = modes.shape
    channels = b3.shape[1]
    tokens = (1, L.BLOCK_TOKENS)                      # per-channel bases repeated for every token
    e3 = np.tile(b3.astype(np.int64), tokens) + rng.integers(0, L.WINDOW_3BIT, size=(n, groups * L.GROUP_SIZE))
    e4 = np.tile(b4.astype(np.int64), tokens) + rng.integers(0, L.WINDOW_4BIT, size=e3.shape)
    anything = rng.integers(0, 256, size=e3.shape)
    m = np.repeat(modes, L.GROUP_SIZE, axis=1)
    e = np.where(m == L.MODE_3BIT, e3, np.where(m == L.MODE_4BIT, e4, anything))

    # One witness per non-3-bit group, at a drawn position of the group.
    tile, group = np.nonzero(modes != L.MODE_3BIT)
    element = group * L.GROUP_SIZE + rng.integers(0, L.GROUP_SIZE, size=group.size)
    channel = element % channels
    ex = np.arange(256)
    wb3 = b3[tile, channel].astype(np.int64)[:, None]
    wb4 = b4[tile, channel].astype(np.int64)[:, None]
    in3 = (ex >= wb3) & (ex < wb3 + L.WINDOW_3BIT)
    in4 = (ex >= wb4) & (ex < wb4 + L.WINDOW_4BIT)
    allowed = np.where((modes[tile, group] == L.MODE_4BIT)[:, None], in4 & ~in3, ~in4 & ~in3)
    e[tile, element] = np.argmax(rng.random(allowed.shape) * allowed, axis=1)
    return e.astype(np.uint8)


def tile_escapes(modes: np.ndarray) -> np.ndarray:
    """Escape bytes each tile's groups need, summed straight from ``layout.ESCAPE_BYTES``.

    Deliberately not the codec's own count: tests compare the two.
    """
    per_mode = np.array([L.ESCAPE_BYTES.get(m, 0) for m in range(1 << L.TAG_BITS)])
    return per_mode[modes].sum(axis=-1)


@st.composite
def forced_blocks(draw, head_dim: int | None = None, heads: int | None = None, weights=None,
                  overflow: bool = False) -> BlockCase:
    """A block whose every group needs the mode in ``case.modes``, drawn on purpose.

    ``weights`` (three non-negative numbers for 3-bit, 4-bit, raw) fixes the
    mix; by default it is drawn.  Without ``overflow`` the capacity holds every
    tile's escapes.  With ``overflow`` one drawn tile gets at least one raw
    group and the capacity is drawn below its escape bytes, so that tile -- and
    any other that needs as much -- overflows its slot and stays raw
    (``case.raw_tiles``).
    """
    h, dim, layers, layer, kind = draw(_block_frame(head_dim, heads))
    geo = L.geometry(dim)
    n_tiles = h * L.tiles_per_head(dim)
    rng = np.random.default_rng(draw(seeds))
    if weights is None:
        weights = draw(st.tuples(*[st.integers(0, 4)] * 3).filter(any))
    p = np.asarray(weights, dtype=float) / sum(weights)
    modes = rng.choice([L.MODE_3BIT, L.MODE_4BIT, L.MODE_RAW], size=(n_tiles, geo.groups), p=p).astype(np.uint8)
    esc = tile_escapes(modes)
    if overflow:
        victim = draw(st.integers(0, n_tiles - 1))
        modes[victim, draw(st.integers(0, geo.groups - 1))] = L.MODE_RAW
        esc = tile_escapes(modes)
        capacity = draw(capacities(dim, below=int(esc[victim])))
    else:
        least = -(-int(esc.max()) // L.SLOT_ALIGN)
        capacity = L.SLOT_ALIGN * draw(st.integers(least, max_tile_escapes(dim) // L.SLOT_ALIGN + 1))

    b3, b4 = draw(bases(h, dim))
    t3, t4 = tile_bases(b3, b4)
    e = forced_exponents(rng, modes, t3, t4)
    sm = rng.integers(0, 0x100, size=e.shape, dtype=np.uint8)
    tiles = join_bf16(sm, e).astype(np.uint16).reshape(n_tiles, L.BLOCK_TOKENS, geo.channels)
    kd = L.KIND_K if kind == "k" else L.KIND_V
    cal = draw(calibrations(layers, h, dim, layer=layer, kind=kd, layer_bases=(b3, b4), capacity=capacity))
    return BlockCase(bits=untile(tiles, h, dim), calibration=cal, layer=layer, kind=kind, modes=modes,
                     raw_tiles=tuple(int(t) for t in np.flatnonzero(esc > capacity)))


def overflow_blocks(head_dim: int | None = None, heads: int | None = None) -> st.SearchStrategy[BlockCase]:
    """Forced blocks where at least one tile overflows its slot (see :func:`forced_blocks`)."""
    return forced_blocks(head_dim, heads, overflow=True)


def drifting(rng, layers, heads, tokens, dim, drift):
    """Random BF16 bits whose exponent centres move by ``drift`` over ``tokens`` in the even channels.

    The way RoPE drift moves K's slowly rotating channel pairs as a context grows.
    """
    centres = rng.integers(112, 128, size=(layers, heads, 1, dim)).astype(float)
    shift = drift * (np.arange(tokens)[:, None] / tokens) * (np.arange(dim) % 2 == 0)
    e = np.rint(centres + shift + rng.normal(0, 1.5, size=(layers, heads, tokens, dim)))
    sm = rng.integers(0, 256, size=e.shape, dtype=np.uint16)
    return ((sm & 0x80) << 8) | (np.clip(e, 0, 255).astype(np.uint16) << 7) | (sm & 0x7F)
