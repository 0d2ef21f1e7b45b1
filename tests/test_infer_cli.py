"""infer.py: --help, bad input (one line, non-zero exit), and the one-shot JSON schema in a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import infer
from sampling.registry import STRATEGIES
from tests.tiny_checkpoint import save_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("infer_cli")
    return (save_tiny_checkpoint(root / "target", seed=0),
            save_tiny_checkpoint(root / "drafter", seed=1, layers=1, hidden=16))


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        infer.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--preset", "--target", "--drafter", "--device", "--dtype", "--target-quantize", "--drafter-quantize",
                 "--strategy", "--gamma", "--max-new-tokens", "-n", "--temperature", "--top-k", "--top-p", "--seed",
                 "--system", "--no-chat", "--verbose", "--trust-remote-code", "--prompt", "--prompt-file", "--json",
                 "--alternatives", "--lookahead", "--draft-cumulative", "--verify-width"):
        assert f"{flag} " in text or f"{flag}," in text, flag
    for name in STRATEGIES:
        assert name in text


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "autoregressive,fast"], "unknown strategy 'fast'"),
    (["--strategy", ","], "--strategy needs at least one strategy"),
    (["--gamma", "0"], "--gamma must be >= 1, got 0"),
    (["-n", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "0.7", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--json"], "--json needs --prompt or --prompt-file"),
    (["--alternatives", "-1"], "--alternatives must be >= 0, got -1"),
    (["--verify-width", "1"], "--verify-width must be >= 2 (the last token and one draft), got 1"),
    (["--draft-cumulative", "1"], "--draft-cumulative must be in [0, 1), got 1.0"),
    (["--lookahead", "2", "1", "1"], "--lookahead W N G needs W >= 1, N >= 2, G >= 1, got 2 1 1"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read --prompt-file /nonexistent/prompt.txt"),
    (["--prompt", "  "], "the prompt is empty"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert infer.main(argv) == infer.USAGE_EXIT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1


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


def test_preset_and_overrides(monkeypatch):
    from utils.presets import resolve_preset

    args = infer.build_parser().parse_args(["--preset", "embedded", "--drafter", "none", "--device", "cpu"])
    choice = infer.choose_models(args, resolve_preset)
    assert (choice.target, choice.drafter, choice.device) == ("qwen2.5-coder-1.5b", None, "cpu")
    args = infer.build_parser().parse_args(["--target", "a", "--target-quantize", "int8"])
    choice = infer.choose_models(args, resolve_preset)
    assert (choice.target, choice.drafter, choice.target_quantize, choice.drafter_quantize) == ("a", None, "int8",
                                                                                               "none")


def test_one_shot_json_prints_exactly_one_object(checkpoints):
    target, drafter = checkpoints
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--device", "cpu", "--prompt", "hi", "--json", "-n", "6", "--strategy", ",".join(STRATEGIES),
            "--system", "Be brief."]
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
    for lossless in ("speculative", "ngram", "lookup"):  # greedy: token for token what autoregressive gives
        assert by_name[lossless]["token_ids"] == by_name["autoregressive"]["token_ids"]


def test_quantize_choices_match_the_loader():
    from utils.presets import QUANTIZE_CHOICES
    assert infer.QUANTIZE == QUANTIZE_CHOICES


def test_drafting_flags_reach_the_strategy_settings():
    args = infer.build_parser().parse_args(["--alternatives", "2", "--lookahead", "3", "4", "2", "--gamma", "5",
                                            "--draft-cumulative", "0.4", "--verify-width", "9"])
    strategy = infer.make_settings(args, ("speculative",)).strategy
    assert (strategy.gamma, strategy.draft_alternatives, strategy.draft_cumulative) == (5, 2, 0.4)
    assert strategy.verify_width == 9
    assert (strategy.lookahead_window, strategy.lookahead_ngram, strategy.lookahead_candidates) == (3, 4, 2)
