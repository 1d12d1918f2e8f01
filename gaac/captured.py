"""A decode step the device drives by itself, for CUDA graphs: the captured plan of :mod:`gaac.step`.

An eager step is planned by the host from the lengths it keeps (:class:`gaac.step.StepPlan`); a CUDA
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

:class:`StepGraph` runs that loop for a model's step function: it replays, plans and captures again when a
plan's steps are used, and steps eagerly where no plan can take the next step.

What the device reads instead of the host:

* **Appends** (:func:`gaac.cuda.codec.step_append_kernel`, one launch a layer for K and V): each
  sequence's position is its length on the device, which the kernel advances.  A warp per (head, kind)
  writes its share of the token; where the token completes the block, the same warp encodes its tile
  straight from the tail into the pools, popping records from the device free lists, and writes the
  block-table entry and the block's epoch.
* **Attention**: the work list covers the lengths of the plan's last step (a length-independent split
  for the plan's steps); the kernel stops each split at the sequence's length now, and the merge skips
  the splits that are still empty.  The list is cut at the blocks where an epoch changes, and, with
  adaptation, at the first block the plan finishes, so that every split reads one epoch.

What stays with the host, in :meth:`CapturedSteps.replayed` (no synchronisation): its copy of the
lengths, the blocks it knows finished (pool counts, each block's epoch, the blocks the adaptation rule
observes, copied to pinned memory for it).  The host knows which blocks a step finishes because every
step appends one token to every sequence of the plan.

Limits, worked out when the plan is made (``plan.steps`` may come out below the ``steps`` asked for):

* every pool can take every tile the plan's steps finish (or grows, with ``grow``), since a tile's slot
  or raw record is decided only on the device;
* with adaptation, the plan ends at the step whose blocks complete the rule's next check, so that a new
  plan picks up the epoch that check may append; a step whose blocks go past a check (several
  sequences finishing blocks at once) is left out, and ``plan.steps`` is 0 where it is the next step:
  run that step eagerly (``cache.decode_plan(q_heads)``), then plan again.

Anything else that changes the cache (another update, a removal, growth) ends the plan: ``replayed``
raises :class:`InputError`, since the graph's launches name arrays that may be gone.

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
:func:`check_not_recording` refuses it, for a cache that records no plan of its own, where the cache's
``update_layer`` and ``append`` call it (:data:`RECORDING` names the plans this thread records).
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import numpy as np

from . import layout as L
from .errors import InputError


class CapturedSteps:
    """The device-driven part of a :class:`gaac.step.StepPlan` made with ``steps`` (module docstring).

    The plan holds it; it names the plan by a weak reference (:attr:`plan`), so that the two make no cycle
    that would keep the cache's storage after the caller drops the plan."""

    def __init__(self, plan, steps, rows: np.ndarray, before: np.ndarray):
        from .step import reserve_step

        cache = plan.cache
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise InputError(f"steps must be a positive number of decode steps, got {steps!r}")
        if not cache._cuda_codec:
            raise InputError("a plan of steps records the CUDA codec's device-driven step; this cache runs the "
                             "reference codec (make it on a GPU, or with codec='cuda' in the simulator)")
        if L.tiles_per_head(cache.head_dim) != 1:
            raise InputError(f"a captured step encodes finished blocks straight from the tails, which needs one "
                             f"tile per head: head_dim 64 or 128, not {cache.head_dim}")
        if not len(rows):
            raise InputError("a plan of steps needs at least one live sequence")
        self._plan, self.cache, self.rows = weakref.ref(plan), cache, rows
        cache._flush_all()                      # the adapters' counts are current
        self.steps = self._steps_before_check(int(steps), before[rows])
        self.end = before.copy()
        self.end[rows] += self.steps
        self.step = 0
        self._appended = None       # the layers the recording in progress appended (None: no recording)
        self._ran = False           # a step ran eagerly (recorded outside a capture), not yet accounted by replayed()
        self._captured = False      # whether a recording was captured: its replays are torch's, unseen by the plan
        self.cuts = set()
        if not self.steps:
            return
        reserve_step(cache, before, self.end)
        # Each layer and kind's epoch for the blocks the plan finishes: the adapter's newest (0 without
        # adaptation).  Where it differs from a sequence's last block, the work list is cut there.
        self.epochs = [[s.adapter.epoch if s.adapter is not None else 0 for s in layer] for layer in cache._store]
        if cache.adapt:
            self.cuts = {int(b) for b in before[rows] // L.BLOCK_TOKENS}
        self._generation = None

    @property
    def plan(self):
        """The step plan this is the device-driven part of."""
        return self._plan()

    def _steps_before_check(self, steps: int, lens: np.ndarray) -> int:
        """``steps``, or fewer: up to the step whose finished blocks complete an adapter's next check."""
        cache = self.cache
        if not cache.adapt:
            return steps
        until = min(s.adapter.until_check for layer in cache._store for s in layer)
        done = ((lens[None, :] + np.arange(1, steps + 1)[:, None]) % L.BLOCK_TOKENS == 0).sum(axis=1)
        total = np.cumsum(done)
        hit = np.flatnonzero(total >= until)
        if not len(hit):
            return steps
        return int(hit[0]) + (1 if total[hit[0]] == until else 0)

    # -- before recording --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Compile every kernel the step launches (a launch being captured must not compile) and make the
        step's device arrays and each layer's encoders."""
        from .cuda import attention as K
        from .step import layer_launch
        from .step_append import step_append

        cache, plan = self.cache, self.plan
        self.appender = step_append(cache, self.rows)
        self.appender.prepare(self.epochs)
        if not K.SIMULATOR:
            for layer in range(cache.layers):
                layer_launch(cache, layer, plan.g).main.prepare(K.kernel_signature())
            plan._merge_launch.prepare(merge_signature())
        self._generation = cache._generation

    # -- recording ---------------------------------------------------------------------------------
    @contextmanager
    def device_driven(self, plan):
        """The recording of a step of ``plan`` (this one's plan, held until the recording ends)."""
        cache = self.cache
        if not self.steps:
            raise InputError("this plan has no steps to record (plan.steps is 0): run the next step eagerly, "
                             "then plan again")
        if cache._recording is not None:
            raise InputError("another plan's step is being recorded")
        self.check_current()
        if self._ran:
            raise InputError("the step this plan last ran eagerly is not accounted: call plan.replayed() before "
                             "recording the next")
        capturing = _capturing(cache)
        cache._recording = self
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
            cache._recording = None
            RECORDING.plans.remove(self)
            appended, self._appended = self._appended, None
            if not recorded and appended and not capturing:
                self._take_back(appended)
        if capturing:
            self._captured = True
        else:
            self._ran = True

    def check_recording(self, what: str) -> None:
        if self.cache._recording is not self:
            raise InputError(f"{what}: a plan of steps runs inside `with plan.device_driven():` (captured in a "
                             "CUDA graph, or run eagerly there), its host account kept by plan.replayed()")

    def check_run(self, layer: int) -> None:
        """``plan.run(q, layer)``: inside the recording, after the step's append to ``layer``."""
        self.check_recording("run")
        if layer not in self._appended:
            raise InputError(f"run(q, {layer}): layer {layer} has not taken this step's token; append it "
                             f"(cache.update_layer) before its attention, which would otherwise leave it out")

    def check_current(self) -> None:
        if self.cache._generation != self._generation:
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
        self.appender.launch(layer, k, v, tuple(self.epochs[layer]))
        self._appended.add(layer)

    def _take_back(self, layers) -> None:
        """Undo the appends of a refused recording that ran eagerly (outside a capture): ``layers`` took a token
        the host does not account.  Their device lengths return to the host's, and the records that the
        encodes of the blocks they finished took (read from the block table: a refused step waits for the
        device) go back to the pools, as a removal gives them back.  The plan ends (the pools' free lists
        are new): the next plan starts from the host's lengths."""
        cache, rows = self.cache, self.rows
        with cache.lock:
            cache._seq_lens[:, cache._to_device(rows)] = cache._to_device(cache._lens[:, rows].astype(np.int32))
            after = cache._lens[0, rows] + 1
            done = after % L.BLOCK_TOKENS == 0
            if done.any():
                at = (cache._to_device(rows[done]), cache._to_device(after[done] // L.BLOCK_TOKENS - 1))
                for layer in sorted(layers):
                    for store in cache._store[layer]:
                        e = store.table[at].reshape(-1).cpu().numpy().view(np.uint32).astype(np.int64)
                        is_raw = (e & L.TABLE_RAW_FLAG) != 0
                        store.slots.give(e[~is_raw])
                        store.raw.give(e[is_raw] & L.TABLE_INDEX_MASK)
                        store.table[at] = 0
                        if store.epoch is not None:
                            store.epoch[at] = 0
            cache._lengths_changed()

    # -- after each replay -------------------------------------------------------------------------
    def replayed(self) -> None:
        """The host's account of one replayed (or eagerly run) step: lengths, the blocks it finished.

        Once per step that ran (module docstring): a step run eagerly is accounted once; after a captured
        recording each call stands for one ``graph.replay()``, which the plan cannot see without waiting for
        the device, so only calls past ``plan.steps`` are refused there."""
        cache = self.cache
        if cache._recording is self:
            raise InputError("replayed(): the step is being recorded; account it after the `with "
                             "plan.device_driven():` block (and, for a captured graph, after each graph.replay())")
        self.check_current()
        if self._ran:
            self._ran = False
        elif not self._captured:
            raise InputError("replayed(): no step of this plan ran since its last account: record the step (`with "
                             "plan.device_driven():`), and call plan.replayed() once per graph.replay() or eager run")
        rows = self.rows
        after = cache._lens[0, rows] + 1
        done = after % L.BLOCK_TOKENS == 0
        cache._lens[:, rows] += 1
        self.step += 1
        self.appender.account(range(cache.layers), rows[done], after[done] // L.BLOCK_TOKENS - 1, self.epochs)


class _Recordings(threading.local):
    """The plans whose device-driven steps this thread records now, innermost last."""

    def __init__(self):
        self.plans = []


RECORDING = _Recordings()


def _capturing(cache) -> bool:
    """Whether the current CUDA stream is being captured in a graph (then a recording's launches do not run)."""
    if cache.device.type != "cuda":
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def check_not_recording(cache, what: str = "update") -> None:
    """Refuse a change to ``cache`` while this thread records a device-driven step of another cache (one
    not recording a plan of its own): a CUDA graph would replay it on every step, and nothing would account
    for it on the host."""
    plans = RECORDING.plans
    if plans and cache._recording is None:
        raise InputError(f"{what} of a cache that records no plan, inside another cache's `with "
                         "plan.device_driven():`: a graph replays it every step and nothing accounts for it; change "
                         "it outside the recording, or record a plan of its own for it")


def merge_signature() -> tuple:
    """The argument types the merge kernel is launched with (:mod:`gaac.cuda.merge`)."""
    from numba import types

    def array(dtype):
        return types.Array(dtype, 1, "C")
    return (array(types.float32), array(types.float32), array(types.int32), array(types.int16),
            array(types.float32), types.int64, types.int64)


class StepGraph:
    """A model's decode step over a cache, run as CUDA graphs: each call runs one step.

    ``step(plan)`` is the model's step written against fixed buffers (its inputs read from them, its
    outputs written to them): per layer ``cache.update_layer(layer, seqs, k, v)`` of one token per
    sequence and ``plan.run(q, layer, out=...)``.  A call replays the captured step; where the plan's
    steps are used up it plans and captures again (:meth:`PagedKVCache.decode_plan` with ``steps``), and
    where no plan can take the next step (it passes the adaptation rule's check) it runs that one
    step eagerly with a one-step plan.  The first call runs eagerly too: it warms the model's kernels
    (libraries allocate on first use, which a capture must not do).  The graphs share one memory pool.

    Between calls, change the cache only through the steps: anything else ends the current plan, and
    the next call raises :class:`InputError` from ``plan.replayed()``; call :meth:`reset` after such a
    change to plan and capture afresh.
    """

    def __init__(self, cache, q_heads: int, step, *, steps: int = 256, seqs=None):
        if not callable(step):
            raise InputError(f"step must be the model's step, a callable taking the plan; got {type(step).__name__}")
        self.cache, self.q_heads, self.step, self.steps, self.seqs = cache, q_heads, step, steps, seqs
        self.plan = self.graph = None
        self._pool = None
        self._warm = False
        self.captures = self.eager_steps = 0

    def reset(self) -> None:
        """Forget the captured step: the next call plans and captures again."""
        self.plan = self.graph = None

    def __call__(self) -> None:
        import torch

        if self.plan is None or self.plan.captured.step >= self.plan.steps:
            self.plan = self.graph = None
            plan = self.cache.decode_plan(self.q_heads, steps=self.steps, seqs=self.seqs) if self._warm else None
            if plan is None or not plan.steps:
                self.step(self.cache.decode_plan(self.q_heads, seqs=self.seqs))
                self.eager_steps += 1
                self._warm = True
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool), plan.device_driven():
                self.step(plan)
            self._pool = graph.pool()
            self.plan, self.graph = plan, graph
            self.captures += 1
        self.graph.replay()
        self.plan.replayed()
