"""What a self-calibrated prompt keeps: ``gaac.hf.GAACCache(calibration=None)`` on the real SmolLM2-135M, the
prompt's blocks appended as fitted (the calibration made from them, the rule appending no epoch among them)
against the same prompt decided by the rule as other content would be.

    python benchmarks/fitted_prompt.py --out benchmarks/results/fitted-prompt-smollm2.md

Both caches calibrate themselves on the prompt, through the model's forward pass on the CPU (sizes and epochs do
not depend on the device); the second appends the prompt with ``fitted=False``.  Prompts are real text that every
Python installation carries: the source of ``argparse`` (code) and the ``pydoc_data`` topics (English prose).
Each cache reads back bit for bit (``read``) against the K/V the model made.
"""
from __future__ import annotations

import argparse
import inspect
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import commit_with_changes, table, write  # noqa: E402


def texts() -> dict:
    import argparse as source
    from pydoc_data.topics import topics

    return {"code (argparse source)": inspect.getsource(source),
            "prose (pydoc topics)": "\n\n".join(topics[k] for k in sorted(topics))}


def measure(model, ids: torch.Tensor, fitted: bool) -> dict:
    """One self-calibrated GAACCache over ``ids``, the prompt appended with ``fitted``."""
    import gaac.hf as hf
    from gaac.cache.paged import PagedKVCache

    real = PagedKVCache.append

    def append(self, *args, **kwargs):
        kwargs["fitted"] = fitted
        return real(self, *args, **kwargs)

    from transformers import DynamicCache

    default = DynamicCache(config=model.config)
    cache = hf.GAACCache(config=model.config)
    PagedKVCache.append = append
    try:
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
        seconds = time.perf_counter() - start
    finally:
        PagedKVCache.append = real
    with torch.no_grad():
        model(input_ids=ids, cache=default)
    k, v = cache.store.read(cache.rows[0])
    exact = all(np.array_equal(k[i], layer.keys[0].view(torch.int16).numpy().view(np.uint16)) and
                np.array_equal(v[i], layer.values[0].view(torch.int16).numpy().view(np.uint16))
                for i, layer in enumerate(default.layers))
    m = cache.memory()
    cal = cache.store.calibration
    layers = cal.layers
    return {"bf16_bytes": m.bf16_bytes, "resident_bytes": m.resident_bytes, "allocated_bytes": m.allocated_bytes,
            "ratio": m.bf16_bytes / m.resident_bytes,
            "epochs": sum(cal.n_epochs(layer, kind) - 1 for layer in range(layers) for kind in (0, 1)),
            "bit_exact": bool(exact), "seconds": seconds}


def render(rep: dict) -> str:
    lines = ["# A self-calibrated prompt: fitted (no epoch among its blocks) or decided by the rule", "",
             f"- date: {rep['date']}", f"- machine: {rep['machine']}", f"- commit: {rep['commit']}",
             f"- command: `{rep['command']}`", f"- model: {rep['model']}",
             "- each row: `gaac.hf.GAACCache(calibration=None)`, one forward pass of the prompt; `fitted`: the "
             "prompt appended as `GAACCache` appends it (`fitted=True`), `decided`: the same prompt appended with "
             "`fitted=False`, the rule deciding its checks as for other content; `BF16/resident`: the BF16 bytes of "
             "the prompt's K/V over what the cache holds them in (slots, raw tiles, epoch tables)", ""]
    rows = []
    for case in rep["cases"]:
        for how in ("fitted", "decided"):
            r = case[how]
            rows.append([case["text"], case["tokens"], how, f"{r['ratio']:.4f}x", r["epochs"],
                         f"{r['resident_bytes'] / 2**20:.2f}", "yes" if r["bit_exact"] else "NO"])
    lines += table(["text", "tokens", "prompt", "BF16/resident", "epochs appended", "resident MiB", "bit-exact"],
                   rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8000", help="prompt lengths (comma-separated)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from gaac.capture import load_model

    model, tok, source = load_model()
    model.eval()
    rep = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__} (CPU)",
           "commit": commit_with_changes("benchmarks/fitted_prompt.py"),
           "command": "python benchmarks/fitted_prompt.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": f"SmolLM2-135M-Instruct ({source['package']}, BF16)", "cases": []}
    for name, text in texts().items():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for tokens in (int(t) for t in args.tokens.split(",")):
            if tokens > len(ids):
                continue
            x = torch.tensor([ids[:tokens]])
            case = {"text": name, "tokens": tokens,
                    "fitted": measure(model, x, True), "decided": measure(model, x, False)}
            rep["cases"].append(case)
            print(f"{name}, {tokens} tokens: fitted {case['fitted']['ratio']:.4f}x ({case['fitted']['epochs']} "
                  f"epochs), decided {case['decided']['ratio']:.4f}x ({case['decided']['epochs']} epochs)", flush=True)
            write(rep, args.out, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
