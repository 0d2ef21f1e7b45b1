"""Lookahead decoding: greedy equivalence, the tree's attention mask and positions, the cache invariant, the
multi-candidate verification rules and losslessness under sampling."""

import pytest
import torch

from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.base import Draft
from sampling.drafters.lookahead import LookaheadDrafter
from sampling.drafters.ngram import NGramStore
from sampling.registry import build_strategy
from sampling.settings import STRATEGIES, StrategySettings
from sampling.speculative import Speculative
from sampling.verify import accept_stochastic, accept_tree_greedy, accept_tree_stochastic
from tests.distribution import FALSE_ALARM, chi_square_test, exact_sequence_distribution
from tests.helpers import tiny_model
from utils.caching import tree_attention
from utils.logits_processor import GreedyProcessor, MultinomialProcessor, TopKProcessor
from utils.runner import CachedModel

PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]  # repetitive: the pool has something to offer
MAX_NEW = 40
DEFAULT = (StrategySettings.lookahead_window, StrategySettings.lookahead_ngram, StrategySettings.lookahead_candidates)
SHAPES = [DEFAULT, (3, 3, 2), (4, 4, 3), (2, 2, 1), (5, 3, 0), (3, 5, 4)]  # (W, N, G)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run several times faster on one thread, the more so on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(target_model):
    """Greedy autoregressive output, and the same cut at an end token that occurs in its middle."""
    tokens = Autoregressive(CachedModel(target_model)).generate(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW)).token_ids
    end_at = next(i for i in range(12, MAX_NEW) if tokens[i] not in tokens[:i])
    return {"none": (tokens, ()), "end": (tokens[: end_at + 1], (tokens[end_at],))}


def lookahead(model, shape, **kwargs) -> Speculative:
    window, ngram, candidates = shape
    return Speculative(CachedModel(model), LookaheadDrafter(window, ngram, candidates, **kwargs), ngram - 1,
                       name="lookahead")


# Greedy equivalence and the cache invariant.

@pytest.mark.parametrize("stop", ["none", "end"])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_lookahead_equals_greedy_autoregressive(target_model, reference, shape, stop):
    """Token for token, over many rounds; after each round the target's cache holds every committed token but the
    last, at their own positions (accepted tree rows were moved there), and nothing else."""
    expected, end_ids = reference[stop]
    strategy = lookahead(target_model, shape)
    ids, rounds = list(PROMPT), []
    for r in strategy.stream(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW, end_ids=end_ids)):
        ids += r.tokens
        rounds.append(r)
        assert strategy.target.tokens == ids[:-1]
        assert strategy.target.cache.get_seq_length() == len(ids) - 1
    assert ids[len(PROMPT):] == expected
    assert rounds[-1].finished == (stop == "end")
    assert len(rounds) < len(expected)  # drafts were accepted: fewer target forwards than tokens


def test_both_branches_are_accepted_from(target_model):
    """On the default shape both the pool's n-grams and the Jacobi window's own guesses get accepted."""
    stats = lookahead(target_model, DEFAULT).generate(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW)).stats
    assert 0 < stats.extra["pool_hits"] < stats.accepted
    assert stats.mean_tokens_per_round > 1.3


def test_cache_after_a_moved_path_gives_the_logits_of_a_fresh_forward(target_model):
    """`crop_to_path` moves a tree path that is not the first rows in place; the next logits equal a fresh forward."""
    target = CachedModel(target_model)
    tokens, parents = [7, 8, 9, 10, 11], [-1, 0, -1, 2, 3]  # two branches; the path 9, 10, 11 sits at rows 2..4
    target.extend_tree(PROMPT, tokens, parents)
    target.crop_to_path(len(PROMPT), [len(PROMPT) + i for i in (2, 3, 4)])
    assert target.tokens == PROMPT + [9, 10, 11] and target.cache.get_seq_length() == len(PROMPT) + 3
    fresh = target_model(torch.tensor([PROMPT + [9, 10, 11, 12]])).logits[0, -1]
    torch.testing.assert_close(target.forward([12])[0], fresh, rtol=1e-9, atol=1e-9)


# The tree: layout, attention mask, positions.

def steady_drafter() -> tuple[LookaheadDrafter, list[int]]:
    """W=3, N=3, G=2 with a known pool and a full window."""
    ids = [1, 2, 3, 1, 2, 4, 1, 2]  # (1, 2) was followed by 3 and by 4, each followed by 1
    drafter = LookaheadDrafter(window=3, ngram=3, candidates=2)
    drafter.start(ids)
    drafter.rows = [[2, 10, 11], [20, 21, 22]]  # row 0: the last committed token, then two guesses
    return drafter, ids


def test_draft_tree_layout():
    drafter, ids = steady_drafter()
    draft = drafter.propose(ids, 2, GreedyProcessor(), None)
    # candidates [3, 1] and [4, 1]; window row 0 (10, 11) a chain from the root, row 1 (20, 21, 22) hangs from it
    assert draft.tokens == [3, 1, 4, 1, 10, 11, 20, 21, 22]
    assert draft.parents == [-1, 0, -1, 2, -1, 4, -1, 4, 5]
    assert drafter.top_nodes == [6, 7, 8]  # the nodes of 20, 21, 22
    assert [draft.row(node) for node in drafter.top_nodes] == [7, 8, 9]  # their target rows (row 0 is the root)


def test_attention_mask_and_positions_passed_to_the_model(target_model, monkeypatch):
    drafter, ids = steady_drafter()
    draft = drafter.propose(ids, 2, GreedyProcessor(), None)
    target = CachedModel(target_model)
    target.extend(ids[:-1])  # the cache holds every committed token but the last
    seen = {}
    forward = target_model.forward

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return forward(*args, **kwargs)

    monkeypatch.setattr(target_model, "forward", spy)
    target.extend_tree(ids, draft.tokens, draft.parents)
    # Rows: the last committed token (2), then the tree; columns: the 7 cached tokens, then the same as the rows.
    #        2  3  1  4  1 10 11 20 21 22
    tree = [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # 2      the root sees no draft
            [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # 3      candidate 1
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # 1
            [1, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # 4      candidate 2
            [1, 0, 0, 1, 1, 0, 0, 0, 0, 0],  # 1
            [1, 0, 0, 0, 0, 1, 0, 0, 0, 0],  # 10     window row 0
            [1, 0, 0, 0, 0, 1, 1, 0, 0, 0],  # 11
            [1, 0, 0, 0, 0, 0, 0, 1, 0, 0],  # 20     window row 1, column 0: follows the root
            [1, 0, 0, 0, 0, 1, 0, 0, 1, 0],  # 21     column 1: follows 10
            [1, 0, 0, 0, 0, 1, 1, 0, 0, 1]]  # 22     column 2: follows 10, 11
    allowed = torch.cat([torch.ones(10, 7), torch.tensor(tree)], dim=1).bool()
    mask = seen["attention_mask"]
    assert mask.shape == (1, 1, 10, 7 + 10) and mask.dtype == target_model.dtype
    assert torch.equal(mask[0, 0] == 0, allowed)
    assert torch.all(mask[0, 0][~allowed] == torch.finfo(mask.dtype).min)
    assert seen["position_ids"].tolist() == [[7, 8, 9, 8, 9, 8, 9, 8, 9, 10]]
    assert seen["past_key_values"].get_seq_length() == 7 + 10


def test_every_tree_row_equals_a_fresh_forward_of_its_path(target_model):
    drafter, ids = steady_drafter()
    draft = drafter.propose(ids, 2, GreedyProcessor(), None)
    logits = CachedModel(target_model).extend_tree(ids, draft.tokens, draft.parents)
    for row, node in enumerate([-1] + list(range(len(draft)))):
        path = [draft.tokens[i] for i in draft.path(node)]
        fresh = target_model(torch.tensor([ids + path])).logits[0, -1]
        torch.testing.assert_close(logits[row], fresh, rtol=1e-9, atol=1e-9)


def test_tree_attention_rejects_a_parent_after_its_child():
    sees, depth = tree_attention([-1, 0, 0, 1])
    assert depth.tolist() == [1, 2, 2, 3] and sees[3].tolist() == [True, True, False, True]
    with pytest.raises(ValueError, match="parents must come first"):
        tree_attention([1, -1])


def test_window_update_warm_up_then_steady():
    """Warm-up: the window grows a row and its columns move left; full: the oldest row leaves and each column with
    its new token goes into the pool as an N-gram."""
    drafter = LookaheadDrafter(window=3, ngram=3, candidates=0)
    drafter.start([7, 8, 9])
    row0 = list(drafter.rows[0])
    drafter.propose([7, 8, 9], 2, GreedyProcessor(), None)
    logits = torch.zeros(3, 50)
    logits[[0, 1, 2], [30, 31, 32]] = 1.0  # target rows: the root, then row 0's two guesses
    drafter.feedback([7, 8, 9, 5], 0, logits)
    assert drafter.rows[0][:2] == [5, row0[2]] and drafter.rows[1][:2] == [31, 32] and len(drafter.rows[1]) == 3
    draft = drafter.propose([7, 8, 9, 5], 2, GreedyProcessor(), None)
    assert len(draft) == 2 + 3 and drafter.top_nodes == [2, 3, 4]
    logits = torch.zeros(6, 50)
    logits[[3, 4, 5], [40, 41, 42]] = 1.0
    drafter.feedback([7, 8, 9, 5, 6], 0, logits)
    assert drafter.rows == [[6, 32, drafter.rows[0][2]], [40, 41, 42]]
    assert drafter.store.counts[(5, 31)][40] == 1 and drafter.store.counts[(32,)][41] >= 1


# Verification of several candidates.

def test_tree_greedy_takes_the_candidate_with_the_longest_accepted_prefix():
    # Candidates 1-4 and 1-4-6 (as the pool and the window may both offer them), and 5; the target says 1, 4, 6, 9.
    x, parents = torch.tensor([1, 4, 1, 4, 6, 5]), torch.tensor([-1, 0, -1, 2, 3, -1])
    best = [1, 4, 8, 4, 6, 9, 3]  # argmax per row: the root, then each token
    logits = torch.nn.functional.one_hot(torch.tensor(best), 10).double()
    assert accept_tree_greedy(x, parents, logits) == (4, 9)
    assert accept_tree_greedy(x, parents, torch.nn.functional.one_hot(torch.tensor([7] * 7), 10).double()) == (-1, 7)


def test_tree_stochastic_on_a_chain_is_accept_stochastic():
    """A chain is the one-candidate case: the same decisions and tokens from the same generator state."""
    p = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2, -1)
    x = torch.tensor([1, 4, 2])
    for seed in range(200):
        n, token = accept_stochastic(x, p, None, torch.Generator().manual_seed(seed))
        assert accept_tree_stochastic(x, torch.tensor([-1, 0, 1]), p, torch.Generator().manual_seed(seed)) == (
            n - 1, token)


@pytest.mark.slow
def test_tree_stochastic_rule_alone_is_exact():
    """Three candidates at the root, the third repeating the first's token, each with a child: the first committed
    token follows p[root], the second follows the row of the first; the repeat is never accepted."""
    generator = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(7, 5, generator=generator, dtype=torch.float64) * 1.5, -1)
    x, parents = torch.tensor([2, 0, 0, 1, 2, 3]), torch.tensor([-1, 0, -1, 2, -1, 4])
    firsts, seconds, lasts = [], {2: [], 0: []}, set()
    for _ in range(6000):
        last, token = accept_tree_stochastic(x, parents, p, generator)
        committed = [int(x[i]) for i in Draft(x.tolist(), parents=parents.tolist()).path(last)] + [token]
        firsts.append((committed[0],))
        if committed[0] in seconds:
            seconds[committed[0]].append((committed[1],))
        lasts.add(last)
    assert lasts.isdisjoint({4, 5}) and {0, 1, 2, 3} <= lasts
    for samples, row in ((firsts, 0), (seconds[2], 1), (seconds[0], 3)):  # rows: the root, then token i at i + 1
        stat, critical = chi_square_test(samples, {(v,): float(p[row, v]) for v in range(5)})
        assert stat <= critical


# Losslessness under sampling, end to end.

VOCAB, LENGTH, RUNS = 6, 3, 1000
TOY_PROMPT = [1, 4, 2, 1, 4, 3, 1, 4, 2, 1, 4]  # (1, 4) was followed by 2 and by 3: two candidates at the root


@pytest.mark.slow
def test_lookahead_sampling_follows_the_target_distribution():
    """The first three tokens of seeded runs against their exact distribution by enumeration (top-k with
    temperature); a correct sampler fails with probability FALSE_ALARM = 1e-4."""
    model = tiny_model(vocab_size=VOCAB, seed=11, layers=1, hidden=16)
    processor = TopKProcessor(temperature=1.3, top_k=5)
    strategy = lookahead(model, (3, 3, 3))
    samples, accepted, pool_hits = [], 0, 0
    for seed in range(RUNS):
        result = strategy.generate(TOY_PROMPT, DecodeConfig(max_new_tokens=LENGTH, processor=processor, seed=seed))
        samples.append(tuple(result.token_ids))
        accepted, pool_hits = accepted + result.stats.accepted, pool_hits + result.stats.extra["pool_hits"]
    assert pool_hits > RUNS / 10 and accepted > pool_hits  # both branches were verified and accepted from
    stat, critical = chi_square_test(samples, exact_sequence_distribution(model, TOY_PROMPT, LENGTH, processor))
    assert stat <= critical, f"chi-square {stat:.1f} > {critical:.1f} (false alarm {FALSE_ALARM})"


def test_seeded_sampling_is_reproducible_and_greedy_ignores_the_seed(target_model):
    def run(seed, processor):
        config = DecodeConfig(max_new_tokens=20, processor=processor, seed=seed)
        return lookahead(target_model, (3, 3, 2)).generate(PROMPT, config).token_ids
    sampler = MultinomialProcessor(temperature=1.0)
    assert run(5, sampler) == run(5, sampler)
    assert len({tuple(run(s, sampler)) for s in range(4)}) > 1
    assert run(0, GreedyProcessor()) == run(1, GreedyProcessor())


# The pool and the registry.

def test_store_continuations():
    store = NGramStore(3)
    store.add([1, 2, 3, 1, 2, 4, 1, 2, 3, 5])
    assert store.continuations([0, 1, 2], 2, 1) == [store.chain([0, 1, 2], 2)] == [[3, 1]]
    assert store.continuations([0, 1, 2], 2, 3) == [[3, 1], [3, 5], [4, 1]]  # 2/3 * 1/2, 2/3 * 1/2, 1/3 * 1
    assert store.continuations([7], 3, 2) == []  # nothing known
    assert store.continuations([4, 1, 2], 5, 1) == [store.chain([4, 1, 2], 5)]


def test_registry_builds_lookahead_with_its_settings(target_model):
    assert "lookahead" in STRATEGIES
    settings = StrategySettings(lookahead_window=4, lookahead_ngram=4, lookahead_candidates=3)
    strategy = build_strategy("lookahead", CachedModel(target_model), None, settings)
    drafter = strategy.drafter
    assert (strategy.name, strategy.gamma) == ("lookahead", 3)
    assert (drafter.window, drafter.ngram, drafter.num_candidates) == (4, 4, 3)


@pytest.mark.parametrize("bad", [dict(window=1), dict(ngram=1), dict(candidates=-1), dict(window=2.5)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError, match="lookahead"):
        LookaheadDrafter(**bad)


# Near the end of the context.

CONTEXT = 48


@pytest.mark.parametrize("name", ["lookahead", "speculative", "auto", "lookup", "ngram"])
def test_near_the_context_end_drafts_shrink_and_decoding_goes_on_until_the_context_is_full(name):
    """Bug: near the context's end, lookahead with a large window failed the whole turn ("N tokens and a tree draft
    exceed the model's context"), and any drafter failed where the budget went past the context. Now the
    speculative loop cuts every draft to the room left, and stops, as at the budget, once the context is full."""
    model = tiny_model(seed=0, max_positions=CONTEXT)
    drafter = tiny_model(seed=1, layers=1, hidden=16, max_positions=CONTEXT)
    prompt = (PROMPT * 4)[:40]
    full = CONTEXT + 1 - len(prompt)  # the last committed token is never fed: it may take position CONTEXT
    expected = Autoregressive(CachedModel(model)).generate(prompt, DecodeConfig(max_new_tokens=full)).token_ids
    settings = StrategySettings(lookahead_window=8, lookahead_ngram=4, lookahead_candidates=3, gamma=6)
    strategy = build_strategy(name, CachedModel(model), CachedModel(drafter), settings)
    chat_budget = strategy.generate(prompt, DecodeConfig(max_new_tokens=CONTEXT - len(prompt)))  # the chat's plan
    assert chat_budget.token_ids == expected[: CONTEXT - len(prompt)]
    past_the_end = strategy.generate(prompt, DecodeConfig(max_new_tokens=100))
    assert past_the_end.token_ids == expected and not past_the_end.finished


def test_a_cut_tree_keeps_its_shallow_nodes_and_maps_them_to_their_rows():
    # root ─ 10 ─ 11 ─ 12        nodes 0, 1, 2
    #      └ 20 ─ 21             nodes 3, 4
    #           └ 22 ─ 23        nodes 5, 6
    draft = Draft([10, 11, 12, 20, 21, 22, 23], parents=[-1, 0, 1, -1, 3, 3, 5])
    assert draft.within(3) is draft and draft.kept is None  # nothing deeper than 3: untouched
    draft.within(2)
    assert (draft.tokens, draft.parents, draft.kept) == ([10, 11, 20, 21, 22], [-1, 0, -1, 2, 2], [0, 1, 3, 4, 5])
    assert [draft.row(node) for node in range(7)] == [1, 2, None, 3, 4, 5, None]
    draft.within(0)
    assert (draft.tokens, draft.parents) == ([], None)
    chain = Draft([1, 2, 3], q=torch.full((3, 5), 0.2)).within(2)
    assert chain.tokens == [1, 2] and chain.q.shape == (2, 5) and chain.parents is None
