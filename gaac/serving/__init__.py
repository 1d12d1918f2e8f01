"""The serving loop over a :class:`gaac.PagedKVCache`: a decode step's plan, its one-token appends and its
CUDA graphs.

* :mod:`gaac.serving.plan` -- :class:`~gaac.serving.plan.StepPlan` (``cache.decode_plan(q_heads)``): one
  decode step planned once from the host's lengths, attention run per layer;
* :mod:`gaac.serving.append` -- the step's one-token appends on the device (one launch a layer, block ends
  encoded there), and a token's append outside a plan;
* :mod:`gaac.serving.graph` -- the device-driven step a CUDA graph replays (``decode_plan(steps=...)``,
  ``decode_plan(bucket=...)``) and :class:`~gaac.serving.graph.StepGraph`, the loop of one graph per
  batch-size bucket;
* :mod:`gaac.serving.state` -- :class:`~gaac.serving.state.ServingState`, what the loop keeps per cache
  between steps (the cache holds it as ``cache.serving``; defined in :mod:`gaac.cache.hooks`).

The package sits above the cache, which never imports it: the cache holds the loop's state and calls its
hooks (:mod:`gaac.cache.hooks`), and importing this package registers the two entry points the cache calls
(:func:`gaac.cache.hooks.register_serving`): :func:`~gaac.serving.append.append_token`, ``update_layer``'s
append of one token outside a plan, and :class:`~gaac.serving.plan.StepPlan`, what ``decode_plan`` returns.
The package ``gaac`` has the cache import this one the first time it needs either
(:func:`gaac.cache.hooks.set_loader`).

The package reads the cache only through its storage interface (the :class:`gaac.PagedKVCache` docstring,
docs/design/serving.md).  ``gaac.StepPlan`` and ``gaac.StepGraph`` name the public classes.
"""
from ..cache.hooks import register_serving
from .append import append_token
from .plan import StepPlan

register_serving(append_token=append_token, step_plan=StepPlan)
