"""Fuzzing the public entry points with random and mutated input.

Every test here feeds bytes, JSON, files or call sequences that are random or are valid ones with
a few changes, and checks two things only: nothing but a :class:`gaac.GAACError` subclass escapes,
and what is accepted decodes bit-exact -- to the values that were encoded where the input was not
changed, and to an independent decoder (``spec_decoder``, ``test_fp8.spec_decode_slot``) where a
change that keeps the container valid was accepted.  The example counts keep the whole module well
under a minute.
"""
import json
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gaac
import gaac.transfer  # noqa: F401  (gaac.transfer.unpack below; import gaac alone does not load it)
import spec_decoder
from gaac import layout as L
from gaac.calibration import Calibration, calibrate
from gaac.errors import GAACError
from gaac.io import load_cache, load_sample
from gaac.tiles import block_tiles, tile_bases
from strategies import block_cases
from test_fp8 import spec_decode_slot

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])
FEW = settings(FUZZ, max_examples=15)
MANY = settings(FUZZ, max_examples=150)
TMP = Path(tempfile.mkdtemp(prefix="gaac-fuzz-"))


def refused_or(call):
    """``call()``'s result, or None when it raised a :class:`GAACError` (anything else fails the test)."""
    try:
        return call()
    except GAACError as exc:
        event(f"refused: {type(exc).__name__}")
        return None


# -- mutations of byte strings -----------------------------------------------------------------------

@st.composite
def mutated(draw, data: bytes, resign: bool = True):
    """``(bytes, changed positions)``: ``data`` with a few bytes changed, cut short, extended or replaced.

    With ``resign`` a changed container may get its CRC-32 recomputed, so that the checks behind
    the CRC see the change (a stream edited on purpose, FORMAT.md section 8).
    """
    how = draw(st.sampled_from(("flip", "flip", "flip", "truncate", "extend", "random", "none")))
    out = bytearray(data)
    changed = set()
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(out) - 1))
            out[at] ^= draw(st.integers(1, 255))
            changed.add(at)
        if resign and draw(st.booleans()) and len(out) >= 4:
            out[-4:] = struct.pack("<I", zlib.crc32(bytes(out[:-4])))
            changed.discard(len(out) - 4)
    elif how == "truncate":
        out = out[:draw(st.integers(0, len(out) - 1))]
        changed.add(len(out))
    elif how == "extend":
        out += draw(st.binary(min_size=1, max_size=64))
        changed.add(len(data))
    elif how == "random":
        out = bytearray(draw(st.binary(max_size=2 * len(data))))
        changed.add(0)
    return bytes(out), changed


def _payload_tiles(data: bytes, n_tiles: int, is_raw: np.ndarray, slot_bytes: int, raw_bytes: int, changed) -> set:
    """Tiles whose slot or raw tile holds a changed byte; None where a change is outside the payload."""
    table_end = L.STREAM_HEADER_BYTES + n_tiles * L.TABLE_ENTRY_BYTES
    slot_tiles, raw_tiles = np.flatnonzero(~is_raw), np.flatnonzero(is_raw)
    raw_start = table_end + len(slot_tiles) * slot_bytes
    hit = set()
    for at in changed:
        if table_end <= at < raw_start:
            hit.add(int(slot_tiles[(at - table_end) // slot_bytes]))
        elif raw_start <= at < len(data) - 4:
            hit.add(int(raw_tiles[(at - raw_start) // raw_bytes]))
        else:
            return None
    return hit


# -- block containers: BF16 --------------------------------------------------------------------------

@MANY
@given(case=block_cases(), data=st.data())
def test_bf16_decoder_takes_random_and_mutated_containers(case, data):
    block = gaac.encode_block(case.bits, case.calibration, case.layer, case.kind)
    stream, changed = data.draw(mutated(block.data))
    out = refused_or(lambda: gaac.decode_block(stream, case.calibration))
    if out is None:
        return
    assert out.dtype == np.uint16 and out.shape == case.bits.shape
    if stream == block.data:
        np.testing.assert_array_equal(out, case.bits)
        return
    # An accepted change re-signed its CRC: the values are the spec decoder's, bit for bit, and where the
    # change is inside the slots or raw tiles, every other tile is as encoded.
    spec_cal = spec_decoder.load_calibration(case.calibration.to_dict())
    spec = spec_decoder.decode_block(stream, spec_cal)
    np.testing.assert_array_equal(out, np.array(spec.values, dtype=np.uint16))
    is_raw = np.array([s == "raw" for s in spec.storage])
    geo = L.geometry(case.head_dim)
    hit = _payload_tiles(stream, len(is_raw), is_raw, geo.slot_bytes(case.capacity), geo.raw_bytes, changed)
    if hit is not None:
        keep = np.setdiff1d(np.arange(len(is_raw)), sorted(hit))
        np.testing.assert_array_equal(block_tiles(out)[keep], block_tiles(case.bits)[keep])
        event("accepted a payload change")


@MANY
@given(data=st.binary(max_size=600), head=st.booleans())
def test_bf16_decoder_takes_random_bytes(data, head):
    cal = _small_calibration()
    if head:            # a valid header in front, so that the checks behind it see random bytes
        data = struct.pack("<4sBBBBHHHHI4s", L.STREAM_MAGIC, 2, L.ELEMENT_BF16, 0, 16, 0, 1, 64,
                           int(cal.capacity[0, 0]), cal.id, bytes(4)) + data
        data += struct.pack("<I", zlib.crc32(data))
    out = refused_or(lambda: gaac.decode_block(data, cal))
    if out is not None:
        np.testing.assert_array_equal(out, np.array(spec_decoder.decode_block(
            data, spec_decoder.load_calibration(cal.to_dict())).values, dtype=np.uint16))


_CAL = {}


def _small_calibration() -> Calibration:
    """A calibration of 2 layers, 1 KV head, head_dim 64 on the shipped sample."""
    if "bf16" not in _CAL:
        k, v, _ = load_sample("prose")
        _CAL["bf16"] = calibrate(k[:2, :1, :128], v[:2, :1, :128])
    return _CAL["bf16"]


# -- block containers: FP8 ---------------------------------------------------------------------------

@FUZZ
@given(fmt=st.sampled_from(("fp8_e4m3", "fp8_e5m2")), seed=st.integers(0, 2 ** 32 - 1), kind=st.sampled_from("kv"),
       data=st.data())
def test_fp8_decoder_takes_random_and_mutated_containers(fmt, seed, kind, data):
    from gaac.fp8 import decode_fp8_block, encode_fp8_block
    from gaac.layout import mode_set

    cal = _fp8_calibration(fmt)
    rng = np.random.default_rng(seed)
    k, _, _ = load_sample("code")
    start = int(rng.integers(0, k.shape[2] // 16)) * 16
    x = _to_fp8(k[1, :1, start:start + 16], cal, L.KIND_K if kind == "k" else L.KIND_V)
    if rng.integers(0, 4) == 0:                                   # now and then: any FP8 byte at all
        x = rng.integers(0, 256, x.shape, dtype=np.uint8)
    block = encode_fp8_block(x, cal, 1, kind)
    stream, changed = data.draw(mutated(block.data))
    out = refused_or(lambda: decode_fp8_block(stream, cal))
    if out is None:
        return
    assert out.dtype == np.uint8 and out.shape == x.shape
    if stream == block.data:
        np.testing.assert_array_equal(out, x)
        return
    # A re-signed change was accepted: every slot decodes as the spec's FP8 decoder says.
    c = gaac.format.block.read_container(stream, mode_set(fmt).fmt)
    if c.kind != block.kind or c.layer != block.layer:
        event("accepted a re-signed header naming another layer or kind (FORMAT.md 8: not detected)")
        return
    bn, bw = tile_bases(*cal.bases(1, c.kind))
    tiles = block_tiles(out)
    for slot, t in zip(c.slots, c.slot_tiles):
        want = spec_decode_slot(bytes(slot), fmt, c.geo.channels, c.capacity, bn[t].tolist(), bw[t].tolist())
        assert tiles[t].reshape(-1).tolist() == want
    hit = _payload_tiles(stream, c.n_tiles, c.is_raw, c.geo.slot_bytes(c.capacity), c.geo.raw_bytes, changed)
    if hit is not None:
        keep = np.setdiff1d(np.arange(c.n_tiles), sorted(hit))
        np.testing.assert_array_equal(tiles[keep], block_tiles(x)[keep])


def _fp8_calibration(fmt):
    from gaac.fp8 import calibrate_fp8

    if fmt not in _CAL:
        k, v, _ = load_sample("prose")
        _CAL[fmt] = calibrate_fp8(k[:2, :1, :128], v[:2, :1, :128], fmt)
    return _CAL[fmt]


def _to_fp8(bits, cal, kind):
    from gaac.fp8 import to_fp8

    scale = cal.scale_log2[kind, 1].astype(np.int64)[:, None, None]
    return to_fp8(np.ascontiguousarray(bits), cal.modes.fmt, scale)


# -- calibration files -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _paths(obj, prefix=()):
    """Every path (a tuple of keys and indices) into a parsed JSON value, the root included."""
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _paths(value, prefix + (i,))


@st.composite
def mutated_json(draw, valid: dict):
    """``valid`` with one value replaced, deleted, nudged by one or wrapped in a list, at a drawn path."""
    d = json.loads(json.dumps(valid))
    paths = [p for p in _paths(d) if p]
    path = draw(st.sampled_from(paths))
    parent = d
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    how = draw(st.sampled_from(("replace", "delete", "nudge", "wrap")))
    if how == "replace":
        parent[last] = draw(json_values)
    elif how == "delete":
        del parent[last]
    elif how == "nudge" and type(parent[last]) is int:
        parent[last] += draw(st.sampled_from((-1, 1, 256, -256)))
    elif how == "wrap":
        parent[last] = [parent[last]]
    return d


def _drop_ids(obj) -> None:
    """Remove every ``id`` key of a calibration file, at any depth (the top level's and the epochs'), in place."""
    if isinstance(obj, dict):
        obj.pop("id", None)
        children = obj.values()
    else:
        children = obj if isinstance(obj, list) else ()
    for child in children:
        _drop_ids(child)


def _load_json_text(text, family=None):
    path = TMP / "cal.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return Calibration.load(path, family)


@FUZZ
@given(data=st.data(), epochs=st.booleans())
def test_calibration_loader_takes_mutated_files(data, epochs):
    cal = _small_calibration()
    if epochs:
        cal = cal.copy()
        cal.add_epoch(1, 0, np.minimum(cal.b3[0, 1] + 1, L.B3_MAX), cal.b4[0, 1])
    d = data.draw(mutated_json(cal.to_dict()))
    if data.draw(st.booleans()):
        _drop_ids(d)            # ids are optional: without them a changed table is checked on its own merits
    loaded = refused_or(lambda: _load_json_text(json.dumps(d)))
    if loaded is None:
        return
    event("accepted")
    # Accepted: a calibration that codes and decodes a block bit-exact and saves to an equal file.
    again = Calibration.from_dict(json.loads(json.dumps(loaded.to_dict())))
    assert again.id == loaded.id and again.to_dict() == loaded.to_dict()
    k, _, _ = load_sample("code")
    for layer in range(loaded.layers):
        block = k[layer % 4, :loaded.kv_heads, 16:32, :loaded.head_dim]
        if block.shape == (loaded.kv_heads, 16, loaded.head_dim):
            enc = gaac.encode_block(block, loaded, layer, "k")
            np.testing.assert_array_equal(gaac.decode_block(enc.data, loaded), block)


@FUZZ
@given(value=json_values, raw=st.binary(max_size=64))
def test_calibration_loaders_take_random_json_and_bytes(value, raw):
    from gaac.calibration import BF16_FILE, FP8_FILE

    for family in (None, BF16_FILE, FP8_FILE):
        refused_or(lambda: Calibration.from_dict(value, family))
        refused_or(lambda: _load_json_text(json.dumps(value), family))
        refused_or(lambda: _load_json_text(raw, family))


@FEW
@given(data=st.data(), fmt=st.sampled_from(("fp8_e4m3", "fp8_e5m2")))
def test_fp8_calibration_loader_takes_mutated_files(data, fmt):
    from gaac.calibration import FP8_FILE
    from gaac.fp8 import decode_fp8_block, encode_fp8_block

    cal = _fp8_calibration(fmt)
    d = data.draw(mutated_json(cal.to_dict()))
    if data.draw(st.booleans()):
        _drop_ids(d)
    loaded = refused_or(lambda: _load_json_text(json.dumps(d), FP8_FILE))
    if loaded is None:
        return
    event("accepted")
    assert Calibration.from_dict(loaded.to_dict()).id == loaded.id
    k, _, _ = load_sample("code")
    if loaded.kv_heads == 1 and loaded.head_dim == 64:
        x = _to_fp8(k[1, :1, 16:32], loaded, 0) if loaded.layers > 1 else None
        if x is not None:
            np.testing.assert_array_equal(decode_fp8_block(encode_fp8_block(x, loaded, 1, "k").data, loaded), x)


# -- cache files -------------------------------------------------------------------------------------

def _cache_file_bytes(suffix: str) -> tuple[bytes, np.ndarray]:
    """A valid cache file of 1 layer, 1 KV head, 16 tokens of head_dim 64, and the array it holds."""
    k, _, _ = load_sample("prose")
    x = np.ascontiguousarray(k[:1, :1, :16])
    path = TMP / f"valid{suffix}"
    if suffix == ".npy":
        np.save(path, x)
    elif suffix == ".safetensors":
        header = json.dumps({"__metadata__": {"format": "pt"},
                             "k": {"dtype": "BF16", "shape": list(x.shape), "data_offsets": [0, x.nbytes]}}).encode()
        path.write_bytes(struct.pack("<Q", len(header)) + header + x.tobytes())
    else:
        import torch

        torch.save({"k": torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)}, path)
    return path.read_bytes(), x


def _safetensors_region(data: bytes):
    """The bytes a safetensors file's ``k`` entry declares, or its only tensor's (a mutation can rename the key:
    the loader takes a file's single tensor whatever its name), read by hand (the loader's oracle)."""
    (n,) = struct.unpack_from("<Q", data)
    tensors = {key: v for key, v in json.loads(data[8:8 + n]).items() if key != "__metadata__"}
    entry = tensors["k"] if "k" in tensors else next(iter(tensors.values()))
    begin, end = entry["data_offsets"]
    return np.frombuffer(data[8 + n + begin:8 + n + end], dtype="<u2"), entry["shape"]


@FUZZ
@given(suffix=st.sampled_from((".npy", ".safetensors")), data=st.data())
def test_cache_loaders_take_mutated_files(suffix, data):
    valid, x = _cache_file_bytes(suffix)
    blob, _ = data.draw(mutated(valid, resign=False))
    path = TMP / f"fuzz{suffix}"
    path.write_bytes(blob)
    out = refused_or(lambda: load_cache(path, "k"))
    if out is None:
        return
    assert out.dtype == np.uint16 and out.ndim == 4 and out.shape[3] in L.SUPPORTED_HEAD_DIMS
    if blob == valid:
        np.testing.assert_array_equal(out, x)
    elif suffix == ".safetensors":
        region, shape = _safetensors_region(blob)
        np.testing.assert_array_equal(out.reshape(-1), region)
        assert list(out.shape) == shape


@FUZZ
@given(data=st.data())
def test_safetensors_loader_takes_mutated_headers(data):
    valid, x = _cache_file_bytes(".safetensors")
    (n,) = struct.unpack_from("<Q", valid)
    header = json.loads(valid[8:8 + n])
    d = data.draw(mutated_json(header))
    raw = json.dumps(d).encode()
    path = TMP / "header.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + valid[8 + n:])
    out = refused_or(lambda: load_cache(path, "k"))
    if out is not None:
        region, shape = _safetensors_region(path.read_bytes())
        np.testing.assert_array_equal(out.reshape(-1), region)
        assert list(out.shape) == shape


@FEW
@given(data=st.data())
def test_torch_loader_takes_mutated_files(data):
    pytest.importorskip("torch")
    valid, x = _cache_file_bytes(".pt")
    blob, _ = data.draw(mutated(valid, resign=False))
    path = TMP / "fuzz.pt"
    path.write_bytes(blob)
    out = refused_or(lambda: load_cache(path, "k"))
    if out is not None and blob == valid:
        np.testing.assert_array_equal(out, x)


# -- the paged cache ---------------------------------------------------------------------------------

BAD_SEQS = (True, False, 0.0, 1.5, "0", None, [0], -1, 99, np.float64(1.0), np.bool_(True))


def _bad_arrays(k: np.ndarray):
    """Arrays the cache must refuse (or, for the last two, take as the bits they are)."""
    import torch

    return {
        "float32": k.astype(np.float32), "3-d": k[0], "heads": k[:, :1], "head_dim": k[..., :32],
        "layers": k[:1], "list": k.tolist(), "none": None, "string": "bits",
        "meta": torch.empty(k.shape, dtype=torch.bfloat16, device="meta"),
        "float16 tensor": torch.zeros(k.shape, dtype=torch.float16),
        "reversed": k[:, :, ::-1], "int16 tensor": torch.from_numpy(k.view(np.int16).copy()),
    }


ops = st.lists(st.tuples(st.sampled_from(("add", "append", "append", "update", "remove", "read")),
                         st.integers(0, 40), st.integers(0, 3), st.integers(0, 3 * len(BAD_SEQS)),
                         st.integers(0, 15)), max_size=10)


def _bits_of(x) -> np.ndarray:
    """The uint16 bits of an array the cache accepted (a NumPy array of any strides, or an int16 tensor)."""
    if not isinstance(x, np.ndarray):
        x = x.numpy()
    return np.ascontiguousarray(x).view(np.uint16)


@FUZZ
@given(first=st.integers(0, 60), steps=ops)
def test_cache_api_takes_random_calls(first, steps):
    """Random calls, many with bad ids or arrays: only GAACErrors, a refused call changes nothing, and every
    live sequence reads back bit-exact; removing every sequence returns every pool record."""
    pytest.importorskip("torch")
    k_all, v_all, _ = load_sample("prose")
    k_all, v_all = k_all[:2, :1], v_all[:2, :1]
    cache = gaac.PagedKVCache(_small_calibration(), max_seqs=3, max_blocks=8, slots=20, raw_tiles=4)
    model = {}                       # sequence id -> (K, V) uint16 [layers, 1, tokens, 64] it was given
    empty = np.zeros((2, 1, 0, 64), np.uint16)
    seq = cache.add_sequence(k_all[:, :, :first], v_all[:, :, :first])
    model[seq] = (k_all[:, :, :first], v_all[:, :, :first])
    for what, tokens, which, bad, bad_array in steps:
        live = sorted(model)
        if bad < len(BAD_SEQS):
            seq = BAD_SEQS[bad]
        else:
            seq = live[which % len(live)] if live and bad > len(BAD_SEQS) else which
        start = 37 * which
        k, v = k_all[:, :, start:start + tokens], v_all[:, :, start:start + tokens]
        if bad_array < 12 and tokens % 3 == 0:
            k = list(_bad_arrays(k).values())[bad_array]
        before = {s: cache.read(s) for s in model}
        try:
            if what == "add":
                new = cache.add_sequence(k, v)
                model[new] = (_bits_of(k), _bits_of(v))
            elif what == "append":
                cache.append(seq, k, v)
                model[seq] = tuple(np.concatenate([m, _bits_of(x)], axis=2) for m, x in zip(model[seq], (k, v)))
            elif what == "update":
                for layer in range(cache.layers):
                    part = k[layer:layer + 1] if isinstance(k, np.ndarray) else k
                    cache.update_layer(layer, [seq], part, v[layer:layer + 1])
                model[seq] = tuple(np.concatenate([m, _bits_of(x)], axis=2) for m, x in zip(model[seq], (k, v)))
            elif what == "remove":
                cache.remove_sequence(seq)
                del model[seq]
            else:
                got = cache.read(seq)
                np.testing.assert_array_equal(got[0], model[seq][0])
        except GAACError:
            event(f"refused {what}")
            if what == "update" and type(seq) is int and seq in live:
                # A layer refused after an earlier one was appended leaves the sequence mid-update: drop it.
                cache.remove_sequence(seq)
                del model[seq]
            for s, (got_k, got_v) in before.items():
                if s in model:
                    now = cache.read(s)
                    np.testing.assert_array_equal(now[0], got_k)
                    np.testing.assert_array_equal(now[1], got_v)
        except KeyError:                     # the model's own lookup of an id the cache should have refused
            raise AssertionError(f"the cache accepted {what} on sequence {seq!r}") from None
        else:
            event(f"accepted {what}")
        assert cache.sequences == sorted(model)
    for seq, (k, v) in model.items():
        got_k, got_v = cache.read(seq)
        np.testing.assert_array_equal(got_k, k if k.size else empty)
        np.testing.assert_array_equal(got_v, v if v.size else empty)
        cache.remove_sequence(seq)
    report = cache.memory()
    assert report.slot_bytes == report.raw_bytes == report.tokens == 0


# -- sequence containers ---------------------------------------------------------------------------

SEQUENCE = Path(__file__).resolve().parents[1] / "format_spec" / "vectors" / "sequence"


@FUZZ
@given(name=st.sampled_from(("seq_epochs", "seq_embedded")), data=st.data())
def test_sequence_import_takes_mutated_containers(name, data):
    """A sequence container with epoch records (or its calibration embedded), mutated: an import refuses it
    with a GAACError and leaves the cache empty and its pools as they were, or accepts it and reads back
    what the independent spec decoder reads from the same bytes."""
    meta = json.loads((SEQUENCE / f"{name}.json").read_text())
    buf, _ = data.draw(mutated((SEQUENCE / f"{name}.bin").read_bytes()))
    if meta["calibration_embedded"]:
        got = refused_or(lambda: gaac.transfer.unpack(buf))
        spec_cal = None
    else:
        cal = Calibration.load(SEQUENCE / meta["calibration"])
        cache = gaac.PagedKVCache(cal, max_blocks=8, raw_tiles=8 * cal.kv_heads * 2 * cal.layers)
        before = cache.memory()
        seq = refused_or(lambda: cache.import_sequence(buf))
        if seq is None:
            assert cache.sequences == [] and cache.memory() == before
            got = None
        else:
            got = cache.read(seq)
        spec_cal = spec_decoder.load_calibration(SEQUENCE / meta["calibration"])
    if got is not None:
        want = spec_decoder.read_sequence(buf, spec_cal).values
        for kind in range(2):
            np.testing.assert_array_equal(got[kind], np.array(want[kind], dtype=np.uint16))
