"""Prompt-set loading: the shared MT-bench file and the project's own set."""

import json
from pathlib import Path

import pytest

from app.text import chat_ids
from benchmarks.names import DEFAULT_PROMPTS
from utils.prompts import count_by_category, load_prompts

SHARED = Path(__file__).resolve().parents[2] / "shared" / "bench"


@pytest.mark.skipif(not (SHARED / "mt_bench.jsonl").is_file(), reason="the shared prompt sets are not beside the repo")
def test_mt_bench():
    prompts = load_prompts(SHARED / "mt_bench.jsonl")
    assert len(prompts) == 80
    assert count_by_category(prompts) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                                           "extraction", "stem", "humanities")}
    assert all(len(p.turns) == 2 for p in prompts)
    assert prompts[0].id == "81"


def test_own_prompt_set():
    prompts = load_prompts(DEFAULT_PROMPTS)
    counts = count_by_category(prompts)
    assert counts == {c: 5 for c in ("chat", "code", "math", "summarization", "qa", "translation")}
    assert all(len(p.turns) >= 2 for p in prompts if p.category == "chat")  # multi-turn chat
    assert all(len(p.turns[0]) > 600 for p in prompts if p.category in ("summarization", "qa"))  # passage included
    assert len({p.id for p in prompts}) == len(prompts)


def test_limit_is_per_category_and_categories_filter():
    prompts = load_prompts(DEFAULT_PROMPTS, categories=["code", "math"], limit=2)
    assert count_by_category(prompts) == {"code": 2, "math": 2}
    with pytest.raises(ValueError, match="no prompts of categories nope"):
        load_prompts(DEFAULT_PROMPTS, categories=["nope"])
    with pytest.raises(ValueError, match="limit"):
        load_prompts(DEFAULT_PROMPTS, limit=0)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"category": "x", "turns": []}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        load_prompts(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_prompts(bad)


def test_chat_ids_are_plain_ids(tmp_path):
    from tests.helpers import build_tokenizer

    tokenizer = build_tokenizer()
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Hello!"}])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
