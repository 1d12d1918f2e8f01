"""Round trip and size accounting of our SplitZip-style codec (benchmarks/splitzip.py).

The codec is a benchmark baseline, not part of the package, so it is loaded
from its file; its ratio in the comparison is only worth something if every
stream decodes to the exact input bits and its byte count is what it stores.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import benchmark_module, kv_dump

splitzip = benchmark_module("splitzip")


def exponents(bits):
    return (np.asarray(bits, dtype=np.uint16) >> 7) & 0xFF


def check_round_trip(bits, codebook, chunk=splitzip.CHUNK_ELEMENTS):
    stream = splitzip.encode(bits, codebook, chunk)
    out = splitzip.decode(stream)
    assert out.dtype == np.uint16 and out.shape == bits.shape
    np.testing.assert_array_equal(out, bits)
    # Size accounting: one sm byte and half a code byte per element, 3 bytes per escape,
    # 2 bytes of escape count per chunk, and the 16-byte codebook.
    n = bits.size
    outside = ~np.isin(exponents(bits), codebook)
    assert stream.escapes == int(outside.sum())
    assert stream.nbytes == n + (n + 1) // 2 + 3 * stream.escapes + 2 * -(-n // chunk) + splitzip.CODEBOOK_SIZE
    return stream


@pytest.mark.parametrize("prompt", ["code", "list"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_real_kv_round_trip_self_and_cross_calibrated(prompt, which):
    x = kv_dump(prompt, which)
    other = kv_dump("math", which)
    for codebook in (splitzip.calibrate_codebook(x), splitzip.calibrate_codebook(other)):
        stream = check_round_trip(x, codebook)
        assert x.nbytes / stream.nbytes > 1.2     # real KV exponents are concentrated


def test_codebook_is_top16_most_frequent_first_ties_to_smaller():
    e = np.concatenate([np.full(100 - i, 100 + 3 * i) for i in range(20)] + [np.full(50, 7), np.full(50, 5)])
    bits = (e.astype(np.uint16) << 7)
    book = splitzip.calibrate_codebook(bits)
    # counts 100..81 for exponents 100,103,...; 5 and 7 tie at 50 and lose to all of those.
    assert book.tolist() == [100 + 3 * i for i in range(16)]
    assert splitzip.calibrate_codebook((np.array([5, 7] * 50 + [9], dtype=np.uint16) << 7))[:3].tolist() \
        == [5, 7, 9]


def test_few_distinct_exponents_still_give_16_codes_and_no_escapes():
    bits = np.array([0x3F80, 0xBF80, 0x4000, 0x0000], dtype=np.uint16)   # 1, -1, 2, +0
    book = splitzip.calibrate_codebook(bits)
    assert np.unique(book).size == splitzip.CODEBOOK_SIZE
    assert check_round_trip(bits, book).escapes == 0


def test_every_element_escapes_with_a_foreign_codebook():
    # Exponents 200..255 (inf/NaN included), codebook 0..15: all escape, odd length, partial last chunk.
    rng = np.random.default_rng(1)
    e = rng.integers(200, 256, size=2051)
    bits = ((rng.integers(0, 2, 2051) << 15) | (e << 7) | rng.integers(0, 128, 2051)).astype(np.uint16)
    stream = check_round_trip(bits, np.arange(16, dtype=np.uint8), chunk=1024)
    assert stream.escapes == bits.size
    assert stream.escape_counts.tolist() == [1024, 1024, 3]


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError):
        splitzip.encode(np.zeros(4, dtype=np.int32), np.arange(16))
    with pytest.raises(ValueError):
        splitzip.encode(np.zeros(4, dtype=np.uint16), np.zeros(16))          # repeated entries
    with pytest.raises(ValueError):
        splitzip.encode(np.zeros(4, dtype=np.uint16), np.arange(16), chunk=1 << 17)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=3000),
       st.lists(st.integers(0, 255), min_size=16, max_size=16, unique=True),
       st.sampled_from([1, 7, 1024]))
def test_any_bits_any_codebook_round_trip(values, book, chunk):
    check_round_trip(np.array(values, dtype=np.uint16), np.array(book, dtype=np.uint8), chunk)
