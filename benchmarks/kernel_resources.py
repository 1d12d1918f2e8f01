"""Registers, shared memory, spills and SASS size of the attention kernel's variants, without a GPU.

    python benchmarks/kernel_resources.py                         # the default variants
    python benchmarks/kernel_resources.py "{'overlap': True}" "{'nstage': 2}"

Device time is scarce and the simulator says nothing about resources, but compiling needs no GPU:
numba's ``cuda.compile_ptx`` (NVVM from the ``nvidia-nvvm`` wheel) gives the PTX, ``ptxas`` assembles it for
sm_90, and ``cuobjdump`` prints the SASS.  What ptxas reports decides occupancy (one-warp blocks: 65536 /
(32 * registers) by registers, 227 KB / (shared + 1 KB) by shared memory), and a variant that spills or
changes its instruction count shows here before it costs a device call.  GPU-only typing errors (a shared
array whose shape is not a compile-time constant, say) also show here and not in the simulator.

Needs ``ptxas`` (CUDA toolkit; the PTX's ``.version`` line is lowered to what that ptxas accepts) and
``cuobjdump`` on PATH or in the ``nvidia`` wheels.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)          # compile for the GPU, not the simulator
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from numba import cuda, typeof, types  # noqa: E402

from gaac import layout as L  # noqa: E402
from gaac.cuda import attention as K  # noqa: E402

DEFAULT_VARIANTS = ("{}", "{'overlap': True}", "{'plain': True}", "{'variant': 'load_only'}")
HEAD_DIM = 128


def _array(dtype) -> types.Array:
    return types.Array(typeof(np.zeros(1, dtype)).dtype, 1, "C")


def attention_signature() -> tuple:
    """The argument types :class:`gaac.attention.AttentionPlan` launches the attention kernel with."""
    arrays = [np.int32, np.uint8, np.uint8, np.uint8, np.uint8, np.int32, np.int32, np.uint8, np.uint8, np.int32,
              np.int16, np.int16, np.int32, np.int32, np.float32, np.float32, np.int32]
    return tuple([_array(a) for a in arrays] + [types.int64] * 9 + [types.float32])


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    import nvidia

    for root in nvidia.__path__:
        for path in Path(root).glob(f"*/bin/{name}"):
            return str(path)
    raise SystemExit(f"{name} not found (install the CUDA toolkit or the nvidia-cuda-* wheels)")


def _ptxas_version(ptxas: str) -> str:
    """The highest PTX ISA version this ptxas accepts (CUDA 13.0: 9.0)."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    major, minor = map(int, re.search(r"release (\d+)\.(\d+)", out).groups())
    return f"{major - 4}.{minor}"


def resources(options: dict, workdir: Path, ptxas: str, cuobjdump: str, isa: str) -> dict:
    """Compile one variant of the attention kernel and read what ptxas and the SASS say."""
    options = dict(options)
    plain = options.pop("plain", False)
    geo = L.TileGeometry(L.tile_channels(HEAD_DIM))
    stage = 0 if plain else -(-geo.slot_bytes(64) // 16) * 16
    kernel = K.attention_kernel(HEAD_DIM, plain, options.pop("variant", K.FULL), options.pop("nstage", 3), stage,
                                **options)
    ptx, _ = cuda.compile_ptx(kernel.py_func, attention_signature(), cc=(9, 0))
    src, cubin = workdir / "k.ptx", workdir / "k.cubin"
    src.write_text(re.sub(r"^\.version \d+\.\d+", f".version {isa}", ptx, count=1, flags=re.M))
    info = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", str(cubin)], capture_output=True, text=True)
    if info.returncode:
        raise SystemExit(info.stderr)
    regs = int(re.search(r"Used (\d+) registers", info.stderr).group(1))
    smem = int(re.search(r"(\d+) bytes smem", info.stderr).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill", info.stderr))
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
    ops = Counter(m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
    warps = min(32, 65536 // (32 * regs), (227 * 1024) // (smem + 1024))
    return {"registers": regs, "smem": smem, "spill_bytes": spill, "warps_per_sm": warps,
            "sass": sum(ops.values()), "ops": ops}


def main():
    variants = sys.argv[1:] or DEFAULT_VARIANTS
    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    isa = _ptxas_version(ptxas)
    print(f"attention kernel, head_dim {HEAD_DIM}, sm_90 (ptxas {ptxas}, PTX .version {isa})")
    print("| variant | registers | shared bytes | spill bytes | warps/SM | SASS instructions | LDS | STS | HMMA |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for text in variants:
            r = resources(ast.literal_eval(text), Path(tmp), ptxas, cuobjdump, isa)
            o = r["ops"]
            print(f"| {text} | {r['registers']} | {r['smem']} | {r['spill_bytes']} | {r['warps_per_sm']} | "
                  f"{r['sass']} | {o['LDS']} | {o['STS']} | {o['HMMA']} |", flush=True)


if __name__ == "__main__":
    main()
