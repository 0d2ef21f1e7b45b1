"""The example drafter of docs/design.md ("Add your own drafter") runs through the one speculative loop and keeps
greedy output identical to autoregressive output, token for token (float64, a tiny model)."""

import pytest

from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig, Result
from sampling.drafters.phrases import PhraseDrafter, matching_tail
from sampling.speculative import Speculative
from tests.helpers import REPO
from utils.runner import CachedModel

PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
MAX_NEW = 40


@pytest.fixture(scope="module")
def reference(target_model) -> list[int]:
    return Autoregressive(CachedModel(target_model)).generate(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW)).token_ids


def phrases_for(answer: list[int]) -> list[list[int]]:
    """Two stretches of the answer the target gives (their drafts are accepted) and one that leaves it after three
    tokens (its draft is rejected where it is the longest match)."""
    wrong = [(t + 1) % 97 for t in answer[26:34]]
    return [PROMPT[-3:] + answer[:12], answer[14:24], answer[22:26] + wrong]


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("stop", ["none", "end"])
def test_the_phrase_drafter_keeps_greedy_output_identical_through_the_one_loop(target_model, reference, gamma, stop):
    end_ids = (reference[30],) if stop == "end" else ()
    config = DecodeConfig(max_new_tokens=MAX_NEW, end_ids=end_ids)
    expected = Autoregressive(CachedModel(target_model)).generate(PROMPT, config).token_ids
    speculative = Speculative(CachedModel(target_model), PhraseDrafter(phrases_for(reference)), gamma, name="phrases")
    result = speculative.generate(PROMPT, config)
    assert result.token_ids == expected
    assert result.stats.accepted > 0  # its drafts were used, not only proposed


def test_a_phrase_that_leaves_the_answer_is_rejected_and_the_output_stays_the_targets(target_model, reference):
    leaving = phrases_for(reference)[2]  # four tokens of the answer, then eight it does not give
    speculative = Speculative(CachedModel(target_model), PhraseDrafter([leaving]), 8)
    rounds = list(speculative.stream(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW)))
    assert Result.from_rounds(rounds).token_ids == reference
    drafting = [r for r in rounds if r.drafted]
    # kept up to the token where the phrase leaves the answer, not one further
    assert drafting and all(r.drafted[r.accepted:r.accepted + 1] == leaving[4:5] for r in drafting)


def test_the_longest_match_picks_the_phrase_and_nothing_matching_drafts_nothing():
    drafter = PhraseDrafter([[1, 2, 3, 4, 5], [9, 2, 3, 7, 8]], min_match=2)
    assert drafter.propose([0, 1, 2, 3], 4, None, None).tokens == [4, 5]  # 1 2 3: three tokens against two
    assert drafter.propose([0, 9, 2, 3], 1, None, None).tokens == [7]  # cut to k
    assert drafter.propose([0, 5, 3], 4, None, None).tokens == []  # one token matches: under min_match
    assert matching_tail([1, 2, 3], [7, 2, 3]) == 2 and matching_tail([], [1]) == 0
    with pytest.raises(ValueError, match="min_match"):
        PhraseDrafter([[1, 2]], min_match=0)


def test_the_excerpt_in_docs_design_is_the_drafters_code():
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = design[design.index("## Add your own drafter"):]
    excerpt = section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))]
    source = (REPO / "sampling" / "drafters" / "phrases.py").read_text(encoding="utf-8")
    assert [line for line in excerpt.splitlines() if line.strip() and "def propose" not in line
            and line not in source] == []
