"""infer.py: --help, bad input (one line, non-zero exit), and the one-shot JSON schema in a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import infer
from app.flags import model_choice
from sampling.settings import STRATEGIES
from tests.helpers import heavy_modules_imported, run_interrupted_while_importing, save_random_heads, save_tiny_pair

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("infer_cli")
    return save_tiny_pair(root)


@pytest.fixture(scope="module")
def head_dirs(checkpoints):
    return save_random_heads(checkpoints[0])


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        infer.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--preset", "--target", "--drafter", "--device", "--dtype", "--target-quantize", "--drafter-quantize",
                 "--strategy", "--gamma", "--max-new-tokens", "-n", "--temperature", "--top-k", "--top-p", "--seed",
                 "--system", "--no-chat", "--verbose", "--trust-remote-code", "--prompt", "--prompt-file", "--json",
                 "--alternatives", "--lookahead", "--draft-cumulative", "--verify-width", "--device-map",
                 "--max-memory", "--drafter-device-map", "--drafter-max-memory", "--offload-dir", "--export",
                 "--kernels"):
        assert f"{flag} " in text or f"{flag}," in text, flag
    for name in STRATEGIES:
        assert name in text


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "autoregressive,fast"], "unknown strategy 'fast'"),
    (["--strategy", ","], "--strategy needs at least one strategy"),
    (["--gamma", "0"], "--gamma must be an integer from 1 to 64, got 0"),
    # Bug: gamma had no upper bound (and an export wrote `num_speculative_tokens 100000`).
    (["--gamma", "100000"], "--gamma must be an integer from 1 to 64, got 100000"),
    (["-n", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--temperature", "0.7", "--top-p", "1.5"], "--top-p must be a number in (0, 1], got 1.5"),
    (["--json"], "--json needs --prompt or --prompt-file"),
    (["--alternatives", "-1"], "--alternatives must be an integer from 0 to 8, got -1"),
    (["--verify-width", "1"], "--verify-width must be an integer from 2 to 64, got 1"),
    (["--draft-cumulative", "1"], "--draft-cumulative must be a number in [0, 1), got 1.0"),
    (["--lookahead", "2", "1", "1"], "--lookahead N must be an integer from 2 to 8, got 1"),
    (["--num-beams", "0"], "--num-beams must be an integer from 1 to 64, got 0"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read --prompt-file /nonexistent/prompt.txt"),
    (["--prompt", "  "], "the prompt is empty"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert infer.main(argv) == infer.USAGE_EXIT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    # Bug: a window of 1 passed the command line's own check ("W >= 1") and the drafter refused it after loading.
    (["--lookahead", "1", "3", "1"], "--lookahead W must be an integer from 2 to 16, got 1"),
    # Bug: these were accepted silently (greedy ignores the filters, an empty list meant the default strategies)...
    (["--top-p", "2"], "--top-p must be a number in (0, 1], got 2.0"),
    (["--top-k", "-1"], "--top-k must be an integer >= 1, got -1"),
    (["--min-p", "0"], "--min-p must be a number in (0, 1], got 0.0"),
    (["--strategy", ""], "--strategy needs at least one strategy"),
    # ... or failed only once the models were loaded and the first prompt sampled.
    (["--temperature", "inf"], "--temperature must be a finite number >= 0.001 (use 0 for greedy), got inf"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0.001 (use 0 for greedy), got nan"),
    (["--temperature", "1e-45"], "--temperature must be a finite number >= 0.001 (use 0 for greedy), got 1e-45"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 9223372036854775807, got -1"),
    (["--seed", "18446744073709551616"], "--seed must be an integer from 0 to 9223372036854775807, got 1844"),
    # Bug: these exited 1, after importing torch, where every other bad flag exits 2.
    (["--dtype", "float8"], "Unknown dtype 'float8'; use one of: auto, float32, fp32, bfloat16"),
    (["--device", "gpu"], "Unknown device 'gpu'; use one of: auto, cpu, cuda, cuda:N, mps."),
    (["--device", "cuda:x"], "Unknown device 'cuda:x'"),
    (["--preset", "tiny"], "Unknown preset 'tiny'; valid presets: auto, embedded, llama-3.2."),
])
def test_bad_values_are_refused_before_loading(capsys, argv, message):
    assert infer.main(argv + ["--prompt", "hi"]) == infer.USAGE_EXIT
    err = capsys.readouterr().err
    assert err.startswith("infer.py: error: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, warning", [
    (["--top-k", "5"], "infer.py: warning: --top-k is ignored: --temperature 0 is greedy"),
    (["--top-p", "0.9", "--min-p", "0.1"],
     "infer.py: warning: --top-p, --min-p are ignored: --temperature 0 is greedy"),
    (["--temperature", "0.7", "--top-k", "5", "--min-p", "0.1"], "infer.py: warning: --top-k is ignored: --min-p "
                                                                  "replaces them"),
])
def test_sampling_flags_that_do_not_apply_are_named_on_stderr(capsys, argv, warning):
    """Bug: --top-k/--top-p/--min-p with temperature 0 (greedy) were ignored silently."""
    assert infer.main(argv + ["--prompt-file", "/nonexistent/prompt.txt"]) == infer.USAGE_EXIT
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == warning and lines[1].startswith("infer.py: error: cannot read --prompt-file")


def test_flags_that_apply_give_no_warning(capsys):
    assert infer.main(["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--prompt", " "]) == infer.USAGE_EXIT
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3", "--lookahead", "3", "4", "2",
     "--strategy", "lookahead,beam", "--dtype", "bfloat16", "--device", "cuda:1", "--preset", "embedded",
     "--prompt-file", "/nonexistent/prompt.txt"],  # every flag checked, then the missing file ends it
    ["--dtype", "float8", "--prompt", "hi"],
    ["--top-p", "2", "--prompt", "hi"],
], ids=["help", "checked-flags", "bad-dtype", "bad-top-p"])
def test_the_flag_path_imports_neither_torch_nor_transformers(argv):
    """--help and every flag check stay instant: importing torch takes seconds. (Bug: checking the flags built the
    chat's settings, which imported torch, before a bad flag was refused.)"""
    assert heavy_modules_imported("infer", argv) == []


def test_ctrl_c_while_the_imports_load_says_interrupted_and_exits_130(tmp_path):
    """Bug: a Ctrl-C in the first seconds after launch printed a KeyboardInterrupt traceback: the imports ran outside
    main's handler."""
    done = run_interrupted_while_importing("infer.py", tmp_path)
    assert (done.returncode, done.stderr, done.stdout) == (infer.INTERRUPTED_EXIT, "interrupted\n", "")


def test_the_history_file_follows_the_cache_directory(monkeypatch, tmp_path):
    """Bug: the REPL's history was always ~/.cache/specchat/history, whatever --cache-dir or XDG_CACHE_HOME said."""
    args = infer.build_parser().parse_args(["--cache-dir", str(tmp_path / "cache")])
    assert infer.history_file(args.cache_dir) == tmp_path / "cache" / "history"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert infer.history_file(None) == tmp_path / "xdg" / "specchat" / "history"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert infer.history_file(None) == tmp_path / "home" / ".cache" / "specchat" / "history"


def test_a_drafter_strategy_without_a_drafter_is_refused(capsys, checkpoints):
    target, _ = checkpoints
    argv = ["--target", str(target), "--strategy", "speculative", "--prompt", "hi", "--device", "cpu"]
    assert infer.main(argv) == infer.USAGE_EXIT
    assert "strategy 'speculative' needs a drafter" in capsys.readouterr().err


def test_a_model_load_error_exits_1_with_one_line_and_no_traceback(capsys, tmp_path):
    assert infer.main(["--target", str(tmp_path / "missing"), "--prompt", "hi", "--device", "cpu"]) == infer.LOAD_EXIT
    err = capsys.readouterr().err
    assert err.startswith("infer.py: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_default_strategies_drop_the_drafter_ones_without_a_drafter():
    assert infer.parse_strategies(None, has_drafter=False) == ("autoregressive",)
    assert infer.parse_strategies(None, has_drafter=True) == ("auto", "speculative", "autoregressive")


def test_preset_and_overrides():
    from models.presets import resolve_preset

    args = infer.build_parser().parse_args(["--preset", "embedded", "--drafter", "none", "--device", "cpu"])
    choice = model_choice(args, resolve_preset)
    assert (choice.target, choice.drafter, choice.device, choice.preset) == ("qwen2.5-coder-1.5b", None, "cpu",
                                                                             "embedded")
    args = infer.build_parser().parse_args(["--target", "a", "--target-quantize", "int8"])
    choice = model_choice(args, resolve_preset)
    assert (choice.target, choice.drafter, choice.target_quantize, choice.drafter_quantize) == ("a", None, "int8",
                                                                                               "none")


@pytest.mark.slow
def test_one_shot_json_prints_exactly_one_object(checkpoints, head_dirs):
    target, drafter = checkpoints
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--device", "cpu", "--prompt", "hi", "--json", "-n", "6", "--strategy", ",".join(STRATEGIES),
            "--system", "Be brief.", "--head", head_dirs[0], "--head", head_dirs[1]]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1
    out = json.loads(done.stdout)
    assert out["target"] == "target" and out["drafter"] == "drafter" and out["dtype"] == "float32"
    assert [r["strategy"] for r in out["results"]] == list(STRATEGIES)
    keys = {"strategy", "text", "token_ids", "new_tokens", "tokens_per_second", "acceptance_rate",
            "mean_tokens_per_round", "time_to_first_token_s"}
    by_name = {}
    for result in out["results"]:
        assert keys <= set(result)
        assert result["new_tokens"] == len(result["token_ids"]) and 1 <= result["new_tokens"] <= 6
        assert isinstance(result["text"], str) and result["tokens_per_second"] > 0
        assert result["time_to_first_token_s"] > 0
        by_name[result["strategy"]] = result
    assert by_name["autoregressive"]["acceptance_rate"] is None
    assert 0 <= by_name["speculative"]["acceptance_rate"] <= 1
    for lossless in ("speculative", "ngram", "lookup", "eagle", "medusa"):  # greedy: what autoregressive gives
        assert by_name[lossless]["token_ids"] == by_name["autoregressive"]["token_ids"]
        assert by_name[lossless]["lossless"] is True


@pytest.mark.slow
def test_head_strategies_need_a_head_and_say_how_to_get_one(checkpoints, head_dirs):
    target, _ = checkpoints
    base = [sys.executable, "infer.py", "--target", str(target), "--dtype", "float32", "--device", "cpu",
            "--prompt", "hi", "--json", "-n", "4"]
    done = subprocess.run(base + ["--strategy", "eagle,autoregressive"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "needs a trained eagle head; pass --head DIR" in done.stderr
    done = subprocess.run(base + ["--head", head_dirs[0], "--head", head_dirs[0]], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "two eagle heads given" in done.stderr
    # without --strategy the head strategies stay off (the defaults), and sampling takes --typical
    done = subprocess.run(base + ["--head", head_dirs[1], "--temperature", "0.8", "--seed", "1", "--typical"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)["results"]
    assert [r["strategy"] for r in results] == ["autoregressive"]
    done = subprocess.run(base + ["--head", head_dirs[1], "--temperature", "0.8", "--seed", "1", "--typical",
                                  "--strategy", "medusa"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["results"][0]["lossless"] is False  # typical acceptance while sampling


def test_drafting_flags_reach_the_strategy_settings():
    args = infer.build_parser().parse_args(["--alternatives", "2", "--lookahead", "3", "4", "2", "--gamma", "5",
                                            "--draft-cumulative", "0.4", "--verify-width", "9"])
    strategy = infer.check_flags(args).strategy
    assert (strategy.gamma, strategy.draft_alternatives, strategy.draft_cumulative) == (5, 2, 0.4)
    assert strategy.verify_width == 9
    assert (strategy.lookahead_window, strategy.lookahead_ngram, strategy.lookahead_candidates) == (3, 4, 2)


def test_verify_reaches_the_loader(monkeypatch):
    from models import loading
    from utils.errors import ModelLoadError

    seen = {}

    def load_pair(*args, **kwargs):
        seen.update(kwargs)
        raise ModelLoadError("stop here")

    monkeypatch.setattr(loading, "load_pair", load_pair)
    assert infer.main(["--target", "x", "--device", "cpu", "--verify", "-p", "hi"]) == infer.LOAD_EXIT
    assert seen["verify"] is True
    assert infer.main(["--target", "x", "--device", "cpu", "-p", "hi"]) == infer.LOAD_EXIT
    assert seen["verify"] is False


@pytest.mark.slow
@pytest.mark.parametrize("stdin_encoding", [None, "utf-8:strict"], ids=["surrogateescape", "strict"])
def test_invalid_utf8_on_stdin_is_replaced_with_a_notice_and_the_chat_goes_on(checkpoints, stdin_encoding):
    """Bug: `printf 'caf\\xe9 \\xff\\nhi\\n' | infer.py` ended in a tokenizer TypeError (or, with a strict stdin, a
    UnicodeDecodeError), rc 1: the session and the rest of the input lost."""
    target, drafter = checkpoints
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    env.pop("PYTHONIOENCODING", None)
    if stdin_encoding:
        env["PYTHONIOENCODING"] = stdin_encoding
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--device", "cpu", "-n", "3", "--strategy", "autoregressive", "--no-calibrate"]
    done = subprocess.run(argv, cwd=REPO, env=env, input=b"caf\xe9 \xff\nhi\n/history\n", capture_output=True,
                          timeout=120)
    out, err = done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0 and "Traceback" not in err, err
    assert out.count("invalid UTF-8") == 1 and "the line had 2 invalid UTF-8 bytes: replaced by \ufffd" in out
    assert "user caf\ufffd \ufffd" in out and "user hi" in out  # both turns answered, in the history


def test_invalid_utf8_in_the_prompt_flags_is_replaced_with_a_notice(capsys, monkeypatch):
    """Bug: `-p $'caf\\xe9 \\xff'` (the command line hands undecodable bytes over as surrogates) crashed in the
    tokenizer."""
    seen = {}

    def run(args, chosen, console, errors, prompt, one_shot, json_out):
        seen.update(prompt=prompt, system=args.system)
        return 0

    monkeypatch.setattr(infer, "run", run)
    assert infer.main(["-p", "caf\udce9 \udcff", "--system", "\udce9t\u00e9"]) == 0
    assert seen == {"prompt": "caf\ufffd \ufffd", "system": "\ufffdt\u00e9"}
    err = capsys.readouterr().err.splitlines()
    assert err == ["infer.py: warning: --prompt had 2 invalid UTF-8 bytes: replaced by \ufffd (send UTF-8 text)",
                   "infer.py: warning: --system had 1 invalid UTF-8 byte: replaced by \ufffd (send UTF-8 text)"]


class Loaded(Exception):
    """Raised in place of loading the models: what a test's flags reached."""


def test_the_drafter_strategy_with_a_drafter_of_another_tokenizer_is_refused_before_loading(
        capsys, monkeypatch, checkpoints, tmp_path):
    """Bug: `--preset embedded --drafter smollm2-135m --strategy drafter` loaded both models (45 s) and then ended in
    a ValueError traceback: the tokenizers, read from their files in a second, already tell."""
    from app.engine import Engine
    from tests.helpers import save_tiny_checkpoint, word_tokenizer

    def load(*_args, **_kwargs):
        raise Loaded

    monkeypatch.setattr(Engine, "load", load)
    target, same_tokenizer = checkpoints
    other = save_tiny_checkpoint(tmp_path / "other", layers=1, hidden=16, tokenizer=word_tokenizer())
    capsys.readouterr()  # the save's progress bars
    argv = ["--target", str(target), "--strategy", "autoregressive,drafter", "--prompt", "hi", "--device", "cpu",
            "--cache-dir", str(tmp_path / "cache")]
    assert infer.main([*argv, "--drafter", str(other)]) == infer.USAGE_EXIT
    err = capsys.readouterr().err
    assert err.startswith("infer.py: error: strategy 'drafter' runs the drafter on the target's tokens, and this "
                          "drafter has another tokenizer") and err.count("\n") == 1
    with pytest.raises(Loaded):  # the same tokenizer: on to loading
        infer.main([*argv, "--drafter", str(same_tokenizer)])
    with pytest.raises(Loaded):  # another tokenizer without the drafter strategy: drafts text, on to loading
        infer.main([*argv[:2], "--strategy", "speculative", *argv[4:], "--drafter", str(other)])
