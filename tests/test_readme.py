"""README.md works as written: its set-up commands, every Python example (run in an empty folder), the lean
install it describes, and what it says about the command line and transformers."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def fenced(language: str) -> list[str]:
    """The README's fenced code blocks of ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


def run_python(code: str, cwd: Path, timeout: int = 600, prelude: str = "") -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in ``cwd``, importing gaac from this checkout (as an install would)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_readme_starts_with_the_two_setup_commands():
    assert README.startswith("# gaac\n\n```sh\n")                  # the first thing after the title
    commands = fenced("sh")[0].strip().splitlines()
    assert len(commands) == 2
    assert commands[0].startswith("pip install ") and commands[0].endswith("&& gaac stats")
    assert commands[1] == "python -m pytest -q -n auto tests"
    assert commands[1] in (ROOT / ".ci" / "run").read_text()     # CI runs the README's test command


PYTHON_BLOCKS = fenced("python")


def test_the_readme_has_python_examples():
    assert len(PYTHON_BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_every_python_block_runs_as_written_in_an_empty_folder(index, tmp_path):
    code = PYTHON_BLOCKS[index]
    if "transformers" in code:
        pytest.importorskip("transformers")
    if "torch" in code:
        pytest.importorskip("torch")
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n{proc.stderr[-3000:]}"


def test_the_lean_install_measures_the_sample(tmp_path):
    """``pip install .`` brings numpy and tqdm only: gaac stats and calibrate must run without any extra."""
    setup = (ROOT / "setup.cfg").read_text()
    requires = setup.split("install_requires =", 1)[1].split("\n\n", 1)[0].split()
    assert [r.split(">")[0].split("<")[0] for r in requires] == ["numpy", "tqdm"]
    assert "pip install .`" in README
    block = ("import importlib.abc, sys\n"
             "class NoExtras(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('torch', 'numba', 'matplotlib', 'transformers', 'safetensors',\n"
             "                                  'gguf', 'llvmlite', 'cuda'):\n"
             "            raise ModuleNotFoundError(f'No module named {name!r} (not in the lean install)', name=name)\n"
             "sys.meta_path.insert(0, NoExtras())\n")
    code = ("from gaac.cli import main\n"
            "assert main(['stats', '--json']) == 0\n"
            "import gaac, numpy as np\n"
            "k, v = gaac.sample('code')\n"
            "np.save('k.npy', k); np.save('v.npy', v)\n"
            "assert main(['calibrate', '--k', 'k.npy', '--v', 'v.npy', '-o', 'cal.json']) == 0\n"
            "assert main(['stats', '--k', 'k.npy', '--v', 'v.npy', '--calibration', 'cal.json']) == 0\n"
            "assert main(['pack', '--k', 'k.npy', '--v', 'v.npy', '-o', 'x.gaac']) == 2\n"
            "assert 'torch' not in sys.modules and 'numba' not in sys.modules\n")
    proc = run_python(code, tmp_path, prelude=block)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gaac pack and gaac unpack need torch: pip install 'gaac[torch]'" in proc.stderr


def test_the_readme_says_what_a_first_hour_needs():
    synopsis = fenced("sh")[1]
    calibrate = synopsis.split("gaac calibrate", 1)[1].split("\ngaac stats", 1)[0]
    stats = synopsis.split("\ngaac stats --k", 1)[1].split("\ngaac pack", 1)[0]
    assert "--format" in calibrate and "--format" in stats and "--plot-layers" in stats
    for command in ("gaac pack", "gaac unpack", "gaac --version", "gaac capture"):
        assert command in synopsis
    # transformers: the keyword it takes, the registration and the attention name the fused path needs, and
    # what the CPU path costs
    assert "past_key_values=GAACCache" not in README and "cache=cache)" in README
    assert "import gaac.hf" in README and 'attn_implementation="gaac"' in README
    assert "decodes each layer's\npast at every step" in README
    # the paged cache: its default size, and how to grow it
    assert "max_blocks (default 64)" in README and "grow=True" in README
    # capture's first run
    assert "270 MB" in README and "GAAC_CACHE_DIR" in README
