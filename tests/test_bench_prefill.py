"""The prefill benchmark's logic on a tiny model: what it times, how it skips llama.cpp, what it prints."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.prefill import llamacpp_prompt_seconds, measure, table, time_prefill
from tests.helpers import tiny_model
from utils.runner import CachedModel


def test_a_prefill_is_timed_from_an_empty_cache_and_leaves_it_empty():
    lm = CachedModel(tiny_model())
    lm.forward([1, 2, 3])  # what an earlier run left
    assert time_prefill(lm, list(range(5, 40))) > 0
    assert lm.tokens == []
    with torch.inference_mode():
        expected = CachedModel(tiny_model()).forward(list(range(5, 40)), logits_rows=1)
        assert torch.equal(lm.forward(list(range(5, 40)), logits_rows=1), expected)  # the timed forward: a whole prompt


def test_llama_cpp_is_skipped_where_it_is_not_built_and_its_lengths_left_blank(tmp_path: Path):
    assert llamacpp_prompt_seconds(tmp_path / "model.gguf", 2, tmp_path / "llama-completion", "hi") is None
    lm = CachedModel(tiny_model())
    ids = list(range(3, 60))
    asked: list[int] = []

    def llamacpp(prompt: list[int]) -> float | None:
        asked.append(len(prompt))
        return None if len(prompt) == 48 else len(prompt) / 100

    seconds = measure(lm, ids, [16, 48], repeats=2, llamacpp=llamacpp)
    assert asked == [16, 48, 16, 48]  # interleaved with the target, each length in turn
    assert set(seconds["target"]) == {16, 48} and seconds["llama.cpp"] == {16: 0.16}
    text = table(seconds, [16, 48])
    assert text.splitlines()[0] == "| prompt tokens | 16 | 48 |"
    assert text.splitlines()[-1] == "| llama.cpp | 0.16 | – |"
    assert "llama.cpp" not in table(measure(lm, ids, [16], repeats=1, llamacpp=None), [16])
