"""GAAC in transformers: a drop-in compressed cache and the ``"gaac"`` attention.

    cache = gaac.hf.GAACCache(config=model.config, calibration=cal)
    model.generate(**inputs, cache=cache)        # transformers < 5.24: past_key_values=cache

:class:`GAACCache` is a ``transformers.Cache`` made of :class:`GAACLayer`
layers, the way transformers' own layered caches (``DynamicLayer``,
``QuantizedLayer``) are built; all layers share one :class:`gaac.PagedKVCache`,
whose layer ``i`` receives the model's layer-``i`` K/V (K after RoPE) one
forward pass at a time: new tokens go to the BF16 tail, finished blocks are
encoded once.  Each HF batch row is one sequence of the paged cache.

What attention reads.  Each layer's :meth:`GAACLayer.update` returns what
the model's attention reads, as transformers' ``QuantizedLayer`` does: the
layer's cached past followed by the model's own new K/V.  A prefill into a
layer that holds nothing gets the model's K/V back as they are; one into a
layer that holds tokens gets the past decoded from its slots, raw tiles and
tail with the codec, then the new K/V, never decoded again after they are
encoded, so outputs are bit-identical to ``DynamicCache``'s (the codec is
lossless).

A prompt is one transaction.  The prefill into layers that hold nothing runs
inside a deferral of the paged cache (:meth:`gaac.PagedKVCache.deferred`): each
layer's update is checked and queued, and the last layer's update applies them
all at once, one adaptation-rule batch over every layer and kind, one
reservation and one commit, as ``PagedKVCache.append`` does (anything that reads
the paged cache before then applies them first).  Those layers' attention reads
the model's own K/V, so nothing waits for the encode; until it is applied the
paged cache holds the prompt's K/V tensors as the model made them.  The fused path (``fused=True``, the default on CUDA with
``attn_implementation="gaac"``) returns, for a one-token decode step, a
:class:`PagedLayer` handle instead of tensors; the ``"gaac"`` attention
registered here runs the forward pass's step plan on it
(:meth:`gaac.PagedKVCache.decode_plan`, made once per forward pass before its
first append), which reads the compressed slots directly.  Prefill (more than
one new token) always takes the decoded path and the model's standard
attention, as in the paper.  The decoded path is what a CPU always runs:
decoding every layer's whole past at every step makes a generation several
times slower than with ``DynamicCache`` there (3-16x on SmolLM2-135M), so on a
CPU this cache is for checking outputs and measuring memory; its speed is the
fused kernel's, on CUDA.

Calibration epochs (``adapt=True``, the default; :mod:`gaac.epochs`).  The
paged cache appends new bases as a long generation drifts from the
calibration (RoPE drift in K) and records each block's epoch; both paths
decode every block with its own epoch's bases.  The epochs live in the paged
cache's copy of the calibration, ``cache.store.calibration``;
:attr:`GAACCache.calibration` stays the calibration the cache started from.

``calibration=None``: the cache calibrates itself.  It holds plain BF16 (as
``DynamicCache`` does) until the last layer of a forward pass leaves at least
one complete 16-token block in every layer -- right after the prefill for a
prompt of 16 tokens or more, else at the decode step that completes the first
block -- then calibrates on every complete block it holds (all layers, all
batch rows) and compresses everything.  Those blocks keep the calibration fitted
on them (epoch 0): the adaptation rule takes them into its histograms and
appends epochs only as the generation after them drifts, so that the prompt
waits for no decision of the rule.  A calibration made from one short
prompt fits later text less well (more 4-bit and raw groups, more tiles in
the raw pool), never incorrectly: the codec is lossless with any calibration.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from . import layout as L
from .cache.paged import PagedKVCache
from .calibration import Calibration, calibrate
from .errors import InputError

ATTENTION = "gaac"           # attn_implementation name of gaac_attention

# Three short prompts of different kinds (prose, code, a proof) on which GAACCache's greedy generation is
# compared with DynamicCache's: tests/test_hf.py on the CPU and benchmarks/generate_cuda.py on CUDA use these
# same prompts, so that the CUDA results speak of the cases the tests check.
CHECK_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type with an oil-based ink and a screw press adapted from wine making.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n",
    "Theorem. There are infinitely many prime numbers.\nProof. Suppose, for contradiction, that p_1, ..., p_n "
    "are all the primes, and let N = p_1 p_2 ... p_n + 1. Then",
)


@dataclass
class PagedLayer:
    """What a fused decode step gets instead of K/V tensors: one layer of the paged cache."""

    store: PagedKVCache
    layer: int
    rows: list
    plan: object = None          # the forward pass's gaac.serving.plan.StepPlan, shared by its layers

    @property
    def view(self):
        return self.store.layer_view(self.layer)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V decoded to BF16 ``[batch, kv_heads, tokens, head_dim]``."""
        k, v = self.store.read_layer(self.layer, self.rows)
        return k.view(torch.bfloat16), v.view(torch.bfloat16)


def gaac_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention for ``attn_implementation="gaac"``: the fused kernel on a :class:`PagedLayer`, else SDPA.

    A decode step whose keys are a :class:`PagedLayer` runs
    :func:`gaac.attention.decode_attention` on the compressed layer; it attends to
    every cached token, so a padding mask (left-padded batches) sends the step
    back to decoded tensors and SDPA instead.
    """
    if isinstance(key, PagedLayer):
        if attention_mask is None:
            q = query[:, :, 0].contiguous()
            plan = key.plan
            if plan is not None and plan.q_heads == q.shape[1] and (scaling is None or scaling == plan.scale):
                out = plan.run(q, key.layer)
            else:
                from .attention import decode_attention

                out = decode_attention(q, key.view, scale=scaling)
            return out[:, None].to(query.dtype), None             # [batch, 1, q_heads, head_dim], as SDPA's
        key, value = key.dense()
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(ATTENTION, gaac_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class GAACLayer(CacheLayerMixin):
    """One decoder layer of a :class:`GAACCache`, built as transformers' ``QuantizedLayer``: :meth:`update`
    stores the layer's new K/V and returns what its attention reads.

    The layers of one cache share its paged cache (``cache.store``, layer ``index``), its batch rows and the
    forward pass's step plan.  Until the cache is calibrated a layer holds its K/V in BF16 (``keys`` and
    ``values``, as ``DynamicLayer`` does); the update of the last layer that leaves a complete block in every
    layer calibrates the cache and moves every layer into the paged cache
    (:meth:`GAACCache._calibrate_and_compress`).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: "GAACCache", index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.tokens = 0          # tokens this layer holds; ``keys``/``values`` hold them only while uncalibrated

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``key_states``/``value_states`` ``[batch, kv_heads, new, head_dim]`` (BF16, K after RoPE) and
        return the layer's K and V for attention: the cached past, then the model's own new K/V (the new K/V
        alone where the layer held nothing), or a :class:`PagedLayer` for a fused one-token step."""
        if key_states.dtype != torch.bfloat16 or value_states.dtype != torch.bfloat16:
            raise InputError(f"GAACCache codes BF16 K/V; layer {self.index} gave {key_states.dtype} (load the model "
                             "with dtype=torch.bfloat16)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache, new = self.cache, key_states.shape[-2]
        if cache.store is None and cache.calibration is None:
            return self._hold(key_states, value_states)
        if cache.store is None:
            cache._open(key_states)
        step = cache.fused and new == 1
        if self.index == 0:       # one plan per forward pass, made before its first append, shared by its layers
            cache._end_prefill()          # a prefill a forward pass left open (it stopped part way) is applied
            cache._plan = (cache.store.decode_plan(cache.config.num_attention_heads, seqs=cache.rows, append=new)
                           if step else None)
        handle = PagedLayer(cache.store, self.index, cache.rows, cache._plan)
        past = handle.dense() if self.tokens and not step else None      # decoded before the new tokens go in
        if past is None and new > 1 and cache._prefill is None and not cache.store.deferring:
            cache._prefill = cache.store.deferred().start()     # the prompt's layers: one transaction
        cache.store.update_layer(self.index, cache.rows, key_states, value_states)
        self.tokens += new
        if self.index == len(cache.layers) - 1:
            cache._end_prefill()
        if step:
            return handle, handle
        if past is None:
            return key_states, value_states
        return torch.cat([past[0], key_states], dim=-2), torch.cat([past[1], value_states], dim=-2)

    def _hold(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The update of an uncalibrated cache: the layer holds its K/V in BF16; the last layer's calibrates the
        cache once every layer holds a complete block."""
        self.keys = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
        self.values = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
        self.tokens += key_states.shape[-2]
        keys, values, cache = self.keys, self.values, self.cache
        if self.index < len(cache.layers) - 1 or self.tokens < L.BLOCK_TOKENS:
            return keys, values
        cache._calibrate_and_compress()
        if cache.fused and key_states.shape[-2] == 1:
            handle = PagedLayer(cache.store, self.index, cache.rows)
            return handle, handle
        return keys, values          # what the layer holds, as the paged cache now holds it (lossless)

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.tokens = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("GAACCache does not reorder sequences (beam search); use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("GAACCache cannot drop tokens: finalized blocks are compressed")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("GAACCache cannot repeat batch rows (num_return_sequences > 1)")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("GAACCache cannot select batch rows")


class GAACCache(Cache):
    """A transformers cache that keeps K/V compressed in a :class:`gaac.PagedKVCache` (see the module docstring).

    ``config``: the model's config (full-attention decoder layers with BF16 K/V
    and a head size the GAAC format supports).  ``calibration``: a :class:`gaac.Calibration`
    for this model, or None to calibrate on the first complete blocks.
    ``fused``: use the fused decode attention (None: on CUDA when the model's
    ``attn_implementation`` is ``"gaac"``).  ``codec`` and ``adapt`` (calibration
    epochs, default on): as in :class:`gaac.PagedKVCache`.
    """

    def __init__(self, config, calibration: Calibration | None = None, *, fused: bool | None = None,
                 codec: str | None = None, adapt: bool = True):
        text = config.get_text_config(decoder=True)
        types = set(getattr(text, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"} or getattr(text, "sliding_window", None):
            raise InputError(f"GAACCache holds full-attention layers; this model has layer types {sorted(types)}"
                             f" (sliding window {getattr(text, 'sliding_window', None)})")
        heads = text.num_attention_heads
        self.shape = (text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads,
                      getattr(text, "head_dim", None) or text.hidden_size // heads)
        if self.shape[2] not in L.SUPPORTED_HEAD_DIMS:
            raise InputError(f"head_dim {self.shape[2]} is not supported; the GAAC format supports "
                             f"{L.SUPPORTED_HEAD_DIMS}")
        if calibration is not None:
            if not isinstance(calibration, Calibration):
                raise InputError(f"calibration: expected a gaac.Calibration or None, got {type(calibration).__name__}")
            if calibration.format is not L.BF16:
                raise InputError(f"calibration: the cache holds BF16; this calibration is for {calibration.format.name}")
            calibration.check_shape(*self.shape)
        self.config = text
        self.calibration = self._given = calibration
        if not isinstance(adapt, bool):
            raise InputError(f"adapt must be True or False, got {adapt!r}")
        self._fused, self.codec, self.adapt = fused, codec, adapt
        self.store: PagedKVCache | None = None
        self.rows: list = []
        self._plan = None
        self._prefill = None         # the paged cache's deferral of a prefill's layers (GAACLayer.update)
        super().__init__(layers=[GAACLayer(self, i) for i in range(self.shape[0])])

    @property
    def fused(self) -> bool:
        if self._fused is not None:
            return self._fused
        return self.store is not None and self.store.device.type == "cuda" \
            and self.config._attn_implementation == ATTENTION

    def _open(self, k: torch.Tensor) -> None:
        """Start the paged cache: one sequence per batch row, pools sized for the prompt's blocks and one more,
        which grow as generation needs by ``gaac.cache.pools.GROWTH`` of their size, so the cache allocates about
        what its tokens take."""
        batch, _, tokens, _ = k.shape
        self.store = PagedKVCache(self.calibration, max_seqs=batch, max_blocks=tokens // L.BLOCK_TOKENS + 1,
                                  device=k.device, grow=True, codec=self.codec, adapt=self.adapt)
        self.rows = [self.store.add_sequence() for _ in range(batch)]

    def _calibrate_and_compress(self) -> None:
        """Calibrate on every complete block the layers hold, then move their BF16 into the paged cache.

        Both happen where the K/V are: on a GPU the calibration runs there (only its tables come to the
        host), and each batch row goes in with one append of every layer, which runs the adaptation rule
        of all layers and kinds at once and encodes the row's blocks where the model left them.  The
        calibration was fitted on those blocks, so they keep it (``fitted=True``): the rule takes them into its
        histograms and appends epochs only from the blocks generated after them."""
        full = self.layers[0].tokens // L.BLOCK_TOKENS * L.BLOCK_TOKENS
        keys = torch.stack([layer.keys for layer in self.layers])          # [layers, batch, kv_heads, tokens, D]
        values = torch.stack([layer.values for layer in self.layers])

        def sample(x):      # [layers, kv_heads, batch * full, head_dim]: each row's complete blocks, in a row
            x = x[:, :, :, :full].transpose(1, 2)
            return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])

        self.calibration = calibrate(sample(keys), sample(values),
                                     model=getattr(self.config, "name_or_path", None) or None)
        self.calibration.notes["source"] = "gaac.hf.GAACCache: self-calibrated on the first complete blocks"
        self._open(keys[0])
        for layer in self.layers:
            layer.keys = layer.values = None
        for row, seq in enumerate(self.rows):
            self.store.append(seq, keys[:, row], values[:, row], show_progress=False, fitted=True)

    def _end_prefill(self) -> None:
        """Apply the prefill's deferred layers, where a deferral is open (:meth:`GAACLayer.update`)."""
        deferral, self._prefill = self._prefill, None
        if deferral is not None:
            deferral.apply()

    def memory(self):
        """The paged cache's :class:`gaac.cache.MemoryReport` (None while uncalibrated and still BF16)."""
        return None if self.store is None else self.store.memory()

    def reset(self) -> None:
        super().reset()
        if self._prefill is not None:         # the old paged cache's queued prompt is dropped with it
            self._prefill.discard()
        self.store, self.rows, self._plan, self._prefill = None, [], None, None
        self.calibration = self._given


__all__ = ["ATTENTION", "GAACCache", "GAACLayer", "PagedLayer", "gaac_attention"]
