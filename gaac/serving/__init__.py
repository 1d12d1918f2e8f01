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
  between steps (the cache holds it as ``cache.serving``).

The package reads the cache only through its storage interface (the :class:`gaac.PagedKVCache` docstring,
docs/design/serving.md).  ``gaac.StepPlan`` and ``gaac.StepGraph`` name the public classes.
"""
