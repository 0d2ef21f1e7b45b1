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


def _bad_files(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Each case: bench.py's flags, and what its one line says (a missing --target: should a check come too late, the
    run ends at loading, never on the default models)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "binary.jsonl").write_bytes(b"\x00\xff\xfe\x9c binary")
    (tmp_path / "array.jsonl").write_text('["not", "an", "object"]\n')
    (tmp_path / "finished").mkdir()
    (tmp_path / "finished" / "results.json").write_text("{}")
    (tmp_path / "interrupted").mkdir()
    (tmp_path / "interrupted" / "progress.jsonl").write_text("{}\n")
    (tmp_path / "notes.md").write_text("my notes")
    cases = {
        "out-is-a-file": (["--out", str(tmp_path / "file")], "is a file, not a directory"),
        "out-under-a-file": (["--out", str(tmp_path / "file" / "run")], f"lies under the file {tmp_path / 'file'}"),
        "prompts-missing": (["--prompts", str(tmp_path / "missing.jsonl")], "no prompt file at"),
        "prompts-binary": (["--prompts", str(tmp_path / "binary.jsonl")], "is not UTF-8 text"),
        "prompts-array-line": (["--prompts", str(tmp_path / "array.jsonl")], "array.jsonl:1: not a JSON object"),
        "unknown-category": (["--categories", "nope"], "no prompts of categories nope in"),
        "finished-run": (["--out", str(tmp_path / "finished")], "holds a finished run (results.json): pass --resume"),
        "interrupted-run": (["--out", str(tmp_path / "interrupted")], "holds an interrupted run (progress.jsonl)"),
        "markdown-exists": (["--markdown", str(tmp_path / "notes.md")],  # was replaced at the run's end
                            f"--markdown {tmp_path / 'notes.md'} exists: pass --force to replace it"),
        "markdown-is-a-directory": (["--markdown", str(tmp_path / "finished"), "--force"], "is a directory"),
        "markdown-under-a-file": (["--markdown", str(tmp_path / "file" / "notes.md")], "lies under the file"),
    }
    return {name: (argv + ["--target", str(tmp_path / "no-model")], message) for name, (argv, message) in cases.items()}


CASES = ["out-is-a-file", "out-under-a-file", "prompts-missing", "prompts-binary", "prompts-array-line",
         "unknown-category", "finished-run", "interrupted-run", "markdown-exists", "markdown-is-a-directory",
         "markdown-under-a-file"]


@pytest.mark.parametrize("case", CASES)
def test_bad_files_and_runs_are_refused_before_loading_in_one_line(capsys, tmp_path, case):
    """Bug: these ended in tracebacks (FileNotFoundError, UnicodeDecodeError, AttributeError, ValueError), mostly after
    the models loaded; and a finished run's results were overwritten silently without --resume."""
    argv, message = _bad_files(tmp_path)[case]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case", ["prompts-binary", "finished-run", "markdown-exists"])
def test_bad_files_are_refused_without_importing_torch(tmp_path, case):
    assert heavy_modules_imported("bench", _bad_files(tmp_path)[case][0]) == []


def test_an_existing_markdown_file_is_replaced_only_with_force(tmp_path):
    notes = tmp_path / "notes.md"
    bench.check_markdown_file(notes, force=False)  # a new name: taken
    notes.write_text("my notes")
    with pytest.raises(ValueError, match="--force"):
        bench.check_markdown_file(notes, force=False)
    bench.check_markdown_file(notes, force=True)
    assert notes.read_text() == "my notes"  # checked, not touched: the summary is written at the run's end


def test_a_finished_run_is_continued_with_resume(tmp_path):
    bench.check_output_dir(tmp_path, resume=True)  # --resume: its measurements are kept, nothing refused
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="--resume"):
        bench.check_output_dir(tmp_path, resume=False)
    bench.check_output_dir(tmp_path, resume=True)
