"""A digest of the SASS of every kernel gaac ships, without a GPU: a refactoring that claims to leave the
machine code alone proves it by unchanged digests.

    python benchmarks/sass_digest.py                  # one line per kernel: sha256 of its SASS, then a total
    python benchmarks/sass_digest.py --check-kernel   # and the tile decoder's check kernel (tests/decode_check.py)
    python benchmarks/sass_digest.py --only merge     # the kernels whose name contains a word

Each kernel is compiled as gaac builds it (numba's ``cuda.compile_ptx`` for sm_90, ``ptxas`` with the
kernel's register cap) and disassembled by ``cuobjdump -sass`` (tools found as in kernel_resources.py).
The digest covers the instruction text only: addresses, encodings, section headers and the kernel's own
name are left out, and any mangled symbol inside an instruction (a call target) reads ``<symbol>``,
so that moving a kernel or a device function to another module does not count as a change; register
numbers, immediates, constant-bank offsets and the order of the instructions do.

The kernels: the attention kernel at :class:`gaac.attention.AttentionPlan`'s defaults for head_dim 64, 128
and 256 (two staging sizes each: a slot size that is a whole number of 128-byte lines and one that is
not), its BF16 twin (``plain``), the ``nstage=1`` and ``nstage=3`` options, the merge kernel for each
head_dim and several split-lane counts, and the tile codecs' kernels (BF16 and both FP8 formats, 64 and 128
channels).  (The chunk CRC kernel calls a device function that numba compiles only for a present GPU.)
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)          # compile for the GPU, not the simulator
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda, types  # noqa: E402

from benchmarks.kernel_resources import _ptxas_version, _tool, codec_kernels  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.attention import kernel_options  # noqa: E402
from gaac.cuda import attention as K  # noqa: E402
from gaac.cuda import merge as M  # noqa: E402
from gaac.cuda.tile_decoder import tile_bytes  # noqa: E402

HEAD_DIMS = (64, 128, 256)
MERGE_LANES = (1, 8, 64)


def _stages(head_dim: int) -> tuple[int, int]:
    """Staging sizes of the compressed kernel: slots of capacity 16 rounded up to whole 128-byte lines
    (2944 bytes for 128 channels, the real caches'), and as they are (a multiple of 16 bytes only)."""
    slot = L.TileGeometry(L.tile_channels(head_dim)).slot_bytes(16)
    return -(-slot // 128) * 128, -(-slot // 16) * 16


def attention(head_dim: int, plain: bool, nstage: int = 2, stage: int = 0, max_registers: int | None = -1,
              overlap: bool | None = None, fused_merge: bool = False):
    """(Python function, signature, register cap) of the attention kernel as AttentionPlan builds it (``fused_merge``:
    as an eager step plan builds it, gaac.attention_launch.layer_launch)."""
    overlap, max_registers = kernel_options(head_dim, plain, overlap, max_registers)
    stage = tile_bytes(L.tile_channels(head_dim)) if plain else stage
    kernel = K.attention_kernel(head_dim, plain, nstage, 0 if plain else stage, overlap, max_registers,
                                fused_merge=fused_merge)
    return kernel.py_func, K.kernel_signature(), max_registers


def merge(head_dim: int, lanes: int):
    def array(dtype):
        return types.Array(dtype, 1, "C")
    signature = (array(types.float32), array(types.float32), array(types.int32), array(types.int16),
                 array(types.float32), types.int64, types.int64)
    return M.merge_kernel(head_dim, lanes).py_func, signature, None


def kernels(check_kernel: bool):
    """(name, thunk giving (Python function, signature, register cap)) of every kernel to digest."""
    for d in HEAD_DIMS:
        for stage in _stages(d):
            yield f"attention D={d} stage={stage}", lambda d=d, s=stage: attention(d, False, stage=s)
        yield f"attention plain D={d}", lambda d=d: attention(d, True)
        s = _stages(d)[0]
        yield f"attention D={d} stage={s} nstage=1 regs=128", \
            lambda d=d, s=s: attention(d, False, nstage=1, stage=s, max_registers=128)
        yield f"attention D={d} stage={s} nstage=3", lambda d=d, s=s: attention(d, False, nstage=3, stage=s)
        yield f"attention plain D={d} nstage=1", lambda d=d: attention(d, True, nstage=1)
        if d <= 128:                    # an eager step's kernel merges its splits (gaac.serving.plan.FUSED_MERGE)
            for stage in _stages(d):
                yield f"attention D={d} stage={stage} fused merge", \
                    lambda d=d, s=stage: attention(d, False, stage=s, fused_merge=True)
    for d in HEAD_DIMS:
        for lanes in MERGE_LANES:
            yield f"merge D={d} lanes={lanes}", lambda d=d, n=lanes: merge(d, n)
    for channels in (64, 128):
        for name, fn, signature in codec_kernels(channels):
            yield name, lambda f=fn, s=signature: (f, s, None)
    if check_kernel:
        for c in (64, 128):
            geo = L.TileGeometry(c)
            yield f"check decode C={c}", lambda c=c, geo=geo: (
                _decode_check().decode_check_kernel(c, geo.slot_bytes(48)).py_func,
                (types.Array(types.uint8, 1, "C"), types.Array(types.int32, 1, "C"), types.int64,
                 types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C")), None)


def _decode_check():
    """tests/decode_check.py, the tile decoder's check kernel (a test helper, loaded by path)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "decode_check.py"
    spec = importlib.util.spec_from_file_location("tests_decode_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sass_lines(fn, signature, max_registers, workdir: Path, ptxas: str, cuobjdump: str, isa: str) -> list[str]:
    """The kernel's SASS instructions, as text without addresses or encodings, symbols normalised."""
    ptx, _ = cuda.compile_ptx(fn, signature, cc=(9, 0))
    src, cubin = workdir / "k.ptx", workdir / "k.cubin"
    src.write_text(re.sub(r"^\.version \d+\.\d+", f".version {isa}", ptx, count=1, flags=re.M))
    cap = [f"-maxrregcount={max_registers}"] if max_registers else []
    done = subprocess.run([ptxas, "-arch=sm_90", *cap, str(src), "-o", str(cubin)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
    lines = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", sass, re.M)
    if not lines:
        raise SystemExit(f"{cuobjdump} printed no SASS (it needs nvdisasm on PATH)")
    return [re.sub(r"_Z\w+", "<symbol>", line) for line in lines]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--check-kernel", action="store_true",
                        help="also the tile decoder's check kernel (tests/decode_check.py, not shipped)")
    parser.add_argument("--only", default="", help="only the kernels whose name contains this")
    args = parser.parse_args()
    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    isa = _ptxas_version(ptxas)
    total = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in kernels(args.check_kernel):
            if args.only not in name:
                continue
            lines = sass_lines(*build(), Path(tmp), ptxas, cuobjdump, isa)
            digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
            total.update(f"{name} {digest}\n".encode())
            print(f"{digest}  {len(lines):6d}  {name}", flush=True)
    print(f"{total.hexdigest()}  total")


if __name__ == "__main__":
    main()
