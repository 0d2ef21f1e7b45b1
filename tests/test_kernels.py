"""The GGUF block kernels (kernels/): every format against a float64 dequantize-and-matmul on random blocks, and each
row's bits independent of the number of rows and of the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")


@pytest.fixture(params=kernels.isas() or ["none"])
def isa(request):
    """Each instruction set's kernels this CPU runs, in turn; the best one again afterwards."""
    kernels.use(request.param)
    yield request.param
    kernels.use()


def random_blocks(block_type: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `block_type`'s layout, (rows, bytes per row), with finite small fp16 scales."""
    rng = np.random.default_rng(seed)
    _, per_block, block_bytes = kernels.BLOCKS[block_type]
    count = rows * cols // per_block
    raw = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)

    def half(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, (count, 1)).astype(np.float16).view(np.uint8)

    if block_type == "Q4_K":
        raw[:, 0:2], raw[:, 2:4] = half(1e-3, 2e-2), half(1e-3, 2e-2)  # d, dmin
    elif block_type == "Q6_K":
        raw[:, 208:210] = half(-2e-2, 2e-2)
    else:
        raw[:, 0:2] = half(-2e-2, 2e-2)
    return raw.reshape(rows, -1)


def dequantized(raw: np.ndarray, block_type: str, cols: int) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(raw, GGMLQuantizationType[block_type]).reshape(len(raw), cols).astype(np.float64)


def int8_rows(x: np.ndarray, group: int) -> np.ndarray:
    """x as the kernels round it: int8 per `group` values, scale max|x| / 127 (float32), in float64."""
    groups = x.reshape(len(x), -1, group)
    top = np.abs(groups).max(-1, keepdims=True)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(groups * inverse), -127, 127)
    return (codes * (top / np.float32(127)).astype(np.float32)).astype(np.float64).reshape(x.shape)


@pytest.mark.parametrize("block_type", list(kernels.BLOCKS))
@pytest.mark.parametrize("rows", [1, 3, 16, 21])  # one step, a verify, a full tile, prefill past a tile
@pytest.mark.parametrize("out_features", [24, 48])  # 48: whole tiles of 16 columns for the AMX kernels
def test_each_format_matches_a_float64_dequantize_and_matmul(isa, block_type, rows, out_features):
    in_features = 512
    raw = random_blocks(block_type, out_features, in_features)
    weight = dequantized(raw, block_type, in_features)
    x = np.random.default_rng(1).standard_normal((rows, in_features)).astype(np.float32)
    bias = np.random.default_rng(2).standard_normal(out_features).astype(np.float32)
    got = kernels.matmul(torch.from_numpy(x), torch.from_numpy(raw), block_type, out_features,
                         torch.from_numpy(bias)).double().numpy()
    same_inputs = int8_rows(x, 32) @ weight.T + bias  # what the kernel computes, in float64
    exact = x.astype(np.float64) @ weight.T + bias
    size = np.abs(exact).max()
    assert np.abs(got - same_inputs).max() <= 1e-5 * size  # float32 sums of exact integer dot products
    assert np.abs(got - exact).max() <= 3e-2 * size  # the int8 rounding of the activations


@pytest.mark.parametrize("block_type", list(kernels.BLOCKS))
@pytest.mark.parametrize("in_features", [96, 768])  # Q5_0 and Q8_0: 96 is not whole units of 128 for AVX-512
@pytest.mark.parametrize("out_features", [41, 64])  # 64: whole tiles of 16 columns for the AMX kernels
def test_a_row_has_the_same_bits_whatever_the_rows_beside_it_and_the_threads(isa, block_type, in_features,
                                                                              out_features):
    if in_features % kernels.BLOCKS[block_type][1]:
        pytest.skip(f"{block_type} blocks do not fill {in_features} inputs")
    raw = torch.from_numpy(random_blocks(block_type, out_features, in_features, seed=3))
    x = torch.randn(290, in_features, generator=torch.Generator().manual_seed(4))  # prefill past 256 rows a call
    alone = torch.cat([kernels.matmul(x[i : i + 1], raw, block_type, out_features) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 9, 13, 16, 17, 20, 29, 32, 37, 290):
        assert torch.equal(kernels.matmul(x[:rows], raw, block_type, out_features), alone[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernels.matmul(x, raw, block_type, out_features)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, alone)


@pytest.mark.parametrize("block_type", list(kernels.BLOCKS))
@pytest.mark.parametrize("in_features", [512, 96])  # 96: Q5_0 and Q8_0 rows that are not whole units of 128
@pytest.mark.parametrize("out_features", [7, 32])  # 32: the AMX kernels' tiles of 16 rows
def test_packing_keeps_every_bit_and_lookups_read_the_packed_rows(isa, block_type, in_features, out_features):
    if in_features % kernels.BLOCKS[block_type][1]:
        pytest.skip(f"{block_type} blocks do not fill {in_features} inputs")
    raw = torch.from_numpy(random_blocks(block_type, out_features, in_features, seed=7))
    packed, type_id = kernels.pack(raw, block_type)
    # the AVX-512 kernels (and the AMX ones, for what they leave to them) read every type packed, AVX2 all but Q8_0
    repacks = in_features % 128 == 0 and (isa != "avx2" or block_type != "Q8_0")
    tiled = (isa in ("amx-int8", "avx512-tiles") and out_features % 16 == 0
             and (block_type in ("Q4_K", "Q6_K") or block_type == "Q4_0" and in_features % 128 == 0))
    assert (type_id in kernels.PACKED) == repacks and (packed is raw) != repacks
    assert (type_id > 512) == tiled
    assert torch.equal(kernels.unpack(packed, type_id), raw)
    ids = torch.tensor([[6, 0], [3, 3]]) if out_features < 16 else torch.tensor([[31, 0], [17, 17]])
    assert torch.equal(torch.ops.specchat.gguf_rows(packed, ids, type_id, in_features),
                       torch.from_numpy(dequantized(raw.numpy(), block_type, in_features)).float()[ids])


@pytest.mark.skipif("avx512-vnni" not in kernels.isas(), reason="the CPU runs no AVX-512 VNNI")
def test_weights_packed_for_one_instruction_set_are_refused_by_another_with_the_reason():
    try:
        kernels.use("avx512-vnni")
        packed, type_id = kernels.pack(torch.from_numpy(random_blocks("Q8_0", 4, 256)), "Q8_0")
        kernels.use("avx2")  # it reads Q8_0 in the file's blocks only
        with pytest.raises(RuntimeError, match="packed for the avx512-vnni kernels"):
            torch.ops.specchat.gguf_mm(torch.randn(1, 256), packed, type_id, 4, None)
    finally:
        kernels.use()


@pytest.mark.skipif("avx512-vnni" not in kernels.isas(), reason="the CPU runs no AVX-512 VNNI")
@pytest.mark.parametrize("block_type", ["Q4_K", "Q6_K", "Q4_0", "Q5_0"])
def test_the_avx2_kernels_read_the_avx512_layouts_and_q4_k_gets_the_same_bits(block_type):
    raw = torch.from_numpy(random_blocks(block_type, 9, 512, seed=11))
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(12))
    try:
        kernels.use("avx512-vnni")
        packed, type_id = kernels.pack(raw, block_type)
        wide = torch.ops.specchat.gguf_mm(x, packed, type_id, 9, None)
        kernels.use("avx2")
        assert kernels.pack(raw, block_type)[1] == type_id
        narrow = torch.ops.specchat.gguf_mm(x, packed, type_id, 9, None)
    finally:
        kernels.use()
    # the same exact integer sums; Q4_K's float steps too, the others sum their 16 lanes as two halves of 8
    assert torch.equal(narrow, wide) if block_type == "Q4_K" else torch.allclose(narrow, wide, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("avx512-tiles" not in kernels.isas(), reason="the CPU runs no AVX-512 VNNI")
def test_weights_tiled_are_refused_by_the_kernels_that_read_lanes_with_the_reason():
    try:
        kernels.use("avx512-tiles")
        packed, type_id = kernels.pack(torch.from_numpy(random_blocks("Q6_K", 16, 256)), "Q6_K")
        assert type_id > 512
        for other in ("avx512-vnni", "avx2"):
            kernels.use(other)
            with pytest.raises(RuntimeError, match=f"packed for the {kernels.isas()[0]} kernels"):
                torch.ops.specchat.gguf_mm(torch.randn(1, 256), packed, type_id, 16, None)
    finally:
        kernels.use()


@pytest.mark.skipif("amx-int8" not in kernels.isas(), reason="the CPU runs no AMX-INT8")
@pytest.mark.parametrize("block_type", ["Q4_K", "Q6_K", "Q4_0"])
@pytest.mark.parametrize("rows", [11, 16])  # a tile of fewer rows and a full one: AMX's multiplies
def test_the_tile_layout_gives_the_same_bits_with_amx_and_with_vnni_alone(block_type, rows):
    raw = torch.from_numpy(random_blocks(block_type, 32, 512, seed=13))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(14))
    try:
        kernels.use("amx-int8")
        packed, type_id = kernels.pack(raw, block_type)
        tiles = torch.ops.specchat.gguf_mm(x, packed, type_id, 32, None)
        kernels.use("avx512-tiles")
        vnni = torch.ops.specchat.gguf_mm(x, packed, type_id, 32, None)
    finally:
        kernels.use()
    assert type_id > 512 and torch.equal(vnni, tiles)


@pytest.mark.parametrize("block_type", list(kernels.BLOCKS))
def test_how_far_ahead_the_kernels_read_changes_no_bit(isa, block_type):
    raw = torch.from_numpy(random_blocks(block_type, 32, 1024, seed=15))
    x = torch.randn(11, 1024, generator=torch.Generator().manual_seed(16))
    try:
        outputs = []
        for ahead in (0, 64, 4096, 1 << 20):
            assert kernels.prefetch(ahead) == ahead
            outputs.append([kernels.matmul(x[:rows], raw, block_type, 32) for rows in (1, 4, 11)])
        for other in outputs[1:]:
            assert all(torch.equal(got, first) for got, first in zip(other, outputs[0], strict=True))
        assert kernels.prefetch() == 1 << 20  # asked, not set
        with pytest.raises(RuntimeError, match="past any cache"):
            kernels.prefetch((1 << 20) + 1)
    finally:
        kernels.prefetch(0)


@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_0"])
def test_quantization_makes_the_blocks_ggml_makes(block_type):
    from gguf import GGMLQuantizationType, quants

    weights = torch.randn(40, 320, generator=torch.Generator().manual_seed(8)) * 0.05
    weights[3, :32] = 0  # a block of zeros: scale 0, codes 0
    weights[5, 7] = weights[5, :32].abs().max() / 127 * 2.5  # a value half way between two Q8_0 codes
    weights[6, :32] = -weights[6, :32].abs()  # Q4_0: the largest magnitude negative, its scale positive
    got = kernels.quantize(weights, block_type)
    expected = quants.quantize(weights.numpy(), GGMLQuantizationType[block_type])
    assert got.dtype == torch.uint8 and torch.equal(got, torch.from_numpy(expected))
    with pytest.raises(RuntimeError, match="whole blocks of 32"):
        kernels.quantize(torch.randn(4, 40), block_type)


def test_inputs_that_do_not_fit_the_blocks_are_refused_with_the_reason():
    raw = torch.from_numpy(random_blocks("Q8_0", 4, 64))
    with pytest.raises(RuntimeError, match="do not fill the rows"):
        kernels.matmul(torch.randn(2, 96), raw, "Q8_0", 4)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.matmul(torch.randn(2, 64, dtype=torch.float64), raw, "Q8_0", 4)


def test_the_library_is_built_once_and_found_again(tmp_path):
    from kernels.build import build, library_path

    assert library_path(tmp_path) == library_path(tmp_path)
    assert not library_path(tmp_path).exists()
    assert build().exists() and build() == library_path()  # the default one is there: the suite has loaded it


def test_without_a_compiler_the_kernels_say_why_in_one_line_and_setup_goes_on(tmp_path, monkeypatch, capsys):
    from kernels.build import main

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reason = kernels.unavailable(tmp_path / "cache")
    assert reason is not None and "\n" not in reason and "no-such-g++" in reason
    assert main() == 0 and "kernels not built" in capsys.readouterr().err


def attention_reference(q, k, v, seen):
    """float64 softmax(q k^T / sqrt(D)) v over the keys each row sees, heads grouped by key head; (B, Q, H, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def causal(rows: int, length: int) -> torch.Tensor:
    return torch.ones(rows, length, dtype=torch.bool).tril(length - rows)[None]


@pytest.mark.parametrize("masked", [False, True])
def test_row_attention_matches_a_float64_softmax_for_chains_and_trees(masked):
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, heads, rows, 64, generator=generator) for heads, rows in ((6, 5), (2, 19), (2, 19)))
    seen = causal(5, 19).repeat(2, 1, 1)
    if masked:  # a tree: rows 2 and 4 do not see the keys of rows 1 and 3, and one cached key is masked out
        seen[:, 2, 15] = seen[:, 4, 15] = seen[:, 4, 17] = seen[1, :, 3] = False
    got = kernels.row_attention(q, k, v, seen if masked else None, 64 ** -0.5)
    assert got.shape == (2, 5, 6, 64)
    torch.testing.assert_close(got.double(), attention_reference(q, k, v, seen), rtol=0, atol=2e-6)


def test_row_attention_gives_a_row_the_same_bits_whatever_the_rows_beside_it_and_the_threads():
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, heads, 40, 128, generator=generator) for heads in (12, 2, 2))
    scale = 128 ** -0.5
    alone = [kernels.row_attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], None, scale)
             for i in range(40)]
    for rows in (2, 3, 8, 17):  # the last `rows` of the first 30 keys, causal, and as a masked block past a tail
        got = kernels.row_attention(q[:, :, 30 - rows : 30], k[:, :, :30], v[:, :, :30], None, scale)
        padded = torch.zeros(1, rows, 40, dtype=torch.bool)
        padded[:, :, :30] = causal(rows, 30)
        masked = kernels.row_attention(q[:, :, 30 - rows : 30], k, v, padded, scale)
        for r in range(rows):
            assert torch.equal(got[:, r : r + 1], alone[30 - rows + r]), (rows, r)
            assert torch.equal(masked[:, r : r + 1], alone[30 - rows + r]), (rows, r)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernels.row_attention(q[:, :, 22:30], k[:, :, :30], v[:, :, :30], None, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, torch.cat(alone[22:30], dim=1))


def test_row_attention_scores_keys_four_at_a_time_and_the_rest_one_at_a_time_with_the_same_bits():
    generator = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 1, 128, generator=generator)
    k = torch.randn(1, 1, 1, 128, generator=generator).expand(1, 1, 13, 128).contiguous()  # 13 equal keys: 3 x 4 + 1
    v = torch.eye(13, 128)[None, None]  # key j's value is the unit vector j: the output is the weights themselves
    weights = kernels.row_attention(q, k, v, None, 128 ** -0.5)[0, 0, :, :13]
    assert torch.equal(weights, weights[:, :1].expand(2, 13))  # equal scores, equal weights, in the block or not


def test_row_attention_reads_keys_and_values_in_place_from_a_longer_buffer():
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, 12, 3, 128, generator=generator)
    buffer_k, buffer_v = (torch.randn(1, 2, 50, 128, generator=generator) for _ in range(2))
    k, v = buffer_k[:, :, :33], buffer_v[:, :, :33]  # a cache's view: rows whole, heads 50 rows apart
    assert not k.is_contiguous()
    got = kernels.row_attention(q, k, v, None, 128 ** -0.5)
    assert torch.equal(got, kernels.row_attention(q, k.contiguous(), v.contiguous(), None, 128 ** -0.5))
