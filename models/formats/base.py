"""The one interface every weight format gives the loader: what it reads, how it turns a loaded model's weights into
its own (`load`), which weights oneDNN then packs (`pack`), and its line in the banner (`describe`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from models.formats.prepack import available as prepack_available
from models.formats.prepack import is_prepacked, prepack
from utils.errors import ModelLoadError


@dataclass(frozen=True)
class LoadJob:
    """What a format is told about the model it loads."""

    name: str  # the model's name, for messages
    spec: str  # as the user gave it
    kind: str  # "embedded" | "gguf" | "directory" | "hub"
    gguf_file: Callable[[], Path | None]  # the GGUF the model was converted from (None for other kinds), found once
    cache_root: Path
    device: torch.device
    compute_dtype: torch.dtype  # the machine's (or the asked) dtype for dense weights
    activations: torch.dtype  # what the model computes in with this format (`quantize.activation_dtype`)
    keep_dense: bool = False  # keep the dense weights too (a drafter's prefill form)
    smaller: bool = False  # a drafter: its layers in wider block types again in fewer bits, others to Q8_0


@dataclass
class Loaded:
    """What `load` made besides the model: its dense prefill form, and the layers it quantized again."""

    dense: PreTrainedModel | None = None
    requantized: int = 0  # layers in types the kernels lack, quantized to Q8_0
    smaller: int = 0  # layers in wider types, quantized again to Q4_0


class WeightFormat:
    """Dense weights as read; a format overrides what differs. `name` is its `--quantize` name."""

    name = "none"
    packs_model = True  # the model's own weights go to oneDNN's layout (else only its dense copy's)

    def read_dtype(self, job: LoadJob) -> torch.dtype | str:
        """The dtype `from_pretrained` reads the checkpoint in ("auto": its own)."""
        return job.activations

    def load(self, model: PreTrainedModel, job: LoadJob) -> Loaded:
        """`model`'s weights made this format's, in place."""
        return Loaded()

    def pack(self, model: PreTrainedModel, loaded: Loaded, job: LoadJob) -> None:
        """The weights in oneDNN's layout: a verify of a few tokens costs about one step; bfloat16 ones only for the
        model itself (a drafter's bfloat16 prefill copy keeps F.linear, timed for prompts)."""
        for weights in (model, loaded.dense) if self.packs_model else (loaded.dense,):
            packs = job.activations == torch.float32 or (job.activations == torch.bfloat16 and weights is model)
            if weights is not None and packs and job.device.type == "cpu" and prepack_available(job.activations):
                prepack(weights)

    def describe(self, model: PreTrainedModel, loaded: Loaded) -> str:
        """How the weights are held and computed: "float32, oneDNN-prepacked"."""
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return dtype + (", oneDNN-prepacked" if is_prepacked(model) else "")


def apply_file_weights(model: PreTrainedModel, apply: Callable[[PreTrainedModel, str], list[str]], gguf: str,
                       none_found: str) -> None:
    """`apply` (a format's) the GGUF's own tensors to `model`; its refusal or finding none, as a ModelLoadError."""
    try:
        replaced = apply(model, gguf)
    except ValueError as error:
        raise ModelLoadError(f"{error}. Fix: load the model from that GGUF file itself.") from None
    if not replaced:
        raise ModelLoadError(f"{gguf} holds no {none_found}")
