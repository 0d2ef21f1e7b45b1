"""benchmarks/kld.py without llama.cpp or the real models: llama-perplexity's output parsed from a captured run, its
--kl-divergence-base file read back, and the F32 GGUF written from a tiny quantized one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

from benchmarks.kld import (
    chunked_targets,
    closeness,
    closeness_to_base,
    parse_kld_log,
    parse_perplexity_log,
    read_base_logits,
    write_f32,
)
from tests.helpers import random_q4k

# llama-perplexity --kl-divergence (llama.cpp 11434.0.0, -c 512, 2 threads, AVX-512 EPYC), the target's Q4_K_M GGUF
# against its F32 copy, as captured: the stderr line naming the chunks (with its timestamp), then stdout's tables
KLD_LOG = """\
0.13.472.596 I kl_divergence: computing over 2 chunks, n_ctx=512, batch_size=2048, n_seq=4
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1       4.7553 ±    0.6669      -0.00366 ±    0.00333       0.00100 ±    0.00009     1.078 ±  0.121 %    98.431 ±  0.780 %
   2       7.0466 ±    0.7836      -0.00094 ±    0.00279       0.00155 ±    0.00009     1.063 ±  0.086 %    98.039 ±  0.615 %

====== Perplexity statistics ======
Mean PPL(Q)                   :   7.046605 ±   0.783568
Mean PPL(base)                :   7.053200 ±   0.784478
Cor(ln(PPL(Q)), ln(PPL(base))):  99.97%
Mean ln(PPL(Q)/PPL(base))     :  -0.000936 ±   0.002792
Mean PPL(Q)/PPL(base)         :   0.999065 ±   0.002789
Mean PPL(Q)-PPL(base)         :  -0.006595 ±   0.019702

====== KL divergence statistics ======
Mean    KLD:   0.001554 ±   0.000091
Maximum KLD:   0.015793
99.9%   KLD:   0.015075
99.0%   KLD:   0.010443
95.0%   KLD:   0.005457
90.0%   KLD:   0.003655
Median  KLD:   0.000864
10.0%   KLD:   0.000025
 5.0%   KLD:   0.000003
 1.0%   KLD:  -0.000002
 0.1%   KLD:  -0.000015
Minimum KLD:  -0.000018

====== Token probability statistics ======
Mean    Δp:  0.053 ± 0.047 %
Maximum Δp:  7.405%
99.9%   Δp:  5.772%
99.0%   Δp:  3.467%
95.0%   Δp:  1.591%
90.0%   Δp:  1.124%
75.0%   Δp:  0.340%
Median  Δp:  0.001%
25.0%   Δp: -0.216%
10.0%   Δp: -0.935%
 5.0%   Δp: -1.565%
 1.0%   Δp: -2.636%
 0.1%   Δp: -6.049%
Minimum Δp: -7.418%
RMS Δp    :  1.063 ± 0.086 %
Same top p: 98.039 ± 0.615 %
"""  # noqa: E501

# the --kl-divergence-base run on the F32 copy, as captured: stdout's last line, then stderr's last two, run together
# where stdout printed their ends
BASE_LOG = """\
[1]4.7727,[2]7.0532,
1.56.642.835 I perplexity: 78.78 seconds per pass - ETA 1.57.646.951 I Final estimate: PPL = 7.0532 +/- 0.78448
"""


def test_the_kl_divergence_summary_is_read_from_llama_perplexitys_output():
    got = parse_kld_log(KLD_LOG)
    assert got.positions == 2 * 255  # each chunk scores its second half but the last token
    assert got.top1 == pytest.approx(0.98039)
    assert got.kl == pytest.approx(0.001554)
    assert (got.perplexity, got.reference_perplexity) == (pytest.approx(7.046605), pytest.approx(7.053200))
    assert parse_perplexity_log(BASE_LOG) == pytest.approx(7.0532)
    with pytest.raises(ValueError, match="no KL-divergence summary"):
        parse_kld_log(KLD_LOG.split("======")[0])
    with pytest.raises(ValueError, match="no perplexity"):
        parse_perplexity_log("perplexity: tokenizing the input ..")


def write_base_file(path, tokens: list[int], context: int, log_probs: np.ndarray) -> None:
    """A --kl-divergence-base file as llama-perplexity writes it (log_softmax in tools/perplexity/perplexity.cpp)."""
    vocab = log_probs.shape[1]
    with open(path, "wb") as out:
        out.write(b"_logits_" + np.array([context, vocab, len(tokens) // context], np.int32).tobytes())
        out.write(np.array(tokens, np.int32).tobytes())
        for row in log_probs:
            low = max(row.min(), row.max() - 16)
            scale = (row.max() - low) / 65535
            codes = np.where(row > low, np.rint((row - low) / scale), 0).astype(np.uint16)
            out.write(np.array([scale, low], np.float32).tobytes() + codes.tobytes()
                      + np.zeros(2 * ((vocab + 1) // 2) - vocab, np.uint16).tobytes())


def test_a_base_file_reads_back_and_a_model_equal_to_it_is_at_no_distance(tmp_path):
    context, vocab = 8, 11  # an odd vocabulary: rows are padded to an even count
    tokens = [i % vocab for i in range(2 * context)]
    logits = torch.randn(2 * (context - 1 - context // 2), vocab, generator=torch.Generator().manual_seed(0)) * 3
    log_probs = logits.log_softmax(-1)
    write_base_file(tmp_path / "base.kld", tokens, context, log_probs.numpy())
    read_tokens, read = read_base_logits(tmp_path / "base.kld")
    assert read_tokens == tokens
    torch.testing.assert_close(read, log_probs, atol=16 / 65535, rtol=0)
    targets = chunked_targets(tokens, context)
    assert targets == [5, 6, 7, 2, 3, 4]
    same = closeness_to_base(read, logits, targets)
    assert same.top1 == 1 and abs(same.kl) < 1e-3 and same.perplexity == pytest.approx(same.reference_perplexity,
                                                                                        rel=1e-3)
    other = closeness(logits, logits.flip(-1), targets)
    assert other.kl > 0.1 and other.top1 < 1 and other.reference_perplexity == pytest.approx(same.perplexity)


def test_the_f32_copy_holds_the_files_weights_dequantized_and_its_metadata(tmp_path):
    rng = np.random.default_rng(0)
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    tensors = {"token_embd.weight": (random_q4k(3, 256, seed=1), GGMLQuantizationType.Q4_K),
               "blk.0.attn_q.weight": (q8, GGMLQuantizationType.Q8_0),
               "blk.0.attn_norm.weight": (rng.standard_normal(64).astype(np.float32), None)}
    writer = GGUFWriter(str(tmp_path / "q.gguf"), arch="qwen2")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_token_list(["a", "b", "<|im_end|>"])
    writer.add_token_scores([0.0, -1.0, -2.0])
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    written = write_f32(tmp_path / "q.gguf", tmp_path / "f32.gguf")
    source, copy = GGUFReader(str(tmp_path / "q.gguf")), GGUFReader(str(written))
    for tensor in source.tensors:
        (got,) = [t for t in copy.tensors if t.name == tensor.name]
        assert got.tensor_type == GGMLQuantizationType.F32 and list(got.shape) == list(tensor.shape)
        np.testing.assert_array_equal(np.asarray(got.data), dequantize(tensor.data, tensor.tensor_type))
    assert copy.fields["general.file_type"].contents() == LlamaFileType.ALL_F32
    for name in ("general.architecture", "general.name", "qwen2.block_count", "tokenizer.ggml.tokens",
                 "tokenizer.ggml.scores"):
        assert copy.fields[name].contents() == source.fields[name].contents(), name
    assert copy.fields["tokenizer.ggml.tokens"].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert not (tmp_path / "f32.gguf.partial").exists()
    assert write_f32(tmp_path / "q.gguf", written) == written  # kept: not written again
