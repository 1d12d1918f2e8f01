"""One decode step of a paged cache: plan once, run attention per layer.

A serving loop's step appends one token per sequence to every layer and runs
attention per layer.  Everything that does not depend on the layer is worked
out once, by :meth:`gaac.PagedKVCache.decode_plan` (FlashInfer's plan/run):

    plan = cache.decode_plan(q_heads)                # lengths after this step's token, work list, reservation
    for layer in range(layers):
        k, v, q = ...                                # the model's layer
        out = plan.run(q, layer, k=k, v=v)           # the token appended, then attention: no synchronisation

``plan.run(q, layer, k=k, v=v)`` is ``cache.update_layer(layer, plan.seqs, k, v)`` then ``plan.run(q, layer)``
in one call: an eager step is bound by the host's time a layer, and one call checks its arguments once.

The plan reads only what the cache keeps on the host -- its copy of every
sequence's length -- so it never waits for the device.  Its split-KV work list
(:func:`gaac.attention.split_work`) depends on the lengths only, so the one list
serves every layer: the attention kernel reads each block's epoch and loads that
epoch's bases where it changes inside a split, from the layer's table of every
epoch (:meth:`gaac.PagedKVCache.epoch_table`), which keeps its place as epochs
are appended.  What the kernel needs of each layer (its arrays, the packed
launch parameters) is built the first time a layer runs and kept in the cache's
serving state (:class:`gaac.serving.state.ServingState`) until that layer's storage
is replaced (growth, a full epoch table).

The adaptation rule does not hold a step up: the appends encode finished blocks
with the published epochs (device buffers), the rule looks at finished blocks a
few steps after they complete a check (:data:`gaac.cache.ADAPT_LAG`), on the
device (where it runs on the host: from a host copy that has arrived by then),
and an epoch it appends is published for the steps launched after
(:meth:`gaac.PagedKVCache.account_decode_step`).

An eager step is bound by the host's time per launch, so its attention is one
launch a layer: the kernel's last warps merge the splits (``fused_merge`` in
:mod:`gaac.cuda.attention`).  A captured step (a plan of ``steps``) is bound by the
GPU instead, and launches the merge kernel, whose many blocks merge faster than
the kernel's last warps.

The plan also reserves the step: before anything is written it checks that
every layer's pools can take the blocks this step's appends finish
(:class:`gaac.errors.PoolExhaustedError` otherwise, or growth with
``grow=True``).  On the CPU (the reference codec) ``run`` is the reference
path of :func:`gaac.decode_attention`, so tests and CPU users write the same loop.

The plan reads and writes the cache only through its storage interface (the
:class:`gaac.PagedKVCache` docstring): lengths on the host and the device, the
layers' storage records, the epoch tables, ``reserve_step``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from .. import layout as L
from .. import attention
from ..attention import MAX_GROUP, _check_q, attention_layout, kernel_arguments, split_work, wave_target
from ..errors import FormatError, InputError
from ..attention_launch import layer_launch
from ..cache.hooks import RECORDING
from .append import append_token_launch, step_append, supported

LOG2_E = 1.4426950408889634
PLAN_AHEAD = 16 * L.BLOCK_TOKENS   # an eager step's work list covers lengths up to the next multiple of this
FUSED_MERGE = True          # an eager step's attention merges in the kernel (head_dim <= 128): one launch a layer
# What a one-step plan shares with the next one whose work list is the same (StepPlan._plan_kernel).
_SHARED = ("blocks_per_split", "n_work", "_merge", "_merge_grid", "_grid", "_work", "_split0", "o_part", "lse_part",
           "status", "_lse", "_scale_log2", "_status_params", "_plan_params", "_merge_launch", "_merge_buffer",
           "_merge_out", "_owner", "_current_stream", "_fused", "_mrg", "_group")


class _Account:
    """The host's account of the blocks an eager step's appends finished (:meth:`StepPlan.settle`): the layers
    appended since the last account and their blocks' epochs (K, V), and ``fin`` on the device once made.

    The plan holds it, and the cache too while it is pending, so that the cache's next call makes it
    even where the caller has dropped the plan; it names the cache only through ``appender``'s weak
    reference, so that the cache holds no plan and no cycle."""

    __slots__ = ("appender", "fin", "blk", "pending", "index")

    def __init__(self, appender, fin: np.ndarray, blk: np.ndarray):
        self.appender, self.fin, self.blk = appender, fin, blk
        self.pending = {}               # layer -> the epochs (K, V) of the blocks its append finished
        self.index = None               # ``fin`` on the device, made by the first account

    def settle(self) -> None:
        pending, self.pending = self.pending, {}
        if pending:
            self.index = self.appender.account(list(pending), self.fin, self.blk, pending, self.index)


class StepPlan:
    """Decode attention of one step for every layer of a :class:`gaac.PagedKVCache` (see the module docstring).

    Made by :meth:`gaac.PagedKVCache.decode_plan`.  ``q`` given to :meth:`run` is BF16
    ``[cache.max_seqs, q_heads, head_dim]``: row ``i`` is sequence ``i`` of the cache (rows without a
    live sequence give output 0 and LSE -inf).
    """

    _account = None             # the account of the blocks this step's appends finish (_Account)
    _room = None                # a captured bucket step's work-list room (_plan_kernel), else None
    _after_append = None        # (layer, cache generation, stream) of the one-token append launched last (GPU)
    _current_stream = None      # torch's current-stream accessor, where the plan launches through the driver (GPU)

    def __init__(self, cache, q_heads: int, *, append: int = 1, seqs=None, scale: float | None = None,
                 steps: int | None = None, bucket: int | None = None):
        hk, d = cache.kv_heads, cache.head_dim
        if isinstance(q_heads, bool) or not isinstance(q_heads, (int, np.integer)) or q_heads % hk \
                or not 1 <= q_heads // hk <= MAX_GROUP:
            raise InputError(f"q_heads {q_heads!r}: need 1..{MAX_GROUP} query heads per KV head ({hk} KV heads)")
        if isinstance(append, bool) or not isinstance(append, (int, np.integer)) or append < 0:
            raise InputError(f"append must be a non-negative number of tokens, got {append!r}")
        self.cache, self.q_heads, self.g = cache, int(q_heads), int(q_heads) // hk
        self.scale = attention.check_scale(scale, d)
        if steps is None and bucket is None and append == 1:
            prev = cache.serving.eager_plan
            if self._follow(prev if prev is not None else cache.serving.last_step, seqs):
                return
        lens = cache.host_lengths
        if (lens != lens[0]).any():
            layer = int(np.flatnonzero((lens != lens[0]).any(axis=1))[0])
            raise InputError(f"layer {layer} holds other lengths than layer 0 ({lens[layer].tolist()} against "
                             f"{lens[0].tolist()}): finish the step that is under way before planning the next")
        rows = np.asarray(cache.sequences if seqs is None else cache.check_seqs(seqs), np.int64)
        if len(np.unique(rows)) != len(rows):
            raise InputError(f"seqs {rows.tolist()}: each sequence may appear once in a step")
        self.seqs = rows.tolist()
        self._rows, self._all_seqs = rows, seqs is None
        before = lens[0].copy()
        self.lens = before.copy()
        self.lens[rows] += append
        self.batch = len(self.lens)
        self.steps = None
        self.kernel_path = cache.cuda_codec
        cache.serving.eager_plan = None
        self._fast = False
        if bucket is not None:
            from .graph import BucketSteps

            self.captured = BucketSteps(self, bucket, rows, before)
            self.steps = 1              # a step each time the bucket's plan is advanced (BucketSteps.advance)
            return
        if steps is None:
            cache.reserve_step(before, self.lens)
            if self.kernel_path:
                self._device_appends(rows, before, append)
                self._ahead_lens = self._ahead(self.lens)
                self._plan_kernel(self._ahead_lens)
                self._prepare_fast(rows, before, append)
            return
        from .graph import CapturedSteps

        if append != 1:
            raise InputError(f"a plan of steps appends one token per sequence a step; got append={append!r}")
        self.captured = CapturedSteps(self, steps, rows, before)
        self.steps = self.captured.steps
        if self.steps:
            self._plan_kernel(self.captured.end)
            self.captured.prepare()

    @property
    def size(self) -> int:
        """The places of the step's batch, ``len(plan.seqs)``: a bucket's plan counts its free places (-1) too."""
        return len(self.seqs)

    def _follow(self, prev, seqs) -> bool:
        """Make this plan as the successor of ``prev``, the previous eager step's plan (or, where the caller has
        dropped it, its record of the step it finished, :meth:`_record`), where it can be: ``prev``'s
        token reached every layer through :meth:`append_token` (one launch a layer), nothing else changed the
        cache since, this plan is for the same sequences, heads and scale, and neither step finishes a block.
        Then only the lengths advance: the pools need no reservation, the appends' launches and (while the
        lengths stay within the work list's rounded ones) the work list carry over.  False, nothing set,
        otherwise: the full plan follows."""
        cache = self.cache
        if (prev is None or prev._appender is None or prev._n_appended != cache.layers
                or cache.serving.generation != prev._gen
                or len(prev._fin) or prev.q_heads != self.q_heads or prev.scale != self.scale
                or not (prev._all_seqs if seqs is None else type(seqs) is list and seqs == prev.seqs)):
            return False
        rows, before = prev._rows, prev.lens
        # the lengths the previous step left, still the cache's: a captured step's account advances them without
        # a new generation (it must not invalidate its own plan), and a record outlives its plan
        if not np.array_equal(cache.host_lengths[0], before):
            return False
        after = before[rows] + 1
        if not (after % L.BLOCK_TOKENS).all():
            return False
        lens = before.copy()
        lens[rows] = after
        ahead = self._ahead(lens)
        if not np.array_equal(ahead, prev._ahead_lens):
            return False
        self.seqs, self._rows, self._all_seqs, self.lens, self.batch = prev.seqs, rows, prev._all_seqs, lens, prev.batch
        self.steps, self.kernel_path, self._fast, self._ahead_lens = None, True, False, ahead
        cache.serving.eager_plan = None
        for name in _SHARED:
            if name in prev.__dict__:
                setattr(self, name, prev.__dict__[name])
        self.status.zero_()
        self._appender, self._fin, self._blk = prev._appender, prev._fin, prev._blk
        self._prepare_fast(rows, before, 1, prev._dev)
        return True

    # -- the CUDA kernel's plan -------------------------------------------------------------------
    def _ahead(self, lens: np.ndarray) -> np.ndarray:
        """The lengths an eager step's work list is made for: ``lens`` rounded up to ``PLAN_AHEAD`` tokens, at
        most what a sequence can hold (a full block table and a tail of ``BLOCK_TOKENS - 1`` tokens after it).
        The kernel stops each split at the length it reads on the device, so the list serves every step until
        a sequence passes the rounded length, and the steps in between reuse it (the cache's ``serving.work_plans``)
        instead of building one a block."""
        ahead = -(-lens // PLAN_AHEAD) * PLAN_AHEAD
        return np.minimum(ahead, (self.cache.max_blocks + 1) * L.BLOCK_TOKENS - 1)

    def _split(self, lens: np.ndarray):
        """The split-KV work of the lengths ``lens``: splits of each sequence's blocks, whatever their epochs
        (the kernel loads each block's bases), sized for one wave of the layer kernel; and the runs."""
        cache = self.cache
        nblk = -(-lens // L.BLOCK_TOKENS)
        runs = [(int(b), 0, int(nblk[b])) for b in np.flatnonzero(nblk)]
        state = layer_launch(cache, 0, self.g, self._fused)
        waves = cache.serving.wave
        target = waves.get(id(state.kernel))
        if target is None:
            target = waves[id(state.kernel)] = wave_target(state.kernel, cache.device_lengths)[0]
        return split_work(runs, self.batch, cache.kv_heads, target), runs, state

    def _refresh_work(self, lens: np.ndarray) -> bool:
        """A plan with room (:meth:`_plan_kernel`): write the work list of the lengths ``lens`` into its buffers in
        place (asynchronous copies on the current stream, after the steps launched before), so that the
        launches recorded with them -- a captured step's -- serve the new lengths.  False (nothing written)
        where the list needs more entries than the room."""
        split, _, _ = self._split(lens)
        if split.n_work > self._room:
            return False
        work = np.zeros((self._room, 3), np.int32)          # free entries: no blocks (the kernel leaves at once)
        work[:split.n_work] = split.work.reshape(-1, 3)
        self._work.copy_(self.cache.to_device(work.reshape(-1)))
        self._split0.copy_(self.cache.to_device(split.split0))
        self.n_work, self.blocks_per_split = split.n_work, split.blocks_per_split
        return True

    def _plan_kernel(self, lens: np.ndarray, room: int | None = None) -> None:
        """The work list for the lengths ``lens`` (this step's; a captured plan's: its last step's).  ``room``
        (a captured step for a batch-size bucket): the list's buffers hold that many entries, the kernel's
        grid covers them all, and :meth:`_refresh_work` rewrites them in place."""
        from ..cuda import merge
        from ..cuda.primitives import SIMULATOR

        cache, hk, d = self.cache, self.cache.kv_heads, self.cache.head_dim
        self._fused = FUSED_MERGE and self.steps is None and room is None and d <= 128
        split, runs, state = self._split(lens)
        key = (tuple(runs), self.batch, self.q_heads, self.scale, id(state.kernel))
        shared = cache.serving.work_plans.get(key) if self.steps is None and room is None else None
        if shared is not None:
            # The lengths' blocks are those of an earlier step: its work list, partials and launch
            # parameters serve this one (stream order keeps the steps' uses apart).
            self.__dict__.update(shared)
            self.status.zero_()
            return
        self._room = room
        if room is not None:
            room = max(room, split.n_work)
            self._room = room
        if self._fused:                 # no merge kernel: its split index, launcher and parameters are not made
            work, mrg, self._group = fused_merge_work(split, self.batch, hk)
            self.n_work = len(work) // 3
            self._mrg = cache.to_device(mrg)
            rows = self.n_work + int(mrg[2 * (self.batch + 1) - 1])       # the splits', then the groups'
        else:
            work, self.n_work, self._group = split.work, split.n_work, 0
            if room is not None:
                work = np.concatenate([work, np.zeros(3 * (room - self.n_work), np.int32)])
            self._mrg = torch.zeros(1, dtype=torch.int32, device=cache.device)
            rows = max(self.n_work if room is None else room, 1)
            grid, threads, lanes = merge.merge_launch(self.batch, self.q_heads, d, int(split.splits.max(initial=0)))
            self._merge, self._merge_grid = merge.merge_kernel(d, lanes), (tuple(int(x) for x in grid), threads)
            self._split0 = cache.to_device(split.split0)
        self.blocks_per_split = split.blocks_per_split
        self._grid = (max(self.n_work if room is None else room, 1), hk)
        self._work = cache.to_device(work if len(work) else np.zeros(3, np.int32))
        dev = cache.device
        self.o_part = torch.empty(rows * hk * self.g * d, dtype=torch.float32, device=dev)
        self.lse_part = torch.empty(rows * hk * self.g, dtype=torch.float32, device=dev)
        self.status = torch.zeros(cache.layers, dtype=torch.int32, device=dev)
        self._lse = torch.empty((self.batch, self.q_heads), dtype=torch.float32, device=dev)
        self._scale_log2 = np.float32(self.scale * LOG2_E)
        if not SIMULATOR:
            from ..cuda.launch import FastLaunch, ParamBuffer, current_stream, kernel_arg_names
            from ..cuda.merge import merge_signature

            self._current_stream = current_stream
            # The plan's part of every layer's parameters, packed once by the kernel's argument names (a layer's
            # buffer takes them at its first call; a call writes only the addresses of q, out and lse): q's
            # shape, the work list and partials, the scale, the fused merge's mrg, out and lse (without the
            # fused merge, mrg's one word stands in for both: the kernel does not read them), the batch and the
            # group size; and each layer's status word.
            layout = attention_layout(state.kernel)
            n, m = (self.batch * self.q_heads * d, self.batch * self.q_heads) if self._fused else (1, 1)
            self._plan_params = [layout.vector("q32", self.batch * self.q_heads * d // 2),
                                 layout.pack("work", self._work), layout.pack("o_part", self.o_part),
                                 layout.pack("lse_part", self.lse_part), layout.pack("scale_log2", self._scale_log2),
                                 layout.pack("mrg", self._mrg), layout.vector("out", n), layout.vector("lse_out", m),
                                 layout.pack("merge_batch", self.batch), layout.pack("group", self._group)]
            base = self.status.data_ptr()
            self._status_params = [layout.vector("status", 1, base + 4 * i) for i in range(cache.layers)]
            if not self._fused:
                # One launcher per merge kernel for the cache's life: its first call compiles through numba.
                launchers = cache.serving.launchers
                self._merge_launch = launchers.get(id(self._merge))
                if self._merge_launch is None:
                    self._merge_launch = launchers[id(self._merge)] = FastLaunch(
                        self._merge, None, self._merge_grid[1], pdl=True)
                self._merge_launch.prepare(merge_signature())
                # the merge's parameters by name; a call writes the data pointers of out and lse
                merge = self._merge_buffer = ParamBuffer.for_signature(
                    merge_signature(), kernel_arg_names(self._merge),
                    dict(o_part=self.o_part, lse_part=self.lse_part, split0=self._split0, kv_heads=cache.kv_heads,
                         g=self.g))
                merge.set_vector("out", self.batch * self.q_heads * d)
                merge.set_vector("lse", self.batch * self.q_heads)
                self._merge_out = (merge.layout.data_slot("out"), merge.layout.data_slot("lse"))
        self._owner = object()           # what the layers' parameter buffers were last written for
        if self.steps is None and room is None:
            cache.serving.work_plans = {key: {name: getattr(self, name) for name in _SHARED if hasattr(self, name)}}

    # -- running --------------------------------------------------------------------------------------
    def run(self, q, layer: int, *, k=None, v=None, out=None, lse=None, return_lse: bool = False):
        """Attention of layer ``layer`` for this step: BF16 ``[max_seqs, q_heads, head_dim]`` (torch bfloat16
        from the fused kernel; in ``q``'s kind on the reference path), and with ``return_lse`` the float32
        natural-log LSE ``[max_seqs, q_heads]``.  ``out`` (int16 or bfloat16) and ``lse`` reuse buffers.

        ``k`` and ``v``: the layer's token of this step, ``[len(plan.seqs), kv_heads, 1, head_dim]`` as
        :meth:`gaac.PagedKVCache.update_layer` takes it, appended before the attention exactly as
        ``cache.update_layer(layer, plan.seqs, k, v)`` appends it: one call a layer, which on an eager step
        saves the host a second call's dispatch and checks (its launches are the same two).  Without them
        the layer must already hold this step's tokens."""
        with self.cache.lock:
            if k is None and v is None:
                return self._run(q, layer, out, lse, return_lse)
            if k is None or v is None:
                raise InputError("k and v: give both (the layer's token of this step) or neither")
            if self._fast:
                res = self._append_run_fast(q, layer, k, v, out, lse, return_lse)
                if res is not None:
                    return res
            self.cache.update_layer(layer, self.seqs, k, v)
            return self._run(q, layer, out, lse, return_lse)

    def _append_run_fast(self, q, layer, k, v, out, lse, return_lse):
        """:meth:`run` with the token, where :meth:`append_token`'s fast path takes it: the append launched, then the
        attention through :meth:`_run_fast` on the same stream as its programmatic dependent (through :meth:`_run`,
        which names what is wrong, where ``q``, ``out`` or ``lse`` is not what the plan expects, as a second
        call would).  None, nothing done, where the token is not what the fast path takes."""
        cache = self.cache
        if type(layer) is not int or not 0 <= layer < cache.layers or self._appended[layer]:
            return None
        shape, dev, state = self._token_shape, self._dev, self._state
        if (not (_on_gpu(k, shape, dev) and _on_gpu(v, shape, dev)) or state.eager_plan is not self
                or state.recording is not None or RECORDING.plans or cache.deferring or not self._lengths_hold(layer)):
            return None
        handle = self._current_stream()
        follows = self._append(layer, k, v, handle)
        res = self._run_fast(q, layer, out, lse, return_lse, handle, follows)
        return res if res is not None else self._run(q, layer, out, lse, return_lse)

    def _run(self, q, layer, out, lse, return_lse):
        if self._fast:
            res = self._run_fast(q, layer, out, lse, return_lse)
            if res is not None:
                return res
        cache = self.cache
        cache.check_layer(layer)
        if self.steps is not None:
            self.captured.check_run(layer)
        elif not np.array_equal(cache.host_lengths[layer], self.lens):
            raise InputError(f"layer {layer} holds {cache.host_lengths[layer].tolist()} tokens per sequence; this plan "
                             f"is for {self.lens.tolist()}: append the step's tokens to the layer before its attention")
        if not self.kernel_path:
            return attention.decode_attention(q, cache.layer_view(layer), scale=self.scale, return_lse=return_lse,
                                              backend="cpu", q_heads=self.q_heads, out=out, lse=lse)
        from ..cuda import attention as K

        shape = (self.batch, self.q_heads, cache.head_dim)
        if not (isinstance(q, torch.Tensor) and q.dtype in (torch.bfloat16, torch.int16) and q.shape == shape
                and q.device.type == cache.device.type and q.is_contiguous()):
            _check_q(q, _Shape(self.batch, cache.head_dim, cache.kv_heads), cache.device.type, self.q_heads)
            raise InputError(f"q: expected a contiguous BF16 tensor {list(shape)} on {cache.device}, got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {list(getattr(q, 'shape', []))}")
        state = layer_launch(cache, layer, self.g, self._fused)
        given = out, lse
        if out is not None and (not isinstance(out, torch.Tensor) or out.dtype not in (torch.int16, torch.bfloat16)
                                or out.shape != shape or out.device != q.device):
            raise InputError(f"out: expected a BF16 or int16 tensor {list(shape)} on {q.device}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}")
        if lse is not None and (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
                                or lse.shape != shape[:2] or lse.device != q.device):
            raise InputError(f"lse: expected a float32 tensor {list(shape[:2])} on {q.device}, got "
                             f"{getattr(lse, 'dtype', type(lse).__name__)} {list(getattr(lse, 'shape', []))}")
        # The kernels write contiguous buffers; a strided ``out`` or ``lse`` receives a copy.
        if out is None or not out.is_contiguous():
            out = torch.empty(shape, dtype=torch.int16, device=cache.device)
        if lse is None or not lse.is_contiguous():
            lse = self._lse if given[1] is None and not return_lse else torch.empty(
                shape[:2], dtype=torch.float32, device=cache.device)
        if K.SIMULATOR:
            status = self.status[layer:layer + 1]
            q32 = q.view(torch.int16).view(torch.int32).reshape(-1)
            o, l_ = out.view(torch.int16).reshape(-1), lse.reshape(-1)
            if self.n_work or self._room:
                fused = (o, l_) if self._fused else (self._mrg[:1].view(torch.int16), self._mrg.view(torch.float32))
                values = {name: v.numpy() if isinstance(v, torch.Tensor) else v for name, v in state.values.items()}
                values.update(q32=q32.numpy(), work=self._work.numpy(), o_part=self.o_part.numpy(),
                              lse_part=self.lse_part.numpy(), status=status.numpy(), scale_log2=self._scale_log2,
                              mrg=self._mrg.numpy(), out=fused[0].numpy(), lse_out=fused[1].numpy(),
                              merge_batch=self.batch, group=self._group)
                state.kernel[self._grid, K.WARP](*kernel_arguments(state.kernel, values))
            if not self._fused:
                self._merge[self._merge_grid](self.o_part.numpy(), self.lse_part.numpy(), self._split0.numpy(),
                                              o.numpy(), l_.numpy(), cache.kv_heads, self.g)
        else:
            self._launch(state, layer, q, out, lse)
        for buf, val in zip(given, (out, lse)):
            if buf is not None and buf is not val:
                buf.copy_(val.view(buf.dtype))
        out = given[0] if given[0] is not None else out
        out = out if out.dtype == torch.bfloat16 else out.view(torch.bfloat16)
        lse = given[1] if given[1] is not None else lse
        return (out, lse) if return_lse else out

    def _run_fast(self, q, layer, out, lse, return_lse, handle=None, follows=None):
        """:meth:`run` where every argument is as the plan expects it (the layer appended through the plan,
        contiguous tensors of the plan's shapes on the cache's GPU): the launches and nothing else.
        None where anything differs; :meth:`_run` then checks in full (and names what is wrong).  ``handle`` and
        ``follows``: as :meth:`_launch` takes them."""
        cache = self.cache
        if type(layer) is not int or not 0 <= layer < cache.layers:
            return None
        if not (self._appended[layer] and self._state.generation == self._gen) \
                and not np.array_equal(cache.host_lengths[layer], self.lens):
            return None
        shape, dev = self._q_shape, self._dev
        if not _on_gpu(q, shape, dev):
            return None
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16, device=cache.device)
        elif not _on_gpu(out, shape, dev):
            return None
        if lse is None:
            lse = torch.empty(shape[:2], dtype=torch.float32, device=cache.device) if return_lse else self._lse
        elif not _on_gpu(lse, shape[:2], dev, (torch.float32,)):
            return None
        self._launch(layer_launch(cache, layer, self.g, self._fused), layer, q, out, lse, handle, follows)
        out = out if out.dtype is torch.bfloat16 else out.view(torch.bfloat16)
        return (out, lse) if return_lse else out

    def _launch(self, state, layer: int, q, out, lse, handle: int | None = None, follows: bool | None = None) -> None:
        """The layer's attention kernel (with the fused merge: one launch) or the kernel and the merge kernel, from
        their parameter buffers (GPU): the plan's part of a layer's buffer is written at its first call, a call
        writes only its arrays' addresses.  ``handle``: the current stream, where the caller has it; ``follows``:
        whether the launch before on that stream is this layer's append (None: as :meth:`appended_last` noted)."""
        if handle is None:
            handle = self._current_stream()
        if follows is None:
            follows = self._follows_append(layer, handle)
        if self.n_work or self._room:
            buf = state.buffer
            if buf.owner is not self._owner:
                for at, packed in self._plan_params:
                    buf.write(at, packed)
                buf.write(*self._status_params[layer])
                buf.owner = self._owner
            slots = buf.slots
            slots[state.q_slot] = q.data_ptr()
            if self._fused:                 # the kernel merges
                o, l_ = state.out_slots
                slots[o], slots[l_] = out.data_ptr(), lse.data_ptr()
            state.main.run(buf, self._grid, handle, pdl=follows)
            if self._fused:
                return
        merge = self._merge_buffer
        o, l_ = self._merge_out
        merge.slots[o], merge.slots[l_] = out.data_ptr(), lse.data_ptr()
        self._merge_launch.run(merge, self._merge_grid[0], handle)

    def _device_appends(self, rows: np.ndarray, before: np.ndarray, append: int) -> None:
        """Whether this step's token appends go through the cache's :class:`gaac.serving.append.StepAppend` (one
        launch a layer, block ends encoded on the device with the published epochs): wherever the cache can
        (:func:`gaac.serving.append.supported`) and the step appends one token."""
        cache = self.cache
        self._appender = None
        if append != 1 or not len(rows) or not supported(cache):
            return
        after = before[rows] + 1
        done = after % L.BLOCK_TOKENS == 0
        self._appender = step_append(cache, rows)
        self._fin, self._blk = rows[done], after[done] // L.BLOCK_TOKENS - 1

    def _prepare_fast(self, rows: np.ndarray, before: np.ndarray, append: int, dev: int | None = None) -> None:
        """Set up the per-call fast paths of an eager plan: ``cache.update_layer`` of the step's token
        (:meth:`append_token`), and on the GPU :meth:`run` (``dev``: the cache's device index, if known)."""
        from ..cuda.launch import device_index
        from ..cuda.primitives import SIMULATOR

        cache = self.cache
        self._appended = [False] * cache.layers
        self._n_appended = 0
        self._account = _Account(self._appender, self._fin, self._blk) if self._appender is not None else None
        self._token_shape = None
        self._before = before
        self._state = cache.serving
        self._gen = self._state.generation
        self._host_lens = cache.host_lengths     # the live array while the generation holds (growth replaces it)
        if SIMULATOR:
            self._dev = None
        else:
            self._fast = True
            self._dev = device_index(cache.device) if dev is None else dev
            self._q_shape = (self.batch, self.q_heads, cache.head_dim)
        if self._appender is not None:
            self._token_shape = (len(rows), cache.kv_heads, 1, cache.head_dim)
            self._state.eager_plan = self
        elif not SIMULATOR and append == 1 and len(rows) \
                and not (before[rows] % L.BLOCK_TOKENS == L.BLOCK_TOKENS - 1).any():
            self._token_shape = (len(rows), cache.kv_heads, 1, cache.head_dim)
            self._index = cache.to_device(np.stack([rows, before[rows] % L.BLOCK_TOKENS, before[rows] + 1])
                                           .astype(np.int32))
            self._state.eager_plan = self

    def append_token(self, layer, seqs, k, v) -> bool:
        """``cache.update_layer(layer, seqs, k, v)`` of this step's token where the call is exactly what the
        plan expects (``seqs`` the plan's list, a layer not yet appended, nothing else changed in the cache,
        contiguous BF16 or int16 ``[len(seqs), kv_heads, 1, head_dim]`` on the cache's device): one launch
        writes both tails and the layer's lengths -- and encodes the blocks the token finishes -- and the
        host advances its copy of the lengths; its account of the finished blocks waits for the step's last
        layer (:meth:`settle`).  False (nothing done) otherwise: ``update_layer`` then checks the call in full."""
        cache = self.cache
        shape = self._token_shape
        if (type(layer) is not int or not 0 <= layer < cache.layers or self._appended[layer]
                or type(seqs) is not list or seqs != self.seqs
                or not _on_gpu(k, shape, self._dev) or not _on_gpu(v, shape, self._dev)
                or not self._lengths_hold(layer)):
            return False
        if self._append(layer, k, v):
            self.appended_last(layer)
        return True

    def _lengths_hold(self, layer: int) -> bool:
        """Whether ``layer`` holds the lengths this plan was made from: certain while nothing but this plan's
        appends changed the cache, else compared (in the host's lengths of now: growth of the rows replaces
        the array)."""
        state = self._state
        if state.generation != self._gen:
            self._host_lens = self.cache.host_lengths
            return np.array_equal(self._host_lens[layer], self._before)
        return True

    def _append(self, layer: int, k, v, handle: int | None = None) -> bool:
        """Launch ``layer``'s append of the step's token (checked by the caller) on stream ``handle`` (default the
        current one) and advance the host's lengths; the account of the blocks it finishes waits for the step's
        last layer (:meth:`settle`).  Whether the append is the last launch on the stream (no account made
        after it)."""
        cache, state = self.cache, self._state
        app = self._appender
        if app is not None:
            app.launch(layer, k, v, contiguous=True, handle=handle)
            self._account.pending[layer] = app.epochs(layer)
            state.unsettled = self._account
        else:
            append_token_launch(cache, layer, self._index, self._token_shape[0], k.data_ptr(), v.data_ptr())
        self._host_lens[layer] = self.lens
        state.generation += 1
        self._gen = state.generation
        self._appended[layer] = True
        self._n_appended += 1
        done = self._n_appended == cache.layers
        if done:
            self._record()
        if done and self._account is not None and self._account.pending:
            self.settle()       # every step is accounted: the adaptation rule's lag counts steps
            return False
        return True

    def _record(self) -> None:
        """Keep in the cache's serving state what :meth:`_follow` reads of this plan, now that its step reached every
        layer: a serving loop that makes each step's plan inside a function drops the plan before the next
        one is made, and the next plan follows this record instead (only the lengths advance, no work list
        made again).  The record names no plan and no cache (the appender's reference is weak): no cycle."""
        names = ("_appender", "_n_appended", "_gen", "_fin", "_blk", "q_heads", "scale", "_all_seqs", "seqs", "_rows",
                 "lens", "_ahead_lens", "_dev", "batch")
        record = SimpleNamespace(**{name: getattr(self, name, None) for name in names})
        record.__dict__.update((name, self.__dict__[name]) for name in _SHARED if name in self.__dict__)
        self._state.last_step = record

    def appended_last(self, layer: int) -> None:
        """Note that the launch just made on the current stream is ``layer``'s one-token append of this step (the
        append kernels of :mod:`gaac.serving.append` and :mod:`gaac.cuda.append`): :meth:`run` of that layer then
        launches the attention kernel as its programmatic dependent, which overlaps the kernel's start with the
        append (:mod:`gaac.cuda.attention` says what it reads before it waits for the append)."""
        if self._current_stream is not None:
            self._after_append = (layer, self.cache.serving.generation, self._current_stream())

    def _follows_append(self, layer: int, handle: int) -> bool:
        """Whether the launch before ``layer``'s attention on stream ``handle`` is that layer's append of this
        step, nothing in the cache changed since (:meth:`appended_last`); asked once, at the attention's launch."""
        after, self._after_append = self._after_append, None
        return after == (layer, self.cache.serving.generation, handle)

    def settle(self) -> None:
        """The host's account of the blocks this step's appends finished (:meth:`StepAppend.account
        <gaac.serving.append.StepAppend.account>`), for every layer appended since the last account, in one
        copy of the pools' counts and one of the finished blocks: made when the step's last layer is
        appended, or by the cache's next call if the step stops part way."""
        cache, account = self.cache, self._account
        if account is None:
            return
        if cache.serving.unsettled is account:
            cache.serving.unsettled = None
        account.settle()

    def device_driven(self):
        """A plan of ``steps``: the context in which ``cache.update_layer`` (one token) and :meth:`run` launch
        the device-driven step, for a CUDA graph to capture (:mod:`gaac.serving.graph`).  Run eagerly, it is
        one step.  Every layer takes one token, before its attention; a step that does otherwise is refused
        (:class:`InputError`) and leaves the cache as it was."""
        self._need_steps("device_driven")
        return self.captured.device_driven(self)

    def replayed(self) -> None:
        """A plan of ``steps``: the host's account of one replay of the captured step (no synchronisation):
        its copy of the lengths and of the blocks the step finished.  Call it once per ``graph.replay()``
        (or eager run of the step); a call with no step run since the last is refused where the host can
        tell without waiting for the device
        (:meth:`CapturedSteps.replayed <gaac.serving.graph.CapturedSteps.replayed>`)."""
        self._need_steps("replayed")
        self.captured.replayed()

    def _need_steps(self, what: str) -> None:
        if self.steps is None:
            raise InputError(f"{what}: this plan is for one eager step; cache.decode_plan(q_heads, steps=N) makes a "
                             "plan of N device-driven steps")

    def check_status(self) -> None:
        """Raise :class:`FormatError` naming the layers whose attention found a malformed slot or table entry
        this step (synchronises with the device: call it where the loop waits for the device anyway)."""
        if not self.kernel_path:
            return
        status = self.status.cpu().numpy()
        errors = [attention.status_error(int(status[i]), layer=int(i), seqs=self.seqs) for i in np.flatnonzero(status)]
        if errors:
            raise FormatError(" | ".join(str(e) for e in errors))


@dataclass
class _Shape:
    """What :func:`gaac.attention._check_q` reads of a view: the batch, head size and KV heads."""

    batch: int
    head_dim: int
    kv_heads: int

    @property
    def seq_lens(self):
        return np.zeros(self.batch)


_BITS = (torch.bfloat16, torch.int16)


def _on_gpu(x, shape: tuple, device: int | None, dtypes: tuple = _BITS) -> bool:
    """Whether ``x`` is a contiguous torch tensor of ``shape`` on CUDA device ``device`` (None: on the CPU,
    as in the simulator), of one of ``dtypes`` (default BF16 or int16)."""
    return (type(x) is torch.Tensor and x.dtype in dtypes and x.shape == shape
            and (x.is_cuda and x.get_device() == device if device is not None else not x.is_cuda)
            and x.is_contiguous())


def fused_merge_work(split, batch: int, kv_heads: int) -> tuple:
    """The work list and ``mrg`` array of the kernel's fused merge, and its group size.

    Every sequence row gets at least one split (a row without blocks one of no blocks, whose warps store an
    empty partial), so that its output is written: the fused merge writes a row's output from its splits.
    Splits come in groups of ``group`` (about the square root of the most a sequence has, at least 8), so
    that neither level of the merge folds many rows.  ``mrg`` int32: the splits' first index per sequence
    ``[B + 1]``, the groups' first slot per sequence ``[B + 1]``, then zeroed counters, one per (slot, KV
    head) and one per (sequence, KV head), which the kernel leaves at zero."""
    held = split.splits > 0
    splits = np.where(held, split.splits, 1).astype(np.int64)
    split0 = np.concatenate([[0], np.cumsum(splits)])
    work = np.zeros((int(split0[-1]), 3), np.int32)            # (row, 0, 0): a split of no blocks
    work[:, 0] = np.repeat(np.arange(batch), splits)
    work[np.repeat(held, splits)] = split.work.reshape(-1, 3)  # the rows' own splits, in order
    group = max(8, math.isqrt(int(splits.max(initial=1)) - 1) + 1)
    group0 = np.concatenate([[0], np.cumsum(-(-splits // group))])
    mrg = np.zeros(2 * (batch + 1) + (int(group0[-1]) + batch) * kv_heads, np.int32)
    mrg[:batch + 1], mrg[batch + 1:2 * (batch + 1)] = split0, group0
    return work.reshape(-1), mrg, group
