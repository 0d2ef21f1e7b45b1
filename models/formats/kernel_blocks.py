"""The two formats that run on the project's kernels: a GGUF's own blocks (`gguf`) and Q8_0 blocks quantized from a
dense checkpoint at load (`q8_0`). Both keep float32 around their blocks, and prefill on the same kernels."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

import kernels
from models.formats import blocks, prefetch
from models.formats.base import Loaded, LoadJob, WeightFormat, apply_file_weights
from utils.errors import ModelLoadError


class GgufBlocks(WeightFormat):
    name = "gguf"
    packs_model = False  # its linears are blocks; no dense copy either

    def read_dtype(self, job: LoadJob) -> torch.dtype | str:
        # the converted copy's own dtype, so the same values; mapped, not read, until used, and widened once the
        # linears and the embedding are blocks: their dense weights are never read
        return torch.bfloat16

    def load(self, model: PreTrainedModel, job: LoadJob) -> Loaded:
        apply_file_weights(model, blocks.apply, str(job.gguf_file()),
                           f"{', '.join(kernels.BLOCKS)} weights. Fix: use int4 for other types.")
        loaded = Loaded()
        if job.smaller:
            loaded.smaller = len(blocks.requantize(model, "Q4_0"))
            loaded.requantized = len(blocks.quantize_dense(model))
        model.float()  # norms and biases (and a layer in another type); the blocks are uint8 and stay
        _join_and_tune(model, job)
        return loaded

    def describe(self, model: PreTrainedModel, loaded: Loaded) -> str:
        kinds = sorted({m.block_type for m in model.modules()
                        if isinstance(m, (blocks.BlockLinear, blocks.BlockEmbedding))})
        rest = f", {loaded.requantized} layers of other types as Q8_0" if loaded.requantized else ""
        rest += f", {loaded.smaller} layers of wider types again as Q4_0" if loaded.smaller else ""
        return (f"the GGUF's own {', '.join(kinds)} blocks{rest} ({kernels.isa()} kernels {kernels.build_id()}, "
                "int8 activations), the rest float32")


class Q8_0Blocks(WeightFormat):
    name = "q8_0"
    packs_model = False

    def read_dtype(self, job: LoadJob) -> torch.dtype | str:
        return "auto"  # quantized from the checkpoint's own values

    def load(self, model: PreTrainedModel, job: LoadJob) -> Loaded:
        if not blocks.quantize_dense(model):
            raise ModelLoadError(f"{job.name} has no linear layer whose inputs are whole blocks of 32. Fix: use int4.")
        model.float()  # norms and biases (and a layer the blocks do not fit); the blocks are uint8 and stay
        _join_and_tune(model, job)
        return Loaded()

    def describe(self, model: PreTrainedModel, loaded: Loaded) -> str:
        return (f"Q8_0 blocks quantized at load ({kernels.isa()} kernels {kernels.build_id()}, int8 activations), "
                "the rest float32")


def _join_and_tune(model: PreTrainedModel, job: LoadJob) -> None:
    blocks.join_siblings(model)  # q, k, v and gate, up: one kernel call each where their kinds agree
    prefetch.tune(model, job.cache_root)  # how far ahead the kernels read: this machine's kept choice, else timed
