"""The files the `gaac` command reads and writes: every file error names the option and the path and says
what is wrong; outputs are replaced whole or not at all, and never overwrite the command's inputs."""
import errno
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from gaac.cli import main
from gaac.command import EXIT_BROKEN_PIPE
from gaac.io import load_sample, write_files
from gaac.errors import InputError


def run(capsys, *argv):
    """``main(argv)`` -> (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(rc, out, err) -> str:
    """The one-line error of a refused command."""
    assert rc == 2 and out == "" and err.startswith("gaac: error: ") and err.count("\n") == 1, (rc, out, err)
    return err


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A small cache (1 layer, 1 KV head, 32 tokens) as k.npy, v.npy in the working directory."""
    monkeypatch.chdir(tmp_path)
    k, v, _ = load_sample("code")
    np.save("k.npy", k[:1, :1, :32])
    np.save("v.npy", v[:1, :1, :32])
    return tmp_path


@pytest.fixture
def packed(files, capsys):
    """files, plus x.gaac packed from them."""
    pytest.importorskip("torch")
    assert run(capsys, "pack", "--k", "k.npy", "--v", "v.npy", "-o", "x.gaac")[0] == 0
    return files


def test_file_errors_name_the_option_the_path_and_the_problem(files, capsys):
    (files / "d").mkdir()
    cases = [(["stats", "--k", "d", "--v", "v.npy"], "--k 'd': is a directory"),
             (["stats", "--k", "k.npy", "--v", os.devnull], f"--v '{os.devnull}': is a character device"),
             (["stats", "--k", "k.npy", "--v", "v.npy", "--calibration", "missing.json"],
              "--calibration 'missing.json': no such file"),
             (["stats", "--k", "k.npy", "--v", "v.npy", "--calibration", "d"], "--calibration 'd': is a directory"),
             (["calibrate", "--k", "k.npy", "--v", "v.npy", "-o", "d"], "-o 'd': is a directory"),
             (["calibrate", "--k", "k.npy", "--v", "v.npy", "-o", "no/c.json"], "-o 'no/c.json': cannot write "
                                                                               "(no such folder 'no')"),
             (["stats", "--plot", "d"], "--plot 'd': is a directory")]
    if os.path.isfile("/proc/version"):                     # a file no one can replace
        cases.append((["calibrate", "--k", "k.npy", "--v", "v.npy", "-o", "/proc/version"],
                      "-o '/proc/version': cannot write"))
    for argv, message in cases:
        err = one_error(*run(capsys, *argv))
        assert message in err, (argv, err)
    assert sorted(os.listdir(files)) == ["d", "k.npy", "v.npy"]          # nothing written, no temporary files


def test_unpack_input_errors_name_the_input(packed, capsys):
    pytest.importorskip("torch")
    err = one_error(*run(capsys, "unpack", packed, "--k", "a.npy", "--v", "b.npy"))
    assert f"input '{packed}': is a directory" in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_opening_it(files, capsys):
    """Opening a FIFO that no one writes to blocks forever: the command refuses it by its type first."""
    pytest.importorskip("torch")
    os.mkfifo("cal.json")

    def opened(*_):
        raise TimeoutError("the command opened the FIFO and blocked")

    previous = signal.signal(signal.SIGALRM, opened)
    signal.alarm(30)
    try:
        for command in (["pack", "-o", "x.gaac"], ["stats"]):
            err = one_error(*run(capsys, *command, "--k", "k.npy", "--v", "v.npy", "--calibration", "cal.json"))
            assert "--calibration 'cal.json': is a FIFO (named pipe), not a regular file" in err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_pack_and_unpack_refuse_to_overwrite_their_inputs(packed, capsys):
    before = {name: (packed / name).read_bytes() for name in ("k.npy", "v.npy", "x.gaac")}
    os.link("k.npy", "k_link.npy")
    for argv, message in (
            (["pack", "--k", "k.npy", "--v", "v.npy", "-o", "./k.npy"], "-o './k.npy': is also --k"),
            (["pack", "--k", "k.npy", "--v", "v.npy", "-o", "k_link.npy"], "-o 'k_link.npy': is also --k"),
            (["pack", "--k", "k.npy", "--v", "v.npy", "--calibration", "x.gaac", "-o", "x.gaac"],
             "-o 'x.gaac': is also --calibration"),
            (["unpack", "x.gaac", "--k", "k.npy", "--v", "w.npy", "--calibration", "k.npy"],
             "--k 'k.npy': is also --calibration"),
            (["unpack", "k.npy", "--k", "k.npy", "--v", "w.npy"], "--k 'k.npy': is also the input"),
            (["unpack", "x.gaac", "--k", "X.npy", "--v", "X.npy"], "--v 'X.npy': is also --k"),
            (["unpack", "x.gaac", "--k", "X.npy", "--v", f"{packed}/X.npy"], "is also --k")):
        err = one_error(*run(capsys, *argv))
        assert message in err, (argv, err)
    assert {name: (packed / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(packed)) == ["k.npy", "k_link.npy", "v.npy", "x.gaac"]


def test_unpack_writes_the_file_it_names(packed, capsys):
    rc, out, _ = run(capsys, "unpack", "x.gaac", "--k", "UP.NPY", "--v", "v2.Npy")
    assert rc == 0 and out.startswith("wrote UP.NPY, v2.Npy:")
    assert sorted(os.listdir(packed)) == ["UP.NPY", "k.npy", "v.npy", "v2.Npy", "x.gaac"]
    np.testing.assert_array_equal(np.load("UP.NPY"), np.load("k.npy"))
    np.testing.assert_array_equal(np.load("v2.Npy"), np.load("v.npy"))


def test_a_failed_pack_leaves_the_file_that_was_there(packed, capsys):
    """The container goes to a temporary file first: a write that fails (here: past the file-size limit,
    as a full disk would) leaves the old file whole, and no temporary file."""
    resource = pytest.importorskip("resource")
    good = (packed / "x.gaac").read_bytes()
    np.save("k2.npy", np.load("k.npy")[:, :, ::-1])          # another cache: a container that differs
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))   # Python ignores SIGXFSZ: writes fail EFBIG
    try:
        rc, out, err = run(capsys, "pack", "--k", "k2.npy", "--v", "v.npy", "-o", "x.gaac")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert "-o 'x.gaac': cannot write (File too large)" in one_error(rc, out, err)
    assert (packed / "x.gaac").read_bytes() == good
    assert sorted(os.listdir(packed)) == ["k.npy", "k2.npy", "v.npy", "x.gaac"]


def test_a_failed_unpack_leaves_both_files_that_were_there(packed, capsys, monkeypatch):
    """K is not moved into place until V is written too."""
    (packed / "a.npy").write_bytes(b"old k")
    (packed / "b.npy").write_bytes(b"old v")
    save, calls = np.save, []

    def save_then_fail(f, array, **kw):             # the second file (V) fails half-way, as a full disk would
        calls.append(f)
        save(f, array, **kw)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", save_then_fail)
    err = one_error(*run(capsys, "unpack", "x.gaac", "--k", "a.npy", "--v", "b.npy"))
    assert "--v 'b.npy': cannot write (No space left on device)" in err and len(calls) == 2
    assert (packed / "a.npy").read_bytes() == b"old k" and (packed / "b.npy").read_bytes() == b"old v"
    assert sorted(os.listdir(packed)) == ["a.npy", "b.npy", "k.npy", "v.npy", "x.gaac"]


def test_write_files_keeps_an_existing_files_permissions(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    path.chmod(0o640)
    write_files([("-o", path, lambda f: f.write(b"new"))])
    assert path.read_bytes() == b"new" and (path.stat().st_mode & 0o777) == 0o640
    write_files([("-o", tmp_path / "g.bin", lambda f: f.write(b"x"))])
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "g.bin").stat().st_mode & 0o777 == 0o666 & ~mask

    def fail(f):
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(InputError, match=re.escape(f"--v '{tmp_path / 'i.bin'}': cannot write (Input/output error)")):
        write_files([("--k", tmp_path / "h.bin", lambda f: f.write(b"x")), ("--v", tmp_path / "i.bin", fail)])
    assert sorted(os.listdir(tmp_path)) == ["f.bin", "g.bin"]        # neither file, nor a temporary one


def test_a_closed_output_pipe_ends_the_command_quietly(files):
    """`gaac ... | head -c 10`: the reader is gone before gaac writes; no error, no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "gaac.cli", "calibrate", "--k", "k.npy", "--v", "v.npy", "-o",
                               "c.json"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == EXIT_BROKEN_PIPE and proc.stderr == ""
    assert (files / "c.json").is_file()


def test_an_output_that_is_a_symbolic_link_is_written_through(packed, capsys):
    """The link's target gets the new contents; the link stays a link."""
    good = (packed / "x.gaac").read_bytes()
    (packed / "x.gaac").write_bytes(b"old")
    os.symlink("x.gaac", "link.gaac")
    rc, _, _ = run(capsys, "pack", "--k", "k.npy", "--v", "v.npy", "-o", "link.gaac")
    assert rc == 0 and os.path.islink("link.gaac") and (packed / "x.gaac").read_bytes() == good
    assert sorted(os.listdir(packed)) == ["k.npy", "link.gaac", "v.npy", "x.gaac"]
