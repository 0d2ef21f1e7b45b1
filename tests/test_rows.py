"""specchat::gguf_rows (kernels/csrc/rows.cpp): rows of a GGUF tensor's blocks dequantized exactly as gguf-py's
reference dequantizes them, for every format the kernels take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from tests.test_kernels import dequantized, random_blocks

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")


@pytest.mark.parametrize("block_type", list(kernels.BLOCKS))
def test_rows_equal_the_reference_dequantization_bit_for_bit(block_type):
    rows, cols = 37, 768
    raw = random_blocks(block_type, rows, cols, seed=7)
    reference = torch.from_numpy(dequantized(raw, block_type, cols).astype(np.float32))
    ids = torch.tensor([[5, 0, 36], [5, 17, 2]])  # any shape, repeats, first and last rows
    got = kernels.rows(torch.from_numpy(raw), ids, block_type, cols)
    assert got.shape == (2, 3, cols) and got.dtype == torch.float32
    assert torch.equal(got, reference[ids])
    every = kernels.rows(torch.from_numpy(raw), torch.arange(rows), block_type, cols)
    assert torch.equal(every, reference)


def test_no_ids_give_no_rows_and_int32_ids_are_taken():
    raw = torch.from_numpy(random_blocks("Q8_0", 4, 64))
    assert kernels.rows(raw, torch.zeros(0, dtype=torch.long), "Q8_0", 64).shape == (0, 64)
    assert torch.equal(kernels.rows(raw, torch.tensor([3, 1], dtype=torch.int32), "Q8_0", 64),
                       kernels.rows(raw, torch.tensor([3, 1]), "Q8_0", 64))


def test_bad_ids_and_shapes_are_refused_with_the_reason():
    raw = torch.from_numpy(random_blocks("Q5_0", 4, 64))
    with pytest.raises(RuntimeError, match="index 4 is out of range for 4 rows"):
        kernels.rows(raw, torch.tensor([0, 4]), "Q5_0", 64)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.rows(raw, torch.tensor([-1]), "Q5_0", 64)
    with pytest.raises(RuntimeError, match="do not fill the rows"):
        kernels.rows(raw, torch.tensor([0]), "Q5_0", 96)
    with pytest.raises(RuntimeError, match="integer"):
        kernels.rows(raw, torch.tensor([0.0]), "Q5_0", 64)


def test_the_op_has_a_fake_implementation_for_compiled_steps():
    raw = torch.from_numpy(random_blocks("Q4_K", 8, 256))
    torch.library.opcheck(torch.ops.specchat.gguf_rows.default, (raw, torch.tensor([[1, 7]]), 12, 256))
