"""Launching numba.cuda kernels from torch without numba's per-call host cost, and the array helpers for it.

numba's own launch, ``kernel[grid, block, stream](*args)``, spends 100 us or more of host time per call
(it types every argument and marshals each array through the CUDA array interface): more than a
decode step's small kernels run on the GPU.  So a kernel is compiled through numba once (an explicit
signature, or numba's first ordinary launch) and from then on launched by its ``CUfunction`` with
``cuda.core.launch``, its parameters packed here (:func:`params`): the arguments that do not change
are packed once per plan, so a call packs only its own arrays.  Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) there is no ``CUfunction``, and launches go through numba's dispatcher.

Shared by :mod:`gaac.cuda.codec`, :mod:`gaac.fp8.cuda` (tile codecs, one warp per tile:
:class:`TileLauncher`) and :mod:`gaac.attention` (:class:`FastLaunch`); the array helpers check and
view torch tensors (NumPy arrays in the simulator) as the tile codecs' kernels take them.
"""
from __future__ import annotations

import ctypes

import numpy as np
from numba import cuda

from ..errors import InputError
from .primitives import SIMULATOR, WARP

WORD = 4                                         # bytes per kernel word (uint32)


def is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch")


def check_array(x, name: str, dtype: str, shape: tuple):
    """Check ``x`` (dtype name, shape with ``None`` for any size, C-contiguous, right device); return it."""
    if is_torch(x):
        got = str(x.dtype).removeprefix("torch.")
        contiguous = x.is_contiguous()
        if SIMULATOR and x.device.type != "cpu":
            raise InputError(f"{name}: the CUDA simulator runs on the CPU; got a tensor on {x.device}")
        if not SIMULATOR and x.device.type != "cuda":
            raise InputError(f"{name}: expected a CUDA tensor, got one on {x.device}")
    elif isinstance(x, np.ndarray) and SIMULATOR:
        got = str(x.dtype)
        contiguous = x.flags.c_contiguous
    else:
        want = "a torch tensor" + (" or NumPy array" if SIMULATOR else " on a CUDA device")
        raise InputError(f"{name}: expected {want}, got {type(x).__name__}")
    if got != dtype:
        raise InputError(f"{name}: dtype {got}, expected {dtype}")
    if len(x.shape) != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InputError(f"{name}: shape {list(x.shape)}, expected {want}")
    if not contiguous:
        raise InputError(f"{name}: must be C-contiguous")
    return x


def words(x):
    """``x`` as the kernels take it: 32-bit words, its trailing axes (after the first) merged.

    An int32 view on the GPU (numba reads torch tensors through the CUDA array
    interface, which has no uint32); a NumPy uint32 view in the simulator, where
    the kernels' arithmetic then stays in ``uint32`` as it does on the GPU.
    """
    lead = x.shape[0]
    if is_torch(x):
        import torch

        if x.numel() and x.data_ptr() % 16:
            raise InputError("arrays must start on a 16-byte boundary (slice whole rows of a pool)")
        w = x.reshape(lead, -1).view(torch.int32)
        return w.numpy().view(np.uint32) if SIMULATOR else w
    return x.reshape(lead, -1).view(np.uint32)


def plain(x):
    """A 1-D int32 array as the kernel takes it (a NumPy view in the simulator)."""
    return x.numpy() if SIMULATOR and is_torch(x) else x


def simulated(args) -> list:
    """Launch arguments for numba's simulator: each NumPy array wrapped as the simulator's device array over the
    same memory.  A bare array is copied in and out of every launch, so two arguments that are one array (K's
    and V's raw tiles, both the cache's one arena) would each write their copy back over the other's writes."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return [FakeCUDAArray(a) if isinstance(a, np.ndarray) and a.ndim > 0 else a for a in args]


def allocators(x):
    """(zeros, arange) allocating like ``x``: torch on its device, or NumPy."""
    if is_torch(x):
        import torch

        return (lambda shape, dt: torch.zeros(shape, dtype=getattr(torch, dt), device=x.device),
                lambda n: torch.arange(n, dtype=torch.int32, device=x.device))
    return (lambda shape, dt: np.zeros(shape, dtype=dt), lambda n: np.arange(n, dtype=np.int32))


# How numba's launch lays out an array argument's parameters: these fields, then its shape and strides.
ARRAY_FIELDS = ("meminfo", "parent", "nitems", "itemsize", "data")


def params(a) -> list:
    """Kernel parameters of one argument (an int64 scalar, Python or NumPy, or a tensor), laid out as
    numba's own launch lays them out: the :data:`ARRAY_FIELDS`, then shape and strides."""
    if isinstance(a, (int, np.integer)):
        return [ctypes.c_int64(int(a))]
    item = a.element_size()
    return [0, 0, a.numel(), item, a.data_ptr(), *a.shape, *[s * item for s in a.stride()]]


def word_params(x) -> list:
    """:func:`params` of ``words(x)`` without building that view (saves host time per call)."""
    if x.numel() and x.data_ptr() % 16:
        raise InputError("arrays must start on a 16-byte boundary (slice whole rows of a pool)")
    rows = x.shape[0]
    cols = x.numel() * x.element_size() // WORD // rows if rows else 0
    return [0, 0, rows * cols, WORD, x.data_ptr(), rows, cols, cols * WORD, WORD]


def current_stream() -> int:
    """The raw handle of torch's current CUDA stream.  torch's C accessor takes about a microsecond;
    ``torch.cuda.current_stream()`` builds a Stream object and checks the device (tens of microseconds on
    a slow host, three times per layer of a decode step)."""
    import torch

    try:
        return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    except AttributeError:             # a torch without the accessor
        return torch.cuda.current_stream().cuda_stream


def device_index(device) -> int:
    """The index of the CUDA ``device`` (a torch.device): its own, or the current device's where it names none
    (``torch.device("cuda")``), so that one GPU has one key in the per-device caches."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def cufunction(dispatcher):
    """The ``CUfunction`` of a dispatcher's (one) compiled kernel: numba compiled it, ``cuda.core`` launches it."""
    kernel = next(iter(dispatcher.overloads.values()))
    return kernel._codelibrary.get_cufunc().kernel


def resident_blocks(dispatcher, signature, threads: int) -> tuple[int, int, int]:
    """Thread blocks of ``threads`` one SM holds at once for ``dispatcher`` compiled for ``signature``
    (GPU only; compiles it, which the first launch would do anyway), with the registers per thread and
    the static shared bytes per block of that build.

    Asks the driver rather than a register count written down from ptxas, which goes stale with every
    change of the kernel.  Also asks for the largest shared-memory carveout: kernels that stream
    through ``cp.async`` into shared memory need little L1, and the driver's default carveout can hold
    fewer blocks than their registers allow."""
    kernel = dispatcher.compile(signature)
    fn = kernel._codelibrary.get_cufunc()
    fn.set_shared_memory_carveout(100)
    n = int(cuda.current_context().get_active_blocks_per_multiprocessor(fn, threads, 0))
    return n, int(fn.attrs.regs), int(fn.attrs.shared)


_CUFUNCS = {}       # id(dispatcher) -> (dispatcher, its CUfunction): resolved once per process, not per plan
_STREAMS = {}       # raw stream handle -> cuda.core Stream
_CONFIGS = {}       # (grid, threads) -> cuda.core LaunchConfig


class TileLauncher:
    """A compiled kernel (one warp per tile, ``tiles_per_block`` tiles per block), launched on a torch
    stream (or in the simulator).

    What a launch needs besides its parameters (the kernel's ``CUfunction``, launch configurations,
    stream objects) is kept per process: a cache makes plans for every layer and kind, and a new
    cache's first prefill would otherwise resolve them once per plan."""

    def __init__(self, dispatcher, tiles_per_block: int):
        self._dispatcher = dispatcher
        self._tiles = tiles_per_block
        self._threads = WARP * tiles_per_block
        self._streams = {}
        self._cufunc = None

    def launch(self, n: int, args, stream=None, fast: bool = True, packed=None):
        """Launch over ``n`` tiles, with ``args`` or, on the fast path, the ``packed`` parameters."""
        grid = -(-n // self._tiles)
        if SIMULATOR:
            self._dispatcher[grid, self._threads](*simulated(args))
            return
        handle = stream.cuda_stream if stream is not None else current_stream()
        if not fast:
            s = self._streams.get(("numba", handle))
            if s is None:
                s = self._streams[("numba", handle)] = cuda.external_stream(handle)
            self._dispatcher[grid, self._threads, s](*args)
            return
        from cuda.core import LaunchConfig, Stream, launch

        if self._cufunc is None:
            known = _CUFUNCS.get(id(self._dispatcher))
            if known is None or known[0] is not self._dispatcher:
                known = _CUFUNCS[id(self._dispatcher)] = (self._dispatcher, cufunction(self._dispatcher))
            self._cufunc = known[1]
        config = _CONFIGS.get((grid, self._threads))
        if config is None:
            config = _CONFIGS[(grid, self._threads)] = LaunchConfig(grid=grid, block=self._threads, shmem_size=0)
        s = _STREAMS.get(handle)
        if s is None:
            s = _STREAMS[handle] = Stream.from_handle(handle)
        launch(s, config, self._cufunc, *(packed if packed is not None else packed_params(args)))


_ARG_NAMES = {}      # id(dispatcher) -> (dispatcher, its argument names)


def kernel_arg_names(dispatcher) -> tuple:
    """The names of a numba kernel's arguments, in order (from its Python function), read once per kernel."""
    known = _ARG_NAMES.get(id(dispatcher))
    if known is None or known[0] is not dispatcher:
        import inspect

        known = _ARG_NAMES[id(dispatcher)] = (dispatcher, tuple(inspect.signature(dispatcher.py_func).parameters))
    return known[1]


def _arg_types(signature) -> tuple:
    """A kernel signature's argument types: numba types, or a signature string (``"void(int32[::1], ...)"``)."""
    if isinstance(signature, str):
        from numba.core import sigutils

        return tuple(sigutils.normalize_signature(signature)[0])
    return tuple(signature)


class ParamLayout:
    """Where each argument of a kernel lies among its packed parameters (:func:`params`), by name.

    Made from the kernel's signature (its argument types) and its argument names
    (:func:`kernel_arg_names`): an array of ``n`` dimensions takes ``5 + 2n`` slots (:data:`ARRAY_FIELDS`,
    shape, strides), a scalar one (a float32 in the low half of its slot).  Callers address parameters by
    the kernel's argument names -- :meth:`pack` an argument, :meth:`data_slot` of an array -- and never count
    slots; a value whose packing does not fit its argument's slots is refused."""

    _made = {}           # (argument types, names) -> ParamLayout: one per kernel signature

    def __new__(cls, signature, names):
        types_ = _arg_types(signature)
        key = (types_, tuple(names))
        layout = cls._made.get(key)
        if layout is None:
            layout = cls._made[key] = super().__new__(cls)
            layout._init(types_, tuple(names))
        return layout

    def _init(self, types_: tuple, names: tuple) -> None:
        from numba import types

        if len(types_) != len(names):
            raise ValueError(f"{len(names)} argument names for a signature of {len(types_)} arguments")
        self.names, self.types = names, dict(zip(names, types_))
        self.at = {}                       # name -> (first slot, slots)
        floats, n = [], 0
        for name, t in zip(names, types_):
            count = len(ARRAY_FIELDS) + 2 * t.ndim if isinstance(t, types.Array) else 1
            if t == types.float32:
                floats.append(n)
            self.at[name] = (n, count)
            n += count
        self.size, self.floats = n, frozenset(floats)

    def __len__(self) -> int:
        return self.size

    def __reduce__(self):
        # one layout per signature: a copy (or an unpickled one) is the process's own
        return ParamLayout, (tuple(self.types[name] for name in self.names), self.names)

    def __deepcopy__(self, memo):
        return self

    def slot(self, name: str, field: str | None = None) -> int:
        """The first slot of argument ``name`` (``field``: that field of an array's, one of :data:`ARRAY_FIELDS`)."""
        first, _ = self.at[name]
        return first if field is None else first + ARRAY_FIELDS.index(field)

    def data_slot(self, name: str) -> int:
        """The slot of array argument ``name``'s data pointer (what a call rewrites)."""
        return self.slot(name, "data")

    def pack(self, name: str, value) -> tuple:
        """``(first slot, packed parameters)`` of ``value`` (an array, an int, or a float for a float32 argument)
        as argument ``name``."""
        first, count = self.at[name]
        if first in self.floats:
            packed = [value if isinstance(value, ctypes.c_float) else ctypes.c_float(float(value))]
        else:
            packed = params(value)
        if len(packed) != count:
            raise ValueError(f"{name}: {len(packed)} packed parameters for an argument of {count} slots")
        return first, packed

    def vector(self, name: str, n: int, data: int = 0) -> tuple:
        """``(first slot, packed parameters)`` of a C-contiguous 1-D array of ``n`` items at address ``data`` as
        argument ``name`` (its item size from the signature): for an array whose address a call writes."""
        first, count = self.at[name]
        item = self.types[name].dtype.bitwidth // 8
        packed = [0, 0, n, item, data, n, item]
        if len(packed) != count:
            raise ValueError(f"{name}: a vector for an argument of {count} slots")
        return first, packed

    def packed(self, values: dict) -> list:
        """Every parameter in order, ``values`` (name -> value) packed into their arguments' slots, zeros (0.0
        for a float32) elsewhere: what :class:`ParamBuffer` holds, as a list for a launch through ``cuda.core``."""
        out = [ctypes.c_float(0.0) if i in self.floats else 0 for i in range(self.size)]
        for name, value in values.items():
            first, packed = self.pack(name, value)
            out[first:first + len(packed)] = packed
        return out

    def buffer(self, values: dict | None = None) -> "ParamBuffer":
        """A :class:`ParamBuffer` of this layout with ``values`` (name -> value) packed in."""
        buf = ParamBuffer(self.packed(values or {}))
        buf.layout = self
        return buf


class ParamBuffer:
    """A kernel's parameters kept in host memory between launches, as ``cuLaunchKernel`` takes them.

    One 8-byte slot per packed parameter (:func:`params`: the words of numba's array layout and int64
    scalars; a float32 in the low half of its slot), and the array of pointers to the slots.  A caller
    writes the slots that change (a call's arrays, a step's work list) and launches: the driver copies
    the values at launch, so a slot may be rewritten as soon as the launch returns.  Made for a kernel's
    signature (:meth:`for_signature`), the buffer is addressed by argument name (:meth:`set`,
    :meth:`set_data`, :attr:`layout`).
    """

    __slots__ = ("slots", "pointers", "_base", "_floats", "owner", "layout")

    @classmethod
    def for_signature(cls, signature, names, values: dict | None = None) -> "ParamBuffer":
        """The buffer of a kernel of ``signature`` (numba types or a signature string) whose arguments are
        ``names`` (:func:`kernel_arg_names`), ``values`` (name -> value) packed in, zeros elsewhere."""
        return ParamLayout(signature, names).buffer(values)

    def set(self, name: str, value) -> None:
        """Pack ``value`` into argument ``name``'s slots."""
        self.write(*self.layout.pack(name, value))

    def set_vector(self, name: str, n: int, data: int = 0) -> None:
        """Argument ``name`` as a C-contiguous 1-D array of ``n`` items at ``data`` (:meth:`ParamLayout.vector`)."""
        self.write(*self.layout.vector(name, n, data))

    def set_data(self, name: str, pointer: int) -> None:
        """Write the data pointer of array argument ``name``."""
        self.slots[self.layout.data_slot(name)] = pointer

    def __init__(self, packed: list):
        n = len(packed)
        self.slots = (ctypes.c_int64 * n)()
        self._base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * n)(*(self._base + 8 * i for i in range(n)))
        self._floats = frozenset(i for i, p in enumerate(packed) if isinstance(p, ctypes.c_float))
        self.owner = None                 # what the step-dependent slots were last written for (the caller's)
        self.layout = None                # the kernel's ParamLayout, where made for its signature
        self.write(0, packed)

    def __len__(self) -> int:
        return len(self.slots)

    def write(self, at: int, packed: list) -> None:
        """Write packed parameters (ints, ``c_int64``, ``c_float``) into the slots from ``at`` on."""
        try:
            self.slots[at:at + len(packed)] = packed         # plain ints: one slice assignment
            return
        except TypeError:
            pass
        for i, p in enumerate(packed, at):
            if isinstance(p, ctypes.c_float):
                ctypes.c_float.from_address(self._base + 8 * i).value = p.value
            else:
                self.slots[i] = p.value if isinstance(p, ctypes.c_int64) else p

    def packed(self) -> list:
        """The parameters as :func:`params` packs them (for a launch through ``cuda.core``)."""
        return [ctypes.c_float.from_address(self._base + 8 * i) if i in self._floats else self.slots[i]
                for i in range(len(self.slots))]


class _Driver:
    """``cuLaunchKernel`` and ``cuLaunchKernelEx`` of the CUDA driver, called through ctypes: a call costs
    about a microsecond of host time where ``cuda.core``'s ``launch`` converts every parameter."""

    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6

    class Attribute(ctypes.Structure):
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]

    class Config(ctypes.Structure):
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("n_attrs", ctypes.c_uint)]

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u, p = ctypes.c_uint, ctypes.c_void_p
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
        self.launch.restype = ctypes.c_int
        self.launch_ex = lib.cuLaunchKernelEx
        self.launch_ex.argtypes = [p, p, p, p]
        self.launch_ex.restype = ctypes.c_int
        # The same entry points without argument types, for calls whose arguments are ctypes values built
        # once (:meth:`FastLaunch.run`): ctypes then converts nothing, half the host time of a call.
        self.launch_raw = lib["cuLaunchKernel"]
        self.launch_raw.restype = ctypes.c_int
        self.launch_ex_raw = lib["cuLaunchKernelEx"]
        self.launch_ex_raw.restype = ctypes.c_int
        self._function = lib.cuKernelGetFunction
        self._function.argtypes = [ctypes.POINTER(p), p]
        self._function.restype = ctypes.c_int
        self._name = lib.cuGetErrorName
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def function(self, compiled) -> int:
        """The ``CUfunction`` of numba's compiled kernel in the current context (numba loads kernels as
        ``CUkernel``; an older loader's handle is already a function)."""
        handle = int(compiled.handle if hasattr(compiled, "handle") else compiled._handle)
        out = ctypes.c_void_p()
        if self._function(ctypes.byref(out), handle) == 0 and out.value:
            return out.value
        return handle

    def check(self, result: int, what: str) -> None:
        if result:
            name = ctypes.c_char_p()
            self._name(result, ctypes.byref(name))
            raise RuntimeError(f"{what}: CUDA error {result} ({(name.value or b'?').decode()})")

    def config(self, grid, block, stream: int, pdl: bool):
        """A launch configuration for ``cuLaunchKernelEx``, with programmatic stream serialization."""
        attr = self.Attribute(self.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        ctypes.c_int.from_address(ctypes.addressof(attr) + self.Attribute.value.offset).value = int(pdl)
        cfg = self.Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0, stream,
                          ctypes.addressof(attr), 1)
        cfg._attr = attr                  # kept alive with the configuration
        return cfg


_DRIVER = None


def driver():
    """The ctypes driver entry points (:class:`_Driver`), loaded once; None where they cannot be."""
    global _DRIVER
    if _DRIVER is None:
        try:
            _DRIVER = _Driver()
        except (OSError, AttributeError):
            _DRIVER = False
    return _DRIVER or None


_NUMBA_DTYPES = {}


def signature_of(args, any_layout: bool = False) -> tuple:
    """The numba argument types of ``args`` (torch tensors and ints) as numba's launch would infer them, except
    that a tensor that is not C-contiguous is typed ``'A'`` (any strides) whatever its strides, and with
    ``any_layout`` every tensor is (one compiled kernel for inputs that are views or not)."""
    from numba import types

    if not _NUMBA_DTYPES:
        import torch

        _NUMBA_DTYPES.update({torch.int8: types.int8, torch.uint8: types.uint8, torch.int16: types.int16,
                              torch.int32: types.int32, torch.int64: types.int64, torch.float32: types.float32})
    return tuple(types.int64 if isinstance(a, (int, np.integer)) else
                 _array_type(a.dtype, a.dim(), "C" if a.is_contiguous() and not any_layout else "A")
                 for a in args)


_ARRAY_TYPES = {}     # (torch dtype, dimensions, layout) -> numba array type


def _array_type(dtype, ndim: int, layout: str):
    """numba's array type, made once per kind of array: making one costs more than a launch's packing."""
    key = (dtype, ndim, layout)
    t = _ARRAY_TYPES.get(key)
    if t is None:
        from numba import types

        t = _ARRAY_TYPES[key] = types.Array(_NUMBA_DTYPES[dtype], ndim, layout)
    return t


def packed_params(args) -> list:
    """:func:`params` of every argument in ``args``, one flat list."""
    return [p for a in args for p in params(a)]


_BY_SIGNATURE = {}    # (kernel, block, signature) -> (kernel, FastLaunch, its ParamBuffer)


def launch_args(dispatcher, grid, block, args, stream: int, any_layout: bool = False) -> None:
    """Launch ``dispatcher`` over ``grid`` x ``block`` with ``args`` (CUDA tensors and ints) on the raw stream
    ``stream`` through the driver: numba's own launch converts every tensor through the CUDA array interface
    (milliseconds for a kernel of a dozen arrays on a slow host).  Compiled once per signature
    (:func:`signature_of`, ``any_layout`` as there); the parameters are packed per call."""
    sig = signature_of(args, any_layout)
    key = (id(dispatcher), tuple(_dims(block)), sig)
    entry = _BY_SIGNATURE.get(key)
    packed = packed_params(args)
    if entry is None or entry[0] is not dispatcher:
        launcher = FastLaunch(dispatcher, grid, block)
        launcher.prepare(sig)
        entry = _BY_SIGNATURE[key] = (dispatcher, launcher, ParamBuffer(packed))
    else:
        # the driver copies the parameters when the launch is queued: one buffer a signature, rewritten
        entry[2].write(0, packed)
    entry[1].run(entry[2], tuple(_dims(grid)), stream)


def _dims(x) -> tuple:
    x = (x,) if isinstance(x, int) else tuple(x)
    return x + (1,) * (3 - len(x))


class FastLaunch:
    """A numba kernel (GPU only) launched on torch's current stream with parameters packed by the caller.

    Made for kernels with many arguments (the attention kernel has 32), whose fixed parameters a plan
    packs once so that a call leaves only the per-call arrays.  ``__call__`` launches through
    ``cuda.core`` (its first call through numba, which compiles); :meth:`run`, the decode step's path,
    launches a :class:`ParamBuffer` through the driver after :meth:`prepare` has compiled.
    """

    def __init__(self, dispatcher, grid, block, pdl: bool = False):
        self._dispatcher, self._grid, self._block = dispatcher, grid, block
        self._pdl = pdl                     # programmatic stream serialization (see ``__call__``)
        self._cufunc = None
        self._function = None               # the driver's CUfunction handle (``run``)
        self._ex_configs = {}               # (grid, stream) -> launch configuration and its ctypes arguments (``run``)
        self._dims = {}                     # (grid, stream) -> cuLaunchKernel's ctypes arguments before the parameters
        self._configs = {}
        self._streams = {}

    def prepare(self, signature) -> None:
        """Compile for ``signature`` (numba types) without launching: a launch being captured into a CUDA
        graph must not compile, and a first launch through numba would run the kernel."""
        if self._cufunc is None:
            # the overload for this signature (a dispatcher may hold others)
            self._cufunc = self._dispatcher.compile(signature)._codelibrary.get_cufunc().kernel

    def __call__(self, args, params_of, grid=None):
        """Launch with ``args`` (first call), later with ``params_of(params)``: the packed parameters.
        ``grid`` replaces the launcher's own for this call (a step plan's grid changes with the lengths)."""
        grid = self._grid if grid is None else grid
        handle = current_stream()
        if self._cufunc is None:
            stream = cuda.external_stream(handle)
            self._dispatcher[grid, self._block, stream](
                *(cuda.as_cuda_array(a) if is_torch(a) else a for a in args))
            self._cufunc = cufunction(self._dispatcher)
            return
        from cuda.core import LaunchConfig, Stream, launch

        config = self._configs.get(grid)
        if config is None:
            # ``pdl``: the kernel may start before the previous kernel on the stream has finished (once
            # that kernel's blocks have run ``griddepcontrol.launch_dependents``); it must itself wait
            # (``griddepcontrol.wait``) before it reads what that kernel wrote.
            # A cuda.core without the option launches in plain stream order: as correct
            # (the wait is then a no-op), without the overlap.
            try:
                config = LaunchConfig(grid=grid, block=self._block, shmem_size=0,
                                      programmatic_stream_serialization=self._pdl)
            except TypeError:
                self._pdl = False
                config = LaunchConfig(grid=grid, block=self._block, shmem_size=0)
            self._configs[grid] = config
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = Stream.from_handle(handle)
        launch(s, config, self._cufunc, *params_of(params))

    def run(self, buffer: ParamBuffer, grid=None, handle: int | None = None, pdl: bool | None = None) -> None:
        """Launch with the parameters of ``buffer`` (after :meth:`prepare` or a first call) through the
        driver: the per-call path of a decode step, whose host time is the launch itself.  ``handle``: the
        raw stream (default torch's current one); ``pdl``: this launch with (or without) programmatic stream
        serialization, whatever the launcher's own setting."""
        grid = self._grid if grid is None else grid
        if handle is None:
            handle = current_stream()
        drv = driver()
        if drv is None:
            self(None, lambda p: buffer.packed(), grid=grid)
            return
        if self._function is None:
            self._check_arguments(buffer)
            self._function = drv.function(self._cufunc)
        key = (grid, handle)
        if self._pdl if pdl is None else pdl:
            cfg = self._ex_configs.get(key)
            if cfg is None:
                cfg = drv.config(_dims(grid), _dims(self._block), handle, True)
                self._ex_configs[key] = (cfg, ctypes.c_void_p(ctypes.addressof(cfg)), ctypes.c_void_p(self._function))
            result = drv.launch_ex_raw(*self._ex_configs[key][1:], buffer.pointers, None)
        else:
            head = self._dims.get(key)
            if head is None:
                u = ctypes.c_uint
                head = self._dims[key] = (ctypes.c_void_p(self._function),
                                          *(u(x) for x in (*_dims(grid), *_dims(self._block), 0)),
                                          ctypes.c_void_p(handle))
            result = drv.launch_raw(*head, buffer.pointers, None)
        if result:
            drv.check(result, f"launching {self._name}")

    @property
    def _name(self) -> str:
        return getattr(self._dispatcher, "__name__", "a kernel")

    def _check_arguments(self, buffer: ParamBuffer) -> None:
        """A buffer of another length than the kernel's parameters would launch with garbage: refuse it
        (where the driver can say how many the kernel takes)."""
        try:
            n = int(self._cufunc.num_arguments)
        except Exception:               # a driver or cuda.core that cannot say
            return
        if n != len(buffer):
            raise RuntimeError(f"{self._name}: {len(buffer)} packed parameters for a kernel of {n}")
