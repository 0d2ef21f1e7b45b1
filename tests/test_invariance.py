"""Row invariance: the probe that finds the target path on which a verify rounds as the steps do, the padded
one-token step, the row-by-row attention, and what the app claims where identity is not exact."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

from app import calibration
from app.engine import Engine
from chat.oneshot import run_oneshot
from chat.render import ComparisonRow, banner, comparison_table
from chat.session import ChatSession, ChatSettings, ModelInfo
from models import invariance, row_attention
from models.formats.layers import replace_layers
from models.invariance import LONE_ROW, ROWS, Invariance, TargetPath
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig, Stats
from sampling.drafters.model import ModelDrafter
from sampling.speculative import Speculative
from tests.helpers import load_tiny_pair, noisy_copy, tiny_model
from utils.runner import CachedModel

PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]


class RowByRow(nn.Module):
    """A linear layer computed one row at a time, so row-invariant on any CPU by construction; `lone` is added to a
    lone row and `per_row` times the row count to every row: the two ways real kernels break invariance; `wide` to
    every row of more than 32 (a GEMM that blocks a long prompt otherwise than a verify)."""

    def __init__(self, linear: nn.Linear, lone: float = 0.0, per_row: float = 0.0, wide: float = 0.0):
        super().__init__()
        self.linear, self.lone, self.per_row, self.wide = linear, lone, per_row, wide
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    def forward(self, x):
        rows = x.shape[-2]
        out = torch.cat([self.linear(x[..., i : i + 1, :]) for i in range(rows)], dim=-2)
        return out + (self.lone if rows == 1 else 0.0) + self.per_row * rows + (self.wide if rows > 32 else 0.0)


def invariant_model(dtype=torch.float32, **breaks) -> nn.Module:
    """A tiny float32 Llama whose linears are `RowByRow`; `breaks` (lone, per_row) go to its down projections."""
    model = tiny_model(dtype=dtype, layers=2, hidden=32)
    replace_layers(model, nn.Linear, RowByRow)
    for layer in model.model.layers:
        layer.mlp.down_proj = RowByRow(layer.mlp.down_proj.linear, **breaks)
    return model


def test_a_padded_step_gives_the_same_logits_and_cache_as_a_plain_one():
    model = tiny_model()
    plain, padded = CachedModel(model), CachedModel(model)
    padded.min_rows = 2
    padded.keep_hidden(), plain.keep_hidden()
    with torch.inference_mode():
        for lm in (plain, padded):
            lm.forward(PROMPT)
        for token in (3, 7, 11):
            a, b = plain.forward([token]), padded.forward([token])
            assert b.shape == (1, model.config.vocab_size)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert padded.tokens == plain.tokens == PROMPT + [3, 7, 11]
        assert padded.cache.get_seq_length() == len(padded.tokens)  # the spare rows were cropped
        assert padded.hidden.shape == plain.hidden.shape
        torch.testing.assert_close(padded.hidden, plain.hidden, rtol=0, atol=1e-12)
        padded.crop(len(PROMPT) + 1)  # rollback: the next logits are a fresh forward's
        fresh = CachedModel(model)
        torch.testing.assert_close(padded.forward([7]), fresh.forward(PROMPT + [3, 7])[-1:], rtol=0, atol=1e-12)


def test_rowwise_attention_equals_sdpa_for_chains_and_trees():
    model = tiny_model()
    sdpa, rowwise = CachedModel(model), CachedModel(copy.deepcopy(model))
    assert invariance.apply(rowwise, TargetPath(row_attention.NAME, 1))
    with torch.inference_mode():
        for lm in (sdpa, rowwise):
            lm.forward(PROMPT)
        torch.testing.assert_close(rowwise.forward([1, 2, 3, 4], logits_rows=4),
                                   sdpa.forward([1, 2, 3, 4], logits_rows=4), rtol=0, atol=1e-10)
        parents = [-1, -1, 0, 0, 2]
        torch.testing.assert_close(rowwise.extend_tree(PROMPT, [6, 9, 12, 15, 18], parents),
                                   sdpa.extend_tree(PROMPT, [6, 9, 12, 15, 18], parents), rtol=0, atol=1e-10)


def test_rowwise_attention_gives_each_row_the_layout_a_lone_step_gives_it(monkeypatch):
    """Regression: the row loop (bfloat16, float64, no kernels) multiplied a view of the query whose strides grew with
    the number of query rows; a bf16 GEMM may take another path for another layout (SmolLM2 on an AMX Xeon: no exact
    path). Every operand of a row's products now has the layout it has in the step that decodes that row alone."""
    layouts: list[tuple] = []
    matmul = torch.matmul

    def recording(a, b):
        layouts.append((a.shape, a.stride(), b.shape, b.stride()))
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", recording)
    heads, key_heads, width, length = 9, 3, 8, 12
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, 4, width, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(1, key_heads, length, width, generator=generator, dtype=torch.float64) for _ in "kv")
    verify, _ = row_attention.rowwise_attention(None, query, key, value, None)
    verify_layouts, layouts[:] = layouts[-2:], []  # the last row's two products
    step, _ = row_attention.rowwise_attention(None, query[:, :, -1:].clone(), key, value, None)
    assert layouts == verify_layouts
    assert torch.equal(step[:, 0], verify[:, -1])


def test_the_probe_finds_an_exact_path_on_invariant_layers_and_speculative_output_is_then_identical():
    target = CachedModel(invariant_model())
    found = invariance.probe(target)
    assert found.exact, found.tried
    assert found.layers and set(found.layers.values()) == {invariance.EXACT}
    assert list(found.tried.values())[-1] == invariance.EXACT and found.reasons == ()
    assert (target.model.config._attn_implementation, target.min_rows) == (found.path.attention, found.path.step_rows)
    drafter = CachedModel(noisy_copy(target.model))
    config = DecodeConfig(max_new_tokens=40)
    reference = Autoregressive(target).generate(PROMPT, config).token_ids
    result = Speculative(target, ModelDrafter(drafter, target.vocab_size, alternatives=2, max_tree=6), 5).generate(
        PROMPT, config)
    assert result.token_ids == reference
    assert result.stats.accepted > 0  # the drafter drafted: the verify rows were compared with real tokens


def test_a_kernel_that_computes_a_lone_row_otherwise_makes_steps_run_as_two_rows():
    target = CachedModel(invariant_model(lone=1e-3))
    found = invariance.probe(target)
    assert found.exact and found.path.step_rows == 2 and target.min_rows == 2
    assert found.layers["down_proj"] == LONE_ROW and found.layers["q_proj"] == invariance.EXACT
    assert all(verdict != invariance.EXACT for path, verdict in found.tried.items() if "1 row" in path)


def test_a_kernel_whose_rows_depend_on_their_count_is_named_and_identity_is_not_claimed():
    target = CachedModel(invariant_model(per_row=1e-3))
    found = invariance.probe(target)
    assert not found.exact and found.layers["down_proj"] == ROWS
    assert found.path == TargetPath("sdpa", 1)  # the default path, none being exact
    assert "down_proj" in found.reasons[0] and "NOT exact" in found.summary
    assert len(found.tried) == len(invariance.ATTENTION) * len(invariance.STEP_ROWS)
    assert all(verdict.startswith("a verify of ") for verdict in found.tried.values())


def test_a_kernel_whose_rows_differ_only_in_a_long_prefill_is_named_not_the_attention():
    """Regression: the linear layers were fed at most 20 rows, so one whose rows change past 32 (the first round's
    prompt with its drafts: 84 in the probe) passed alone and the probe blamed the attention."""
    found = invariance.probe(CachedModel(invariant_model(wide=1e-3)))
    assert not found.exact and found.layers["down_proj"] == ROWS and found.layers["q_proj"] == invariance.EXACT
    assert "down_proj" in found.reasons[0] and "attention" not in found.reasons[0]
    assert any(verdict.startswith("a prefill of ") for verdict in found.tried.values())  # the one forward past 32


def test_the_record_is_kept_reused_and_probed_again_when_damaged(tmp_path):
    target = CachedModel(invariant_model(lone=1e-3))
    key = {"target": "tiny", "cpu": "test"}
    first, probed = calibration.probe(tmp_path, target, key)
    assert probed and first.exact
    target.min_rows = 1
    again, probed = calibration.probe(tmp_path, target, key)
    assert not probed and again == first and target.min_rows == 2  # the kept path is applied
    calibration.key_file(tmp_path, key, "invariance").write_text('{"schema": 1, "key": {}, "invar')
    _, probed = calibration.probe(tmp_path, target, key)
    assert probed


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("invariance"))


NOT_EXACT = Invariance(False, TargetPath("sdpa", 1), {"sdpa attention, one-token steps as 1 row": "a verify of 2 "
                                                      "tokens differs from the steps"}, {"down_proj": ROWS})


def test_where_identity_is_not_exact_the_json_claims_no_greedy_losslessness(pair):
    session = ChatSession(Engine.from_pair(pair),
                          ChatSettings(strategies=("speculative", "autoregressive"), max_new_tokens=8))
    info = ModelInfo("t", "d", "float32", "cpu")

    def results() -> dict:
        out = io.StringIO()
        run_oneshot(session, info, "hello", Console(file=io.StringIO()), out)
        return json.loads(out.getvalue())

    session.engine.identity = NOT_EXACT
    data = results()
    claims = {r["strategy"]: (r["lossless"], r["greedy_identity"]) for r in data["results"]}
    assert claims == {"speculative": (False, "not exact on this machine"), "autoregressive": (True, None)}
    assert data["greedy_identity"]["exact"] is False and "down_proj" in data["greedy_identity"]["reasons"][0]
    session.engine.identity = Invariance(True, TargetPath("eager", 2))
    claims = {r["strategy"]: (r["lossless"], r["greedy_identity"]) for r in results()["results"]}
    assert claims["speculative"] == (True, "exact")


def test_the_banner_and_the_table_say_when_identity_is_not_exact(pair):
    session = ChatSession(Engine(pair.target.model, pair.target.tokenizer, end_ids=pair.end_ids),
                          ChatSettings(strategies=("autoregressive",)))
    session.engine.identity = NOT_EXACT
    console = Console(width=200, record=True, color_system=None, file=io.StringIO())
    console.print(banner(ModelInfo("t", None, "float32", "cpu"), session, False))
    rows = [ComparisonRow("autoregressive", Stats(), [1, 2, 3]),
            ComparisonRow("speculative", Stats(), [1, 2, 4], identity="not exact on this machine")]
    console.print(comparison_table(rows))
    text = console.export_text()
    assert "greedy: NOT exact on this machine" in text and "down_proj" in text
    assert "NO: greedy identity is not exact on this machine" in text
    rows[1] = ComparisonRow("speculative", Stats(), [1, 2, 4], identity="exact")  # a real bug: no excuse printed
    console.print(comparison_table(rows))
    again = console.export_text()
    assert "NO" in again and "NO: greedy identity" not in again
