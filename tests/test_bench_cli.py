"""bench.py's command line before any model loads: flags checked without torch, a Ctrl-C during the imports."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench
from tests.helpers import heavy_modules_imported, run_interrupted_while_importing

REPO = Path(__file__).resolve().parent.parent


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
    assert heavy_modules_imported("bench", argv) == []


def test_a_bad_limit_is_refused_in_the_shared_wording(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--limit", "0"])
    assert "--limit must be an integer >= 1, got 0" in capsys.readouterr().err


def test_ctrl_c_while_the_imports_load_says_interrupted_and_exits_130(tmp_path):
    """Bug: a Ctrl-C while bench.py's imports loaded printed a KeyboardInterrupt traceback: the imports ran outside
    any handler."""
    done = run_interrupted_while_importing("bench.py", tmp_path)
    assert (done.returncode, done.stderr, done.stdout) == (bench.INTERRUPTED_EXIT, "interrupted\n", "")
