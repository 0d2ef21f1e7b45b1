"""The draft model's draft vocabulary: its output layer read for the most frequent tokens only, the logits put back
over the whole vocabulary; speculative decoding stays lossless, and the calibration takes a size only where it pays."""

import argparse
import gzip
import json

import pytest
import torch

import kernels
from app.calibration import Calibration, choose, time_vocabulary, vocabulary_choice
from app.flags import draft_vocabulary_size
from models.draft_vocabulary import DraftVocabulary, answer_tokens, coverage, ranking, restricted
from models.formats import blocks
from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.heads.networks import shipped_answers
from sampling.speculative import Speculative
from tests.distribution import FALSE_ALARM, chi_square_test, exact_sequence_distribution
from tests.helpers import noisy_copy, tiny_engine, tiny_model
from utils.logits_processor import MultinomialProcessor
from utils.runner import CachedModel


def vocabulary_of(model, keep: list[int]) -> DraftVocabulary:
    """A draft vocabulary ranking `keep` first (in that order), the rest after by id."""
    return DraftVocabulary(model, ranking([keep * 3, keep[: len(keep) // 2]], model.config.vocab_size), {})


def test_ranking_puts_the_answers_tokens_first_by_count_then_the_rest_by_id():
    ranked = ranking([[5, 7, 7, 9], [7, 9, 2], [42]], 10)  # 42 lies outside the vocabulary: not counted
    assert ranked.tolist() == [7, 9, 2, 5, 0, 1, 3, 4, 6, 8]


def test_coverage_is_held_out_ranked_on_every_other_answer_counted_on_the_rest():
    answers = [[1, 1, 2], [1, 3], [2, 2], [3, 4]]  # ranked on [1, 1, 2] + [2, 2]: 2, 1, then 0, 3, 4 ...
    assert coverage(answers, 6, sizes=(1, 2, 4)) == {1: 0.0, 2: 0.25, 4: 0.75}  # held out: 1, 3, 3, 4
    assert coverage([[1]], 6, sizes=(2,)) == {}  # nothing held out: no estimate


def test_answers_are_read_without_their_prompts_and_a_bad_file_is_named(tmp_path):
    path = tmp_path / "answers.jsonl.gz"
    with gzip.open(path, "wt") as file:
        file.write(json.dumps({"prompt": "p", "start": 2, "ids": [9, 9, 4, 5]}) + "\n\n")
        file.write(json.dumps({"start": 1, "ids": [9, 6]}) + "\n")
    assert answer_tokens(path) == [[4, 5], [6]]
    with gzip.open(path, "wt") as file:
        file.write(json.dumps({"start": 1, "ids": [9, 6]}) + "\n" + json.dumps({"ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match=r"answers.jsonl.gz:2: not an answers file \(KeyError"):
        answer_tokens(path)
    (tmp_path / "plain.txt").write_text("not gzip")
    with pytest.raises(ValueError, match="plain.txt: not an answers file"):
        answer_tokens(tmp_path / "plain.txt")


def test_a_restricted_output_layer_keeps_the_whole_layers_logits_on_its_tokens_and_only_there():
    model = tiny_model(vocab_size=41, seed=3)
    ids = torch.tensor([[3, 17, 5, 29]])
    whole_logits, whole = model(input_ids=ids).logits, model.get_output_embeddings()
    vocabulary = vocabulary_of(model, [17, 4, 30, 2, 11])
    vocabulary.use(5)
    logits = model(input_ids=ids).logits
    kept = torch.tensor([2, 4, 11, 17, 30])
    assert logits.shape == whole_logits.shape and model.get_output_embeddings().out_features == 41
    # a dense product over fewer rows may round its last bits otherwise: a drafter's logits only move acceptance
    torch.testing.assert_close(logits[..., kept], whole_logits[..., kept], rtol=1e-12, atol=1e-12)
    outside = torch.ones(41, dtype=torch.bool)
    outside[kept] = False
    assert torch.all(logits[..., outside] == float("-inf"))
    assert "5 of 41 tokens" in vocabulary.describe()
    vocabulary.use(0)
    assert model.get_output_embeddings() is whole and torch.equal(model(input_ids=ids).logits, whole_logits)
    with pytest.raises(ValueError, match="takes 1 to 40 tokens"):
        vocabulary.use(41)


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
def test_a_block_output_layer_keeps_the_bytes_of_its_rows():
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(256, 64, generator=generator)
    layer = blocks.BlockLinear(kernels.quantize(weights, "Q4_0"), "Q4_0", 64, torch.randn(256, generator=generator))
    ids = torch.tensor([0, 3, 64, 65, 200, 255])
    rows = restricted(layer, ids)
    assert isinstance(rows, blocks.BlockLinear) and rows.block_type == "Q4_0"
    assert torch.equal(rows.dequantized(), layer.dequantized()[ids]) and torch.equal(rows.bias, layer.bias[ids])
    x = torch.randn(3, 64, generator=generator)
    assert torch.equal(rows(x), layer(x)[:, ids])  # each row's result is its own, whatever rows lie beside it


def test_greedy_speculative_with_a_draft_vocabulary_equals_autoregressive_and_its_misses_end_drafts():
    engine = tiny_engine()
    vocabulary = vocabulary_of(engine.drafter.model, list(range(0, 320, 3)))  # a third of the tokens
    engine.vocabulary = vocabulary
    expected = engine.generate("a b c", "autoregressive", max_new_tokens=40)
    assert engine.draft_vocabulary == 0
    engine.use_vocabulary(107)
    assert "draft vocabulary 107" in engine.info.drafter_format and engine.draft_vocabulary == 107
    got = engine.generate("a b c", "speculative", max_new_tokens=40, gamma=4)
    assert got.token_ids == expected.token_ids
    outside = [t for t in expected.token_ids if t % 3]
    assert outside, "the target says tokens outside the draft vocabulary"
    assert got.stats.accepted < got.stats.drafted  # those were drafted wrong: rounds ended there
    engine.use_vocabulary(0)
    assert "draft vocabulary" not in engine.info.drafter_format


def test_a_draft_vocabulary_is_refused_where_the_drafter_has_none():
    engine = tiny_engine()
    with pytest.raises(ValueError, match="no draft vocabulary"):
        engine.use_vocabulary(100)


@pytest.mark.slow
def test_speculative_sampling_from_a_draft_vocabulary_follows_the_target_distribution():
    vocab, prompt, length = 6, [1, 4, 2], 3
    target = tiny_model(vocab_size=vocab, seed=11, layers=1, hidden=16)
    drafter = noisy_copy(target)
    vocabulary_of(drafter, [0, 2, 3]).use(3)  # tokens 1, 4 and 5 never drafted
    processor = MultinomialProcessor(temperature=1.3)
    strategy = Speculative(CachedModel(target), ModelDrafter(CachedModel(drafter), vocab), gamma=2)
    samples = [tuple(strategy.generate(prompt, DecodeConfig(max_new_tokens=length, processor=processor,
                                                            seed=i)).token_ids) for i in range(1500)]
    stat, critical = chi_square_test(samples, exact_sequence_distribution(target, prompt, length, processor))
    assert stat <= critical, f"chi-square {stat:.1f} > {critical:.1f} (false alarm {FALSE_ALARM})"


def calibration(vocab_ms: dict[int, float]) -> Calibration:
    target_ms = {1: 50.0, 2: 55.0, 4: 62.0, 6: 70.0, 8: 80.0, 12: 100.0, 16: 120.0}
    return Calibration({}, target_ms, 20.0, 128, 1.0, "2026-12-06", vocab_ms)


def test_the_calibration_takes_a_draft_vocabulary_only_where_its_cheaper_step_outweighs_its_misses():
    cheap = calibration({0: 30.0, 8192: 22.0, 16384: 23.5, 32768: 26.0})  # eager: the milliseconds saved count
    assert cheap.vocabulary_cost(8192) == pytest.approx((20 - 8) / 50)
    assert calibration({0: 30.0, 8192: 5.0}).vocabulary_cost(8192) == pytest.approx(2 / 50)  # a tenth at least
    size, why = vocabulary_choice(cheap, {8192: 0.99, 16384: 0.995, 32768: 0.999})
    assert size == 8192 and why.startswith("draft vocabulary 8192 tokens: c = 0.24, 99% of held-out")
    chosen = choose(cheap, coverage={8192: 0.99, 16384: 0.995, 32768: 0.999})
    assert chosen.draft_vocabulary == 8192 and any(r.startswith("draft vocabulary 8192") for r in chosen.reasons)
    assert chosen.settings.draft_cumulative < choose(cheap).settings.draft_cumulative  # a cheaper step: drafts on

    missing = {8192: 0.6, 16384: 0.7, 32768: 0.8}  # too many of the target's tokens left out
    size, why = vocabulary_choice(cheap, missing)
    assert size == 0 and why.startswith("draft vocabulary: the whole") and "does not pay" in why
    assert choose(cheap, coverage=missing).draft_vocabulary == 0
    assert vocabulary_choice(calibration({}), missing) == (0, None)  # not timed: nothing to weigh
    assert choose(cheap).draft_vocabulary == 0


def test_a_kept_calibration_keeps_its_draft_vocabulary_timings():
    kept = calibration({0: 30.0, 8192: 18.0})
    again = Calibration.from_dict(json.loads(json.dumps(kept.as_dict())))
    assert again == kept
    old = {k: v for k, v in kept.as_dict().items() if k != "drafter_vocab_ms"}  # written before they were timed
    assert Calibration.from_dict(old).drafter_vocab_ms == {}
    with pytest.raises(ValueError, match="drafter_vocab_ms"):
        Calibration.from_dict({**kept.as_dict(), "drafter_vocab_ms": {"8192": -1.0}})


def test_the_draft_vocabulary_timings_leave_the_output_layer_and_the_step_graph_as_they_were():
    model = tiny_model(vocab_size=9000, seed=2, hidden=16, layers=1, dtype=torch.float32)
    vocabulary = DraftVocabulary(model, ranking([[1, 2, 3]], 9000), {8192: 0.9})
    drafter = CachedModel(model)
    marker = object()
    drafter.step_model = marker
    vocabulary.use(8192)
    timed = time_vocabulary(drafter, vocabulary, list(range(20)), [7], repeats=2)
    assert sorted(timed) == [0, 8192] and all(ms > 0 for ms in timed.values())
    assert vocabulary.size == 8192 and drafter.step_model is marker


def test_the_embedded_target_ships_answers_to_count_a_draft_vocabulary_on():
    path = shipped_answers("qwen2.5-coder-1.5b")
    assert path is not None and len(answer_tokens(path)) > 500
    assert shipped_answers("no-such-target") is None


def test_the_draft_vocabulary_flag_takes_a_count_of_tokens():
    assert draft_vocabulary_size("16384") == 16384 and draft_vocabulary_size("0") == 0
    for bad in ("-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="number of tokens"):
            draft_vocabulary_size(bad)
