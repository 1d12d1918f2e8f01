"""The `gaac` command end to end, and the cache loaders it reads files with."""
import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from gaac import layout as L
from gaac.calibration import Calibration, calibrate
from gaac.cli import main
from gaac.errors import InputError
from gaac.io import load_cache, load_sample

FIELDS = {"ratio_stream", "ratio_resident", "frac_3bit", "frac_4bit", "frac_raw", "frac_raw_tiles",
          "exponent_entropy", "roundtrip", "capacity", "tail_tokens", "bits_per_element_stream",
          "bits_per_element_resident"}
ALL_3BIT_RATIO = 16 / (8 + L.CODE_BITS + L.TAG_BITS / L.GROUP_SIZE)


def run(capsys, *argv):
    """``main(argv)`` -> (exit status, stdout, stderr)."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def check_kind(s: dict, layers: int):
    assert FIELDS <= set(s)
    assert s["roundtrip"] is True
    assert 1.0 < s["ratio_resident"] <= s["ratio_stream"] <= ALL_3BIT_RATIO + 1e-12
    assert s["frac_3bit"] + s["frac_4bit"] + s["frac_raw"] == pytest.approx(1)
    assert all(0 <= s[f] <= 1 for f in ("frac_3bit", "frac_4bit", "frac_raw", "frac_raw_tiles"))
    assert 0 < s["exponent_entropy"] <= 8
    assert len(s["capacity"]) == layers and all(c % L.SLOT_ALIGN == 0 for c in s["capacity"])


@pytest.fixture(scope="module")
def sample_files(tmp_path_factory):
    """Two layers of the shipped code sample as .npy files."""
    d = tmp_path_factory.mktemp("cache")
    k, v, _ = load_sample("code")
    np.save(d / "k.npy", k[:2])
    np.save(d / "v.npy", v[:2])
    return d


def test_stats_on_the_shipped_sample(capsys):
    rc, out, err = run(capsys, "stats", "--json")
    assert rc == 0
    d = json.loads(out)
    assert set(d) == {"k", "v"}
    for s in d.values():
        check_kind(s, layers=4)
    assert "calibrated on the shipped prose prompt" in err and "code prompt" in err

    rc, out, _ = run(capsys, "stats", "--json", "--per-layer")
    per = json.loads(out)["per_layer"]
    assert [p["layer"] for p in per["k"]] == [0, 10, 20, 29] and len(per["v"]) == 4


def test_stats_table(capsys):
    rc, out, _ = run(capsys, "stats", "--per-layer")
    assert rc == 0
    assert "calibrated on the shipped prose prompt" in out
    assert "roundtrip bit-exact" in out and " NO" not in out
    assert out.count("\n   29 |") == 1                    # the per-layer view, labelled with model layers


def test_calibrate_then_stats(capsys, sample_files, tmp_path):
    cal_path = tmp_path / "cal.json"
    rc, out, _ = run(capsys, "calibrate", "--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy"),
                     "-o", str(cal_path), "--model", "smollm2-slice", "--tokens", "0:128")
    assert rc == 0 and str(cal_path) in out
    cal = Calibration.load(cal_path)
    k, v = np.load(sample_files / "k.npy"), np.load(sample_files / "v.npy")
    assert cal.id == calibrate(k[:, :, :128], v[:, :, :128]).id        # the token range was honoured
    assert cal.model == "smollm2-slice" and cal.notes["token_range"] == "0:128"

    rc, out, err = run(capsys, "stats", "--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy"),
                       "--calibration", str(cal_path), "--json")
    assert rc == 0 and str(cal_path) in err
    d = json.loads(out)
    for kind, name in ((L.KIND_K, "k"), (L.KIND_V, "v")):
        check_kind(d[name], layers=2)
        assert d[name]["tokens"] == 256 and d[name]["capacity"] == cal.capacity[kind].tolist()


def test_calibrate_slot_line(capsys, sample_files, tmp_path):
    cal_path = tmp_path / "cal.json"
    rc, out, _ = run(capsys, "calibrate", "--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy"),
                     "-o", str(cal_path), "--slot-line", "128")
    assert rc == 0
    cal = Calibration.load(cal_path)
    k, v = np.load(sample_files / "k.npy"), np.load(sample_files / "v.npy")
    assert cal.id == calibrate(k, v, slot_line=128).id and cal.notes["slot_line"] == 128
    slots = L.geometry(cal.head_dim).fixed_bytes + cal.capacity
    assert (slots % 128 == 0).all(), slots.tolist()


def test_stats_segments_and_no_adapt(capsys, sample_files):
    files = ["--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy")]
    rc, out, err = run(capsys, "stats", *files, "--segments", "64", "--json")
    d = json.loads(out)
    assert rc == 0 and d["k"]["adapt"] is True and "adaptation: on" in err
    assert [s["tokens"] for s in d["segments"]["v"]] == [[0, 64], [64, 128], [128, 192], [192, 256]]
    assert sum(s["tiles"] for s in d["segments"]["k"]) == d["k"]["tiles"]
    rc, out, _ = run(capsys, "stats", *files, "--no-adapt", "--json")
    fixed = json.loads(out)
    assert rc == 0 and fixed["k"]["adapt"] is False and "segments" not in fixed
    # 16 blocks per layer are too few for an epoch (warm-up): the same tiles, less the 2-byte epoch index
    assert fixed["k"]["tiles"] == d["k"]["tiles"] and fixed["k"]["ratio_resident"] > d["k"]["ratio_resident"]
    rc, out, _ = run(capsys, "stats", *files, "--segments", "128", "--no-adapt")
    assert rc == 0 and "adaptation: off" in out
    assert re.search(r"\n +0-127 \|.*\n +128-255 \|", out) and out.count(" 4-bit bits/elem") == 2
    rc, _, err = run(capsys, "stats", *files, "--segments", "100")
    assert rc == 2 and "multiple of 16" in err


def test_self_calibration_says_so(capsys, sample_files):
    rc, out, _ = run(capsys, "stats", "--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy"))
    assert rc == 0 and "calibrated on these caches themselves" in out
    assert "the rule appends no epoch among them" in out


def test_plot(capsys, sample_files, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "hist.png"
    rc, out, _ = run(capsys, "stats", "--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy"),
                     "--plot", str(png))
    assert rc == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.parametrize("make, args, message", [
    (lambda d: None, ["--k", "missing.npy", "--v", "missing.npy"], "no such file"),
    (lambda d: np.save(d / "f.npy", np.zeros((1, 1, 16, 64), np.float32)), ["--k", "f.npy", "--v", "f.npy"],
     "float32"),
    (lambda d: np.save(d / "s.npy", np.zeros((3, 16, 64), np.uint16)), ["--k", "s.npy", "--v", "s.npy"],
     r"shape \[3, 16, 64\]"),
    (lambda d: np.save(d / "h.npy", np.zeros((1, 1, 16, 48), np.uint16)), ["--k", "h.npy", "--v", "h.npy"],
     "head_dim 48"),
    (lambda d: (d / "x.txt").write_text("hi"), ["--k", "x.txt", "--v", "x.txt"], "unknown file type"),
    (lambda d: np.save(d / "o.npy", np.zeros((1, 1, 16, 64), np.uint16)), ["--k", "o.npy"], "go together"),
    (lambda d: None, ["--nope"], "unrecognized arguments"),
])
def test_bad_input_exits_2_naming_the_problem(capsys, tmp_path, monkeypatch, make, args, message):
    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    rc, out, err = run(capsys, "stats", *args)
    assert rc == 2 and out == ""
    assert err.startswith("gaac: error: ") and err.count("\n") == 1
    assert re.search(message, err)


def test_calibration_for_another_cache_exits_2(capsys, sample_files, tmp_path):
    other = tmp_path / "other.json"
    k, v, _ = load_sample("code")
    calibrate(k, v).save(other)                                          # 4 layers; the files have 2
    rc, _, err = run(capsys, "stats", "--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy"),
                     "--calibration", str(other))
    assert rc == 2 and "calibration is for 4 layers" in err
    rc, _, err = run(capsys, "calibrate", "--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy"),
                     "-o", str(tmp_path / "c.json"), "--tokens", "300:400")
    assert rc == 2 and "token range '300:400'" in err and not (tmp_path / "c.json").exists()


def test_capture_is_dispatched_lazily(capsys, monkeypatch):
    seen = []
    monkeypatch.setitem(sys.modules, "gaac.capture", types.SimpleNamespace(main=lambda argv: seen.append(argv)))
    assert main(["capture", "--model", "x", "-o", "y"]) == 0 and seen == [["--model", "x", "-o", "y"]]
    monkeypatch.setitem(sys.modules, "gaac.capture", None)              # as if gaac/capture.py did not exist
    rc, _, err = run(capsys, "capture", "--model", "x")
    assert rc == 2 and "gaac capture is not available" in err


# -- loaders -------------------------------------------------------------------

def test_safetensors_and_torch_files(tmp_path):
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    k, v, _ = load_sample("code")
    tk, tv = (torch.from_numpy(a[:1].view(np.int16)).view(torch.bfloat16) for a in (k, v))
    save_file({"k": tk, "v": tv}, tmp_path / "both.safetensors")
    save_file({"cache": tv}, tmp_path / "one.safetensors")
    save_file({"a": tk, "b": tv}, tmp_path / "two.safetensors")
    save_file({"k": tk.float()}, tmp_path / "f32.safetensors")
    torch.save(tk, tmp_path / "k.pt")
    torch.save({"k": tk, "v": tv}, tmp_path / "kv.pt")
    np.testing.assert_array_equal(load_cache(tmp_path / "both.safetensors", "k"), k[:1])
    np.testing.assert_array_equal(load_cache(tmp_path / "both.safetensors", "v"), v[:1])
    np.testing.assert_array_equal(load_cache(tmp_path / "one.safetensors", "k"), v[:1])
    np.testing.assert_array_equal(load_cache(tmp_path / "k.pt", "k"), k[:1])
    np.testing.assert_array_equal(load_cache(tmp_path / "kv.pt", "v"), v[:1])
    with pytest.raises(InputError, match=r"holds tensors \['a', 'b'\]"):
        load_cache(tmp_path / "two.safetensors", "k")
    with pytest.raises(InputError, match="dtype F32 is not BF16"):
        load_cache(tmp_path / "f32.safetensors", "k")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 12)
    with pytest.raises(InputError, match="header of .* bytes exceeds the file"):
        load_cache(tmp_path / "bad.safetensors", "k")
    torch.save(tk.float(), tmp_path / "f32.pt")
    with pytest.raises(InputError, match="torch.float32 is not BF16"):
        load_cache(tmp_path / "f32.pt", "k")


def installed_gaac():
    """The `gaac` console script of the environment running the tests, if it is installed."""
    return shutil.which("gaac", path=str(Path(sys.executable).parent)) or shutil.which("gaac")


def test_installed_console_script(tmp_path):
    script = installed_gaac()
    if script is None:
        pytest.skip("the gaac console script is not installed (pip install . installs it)")
    # run outside the checkout, so that the installed package (and its shipped sample) is what runs
    proc = subprocess.run([script, "stats", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    for s in d.values():
        check_kind(s, layers=4)
    bad = subprocess.run([script, "stats", "--k", "nope.npy", "--v", "nope.npy"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nope.npy': no such file" in bad.stderr


def test_plot_samples_many_layers_evenly():
    from gaac.plot import MAX_LAYERS, shown_layers

    assert shown_layers(4) == [0, 1, 2, 3]
    many = shown_layers(30)
    assert len(many) == MAX_LAYERS and many[0] == 0 and many[-1] == 29 and many == sorted(set(many))


def test_plot_layers_choose_layers_or_page_through_all(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from gaac.plot import MAX_LAYERS, parse_layers

    d = tmp_path / "cache"
    d.mkdir()
    k, v, _ = load_sample("code")
    layers = MAX_LAYERS + 2                                     # more layers than a page holds
    np.save(d / "k.npy", np.concatenate([k] * 3)[:layers, :, :64])
    np.save(d / "v.npy", np.concatenate([v] * 3)[:layers, :, :64])
    files = ["--k", str(d / "k.npy"), "--v", str(d / "v.npy")]
    rc, out, _ = run(capsys, "stats", *files, "--plot", str(tmp_path / "h.png"))
    assert rc == 0 and f"{MAX_LAYERS} of {layers} layers; --plot-layers all draws every layer" in out
    rc, out, _ = run(capsys, "stats", *files, "--plot", str(tmp_path / "all.png"), "--plot-layers", "all")
    pages = [tmp_path / "all-1.png", tmp_path / "all-2.png"]
    assert rc == 0 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pages) and not (tmp_path / "all.png").exists()
    assert f"{pages[1]} (layers 8, 9)" in out and "of 10 layers" not in out
    rc, out, _ = run(capsys, "stats", *files, "--plot", str(tmp_path / "two.png"), "--plot-layers", "3,5-6")
    assert rc == 0 and f"{tmp_path / 'two.png'} (layers 3, 5, 6): 3 of {layers} layers" in out
    # the sample names its layers as the model does: 0, 10, 20, 29
    assert parse_layers("10,29", [0, 10, 20, 29]) == [1, 3] and parse_layers("all", [0, 10]) == [0, 1]
    for text, message in (("5", "no layer 5"), ("x", "expected 'all'"), ("4-2", "backwards")):
        with pytest.raises(InputError, match=message):
            parse_layers(text, [0, 10, 20, 29])
    rc, _, err = run(capsys, "stats", *files, "--plot-layers", "all")
    assert rc == 2 and "give --plot PNG too" in err


def test_synopsis_names_every_option():
    import gaac.cli

    synopsis = gaac.cli.__doc__.split("\n\n")[1]
    for command, options in (("calibrate", ["--format", "--slot-line", "--tokens"]),
                             ("stats", ["--format", "--plot-layers", "--segments", "--no-adapt"]),
                             ("pack", ["--k", "--v", "--calibration", "-o"]),
                             ("unpack", ["--k", "--v", "--calibration"])):
        text = synopsis.split(f"gaac {command}", 1)[1].split("\n    gaac ", 1)[0]
        assert all(o in text for o in options), (command, text)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_stats_fp8_formats(capsys, fmt):
    """``--format fp8_*`` reports the BF16 fields plus the ratio over FP8 and the total over BF16."""
    rc, out, err = run(capsys, "stats", "--format", fmt, "--json")
    assert rc == 0 and fmt in err
    d = json.loads(out)
    assert set(d) == {"k", "v"}
    for s in d.values():
        assert s["roundtrip"] is True
        assert 1.0 < s["ratio_resident"] <= s["ratio_stream"]
        assert s["ratio_over_fp8"] > 1.0
        # BF16 is 16 bits, FP8 8: the total over BF16 is twice the ratio over FP8.
        assert s["ratio_total_vs_bf16"] == pytest.approx(2 * s["ratio_over_fp8"])
        assert sum(s[f"frac_{m}"] for m in s["mode_names"]) == pytest.approx(1)


def test_stats_fp8_refuses_bf16_only_options_and_calibrations(capsys, tmp_path):
    rc, _, err = run(capsys, "stats", "--format", "fp8_e5m2", "--segments", "1024")
    assert rc == 2 and "BF16 caches only" in err and "per-segment" in err
    rc, _, err = run(capsys, "stats", "--format", "fp8_e5m2", "--no-adapt")
    assert rc == 2 and "no calibration epochs" in err
    k, v, _ = load_sample("prose")
    path = tmp_path / "bf16.json"
    calibrate(k, v).save(path)
    rc, _, err = run(capsys, "stats", "--format", "fp8_e4m3", "--calibration", str(path))
    assert rc == 2 and "not a GAAC-FP8 calibration" in err and err.count("\n") == 1
    assert "`gaac calibrate --k K.npy --v V.npy -o cal.json --format fp8_e4m3`" in err


def test_fp8_calibration_from_the_command_line(capsys, sample_files, tmp_path):
    from gaac.fp8 import calibrate_fp8

    files = ["--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy")]
    path = tmp_path / "fp8.json"
    rc, out, _ = run(capsys, "calibrate", *files, "-o", str(path), "--format", "fp8_e5m2", "--tokens", "0:128")
    assert rc == 0 and "fp8_e5m2 calibration" in out
    cal = Calibration.load(path)
    k, v = np.load(sample_files / "k.npy"), np.load(sample_files / "v.npy")
    assert cal.id == calibrate_fp8(k[:, :, :128], v[:, :, :128], "fp8_e5m2").id and cal.format.name == "fp8_e5m2"
    rc, out, err = run(capsys, "stats", *files, "--format", "fp8_e5m2", "--calibration", str(path), "--json")
    assert rc == 0 and f"loaded from {path}" in err and json.loads(out)["k"]["roundtrip"] is True
    # the wrong FP8 format, or a BF16 stats run, names the calibration's format and how to make the right one
    rc, _, err = run(capsys, "stats", *files, "--format", "fp8_e4m3", "--calibration", str(path))
    assert rc == 2 and "is a fp8_e5m2 calibration, not fp8_e4m3: pass --format fp8_e5m2" in err
    rc, _, err = run(capsys, "stats", *files, "--calibration", str(path))
    assert rc == 2 and "not a GAAC calibration" in err and "needs a BF16 calibration" in err
    rc, _, err = run(capsys, "calibrate", *files, "-o", str(path), "--format", "fp8_e4m3", "--slot-line", "128")
    assert rc == 2 and "--slot-line applies to BF16" in err


def test_plot_fp8(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fp8.png"
    rc, out, _ = run(capsys, "stats", "--format", "fp8_e4m3", "--plot", str(png))
    assert rc == 0 and f"wrote {png} (layers 0, 10, 20, 29)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_version(capsys):
    import configparser

    import gaac

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"gaac {gaac.__version__} (format version {L.FORMAT_VERSION})\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", gaac.__version__)
    # the package's metadata takes its version from gaac.__version__, so the two cannot differ
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert setup["metadata"]["version"] == "attr: gaac.__version__"


def test_sample_is_the_shipped_cache():
    import gaac

    k, v = gaac.sample("prose")
    ref_k, ref_v, meta = load_sample("prose")
    np.testing.assert_array_equal(k, ref_k)
    np.testing.assert_array_equal(v, ref_v)
    assert k.dtype == np.uint16 and k.shape == (4, 3, 768, 64) and gaac.sample()[0].shape == (4, 3, 256, 64)
    with pytest.raises(InputError, match="ships"):
        gaac.sample("poetry")


def test_pack_unpack_is_bit_exact_and_prints_the_ratio(capsys, sample_files, tmp_path):
    pytest.importorskip("torch")
    files = ["--k", str(sample_files / "k.npy"), "--v", str(sample_files / "v.npy")]
    packed = tmp_path / "x.gaac"
    rc, out, _ = run(capsys, "pack", *files, "-o", str(packed))
    assert rc == 0 and re.search(r"ratio 1\.\d{4}x \(calibration [0-9a-f]{8}, calibrated on these caches, embedded",
                                 out)
    ratio = float(re.search(r"ratio (\d\.\d+)x", out).group(1))
    k, v = np.load(sample_files / "k.npy"), np.load(sample_files / "v.npy")
    assert ratio == pytest.approx(2 * k.nbytes / packed.stat().st_size, abs=1e-4) and ratio > 1.3
    rc, out, _ = run(capsys, "unpack", str(packed), "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy"))
    assert rc == 0 and f"ratio {ratio:.4f}x" in out
    np.testing.assert_array_equal(np.load(tmp_path / "k.npy"), k)
    np.testing.assert_array_equal(np.load(tmp_path / "v.npy"), v)
    # with a calibration file: the same container as the API makes
    cal_path = tmp_path / "cal.json"
    calibrate(k, v).save(cal_path)
    rc, out, _ = run(capsys, "pack", *files, "--calibration", str(cal_path), "-o", str(tmp_path / "c.gaac"))
    assert rc == 0 and f"loaded from {cal_path}" in out
    from gaac import transfer

    assert (tmp_path / "c.gaac").read_bytes() == bytes(transfer.pack(k, v, Calibration.load(cal_path)))


def test_unpack_errors_exit_2(capsys, sample_files, tmp_path):
    pytest.importorskip("torch")
    from gaac import transfer
    from gaac.cache import PagedKVCache

    k, v = np.load(sample_files / "k.npy"), np.load(sample_files / "v.npy")
    good = bytes(transfer.pack(k, v))
    outs = ["--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy")]
    (tmp_path / "bad.gaac").write_bytes(good[:-5000] + bytes([good[-5000] ^ 1]) + good[-4999:])
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, max_blocks=16)
    (tmp_path / "bare.gaac").write_bytes(cache.export_sequence(cache.add_sequence(k, v)))
    cal.save(tmp_path / "cal.json")
    for args, message in (([str(tmp_path / "bad.gaac")], "CRC-32 mismatch"),
                          ([str(tmp_path / "missing.gaac")], "no such file"),
                          ([str(sample_files / "k.npy")], "bad magic"),
                          ([str(tmp_path / "bare.gaac")], "carries no calibration"),
                          ([str(tmp_path / "bad.gaac"), "--v", "v.npy", "--k", "k.txt"], "writes .npy files")):
        rc, out, err = run(capsys, "unpack", *outs, *args)
        assert rc == 2 and out == "" and err.startswith("gaac: error: ") and err.count("\n") == 1, err
        assert message in err, err
    assert not (tmp_path / "k.npy").exists()
    rc, _, _ = run(capsys, "unpack", str(tmp_path / "bare.gaac"), *outs, "--calibration", str(tmp_path / "cal.json"))
    assert rc == 0
    np.testing.assert_array_equal(np.load(tmp_path / "v.npy"), v)
