"""``gaac capture``: the files it writes are what ``gaac stats`` reads, and what the model's cache holds.

The shared dumps in ../shared/data/kv were captured from the same model and
token ids on another machine.  Recapturing them here is exact almost
everywhere in layer 0 (the embedding, RMSNorm, K/V projections and RoPE): K
and V there agree bit for bit in more than 99.9% of values and differ by at
most one BF16 step elsewhere, because the CPU's BF16 matmul kernels round
differently on different instruction sets (one CI machine differed in 0.004%
of layer-0 K).  Deeper layers drift by a few steps.  So the test checks
exactly that: a wrong layout, token order, position or BOS would break layer
0 everywhere.
"""
import json
import sys

import numpy as np
import pytest
from conftest import KV_DIR

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from transformers import DynamicCache  # noqa: E402

from gaac import cli  # noqa: E402
from gaac.capture import BUILTINS, builtin_text, capture_cache  # noqa: E402
from gaac.errors import InputError  # noqa: E402
from gaac.io import load_cache  # noqa: E402

TEXT = ("Lossless compression of a key-value cache keeps every bit of every value, so the model's outputs do "
        "not change at all; the question is only how much memory and bandwidth it saves.")


def as_bits(t):
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_capture_files_are_the_models_cache_and_gaac_reads_them(smollm, tmp_path, capsys):
    model, tokenizer = smollm
    assert cli.main(["capture", "--text", TEXT, "--max-tokens", "33", "--out", str(tmp_path), "--name", "t"]) == 0
    k, v = load_cache(tmp_path / "t__k.npy", "k"), load_cache(tmp_path / "t__v.npy", "v")
    side = json.loads((tmp_path / "t.json").read_text())
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"][:33]
    assert side["token_ids"] == ids and side["num_tokens"] == 33 and not side["bos_prepended"]
    assert side["files"] == {"k": "t__k.npy", "v": "t__v.npy"} and side["shape"] == [30, 3, 33, 64]
    assert side["architecture"]["n_kv_heads"] == 3 and side["source"]["gguf_sha256"]
    # The same prefill, read from the model's own cache object.
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache)
    for layer in (0, 17, 29):
        np.testing.assert_array_equal(k[layer], as_bits(cache.layers[layer].keys[0]))
        np.testing.assert_array_equal(v[layer], as_bits(cache.layers[layer].values[0]))
    capsys.readouterr()
    assert cli.main(["stats", "--k", str(tmp_path / "t__k.npy"), "--v", str(tmp_path / "t__v.npy"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert set(stats) >= {"k", "v"}


def test_recapture_of_a_shared_dump(smollm, tmp_path, capsys):
    sidecar = KV_DIR / "smollm2-135m-instruct-q4_1__list.json"
    if not sidecar.exists():
        pytest.skip(f"{sidecar} not present")
    model, tokenizer = smollm
    ref = json.loads(sidecar.read_text())
    assert tokenizer(ref["text"], add_special_tokens=False)["input_ids"] == ref["token_ids"]
    rc = cli.main(["capture", "--from-sidecar", str(sidecar), "--verify", "--out", str(tmp_path)])
    name = "smollm2-135m-instruct-q4_1__list"
    side = json.loads((tmp_path / f"{name}.json").read_text())
    check = side["verified_against"]
    assert rc == (0 if check["identical"] else 1)
    assert ("bit-identical to" if check["identical"] else "DIFFERS from") in capsys.readouterr().out
    k, v = np.load(tmp_path / f"{name}__k.npy"), np.load(tmp_path / f"{name}__v.npy")
    ref_k, ref_v = (np.load(KV_DIR / ref["files"][kind]) for kind in "kv")
    for kind, got, want in (("k", k, ref_k), ("v", v, ref_v)):
        steps = np.abs(got[0].astype(np.int32) - want[0].astype(np.int32))  # same sign: BF16 steps apart
        assert steps.max() <= 1 and (steps == 0).mean() > 0.999, kind
        assert check[kind][0] == (got[0] == want[0]).mean(), kind


def test_builtin_texts():
    text, files = builtin_text("python-stdlib", 20000)
    assert len(text) >= 20000 and files[0].endswith("argparse.py")
    assert "class ArgumentParser" in text
    try:
        text, files = builtin_text("licenses", 5000)
        assert len(text) >= 5000 and files
    except InputError as exc:            # a machine without licence texts says so
        assert "no such texts" in str(exc)
    with pytest.raises(InputError, match="one of"):
        builtin_text("poems", 10)
    assert BUILTINS == ("python-stdlib", "licenses")


@pytest.mark.parametrize("argv, message", [
    ([], "no prompt"),
    (["--text", "a", "--text", "b", "--name", "x"], "--name names one capture"),
    (["--text", "a", "--verify"], "--verify compares"),
    (["--text", "a", "--max-tokens", "0"], "--max-tokens 0"),
    (["--file", "/nonexistent/prompt.txt"], "no such file"),
    (["--builtin", "poems"], "invalid choice"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    assert cli.main(["capture", *argv]) == 2
    assert message in capsys.readouterr().err


def test_capture_cache_shapes(smollm):
    model, _ = smollm
    k, v, nll = capture_cache(model, [1, 2, 3, 4, 5])
    assert k.shape == v.shape == (30, 3, 5, 64) and k.dtype == np.uint16 and nll > 0


def test_prefill_shows_progress_by_layer(smollm, capsys):
    model, _ = smollm
    k, _, _ = capture_cache(model, [1, 2, 3], show_progress=True)
    err = capsys.readouterr().err
    assert "prefill 3 tokens" in err and "/30" in err and k.shape[2] == 3
    hooks = [layer._forward_hooks for layer in model.get_decoder().layers]
    assert not any(hooks)                                   # the bar's hooks are gone afterwards
    capture_cache(model, [1, 2, 3])                         # not a terminal: no bar
    assert capsys.readouterr().err == ""


def test_loading_the_model_shows_no_transformers_bars_or_advice(smollm, capfd):
    from gaac.capture import load_model

    load_model()                                            # the dense copy exists: the fixture made or read it
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "dtype=torch.float32" not in err and "first use" not in err


def test_the_dense_copy_is_announced_once(tmp_path, monkeypatch, capsys):
    """A first use says what it writes where and how large it is; transformers is quiet meanwhile."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from gaac import capture

    calls = []

    def tiny_model(*args, **kwargs):
        calls.append((hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()))
        config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=1, num_key_value_heads=1, head_dim=64)
        return LlamaForCausalLM(config)

    class Tokenizer:
        def save_pretrained(self, folder):
            (folder / "tokenizer.json").write_text("{}")

    monkeypatch.setenv("GAAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", tiny_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    folder = capture._dense_copy(tmp_path / "model.gguf", "ab" * 32)
    err = capsys.readouterr().err
    assert folder.parent == tmp_path / "models" and (folder / "model.safetensors").is_file()
    assert "first use of model.gguf" in err and f"about {capture.DENSE_COPY_MB} MB in {folder}" in err
    assert "wrote the dense copy" in err and "GAAC_CACHE_DIR" in err
    assert calls == [(hf_logging.ERROR, False)]
    assert hf_logging.is_progress_bar_enabled()               # restored afterwards
    assert capture._dense_copy(tmp_path / "model.gguf", "ab" * 32) == folder
    assert capsys.readouterr().err == "" and len(calls) == 1  # later uses read the copy silently
    help_text = capture.build_parser().format_help()
    assert "dense BF16 copy" in help_text and f"{capture.DENSE_COPY_MB} MB" in help_text


def test_a_bar_redrawn_at_every_layer_changes_nothing(smollm, capsys, monkeypatch):
    """On a terminal the bar shows; tqdm's update() returns True when it redraws, and a forward hook's
    value replaces the layer's output, so the hook must return None.  Here every update redraws."""
    import functools

    import tqdm

    model, _ = smollm
    ids = [1, 2, 3, 4]
    k0, v0, nll0 = capture_cache(model, ids, show_progress=False)
    monkeypatch.setattr(tqdm, "tqdm", functools.partial(tqdm.tqdm, mininterval=0, miniters=1))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    k, v, nll = capture_cache(model, ids)                   # show_progress None: on, as on a terminal
    assert "30/30" in capsys.readouterr().err
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)
    assert nll == nll0


@pytest.mark.parametrize("argv, message", [
    (["--model", "{tmp}/missing"], "--model {tmp}/missing: no such folder"),
    (["--model", "{tmp}"], "--model {tmp}: no config.json in this folder"),
    (["--model", "{tmp}", "--gguf-file", "m.gguf"], "--model {tmp}: no m.gguf in this folder"),
    (["--model", "does/not-exist"], "--model does/not-exist: no such folder, and not in the local Hugging Face cache"),
    (["--device", "cuda:99"], "--device cuda:99: this torch cannot use it"),
    (["--device", "nonsense"], "--device nonsense: this torch cannot use it"),
    (["--file", "{tmp}"], "--file '{tmp}': is a directory"),
    (["--out", "{tmp}/f.txt"], "--out '{tmp}/f.txt': is not a folder"),
])
def test_model_device_and_file_errors_are_one_line(argv, message, tmp_path, capsys, monkeypatch):
    """Refused before any model loads, in one line; a hub id that is neither a folder nor cached is
    not retried against an unreachable hub (here: offline, as HF_HUB_OFFLINE says)."""
    import transformers

    (tmp_path / "f.txt").write_text("x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("a model was loaded"))
    rc = cli.main(["capture", "--text", "hi", *[a.format(tmp=tmp_path) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("gaac: error: ") and err.count("\n") == 1, err
    assert message.format(tmp=tmp_path) in err


def test_a_hub_id_is_not_fetched_from_an_unreachable_hub(monkeypatch):
    from gaac import capture

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(capture, "_hub_reachable", lambda endpoint, timeout=5.0: False)
    with pytest.raises(InputError, match="--model does/not-exist: no such folder, not in the local Hugging Face "
                                         "cache, and .* cannot be reached"):
        capture.local_model("does/not-exist")


def test_capture_on_a_terminal_writes_what_it_writes_off_one(smollm, tmp_path):
    """The README's `gaac capture` with its stderr on a terminal (a pty of 100 columns): the progress bar
    shows, the command succeeds, and its files hold the bits the same capture writes with no terminal."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios
    import threading

    run = [sys.executable, "-c", "from gaac.cli import main; raise SystemExit(main())", "capture", "--text", TEXT,
           "--max-tokens", "9", "--name", "t"]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    shown = []

    def drain():                              # read the terminal as it is written (a full pty would block)
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    # Every update redraws (tqdm's update() then returns True, which a forward hook must not pass on).
    on_tty = subprocess.run(run + ["--out", str(tmp_path / "tty")], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=slave, timeout=300, env={**os.environ, "TQDM_MININTERVAL": "0"})
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    err = b"".join(shown).decode(errors="replace")
    assert on_tty.returncode == 0, err
    assert "prefill 9 tokens" in err and "layer" in err          # the bar over the decoder layers was drawn
    plain = subprocess.run(run + ["--out", str(tmp_path / "plain")], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr.decode(errors="replace")
    assert b"prefill" not in plain.stderr                         # no terminal, no bar
    for kind in ("k", "v"):
        np.testing.assert_array_equal(np.load(tmp_path / "tty" / f"t__{kind}.npy"),
                                      np.load(tmp_path / "plain" / f"t__{kind}.npy"))
