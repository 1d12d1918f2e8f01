"""gaac.lmcache: the LMCache serde stores KV chunks as sequence containers and restores them bit for bit, within
the size it promises; worst_case_bytes bounds every sequence container.

The serde's own tests run on stand-ins of LMCache's memory objects (the attributes the serde uses); the tests
named ``test_lmcache_*`` run through LMCache's own classes (its registry, ``TensorMemoryObj``,
``AsyncSerdeProcessor``, ``L1Manager``, the fs adapter and ``SerdeL2AdapterWrapper``) where the ``lmcache``
package is installed, and are skipped where it is not."""
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gaac
from strategies import bf16_bits, calibrations, drifting
from gaac import layout as L
from gaac import transfer
from gaac.cache import PagedKVCache
from gaac.calibration import Calibration, calibrate, canonical_bytes_size
from gaac.errors import CalibrationError, FormatError, InputError
from gaac.lmcache import GaacDeserializer, GaacSerializer, container_nbytes, worst_case_bytes

B = L.BLOCK_TOKENS


# ----------------------------------------------------------------------------------------------
# worst_case_bytes bounds every container.

def _container(cal, k, v, adapt: bool, embed: bool) -> bytes:
    cache = PagedKVCache(cal, max_blocks=max(1, k.shape[2] // B), grow=True, adapt=adapt)
    return bytes(cache.export_sequence(cache.add_sequence(k, v), calibration=embed))


@st.composite
def containers(draw):
    """A container of random small dimensions: random or raw-heavy (capacity 0) calibrations, uniform or
    clustered bits, with or without epoch records and an embedded calibration."""
    layers, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    dim = draw(st.sampled_from(L.SUPPORTED_HEAD_DIMS))
    tokens = draw(st.integers(0, 5 * B + 3))
    cal = draw(calibrations(layers, heads, dim))
    if draw(st.booleans()):
        cal.capacity[...] = 0                                  # every tile with an escape is raw
    shape = (layers, heads, tokens, dim)
    centres = None if draw(st.booleans()) else np.full((heads, dim), draw(st.integers(0, 255)))
    k, v = draw(bf16_bits(shape, centres)), draw(bf16_bits(shape, centres))
    adapt = draw(st.booleans())
    if adapt:                                                  # newer epochs: blocks use the newest, a record each
        for _ in range(draw(st.integers(0, 2))):
            layer, kind = draw(st.integers(0, layers - 1)), draw(st.sampled_from((0, 1)))
            b3, b4 = cal.bases(layer, kind, 0)
            cal.add_epoch(layer, kind, np.minimum(b3.astype(np.int64) + 1, L.B3_MAX), b4)
    embed = draw(st.booleans())
    return cal, k, v, adapt, embed, centres is None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(containers())
def test_worst_case_bytes_bounds_every_container(case):
    cal, k, v, adapt, embed, uniform = case
    data = _container(cal, k, v, adapt, embed)
    lay = transfer.read_head(data).layout
    records = max(len(s.epochs) for s in lay.sections)
    dims = (cal.layers, cal.kv_heads, cal.head_dim, k.shape[2])
    bound = worst_case_bytes(*dims, cal.capacity, calibration=embed)
    assert len(data) <= worst_case_bytes(*dims, cal.capacity, epoch_records=records, calibration=embed) <= bound
    assert container_nbytes(data) == container_nbytes(data + bytes(37)) == len(data)
    if (cal.capacity <= L.geometry(cal.head_dim).max_useful_capacity).all():
        assert len(data) <= worst_case_bytes(*dims, None, epoch_records=records, calibration=embed)
    if uniform and not cal.capacity.any() and not records:    # all raw: the bound is the size
        assert all(s.slot_tiles == 0 for s in lay.sections)
        assert len(data) == worst_case_bytes(*dims, cal.capacity, epoch_records=0, calibration=embed)


def test_worst_case_bytes_with_adaptation_epochs():
    """Epochs of the cache's own rule (after 48 blocks): their records fit the bound."""
    rng = np.random.default_rng(8)
    k, v = drifting(rng, 1, 1, 80 * B + 3, 64, 8.0), drifting(rng, 1, 1, 80 * B + 3, 64, 0.0)
    cal = calibrate(k[:, :, :256], v[:, :, :256])
    data = _container(cal, k, v, adapt=True, embed=True)
    records = max(len(s.epochs) for s in transfer.read_head(data).layout.sections)
    assert records > 0
    dims = (1, 1, 64, k.shape[2])
    lay = transfer.read_head(data).layout
    assert len(data) <= worst_case_bytes(*dims, epoch_records=records, calibration=True)
    # the head as worst_case_bytes counts it: header, section records, epoch records, calibration, CRCs
    record_bytes = sum(len(s.epochs) for s in lay.sections) * (L.SEQUENCE_EPOCH.size + 2 * 64)
    assert lay.head_bytes == (L.SEQUENCE_HEADER.size + 2 * L.SEQUENCE_SECTION.size + record_bytes
                              + canonical_bytes_size(1, 1, 64) + 4 * lay.chunks + 4)


def test_worst_case_bytes_counts_each_part():
    geo = L.geometry(128)
    # 2 layers x 2 KV heads x 40 tokens: 2 blocks and 8 tail tokens; every tile raw, no records, no calibration
    sections = 2 * 2
    body = sections * (16 + 16 + 2 * 2 * 8 * 128 + 2 * 2 * geo.raw_bytes)
    head = L.SEQUENCE_HEADER.size + sections * L.SEQUENCE_SECTION.size + 4 + 4
    assert worst_case_bytes(2, 2, 128, 40, epoch_records=0) == worst_case_bytes(2, 2, 128, 40, 0, epoch_records=0) \
        == -(-head // 16) * 16 + body
    # a slot larger than a raw tile costs its size; without a limit on records, one a block (S16)
    assert worst_case_bytes(2, 2, 128, 40, 1296, epoch_records=0) == worst_case_bytes(2, 2, 128, 40, epoch_records=0) \
        + sections * 4 * (geo.slot_bytes(1296) - geo.raw_bytes)
    head += sections * 2 * (L.SEQUENCE_EPOCH.size + 2 * 2 * 128)
    assert worst_case_bytes(2, 2, 128, 40) == worst_case_bytes(2, 2, 128, 40, epoch_records=5) \
        == -(-head // 16) * 16 + body
    calibrated = head + canonical_bytes_size(2, 2, 128)
    assert worst_case_bytes(2, 2, 128, 40, calibration=True) == -(-calibrated // 16) * 16 + body
    with pytest.raises(InputError):
        worst_case_bytes(0, 2, 128, 40)
    with pytest.raises(ValueError):
        worst_case_bytes(1, 2, 96, 40)


# ----------------------------------------------------------------------------------------------
# The serde on stand-ins of LMCache's memory objects.

class MemoryObj:
    """What the serde uses of LMCache's MemoryObj: ``tensor`` (one group), ``metadata.shapes`` and
    ``get_tensor`` (several), over one flat buffer as ``TensorMemoryObj`` keeps them."""

    def __init__(self, shapes, dtype, nbytes=None):
        self.shapes, self.dtype = [torch.Size(s) for s in shapes], dtype
        sizes = [s.numel() * dtype.itemsize for s in self.shapes]
        self.ends = np.cumsum([0, *sizes]).tolist()
        self.raw_data = torch.zeros(nbytes if nbytes is not None else self.ends[-1], dtype=torch.uint8)
        self.metadata = type("Meta", (), {"shapes": self.shapes})()

    def get_tensor(self, i):
        return self.raw_data[self.ends[i]:self.ends[i + 1]].view(self.dtype).view(self.shapes[i])

    @property
    def tensor(self):
        return self.get_tensor(0)


class LayoutDesc:
    def __init__(self, shapes, dtypes):
        self.shapes, self.dtypes = shapes, dtypes


def lmcache_chunk(k, v) -> torch.Tensor:
    """gaac's K, V ``[layers, kv_heads, tokens, head_dim]`` (uint16 bits) as LMCache's chunk ``[2, layers, tokens,
    kv_heads * head_dim]`` BF16 (MemoryFormat.KV_2LTD)."""
    kv = torch.from_numpy(np.stack([k, v]).view(np.int16)).view(torch.bfloat16)
    layers, heads, tokens, dim = k.shape
    return kv.permute(0, 1, 3, 2, 4).reshape(2, layers, tokens, heads * dim).contiguous()


@pytest.fixture(scope="module")
def prose():
    return gaac.sample("prose")


@pytest.fixture(scope="module")
def code_calibration(tmp_path_factory):
    """A calibration file made on another prompt (the shipped "code" sample)."""
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    calibrate(*gaac.sample("code")).save(path)
    return path


def roundtrip(ser, des, chunks: list, spare: int = 0):
    """Serialize a memory object of ``chunks`` (one per KV group), check the bytes, deserialize them from a
    buffer as large as the estimate (an L2 load fills only its start) and return what came back and the size."""
    shapes = [c.shape for c in chunks]
    src = MemoryObj(shapes, torch.bfloat16)
    for i, c in enumerate(chunks):
        src.get_tensor(i).copy_(c)
    estimate = ser.estimate_serialized_size(LayoutDesc(shapes, [torch.bfloat16] * len(shapes)))
    dst = MemoryObj([(estimate,)], torch.uint8)
    n = ser.serialize(src, dst, None)
    assert 0 < n <= estimate
    loaded = MemoryObj([(estimate + spare,)], torch.uint8)
    loaded.raw_data.fill_(0xA5)                                  # what lies past the container is not read
    loaded.raw_data[:n] = dst.raw_data[:n]
    out = MemoryObj(shapes, torch.bfloat16)
    des.deserialize(loaded, out, None)
    for i, c in enumerate(chunks):
        assert torch.equal(out.get_tensor(i).view(torch.int16), c.view(torch.int16))
    return dst.raw_data[:n].numpy().tobytes()


@pytest.mark.parametrize("with_file", [True, False])
def test_serde_roundtrips_real_chunks_bit_for_bit(prose, code_calibration, with_file):
    k, v = prose
    cal = Calibration.load(code_calibration) if with_file else None
    ser, des = GaacSerializer(cal, head_dim=64), GaacDeserializer(cal, head_dim=64)
    raw = stored = 0
    for start, stop in ((0, 256), (256, 512), (512, 768), (700, 768), (760, 765)):
        chunk = lmcache_chunk(k[:, :, start:stop], v[:, :, start:stop])
        data = roundtrip(ser, des, [chunk], spare=100)
        c = transfer.read_head(data)
        assert (c.calibration is None) == with_file and len(data) == c.layout.nbytes
        if stop - start == 256:
            raw, stored = raw + chunk.numel() * 2, stored + len(data)
    assert raw / stored > 1.2                                    # the full chunks, calibration embedded or not
    if not with_file:                                            # one calibration: the first chunk's
        assert len(ser._made) == 1


def test_a_memory_object_of_several_kv_groups(prose):
    k, v = prose
    ser, des = GaacSerializer(head_dim=64), GaacDeserializer(head_dim=64)
    groups = [lmcache_chunk(k[:, :, :256], v[:, :, :256]), lmcache_chunk(k[:2, :, 256:300], v[:2, :, 256:300])]
    data = roundtrip(ser, des, groups)
    first = container_nbytes(data)
    assert transfer.read_head(data[:first]).layout.layers == 4
    assert transfer.read_head(data[first:]).layout.layers == 2 and first + container_nbytes(data[first:]) == len(data)


def test_the_serde_refuses_what_it_cannot_store_or_read(prose, code_calibration):
    k, v = prose
    chunk = lmcache_chunk(k[:, :, :64], v[:, :, :64])
    ser = GaacSerializer(head_dim=64)
    with pytest.raises(InputError, match="BF16"):
        ser.estimate_serialized_size(LayoutDesc([chunk.shape], [torch.float16]))
    with pytest.raises(InputError, match="kv_heads"):
        ser.estimate_serialized_size(LayoutDesc([torch.Size([4, 64, 192])], [torch.bfloat16]))    # MLA
    with pytest.raises(InputError, match="head_dim"):
        GaacSerializer(Calibration.load(code_calibration), head_dim=128)

    data = roundtrip(GaacSerializer(Calibration.load(code_calibration)), GaacDeserializer(Calibration.load(
        code_calibration)), [chunk])
    src = MemoryObj([(len(data),)], torch.uint8)
    src.raw_data[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = MemoryObj([chunk.shape], torch.bfloat16)
    with pytest.raises(CalibrationError, match="carries no calibration"):
        GaacDeserializer(head_dim=64).deserialize(src, out, None)
    other = calibrate(k[:, :, :64], v[:, :, :64])
    with pytest.raises(CalibrationError):
        GaacDeserializer(other).deserialize(src, out, None)
    src.raw_data[len(data) - 1] ^= 1                             # a body byte: its chunk CRC
    with pytest.raises(FormatError):
        GaacDeserializer(Calibration.load(code_calibration)).deserialize(src, out, None)
    shorter = MemoryObj([(2, 4, 48, 192)], torch.bfloat16)
    src.raw_data[len(data) - 1] ^= 1
    with pytest.raises(FormatError, match="the chunk is"):
        GaacDeserializer(Calibration.load(code_calibration)).deserialize(src, shorter, None)


def test_a_serde_codes_chunk_after_chunk_with_one_cache_each_as_a_fresh_one_would(prose, code_calibration):
    """The caches a serde keeps between chunks leave nothing behind: a chunk's bytes are those of a new serde."""
    k, v = prose
    cal = Calibration.load(code_calibration)
    chunks = [lmcache_chunk(k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 256), (256, 300), (300, 556), (760, 765))]
    kept = GaacSerializer(cal, device="cpu")
    for chunk in chunks:
        assert roundtrip(kept, GaacDeserializer(cal, device="cpu"), [chunk]) == \
            roundtrip(GaacSerializer(cal), GaacDeserializer(cal), [chunk])
    with pytest.raises(InputError, match="device"):
        GaacSerializer(cal, device="tpu")
    with pytest.raises(InputError, match="device"):
        GaacDeserializer(cal, device="not a device")


# ----------------------------------------------------------------------------------------------
# Through LMCache's own classes, where it is installed.

def test_gaac_imports_without_lmcache():
    import subprocess
    import sys

    code = ("import sys; sys.modules['lmcache'] = None; import gaac, gaac.lmcache; "
            "assert gaac.lmcache._Serializer is object; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def _wait(query, task):
    for _ in range(2000):
        result = query(task)
        if result is not None:
            return result
        time.sleep(0.005)
    raise AssertionError("the serde task did not finish")


@pytest.mark.parametrize("with_file", [True, False])
def test_lmcache_registry_and_async_processor(prose, code_calibration, with_file):
    serde = pytest.importorskip("lmcache.v1.distributed.serde")
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    import gaac.lmcache as plugin

    assert "gaac" in serde.get_registered_serde_types()
    plugin.register()                                            # again: nothing happens
    assert isinstance(plugin.GaacSerializer(head_dim=64), serde.Serializer)

    def memory_obj(shape, dtype, fmt):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=nbytes, ref_count=1,
                                 fmt=fmt, shapes=[torch.Size(shape)], dtypes=[dtype])
        return TensorMemoryObj(torch.zeros(nbytes, dtype=torch.uint8), meta, None)

    config = {"calibration": str(code_calibration)} if with_file else {"head_dim": 64}
    processor = serde.create_serde_processor(serde.SerdeConfig(type="gaac", kwargs=config))
    try:
        k, v = prose
        chunk = lmcache_chunk(k[:, :, 256:512], v[:, :, 256:512])
        src = memory_obj(chunk.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        src.tensor.copy_(chunk)
        layout = serde.serialized_layout_desc(MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype]),
                                              processor)
        temp = memory_obj(layout.shapes[0], torch.uint8, MemoryFormat.BINARY_BUFFER)
        key = ObjectKey(chunk_hash=b"\x01" * 32, model_name="smollm2", kv_rank=0)
        assert _wait(processor.query_serialize_result, processor.submit_serialize([src], [temp], [key]))
        n = temp.get_size()                                      # narrowed to the bytes written
        assert n < layout.shapes[0][0] and n < chunk.numel() * 2
        stored = bytes(temp.byte_array)

        loaded = memory_obj(layout.shapes[0], torch.uint8, MemoryFormat.BINARY_BUFFER)   # an L2 load's temp
        loaded.raw_data[:n] = torch.frombuffer(bytearray(stored), dtype=torch.uint8)
        out = memory_obj(chunk.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        assert _wait(processor.query_deserialize_result, processor.submit_deserialize([loaded], [out], [key]))
        assert torch.equal(out.tensor.view(torch.int16), chunk.view(torch.int16))
    finally:
        processor.close()


def test_lmcache_fs_adapter_stores_through_the_serde_and_a_narrowed_load_reads_it_back(prose, code_calibration,
                                                                                      tmp_path):
    """The fs adapter of a JSON spec with ``"serde": {"type": "gaac", ...}``, made and wrapped in
    ``SerdeL2AdapterWrapper`` as LMCache's StorageManager makes it, over a chunk in LMCache's ``L1Manager``: the
    store writes the container (and reports its size); the load chain with its temp buffer narrowed to that size
    (the inner fs adapter's read, then the serde processor's deserialize) gives the chunk back bit for bit."""
    serde = pytest.importorskip("lmcache.v1.distributed.serde")
    import argparse
    import json

    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.internal_api import L2AdapterListener
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper

    import gaac.lmcache  # noqa: F401  (registers "gaac")

    spec = {"type": "fs", "base_path": str(tmp_path / "l2"),
            "serde": {"type": "gaac", "calibration": str(code_calibration)}}
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    assert config.serde_config.type == "gaac"
    l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=32 << 20, use_lazy=False,
                                                                       shm_name="")))
    processor = serde.create_serde_processor(config.serde_config)
    adapter = SerdeL2AdapterWrapper(inner=create_l2_adapter(config, l1.get_l1_memory_desc()), serde=processor,
                                    l1_manager=l1)
    sizes = {}

    class Sizes(L2AdapterListener):
        def on_l2_keys_stored(self, keys, nbytes):
            sizes.update(zip(keys, nbytes))

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            pass

    adapter.register_listener(Sizes())

    def reserve(key, layout, temporary=True):
        return l1.reserve_write([key], [temporary], layout, tag="test")[key][1]

    k, v = prose
    chunk = lmcache_chunk(k[:, :, 256:512], v[:, :, 256:512])
    layout = MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])
    key = ObjectKey(chunk_hash=b"\x03" * 32, model_name="smollm2", kv_rank=0)
    try:
        src = reserve(key, layout, temporary=False)
        src.tensor.copy_(chunk)
        l1.finish_write([key], tag="test")
        l1.reserve_read([key])                                   # as a store controller holds what it stores
        task = adapter.submit_store_task([key], [src])
        popped = {}
        assert _wait(lambda t: popped.update(adapter.pop_completed_store_tasks()) or popped.get(t), task)\
            .is_successful()
        files = list((tmp_path / "l2").glob("*.data"))
        assert len(files) == 1 and files[0].stat().st_size == sizes[key] < chunk.numel() * 2
        stored = files[0].read_bytes()
        assert transfer.read_head(stored).calibration_id == Calibration.load(code_calibration).id

        temp_key, dst_key = ObjectKey(b"\x04" * 32, "smollm2", 0), ObjectKey(b"\x05" * 32, "smollm2", 0)
        temp = reserve(temp_key, serde.serialized_layout_desc(layout, processor))
        temp.set_used_size(sizes[key])                          # the load's temp, narrowed to the bytes stored
        inner = adapter.inner_adapter
        assert _wait(inner.query_load_result, inner.submit_load_task([key], [temp])).get_indices_list() == [0]
        dst = reserve(dst_key, layout)
        assert _wait(processor.query_deserialize_result, processor.submit_deserialize([temp], [dst], [key]))
        assert torch.equal(dst.tensor.view(torch.int16), chunk.view(torch.int16))
        l1.finish_write_and_delete([temp_key, dst_key], tag="test")
        l1.finish_read([key])
        l1.delete([key])
    finally:
        adapter.close()                                          # and the serde processor


@pytest.mark.xfail(strict=True, reason="LMCache's fs adapter loads a key only when the file fills the whole "
                   "buffer, which a serde sizes by its estimate; a compressed chunk is shorter, so it loads as a miss")
def test_lmcache_fs_adapter_serves_a_compressed_chunk(prose, tmp_path):
    serde = pytest.importorskip("lmcache.v1.distributed.serde")
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    import gaac.lmcache as plugin

    def memory_obj(shape, dtype, fmt):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=nbytes, ref_count=1,
                                 fmt=fmt, shapes=[torch.Size(shape)], dtypes=[dtype])
        return TensorMemoryObj(torch.zeros(nbytes, dtype=torch.uint8), meta, None)

    k, v = prose
    chunk = lmcache_chunk(k[:, :, :256], v[:, :, :256])
    ser = plugin.GaacSerializer(head_dim=64)
    src = memory_obj(chunk.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
    src.tensor.copy_(chunk)
    layout = serde.serialized_layout_desc(MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype]),
                                          serde.AsyncSerdeProcessor(ser, plugin.GaacDeserializer(head_dim=64)))
    temp = memory_obj(layout.shapes[0], torch.uint8, MemoryFormat.BINARY_BUFFER)
    temp.set_used_size(ser.serialize(src, temp, None))          # as AsyncSerdeProcessor does
    key = ObjectKey(chunk_hash=b"\x02" * 32, model_name="m", kv_rank=0)
    fs = FSL2Adapter(FSL2AdapterConfig(base_path=str(tmp_path)))
    try:
        fs.submit_store_task([key], [temp])
        stored = {}
        for _ in range(400):
            stored.update(fs.pop_completed_store_tasks())
            if stored:
                break
            time.sleep(0.005)
        assert list(stored.values()) == [temp.get_size()]        # the compressed bytes are what is stored
        loaded = memory_obj(layout.shapes[0], torch.uint8, MemoryFormat.BINARY_BUFFER)
        bitmap = _wait(fs.query_load_result, fs.submit_load_task([key], [loaded]))
        assert bitmap.get_indices_list() == [0]
    finally:
        fs.close()
