"""Loading KV caches from files, and the real sample shipped inside the package.

A cache file holds one kind (K or V) of a whole cache ``[layers, kv_heads,
tokens, head_dim]`` of BF16 values, in one of three containers:

* ``.npy``  -- the raw bit patterns as ``uint16`` (or ``int16``), as ``../shared/data/kv`` holds them;
* ``.safetensors`` -- a ``BF16`` (or ``U16``/``I16``) tensor, either under the key ``k`` / ``v``
  (one file holding both) or as the file's only tensor;
* ``.pt``   -- a ``torch.bfloat16`` tensor saved with ``torch.save`` (or a dict with keys ``k`` / ``v``).

``.safetensors`` is read here directly rather than through the ``safetensors``
package: its NumPy front end cannot represent BF16, and its torch front end
would make torch a requirement for a format that is only a JSON header and
raw little-endian bytes.  Every dtype rule is :func:`gaac.arrays.as_bits`'s.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import struct
import tempfile
from importlib import resources
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import numpy as np

from . import layout as L
from .arrays import as_bits
from .errors import InputError

CACHE_SUFFIXES = (".npy", ".safetensors", ".pt")

# safetensors dtypes that carry BF16 bit patterns without conversion.
_SAFETENSORS_BITS = {"BF16": "<u2", "U16": "<u2", "I16": "<i2"}


def check_cache(bits: np.ndarray, name: str) -> np.ndarray:
    """``bits`` if it is a cache ``[layers, kv_heads, tokens, head_dim]`` gaac can code, else :class:`InputError`."""
    bits = as_bits(bits, name)
    if bits.ndim != 4:
        raise InputError(f"{name}: expected a cache shaped [layers, kv_heads, tokens, head_dim], "
                         f"got shape {list(bits.shape)}")
    if bits.shape[3] not in L.SUPPORTED_HEAD_DIMS:
        raise InputError(f"{name}: head_dim {bits.shape[3]} (last axis of shape {list(bits.shape)}) is not "
                         f"supported; the GAAC format supports {L.SUPPORTED_HEAD_DIMS}")
    if 0 in bits.shape:
        raise InputError(f"{name}: empty cache, shape {list(bits.shape)}")
    return bits


# -- files the command line reads and writes -------------------------------------

_FILE_TYPES = ((stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a FIFO (named pipe)"),
               (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"),
               (stat.S_ISSOCK, "is a socket"))


def _not_regular(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, said as the reason it is refused (not a regular file)."""
    what = next((text for test, text in _FILE_TYPES if test(mode)), "is not a regular file")
    return what if what == "is not a regular file" else f"{what}, not a regular file"


def check_input_file(path, option: str) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it names a regular file, else :class:`InputError` naming
    ``option`` (e.g. ``'--calibration'``), the path and what is wrong: no such file, a directory, a
    FIFO or device.  The check looks at the file's type without opening it, since opening a FIFO
    that no one writes to blocks forever."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{option} {str(path)!r}: no such file") from None
    except OSError as exc:
        raise InputError(f"{option} {str(path)!r}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{option} {str(path)!r}: {_not_regular(st.st_mode)}")
    return Path(path)


@contextlib.contextmanager
def reading(path, option: str):
    """Within: an :class:`OSError` reading ``path`` becomes an :class:`InputError` naming ``option``."""
    try:
        yield
    except OSError as exc:
        raise InputError(f"{option} {str(path)!r}: cannot read ({exc.strerror or exc})") from None


def same_file(a, b) -> bool:
    """Whether paths ``a`` and ``b`` name one file: the same file on disk (hard links and symbolic links
    included) where both exist, else the same resolved path."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return Path(a).resolve() == Path(b).resolve()


def check_output_file(path, option: str, inputs: Iterable[tuple[str, object]] = (),
                      outputs: Iterable[tuple[str, object]] = ()) -> Path:
    """``path`` as a :class:`~pathlib.Path` if a command may write it, else :class:`InputError` naming
    ``option``, the path and why not: it is a directory or another file that is not a regular file
    (writing it would replace the device or FIFO with a plain file), its folder does not exist, it is
    one of the command's ``inputs`` (``(option, path)`` pairs; writing would destroy what is read), or
    one of its other ``outputs`` (one would overwrite the other)."""
    for other, src in inputs:
        if src is not None and same_file(path, src):
            raise InputError(f"{option} {str(path)!r}: is also {other}; a command does not overwrite its own "
                             "input: write to another file")
    for other, dst in outputs:
        if dst is not None and same_file(path, dst):
            raise InputError(f"{option} {str(path)!r}: is also {other}; each needs a file of its own")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        folder = Path(path).parent
        if not folder.is_dir():
            raise InputError(f"{option} {str(path)!r}: cannot write (no such folder {str(folder)!r})") from None
        return Path(path)
    except OSError as exc:
        raise InputError(f"{option} {str(path)!r}: cannot write ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{option} {str(path)!r}: {_not_regular(st.st_mode)}")
    return Path(path)


def write_files(outputs: Iterable[tuple[str, object, Callable[[BinaryIO], object]]]) -> None:
    """Write each ``(option, path, write)``: ``write(f)`` writes the file's bytes to the binary file ``f``
    (or to the path ``f.name``, which it may open anew).

    Every file is written to a temporary file beside its path first, and only once all of them are
    written are they moved onto their paths (:func:`os.replace`, atomic on one file system).  A failure
    leaves every path as it was (an existing file keeps its contents, not a fragment) and no temporary
    file behind; an :class:`OSError` becomes an :class:`InputError` naming the option and the path.
    A new file gets the permissions an ordinary ``open`` gives it, an existing one keeps its own; a
    symbolic link is written through (its target is replaced, the link stays)."""
    outputs = list(outputs)
    mask = os.umask(0)
    os.umask(mask)
    done = []                                   # (option, path, temporary path), written and closed
    try:
        for option, path, write in outputs:
            path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except OSError:
                mode = 0o666 & ~mask
            try:
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            except OSError as exc:
                raise InputError(f"{option} {str(path)!r}: cannot write (no new file can be made in "
                                 f"{str(path.parent)!r}: {exc.strerror or exc})") from None
            done.append((option, path, tmp))
            os.close(fd)
            try:
                with open(tmp, "wb") as f:           # by name, so that f.name is the temporary file's path
                    write(f)
                os.chmod(tmp, mode)
            except OSError as exc:
                raise InputError(f"{option} {str(path)!r}: cannot write ({exc.strerror or exc})") from None
        while done:
            option, path, tmp = done[0]
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise InputError(f"{option} {str(path)!r}: cannot write ({exc.strerror or exc})") from None
            done.pop(0)
    finally:
        for _, _, tmp in done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def save_npy(path, array: np.ndarray, option: str) -> None:
    """Write ``array`` as a ``.npy`` file at exactly ``path`` (:func:`write_files`; ``np.save`` given a
    name would append ``.npy`` to one that does not end in lower-case ``.npy``)."""
    write_files([(option, path, lambda f: np.save(f, array, allow_pickle=False))])


# -- caches ------------------------------------------------------------------------

def load_cache(path, kind: str, option: str | None = None) -> np.ndarray:
    """The ``kind`` (``'k'`` or ``'v'``) cache in ``path`` as ``uint16[layers, kv_heads, tokens, head_dim]``.

    ``option``: how errors about the file itself (missing, a directory, a FIFO, unreadable) name it,
    e.g. ``'--k'``; by default ``'<kind> cache'``."""
    label = option or f"{kind} cache"
    path = check_input_file(path, label)
    suffix = path.suffix.lower()
    name = f"{kind} cache {path.name}"
    with reading(path, label):
        if suffix == ".npy":
            x = _read_npy(path, name)
        elif suffix == ".safetensors":
            x = _read_safetensors(path, kind, name)
        elif suffix == ".pt":
            x = _read_torch(path, kind, name)
        else:
            raise InputError(f"{name}: unknown file type {suffix!r}; expected one of {', '.join(CACHE_SUFFIXES)}")
    return check_cache(x, name)


def _read_npy(path: Path, name: str) -> np.ndarray:
    """The array of a ``.npy`` file.  Its header is read and checked against the file's size first, so
    that an empty, truncated, padded or pickled file, or one whose header claims terabytes, is an
    :class:`InputError` before any data is read."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        if f.read(4) == b"PK\x03\x04":
            raise InputError(f"{name}: a NumPy archive (.npz), not a single array (.npy)")
        f.seek(0)
        try:
            version = fmt.read_magic(f)
            read_header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f"format version {version[0]}.{version[1]} is not one gaac reads (1.0, 2.0)")
            shape, _, dtype = read_header(f)
        except Exception as exc:        # NumPy's header parser raises ValueError, SyntaxError, TokenError, ...
            raise InputError(f"{name}: not a plain NumPy array file ({type(exc).__name__}: {_first_line(exc)})") \
                from exc
        start = f.tell()
    if dtype.hasobject:
        raise InputError(f"{name}: holds Python objects (dtype {dtype}), not BF16 bit patterns")
    have, need = path.stat().st_size - start, math.prod(shape) * dtype.itemsize
    if have != need:
        raise InputError(f"{name}: its header declares {dtype} {list(shape)} ({need} bytes) but the file holds "
                         f"{have} data bytes")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:            # the header passed: a file changed while being read, or a NumPy limit
        raise InputError(f"{name}: not a plain NumPy array file ({type(exc).__name__}: {_first_line(exc)})") \
            from exc


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (third-party messages can run for paragraphs)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def _pick(tensors: dict, kind: str, name: str):
    """The tensor for ``kind`` from a file of several: key ``kind``, or the only tensor there is."""
    if kind in tensors:
        return tensors[kind]
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    raise InputError(f"{name}: holds tensors {_short(sorted(str(t) for t in tensors))}; expected a key {kind!r} "
                     "or a single tensor")


def _read_safetensors(path: Path, kind: str, name: str) -> np.ndarray:
    """One tensor of a ``.safetensors`` file: 8-byte LE header length, JSON header, then the data."""
    data = path.read_bytes()
    if len(data) < 8:
        raise InputError(f"{name}: truncated safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack_from("<Q", data)
    if n > len(data) - 8:
        raise InputError(f"{name}: safetensors header of {n} bytes exceeds the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{name}: safetensors header is not JSON ({exc})") from exc
    except RecursionError:
        raise InputError(f"{name}: safetensors header is JSON nested too deeply to read") from None
    if not isinstance(header, dict):
        raise InputError(f"{name}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    entry = _pick(header, kind, name)
    dtype, shape, offsets = _safetensors_entry(entry, name)
    begin, end = offsets
    count = math.prod(shape)
    body = data[8 + n:]
    if not 0 <= begin <= end <= len(body) or end - begin != 2 * count:
        raise InputError(f"{name}: data offsets {begin}..{end} do not hold a {dtype} tensor of shape {shape} "
                         f"in {len(body)} data bytes")
    return np.frombuffer(body, dtype=_SAFETENSORS_BITS[dtype], count=count, offset=begin).reshape(shape)


def _whole(x) -> bool:
    """A JSON integer: ``int`` but not ``bool`` (``true`` and ``1.0`` are not sizes)."""
    return type(x) is int


def _safetensors_entry(entry, name: str) -> tuple[str, list, list]:
    """``(dtype, shape, data_offsets)`` of a header entry, each checked for its JSON type and range."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise InputError(f"{name}: malformed safetensors entry {_short(entry)}: expected an object with "
                         "dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise InputError(f"{name}: safetensors dtype {_short(dtype)} is not a string")
    if dtype not in _SAFETENSORS_BITS:
        raise InputError(f"{name}: dtype {dtype} is not BF16; gaac codes BF16 caches "
                         f"(safetensors dtypes {sorted(_SAFETENSORS_BITS)})")
    if not isinstance(shape, list) or not all(_whole(s) and s >= 0 for s in shape):
        raise InputError(f"{name}: safetensors shape {_short(shape)} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) and o >= 0 for o in offsets)):
        raise InputError(f"{name}: safetensors data_offsets {_short(offsets)} are not two non-negative integers")
    return dtype, shape, offsets


def _short(x, limit: int = 80) -> str:
    """``repr(x)``, cut to ``limit`` characters (a hostile header can hold megabytes)."""
    text = repr(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _read_torch(path: Path, kind: str, name: str):
    try:
        import torch
    except ImportError as exc:
        raise InputError(f"{name}: reading .pt files needs torch (pip install 'gaac[torch]')") from exc
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a file it cannot read
        # Only the first sentence: torch's advice on weights_only=False is not for a file gaac reads.
        why = _first_line(exc).split(". ")[0].rstrip(".")
        raise InputError(f"{name}: not a torch tensor file ({type(exc).__name__}: {why})") from exc
    if isinstance(obj, dict):
        obj = _pick(obj, kind, name)
    if not isinstance(obj, torch.Tensor):
        raise InputError(f"{name}: holds a {type(obj).__name__}, expected a torch.bfloat16 tensor")
    return obj


def parse_token_range(text: str, tokens: int) -> slice:
    """``'A:B'`` (either side may be empty) -> a slice of ``tokens`` tokens, checked."""
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start = int(parts[0]) if parts[0] else 0
        stop = int(parts[1]) if parts[1] else tokens
    except ValueError:
        raise InputError(f"token range {text!r}: expected A:B with integers, e.g. 0:512") from None
    if not 0 <= start < stop <= tokens:
        raise InputError(f"token range {text!r}: need 0 <= A < B <= {tokens} (the cache has {tokens} tokens)")
    return slice(start, stop)


# -- the shipped sample --------------------------------------------------------

SAMPLE_PROMPTS = ("prose", "code")


def load_sample(prompt: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """K, V and a description of one prompt of the real sample in ``gaac/data`` (see its README.md)."""
    if prompt not in SAMPLE_PROMPTS:
        raise InputError(f"sample prompt {prompt!r}: the package ships {SAMPLE_PROMPTS}")
    ref = resources.files("gaac") / "data" / f"smollm2-135m__{prompt}.npz"
    with resources.as_file(ref) as path, np.load(path, allow_pickle=False) as z:
        k, v, layers = z["k"], z["v"], z["layers"]
        meta = {"model": str(z["model"]), "prompt": prompt, "layers": [int(i) for i in layers]}
    return check_cache(k, f"sample {prompt} k"), check_cache(v, f"sample {prompt} v"), meta


def sample(prompt: str = "code") -> tuple[np.ndarray, np.ndarray]:
    """The real K/V cache shipped in the package, ``(k, v)`` as uint16 ``[4 layers, 3 KV heads, tokens, 64]``.

    Layers 0, 10, 20 and 29 of SmolLM2-135M-Instruct after one prefill of a
    ``"prose"`` prompt (768 tokens) or a ``"code"`` prompt (256 tokens); ``gaac/data/README.md``
    says how they were made.  Something to try gaac on without a model or files of one's own.
    """
    k, v, _ = load_sample(prompt)
    return k, v
