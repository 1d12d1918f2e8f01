"""What the serving loop keeps per cache between decode steps: one :class:`ServingState`, which a
:class:`gaac.PagedKVCache` makes at its creation and holds as :attr:`gaac.PagedKVCache.serving`.

The cache owns its storage (pools, tables, tails, lengths, epochs); the decode-step machinery of this
package (:mod:`gaac.serving.plan`, :mod:`gaac.serving.append`, :mod:`gaac.serving.graph`) owns what it
builds on top of it, kept here so that a step reuses what the last one built: each layer's attention launch
state, the eager plans' shared work list, the one-token appends' launchers and parameter buffers, the
plan whose device-driven step is being recorded.  The cache calls two hooks where its storage changes
(:meth:`ServingState.storage_changed`, :meth:`ServingState.lengths_changed`), which drop what names the old
arrays and advance :attr:`ServingState.generation`, the counter a plan compares to tell that the cache
changed under it.

The state names the cache nowhere (the cache holds it: no reference cycle), and the newest eager plan
only through a weak reference (the plan holds the cache).
"""
from __future__ import annotations

import weakref


class ServingState:
    """The serving loop's state for one cache (module docstring)."""

    def __init__(self):
        self.generation = 0          # counts changes of lengths or storage: a plan made before compares it
        self.layer_launch = {}       # (layer, g, fused) -> that layer's attention launch state (gaac.attention_launch)
        self.wave = {}               # id(attention kernel) -> warps in one wave (gaac.serving.plan)
        self.launchers = {}          # id(kernel) -> its launcher, kept across steps (gaac.serving.plan)
        self.work_plans = {}         # the newest eager plan's work list and launch state, for the next plan
        self.step_appends = {}       # the sequences' bytes -> their one-token step appends (gaac.serving.append)
        self.step_index = None       # the device indices of the current one-token append (gaac.serving.append)
        self.append_launch = None    # the one-token append kernel's launcher (GPU)
        self.append_params = {}      # layer -> (its tails, lengths, the append kernel's parameter buffer) (GPU)
        self.recording = None        # the plan whose device-driven step is being recorded (gaac.serving.graph)
        self.unsettled = None        # an eager step's account of finished blocks, pending (gaac.serving.plan)
        self._eager_ref = None       # a weak reference to the newest eager plan (eager_plan)

    @property
    def eager_plan(self):
        """The newest eager one-step plan, whose token appends take its fast path, while anyone else holds it."""
        ref = self._eager_ref
        return ref() if ref is not None else None

    @eager_plan.setter
    def eager_plan(self, plan) -> None:
        self._eager_ref = weakref.ref(plan) if plan is not None else None

    def settle(self) -> None:
        """Make the account of an eager step's finished blocks that the step left pending, if any (the cache
        calls it before each of its public methods)."""
        account = self.unsettled
        if account is not None:
            self.unsettled = None
            account.settle()

    # -- the cache's hooks -------------------------------------------------------------------------------
    def storage_changed(self, layer: int | None = None) -> None:
        """The cache replaced arrays that launches name: of ``layer`` (a full epoch table), or of every layer
        (None: growth).  What names them is dropped and made again at the next use."""
        if layer is None:
            self.layer_launch.clear()
            self.step_appends.clear()
        else:
            for key in [key for key in self.layer_launch if key[0] == layer]:
                del self.layer_launch[key]
        self.generation += 1

    def lengths_changed(self) -> None:
        """The cache changed lengths or sequences other than through a plan's appends: the one-token append's
        device indices (made for the old lengths) are dropped and plans made before are stale."""
        self.step_index = None
        self.generation += 1

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_eager_ref"] = None   # a weak reference is not copied: no caller holds a plan of the copy
        return state
