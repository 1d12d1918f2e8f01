"""Calibration: per-channel exponent windows and per-layer escape capacities, for any element format.

``calibrate(k, v)`` looks at sample caches ``[layers, kv_heads, tokens, head_dim]``
and, for each layer, K and V separately, each (head, channel):

* ``b3`` -- the start of the 8-wide exponent window covering the most values;
* ``b4`` -- the start of the 16-wide window covering the most values;

and for each layer and kind the escape capacity of a slot that makes the
resident cache smallest: a larger slot wastes its unused bytes on every tile,
a smaller one sends more tiles to the raw BF16 pool (FORMAT.md section 6).

The element format decides the widths: BF16's windows are 3 and 4 bits wide
(``b3``/``b4``); an FP8 calibration (``calibrate(k, v, format="fp8_e4m3")``,
FORMAT-FP8.md 5) fits the narrow and wide windows of its mode set
(``b_narrow``/``b_wide``) to the cache converted with the scales it chooses
and records them (``scale_log2``).  One :class:`Calibration` holds either; its
format picks the file it is saved in and the canonical bytes of its id.

Ties go to the smallest base and the smallest capacity, so calibration is a
pure function of its input.  A calibration only changes sizes: any value,
in a window or not, round-trips.

A BF16 calibration may also carry **epochs** (FORMAT.md 3.5): further bases per
(kind, layer) that a cache appended while its context grew past what the
calibration saw (:mod:`gaac.epochs` says when).  ``b3``/``b4`` are epoch 0;
``epochs[(kind, layer)]`` lists epochs 1, 2, ...  A block records its epoch and
is decoded with that epoch's bases, so saving a calibration with its epochs
keeps every stream of the cache decodable.  :attr:`Calibration.id` covers
epoch 0 only; each later epoch has an id of its own (:meth:`Calibration.epoch_id`).

:meth:`Calibration.slice_heads` gives the calibration of some KV heads of every
layer (FORMAT.md 11.12), for a tensor-parallel worker that holds only those: a
calibration like any other, with the id of its own tables.
"""
from __future__ import annotations

import json
import numbers
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import layout as L
from .arrays import as_bits
from .errors import CalibrationError, InputError
from .progress import progress

CALIBRATION_FORMAT = "gaac-calibration"
# The "version" of a calibration file without epochs, and the version byte of the canonical bytes of 3.3:
# format version 2 left both alone, so every version 1 calibration keeps its file and its id.
CALIBRATION_VERSION = 1
EPOCHS_VERSION = 2                 # the "version" of a calibration file with an "epochs" section
EPOCH_MAGIC = b"GAACEPCH"          # FORMAT.md 3.5: first bytes of an epoch's canonical bytes
MAX_EPOCH = 0xFFFF                 # the block header's epoch is a u16


@dataclass(frozen=True)
class CalibrationFile:
    """How the calibrations of one family of element formats are written: the file's ``"format"`` tag,
    its version(s), the names of its per-kind base tables, and the magic of its canonical bytes.

    BF16 calibrations are FORMAT.md section 3's files (``b3``/``b4``, epochs from version 2); FP8 ones are
    FORMAT-FP8.md section 5's (``scale_log2``, ``b_narrow``/``b_wide``, the element format named inside).
    """

    tag: str                  # the file's "format"
    title: str                # how messages name a file of this family
    versions: tuple           # the file "version"s this gaac reads, oldest first
    bases: tuple              # file names of the narrow and the wide base tables
    magic: bytes              # first bytes of the canonical bytes, before the version byte
    scales: bool              # whether the calibration holds conversion scales (``scale_log2``)


BF16_FILE = CalibrationFile("gaac-calibration", "GAAC", (CALIBRATION_VERSION, EPOCHS_VERSION), ("b3", "b4"),
                            b"GAACCAL", scales=False)
FP8_FILE = CalibrationFile("gaac-fp8-calibration", "GAAC-FP8", (L.FP8_FORMAT_VERSION,), ("b_narrow", "b_wide"),
                           b"GAACF8C", scales=True)
CALIBRATION_FILES = {L.BF16.name: BF16_FILE, L.E4M3.name: FP8_FILE, L.E5M2.name: FP8_FILE}
SCALE_LOG2_RANGE = (-127, 127)    # an FP8 scale exponent is stored as a signed byte


def check_notes(notes) -> None:
    """FORMAT.md 3.4: ``notes`` is a JSON object (a dict), free-form inside."""
    if not isinstance(notes, dict):
        raise CalibrationError(f"calibration notes must be an object (a dict), got {type(notes).__name__}")


def file_notes(d: dict) -> dict:
    """The ``notes`` of a calibration file: optional (absent or null is none), else an object."""
    notes = d.get("notes")
    if notes is None:
        return {}
    check_notes(notes)
    return notes


def check_capacities(capacity: np.ndarray) -> None:
    """FORMAT.md 3.2: escape capacities are multiples of 16 that fit the header's u16."""
    bad = (capacity < 0) | (capacity > L.MAX_ESCAPE_CAPACITY) | (capacity % L.SLOT_ALIGN != 0)
    if bad.any():
        raise CalibrationError(f"escape capacities must be multiples of {L.SLOT_ALIGN} in "
                               f"0..{L.MAX_ESCAPE_CAPACITY}, got {capacity.tolist()}")


class Calibration:
    """Everything a cache of one model and element format needs besides its data.

    ``b_narrow``/``b_wide`` ``[2 (K, V), layers, kv_heads, head_dim]``: the bases of the narrow and the
    wide window of each channel (for BF16 the 3-bit and 4-bit windows: ``b3``/``b4``, the names the
    constructor and the attributes also take); ``capacity`` ``[2, layers]``: the escape capacity of each
    layer's slots.  ``format`` (an :class:`~gaac.layout.ElementFormat` or its name) says what the tables
    mean -- its mode set gives the window widths and base ranges -- and which file and canonical bytes
    the calibration has (:data:`CALIBRATION_FILES`).  An FP8 calibration adds ``scale_log2``
    ``[2, layers, kv_heads]``: the cache holds ``x * 2**-scale_log2`` in FP8 (:mod:`gaac.fp8.convert`).

    A BF16 calibration may also carry **epochs** (FORMAT.md 3.5): ``epochs[(kind, layer)]`` lists the
    bases ``(b3, b4)`` of epochs 1, 2, ...; ``b3``/``b4`` are epoch 0.  An FP8 calibration has epoch 0 only.
    """

    def __init__(self, b_narrow=None, b_wide=None, capacity=None, model: str | None = None, notes=None,
                 epochs=None, *, format=L.BF16, scale_log2=None, b3=None, b4=None):
        try:
            self.format = L.element_format(format)
        except ValueError as exc:
            raise CalibrationError(str(exc)) from None
        names = self.file.bases
        if b3 is not None or b4 is not None:
            if b_narrow is not None or b_wide is not None:
                raise CalibrationError("give the bases as b_narrow/b_wide or as b3/b4, not both")
            b_narrow, b_wide = b3, b4
        if b_narrow is None or b_wide is None or capacity is None:
            raise CalibrationError(f"a calibration needs {names[0]}, {names[1]} and capacity")
        self.model = model
        self.notes = {} if notes is None else notes
        check_notes(self.notes)
        self.b_narrow, self.b_wide, self.capacity = (_int_array(t, "calibration tables")
                                                     for t in (b_narrow, b_wide, capacity))
        if self.file.scales:
            if scale_log2 is None:
                raise CalibrationError(f"a {self.format.name} calibration needs scale_log2 [2, layers, kv_heads]")
            self.scale_log2 = _int_array(scale_log2, "calibration tables")
        elif scale_log2 is not None:
            raise CalibrationError(f"a {self.format.name} calibration has no scale_log2 (conversion scales belong "
                                   "to FP8 formats)")
        else:
            self.scale_log2 = None
        self.validate()
        self.b_narrow = self.b_narrow.astype(np.uint8)
        self.b_wide = self.b_wide.astype(np.uint8)
        if self.scale_log2 is not None:
            self.scale_log2 = self.scale_log2.astype(np.int8)
        given, self.epochs = {} if epochs is None else epochs, {}
        if not isinstance(given, dict):
            raise CalibrationError(f"epochs must be a dict {{(kind, layer): [(b3, b4), ...]}}, got "
                                   f"{type(given).__name__}")
        for key, tables in given.items():
            if not (isinstance(key, tuple) and len(key) == 2 and key[0] in L.KIND_NAMES
                    and isinstance(key[1], (int, np.integer)) and 0 <= key[1] < self.layers):
                raise CalibrationError(f"epochs key {key!r} is not (kind 0 or 1, layer 0..{self.layers - 1})")
            for pair in tables:
                if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                    raise CalibrationError(f"epochs of {key!r}: expected (b3, b4) pairs, got {type(pair).__name__}")
                self.add_epoch(int(key[1]), int(key[0]), *pair)

    def __repr__(self) -> str:
        return (f"Calibration({self.format.name}, {self.layers} layers x {self.kv_heads} KV heads x head_dim "
                f"{self.head_dim}, id {self.id:08x}, model {self.model!r})")

    # -- shape ---------------------------------------------------------------
    @property
    def file(self) -> CalibrationFile:
        """The file family of this calibration's element format."""
        return CALIBRATION_FILES[self.format.name]

    @property
    def modes(self) -> L.ModeSet:
        """The element format's mode set: the code widths the bases are for."""
        return L.MODE_SETS[self.format.name]

    @property
    def element(self) -> int:
        """The element-format byte of this calibration's block containers."""
        return self.format.element

    @property
    def geometry(self) -> L.TileGeometry:
        """The geometry of this calibration's tiles."""
        return self.modes.geometry(self.head_dim)

    @property
    def b3(self) -> np.ndarray:
        """BF16's name of :attr:`b_narrow`: the bases of the 3-bit window."""
        return self.b_narrow

    @property
    def b4(self) -> np.ndarray:
        """BF16's name of :attr:`b_wide`: the bases of the 4-bit window."""
        return self.b_wide

    @property
    def layers(self) -> int:
        return self.b_narrow.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.b_narrow.shape[2]

    @property
    def head_dim(self) -> int:
        return self.b_narrow.shape[3]

    def validate(self) -> None:
        """FORMAT.md 3.2 (FORMAT-FP8.md 5): the rules a calibration must satisfy before any stream is read
        with it."""
        bn, bw, cap, names = self.b_narrow, self.b_wide, self.capacity, self.file.bases
        if bn.ndim != 4 or bn.shape[0] != 2:
            raise CalibrationError(f"{names[0]} must be [2, layers, kv_heads, head_dim], got {list(bn.shape)}")
        if min(bn.shape[1:3]) < 1:
            raise CalibrationError(f"a calibration needs at least one layer and one KV head, got "
                                   f"{bn.shape[1]} layers x {bn.shape[2]} KV heads")
        if bn.shape[1] > L.MAX_LAYERS or bn.shape[2] > L.MAX_KV_HEADS:
            raise CalibrationError(f"calibration of {bn.shape[1]} layers x {bn.shape[2]} KV heads: block and "
                                   f"sequence headers hold at most {L.MAX_LAYERS} layers and {L.MAX_KV_HEADS} KV "
                                   "heads (u16)")
        if bw.shape != bn.shape:
            raise CalibrationError(f"{names[1]} shape {list(bw.shape)} differs from {names[0]} shape "
                                   f"{list(bn.shape)}")
        if cap.shape != (2, bn.shape[1]):
            raise CalibrationError(f"capacity must be [2, {bn.shape[1]}], got {list(cap.shape)}")
        if self.scale_log2 is not None and self.scale_log2.shape != bn.shape[:3]:
            raise CalibrationError(f"scale_log2 must be {list(bn.shape[:3])}, got {list(self.scale_log2.shape)}")
        if bn.shape[3] not in L.SUPPORTED_HEAD_DIMS:
            raise CalibrationError(f"head_dim {bn.shape[3]} is not one of {L.SUPPORTED_HEAD_DIMS}")
        _check_base_ranges(bn, bw, self.modes, "")
        sc = self.scale_log2
        if sc is not None and sc.size and (sc.min() < SCALE_LOG2_RANGE[0] or sc.max() > SCALE_LOG2_RANGE[1]):
            raise CalibrationError(f"scale exponents must lie in {SCALE_LOG2_RANGE[0]}..{SCALE_LOG2_RANGE[1]}")
        check_capacities(cap)

    def check_shape(self, layers: int | None, kv_heads: int, head_dim: int) -> None:
        """Raise :class:`CalibrationError` unless this calibration is for caches of that shape."""
        if (kv_heads, head_dim) != (self.kv_heads, self.head_dim) or (layers is not None and layers != self.layers):
            have = f"{self.layers} layers x {self.kv_heads} KV heads x head_dim {self.head_dim}"
            want = f"{'?' if layers is None else layers} layers x {kv_heads} KV heads x head_dim {head_dim}"
            raise CalibrationError(f"Calibration: {self.format.name} calibration is for {have} (model "
                                   f"{self.model!r}); the cache has {want}")

    def check_layer(self, layer: int) -> None:
        """:class:`InputError` unless ``layer`` is an integer (not a bool); :class:`CalibrationError` unless
        this calibration has that layer."""
        if type(layer) is not int and (isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral)):
            raise InputError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.layers:
            raise CalibrationError(f"layer {layer} out of range: calibration has {self.layers} layers")

    @staticmethod
    def check_kind(kind: int) -> None:
        """:class:`InputError` unless ``kind`` is 0 (K, :data:`gaac.layout.KIND_K`) or 1 (V, ``KIND_V``): an
        integer, not a bool, a name or anything else (``'k'`` would otherwise look up no epochs)."""
        if type(kind) is int and 0 <= kind <= 1:
            return
        if isinstance(kind, (bool, np.bool_)) or not isinstance(kind, numbers.Integral) or kind not in L.KIND_NAMES:
            raise InputError(f"kind must be 0 (K, gaac.layout.KIND_K) or 1 (V, KIND_V), got {kind!r}")

    def check_block(self, kind: int, layer: int, heads: int, dim: int, capacity: int) -> None:
        """FORMAT.md 8, R15-R17: a block container's shape, layer and escape capacity against this calibration."""
        self.check_kind(kind)
        self.check_shape(None, heads, dim)
        self.check_layer(layer)
        if capacity != self.capacity[kind, layer]:
            raise CalibrationError(f"stream escape capacity {capacity} differs from the calibration's "
                                   f"{self.capacity[kind, layer]} for layer {layer} {L.KIND_NAMES[kind]}")

    # -- identity ------------------------------------------------------------
    def canonical_bytes(self) -> bytes:
        """FORMAT.md 3.3 (FORMAT-FP8.md 5.2): the bytes whose CRC-32 is the calibration id (epoch 0 only)."""
        dims = np.array([self.layers, self.kv_heads, self.head_dim], dtype="<u4").tobytes()
        tail = self.b_narrow.tobytes() + self.b_wide.tobytes() + self.capacity.astype("<u2").tobytes()
        if not self.file.scales:
            return BF16_FILE.magic + bytes([CALIBRATION_VERSION]) + dims + tail
        head = FP8_FILE.magic + bytes([L.FP8_FORMAT_VERSION, self.element])
        return head + dims + self.scale_log2.astype(np.int8).tobytes() + tail

    @property
    def id(self) -> int:
        return zlib.crc32(self.canonical_bytes())

    @classmethod
    def from_canonical_bytes(cls, data: bytes, model: str | None = None) -> "Calibration":
        """The BF16 calibration whose canonical bytes (FORMAT.md 3.3) are ``data`` (epoch 0: no epochs, no notes)."""
        head = BF16_FILE.magic + bytes([CALIBRATION_VERSION])
        if len(data) < CANONICAL_HEAD_BYTES or bytes(data[:8]) != head:
            raise CalibrationError(f"not the canonical bytes of a calibration (they start with {head!r})")
        layers, heads, dim = (int(x) for x in np.frombuffer(data, dtype="<u4", count=3, offset=8))
        n = 2 * layers * heads * dim
        if len(data) != canonical_bytes_size(layers, heads, dim):
            raise CalibrationError(f"canonical calibration bytes of {layers} layers x {heads} KV heads x head_dim "
                                   f"{dim} are {canonical_bytes_size(layers, heads, dim)} bytes, not {len(data)}")
        b3 = np.frombuffer(data, np.uint8, n, CANONICAL_HEAD_BYTES).reshape(2, layers, heads, dim)
        b4 = np.frombuffer(data, np.uint8, n, CANONICAL_HEAD_BYTES + n).reshape(2, layers, heads, dim)
        capacity = np.frombuffer(data, "<u2", 2 * layers, CANONICAL_HEAD_BYTES + 2 * n).reshape(2, layers)
        return cls(b3=b3, b4=b4, capacity=capacity, model=model)

    def bases(self, layer: int, kind: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(b_narrow, b_wide)`` of one layer, kind and epoch, each ``[kv_heads, head_dim]``."""
        self.check_epoch(layer, kind, epoch)
        if epoch == 0:
            return self.b_narrow[kind, layer], self.b_wide[kind, layer]
        return self.epochs[(kind, layer)][epoch - 1]

    def copy(self, *, share_tables: bool = False) -> "Calibration":
        """An independent calibration with the same tables and epochs (appending to it leaves this one alone).

        ``share_tables``: the copy shares this calibration's arrays instead of checking and copying them (they
        were checked when made, an epoch's when added), so that it costs a list per layer and kind: for a copy
        that only appends epochs, as the adaptation rule's trial copies do, once per prefill layer.  Changing
        an array of either in place then changes both."""
        if not share_tables:
            return Calibration(self.b_narrow, self.b_wide, self.capacity, model=self.model, notes=dict(self.notes),
                               epochs={key: list(tables) for key, tables in self.epochs.items()},
                               format=self.format, scale_log2=self.scale_log2)
        out = object.__new__(Calibration)
        out.__dict__.update(self.__dict__)
        out.notes = dict(self.notes)
        out.epochs = {key: list(tables) for key, tables in self.epochs.items()}
        return out

    def slice_heads(self, start: int, stop: int) -> "Calibration":
        """The calibration of KV heads ``start .. stop - 1`` of every layer (FORMAT.md 11.12): the bases (and an
        FP8 calibration's scales) sliced on the heads axis, every epoch's bases likewise, the capacities, model
        and notes as they are.  A sliced calibration is a calibration: its id is the id of its own canonical
        bytes (3.3), and its epochs' ids are computed with that id (3.5).  It is the calibration of a cache
        that holds those heads, as a tensor-parallel worker does, and of the containers
        ``export_sequence(..., heads=(start, stop))`` writes.  A range that is empty or not within
        ``0 .. kv_heads`` is an :class:`InputError`."""
        start, stop = check_heads((start, stop), self.kv_heads)
        out = Calibration(self.b_narrow[:, :, start:stop], self.b_wide[:, :, start:stop], self.capacity,
                          model=self.model, notes=dict(self.notes), format=self.format,
                          scale_log2=None if self.scale_log2 is None else self.scale_log2[:, :, start:stop])
        # each epoch's bases were checked (3.2 rule 2) when they were added; a slice of them keeps to it
        out.epochs = {key: [(b3[start:stop].copy(), b4[start:stop].copy()) for b3, b4 in tables]
                      for key, tables in self.epochs.items()}
        return out

    # -- epochs (FORMAT.md 3.5) ------------------------------------------------
    def n_epochs(self, layer: int, kind: int) -> int:
        """Epochs of one layer and kind, epoch 0 (the calibration's own bases) included."""
        self.check_kind(kind)
        self.check_layer(layer)
        return 1 + len(self.epochs.get((kind, layer), ()))

    def check_epoch(self, layer: int, kind: int, epoch: int) -> None:
        """:class:`InputError` for a layer, kind or epoch that is not an integer (or a kind other than 0 and
        1); :class:`CalibrationError` unless this calibration has that layer and epoch."""
        if type(epoch) is not int and (isinstance(epoch, (bool, np.bool_)) or not isinstance(epoch, numbers.Integral)):
            raise InputError(f"epoch must be an integer, got {epoch!r}")
        if not 0 <= epoch < self.n_epochs(layer, kind):
            raise CalibrationError(f"unknown epoch {epoch}: the calibration has {self.n_epochs(layer, kind)} "
                                   f"epoch(s) for layer {layer} {L.KIND_NAMES[kind]} (a cache that appended "
                                   "epochs must save its calibration with them)")

    def epoch_canonical_bytes(self, layer: int, kind: int, epoch: int) -> bytes:
        """FORMAT.md 3.5: the bytes whose CRC-32 is the id of epoch ``epoch >= 1``.

        They hold the calibration id, the layer, the epoch and the kind, so an
        epoch's id differs from that of any other cache's epoch of the same index.
        """
        self.check_epoch(layer, kind, epoch)
        if epoch < 1:
            raise CalibrationError(f"epoch {epoch}: only epochs 1 and later have epoch bytes; epoch 0 is "
                                   "identified by the calibration id")
        return epoch_canonical_bytes(self.id, layer, kind, epoch, *self.bases(layer, kind, epoch))

    def epoch_id(self, layer: int, kind: int, epoch: int) -> int:
        """The id a block of ``epoch`` carries in its header: the calibration id for epoch 0."""
        self.check_epoch(layer, kind, epoch)
        return self.id if epoch == 0 else zlib.crc32(self.epoch_canonical_bytes(layer, kind, epoch))

    def add_epoch(self, layer: int, kind: int, b3, b4) -> int:
        """Append bases ``[kv_heads, head_dim]`` as the newest epoch of one layer and kind; return its index."""
        return self.add_epochs([(layer, kind, b3, b4)])[0]

    def add_epochs(self, items) -> list[int]:
        """Append epochs ``(layer, kind, b3, b4)`` in the order given, as :meth:`add_epoch` appends one; return
        their indices.  Every one is checked before any is appended (all of them, or none and the error of the
        first that fails), the bases' ranges in one pass over all of them: an update whose adaptation appends in
        every layer and kind checks once, not once an epoch."""
        items = list(items)
        if not items:
            return []
        if not self.format.epochs:
            raise CalibrationError(f"a {self.format.name} calibration has epoch 0 only (its blocks name no epoch)")
        shape = (self.kv_heads, self.head_dim)
        count, checked = {}, []
        for layer, kind, b3, b4 in items:
            key = (kind, layer)
            epoch = count[key] if key in count else self.n_epochs(layer, kind)     # checks the layer and kind
            if epoch > MAX_EPOCH:
                raise CalibrationError(f"layer {layer} {L.KIND_NAMES[kind]} already has {epoch} epochs, the most a "
                                       f"block header can name")
            count[key] = epoch + 1
            where = f"epoch {epoch} of layer {layer} {L.KIND_NAMES[kind]}"
            b3, b4 = (_int_array(t, where) for t in (b3, b4))
            if b3.shape != shape or b4.shape != shape:
                raise CalibrationError(f"{where}: bases must be [{self.kv_heads}, {self.head_dim}], got "
                                       f"{list(b3.shape)} and {list(b4.shape)}")
            checked.append((key, epoch, where, b3, b4))
        try:
            _check_base_ranges(np.stack([c[3] for c in checked]), np.stack([c[4] for c in checked]), self.modes, "")
        except CalibrationError:
            for _, _, where, b3, b4 in checked:         # the first epoch out of range names itself
                _check_base_ranges(b3, b4, self.modes, f"{where}: ")
            raise
        for key, _, _, b3, b4 in checked:
            self.epochs.setdefault(key, []).append((b3.astype(np.uint8), b4.astype(np.uint8)))
        return [epoch for _, epoch, _, _, _ in checked]

    # -- files ---------------------------------------------------------------
    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path, family: CalibrationFile | None = None) -> "Calibration":
        """The calibration in the JSON file ``path`` (of ``family`` only, when given: :meth:`from_dict`);
        anything else is a :class:`CalibrationError`."""
        data = Path(path).read_bytes()
        try:
            d = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise CalibrationError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}: not JSON ({exc})") from exc
        except RecursionError:
            raise CalibrationError(f"{path}: JSON nested too deeply to be a calibration") from None
        return cls.from_dict(d, family)

    def to_dict(self) -> dict:
        f = self.file
        if f.scales:
            def kind(i):
                return {"scale_log2": self.scale_log2[i].tolist(), "b_narrow": self.b_narrow[i].tolist(),
                        "b_wide": self.b_wide[i].tolist(), "capacity": self.capacity[i].tolist()}
            head = {"format": f.tag, "version": f.versions[0], "element_format": self.format.name}
        else:
            def kind(i):
                return {"b3": self.b_narrow[i].tolist(), "b4": self.b_wide[i].tolist(),
                        "capacity": self.capacity[i].tolist()}
            head = {"format": f.tag, "version": EPOCHS_VERSION if self.epochs else CALIBRATION_VERSION}
        d = {**head, "model": self.model, "layers": self.layers, "kv_heads": self.kv_heads,
             "head_dim": self.head_dim, "id": f"{self.id:08x}", "k": kind(0), "v": kind(1)}
        if self.epochs:
            d["epochs"] = {name: [[{"b3": b3.tolist(), "b4": b4.tolist(),
                                    "id": f"{self.epoch_id(layer, kind, e):08x}"}
                                   for e, (b3, b4) in enumerate(self.epochs.get((kind, layer), ()), start=1)]
                                  for layer in range(self.layers)]
                           for kind, name in L.KIND_NAMES.items()}
        d["notes"] = self.notes
        return d

    @classmethod
    def from_dict(cls, d: dict, family: CalibrationFile | None = None) -> "Calibration":
        """The calibration of a file's JSON object ``d``; its ``"format"`` says which family of files it is.
        ``family`` (:data:`BF16_FILE` or :data:`FP8_FILE`) accepts only files of that family."""
        families = (family,) if family is not None else (BF16_FILE, FP8_FILE)
        f = next((f for f in families if isinstance(d, dict) and d.get("format") == f.tag), None)
        if f is None:
            want = " or ".join(f'"{f.tag}"' for f in families)
            raise CalibrationError(f"not a {families[0].title if family else 'GAAC'} calibration "
                                   f"(expected \"format\": {want})")
        if d.get("version") not in f.versions or type(d.get("version")) is not int:
            raise CalibrationError(f"{'FP8 ' if f.scales else ''}calibration version {d.get('version')} is not "
                                   f"supported (this gaac reads version{'s' if len(f.versions) > 1 else ''} "
                                   f"{' and '.join(map(str, f.versions))})")
        if d.get("model") is not None and not isinstance(d["model"], str):
            raise CalibrationError(f"calibration \"model\" must be a string or null, got {type(d['model']).__name__}")
        if "epochs" in d and not f.scales and d["version"] != EPOCHS_VERSION:
            raise CalibrationError(f"a calibration with an \"epochs\" section is version {EPOCHS_VERSION}, "
                                   f"this file says {d['version']}")
        names = (("scale_log2",) if f.scales else ()) + f.bases + ("capacity",)
        what = "malformed FP8 calibration" if f.scales else "malformed calibration"
        for kind in ("k", "v"):
            for name in names:
                table = d[kind].get(name) if isinstance(d.get(kind), dict) else None
                if table is None:
                    raise CalibrationError(f"{what}: missing {kind}.{name}")
                if not _all_ints(table):
                    raise CalibrationError(f"{what}: {kind}.{name} holds a value that is not an integer "
                                           "(scales, bases and capacities are whole numbers)")
        try:
            fmt = L.BF16
            if f.scales:
                try:
                    fmt = L.fp8_format(d["element_format"])
                except ValueError as exc:
                    raise CalibrationError(str(exc)) from None
            cal = cls(*([d["k"][name], d["v"][name]] for name in f.bases + ("capacity",)), model=d.get("model"),
                      notes=file_notes(d), format=fmt,
                      scale_log2=[d["k"]["scale_log2"], d["v"]["scale_log2"]] if f.scales else None)
        except CalibrationError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{what}: {exc!r}") from exc
        cal.check_header(d)
        if not f.scales:                 # FORMAT-FP8.md 5: an FP8 file has no epochs to read
            cal._read_epochs(d.get("epochs", {}))
        return cal

    def check_header(self, d: dict) -> None:
        """FORMAT.md 3.4: the file's ``layers``, ``kv_heads`` and ``head_dim`` are JSON integers (``1.0`` and
        ``true`` are not) equal to its tables' shape (which :meth:`validate` holds to the containers' u16
        fields), and ``id``, when present, is the tables' id as 8 lowercase hex digits."""
        dims = (d.get("layers"), d.get("kv_heads"), d.get("head_dim"))
        if any(type(n) is not int for n in dims) or dims != (self.layers, self.kv_heads, self.head_dim):
            raise CalibrationError(f"calibration header says {dims} but its tables are "
                                   f"{(self.layers, self.kv_heads, self.head_dim)} (integers)")
        given = d.get("id", f"{self.id:08x}")
        if not (isinstance(given, str) and len(given) == 8 and set(given) <= set("0123456789abcdef")):
            raise CalibrationError(f"calibration id {given!r} is not 8 lowercase hex digits")
        if given != f"{self.id:08x}":
            raise CalibrationError(f"calibration id {given} does not match its tables ({self.id:08x}): "
                                   "the file was edited or damaged")

    def _read_epochs(self, section) -> None:
        """FORMAT.md 3.5: ``{"k": [per layer: [{"b3", "b4", "id"?}, ...]], "v": [...]}`` appended in order."""
        if not isinstance(section, dict) or not set(section) <= {"k", "v"}:
            raise CalibrationError("malformed calibration: \"epochs\" must be an object with keys \"k\" and \"v\" "
                                   "(no others)")
        for kind, name in L.KIND_NAMES.items():
            layers = section.get(name, [[] for _ in range(self.layers)])
            if not isinstance(layers, list) or len(layers) != self.layers:
                raise CalibrationError(f"malformed calibration: epochs.{name} must list the epochs of each of "
                                       f"the {self.layers} layers")
            for layer, epochs in enumerate(layers):
                if not isinstance(epochs, list):
                    raise CalibrationError(f"malformed calibration: epochs.{name}[{layer}] is not a list")
                for entry in epochs:
                    where = f"epochs.{name}[{layer}] epoch {self.n_epochs(layer, kind)}"
                    if not isinstance(entry, dict) or not all(_all_ints(entry.get(t)) for t in ("b3", "b4")):
                        raise CalibrationError(f"malformed calibration: {where} needs integer tables b3 and b4")
                    if not set(entry) <= {"b3", "b4", "id"}:
                        raise CalibrationError(f"malformed calibration: {where} has keys other than b3, b4 and id "
                                               f"({sorted(set(entry) - {'b3', 'b4', 'id'})})")
                    epoch = self.add_epoch(layer, kind, entry["b3"], entry["b4"])
                    if "id" not in entry:
                        continue
                    given, want = entry["id"], f"{self.epoch_id(layer, kind, epoch):08x}"
                    if not (isinstance(given, str) and len(given) == 8 and set(given) <= set("0123456789abcdef")):
                        raise CalibrationError(f"{where}: id {given!r} is not 8 lowercase hex digits")
                    if given != want:
                        raise CalibrationError(f"{where}: id {given} does not match its tables ({want}): the file "
                                               "was edited or damaged")


CANONICAL_HEAD_BYTES = 20        # FORMAT.md 3.3: "GAACCAL", the version byte and three u32 dimensions


def canonical_bytes_size(layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of a BF16 calibration's canonical bytes (FORMAT.md 3.3)."""
    return CANONICAL_HEAD_BYTES + 4 * layers * kv_heads * head_dim + 4 * layers


def epoch_canonical_bytes(calibration_id: int, layer: int, kind: int, epoch: int, b3, b4) -> bytes:
    """FORMAT.md 3.5: the bytes whose CRC-32 is the id of epoch ``epoch >= 1`` with bases ``b3``, ``b4``
    ``[kv_heads, head_dim]`` of layer ``layer`` and kind ``kind`` of the calibration ``calibration_id``."""
    return EPOCH_MAGIC + np.array([calibration_id], dtype="<u4").tobytes() \
        + np.array([layer, epoch], dtype="<u2").tobytes() + bytes([kind]) \
        + np.ascontiguousarray(b3, dtype=np.uint8).tobytes() + np.ascontiguousarray(b4, dtype=np.uint8).tobytes()


def check_heads(heads, kv_heads: int) -> tuple[int, int]:
    """``heads`` as ``(start, stop)``: two integers (not bools) with ``0 <= start < stop <= kv_heads``, the KV
    heads ``start .. stop - 1`` of a slice (FORMAT.md 11.12); anything else is an :class:`InputError`."""
    try:
        start, stop = heads
    except (TypeError, ValueError):
        raise InputError(f"heads must be (start, stop), two integers, got {heads!r}") from None
    for value in (start, stop):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise InputError(f"heads must be (start, stop), two integers, got {heads!r}")
    start, stop = int(start), int(stop)
    if not 0 <= start < stop <= kv_heads:
        raise InputError(f"heads ({start}, {stop}): a slice holds KV heads start .. stop - 1, at least one, of the "
                         f"{kv_heads} there are (0 <= start < stop <= {kv_heads})")
    return start, stop


def _int_array(table, what: str) -> np.ndarray:
    """``table`` as int64, or :class:`CalibrationError` for ragged, non-numeric or huge input."""
    try:
        return np.asarray(table, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:    # ragged, non-numeric or beyond int64
        raise CalibrationError(f"malformed {what}: {exc}") from exc


def _check_base_ranges(b_narrow: np.ndarray, b_wide: np.ndarray, modes: L.ModeSet, where: str) -> None:
    """FORMAT.md 3.2 rule 2 (``where`` prefixes the message): every ``base + code`` is an exponent field."""
    top = modes.fmt.max_exponent_field
    for bases, bits, most in ((b_narrow, modes.low_bits, modes.narrow_base_max),
                              (b_wide, modes.wide_bits, modes.wide_base_max)):
        if bases.size and (bases.min() < 0 or bases.max() > most):
            raise CalibrationError(f"{where}{bits}-bit bases must lie in 0..{most} so that base + "
                                   f"{(1 << bits) - 1} <= {top}")


def _all_ints(table) -> bool:
    """True when a nested list holds only ints (JSON true/false and 121.5 are refused, not coerced)."""
    if isinstance(table, list):
        return all(_all_ints(t) for t in table)
    return type(table) is int


def exponent_fields(x, fmt: L.ElementFormat = L.BF16):
    """The exponent field of every element of ``x`` (bits of format ``fmt``, NumPy or torch) as ``uint8``."""
    shifted = x >> fmt.mantissa_bits
    if not isinstance(shifted, np.ndarray):    # torch: signed bits shift in copies of the sign
        return (shifted & fmt.max_exponent_field).to(_torch().uint8)
    if fmt.exponent_bits < 8:                  # an FP8 byte: the sign sits right above the field
        shifted &= fmt.max_exponent_field
    # BF16: the field is the low byte of x >> mantissa_bits, and the cast drops the sign above it
    return shifted.astype(np.uint8)


def _histogram(e: np.ndarray, bins: int) -> np.ndarray:
    """Counts of each exponent field ``e`` ``[heads, tokens, head_dim]`` per (head, channel):
    ``[heads, head_dim, bins]``."""
    heads, _, dim = e.shape
    cells = heads * dim * bins
    index = np.uint16 if cells <= 1 << 16 else np.int64     # a narrow index costs bincount less to read
    cell = ((np.arange(heads)[:, None, None] * dim + np.arange(dim)[None, None, :]) * bins).astype(index)
    idx = e.astype(index)
    idx += cell
    return np.bincount(idx.ravel(), minlength=cells).reshape(heads, dim, bins)


def exponent_histograms(x: np.ndarray, fmt: L.ElementFormat = L.BF16) -> np.ndarray:
    """Counts of each exponent field per (layer, head, channel) of a cache of format ``fmt``:
    ``[layers, heads, head_dim, 2**exponent_bits]``."""
    layers, heads, tokens, dim = x.shape
    hist = np.empty((layers, heads, dim, fmt.exponent_values), dtype=np.int64)
    for layer in range(layers):
        hist[layer] = _histogram(exponent_fields(x[layer], fmt), fmt.exponent_values)
    return hist


def best_windows(hist: np.ndarray, width: int) -> np.ndarray:
    """Start of the ``width``-wide window covering the most counts (smallest start on ties)."""
    cs = np.concatenate([np.zeros(hist.shape[:-1] + (1,), dtype=np.int64), np.cumsum(hist, axis=-1)], axis=-1)
    cover = cs[..., width:] - cs[..., :-width]          # [..., 257 - width] window sums
    return np.argmax(cover, axis=-1)                      # argmax returns the first maximum


_GROUP_ONES = np.uint64(int.from_bytes(bytes([1]) * L.GROUP_SIZE, "little"))   # 8 true bytes as one uint64


def _in_window(e: np.ndarray, bases: np.ndarray, window: int, values: int) -> np.ndarray:
    """Whether each exponent field ``e`` ``[heads, tokens, head_dim]`` lies in its channel's window
    ``bases .. bases + window - 1`` (``bases`` ``[heads, head_dim]``)."""
    b = np.asarray(bases)
    if b.size and (b.min() < 0 or b.max() > values - window):      # not a valid base: exact arithmetic
        d = e.astype(np.int16) - b.astype(np.int16)[:, None, :]
        return (d >= 0) & (d < window)
    # e - base modulo 256 is below the window exactly when e lies in it: below the base, the difference
    # wraps to 256 - (base - e) >= 256 - (values - window) >= window
    return np.subtract(e, b.astype(np.uint8)[:, None, :]) < window


def _group_all(fits: np.ndarray) -> np.ndarray:
    """``[..., head_dim]`` bools -> ``[..., head_dim / 8]``: whether all 8 channels of each group are true."""
    return np.ascontiguousarray(fits).view(np.uint64) == _GROUP_ONES


def _tile_escapes(e: np.ndarray, b_narrow, b_wide, modes: L.ModeSet) -> np.ndarray:
    """Escape bytes of every tile of one layer's exponent fields ``e`` ``[heads, tokens, head_dim]`` (whole
    blocks only), as ``[blocks, heads, tiles per head]``: FORMAT.md 5.2's mode of each group, summed."""
    from .reference.codec import escape_lengths

    heads, tokens, dim = e.shape
    blocks, c = tokens // L.BLOCK_TOKENS, L.tile_channels(dim)
    e = e[:, :blocks * L.BLOCK_TOKENS]
    values = modes.fmt.exponent_values
    narrow = _group_all(_in_window(e, b_narrow, modes.narrow_window, values))
    wide = _group_all(_in_window(e, b_wide, modes.wide_window, values))
    lengths = escape_lengths(modes)
    table = np.array([lengths[L.MODE_RAW], lengths[L.MODE_WIDE], lengths[L.MODE_NARROW], lengths[L.MODE_NARROW]],
                     dtype=np.uint8)       # by 2 * narrow + wide: the narrowest mode that holds the group
    per_group = table[(narrow.view(np.uint8) << 1) | wide.view(np.uint8)]
    per_tile = per_group.reshape(heads, blocks, L.BLOCK_TOKENS, dim // c, c // L.GROUP_SIZE).sum(
        axis=(2, 4), dtype=np.int64)
    return per_tile.transpose(1, 0, 2)


def tile_escape_bytes(x: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray,
                      modes: L.ModeSet = L.BF16_MODES) -> np.ndarray:
    """Escape bytes of every tile of one layer's cache ``[heads, tokens, head_dim]`` (whole blocks only), in
    tile order (:func:`gaac.tiles.block_tiles` of :func:`gaac.tiles.cache_blocks`)."""
    return _tile_escapes(exponent_fields(x, modes.fmt), b_narrow, b_wide, modes).reshape(-1)


def _max_tile_escapes(modes: L.ModeSet, dim: int) -> int:
    """The most escape bytes one tile of a ``dim``-wide head can need (every group raw)."""
    return L.BLOCK_TOKENS * L.tile_channels(dim) // L.GROUP_SIZE * modes.escape_bytes[L.MODE_RAW]


@dataclass(frozen=True)
class SlotLine:
    """Slot capacities whose slots fill whole ``size``-byte lines: always (``slack`` None), or only where that costs at
    most ``slack`` (a share) more resident bytes than the capacity with the fewest (else that one)."""

    size: int = 128
    slack: float | None = None


# calibrate's default for BF16: a paged pool of slots that fill whole 128-byte lines keeps every slot on a line, and
# the fused attention kernel copies such a slot in fewer shared-memory wavefronts than one that straddles lines; at
# head_dim 128 a lined capacity is often the best one plus 16 bytes (0.55% of a slot), at 64 often 48 more (3%)
PREFERRED_LINE = SlotLine(128, 0.01)


def _slot_line(slot_line) -> SlotLine | None:
    """``slot_line`` as a :class:`SlotLine`: an int is a line size taken always."""
    return SlotLine(int(slot_line)) if isinstance(slot_line, numbers.Integral) else slot_line


def _pick(cost: np.ndarray, candidates: np.ndarray, geo: L.TileGeometry, slot_line) -> np.ndarray:
    """The capacity ``candidates`` picks by ``cost`` ``[..., candidates]`` (resident bytes of each): the first with
    the fewest bytes, or a lined one as ``slot_line`` (an int, a :class:`SlotLine` or None) asks."""
    best = np.argmin(cost, axis=-1)
    line = _slot_line(slot_line)
    lined = (geo.fixed_bytes + candidates) % line.size == 0 if line is not None else None
    if lined is None or not lined.any():
        return candidates[best]
    on_line = np.argmin(np.where(lined, cost, np.iinfo(np.int64).max), axis=-1)
    if line.slack is None:
        return candidates[on_line]
    extra = np.take_along_axis(cost, on_line[..., None], -1)[..., 0]
    least = np.take_along_axis(cost, best[..., None], -1)[..., 0]
    return candidates[np.where(extra <= least * (1 + line.slack), on_line, best)]


def _capacities(counts: np.ndarray, geo: L.TileGeometry, slot_line) -> np.ndarray:
    """:func:`best_capacity` of each layer from ``counts`` ``[layers, m + 1]``: how many of its tiles need
    0 .. m escape bytes."""
    candidates = _capacity_candidates(geo)
    within = np.cumsum(counts, axis=1)                     # tiles needing at most 0 .. m escape bytes
    fits = within[:, np.minimum(candidates, counts.shape[1] - 1)]          # [layers, candidates]
    cost = fits * (geo.fixed_bytes + candidates) + (within[:, -1:] - fits) * geo.raw_bytes
    return _pick(cost.astype(np.int64), candidates, geo, slot_line).astype(np.int64)


def _capacity_candidates(geo: L.TileGeometry) -> np.ndarray:
    return np.arange(0, geo.max_useful_capacity + 1, L.SLOT_ALIGN)


def best_capacity(escapes: np.ndarray, tile, slot_line=None) -> int:
    """The escape capacity that minimises resident bytes over tiles with ``escapes`` escape bytes.

    ``tile`` is a head_dim (BF16 tiles of that head) or a :class:`gaac.layout.TileGeometry`
    (any element format: the rule is the same, only the section sizes differ).  ``slot_line``: an int asks for
    capacities whose slots are a whole number of ``slot_line``-byte lines (when there is one), a :class:`SlotLine`
    for them where they cost at most its slack more; see :func:`calibrate`.
    """
    geo = tile if isinstance(tile, L.TileGeometry) else L.geometry(tile)
    candidates = _capacity_candidates(geo)
    fits = escapes[None, :] <= candidates[:, None]
    cost = np.where(fits, geo.fixed_bytes + candidates[:, None], geo.raw_bytes).sum(axis=1).astype(np.int64)
    return int(_pick(cost, candidates, geo, slot_line))


@dataclass
class Windows:
    """Windows and capacities of one kind of a cache, for one mode set (a calibration's core)."""

    b_narrow: np.ndarray     # [layers, heads, head_dim]
    b_wide: np.ndarray
    capacity: np.ndarray     # [layers]
    raw_tiles: int = 0       # tiles of the sample whose escapes overflow their slot (measured where the
    tiles: int = 0           # capacity is chosen), and tiles of the sample


def fit_windows(x, modes: L.ModeSet = L.BF16_MODES, capacity: int | None = None,
                slot_line: int | SlotLine | None = None) -> Windows:
    """Windows and capacities for one kind of a cache ``[layers, heads, tokens, head_dim]`` of ``modes``' format.

    Per (layer, head, channel) the narrow and the wide window covering the most values
    (:func:`best_windows`); per layer the capacity that minimises resident bytes (:func:`best_capacity`),
    or ``capacity`` everywhere when given.  ``x`` is NumPy bits, or a torch tensor of BF16 bits on a device,
    fitted there (:func:`_fit_on_device`): the same windows and capacities.
    """
    if not isinstance(x, np.ndarray):
        return _fit_on_device(x, modes, capacity, slot_line)
    layers, heads, _, dim = x.shape
    bins = modes.fmt.exponent_values
    bn = np.empty((layers, heads, dim), dtype=np.intp)
    bw = np.empty((layers, heads, dim), dtype=np.intp)
    counts = np.zeros((layers, _max_tile_escapes(modes, dim) + 1), dtype=np.int64)
    for layer in range(layers):          # one layer at a time: its exponent fields serve both passes
        e = exponent_fields(x[layer], modes.fmt)
        hist = _histogram(e, bins)
        bn[layer] = best_windows(hist, modes.narrow_window)
        bw[layer] = best_windows(hist, modes.wide_window)
        if capacity is None:
            counts[layer] = np.bincount(_tile_escapes(e, bn[layer], bw[layer], modes).ravel(),
                                        minlength=counts.shape[1])
    return _windows(bn, bw, counts, modes.geometry(dim), capacity, slot_line)


def _windows(bn, bw, counts: np.ndarray, geo: L.TileGeometry, capacity: int | None, slot_line) -> Windows:
    """The :class:`Windows` of bases ``bn``, ``bw`` and each layer's tile counts by escape bytes."""
    if capacity is not None:
        return Windows(bn, bw, np.full(bn.shape[0], capacity, dtype=np.int64))
    cap = _capacities(counts, geo, slot_line)
    tiles = counts.sum(axis=1)
    fit = np.array([counts[layer, :c + 1].sum() for layer, c in enumerate(cap)], dtype=np.int64)
    return Windows(bn, bw, cap, raw_tiles=int((tiles - fit).sum()), tiles=int(tiles.sum()))


DEVICE_CHUNK = 1 << 25       # elements a device fit works on at once (its temporaries: about 10 bytes an element)


def _torch():
    import torch

    return torch


def _first_max(x, dim: int = -1):
    """Index of the first maximum of ``x`` (torch) along ``dim``, whatever the backend's argmax does on ties."""
    torch = _torch()
    top = x.amax(dim=dim, keepdim=True)
    index = torch.arange(x.shape[dim], device=x.device).view(-1, *([1] * (x.dim() - 1 - (dim % x.dim()))))
    return torch.where(x == top, index, x.shape[dim]).amin(dim=dim)


def _fit_on_device(x, modes: L.ModeSet, capacity: int | None, slot_line) -> Windows:
    """:func:`fit_windows` of int16 BF16 bits ``x`` ``[layers, heads, tokens, head_dim]`` (a torch tensor) where
    they are: the histograms, windows and each layer's tiles by escape bytes on the tensor's device, in chunks
    of at most ``DEVICE_CHUNK`` elements; one copy of the results to the host."""
    torch = _torch()
    from .reference.codec import escape_lengths

    layers, heads, tokens, dim = x.shape
    dev, bins, fmt = x.device, modes.fmt.exponent_values, modes.fmt
    c = L.tile_channels(dim)
    blocks = tokens // L.BLOCK_TOKENS
    step_l = max(1, min(layers, DEVICE_CHUNK // max(1, heads * tokens * dim)))     # whole layers where they fit
    step_t = max(tokens, 1) if heads * tokens * dim <= DEVICE_CHUNK else \
        max(L.BLOCK_TOKENS, DEVICE_CHUNK // (heads * dim) // L.BLOCK_TOKENS * L.BLOCK_TOKENS)    # else whole blocks
    chunks = [(a, min(a + step_l, layers), t, min(t + step_t, tokens))
              for a in range(0, layers, step_l) for t in range(0, tokens, step_t)]
    cells = heads * dim * bins                      # histogram bins of one layer
    cell = (torch.arange(heads * dim, device=dev, dtype=torch.int32) * bins).view(1, heads, 1, dim)
    hist = torch.zeros(layers * cells, dtype=torch.int64, device=dev)
    for a, b, t0, t1 in chunks:
        idx = exponent_fields(x[a:b, :, t0:t1], fmt).to(torch.int32) + cell
        idx += (torch.arange(b - a, device=dev, dtype=torch.int32) * cells).view(-1, 1, 1, 1)
        hist[a * cells:b * cells] += torch.bincount(idx.view(-1), minlength=(b - a) * cells)
        del idx
    hist = hist.view(layers, heads, dim, bins)
    cs = torch.nn.functional.pad(hist.cumsum(-1), (1, 0))
    bases = [_first_max(cs[..., w:] - cs[..., :-w]) for w in (modes.narrow_window, modes.wide_window)]
    top = _max_tile_escapes(modes, dim)
    counts = torch.zeros(layers * (top + 1), dtype=torch.int64, device=dev)
    if capacity is None and blocks:
        lengths = escape_lengths(modes)
        ln, lw, lr = (int(lengths[m]) for m in (L.MODE_NARROW, L.MODE_WIDE, L.MODE_RAW))
        b8 = [b.to(torch.uint8)[:, :, None, :] for b in bases]       # valid bases: the uint8 difference holds
        for a, b, t0, t1 in chunks:
            t1 = min(t1, blocks * L.BLOCK_TOKENS)       # whole blocks only
            if t1 <= t0:
                continue
            e = exponent_fields(x[a:b, :, t0:t1], fmt)
            shape = (b - a, heads, t1 - t0, dim // L.GROUP_SIZE, L.GROUP_SIZE)
            narrow = ((e - b8[0][a:b]) < modes.narrow_window).view(shape).all(-1)
            wide = ((e - b8[1][a:b]) < modes.wide_window).view(shape).all(-1)
            del e
            per_group = torch.where(narrow, ln, torch.where(wide, lw, lr))
            per_tile = per_group.view(b - a, heads, (t1 - t0) // L.BLOCK_TOKENS, L.BLOCK_TOKENS, dim // c,
                                      c // L.GROUP_SIZE).sum((3, 5))
            per_tile += (torch.arange(b - a, device=dev) * (top + 1)).view(-1, 1, 1, 1)
            counts[a * (top + 1):b * (top + 1)] += torch.bincount(per_tile.view(-1), minlength=(b - a) * (top + 1))
    host = torch.cat([bases[0].view(-1), bases[1].view(-1), counts]).cpu().numpy()
    n = layers * heads * dim
    bn, bw = (host[i * n:(i + 1) * n].reshape(layers, heads, dim).astype(np.intp) for i in (0, 1))
    return _windows(bn, bw, host[2 * n:].reshape(layers, top + 1), modes.geometry(dim), capacity, slot_line)


def _sample_bits(x, name: str):
    """``x`` as :func:`gaac.arrays.as_bits` takes it, or, for a torch tensor on a device other than the CPU, its
    int16 bits there (``[layers, kv_heads, tokens, head_dim]``)."""
    if type(x).__module__.startswith("torch") and x.device.type != "cpu":
        torch = _torch()
        if x.dtype not in (torch.bfloat16, torch.int16, torch.uint16):
            raise InputError(f"{name}: dtype {x.dtype} is not BF16; pass a torch.bfloat16 tensor "
                             "or its bits as int16/uint16")
        if x.dim() != 4:
            raise InputError(f"{name}: expected 4 dimensions, got shape {list(x.shape)}")
        return x.detach().contiguous().view(torch.int16)
    return as_bits(x, name, ndim=4)


def sample_caches(k, v):
    """The bits of sample caches ``k``, ``v`` ``[layers, kv_heads, tokens, head_dim]``, checked for a calibration:
    the same layers, heads and head_dim, at least one layer and one KV head, a supported head_dim.  NumPy
    ``uint16`` arrays, or int16 torch tensors where ``k``, ``v`` are tensors on a device other than the CPU."""
    ks, vs = _sample_bits(k, "k"), _sample_bits(v, "v")
    if isinstance(ks, np.ndarray) != isinstance(vs, np.ndarray) or \
            (not isinstance(ks, np.ndarray) and ks.device != vs.device):
        raise InputError(f"k and v must be on one device (k: {getattr(k, 'device', 'NumPy')}, "
                         f"v: {getattr(v, 'device', 'NumPy')})")
    if ks.shape[0] != vs.shape[0] or ks.shape[1] != vs.shape[1] or ks.shape[3] != vs.shape[3]:
        raise CalibrationError(f"k {list(ks.shape)} and v {list(vs.shape)} disagree on layers, heads or head_dim")
    if min(ks.shape[:2]) < 1:
        raise CalibrationError(f"calibration needs at least one layer and one KV head; the caches have "
                               f"{ks.shape[0]} layers x {ks.shape[1]} KV heads (k {list(ks.shape)}, "
                               f"v {list(vs.shape)})")
    try:
        L.tile_channels(ks.shape[3])
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    return ks, vs


def calibrate(k, v, *, format="bf16", model: str | None = None, capacity: int | None = None,
              slot_line: int | SlotLine | None = PREFERRED_LINE, scale: str = "tensor",
              show_progress: bool | None = None) -> Calibration:
    """Calibrate a cache of element format ``format`` on BF16 sample caches ``k``, ``v`` shaped
    ``[layers, kv_heads, tokens, head_dim]``.

    Inputs are torch BF16 tensors or uint16 NumPy arrays of BF16 bit patterns; BF16 windows of tensors on a
    GPU are fitted there, with the same result, and only the tables come back to the host.  For an FP8 format the
    samples are first converted with scales chosen by the policy ``scale`` of
    :func:`gaac.fp8.convert.cache_scales` (``'tensor'``: one power of two per layer and kind; ``'head'``:
    per KV head; ``'one'``: no scaling), and the windows are fitted to the converted caches.
    ``capacity`` forces one escape capacity everywhere instead of choosing it.  Otherwise each layer and
    kind takes the capacity with the fewest resident bytes, except that by default (``slot_line``
    :data:`PREFERRED_LINE`, BF16 only) it takes the best one whose slots fill whole 128-byte lines where that
    costs at most 1% more: a paged pool of such slots keeps every slot on a line, and the fused attention kernel
    copies a slot that straddles lines in more shared-memory wavefronts (docs/design/attention.md).  On the
    real SmolLM2 caches at head_dim 128 K's capacity 48 becomes 64 (+0.55% of a slot); at head_dim 64 the
    smallest lined capacity is 96, which the slack refuses where 48 fits.  ``slot_line=128`` takes lined
    capacities whatever they cost (up to 112 bytes a slot), ``None`` the fewest bytes everywhere, a
    :class:`SlotLine` its own line and slack.
    """
    ks, vs = sample_caches(k, v)
    layers, heads, tokens, dim = ks.shape
    if min(tokens, vs.shape[2]) < L.BLOCK_TOKENS and capacity is None:
        raise CalibrationError(f"calibration needs at least one full block of {L.BLOCK_TOKENS} tokens "
                               f"to choose a slot capacity; got {tokens} (k) / {vs.shape[2]} (v)")
    try:
        modes = L.mode_set(format)
    except ValueError as exc:
        raise CalibrationError(str(exc)) from None
    notes = {"tokens": {"k": int(tokens), "v": int(vs.shape[2])}}
    scales = None
    if CALIBRATION_FILES[modes.fmt.name].scales:
        from .fp8.convert import cache_scales, cache_to_fp8

        ks, vs = (x if isinstance(x, np.ndarray) else x.cpu().numpy().view(np.uint16) for x in (ks, vs))
        scales = [cache_scales(x, modes.fmt, scale) for x in (ks, vs)]
        ks, vs = (cache_to_fp8(x, modes.fmt, s) for x, s in zip((ks, vs), scales))
        notes = {"scale": scale, **notes}
    if slot_line is PREFERRED_LINE and modes.fmt is not L.BF16:
        slot_line = None          # GAAC-FP8 slots have their own sizes: the fewest bytes
    parts = [fit_windows(x, modes, capacity, slot_line)
             for x in progress((ks, vs), desc="calibrate", unit="kind", enable=show_progress)]
    tiles = sum(p.tiles for p in parts)
    if tiles and modes.fmt is L.BF16:     # what a paged cache sizes its raw-tile arena from (gaac.budget)
        notes["raw_rate"] = round(sum(p.raw_tiles for p in parts) / tiles, 6)
    return Calibration([p.b_narrow for p in parts], [p.b_wide for p in parts], [p.capacity for p in parts],
                       model=model, notes=notes, format=modes.fmt, scale_log2=scales)
