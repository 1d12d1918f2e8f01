"""A decode step the device drives by itself, for CUDA graphs: the captured plan of :mod:`gaac.serving.plan`.

An eager step is planned by the host from the lengths it keeps (:class:`gaac.serving.plan.StepPlan`); a CUDA
graph replays the same launches step after step, so its kernels must find on the device what changes
between steps.  A plan made with ``steps=N`` (``cache.decode_plan(q_heads, steps=N)``) does that for the
next ``N`` steps of one token per sequence:

    plan = cache.decode_plan(q_heads, steps=256)      # plan.steps <= 256 steps, all reserved
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), plan.device_driven():
        for layer in range(layers):                   # the model's step, inputs and outputs in fixed buffers
            cache.update_layer(layer, seqs, k, v)
            plan.run(q, layer, out=out)
    for _ in range(plan.steps):
        graph.replay()
        plan.replayed()                              # the host's own account of the step

:class:`StepGraph` runs a serving loop for a model's step function: one graph per batch-size bucket
(:class:`BucketSteps`), replayed whatever sequences join or leave.

What the device reads instead of the host:

* **Appends** (:func:`gaac.cuda.codec.step_append_kernel`, one launch a layer for K and V): each
  sequence's position is its length on the device, which the kernel advances.  A warp per (head, kind)
  writes its share of the token; where the token completes the block, the same warp encodes its tile
  straight from the tail into the pools, popping records from the device free lists, and writes the
  block-table entry and the block's epoch.
* **Attention**: the work list covers the lengths of the plan's last step (a length-independent split
  for the plan's steps); the kernel stops each split at the sequence's length now, and the merge skips
  the splits that are still empty.  The kernel reads each block's epoch and that epoch's bases.
* **Epochs**: the appends encode with the published epochs (``cache.epochs_now`` and the bases buffers),
  which the host changes between steps where the adaptation rule appends an epoch.

What stays with the host, in :meth:`CapturedSteps.replayed` (no synchronisation): its copy of the
lengths, the blocks it knows finished (pool counts, each block's epoch, the blocks the adaptation rule
observes, copied to pinned memory for it).  The host knows which blocks a step finishes because every
step appends one token to every sequence of the plan.

Limits, worked out when the plan is made (``plan.steps`` may come out below the ``steps`` asked for):

* every pool can take every tile the plan's steps finish (or grows, with ``grow``), since a tile's slot
  or raw record is decided only on the device.

The adaptation rule's checks do not end a plan: the host looks at the finished blocks a few steps later and
publishes an epoch it appends through device buffers (:meth:`gaac.PagedKVCache.account_decode_step`).  Anything else
that changes the cache (another update, a removal, growth) ends a plan of steps: ``replayed`` raises
:class:`InputError`, since the graph's launches name arrays that may be gone.  A bucket's step
(:class:`BucketSteps`, what :class:`StepGraph` runs) lives through joins, removals and changing lengths: it
refreshes its device buffers before each replay instead.

What the host checks of a recording and of its account, since a graph replays whatever was recorded and
the host's lengths must follow the device's:

* a recorded step appends every layer once (``cache.update_layer`` of a layer appended already is refused
  before it launches; a layer left out is refused as the ``with`` block ends), and runs a layer's
  attention only after that layer's append (attention over the old tokens is refused);
* ``plan.replayed()`` is called once per step that ran: a step run eagerly (a recording outside a CUDA graph
  capture runs its launches) is accounted by one call before the next recording, and a second call, or a
  call before any step ran or inside the recording, is refused.  The plan does not see ``graph.replay()`` (torch's), and reading the device's lengths would
  wait for it, so after a captured recording it takes each call for one replay: more calls than the
  graph's replays go unnoticed until ``plan.steps`` calls, past which it refuses;
* a refused recording leaves the cache as it was: under a capture nothing ran; run eagerly, the layers it
  appended are taken back (the device's lengths return to the host's, the records their finished blocks
  took go back to the pools) and the plan ends, so that the next plan starts from the host's lengths.

A change to another cache while a step is recorded would be replayed on every step and accounted once:
:func:`gaac.cache.hooks.check_not_recording` refuses it, for a cache that records no plan of its own, where
the cache's ``update_layer`` and ``append`` call it (:data:`gaac.cache.hooks.RECORDING` names the plans this
thread records: a recording adds itself there).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import numpy as np

from .. import layout as L
from ..errors import InputError
from ..cache.hooks import RECORDING
from ..cache.pools import latest_version
from .append import StepAppend, step_append


def _check_device_driven(cache, count, name: str, what: str, unit: str) -> None:
    """Refuse a device-driven step ``what`` that ``cache`` cannot record, or a ``count`` (argument ``name``, a
    number of ``unit``) that is not positive."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise InputError(f"{name} must be a positive number of {unit}, got {count!r}")
    if not cache.cuda_codec:
        raise InputError(f"{what} records the CUDA codec's device-driven step; this cache runs the reference codec "
                         "(make it on a GPU, or with codec='cuda' in the simulator)")
    if L.tiles_per_head(cache.head_dim) != 1:
        raise InputError(f"a captured step encodes finished blocks straight from the tails, which needs one tile per "
                         f"head: head_dim 64 or 128, not {cache.head_dim}")


class CapturedSteps:
    """The device-driven part of a :class:`gaac.serving.plan.StepPlan` made with ``steps`` (module docstring).

    The plan holds it; it names the plan by a weak reference (:attr:`plan`), so that the two make no cycle
    that would keep the cache's storage after the caller drops the plan."""

    places = False              # a plan of the sequences it was made for (BucketSteps: of a bucket's places)

    def __init__(self, plan, steps, rows: np.ndarray, before: np.ndarray):
        cache = plan.cache
        _check_device_driven(cache, steps, "steps", "a plan of steps", "decode steps")
        if not len(rows):
            raise InputError("a plan of steps needs at least one live sequence")
        cache.serving.device_steps = True       # its steps pop records the host accounts only when told
        self._plan, self.cache, self.rows = weakref.ref(plan), cache, rows
        self.steps = int(steps)
        self.end = before.copy()
        self.end[rows] += self.steps
        self.step = 0
        self._appended = None       # the layers the recording in progress appended (None: no recording)
        self._ran = False           # a step ran eagerly (recorded outside a capture), not yet accounted by replayed()
        self._captured = False      # whether a recording was captured: its replays are torch's, unseen by the plan
        cache.reserve_step(before, self.end)
        self._generation = None

    @property
    def plan(self):
        """The step plan this is the device-driven part of."""
        return self._plan()

    # -- before recording --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Compile every kernel the step launches (a launch being captured must not compile) and make the
        step's device arrays and each layer's encoders."""
        from ..attention_launch import layer_launch
        from ..cuda import attention as K
        from ..cuda.merge import merge_signature

        cache, plan = self.cache, self.plan
        self.appender = step_append(cache, self.rows)
        self.appender.prepare()
        if not K.SIMULATOR:
            for layer in range(cache.layers):
                layer_launch(cache, layer, plan.g).main.prepare(K.kernel_signature())
            plan._merge_launch.prepare(merge_signature())
        self._generation = cache.serving.generation

    # -- recording ---------------------------------------------------------------------------------
    @contextmanager
    def device_driven(self, plan):
        """The recording of a step of ``plan`` (this one's plan, held until the recording ends)."""
        cache = self.cache
        if not self.steps:
            raise InputError("this plan has no steps to record (plan.steps is 0): run the next step eagerly, "
                             "then plan again")
        serving = cache.serving
        if serving.recording is not None:
            raise InputError("another plan's step is being recorded")
        self.check_current()
        if self._ran:
            raise InputError("the step this plan last ran eagerly is not accounted: call plan.replayed() before "
                             "recording the next")
        capturing = _capturing(cache)
        serving.recording = self
        self._appended = set()
        RECORDING.plans.append(self)
        recorded = False
        try:
            yield plan
            missing = [layer for layer in range(cache.layers) if layer not in self._appended]
            if missing:
                raise InputError(f"the recorded step appends no token to layer(s) {missing}: a plan of steps "
                                 f"advances every layer's lengths a step, so each of the {cache.layers} layers takes "
                                 "its token (cache.update_layer) once")
            recorded = True
        finally:
            serving.recording = None
            RECORDING.plans.remove(self)
            appended, self._appended = self._appended, None
            if not recorded and appended and not capturing:
                self._take_back(appended)
        if capturing:
            self._captured = True
        else:
            self._ran = True

    def check_recording(self, what: str) -> None:
        if self.cache.serving.recording is not self:
            raise InputError(f"{what}: a plan of steps runs inside `with plan.device_driven():` (captured in a "
                             "CUDA graph, or run eagerly there), its host account kept by plan.replayed()")

    def check_run(self, layer: int) -> None:
        """``plan.run(q, layer)``: inside the recording, after the step's append to ``layer``."""
        self.check_recording("run")
        if layer not in self._appended:
            raise InputError(f"run(q, {layer}): layer {layer} has not taken this step's token; append it "
                             f"(cache.update_layer) before its attention, which would otherwise leave it out")

    def check_current(self) -> None:
        if self.cache.serving.generation != self._generation:
            raise InputError("the cache changed since this plan of steps was made (another update, a removal, "
                             "growth): its launches may name arrays that are gone; make a new plan and capture "
                             "it again")
        if self.step >= self.steps:
            raise InputError(f"this plan's {self.steps} steps are used; make a new plan")

    def record_append(self, layer: int, seqs: list, k, v) -> None:
        """``cache.update_layer`` while recording (it has checked the layer, the sequences and the bits): one
        launch appends the token to both tails, advances the lengths and encodes the blocks it completes
        (:func:`gaac.cuda.codec.step_append_kernel`).  A layer takes one token a step: a second append is
        refused before it launches."""
        cache = self.cache
        if seqs != self.plan.seqs:
            raise InputError(f"sequences {seqs}: this plan of steps appends to {self.plan.seqs}, in that order")
        if k.shape[2] != 1:
            raise InputError(f"k {list(k.shape)} and v {list(v.shape)}: a plan of steps appends one token, "
                             f"[{len(seqs)}, {cache.kv_heads}, 1, {cache.head_dim}] each")
        layer = int(layer)
        if layer in self._appended:
            raise InputError(f"layer {layer} already took this step's token: a plan of steps appends one token per "
                             "layer a step (the host accounts one)")
        self.appender.launch(layer, k, v)
        self._appended.add(layer)
        self.plan.appended_last(layer)

    def _take_back(self, layers) -> None:
        """Undo the appends of a refused recording that ran eagerly (outside a capture): ``layers`` took a token
        the host does not account.  Their device lengths return to the host's, and the records that the
        encodes of the blocks they finished took (read from the block table: a refused step waits for the
        device) go back to the pools, as a removal gives them back.  The plan ends (the pools' free lists
        are new): the next plan starts from the host's lengths."""
        self.cache.undo_device_appends(self.rows, layers)

    # -- after each replay -------------------------------------------------------------------------
    def replayed(self) -> None:
        """The host's account of one replayed (or eagerly run) step: lengths, the blocks it finished.

        Once per step that ran (module docstring): a step run eagerly is accounted once; after a captured
        recording each call stands for one ``graph.replay()``, which the plan cannot see without waiting for
        the device, so only calls past ``plan.steps`` are refused there."""
        self._refuse_while_recording()
        self.check_current()
        if self._ran:
            self._ran = False
        elif not self._captured:
            raise InputError("replayed(): no step of this plan ran since its last account: record the step (`with "
                             "plan.device_driven():`), and call plan.replayed() once per graph.replay() or eager run")
        self._account_step()

    def _refuse_while_recording(self) -> None:
        if self.cache.serving.recording is self:
            raise InputError("replayed(): the step is being recorded; account it after the `with "
                             "plan.device_driven():` block (and, for a captured graph, after each graph.replay())")

    def _account_step(self) -> None:
        """The host's account of a step that ran: the rows' lengths advance, the blocks they finished are
        accounted (pools, block epochs, the rule's copies) without reading the device."""
        cache, rows = self.cache, self.rows
        lens = cache.host_lengths
        after = lens[0, rows] + 1
        done = after % L.BLOCK_TOKENS == 0
        lens[:, rows] += 1
        self.step += 1
        app = self.appender
        # the published epochs, which a step's finished blocks took (read only where some block finished)
        epochs = [app.epochs(layer) for layer in range(cache.layers)] if done.any() else None
        app.account(range(cache.layers), rows[done], after[done] // L.BLOCK_TOKENS - 1, epochs)


class BucketSteps(CapturedSteps):
    """The device-driven step of a batch-size bucket: the part of a :class:`gaac.serving.plan.StepPlan` made with
    ``bucket=size`` that :class:`StepGraph` captures once and replays for every batch of up to ``size``
    sequences, step after step, whatever joins, leaves or adaptation checks come between.

    What a replay reads lives in device buffers that keep their place, and the host refreshes them before
    a replay where they must change (:meth:`advance`):

    * **places** (``plan.seqs``): the bucket's ``size`` places, each a sequence row or -1 (free); the append
      kernel skips a free place.  A batch that differs rewrites them (one small copy).
    * **the work list** (``room`` entries, the kernel's grid, and the merge's split index): made for the
      lengths rounded up to :data:`gaac.serving.plan.PLAN_AHEAD` tokens; rewritten where a sequence passes its
      rounded length or holds another length than the plan expects (a join, a removal).  Entries past the
      list are free (the kernel leaves them at once).
    * **epochs**: the appends encode finished blocks with the published epochs (``cache.epochs_now`` and
      the bases buffers), the attention kernel reads each block's epoch and every epoch's bases from the
      layer's table: an epoch the adaptation rule appends between steps changes buffers, not launches.

    The arrays the launches name (pools, free lists, tables, epoch tables) stay in place through removals,
    joins and published epochs; only growth (of pools, the arena's lending arrays, a full epoch table)
    replaces one, and then :meth:`valid` is False: the plan is made and captured again.  The host's account
    of a step (:meth:`replayed`) is the one of a plan of steps, for the sequences of the batch."""

    places = True

    def __init__(self, plan, size, rows: np.ndarray, before: np.ndarray):
        cache = plan.cache
        _check_device_driven(cache, size, "bucket", "a bucket's step", "sequences")
        if not 1 <= len(rows) <= size:
            raise InputError(f"{len(rows)} sequences for a bucket of {size}: a bucket's step takes 1 to {size}")
        cache.serving.device_steps = True       # its steps pop records the host accounts only when told
        self._plan, self.cache, self.size = weakref.ref(plan), cache, int(size)
        self.rows = np.asarray(rows, np.int64)
        plan.seqs = self._places(self.rows)
        self.steps, self.step = 1, 0
        self._appended = None
        self._ran = False
        self._captured = False
        after = before.copy()
        after[self.rows] += 1
        cache.reserve_step(before, after)
        self.appender = StepAppend(cache, np.asarray(plan.seqs, np.int64))
        self.expect = before.copy()     # the host's lengths the buffers were last made for
        self.cover = self._cover(after)
        plan._fused = False                 # a captured step launches the merge kernel
        plan._plan_kernel(self.cover, room=self._room_for(plan, self.cover))
        self.prepare()
        self._ready = True              # the buffers serve the next step
        self._versions = self._pool_versions()
        self._latest = latest_version()
        self._storage = cache.storage_version

    def _places(self, rows: np.ndarray) -> list:
        return [int(r) for r in rows] + [-1] * (self.size - len(rows))

    def _cover(self, after: np.ndarray) -> np.ndarray:
        """The lengths the work list is made for: those of the batch's rows after the step, rounded up."""
        cover = np.zeros_like(after)
        cover[self.rows] = self.plan._ahead(after)[self.rows]
        return cover

    def _room_for(self, plan, cover: np.ndarray) -> int:
        """Entries of the work list's buffers: the batch's list (at least a split per place of the bucket)
        rounded up to whole waves of the attention kernel.  The grid walks entries within each KV head, so a
        free entry is dispatched among the splits; entries that end the wave the list ends in cost nothing,
        while entries past it push real splits into a second wave (docs/design/serving.md).  Splits are
        sized to fit the waves they fill (:func:`gaac.attention.split_work`), so lengths that grow and joins
        keep the list in that room; a list that outgrows it is planned and captured again."""
        split, _, state = plan._split(cover)
        per_wave = max(self.cache.serving.wave[id(state.kernel)] // self.cache.kv_heads, 1)
        return -(-max(split.n_work, self.size, 1) // per_wave) * per_wave

    def _pool_versions(self) -> tuple:
        cache = self.cache
        return tuple(p.version for layer in range(cache.layers) for s in cache.stores(layer)
                     for p in (s.slots, s.raw))

    def valid(self) -> bool:
        """Whether the launches recorded for this plan still name the cache's arrays (no growth since)."""
        cache = self.cache
        if cache.storage_version != self._storage:
            return False
        if latest_version() != self._latest:
            if self._pool_versions() != self._versions:
                return False
            self._latest = latest_version()
        return True

    def check_current(self) -> None:
        if not self.valid():
            raise InputError("the cache's arrays were replaced since this bucket's step was made (growth): its "
                             "launches name arrays that are gone; make the plan and capture it again")

    def advance(self, rows) -> bool:
        """Make the device buffers serve the next step for the sequences ``rows`` (an int64 array of cache
        rows, at most the bucket's size, each live once), and reserve the step.  False where they cannot:
        the cache's arrays changed (growth), or the batch's work list needs more entries than the room;
        then the plan is made and captured again.  Raises :class:`PoolExhaustedError` (nothing written)
        where the pools cannot take the step's finished blocks."""
        cache = self.cache
        if not self.valid():
            return False
        rows = np.asarray(rows, np.int64)
        if len(rows) > self.size:
            raise InputError(f"{len(rows)} sequences for a bucket of {self.size}")
        before = cache.host_lengths[0]
        refresh = not (len(rows) == len(self.rows) and (rows == self.rows).all())
        if refresh:
            places = self._places(rows)
            self.appender.rows_dev.copy_(cache.to_device(np.asarray(places, np.int32)))
            self.appender.rows = np.asarray(places, np.int64)
            self.plan.seqs[:] = places
            self.rows = rows
        after = before.copy()
        after[rows] += 1
        cache.reserve_step(before, after)
        if not self.valid():                    # the reservation grew a pool
            return False
        if refresh or (after[rows] > self.cover[rows]).any() or (before[rows] != self.expect[rows]).any():
            cover = self._cover(after)
            if not self.plan._refresh_work(cover):
                return False
            self.cover = cover
        self.expect = after
        self._ready = True
        return True

    def prepare(self) -> None:
        from ..attention_launch import layer_launch
        from ..cuda import attention as K
        from ..cuda.merge import merge_signature

        cache, plan = self.cache, self.plan
        self.appender.prepare()
        if not K.SIMULATOR:
            for layer in range(cache.layers):
                layer_launch(cache, layer, plan.g).main.prepare(K.kernel_signature())
            plan._merge_launch.prepare(merge_signature())

    def record_append(self, layer: int, seqs: list, k, v) -> None:
        """``cache.update_layer(layer, plan.seqs, k, v)`` while recording: the token of each place, ``k``/``v``
        ``[size, kv_heads, 1, head_dim]`` (a free place's row is ignored)."""
        cache = self.cache
        if seqs is not self.plan.seqs and list(seqs) != self.plan.seqs:
            raise InputError(f"sequences {seqs}: a bucket's step appends to its places, plan.seqs "
                             f"({self.plan.seqs}: -1 is a free place)")
        want = (self.size, cache.kv_heads, 1, cache.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise InputError(f"k {list(k.shape)} and v {list(v.shape)}: a bucket's step appends one token a place, "
                             f"{list(want)} each")
        layer = int(layer)
        if layer in self._appended:
            raise InputError(f"layer {layer} already took this step's token: a step appends one token per layer")
        self.appender.launch(layer, k, v)
        self._appended.add(layer)
        self.plan.appended_last(layer)

    def _take_back(self, layers) -> None:
        super()._take_back(layers)
        self.expect = np.full_like(self.expect, -1)        # the buffers are made again before the next step

    def replayed(self) -> None:
        """The host's account of one replayed (or eagerly run) step of the batch (no synchronisation); the
        next step needs :meth:`advance` first."""
        cache = self.cache
        self._refuse_while_recording()
        if self._ran:
            self._ran = False
        elif not self._captured:
            raise InputError("replayed(): no step of this plan ran since its last account")
        if not self._ready:
            raise InputError("replayed(): the step was not advanced (BucketSteps.advance) since its last account")
        self._ready = False
        cache.serving.step_index = None
        self._account_step()


def _capturing(cache) -> bool:
    """Whether the current CUDA stream is being captured in a graph (then a recording's launches do not run)."""
    if cache.device.type != "cuda":
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


class StepGraph:
    """A model's decode step over a cache, run as CUDA graphs: one graph per batch-size bucket, captured once
    and replayed for every step of any batch that fits it.

    ``step(plan)`` is the model's step written against fixed buffers of ``plan.size`` places (its inputs
    read from them, its outputs written to them): per layer ``cache.update_layer(layer, plan.seqs, k, v)``
    with ``k``/``v`` ``[plan.size, kv_heads, 1, head_dim]`` (place ``i``'s token) and ``plan.run(q, layer,
    out=...)`` with ``q`` and ``out`` ``[cache.max_seqs, q_heads, head_dim]`` (a row per cache sequence, as
    every step plan takes them).  A call ``runner(seqs)`` runs one step for ``seqs`` (default: the
    ``seqs`` given here, else every live sequence): place ``i`` is ``seqs[i]``, the places past them free.

    Each call refreshes the bucket's device buffers where the step needs it (the places, the work list,
    published epochs: :meth:`BucketSteps.advance`) and replays its graph, then keeps the host's account.
    Sequences that join or leave, lengths that pass a work list and the adaptation rule's checks change
    buffers, not graphs.  A bucket's first step runs eagerly (it warms the model's kernels: libraries
    allocate on first use, which a capture must not do); a bucket is captured again only where the cache's
    arrays were replaced (growth) or its work list outgrew its room.  Buckets (``buckets``, default the powers
    of two up to ``cache.max_seqs``, and ``max_seqs``) share one memory pool.  Without a GPU (numba's
    simulator) every step runs eagerly through the same recording.
    """

    def __init__(self, cache, q_heads: int, step, *, buckets=None, seqs=None):
        if not callable(step):
            raise InputError(f"step must be the model's step, a callable taking the plan; got {type(step).__name__}")
        if buckets is None:
            buckets, b = [], 1
            while b < cache.max_seqs:
                buckets.append(b)
                b *= 2
            buckets.append(cache.max_seqs)
        buckets = sorted({int(b) for b in buckets})
        if not buckets or buckets[0] < 1:
            raise InputError(f"buckets must be positive batch sizes, got {buckets}")
        self.cache, self.q_heads, self.step, self.seqs, self.buckets = cache, q_heads, step, seqs, buckets
        self._plans, self._graphs, self._warm = {}, {}, set()
        self._pool = None
        self.captures = self.eager_steps = 0

    def reset(self) -> None:
        """Forget every bucket's plan and graph: the next call plans and captures again."""
        self._plans, self._graphs = {}, {}

    def bucket(self, n: int) -> int:
        """The bucket a batch of ``n`` sequences runs in: the smallest that holds it."""
        for b in self.buckets:
            if b >= n:
                return b
        raise InputError(f"a batch of {n} sequences: the largest bucket holds {self.buckets[-1]}")

    def __call__(self, seqs=None) -> None:
        import torch

        cache = self.cache
        seqs = self.seqs if seqs is None else seqs
        rows = np.asarray(cache.sequences if seqs is None else cache.check_seqs(seqs), np.int64)
        if not len(rows) or len(np.unique(rows)) != len(rows):
            raise InputError(f"seqs {rows.tolist()}: a step needs at least one sequence, each once")
        size = self.bucket(len(rows))
        plan = self._plans.get(size)
        if plan is not None and not plan.captured.advance(rows):
            plan = None
        if plan is None:
            self._graphs.pop(size, None)
            plan = self._plans[size] = cache.decode_plan(self.q_heads, seqs=rows.tolist(), bucket=size)
        graph = self._graphs.get(size)
        if graph is None:
            if cache.device.type != "cuda" or size not in self._warm:
                with plan.device_driven():
                    self.step(plan)
                plan.replayed()
                self._warm.add(size)
                self.eager_steps += 1
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool), plan.device_driven():
                self.step(plan)
            self._pool = graph.pool()
            self._graphs[size] = graph
            self.captures += 1
        graph.replay()
        plan.replayed()


