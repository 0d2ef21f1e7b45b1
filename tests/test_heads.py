"""Trained draft heads (EAGLE, Medusa): lossless as chains and trees, their features consistent through rollback,
every file format read, and train_head.py training one on a tiny target in seconds."""

import json

import pytest
import torch

import train_head
from models.loading import load_model
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.heads.eagle import EagleDrafter
from sampling.heads.medusa import MedusaDrafter
from sampling.heads.networks import CONFIG, load_head, load_heads, save_head, shipped_heads
from sampling.registry import build_strategy
from sampling.settings import StrategySettings
from sampling.speculative import Speculative
from sampling.verify import accept_tree_typical
from tests.distribution import FALSE_ALARM, chi_square_test, exact_sequence_distribution
from tests.helpers import random_head, save_tiny_checkpoint, tiny_model
from training.held_out import StoredFeatures
from training.learning import draft_mask, losses
from utils.errors import ModelLoadError
from utils.logits_processor import GreedyProcessor, MultinomialProcessor, TopKNucleusProcessor
from utils.runner import CachedModel

PROMPTS = ([5, 9, 14, 3], [5, 9, 14, 3, 22, 8, 40], [71, 2])  # the second shares the first's beginning


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny saved target, and an eagle and a medusa head trained for it by train_head.py."""
    root = tmp_path_factory.mktemp("heads")
    target = save_tiny_checkpoint(root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": "x", "turns": [f"question {i}: the fox and the dog"]})
                                 for i in range(16)))
    results = {}
    for kind in ("eagle", "medusa"):
        argv = ["--target", str(target), "--kind", kind, "--out", str(root / kind), "--prompts", str(prompts),
                "--max-new-tokens", "24", "--batch", "8", "--time-budget", "2", "--epochs", "25", "--intermediate",
                "64", "--lr", "3e-3", "--no-progress"] + (["--data", str(root / "eagle" / "data")] * (kind == "medusa"))
        assert train_head.main(argv) == 0
        results[kind] = root / kind
    return target, results


@pytest.fixture(scope="module")
def target64(trained):
    return load_model(str(trained[0]), device="cpu", dtype="float64", progress=False).model


def generate(strategy, prompt, processor=None, n=30, seed=None):
    config = DecodeConfig(max_new_tokens=n, processor=processor or GreedyProcessor(), seed=seed)
    return strategy.generate(prompt, config)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("branch", [1, 3])
@pytest.mark.parametrize("lookup", [False, True], ids=["head alone", "with prompt lookup"])
def test_greedy_head_decoding_equals_autoregressive_token_for_token(trained, target64, kind, branch, lookup):
    """float64, chain (one branch) and tree, prompts in a row sharing the caches, as the chat does; the head alone,
    and with prompt lookup drafting the rounds where the context holds a copy."""
    head = load_head(trained[1][kind], target64, torch.float64)
    target = CachedModel(target64)
    settings = StrategySettings(gamma=5, verify_width=10, head_branch=branch, head_lookup=lookup)
    strategy = build_strategy(kind, target, None, settings, {kind: head})
    reference = Autoregressive(CachedModel(target64))
    accepted = drafted = 0
    for prompt in PROMPTS:
        result = generate(strategy, prompt)
        assert result.token_ids == generate(reference, prompt).token_ids
        accepted, drafted = accepted + result.stats.accepted, drafted + result.stats.drafted
    assert drafted > 0
    if kind == "eagle" or branch > 1:  # the trained head's drafts are taken: the accepting paths ran
        assert accepted > 0
    if lookup:  # the lookup drafted the rounds where the context held a copy, the head the others
        assert 0 < strategy.drafter.copied and isinstance(strategy.drafter.model, (EagleDrafter, MedusaDrafter))
        assert strategy.gamma == settings.copy_gamma


def test_the_targets_features_stay_those_of_its_cached_tokens_through_rollback(trained, target64):
    """After tree rounds (rejected branches, accepted paths moved in place) the kept hidden states are exactly what
    a fresh forward over the cached tokens gives."""
    head = load_head(trained[1]["eagle"], target64, torch.float64)
    target = CachedModel(target64)
    strategy = Speculative(target, EagleDrafter(target, head, 3, 9), gamma=4, name="eagle")
    for prompt in PROMPTS[:2]:
        generate(strategy, prompt, n=25)
        with torch.no_grad():
            fresh = target64(input_ids=torch.tensor([target.tokens]), output_hidden_states=True).hidden_states[-1][0]
        assert target.hidden.shape == fresh.shape
        torch.testing.assert_close(target.hidden, fresh, rtol=1e-9, atol=1e-9)


def reference_eagle_tree(head, features, ids, depth, branch, max_tree):
    """EAGLE-2's tree, each node's feature recomputed by a plain causal pass over the committed positions and the
    node's own path (no head cache, no tree mask): (token ids, parents) of the `max_tree` best paths."""
    def predict(path):  # path: (input feature, draft index) from depth 1 to a node; the node's predicted feature
        feats = torch.cat([features] + [f[None] for f, _ in path])
        tokens = torch.tensor(ids[1:] + head.token_ids(torch.tensor([t for _, t in path], dtype=torch.long)).tolist())
        return head.module(feats[None], head.embeds(tokens)[None], torch.arange(len(tokens)))[0, -1]

    tokens, parents, scores, paths = [], [], [], []

    def children(out, score, parent, path):
        top = head.logits(out).log_softmax(-1).double().topk(branch)
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            tokens.append(index), parents.append(parent), scores.append(score + value)
            paths.append(path + [(out, index)])
        return list(range(len(tokens) - branch, len(tokens)))

    frontier = children(predict([]), 0.0, -1, [])
    for _ in range(2, depth + 1):
        expand = sorted(frontier, key=lambda i: -scores[i])[:branch]
        frontier = [child for node in expand for child in children(predict(paths[node]), scores[node], node,
                                                                    paths[node])]
    kept = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:max_tree])
    new = {old: i for i, old in enumerate(kept)}
    return (head.token_ids(torch.tensor([tokens[i] for i in kept])).tolist(),
            [new[parents[i]] if parents[i] >= 0 else -1 for i in kept])


def test_an_eagle_tree_drafts_what_a_plain_causal_pass_over_each_path_gives(trained, target64):
    """The head's cache and per-depth tree mask let each node see the committed positions and its own ancestors,
    no sibling or cousin: its tree equals one built by recomputing every path from scratch."""
    head = load_head(trained[1]["eagle"], target64, torch.float64)
    ids = PROMPTS[1] + [11, 30, 6]
    with torch.no_grad():
        hidden = target64(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    stored = StoredFeatures(ids, hidden)
    stored.at(len(ids))
    drafter = EagleDrafter(stored, head, 3, 9)
    for n in (len(ids) - 3, len(ids)):  # a second draft reuses the head's cache of the first
        stored.at(n)
        draft = drafter.propose(ids[:n], 4, GreedyProcessor(), None)
        expected_tokens, expected_parents = reference_eagle_tree(head, hidden[: n - 1], ids[:n], 4, 3, 9)
        assert draft.tokens == expected_tokens
        assert (draft.parents or list(range(-1, len(draft) - 1))) == expected_parents
        assert len(set(expected_parents)) > 2  # a real tree: several nodes have children


def test_training_reports_held_out_tokens_per_step_and_beats_an_untrained_head(trained):
    for kind, floor in (("eagle", 1.5), ("medusa", 1.05)):
        meta = json.loads((trained[1][kind] / "head.json").read_text())
        info = meta["training"]
        assert info["answers"] == 16 and info["held_out_answers"] == 2 and info["answer_tokens"] > 0
        assert info["held_out"]["chain_tokens_per_step"] > floor, (kind, info["held_out"])
        assert info["held_out"]["tree_tokens_per_step"] >= 1.0
        assert info["command"].startswith("python train_head.py --target")
    # the medusa run reused the eagle run's answers: none made again
    assert not (trained[1]["medusa"] / "data").exists()


@pytest.mark.parametrize("depth", [2, 3])
def test_a_training_pass_reads_its_drafts_as_the_drafter_does_at_that_depth(target64, depth):
    """Pass d of the training-time test at position i: the head's output when it drafts d deep from the real
    position i - d + 1, one depth at a time over its cache, as EagleDrafter feeds it."""
    from sampling.heads.networks import HeadCache

    head = random_head(target64, "eagle")
    length, width = 12, target64.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    feats = torch.randn(length, width, generator=generator, dtype=torch.float64)
    embeds = torch.randn(length, width, generator=generator, dtype=torch.float64)
    positions, cache, inputs = torch.arange(length), HeadCache(), feats
    with torch.no_grad():
        for d in range(1, depth + 1):
            out = head.module(inputs[None], embeds[None], positions, draft_mask(length, d), cache)[0]
            inputs = torch.cat([feats[:1], out[:-1]])
        for i in range(depth - 1, length):
            real = i - depth + 2  # positions 0 .. real - 1 carry the target's features
            steps = HeadCache()
            step = head.module(feats[None, :real], embeds[None, :real], positions[:real],
                               torch.ones(real, real, dtype=torch.bool).tril(), steps)[0, -1]
            for d in range(2, depth + 1):
                at = real - 2 + d
                step = head.module(step[None, None], embeds[None, at : at + 1], positions[at : at + 1],
                                   torch.ones(1, len(steps) + 1, dtype=torch.bool), steps)[0, 0]
            torch.testing.assert_close(out[i], step, rtol=1e-9, atol=1e-9)


def test_deeper_training_passes_add_to_the_loss_and_report_the_first():
    model = tiny_model(dtype=torch.float32)
    head = random_head(model, "eagle")
    ids = torch.tensor([5, 9, 14, 3, 22, 8, 40, 7, 11])
    row = {"ids": ids, "features": torch.randn(len(ids) - 1, model.config.hidden_size), "start": 4}
    one = losses(head, head.module, row, 0.0, torch.Generator().manual_seed(0), depth=1)
    three = losses(head, head.module, row, 0.0, torch.Generator().manual_seed(0), depth=3)
    assert three[0] > one[0]  # the deeper passes' losses are added
    torch.testing.assert_close(three[1:], one[1:])  # the first pass's cross-entropy and agreement are reported


def test_an_eagle_head_trains_on_its_own_drafts(trained, tmp_path):
    target, heads = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["question 0: the fox and the dog"]}))
    argv = ["--target", str(target), "--kind", "eagle", "--out", str(tmp_path / "h"), "--prompts", str(prompts),
            "--data", str(heads["eagle"] / "data"), "--time-budget", "2", "--epochs", "10", "--intermediate", "64",
            "--lr", "3e-3", "--draft-depth", "3", "--no-progress"]
    assert train_head.main(argv) == 0
    info = json.loads((tmp_path / "h" / "head.json").read_text())["training"]
    assert info["draft_depth"] == 3 and info["answers"] == 16  # the answers reused: none made again
    assert info["held_out"]["chain_tokens_per_step"] > 1.5  # as the fixture's head trained on features alone


def test_an_eagle_head_trains_with_bf16_products_and_says_so(trained, tmp_path, monkeypatch):
    import torch.nn.functional as F

    target, heads = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["question 0: the fox and the dog"]}))
    seen, linear = set(), F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.add(linear(x, w, b).dtype) or linear(x, w, b))
    argv = ["--target", str(target), "--kind", "eagle", "--out", str(tmp_path / "h"), "--prompts", str(prompts),
            "--data", str(heads["eagle"] / "data"), "--time-budget", "2", "--epochs", "10", "--intermediate", "64",
            "--lr", "3e-3", "--train-bf16", "--no-progress"]
    assert train_head.main(argv) == 0
    info = json.loads((tmp_path / "h" / "head.json").read_text())["training"]
    assert info["train_bf16"] is True and info["answers"] == 16
    assert torch.bfloat16 in seen  # the head's products ran in bf16
    assert info["held_out"]["chain_tokens_per_step"] > 1.5  # as the fixture's head trained in float32


def test_draft_depth_is_for_eagle_heads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_head.parse_args(["--target", "x", "--kind", "medusa", "--out", str(tmp_path), "--prompts", "p.jsonl",
                               "--draft-depth", "2"])
    assert "--draft-depth trains an eagle head on its own drafts" in capsys.readouterr().err


def test_training_resumes_from_its_answers_and_checkpoint(trained, tmp_path):
    target, heads = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": "x", "turns": [f"q {i}"]}) for i in range(4)))
    argv = ["--target", str(target), "--kind", "medusa", "--out", str(tmp_path / "h"), "--prompts", str(prompts),
            "--max-new-tokens", "8", "--batch", "2", "--epochs", "2", "--no-progress"]
    assert train_head.main(argv) == 0
    first = json.loads((tmp_path / "h" / "head.json").read_text())["training"]
    assert train_head.main(argv + ["--resume", "--epochs", "3"]) == 0
    again = json.loads((tmp_path / "h" / "head.json").read_text())["training"]
    assert first["epochs"] == 2 and again["epochs"] == 3 and again["steps"] == first["steps"] * 3 // 2
    assert again["answers"] == first["answers"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("kind, branch", [("eagle", 1), ("eagle", 3), ("medusa", 2)])
def test_head_sampling_follows_the_target_distribution(kind, branch):
    model = tiny_model(vocab_size=6, seed=11, layers=1, hidden=16)
    head = random_head(model, kind, std=0.5)
    processor = TopKNucleusProcessor(temperature=1.2, top_k=4, top_p=0.9)
    prompt, length = [1, 4, 2], 3
    target = CachedModel(model)
    drafter = EagleDrafter(target, head, branch, 4) if kind == "eagle" else MedusaDrafter(target, head, branch, 4)
    strategy = Speculative(target, drafter, gamma=2, name=kind)
    samples = [tuple(generate(strategy, prompt, processor, n=length, seed=i).token_ids) for i in range(1500)]
    stat, critical = chi_square_test(samples, exact_sequence_distribution(model, prompt, length, processor))
    assert stat <= critical, f"chi-square {stat:.1f} > {critical:.1f} (false alarm {FALSE_ALARM})"


def test_typical_acceptance_is_an_opt_in_labelled_not_lossless():
    model = tiny_model(vocab_size=31, seed=3)
    head = random_head(model, "medusa")
    lossless = build_strategy("medusa", CachedModel(model), None, StrategySettings(), {"medusa": head})
    typical = build_strategy("medusa", CachedModel(model), None, StrategySettings(typical=True), {"medusa": head})
    assert lossless.lossless and not typical.lossless
    # the rule itself: a token the target gives more than min(threshold, alpha * exp(-H)) passes, the others not
    p = torch.tensor([[0.7, 0.2, 0.1], [0.05, 0.9, 0.05], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    x, parents = torch.tensor([0, 1]), torch.tensor([-1, 0])
    last, token = accept_tree_typical(x, parents, p, 0.09, 0.3, torch.Generator().manual_seed(0))
    assert last == 1 and token in (0, 1, 2)  # both pass: 0.7 and 0.9 are above their floors
    last, _ = accept_tree_typical(torch.tensor([2]), torch.tensor([-1]), p, 0.09, 0.3, None)
    assert last == 0  # 0.1 at a row whose floor is min(0.09, 0.3 * exp(-0.80)) = 0.09: passes, unlike the lossless rule
    last, _ = accept_tree_typical(torch.tensor([0]), torch.tensor([-1]), p[1:], 0.09, 0.3, None)
    assert last == -1  # 0.05 is below 0.09
    generated = generate(typical, [3, 4, 5], MultinomialProcessor(1.0), n=12, seed=0)
    assert len(generated.token_ids) == 12


def test_project_format_round_trip_and_published_layouts(tmp_path):
    model = tiny_model(vocab_size=41, seed=2, dtype=torch.float32)
    # the project's: weights and the draft vocabulary come back as saved (stored in bfloat16)
    eagle = random_head(model, "eagle", vocab=torch.arange(0, 41, 3))
    save_head(tmp_path / "ours", eagle.config, eagle.module, eagle.vocab, {"answers": 3})
    back = load_head(tmp_path / "ours", model)
    assert back.config == eagle.config and torch.equal(back.vocab, eagle.vocab) and back.info == {"answers": 3}
    for name, tensor in eagle.module.state_dict().items():
        torch.testing.assert_close(back.module.state_dict()[name], tensor.bfloat16().float())
    # EAGLE-1/2 authors' layout: config.json (Llama-style) and pytorch_model.bin, layer 0 without its input norm
    c = eagle.config
    published = {f"layers.0.{k}": v for k, v in eagle.module.layers[0].state_dict().items()
                 if k != "post_attention_layernorm"}
    published |= {"fc.weight": eagle.module.fc.weight, "layers.0.post_attention_layernorm.weight":
                  eagle.module.layers[0].post_attention_layernorm.detach(),
                  "layers.0.input_layernorm.weight": torch.ones(c.hidden_size),
                  "embed_tokens.weight": torch.zeros(41, 32)}
    (tmp_path / "eagle").mkdir()
    torch.save(published, tmp_path / "eagle" / "pytorch_model.bin")
    (tmp_path / "eagle" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "intermediate_size": c.intermediate_size, "rms_norm_eps": 1e-6,
        "rope_theta": c.rope_theta, "vocab_size": 41}))
    theirs = load_head(tmp_path / "eagle", model)
    assert theirs.vocab is None and theirs.info["source"] == "EAGLE authors' format"
    x, e = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    torch.testing.assert_close(theirs.module(x, e, torch.arange(5)), eagle.module(x, e, torch.arange(5)))
    # Medusa authors' layout: each head's residual blocks and its own output layer over the whole vocabulary
    (tmp_path / "medusa").mkdir()
    generator = torch.Generator().manual_seed(0)
    state = {}
    for head in range(2):
        state[f"{head}.0.linear.weight"] = torch.randn(32, 32, generator=generator) * 0.1
        state[f"{head}.0.linear.bias"] = torch.zeros(32)
        state[f"{head}.1.weight"] = torch.randn(41, 32, generator=generator)
    torch.save(state, tmp_path / "medusa" / "medusa_lm_head.pt")
    (tmp_path / "medusa" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                                 "base_model_name_or_path": "tiny"}))
    medusa = load_head(tmp_path / "medusa", model)
    assert medusa.config.own_lm_head and medusa.config.num_heads == 2 and medusa.config.vocab_size == 41
    target = CachedModel(model)
    drafter = MedusaDrafter(target, medusa, 1, 4)
    ids = [3, 7, 1, 9]
    target.extend(ids)
    draft = drafter.propose(ids + [5], 2, GreedyProcessor(), None)
    with torch.no_grad():
        feature = target.hidden[-1]
        expected = [int(torch.argmax(state[f"{h}.1.weight"] @ (feature + torch.nn.functional.silu(
            state[f"{h}.0.linear.weight"] @ feature)))) for h in range(2)]
    assert draft.tokens == expected


def test_unusable_heads_are_refused_with_a_reason(tmp_path):
    model = tiny_model(vocab_size=41, seed=2, dtype=torch.float32)
    other = tiny_model(vocab_size=41, seed=2, hidden=16, dtype=torch.float32)
    head = random_head(other, "medusa")
    save_head(tmp_path / "narrow", head.config, head.module, None, {})
    with pytest.raises(ModelLoadError, match="width 16, the target's are 32: it was trained for another model"):
        load_head(tmp_path / "narrow", model)
    with pytest.raises(ModelLoadError, match="no head directory"):
        load_head(tmp_path / "missing", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="neither head.json"):
        load_head(tmp_path / "empty", model)
    save_head(tmp_path / "damaged", head.config, head.module, None, {})
    (tmp_path / "damaged" / "head.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="cannot read the head in") as error:
        load_head(tmp_path / "damaged", model)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="needs a trained eagle head"):
        build_strategy("eagle", CachedModel(model), None, StrategySettings(), {})
    assert load_heads(["none"], "tiny", model) == {}


def test_the_shipped_heads_are_found_for_their_target():
    """Bug: after the head code moved into sampling/heads/, the shipped heads were looked for in that package, found
    nowhere, and the embedded target ran without its eagle head (the strategy missing from the chat and the bench)."""
    found = shipped_heads("qwen2.5-coder-1.5b")
    assert [d.name for d in found] == ["qwen2.5-coder-1.5b-eagle"]
    assert (found[0] / CONFIG).is_file()
    assert shipped_heads("no-such-target") == []


@pytest.mark.parametrize("kind, claimed, message", [
    ("eagle", "medusa", "its medusa config has no num_heads"),
    ("medusa", "eagle", "its eagle config has no num_attention_heads, num_key_value_heads, head_dim"),
])
def test_a_head_json_naming_another_kind_than_its_weights_is_refused(tmp_path, kind, claimed, message):
    """Bug: a head.json saying "medusa" over eagle weights loaded as a Medusa head with zero heads, and ran."""
    model = tiny_model(vocab_size=41, seed=2, dtype=torch.float32)
    head = random_head(model, kind)
    save_head(tmp_path, head.config, head.module, None, {})
    meta = json.loads((tmp_path / "head.json").read_text())
    (tmp_path / "head.json").write_text(json.dumps({**meta, "kind": claimed}))
    with pytest.raises(ModelLoadError, match=message) as error:
        load_head(tmp_path, model)
    assert "\n" not in str(error.value)
    meta["config"]["num_heads"] = 2  # a medusa config of fewer heads than its weights: refused the same way
    (tmp_path / "head.json").write_text(json.dumps(meta))
    if kind == "medusa":
        with pytest.raises(ModelLoadError, match="medusa config has no place for weights heads.2.0.linear.bias, "):
            load_head(tmp_path, model)


def test_a_compact_head_keeps_its_size_and_the_output(trained, target64):
    """int4 weights (int8 where a layer's shape does not fit int4), bf16 activations: drafts change, output not."""
    from sampling.heads.networks import compact

    dense = load_head(trained[1]["eagle"], target64, torch.float64)
    size = dense.size
    head = compact(dense, "int4")
    assert head.size == size and head.weights == "int4" and head.dtype == torch.bfloat16
    target = CachedModel(target64)
    strategy = build_strategy("eagle", target, None, StrategySettings(gamma=4, verify_width=8), {"eagle": head})
    for prompt in PROMPTS:
        assert generate(strategy, prompt).token_ids == generate(Autoregressive(CachedModel(target64)), prompt).token_ids


def test_the_docstring_prompts_are_the_same_every_time_and_cover_their_three_categories():
    import importlib.util
    from collections import Counter
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "heads" / "docstring_prompts.py"
    spec = importlib.util.spec_from_file_location("docstring_prompts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.prompts(4)
    assert rows == module.prompts(4)
    assert Counter(r["category"] for r in rows) == {"summarization": 4, "qa": 4, "translation": 4}
    passages = [r["turns"][0].split("\n\n", 1)[1] for r in rows]
    assert len(set(passages)) == len(rows) and not any(">>>" in p or "    " in p for p in passages)


def test_the_docstring_prompts_with_every_task_give_each_passage_all_three_categories_and_packages_read_subpackages(
        tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "heads" / "docstring_prompts.py"
    spec = importlib.util.spec_from_file_location("docstring_prompts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.prompts(3, every_task=True)
    by_category = {c: [r["turns"][0] for r in rows if r["category"] == c]
                   for c in ("summarization", "qa", "translation")}
    assert [len(v) for v in by_category.values()] == [3, 3, 3]
    passages = [turn.split("\n\n", 1)[1] for turn in by_category["summarization"]]
    assert all(p in q for p, q in zip(passages, by_category["qa"], strict=True))
    assert all(p.split(". ")[0] in t for p, t in zip(passages, by_category["translation"], strict=True))
    prose = ("This {0} keeps a record of every request the server has answered so far. Each entry holds the time it "
             "came in and the name of the client that sent it, so that a later report can count them by hour and by "
             "client without reading the log files again.")
    for folder, name in (("", "top"), ("package", "sub"), ("test", "skipped")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"{name}.py").write_text(f'"""{prose.format(name)}"""\n')
    assert module.paragraphs(tmp_path) == [prose.format("top")]
    assert module.paragraphs(tmp_path, packages=True) == sorted([prose.format("top"), prose.format("sub")])
