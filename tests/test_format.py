"""gaac.format: the sequence container (FORMAT.md section 11) read, checked, decoded and written with NumPy alone.

A third party reads a container with ``gaac.format`` and no torch: the package imports neither torch nor
numba, reads every sequence vector to its expected K and V and refuses every must-reject vector with the
error and phrase of its rule; a container exported from a cache reads back to what the cache reads, and the
writer writes it again byte for byte.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gaac
from gaac import format as F
from gaac import layout as L
from gaac.cache import PagedKVCache
from gaac.calibration import calibrate
from gaac.errors import FormatError
from gaac.io import load_sample

ROOT = Path(__file__).resolve().parents[1]
SEQUENCE = ROOT / "format_spec" / "vectors" / "sequence"


def run_alone(script: str) -> str:
    """Run ``script`` in a fresh interpreter (no conftest, no torch imported by anything but the script's own
    imports); fail with its output unless it exits 0.  Returns its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_format_imports_neither_torch_nor_numba():
    out = run_alone("""
        import sys
        import gaac.format
        print(sorted(m for m in ("torch", "numba") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_the_vectors_read_with_gaac_format_alone():
    """Every valid sequence vector reads to its expected K and V (with its calibration file, and with the
    embedded one where it has one); every must-reject vector is refused with its rule's error and phrase, the
    head's rules, then the calibration's (C1-C3, C5), then the body's -- the order of an import.  torch and
    numba are never imported."""
    out = run_alone(f"""
        import json, sys
        from pathlib import Path
        import numpy as np
        import gaac
        from gaac import format as F

        SEQUENCE = Path({str(SEQUENCE)!r})
        checked = 0
        for path in sorted(SEQUENCE.glob("seq_*.json")):
            meta = json.loads(path.read_text())
            seq = F.read_sequence(path.with_suffix(".bin").read_bytes())
            cals = [gaac.Calibration.load(SEQUENCE / meta["calibration"])] + [None] * meta["calibration_embedded"]
            for cal in cals:
                for kind, got in zip("kv", seq.decode(cal)):
                    want = np.array([[[[int(row[i:i + 4], 16) for i in range(0, len(row), 4)] for row in head]
                                      for head in layer] for layer in meta["expected"][kind]], dtype=np.uint16)
                    np.testing.assert_array_equal(got, want)
                    checked += 1
            assert [[f"{{r.bases_id:08x}}" for r in s.epochs] for s in seq.sections] == \\
                [[e["bases_id"] for e in s["epochs"]] for s in meta["sections"]]
        for entry in json.loads((SEQUENCE / "reject.json").read_text()):
            data = (SEQUENCE / (entry["name"] + ".bin")).read_bytes()
            try:
                c = F.read_head(data)
                cal = c.calibration if entry["calibration"] is None else \\
                    gaac.Calibration.load(SEQUENCE / entry["calibration"])
                F.check_calibration(c, cal, entry["adapt"])
                F.read_sequence(data)
            except (gaac.FormatError, gaac.CalibrationError) as exc:
                assert type(exc).__name__ == entry["error"] and entry["message"] in str(exc), (entry, exc)
                checked += 1
            else:
                raise AssertionError(entry["name"] + " was read")
        assert not {{"torch", "numba"}} & set(sys.modules), sorted({{"torch", "numba"}} & set(sys.modules))
        print(checked)
    """)
    rejects = len(json.loads((SEQUENCE / "reject.json").read_text()))
    assert int(out) == rejects + 2 * sum(1 + json.loads(p.read_text())["calibration_embedded"]
                                         for p in SEQUENCE.glob("seq_*.json"))


@pytest.fixture(scope="module")
def exported():
    """A real sequence (333 tokens: blocks and a tail) in a cache whose calibration comes from another prompt,
    so that some tiles are raw, exported with and without its calibration embedded."""
    k, v, _ = load_sample("prose")
    ck, cv, _ = load_sample("code")
    cal = calibrate(ck, cv)
    cache = PagedKVCache(cal, max_blocks=24, grow=True)
    seq = cache.add_sequence(k[:, :, :333], v[:, :, :333])
    return cache, seq, bytes(cache.export_sequence(seq)), bytes(cache.export_sequence(seq, calibration=True))


def test_an_exported_container_reads_back_as_the_cache_reads_it(exported):
    cache, seq, plain, embedded = exported
    want = cache.read(seq)
    for data, cal in ((plain, cache.calibration), (embedded, None), (embedded, cache.calibration)):
        got = F.read_sequence(data).decode(cal)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    sections = F.read_sequence(plain).sections
    assert sum(s.raw.shape[0] for s in sections) > 0           # raw tiles as well as slots
    assert all(s.tail.shape[1] == 333 % L.BLOCK_TOKENS for s in sections)
    with pytest.raises(gaac.CalibrationError, match="carries no calibration"):
        F.read_sequence(plain).decode()


def test_the_writer_writes_what_it_reads_byte_for_byte(exported):
    cache, _, plain, embedded = exported
    for data, canonical in ((plain, None), (embedded, cache.calibration.canonical_bytes())):
        seq = F.read_sequence(data)
        lay = seq.layout
        assert F.write_sequence(lay.kv_heads, lay.head_dim, lay.tokens, seq.sections, seq.container.calibration_id,
                                canonical) == data
    for name in ("seq_epochs", "seq_embedded", "seq_heads", "seq_heads_d256"):
        data = (SEQUENCE / f"{name}.bin").read_bytes()
        seq = F.read_sequence(data)
        canonical = seq.container.calibration.canonical_bytes() if seq.container.calibration else None
        lay = seq.layout
        assert F.write_sequence(lay.kv_heads, lay.head_dim, lay.tokens, seq.sections, seq.container.calibration_id,
                                canonical) == data, name


def test_the_reader_refuses_what_an_import_refuses(exported):
    """A body byte changed: the chunk CRC (S13), with the words of an import; the same change with the CRCs
    recomputed by the writer: the block table rule (S14), with the words of an import."""
    cache, _, plain, _ = exported
    seq = F.read_sequence(plain)
    s = seq.layout.sections[1]
    corrupt = bytearray(plain)
    corrupt[seq.layout.body_offset + s.table] ^= 1
    with pytest.raises(FormatError) as ours:
        F.read_sequence(bytes(corrupt))
    with pytest.raises(FormatError) as theirs:
        PagedKVCache(cache.calibration, max_blocks=24, grow=True).import_sequence(bytes(corrupt))
    assert "CRC-32 mismatch" in str(ours.value) and str(ours.value) == str(theirs.value)

    sections = list(seq.sections)
    table = sections[1].table.copy()
    table.reshape(-1)[0] ^= 1
    sections[1] = F.SectionData(**{**sections[1].__dict__, "table": table})
    lay = seq.layout
    rewritten = F.write_sequence(lay.kv_heads, lay.head_dim, lay.tokens, sections, seq.container.calibration_id)
    with pytest.raises(FormatError) as ours:
        F.read_sequence(rewritten)
    with pytest.raises(FormatError) as theirs:
        PagedKVCache(cache.calibration, max_blocks=24, grow=True).import_sequence(rewritten)
    assert "block table entry" in str(ours.value) and str(ours.value) == str(theirs.value)


def test_the_layout_is_the_containers(exported):
    """Offsets and sizes from the counts alone: the head and the body as read, the size before it is read
    (container_nbytes) and the bound before it is made (worst_case_bytes)."""
    cache, _, plain, embedded = exported
    for data, with_cal in ((plain, False), (embedded, True)):
        c = F.read_head(data)
        lay = c.layout
        again = F.sequence_layout(lay.layers, lay.kv_heads, lay.head_dim, lay.tokens,
                                  [s.capacity for s in lay.sections], [s.raw_tiles for s in lay.sections],
                                  [s.epochs for s in lay.sections], with_cal)
        assert again == lay and lay.nbytes == len(data) == F.container_nbytes(data + bytes(100))
        assert lay.body_offset % L.SEQUENCE_ALIGN == 0 and all(
            p % L.SEQUENCE_ALIGN == 0 for s in lay.sections for p in (s.table, s.block_epochs, s.slots))
        assert F.worst_case_bytes(lay.layers, lay.kv_heads, lay.head_dim, lay.tokens, cache.calibration.capacity,
                                  calibration=with_cal) >= len(data)
