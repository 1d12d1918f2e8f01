"""The ``gaac`` command: calibrate on a cache, measure what the codec makes of one, capture one.

    gaac calibrate --k K.npy --v V.npy -o cal.json [--model NAME] [--tokens A:B] [--slot-line 128]
                   [--format bf16|fp8_e4m3|fp8_e5m2]
    gaac stats [--k K.npy --v V.npy] [--calibration cal.json] [--format bf16|fp8_e4m3|fp8_e5m2] [--json]
               [--per-layer] [--segments N] [--no-adapt] [--plot out.png [--plot-layers all|0,5,10-12]]
    gaac pack --k K.npy --v V.npy [--calibration cal.json] -o x.gaac
    gaac unpack x.gaac --k K.npy --v V.npy [--calibration cal.json]
    gaac capture ...            (gaac.capture, where installed)
    gaac --version

Every error a user can cause -- a missing file, a wrong dtype or shape, a
calibration for another model, an optional package the command needs and
does not find -- ends the command with one line on stderr and exit status 2
(the missing package's line names the extra that installs it); anything else
is a bug and keeps its traceback.  ``gaac
stats`` exits 1 if a block does not decode to its exact bits (never expected).

A file error names the option, the path and what is wrong (no such file, a
directory, a FIFO or device, a folder that cannot be written).  Inputs must be
regular files, checked by type before they are opened.  An output is written
to a temporary file beside it and moved into place once every output of the
command is complete, so a failure leaves the files that were there as they
were; no command writes over one of its own inputs.  A reader that closes the
output early (``| head``) ends the command quietly with status 141.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

import numpy as np

from .calibration import Calibration, calibrate
from .command import CommandParser, run
from .errors import InputError
from .io import check_input_file, check_output_file, load_cache, load_sample, parse_token_range, reading, \
    write_files
from .stats import measure
from .tally import CacheStats

FORMATS = ("bf16", "fp8_e4m3", "fp8_e5m2")
MAX_PLOT_LAYERS = 8          # gaac.plot.MAX_LAYERS (not imported here: gaac.plot is only loaded for --plot)

# `gaac stats` with no files: calibrate on one shipped prompt, measure another (a cross-task transfer).
SAMPLE_CALIBRATION, SAMPLE_MEASURED = "prose", "code"


def version_line() -> str:
    """What ``gaac --version`` prints: the package version and the newest format version it reads and writes."""
    from . import __version__
    from .layout import FORMAT_VERSION

    return f"gaac {__version__} (format version {FORMAT_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="gaac", description="Lossless GAAC compression of BF16 KV caches.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    cal = sub.add_parser("calibrate", help="choose exponent windows and slot capacities from sample caches",
                         description="Calibrate on K/V caches [layers, kv_heads, tokens, head_dim] and write "
                                     "the calibration as JSON.")
    cal.add_argument("--k", required=True, help="K cache: .npy (uint16 BF16 bits), .safetensors or .pt (BF16)")
    cal.add_argument("--v", required=True, help="V cache, same formats")
    cal.add_argument("-o", "--output", required=True, help="calibration file to write (JSON)")
    cal.add_argument("--model", help="model name recorded in the calibration")
    cal.add_argument("--tokens", metavar="A:B", help="calibrate on tokens A..B-1 only, e.g. 0:512")
    cal.add_argument("--slot-line", type=int, choices=(128,), default=None,
                     help="slot capacities whose slots fill whole 128-byte lines whatever they cost (by default "
                          "only where they cost at most 1%% more bytes; faster fused attention on a GPU; see "
                          "gaac.calibrate)")
    cal.add_argument("--format", choices=FORMATS, default="bf16",
                     help="element format the calibration is for: bf16 (default), or the cache converted to FP8 "
                          "(a GAAC-FP8 calibration, with its scales; FORMAT-FP8.md), what `gaac stats --format "
                          "fp8_*` reads")
    cal.set_defaults(func=cmd_calibrate)

    st = sub.add_parser("stats", help="encode, decode and measure a cache",
                        description="Encode every complete 16-token block in token order, as the cache finalizes "
                                    "them (with its calibration epochs unless --no-adapt), decode it, check it bit "
                                    "for bit and report ratios and mode fractions. With no files: the real sample "
                                    "shipped "
                                    f"in the package ({SAMPLE_MEASURED} measured with a calibration from "
                                    f"{SAMPLE_CALIBRATION}).")
    st.add_argument("--k", help="K cache: .npy (uint16 BF16 bits), .safetensors or .pt (BF16)")
    st.add_argument("--v", help="V cache, same formats")
    st.add_argument("--calibration", help="calibration JSON (default: calibrate on the measured caches)")
    st.add_argument("--json", action="store_true", help='print {"k": {...}, "v": {...}} as JSON')
    st.add_argument("--per-layer", action="store_true", help="add the per-layer view")
    st.add_argument("--segments", type=int, metavar="N", help="add the numbers of every N positions "
                                                             "(a multiple of 16), e.g. 1024")
    st.add_argument("--no-adapt", dest="adapt", action="store_false",
                    help="code every block with the calibration's own bases; by default the cache's epoch rule "
                         "(gaac.epochs) appends bases as the context grows, as the cache does")
    st.add_argument("--plot", metavar="PNG", help="write exponent histograms with the calibrated windows, "
                                                  f"{MAX_PLOT_LAYERS} layers a file (needs gaac[plot])")
    st.add_argument("--plot-layers", metavar="LAYERS",
                    help="the layers --plot draws: 'all', or numbers and ranges such as 0,5,10-12 (default: "
                         f"{MAX_PLOT_LAYERS} evenly spaced); more than {MAX_PLOT_LAYERS} go on pages PNG-1.png, "
                         "PNG-2.png, ...")
    st.add_argument("--format", choices=FORMATS, default="bf16",
                    help="element format of the cache: bf16 (default), or the BF16 cache converted to FP8 "
                         "(round-to-nearest-even with saturation, power-of-two scale; FORMAT-FP8.md) and "
                         "coded with GAAC-FP8; --calibration then names an FP8 calibration")
    st.set_defaults(func=cmd_stats)

    pk = sub.add_parser("pack", help="write a cache as one compressed file (a sequence container, FORMAT.md 11)",
                        description="Compress K/V caches [layers, kv_heads, tokens, head_dim] into one file: the "
                                    "sequence container of FORMAT.md section 11 with the calibration embedded, "
                                    "what a paged cache holds for them (needs torch). `gaac unpack` restores the "
                                    "exact bits.")
    pk.add_argument("--k", required=True, help="K cache: .npy (uint16 BF16 bits), .safetensors or .pt (BF16)")
    pk.add_argument("--v", required=True, help="V cache, same formats")
    pk.add_argument("--calibration", help="calibration JSON (default: calibrate on these caches)")
    pk.add_argument("-o", "--output", required=True, help="file to write (e.g. x.gaac)")
    pk.set_defaults(func=cmd_pack)

    up = sub.add_parser("unpack", help="restore the K/V caches of a `gaac pack` file, bit for bit",
                        description="Read a sequence container (FORMAT.md 11), check every CRC, and write its K "
                                    "and V as .npy files of uint16 BF16 bits [layers, kv_heads, tokens, head_dim].")
    up.add_argument("input", help="the container (from `gaac pack`, or PagedKVCache.export_sequence)")
    up.add_argument("--k", required=True, help="K cache to write (.npy)")
    up.add_argument("--v", required=True, help="V cache to write (.npy)")
    up.add_argument("--calibration", help="calibration JSON, for a container without an embedded one")
    up.set_defaults(func=cmd_unpack)

    sub.add_parser("capture", help="capture a real K/V cache from a model (gaac.capture; see `gaac capture "
                                   "--help`)", add_help=False)
    return parser


def main(argv=None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``); its exit status.

    A user error ends the command with one line on stderr and status 2; a reader that closes the output
    early (``gaac stats --json | head``) ends it quietly with status 141 (:func:`gaac.command.run`)."""
    return run(_command, argv)


def _command(argv: list[str]) -> int:
    """The command ``argv`` names, run: ``gaac capture`` by :func:`run_capture`, every other one by the
    function its parser sets."""
    if argv[:1] == ["capture"]:
        return run_capture(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


def run_capture(argv: list[str]) -> int:
    """``gaac capture``: imported only when asked, since it pulls in transformers and torch."""
    try:
        capture = importlib.import_module("gaac.capture")
    except ModuleNotFoundError as exc:
        if exc.name != "gaac.capture":
            raise InputError(f"gaac capture needs {exc.name!r}: pip install 'gaac[torch,hf]'") from exc
        raise InputError("gaac capture is not available in this version of gaac (no gaac.capture module)") \
            from exc
    return capture.main(argv) or 0


# -- calibrate -------------------------------------------------------------------

def cmd_calibrate(args) -> int:
    if args.slot_line and args.format != "bf16":
        raise InputError("--slot-line applies to BF16 calibrations (GAAC-FP8 slots have their own sizes)")
    check_output_file(args.output, "-o", [("--k", args.k), ("--v", args.v)])
    k, v = load_cache(args.k, "k", "--k"), load_cache(args.v, "v", "--v")
    notes = {"source": {"k": args.k, "v": args.v}}
    if args.tokens:
        k = k[:, :, parse_token_range(args.tokens, k.shape[2])]
        v = v[:, :, parse_token_range(args.tokens, v.shape[2])]
        notes["token_range"] = args.tokens
    lines = {"slot_line": args.slot_line} if args.slot_line else {}     # else calibrate's default
    cal = calibrate(k, v, format=args.format, model=args.model, **lines)
    what = "calibration" if args.format == "bf16" else f"{args.format} calibration"
    if args.slot_line:
        notes["slot_line"] = args.slot_line
    cal.notes.update(notes)
    write_files([("-o", args.output, lambda f: cal.save(f.name))])    # save writes by name: the temporary file's
    print(f"wrote {args.output}: {what} {cal.id:08x} for {cal.layers} layers x {cal.kv_heads} KV heads x "
          f"head_dim {cal.head_dim} (model {cal.model!r}), from {k.shape[2]} K / {v.shape[2]} V tokens; "
          f"escape capacity K {_span(cal.capacity[0])}, V {_span(cal.capacity[1])} bytes")
    return 0


def load_calibration(path: str, fmt: str):
    """The calibration file ``path`` for caches of element format ``fmt``; a calibration for another
    format is refused with the command that makes the right one."""
    from .calibration import CALIBRATION_FILES
    from .errors import CalibrationError

    check_input_file(path, "--calibration")
    try:
        with reading(path, "--calibration"):
            cal = Calibration.load(path, CALIBRATION_FILES[fmt])
    except CalibrationError as exc:
        why = str(exc).removeprefix(f"{path}: ")
        if not why.startswith("not a GAAC"):
            raise CalibrationError(f"--calibration {path!r}: {why}") from None
        make = f"gaac calibrate --k K.npy --v V.npy -o cal.json{'' if fmt == 'bf16' else f' --format {fmt}'}"
        raise CalibrationError(f"--calibration {path!r}: {why}. --format {fmt} needs a"
                               f"{' BF16' if fmt == 'bf16' else 'n ' + fmt} calibration, made by `{make}`") from None
    if cal.format.name != fmt:
        raise CalibrationError(f"--calibration {path!r} is a {cal.format.name} calibration, not {fmt}: pass --format "
                               f"{cal.format.name}, or make one with `gaac calibrate --k K.npy --v V.npy -o cal.json "
                               f"--format {fmt}`")
    return cal


def _span(values) -> str:
    lo, hi = int(np.min(values)), int(np.max(values))
    return str(lo) if lo == hi else f"{lo}..{hi}"


# -- stats -----------------------------------------------------------------------

def _stats_inputs(args):
    """The caches ``gaac stats`` measures: ``(k, v, layer_ids, where, meta)`` (``meta`` only for the sample)."""
    if (args.k is None) != (args.v is None):
        raise InputError("--k and --v go together: give both cache files, or neither to use the shipped sample")
    if args.k is None:
        k, v, meta = load_sample(SAMPLE_MEASURED)
        where = (f"the sample shipped with gaac: {meta['model']} layers {', '.join(map(str, meta['layers']))}, "
                 f"{SAMPLE_MEASURED} prompt")
        return k, v, meta["layers"], where, meta
    return (load_cache(args.k, "k", "--k"), load_cache(args.v, "v", "--v"), None, f"K {args.k}, V {args.v}",
            None)


def cmd_stats(args) -> int:
    """``gaac stats``: calibrate (or load a calibration), code and decode every complete block, print the
    numbers.  Every element format takes this path; one without calibration epochs (FP8) refuses the
    options that follow them, and notes its format and calibration id instead of the adaptation."""
    from .layout import element_format

    fmt = element_format(args.format)
    if args.plot_layers and not args.plot:
        raise InputError("--plot-layers chooses the layers --plot draws: give --plot PNG too")
    if not fmt.epochs and not args.adapt:
        raise InputError("--no-adapt applies to BF16 caches only (GAAC-FP8 has no calibration epochs to turn off)")
    if not fmt.epochs and args.segments:
        raise InputError("--segments applies to BF16 caches only (the per-segment view follows BF16's calibration "
                         "epochs; GAAC-FP8 has none)")
    if args.plot:
        from .plot import check_plot_path

        check_plot_path(args.plot)
    k, v, layer_ids, where, meta = _stats_inputs(args)
    fitted = 0              # tokens the calibration was fitted on, which keep it (gaac.stats.measure)
    if args.calibration:
        cal, how = load_calibration(args.calibration, fmt.name), f"loaded from {args.calibration}"
    elif meta is not None:
        ck, cv, _ = load_sample(SAMPLE_CALIBRATION)
        cal = calibrate(ck, cv, format=fmt, model=meta["model"])
        how = f"calibrated on the shipped {SAMPLE_CALIBRATION} prompt (a different text: cross-task transfer)"
    else:
        cal = calibrate(k, v, format=fmt)
        fitted = int(np.shape(k)[2])
        how = ("no --calibration given: calibrated on these caches themselves (self-calibration"
               + (", a best case; as a cache that calibrates itself on its prompt, the blocks it was fitted on "
                  "keep it: the rule appends no epoch among them)" if fmt.epochs else ")"))

    stats = measure(k, v, cal, layer_ids=layer_ids, adapt=args.adapt, segment_tokens=args.segments,
                    fitted_tokens=fitted)
    notes = [f"cache: {where}"]
    if fmt.epochs:
        notes += [f"calibration: {how}",
                  "adaptation: " + ("on (calibration epochs appended by the rule of gaac.epochs, as the cache does)"
                                    if args.adapt else "off (--no-adapt: every block coded with the calibration's "
                                                       "bases)")]
    else:
        notes += [f"format: {fmt.name}", f"calibration: {how} (id {cal.id:08x})"]
    if args.plot:
        notes.append(_plot(args, k, v, cal, layer_ids, f"{where}\n{how}"))
    if args.json:
        for line in notes:
            print(f"gaac: {line}", file=sys.stderr)
        print(json.dumps(stats.as_dict(per_layer=args.per_layer), indent=2))
    else:
        print("\n".join(notes))
        print(format_table(stats, per_layer=args.per_layer))
    return 0 if stats.k.total.mismatched == 0 and stats.v.total.mismatched == 0 else 1


def _plot(args, k, v, cal, layer_ids, title: str) -> str:
    """``--plot`` (with ``--plot-layers``): write the page(s); the note saying what was drawn where."""
    from .plot import parse_layers, plot_windows

    ids = list(range(k.shape[0])) if layer_ids is None else list(layer_ids)
    layers = parse_layers(args.plot_layers, ids) if args.plot_layers else None
    pages = plot_windows(k, v, cal, args.plot, layer_ids=ids, title=title, layers=layers)
    drawn = sum(len(p[1]) for p in pages)
    note = "wrote " + ", ".join(f"{path} (layers {', '.join(str(ids[i]) for i in page)})" for path, page in pages)
    if drawn < len(ids):
        note += f": {drawn} of {len(ids)} layers; --plot-layers all draws every layer"
    return note


# -- pack / unpack ---------------------------------------------------------------

def _transfer():
    """gaac.transfer, which needs torch (the paged cache's tensors)."""
    try:
        return importlib.import_module("gaac.transfer")
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise InputError("gaac pack and gaac unpack need torch: pip install 'gaac[torch]'") from exc


def cmd_pack(args) -> int:
    """``gaac pack``: the container is written to a temporary file and moved onto ``-o`` once complete,
    so a failed pack leaves a file that was there as it was."""
    transfer = _transfer()
    check_output_file(args.output, "-o", [("--k", args.k), ("--v", args.v), ("--calibration", args.calibration)])
    k, v = load_cache(args.k, "k", "--k"), load_cache(args.v, "v", "--v")
    cal = load_calibration(args.calibration, "bf16") if args.calibration else None
    data = transfer.pack(k, v, cal)
    info = transfer.read_head(data).describe()
    write_files([("-o", args.output, lambda f: f.write(data))])
    how = f"loaded from {args.calibration}" if args.calibration else "calibrated on these caches"
    print(f"wrote {args.output}: {info['layers']} layers x {info['kv_heads']} KV heads x {info['tokens']} tokens x "
          f"head_dim {info['head_dim']}, {info['bytes']:,} bytes for {info['bf16_bytes']:,} bytes of BF16: ratio "
          f"{info['ratio']:.4f}x (calibration {info['calibration_id']}, {how}, embedded; {info['raw_tiles']} of "
          f"{info['tiles']} tiles raw)")
    return 0


def cmd_unpack(args) -> int:
    """``gaac unpack``: K and V are written to temporary files and moved onto ``--k`` and ``--v`` once
    both are complete, so a failure leaves files that were there as they were."""
    from pathlib import Path

    transfer = _transfer()
    for option, name in (("--k", args.k), ("--v", args.v)):
        if Path(name).suffix.lower() != ".npy":
            raise InputError(f"{option} {name!r}: gaac unpack writes .npy files (uint16 BF16 bits)")
    inputs = [("the input", args.input), ("--calibration", args.calibration)]
    check_output_file(args.k, "--k", inputs)
    check_output_file(args.v, "--v", inputs, [("--k", args.k)])
    path = check_input_file(args.input, "input")
    with reading(path, "input"):
        data = path.read_bytes()
    cal = load_calibration(args.calibration, "bf16") if args.calibration else None
    k, v = transfer.unpack(data, cal)
    info = transfer.read_head(data).describe()
    write_files([("--k", args.k, lambda f: np.save(f, k, allow_pickle=False)),
                 ("--v", args.v, lambda f: np.save(f, v, allow_pickle=False))])
    print(f"wrote {args.k}, {args.v}: {list(k.shape)} ([layers, kv_heads, tokens, head_dim]) from {info['bytes']:,} "
          f"bytes; ratio {info['ratio']:.4f}x over BF16; every CRC checked")
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def format_table(stats: CacheStats, per_layer: bool = False) -> str:
    """The readable view of :meth:`CacheStats.as_dict`; an FP8 cache's adds its ratios over FP8 and what
    its conversion changed (:func:`gaac.fp8.stats.format_fp8_table`)."""
    d = stats.as_dict(per_layer=per_layer)
    cal = stats.calibration
    if cal is not None and cal.scale_log2 is not None:
        from .fp8.stats import format_fp8_table

        return format_fp8_table({**d, "format": cal.format.name, "calibration_id": f"{cal.id:08x}"},
                                per_layer=per_layer)
    k, v = d["k"], d["v"]
    rows = [
        ("ratio_stream (BF16 / payload)", lambda s: f"{s['ratio_stream']:.4f}"),
        ("ratio_resident (BF16 / slots+raw+table)", lambda s: f"{s['ratio_resident']:.4f}"),
        ("bits per element, stream", lambda s: f"{s['bits_per_element_stream']:.3f}"),
        ("bits per element, resident", lambda s: f"{s['bits_per_element_resident']:.3f}"),
        ("groups 3-bit", lambda s: _pct(s["frac_3bit"])),
        ("groups 4-bit", lambda s: _pct(s["frac_4bit"])),
        ("groups raw", lambda s: _pct(s["frac_raw"])),
        ("tiles raw (slot overflow)", lambda s: f"{_pct(s['frac_raw_tiles'])} ({s['raw_tiles']}/{s['tiles']})"),
        ("exponent entropy (bits)", lambda s: f"{s['exponent_entropy']:.3f}"),
        ("escape capacity (bytes/slot)", lambda s: _span(s["capacity"])),
        ("calibration epochs appended", lambda s: str(s["epochs_appended"])),
        ("roundtrip bit-exact", lambda s: "yes" if s["roundtrip"] else "NO"),
    ]
    rows += [(f"  resident bits/elem: {part}", lambda s, p=part: f"{s['resident_bits_per_element'][p]:.3f}")
             for part in k["resident_bits_per_element"]]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':{width}}  {'K':>16}  {'V':>16}"]
    lines += [f"{name:{width}}  {fmt(k):>16}  {fmt(v):>16}" for name, fmt in rows]
    lines.append(f"{k['layers']} layers, {k['tokens']} K / {v['tokens']} V tokens = {k['blocks']} / {v['blocks']} "
                 f"complete blocks; {k['tail_tokens']} / {v['tail_tokens']} tail tokens stay BF16 and are not in "
                 "the numbers above")
    if per_layer:
        head = f"{'layer':>5} |" + " |".join(f" {kind}: {'cap':>4} {'stream':>7} {'resident':>8} {'3-bit':>7} "
                                             f"{'4-bit':>7} {'raw':>6} {'rawtile':>7}" for kind in "KV")
        lines += ["", head]
        for lk, lv in zip(d["per_layer"]["k"], d["per_layer"]["v"]):
            cells = [f" {kind}: {s['capacity']:>4} {s['ratio_stream']:>7.4f} {s['ratio_resident']:>8.4f} "
                     f"{_pct(s['frac_3bit']):>7} {_pct(s['frac_4bit']):>7} {_pct(s['frac_raw']):>6} "
                     f"{_pct(s['frac_raw_tiles']):>7}" for kind, s in (("K", lk), ("V", lv))]
            lines.append(f"{lk['layer']:>5} |" + " |".join(cells))
    if "segments" in d:
        lines += ["", format_segments(d["segments"])]
    return "\n".join(lines)


def format_segments(segments: dict) -> str:
    """Per-segment raw and 4-bit group fractions, resident bits per element and epochs appended, K and V."""
    columns = f" {'raw':>6} {'4-bit':>6} {'bits/elem':>9} {'epochs+':>7}"
    lines = [f"{'':>11} |" + " |".join(f"{kind:^{len(columns)}}" for kind in "KV"),
             f"{'tokens':>11} |" + " |".join(columns for _ in "KV")]
    for sk, sv in zip(segments["k"], segments["v"]):
        cells = [f" {_pct(s['frac_raw']):>6} {_pct(s['frac_4bit']):>6} {s['bits_per_element_resident']:>9.3f} "
                 f"{s['epochs_appended']:>7}" for s in (sk, sv)]
        first, end = sk["tokens"]
        lines.append(f"{f'{first}-{end - 1}':>11} |" + " |".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
