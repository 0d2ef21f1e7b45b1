"""The chat session on a real model and its real chat template: SmolLM2-135M-Instruct, multi-turn with a system
prompt, as both target and drafter (so every draft is accepted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine import Engine
from chat.session import ChatSession, ChatSettings, Message
from chat.turn import View, run_turn
from models.loading import load_pair
from utils.caching import common_prefix_length
from utils.errors import ModelLoadError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(model_cache_dir):
    try:
        return load_pair("smollm2-135m", "smollm2-135m", device="cpu", dtype="float32", cache_dir=model_cache_dir,
                         progress=False)
    except ModelLoadError as error:
        pytest.skip(f"SmolLM2 is not available: {error}")


def test_the_conversion_goes_into_the_test_cache(smollm2, model_cache_dir):
    # bug: this file converted SmolLM2 into the user's real cache (~/.cache/specchat), 269 MB
    assert Path(smollm2.target.source).is_relative_to(model_cache_dir)


def test_multi_turn_chat_with_a_system_prompt(smollm2):
    settings = ChatSettings(strategies=("speculative", "autoregressive"), max_new_tokens=12,
                            system="You are a geography teacher. Answer in one short sentence.")
    session = ChatSession(Engine.from_pair(smollm2), settings)
    first = run_turn(session, "What is the capital of France?", View())
    prompt_text = smollm2.target.tokenizer.decode(first.plan.ids)
    assert prompt_text.startswith("<|im_start|>system\nYou are a geography teacher.")
    assert prompt_text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert "Paris" in first.answer
    speculative, autoregressive = first.runs
    assert speculative.token_ids == autoregressive.token_ids  # greedy and lossless
    assert speculative.stats.acceptance_rate == 1.0  # the drafter is the target
    assert speculative.finished and first.answer == session.decode(speculative.token_ids[:-1])

    cached = list(session.target.tokens)
    second = run_turn(session, "And of Italy?", View(), strategies=("autoregressive",))
    # The real template re-renders the first answer exactly as generated: the cache covers it all.
    assert second.plan.reused == common_prefix_length(cached, second.plan.ids)
    assert second.plan.reused >= len(first.plan.ids) + len(speculative.token_ids) - 1
    assert "Rome" in second.answer
    assert session.history == [Message("user", "What is the capital of France?"), Message("assistant", first.answer),
                               Message("user", "And of Italy?"), Message("assistant", second.answer)]
