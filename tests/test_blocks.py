"""A model on the GGUF block kernels (models/formats/blocks.py): the file's tensors in place of the linears, and
greedy speculative output identical to autoregressive on them."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

import kernels
from models import invariance
from models.formats import blocks
from models.formats.layers import linear_weight
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.speculative import Speculative
from tests.helpers import random_head, tiny_model
from tests.test_kernels import dequantized, random_blocks
from utils.runner import CachedModel

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q5_0")


# Types for `gguf_tensors(siblings=True)`, by layer: q, k, v, o, gate, up, down. Layer 0's q, k, v share one and its
# gate and up another; layer 1's v differs from its q and k (as a Q4_K_M file's Q6_K v_proj), its gate from its up.
SIBLING_FORMATS = (("Q4_K", "Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q8_0", "Q5_0"),
                   ("Q5_0", "Q5_0", "Q6_K", "Q8_0", "Q4_K", "Q6_K", "Q4_K"))


def gguf_tensors(model, seed: int = 0, siblings: bool = False) -> dict[str, tuple[str, torch.Tensor]]:
    """Random blocks for every linear of a tiny Llama (its GGUF tensor names), the formats taken in turn (or, with
    `siblings`, as `SIBLING_FORMATS` says)."""
    names = {module: name for name, module in blocks.MODULES.items()}
    tensors = {}
    for index, layer in enumerate(model.model.layers):
        for position, (module, name) in enumerate(names.items()):
            linear = layer.get_submodule(module)
            kind = (SIBLING_FORMATS[index % 2][position] if siblings else FORMATS[(index + position) % len(FORMATS)])
            raw = random_blocks(kind, linear.out_features, linear.in_features, seed=seed + 10 * index + position)
            tensors[f"blk.{index}.{name}.weight"] = kind, torch.from_numpy(raw)
    head = model.lm_head
    tensors["output.weight"] = "Q6_K", torch.from_numpy(random_blocks("Q6_K", head.out_features, head.in_features,
                                                                      seed=seed + 99))
    return tensors


def block_model(seed: int = 0, siblings: bool = False):
    """A tiny Llama with every linear and its input embedding in random blocks; with `siblings`, typed as
    `SIBLING_FORMATS` and q, k, v with biases (as Qwen2's), not joined yet."""
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for tensor_name, (kind, raw) in gguf_tensors(model, seed, siblings).items():
        name = blocks.module_name(tensor_name, tied=False)
        parent, _, child = name.rpartition(".")
        bias = torch.randn(raw.shape[0], generator=generator) if siblings and child in ("q_proj", "k_proj", "v_proj") \
            else None
        setattr(model.get_submodule(parent) if parent else model, child, blocks.BlockLinear(raw, kind,
                model.get_submodule(name).in_features, bias))
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    raw = torch.from_numpy(random_blocks("Q8_0", vocab, hidden, seed=seed + 77))
    model.set_input_embeddings(blocks.BlockEmbedding(raw, "Q8_0", hidden))
    return model


def test_a_block_linear_computes_its_dequantized_weights():
    raw = torch.from_numpy(random_blocks("Q4_K", 32, 512))
    layer = blocks.BlockLinear(raw, "Q4_K", 512, torch.randn(32))
    x = torch.randn(2, 3, 512)
    expected = torch.nn.functional.linear(x.double(), layer.dequantized().double(), layer.bias.double())
    got = layer(x)
    assert got.shape == (2, 3, 32) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 3e-2 * expected.abs().max()
    with pytest.raises(ValueError, match="do not hold 256 weights"):
        blocks.BlockLinear(raw, "Q4_K", 256, None)
    with pytest.raises(ValueError, match="not Q4_1"):
        blocks.BlockLinear(raw, "Q4_1", 512, None)


def test_requantize_takes_the_wider_types_to_q4_0_of_their_own_values_and_leaves_the_rest():
    model = block_model(seed=5)
    before = {name: (module.block_type, module.dequantized()) for name, module in model.named_modules()
              if isinstance(module, blocks.BlockLinear)}
    embedding = model.get_input_embeddings()
    replaced = blocks.requantize(model, "Q4_0", rows_at_once=48)  # a layer's rows in several pieces

    assert sorted(replaced) == sorted(name for name, (kind, _) in before.items() if kind in ("Q6_K", "Q8_0", "Q5_0"))
    assert model.get_input_embeddings() is embedding  # a lookup reads few rows: the embedding keeps its blocks
    for name, (kind, weights) in before.items():
        layer = model.get_submodule(name)
        if name not in replaced:
            assert layer.block_type == kind == "Q4_K" and torch.equal(layer.dequantized(), weights)
            continue
        expected = kernels.quantize(weights, "Q4_0")  # ggml's Q4_0 of the values the wider blocks held
        assert layer.block_type == "Q4_0" and torch.equal(kernels.unpack(layer.blocks, layer.type_id), expected)
    assert blocks.requantize(model, "Q4_0") == []  # nothing wider is left


def test_on_the_blocks_the_probe_finds_an_exact_path_and_speculative_output_equals_autoregressive():
    target = CachedModel(block_model())
    found = invariance.probe(target)
    assert found.exact, found.tried
    drafter = CachedModel(block_model(seed=5))  # another random model: most drafts rejected
    config = DecodeConfig(max_new_tokens=40)
    reference = Autoregressive(target).generate(PROMPT, config).token_ids
    for draft in (CachedModel(target.model), drafter):  # all accepted, mostly rejected
        result = Speculative(target, ModelDrafter(draft, target.vocab_size, alternatives=2, max_tree=6), 5).generate(
            PROMPT, config)
        assert result.token_ids == reference


def gguf_mm_calls(model, ids: torch.Tensor) -> int:
    """How many kernel matmuls one forward of `ids` takes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, torch.inference_mode():
        model(ids)
    return sum(event.name == "specchat::gguf_mm" for event in profile.events())


def test_siblings_run_as_one_kernel_call_with_the_bits_of_separate_calls():
    model = block_model(siblings=True)
    reference = copy.deepcopy(model)
    assert blocks.join_siblings(model) == 3  # layer 0: q, k, v and gate, up; layer 1: q, k (its v is another type)
    joined = {name for name, module in model.named_modules() if isinstance(module, blocks.SiblingLinear)}
    assert joined == {f"model.layers.0.{name}" for name in blocks.SIBLINGS[0] + blocks.SIBLINGS[1]} | {
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"}
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.blocks.untyped_storage().data_ptr() == attention.q_proj.blocks.untyped_storage().data_ptr()
    assert blocks.join_siblings(model) == 0  # joined once
    ids = torch.tensor([PROMPT])
    assert (gguf_mm_calls(reference, ids), gguf_mm_calls(model, ids)) == (15, 11)  # 7 a layer and the output's
    for name, module in model.named_modules():  # each linear still computes its own weights alone
        if isinstance(module, blocks.SiblingLinear):
            assert torch.equal(module.dequantized(), reference.get_submodule(name).dequantized())
    # every forward's logits bit for bit: a prompt, steps, a verify
    joined_lm, reference_lm = CachedModel(model), CachedModel(reference)
    with torch.inference_mode():
        for feed, rows in ((PROMPT, 1), ([3], 1), ([4], 1), ([5, 6, 7, 8], 4)):
            assert torch.equal(joined_lm.forward(feed, rows), reference_lm.forward(feed, rows))
    group = attention.q_proj.group
    assert group.input is None and group.outputs == {}  # nothing held past the layer
    # a later sibling fed another tensor than the first was computes its own output
    x, other = torch.randn(3, 256), torch.randn(3, 256)
    with torch.inference_mode():
        attention.q_proj(x)
        assert torch.equal(attention.k_proj(other), reference.model.layers[0].self_attn.k_proj(other))
        assert torch.equal(attention.v_proj(x), reference.model.layers[0].self_attn.v_proj(x))
        attention.q_proj(x)
        group.outputs = {}  # as a graph run on another thread leaves it
        assert torch.equal(attention.k_proj(x), reference.model.layers[0].self_attn.k_proj(x))


def write_gguf(path, tensors) -> None:
    writer = GGUFWriter(str(path), arch="llama")
    for name, (kind, raw) in tensors.items():
        writer.add_tensor(name, raw.numpy(), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_apply_puts_the_files_blocks_in_place_of_the_linears_and_refuses_another_models_file(tmp_path):
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256)
    tensors = gguf_tensors(model)
    with torch.no_grad():  # the model holds the file's weights, as one converted from it does
        for tensor_name, (kind, raw) in tensors.items():
            layer = model.get_submodule(blocks.module_name(tensor_name, tied=False))
            layer.weight.copy_(blocks.BlockLinear(raw, kind, layer.in_features, None).dequantized())
    good, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    write_gguf(good, tensors)
    write_gguf(other, gguf_tensors(model, seed=50))
    assert blocks.block_linears(good) == len(tensors) == 2 * 7 + 1
    before = model.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="does not hold the weights"):
        blocks.apply(model, other)
    assert model.model.layers[0].self_attn.q_proj is before  # refused: nothing changed
    expected = linear_weight(model.model.layers[1].mlp.down_proj)
    assert len(blocks.apply(model, good)) == len(tensors)
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, blocks.BlockLinear) and isinstance(model.lm_head, blocks.BlockLinear)
    torch.testing.assert_close(down.dequantized(), expected, rtol=0, atol=0)


def test_gguf_names_map_to_the_models_linears():
    assert blocks.module_name("blk.3.ffn_up.weight", tied=False) == "model.layers.3.mlp.up_proj"
    assert blocks.module_name("blk.0.attn_v.weight", tied=False) == "model.layers.0.self_attn.v_proj"
    assert blocks.module_name("output.weight", tied=False) == "lm_head"
    assert blocks.module_name("token_embd.weight", tied=True) == "lm_head"
    assert blocks.module_name("token_embd.weight", tied=False) is None
    assert blocks.module_name("blk.0.attn_norm.weight", tied=False) is None


@pytest.mark.parametrize("block_type", FORMATS)
def test_a_block_embedding_dequantizes_the_rows_it_looks_up_and_holds_no_float_table(block_type):
    raw = random_blocks(block_type, 50, 256, seed=3)
    embedding = blocks.BlockEmbedding(torch.from_numpy(raw), block_type, 256)
    ids = torch.tensor([[0, 49, 7], [7, 7, 1]])
    table = torch.from_numpy(dequantized(raw, block_type, 256)).float()
    assert torch.equal(embedding(ids), table[ids])
    assert (embedding.num_embeddings, embedding.embedding_dim) == (50, 256)
    assert embedding.weight.shape == (50, 256) and embedding.weight.is_meta  # its width, for code that reads one
    assert [name for name, _ in embedding.named_parameters()] == []
    with pytest.raises((RuntimeError, NotImplementedError)):  # no values behind it
        embedding.weight.tolist()
    with pytest.raises(ValueError, match="do not hold 512 weights"):
        blocks.BlockEmbedding(torch.from_numpy(raw), block_type, 512)


def embedding_file(tmp_path, model, tied: bool, seed: int = 0):
    """A GGUF of the model's linears and token_embd (Q4_K) in random blocks, without output.weight where `tied`; the
    model's weights set to the file's (the embedding's to seed 0's, so another seed is another model's file)."""
    tensors = gguf_tensors(model, seed=0)
    if tied:
        del tensors["output.weight"]
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    tensors["token_embd.weight"] = "Q4_K", torch.from_numpy(random_blocks("Q4_K", vocab, hidden, seed=seed + 31))
    with torch.no_grad():
        for tensor_name, (kind, raw) in tensors.items():
            if tensor_name == "token_embd.weight":
                table = dequantized(random_blocks("Q4_K", vocab, hidden, seed=31), "Q4_K", hidden)
                model.get_input_embeddings().weight.copy_(torch.from_numpy(table))
            elif not (tied and tensor_name == "output.weight"):
                layer = model.get_submodule(blocks.module_name(tensor_name, tied=tied))
                layer.weight.copy_(blocks.BlockLinear(raw, kind, layer.in_features, None).dequantized())
    path = tmp_path / f"model-{tied}-{seed}.gguf"
    write_gguf(path, tensors)
    return path


def float_tables(model) -> list[str]:
    """The model's parameters of the size of a (vocabulary, hidden) table."""
    size = model.config.vocab_size * model.config.hidden_size
    return [name for name, p in model.named_parameters(remove_duplicate=False) if p.numel() == size]


def test_apply_puts_the_embedding_in_blocks_and_the_model_computes_what_it_did(tmp_path):
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256)
    path = embedding_file(tmp_path, model, tied=False)
    reference = copy.deepcopy(model)
    replaced = blocks.apply(model, path)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, blocks.BlockEmbedding) and "model.embed_tokens" in replaced
    assert embedding.block_type == "Q4_K" and float_tables(model) == []
    ids = torch.tensor([[3, 8, 1, 96, 4, 0]])
    with torch.inference_mode():
        assert torch.equal(embedding(ids), reference.get_input_embeddings()(ids))  # the same values, bit for bit
        got, expected = model(ids).logits, reference(ids).logits
    assert (got - expected).abs().max() <= 3e-2 * expected.abs().max()  # the linears' int8 activations


def test_a_tied_files_embedding_and_output_layer_share_one_copy_of_its_blocks(tmp_path):
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256)
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as a converted Qwen2.5-0.5B is
    path = embedding_file(tmp_path, model, tied=True)
    assert {"lm_head", "model.embed_tokens"} <= set(blocks.apply(model, path))
    assert isinstance(model.lm_head, blocks.BlockLinear) and model.lm_head.block_type == "Q4_K"
    assert model.lm_head.blocks.data_ptr() == model.get_input_embeddings().blocks.data_ptr()
    assert float_tables(model) == []  # the tie brought no float32 table back


def test_apply_refuses_another_models_embedding_and_changes_nothing(tmp_path):
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256)
    other = embedding_file(tmp_path, model, tied=False, seed=5)  # the linears match, token_embd does not
    before = model.get_input_embeddings(), model.model.layers[1].mlp.up_proj
    with pytest.raises(ValueError, match="token_embd.weight in .* does not hold the weights of the model's "
                                         "model.embed_tokens"):
        blocks.apply(model, other)
    assert (model.get_input_embeddings(), model.model.layers[1].mlp.up_proj) == before


def test_what_reads_the_embedding_works_on_blocks_the_hidden_width_and_a_heads_rows():
    model = block_model()
    target = CachedModel(model)
    target.keep_hidden()
    assert target.hidden.shape == (0, 256)  # utils/runner reads the width from the embedding's `weight`
    vocab = torch.tensor([5, 17, 96, 0])
    head = random_head(model, "eagle", vocab=vocab)
    assert head.embed is model.get_input_embeddings()
    ids = torch.tensor([3, 5, 3])
    assert torch.equal(head.embeds(ids), model.get_input_embeddings()(ids))
    assert torch.equal(head.out, model.lm_head.dequantized()[vocab])  # only those rows dequantized
    assert torch.equal(model.lm_head.weight_rows(vocab), model.lm_head.dequantized()[vocab])


def test_a_dense_model_quantized_to_q8_0_blocks_computes_what_it_did_and_shares_a_tied_table():
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256, intermediate=320)
    model.lm_head.weight = model.get_input_embeddings().weight  # tied
    reference = copy.deepcopy(model)
    replaced = blocks.quantize_dense(model)
    linears = [name for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear)]
    assert set(replaced) == {*linears, "model.embed_tokens"}
    assert {m.block_type for m in model.modules() if isinstance(m, blocks.BlockLinear)} == {"Q8_0"}
    assert model.lm_head.blocks is model.get_input_embeddings().blocks  # quantized once
    assert float_tables(model) == []
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        got, expected = model(ids).logits, reference(ids).logits
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()  # Q8_0 weights and int8 activations
    up = model.model.layers[1].mlp.up_proj
    assert (up.dequantized() - reference.model.layers[1].mlp.up_proj.weight).abs().max() <= \
        reference.model.layers[1].mlp.up_proj.weight.abs().max() / 127  # half a step of the largest scale


def test_the_tensor_list_read_from_a_files_header_is_gguf_pys(tmp_path):
    from gguf import GGUFReader

    from models.gguf import tensor_infos

    model = tiny_model(dtype=torch.float32, layers=2, hidden=256)
    path = embedding_file(tmp_path, model, tied=False)
    expected = [(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape), int(t.data_offset), int(t.n_bytes))
                for t in GGUFReader(str(path)).tensors]
    assert [(t.name, t.type_name, t.shape, t.data_offset, t.n_bytes) for t in tensor_infos(path)] == expected


def test_the_prefetch_distance_is_timed_once_on_the_models_linears_kept_and_read_back(tmp_path):
    from models.formats import prefetch

    model = block_model(siblings=True)
    blocks.join_siblings(model)
    try:
        assert prefetch.tune(model, tmp_path) is None  # a model this small stays in cache: nothing to learn
        assert not (tmp_path / "calibration").exists()
        chosen = prefetch.tune(model, tmp_path, least_bytes=0)  # timed for real on its linears
        assert chosen in prefetch.CANDIDATES and kernels.prefetch() == chosen
        (kept,) = (tmp_path / "calibration").glob("*.prefetch.json")
        record = json.loads(kept.read_text())
        assert record["ahead"] == chosen and record["key"]["isa"] == kernels.isa()
        assert set(record["seconds"]) == {str(ahead) for ahead in prefetch.CANDIDATES}

        def no_timing(_):
            raise AssertionError("timed again")

        kernels.prefetch(0)
        assert prefetch.tune(model, tmp_path, least_bytes=0, timer=no_timing) == chosen == kernels.prefetch()
        other = next(ahead for ahead in prefetch.CANDIDATES if ahead not in (0, chosen))
        seconds = {ahead: 0.5 if ahead == other else 1.0 for ahead in prefetch.CANDIDATES}
        assert prefetch.tune(model, tmp_path, again=True, least_bytes=0, timer=lambda _: seconds) == other  # /calibrate
        assert json.loads(kept.read_text())["ahead"] == other
        unwritable = tmp_path / "unwritable"
        unwritable.mkdir()
        (unwritable / "calibration").write_text("a file where the directory would go")
        assert prefetch.tune(model, unwritable, least_bytes=0, timer=lambda _: seconds) == other  # still serves
    finally:
        kernels.prefetch(0)


@pytest.mark.parametrize(("seconds", "taken"), [({0: 1.0, 4096: 0.98, 8192: 0.99, 16384: 1.2}, 0),
                                                 ({0: 1.0, 4096: 0.96, 8192: 0.9, 16384: 0.95}, 8192)])
def test_another_distance_is_taken_only_where_it_saves_more_than_the_timings_noise(tmp_path, seconds, taken):
    from models.formats import prefetch

    model = block_model()
    try:
        assert prefetch.tune(model, tmp_path, least_bytes=0, timer=lambda _: seconds) == taken
    finally:
        kernels.prefetch(0)
