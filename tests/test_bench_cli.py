"""bench.py's command line before any model loads: flags checked without torch, a Ctrl-C during the imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench

REPO = Path(__file__).resolve().parent.parent


def imported_heavy_modules(argv: list[str]) -> list[str]:
    code = ("import sys, bench\n"
            "try:\n    bench.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('imported:', *[m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    return done.stdout.splitlines()[-1].split()[1:]


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["--limit", "0"],
    ["--threads", "0"],
    ["--strategies", "autoregressive,warp"],
    ["--no-hf", "--strategies", "hf_generate"],
    ["--resume"],
    ["--gamma", "0"],
    ["--temperature", "0.7", "--top-p", "2"],
    ["--dtype", "float8"],
], ids=["help", "bad-limit", "bad-threads", "unknown-strategy", "no-hf-contradiction", "resume-without-out",
        "bad-gamma", "bad-top-p", "bad-dtype"])
def test_the_flag_path_imports_neither_torch_nor_transformers(argv):
    """Bug: bench.py imported torch at the top, so a bad flag was refused only after 7-10 s of imports."""
    assert imported_heavy_modules(argv) == []


def test_a_bad_limit_is_refused_in_the_shared_wording(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--limit", "0"])
    assert "--limit must be an integer >= 1, got 0" in capsys.readouterr().err


def test_ctrl_c_while_the_imports_load_says_interrupted_and_exits_130(tmp_path):
    """Bug: a Ctrl-C while bench.py's imports loaded printed a KeyboardInterrupt traceback: the imports ran outside
    any handler. A sitecustomize module raises SIGINT in the process itself when the imports reach
    sampling.settings, so the signal lands there every time."""
    (tmp_path / "sitecustomize.py").write_text(
        "import signal, sys\n"
        "class InterruptOnImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sampling.settings':\n"
        "            sys.meta_path.remove(self)\n"
        "            signal.raise_signal(signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, InterruptOnImport())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "bench.py", "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stderr, done.stdout) == (bench.INTERRUPTED_EXIT, "interrupted\n", "")
