"""Registers, shared memory, spills and SASS size of the attention kernel's variants and of the tile codecs' kernels,
without a GPU.

    python benchmarks/kernel_resources.py                         # the attention kernel's default variants
    python benchmarks/kernel_resources.py "{'overlap': True}" "{'nstage': 2}"
    python benchmarks/kernel_resources.py --codec                 # BF16 and FP8 (both formats) encode/decode
    python benchmarks/kernel_resources.py --codec --channels 64 128
    python benchmarks/kernel_resources.py --path "{'overlap': True, 'nstage': 2, 'max_registers': 168}"

Device time is scarce and the simulator says nothing about resources, but compiling needs no GPU:
numba's ``cuda.compile_ptx`` (NVVM from the ``nvidia-nvvm`` wheel) gives the PTX, ``ptxas`` assembles it for
sm_90, and ``cuobjdump`` prints the SASS.  What ptxas reports decides occupancy (:func:`warps_per_sm`: a
scheduler's quarter of the register file, 228 KB / (shared + 1 KB)), and a variant that spills or
changes its instruction count shows here before it costs a device call.  GPU-only typing errors (a shared
array whose shape is not a compile-time constant, say) also show here and not in the simulator.  ``--codec``
adds a digest of the SASS instruction text (addresses and encodings left out): a refactoring that claims to
leave a kernel's machine code alone proves it by an unchanged digest.  ``--path`` walks the block loop of
one attention variant (the longest backward branch): the instructions of its straight path (unconditional
branches taken, conditional ones not) and, for each forward conditional branch on that path, what it skips,
so that the common path's length is the straight path less the rare regions a warp usually skips
(status atomics, raw-group fix-ups, the accumulator rescale).

Needs ``ptxas`` (CUDA toolkit; the PTX's ``.version`` line is lowered to what that ptxas accepts) and
``cuobjdump`` on PATH or in the ``nvidia`` wheels.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
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

from numba import cuda  # noqa: E402

from gaac import layout as L  # noqa: E402
from gaac.cuda import attention as K  # noqa: E402
from gaac.cuda import codec as C  # noqa: E402
from gaac.fp8 import cuda as F8  # noqa: E402
from gaac.layout import FP8_FORMATS as FORMATS, mode_set  # noqa: E402

DEFAULT_VARIANTS = ("{'overlap': True, 'nstage': 2, 'max_registers': 168}", "{'nstage': 2, 'max_registers': 168}",
                    "{'overlap': True}", "{'overlap': True, 'nstage': 1, 'max_registers': 128}",
                    "{'plain': True, 'nstage': 2, 'max_registers': 168}")
HEAD_DIM = 128


def _tool(name: str) -> str:
    """``name`` on PATH, else in the ``nvidia`` wheels' bin folders, which then go on PATH too: cuobjdump
    runs ``nvdisasm`` (wheel ``nvidia-cuda-nvdisasm``) from PATH and prints no SASS without it."""
    found = shutil.which(name)
    if found:
        return found
    import nvidia

    for root in nvidia.__path__:
        for path in Path(root).glob(f"*/bin/{name}"):
            os.environ["PATH"] = f"{path.parent}{os.pathsep}{os.environ.get('PATH', '')}"
            return str(path)
    raise SystemExit(f"{name} not found (install the CUDA toolkit, or the wheels nvidia-cuda-cuobjdump and "
                     "nvidia-cuda-nvdisasm)")


def _ptxas_version(ptxas: str) -> str:
    """The highest PTX ISA version this ptxas accepts (CUDA 13.0: 9.0)."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    major, minor = map(int, re.search(r"release (\d+)\.(\d+)", out).groups())
    return f"{major - 4}.{minor}"


def attention_kernel(options: dict):
    """The Python function of one variant of the attention kernel, and its signature."""
    options = dict(options)
    plain = options.pop("plain", False)
    geo = L.TileGeometry(L.tile_channels(HEAD_DIM))
    stage = 0 if plain else -(-geo.slot_bytes(64) // 16) * 16
    kernel = K.attention_kernel(HEAD_DIM, plain, options.pop("nstage", 3), stage, **options)
    return kernel.py_func, K.kernel_signature()


def codec_kernels(channels: int):
    """(name, Python function, signature) of every tile codec kernel for ``channels``-wide tiles."""
    yield f"BF16 encode C={channels}", C.encode_source(channels), C.ENCODE_SIG
    yield f"BF16 decode C={channels}", C.decode_source(channels), C.DECODE_SIG
    for name in FORMATS:
        modes = mode_set(name)
        yield f"{name} encode C={channels}", F8.encode_source(modes, channels), C.ENCODE_SIG
        yield f"{name} decode C={channels}", F8.decode_source(modes, channels), C.DECODE_SIG


def warps_per_sm(registers: int, smem: int) -> int:
    """Resident one-warp blocks per SM (sm_90): each of the 4 schedulers owns a quarter of the register
    file (16384), allocated to a warp in units of 256, and each block reserves 1 KB of shared memory
    beyond its own (228 KB per SM).  So 168 registers a thread allow 12 warps and 174 only 8."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(32, 4 * (16384 // per_warp), (228 * 1024) // (smem + 1024))


def _opcode(text: str) -> str | None:
    """The opcode of one SASS instruction (its predicate dropped), or None."""
    m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
    return m.group(1) if m else None


def resources(fn, signature, workdir: Path, ptxas: str, cuobjdump: str, isa: str, max_registers=None) -> dict:
    """Compile one kernel (with ptxas' register cap, as numba passes ``max_registers``) and read what
    ptxas and the SASS say."""
    ptx, _ = cuda.compile_ptx(fn, signature, cc=(9, 0))
    src, cubin = workdir / "k.ptx", workdir / "k.cubin"
    src.write_text(re.sub(r"^\.version \d+\.\d+", f".version {isa}", ptx, count=1, flags=re.M))
    cap = [f"-maxrregcount={max_registers}"] if max_registers else []
    info = subprocess.run([ptxas, "-arch=sm_90", "-v", *cap, str(src), "-o", str(cubin)], capture_output=True, text=True)
    if info.returncode:
        raise SystemExit(info.stderr)
    regs = int(re.search(r"Used (\d+) registers", info.stderr).group(1))
    smem = sum(int(x) for x in re.findall(r"(\d+) bytes smem", info.stderr))     # no line without shared memory
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill", info.stderr))
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
    listing = re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", sass, re.M)
    if not listing:
        raise SystemExit(f"{cuobjdump} printed no SASS (it needs nvdisasm on PATH)")
    lines = [text for _, text in listing]
    ops = Counter(op for op in map(_opcode, lines) if op)
    warps = warps_per_sm(regs, smem)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]
    return {"registers": regs, "smem": smem, "spill_bytes": spill, "warps_per_sm": warps,
            "sass": sum(ops.values()), "ops": ops, "digest": digest, "lines": lines,
            "addresses": [int(address, 16) for address, _ in listing]}


def _target(text: str) -> int | None:
    """The address a BRA jumps to, else None."""
    if _opcode(text) != "BRA":
        return None
    return int(re.search(r"(0x[0-9a-f]+)", text).group(1), 16)


def loop_path(lines: list[str], addresses: list[int]):
    """The block loop (the longest backward branch): its straight path and the forward conditional branches
    on it, each with the number and kinds of the instructions it skips."""
    at = {a: i for i, a in enumerate(addresses)}
    back = [(t, a) for a, x in zip(addresses, lines) if (t := _target(x)) is not None and t < a]
    start, end = max(back, key=lambda ta: ta[1] - ta[0])
    path, skips, i = [], [], at[start]
    while True:
        text = lines[i]
        path.append(text)
        if addresses[i] == end or len(path) > len(lines):
            break
        target = _target(text)
        if target is not None and not text.startswith("@"):
            i = at[target]
            continue
        if target is not None and target > addresses[i]:
            skipped = lines[i + 1:at[target]]
            skips.append((addresses[i], len(skipped), Counter(_opcode(x) for x in skipped)))
        i += 1
    return at[end] - at[start] + 1, path, skips


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("variants", nargs="*", metavar="VARIANT",
                        help="attention_kernel options, a Python dict literal each (default: "
                             f"{' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--codec", action="store_true", help="the tile codecs' kernels instead of the attention kernel")
    parser.add_argument("--path", action="store_true",
                        help="the block loop's straight path and its skippable regions, for each variant given")
    parser.add_argument("--channels", type=int, nargs="+", default=[HEAD_DIM], choices=(64, 128),
                        help="tile widths of the codec kernels (default: %(default)s)")
    args = parser.parse_args()
    if args.codec and args.variants:
        parser.error("--codec takes no attention variants")
    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    isa = _ptxas_version(ptxas)
    with tempfile.TemporaryDirectory() as tmp:
        if args.codec:
            print(f"tile codec kernels, {C.TILES_PER_BLOCK} tile(s) per block, sm_90 (ptxas {ptxas}, "
                  f"PTX .version {isa})")
            print("| kernel | registers | shared bytes | spill bytes | SASS instructions | LDG | STG | LDS | STS | "
                  "BAR | SASS digest |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for channels in args.channels:
                for name, fn, signature in codec_kernels(channels):
                    r = resources(fn, signature, Path(tmp), ptxas, cuobjdump, isa)
                    o = r["ops"]
                    print(f"| {name} | {r['registers']} | {r['smem']} | {r['spill_bytes']} | {r['sass']} | "
                          f"{o['LDG']} | {o['STG']} | {o['LDS']} | {o['STS']} | {o['BAR']} | {r['digest']} |",
                          flush=True)
            return
        print(f"attention kernel, head_dim {HEAD_DIM}, sm_90 (ptxas {ptxas}, PTX .version {isa})")
        if args.path:
            for text in args.variants or DEFAULT_VARIANTS[:1]:
                options = ast.literal_eval(text)
                r = resources(*attention_kernel(options), Path(tmp), ptxas, cuobjdump, isa,
                              options.get("max_registers"))
                size, path, skips = loop_path(r["lines"], r["addresses"])
                ops = Counter(_opcode(x) for x in path)
                print(f"\n{text}: {r['registers']} registers, block loop {size} SASS instructions, straight path "
                      f"{len(path)}: {', '.join(f'{k} {v}' for k, v in ops.most_common(12))}")
                print("| branch at | skips | most common |")
                print("|---|---|---|")
                for address, n, kinds in skips:
                    print(f"| {address:#x} | {n} | {', '.join(f'{k} {v}' for k, v in kinds.most_common(5))} |")
            return
        print("| variant | registers | shared bytes | spill bytes | warps/SM | SASS instructions | LDS | STS | HMMA |")
        print("|---|---|---|---|---|---|---|---|---|")
        for text in args.variants or DEFAULT_VARIANTS:
            options = ast.literal_eval(text)
            r = resources(*attention_kernel(options), Path(tmp), ptxas, cuobjdump, isa, options.get("max_registers"))
            o = r["ops"]
            print(f"| {text} | {r['registers']} | {r['smem']} | {r['spill_bytes']} | {r['warps_per_sm']} | "
                  f"{r['sass']} | {o['LDS']} | {o['STS']} | {o['HMMA']} |", flush=True)


if __name__ == "__main__":
    main()
