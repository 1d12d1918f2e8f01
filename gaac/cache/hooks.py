"""What the cache keeps and calls for the serving loop above it (:mod:`gaac.serving`), which it never imports.

* :class:`ServingState` -- what the serving loop keeps per cache between decode steps.  A
  :class:`gaac.PagedKVCache` makes one at its creation and holds it as :attr:`gaac.PagedKVCache.serving`; the
  cache calls its hooks where its storage changes (:meth:`ServingState.storage_changed`,
  :meth:`ServingState.lengths_changed`) and before each public method (:meth:`ServingState.settle`).
* :data:`RECORDING` and :func:`check_not_recording` -- the device-driven steps this thread records
  (:mod:`gaac.serving.graph` adds and removes them), and the refusal the cache's ``update_layer`` and
  ``append`` call for a change to a cache that records none of them.
* The serving loop's entry points the cache calls, which :mod:`gaac.serving` registers when it is imported
  (:func:`register_serving`), the way :func:`gaac.cuda.codec.register_codec` lets :mod:`gaac.fp8.cuda`
  register its kernels: :func:`append_token` (``update_layer``'s append of one token outside a plan) and
  :func:`step_plan` (what ``decode_plan`` returns, a :class:`gaac.serving.plan.StepPlan`).  The cache looks
  each up here at every call, one attribute lookup.

Until :mod:`gaac.serving` registers, the entry points are stand-ins that run the loader the package
``gaac`` sets (:func:`set_loader`: it imports :mod:`gaac.serving`) and then call what it registered, so
that a cache works the same whichever gaac module made it.  With no loader set, or one that registers
nothing, ``update_layer`` takes its general path (the same result: :func:`append_token` answers False) and
``decode_plan`` raises :class:`InputError` naming the module to import.

Nothing here imports torch or numba, or any gaac module but :mod:`gaac.errors`: the package ``gaac``
imports this module when it is imported, and ``import gaac`` needs neither.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

from ..errors import InputError


class ServingState:
    """The serving loop's state for one cache.

    The cache owns its storage (pools, tables, tails, lengths, epochs); the decode-step machinery of
    :mod:`gaac.serving` (:mod:`~gaac.serving.plan`, :mod:`~gaac.serving.append`, :mod:`~gaac.serving.graph`)
    owns what it builds on top of it, kept here so that a step reuses what the last one built: each layer's
    attention launch state, the eager plans' shared work list, the one-token appends' launchers and parameter
    buffers, the plan whose device-driven step is being recorded.  The cache calls two hooks where its
    storage changes (:meth:`storage_changed`, :meth:`lengths_changed`), which drop what names the old arrays
    and advance :attr:`generation`, the counter a plan compares to tell that the cache changed under it.

    The state names the cache nowhere (the cache holds it: no reference cycle), and the newest eager plan
    only through a weak reference (the plan holds the cache)."""

    device_steps = True              # a state pickled before it kept this: taken as having made them

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
        self.last_step = None        # what the next eager plan follows where the caller dropped the last one
                                     # (gaac.serving.plan: StepPlan's record of its finished step)
        self.device_steps = False    # a plan of device-driven steps was made (gaac.serving.graph): its steps pop
                                     # records that the host accounts only when told (replayed())

    @property
    def eager_plan(self):
        """The newest eager one-step plan, whose token appends take its fast path, while anyone else holds it."""
        ref = self._eager_ref
        return ref() if ref is not None else None

    @eager_plan.setter
    def eager_plan(self, plan) -> None:
        self._eager_ref = weakref.ref(plan) if plan is not None else None
        self.last_step = None

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
        state["last_step"] = None    # its appender names the cache copied from
        return state


# ----------------------------------------------------------------------------------------------
# Recordings of device-driven steps (gaac.serving.graph).

class _Recordings(threading.local):
    """The plans whose device-driven steps this thread records now, innermost last."""

    def __init__(self):
        self.plans = []


RECORDING = _Recordings()


def check_not_recording(cache, what: str = "update") -> None:
    """Refuse a change to ``cache`` while this thread records a device-driven step of another cache (one
    not recording a plan of its own): a CUDA graph would replay it on every step, and nothing would account
    for it on the host."""
    plans = RECORDING.plans
    if plans and cache.serving.recording is None:
        raise InputError(f"{what} of a cache that records no plan, inside another cache's `with "
                         "plan.device_driven():`: a graph replays it every step and nothing accounts for it; change "
                         "it outside the recording, or record a plan of its own for it")


# ----------------------------------------------------------------------------------------------
# The serving loop's entry points (module docstring).

_loader: Callable[[], object] | None = None
_registered = False          # whether register_serving ran


def set_loader(load: Callable[[], object] | None) -> None:
    """Make ``load`` (no arguments: it imports :mod:`gaac.serving`, which registers) what the stand-ins run the
    first time the cache needs the serving loop; None: run nothing.  The package ``gaac`` sets it when it is
    imported."""
    global _loader
    _loader = load


def _unregistered_append(cache, layer: int, seqs, k, v) -> bool:
    """:func:`append_token` before :mod:`gaac.serving` registers: load it, then append through what it
    registered; without it, False (``update_layer`` takes its general path)."""
    if not _load():
        return False
    return append_token(cache, layer, seqs, k, v)


def _unregistered_plan(cache, q_heads: int, **options):
    """:func:`step_plan` before :mod:`gaac.serving` registers: load it, then plan through what it registered;
    without it, :class:`InputError`."""
    if not _load():
        raise InputError("decode_plan: the serving loop is not registered with the cache: import gaac.serving, "
                         "which registers its step plan (gaac.cache.hooks.register_serving)")
    return step_plan(cache, q_heads, **options)


append_token: Callable[..., bool] = _unregistered_append
"""``append_token(cache, layer, seqs, k, v) -> bool``: one token per sequence of ``seqs`` in ``layer``, written
where it finishes no block (True), else nothing (False): what ``update_layer`` calls for a token outside a
plan (:func:`gaac.serving.append.append_token`, once registered)."""

step_plan: Callable = _unregistered_plan
"""``step_plan(cache, q_heads, *, append, seqs, scale, steps, bucket)``: what ``decode_plan`` returns
(:class:`gaac.serving.plan.StepPlan`, once registered)."""


def _load() -> bool:
    """Run the loader where the serving loop is not registered yet; whether it is registered now."""
    if not _registered and _loader is not None:
        _loader()
    return _registered


def register_serving(*, append_token: Callable[..., bool], step_plan: Callable) -> None:
    """Make ``append_token`` and ``step_plan`` the entry points the cache calls (module docstring):
    :mod:`gaac.serving` registers its own when it is imported."""
    module = globals()               # the parameters take the names of the module's entry points
    module["append_token"] = append_token
    module["step_plan"] = step_plan
    module["_registered"] = True
