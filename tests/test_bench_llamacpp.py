"""benchmarks.llamacpp: llama.cpp's own timings read from its logs, and the commands it is run with."""

from pathlib import Path

import pytest

import kernels
from benchmarks.llamacpp import (
    LlamaCpp,
    binary,
    build,
    missing_reason,
    parse_completion_log,
    parse_speculative_log,
    version,
)
from sampling.base import DecodeConfig
from utils.logits_processor import make_processor

COMPLETION_LOG = """
0.07.717.449 I common_perf_print:        load time =    1284.15 ms
0.07.717.454 I common_perf_print: prompt eval time =    1283.67 ms /    38 tokens (   33.78 ms per token,    29.60 tokens per second)
0.07.717.476 I common_perf_print:        eval time =    2735.94 ms /    31 runs   (   88.26 ms per token,    11.33 tokens per second)
0.07.717.476 I common_perf_print:       total time =    4036.35 ms /    69 tokens
"""  # noqa: E501 (llama.cpp's own lines)

SPECULATIVE_LOG = """
0.11.462.764 I encoded   38 tokens in    2.239 seconds, speed:   16.970 t/s
0.11.462.797 I decoded   36 tokens in    5.402 seconds, speed:    6.665 t/s
0.11.462.841 I n_draft   = 3
0.11.462.862 I n_predict = 36
0.11.462.881 I n_drafted = 30
0.11.462.901 I n_accept  = 26
"""


def test_completion_timings_count_the_token_sampled_from_the_prompt():
    t = parse_completion_log(COMPLETION_LOG)
    assert (t.prompt_seconds, t.generate_seconds, t.generated) == (pytest.approx(1.28367), pytest.approx(2.73594), 32)


def test_speculative_timings_and_draft_counts():
    t = parse_speculative_log(SPECULATIVE_LOG)
    assert (t.prompt_seconds, t.generate_seconds, t.generated, t.drafted, t.accepted) == (
        pytest.approx(2.239), pytest.approx(5.402), 36, 30, 26)


def test_a_log_without_timings_is_an_error_that_quotes_it():
    with pytest.raises(ValueError, match="printed no timings; its log ends: boom"):
        parse_completion_log("boom")
    with pytest.raises(ValueError, match="printed no summary"):
        parse_speculative_log("failed to initialize speculative decoding")


def test_commands_use_the_same_threads_greedy_and_the_draft_model(tmp_path):
    args = dict(threads=2, render=str, tokenize=lambda text: [], end_ids=(0,))
    plain = LlamaCpp("llamacpp", Path("llama-completion"), Path("t.gguf"), None, **args)
    command = plain.command(tmp_path / "p.txt", DecodeConfig(max_new_tokens=64, processor=make_processor(0)))
    assert command[command.index("-n") + 1] == "64" and command[command.index("-t") + 1] == "2"
    assert command[command.index("--temp") + 1] == "0" and "-no-cnv" in command and "-md" not in command
    spec = LlamaCpp("llamacpp_speculative", Path("llama-speculative-simple"), Path("t.gguf"), Path("d.gguf"), **args)
    command = spec.command(tmp_path / "p.txt", DecodeConfig(max_new_tokens=8, processor=make_processor(0.7, top_p=0.9),
                                                            seed=3))
    assert command[command.index("-md") + 1] == "d.gguf" and command[command.index("-td") + 1] == "2"
    assert command[command.index("--spec-type") + 1] == "draft-simple"
    assert command[command.index("--temp") + 1] == "0.7" and command[command.index("--top-p") + 1] == "0.9"
    assert command[command.index("--seed") + 1] == "3"
    with pytest.raises(ValueError, match="needs the drafter's GGUF"):
        LlamaCpp("llamacpp_speculative", Path("x"), Path("t.gguf"), None, **args)


def test_unbuilt_binaries_name_the_setup_step(tmp_path):
    assert "./setup.sh --llamacpp" in missing_reason(tmp_path, "llamacpp")
    built = tmp_path / f"llama.cpp-{version()}" / "bin"
    built.mkdir(parents=True)
    (built / "llama-completion").write_text("")
    assert missing_reason(tmp_path, "llamacpp") is None


@pytest.mark.skipif("avx2" not in kernels.isas() or kernels.isas()[0] == "avx2",
                    reason="needs a CPU that runs more than the AVX2 kernels")
def test_our_avx2_kernels_are_compared_with_llamacpps_avx2_build(tmp_path):
    try:
        kernels.use("avx2")
        assert build() == "avx2"
        assert binary(tmp_path, "llamacpp").parent.parent.name == f"llama.cpp-{version()}-avx2"
        assert "./setup.sh --llamacpp avx2" in missing_reason(tmp_path, "llamacpp")
    finally:
        kernels.use()
    assert build() == ""
    assert binary(tmp_path, "llamacpp").parent.parent.name == f"llama.cpp-{version()}"
