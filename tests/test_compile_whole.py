"""The target's whole forward compiled (`CachedModel.compile_whole`): one graph for every forward, taken between
turns, refused where a verify's rows would round otherwise than the one-token steps."""

from __future__ import annotations

import pytest
import torch

import kernels
from models import invariance
from models.formats import blocks
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.heads.eagle import EagleDrafter
from sampling.speculative import Speculative
from tests.helpers import random_head, tiny_model
from tests.test_blocks import PROMPT, block_model
from utils.runner import CachedModel


class RowDependent(torch.nn.Module):
    """A stand-in for a compiled graph whose rows' logits move with the number of rows fed."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, **kwargs):
        out = self.model(input_ids=input_ids, **kwargs)
        out.logits = out.logits + 1e-3 * input_ids.shape[1]
        return out


def test_a_graph_whose_rows_round_with_their_number_is_refused_and_nothing_changes(monkeypatch):
    target = CachedModel(tiny_model(dtype=torch.float32))
    monkeypatch.setattr("torch.compile", lambda model, **kwargs: RowDependent(model))
    with pytest.raises(ValueError, match="rounds a verify's rows otherwise than its one-token steps"):
        target.compile_whole()
    assert not target.adopt_compiled() and target.whole_model is None


def test_an_eager_forward_makes_its_own_room_while_another_thread_is_compiling(monkeypatch):
    """A compile held at a pause mid-trace makes torch.compiler.is_compiling() True on every thread."""
    model = tiny_model(dtype=torch.float32)
    expected = CachedModel(model)
    wanted = [expected.forward(list(range(3, 9))), expected.forward([4]), expected.forward([5, 6])]
    monkeypatch.setattr("torch.compiler.is_compiling", lambda: True)
    lm = CachedModel(model)
    got = [lm.forward(list(range(3, 9))), lm.forward([4]), lm.forward([5, 6])]
    assert all(torch.equal(a, b) for a, b in zip(got, wanted, strict=True))
    assert lm.cache.get_seq_length() == 9


def test_a_model_with_a_prefill_form_is_not_compiled_whole():
    model = tiny_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="prefill form"):
        CachedModel(model, prefill_model=model).compile_whole()


@pytest.mark.slow
@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
def test_on_the_blocks_the_compiled_forward_runs_every_forward_after_adoption_and_speculative_equals_it():
    target = CachedModel(block_model())
    assert invariance.probe(target).exact
    config = DecodeConfig(max_new_tokens=24)
    target.compile_whole()
    assert target.whole_model is None  # ready, not taken: a turn under way keeps its graph
    assert target.adopt_compiled()
    graph, calls = target.whole_model, []

    def counted(**kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return graph(**kwargs)

    target.whole_model = counted
    reference = Autoregressive(target).generate(PROMPT, config).token_ids
    assert calls[0] == len(PROMPT) and set(calls[1:]) == {target.min_rows}  # the prompt, then the steps
    drafter = CachedModel(block_model(seed=5))
    for draft in (CachedModel(target.model), drafter):  # all accepted, mostly rejected; chains and trees
        calls.clear()
        result = Speculative(target, ModelDrafter(draft, target.vocab_size, alternatives=2, max_tree=6), 5).generate(
            PROMPT, config)
        assert result.token_ids == reference and max(calls) > 1
    calls.clear()  # a draft head reads its features from the same graph
    eagle = Speculative(target, EagleDrafter(target, random_head(target.model, "eagle"), 3, 9), 4, name="eagle")
    result = eagle.generate(PROMPT, config)
    assert result.token_ids == reference and result.stats.drafted > 0 and max(calls) > 1
    fresh = CachedModel(target.model)
    fresh.whole_model, fresh.min_rows = graph, target.min_rows
    fresh.keep_hidden()
    fresh.forward(target.tokens)  # a graph's row does not depend on the rows fed with it, nor on rows moved after
    assert torch.equal(fresh.hidden, target.hidden)


def test_models_of_one_class_compiled_in_one_process_each_run_their_own_graph():
    """Graphs are cached per code object, shared by every model of a class; the guards (their fast path over the
    modules' dict tags too) must tell the models apart, blocks of other types and sizes in the same places included:
    each compiled forward gives its own model's logits."""
    models = [block_model(seed=0), block_model(seed=5)]
    lms = [CachedModel(model) for model in models]
    for lm in lms:
        assert invariance.probe(lm).exact
        lm.compile_whole()
        assert lm.adopt_compiled()
    for _ in range(2):  # every model after every other has run its graph
        for model, lm in zip(models, lms, strict=True):
            lm.reset()
            lm.forward(PROMPT[:5])
            with torch.no_grad():
                eager = model(input_ids=torch.tensor([PROMPT[:6]])).logits[0, -1]
            torch.testing.assert_close(lm.forward(PROMPT[5:6])[0], eager, rtol=1e-4, atol=1e-4)


def test_joined_siblings_compile_whole_rounding_a_verify_as_the_steps_and_speculative_equals_autoregressive():
    """Linears joined into one kernel call (`blocks.join_siblings`) hand their later siblings' outputs on through the
    modules' state: the graph keeps that, passes its own check (steps, a verify and a tree bit for bit), computes what
    the model does eagerly, and greedy speculative output equals autoregressive on it."""
    model = block_model(siblings=True)
    assert blocks.join_siblings(model) == 3
    target = CachedModel(model)
    assert invariance.probe(target).exact
    target.compile_whole()
    assert target.adopt_compiled()
    target.forward(PROMPT[:5])
    with torch.no_grad():
        eager = model(input_ids=torch.tensor([PROMPT[:6]])).logits[0, -1]
    torch.testing.assert_close(target.forward(PROMPT[5:6])[0], eager, rtol=1e-4, atol=1e-4)
    group = model.model.layers[0].self_attn.q_proj.group
    assert group.input is None and group.outputs == {}  # the graph's writes back leave nothing held
    config = DecodeConfig(max_new_tokens=24)
    reference = Autoregressive(target).generate(PROMPT, config).token_ids
    drafter = ModelDrafter(CachedModel(block_model(seed=5)), target.vocab_size, alternatives=2, max_tree=6)
    assert Speculative(target, drafter, 5).generate(PROMPT, config).token_ids == reference
