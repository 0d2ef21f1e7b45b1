"""Hugging Face `generate` baselines, run with the same models, dtype, device, threads and decoding settings as ours.

Assisted generation reads its draft settings (`num_assistant_tokens`, `num_assistant_tokens_schedule`,
`assistant_confidence_threshold`) from the *assistant's* `generation_config` (transformers 5.23,
`AssistedCandidateGenerator.__init__`), not from `generate`'s kwargs; each baseline sets them there for its call and
restores them afterwards. The confidence threshold adapts between rounds only when scikit-learn is installed;
without it the threshold stays fixed.

Time to first token comes from a streamer: `generate` first puts the prompt, then each step's (or each verification
round's) new tokens; the time of the first put after the prompt is the first token's.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from benchmarks.contestants import Contestant
from benchmarks.names import HF_BASELINES
from models.formats.prepack import unpack
from models.formats.quantize import activation_dtype, quantize_weights, resolve_quantize
from sampling.base import DecodeConfig, Result, Stats, clip
from utils.errors import ModelLoadError
from utils.logits_processor import LogitsProcessor

ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
# HF's draft length with a quantized drafter: our draft model's default cap, as good as its best (docs/defaults.md)
LOW_BIT_DRAFT_TOKENS = 12


class TimingStreamer(BaseStreamer):
    """Records the time and size of every put after the prompt's."""

    def __init__(self):
        self.prompt_seen = False
        self.times: list[float] = []
        self.sizes: list[int] = []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


def sampling_kwargs(processor: LogitsProcessor) -> dict:
    """HF's equivalent of our processor; every value is explicit so a model's generation_config (Qwen ships
    temperature, top_k, top_p and repetition_penalty) cannot slip in."""
    common = {"repetition_penalty": 1.0, "num_beams": 1}
    if processor.is_greedy:
        return {**common, "do_sample": False}
    return {**common, "do_sample": True, "temperature": processor.temperature,
            "top_k": getattr(processor, "top_k", 0), "top_p": getattr(processor, "top_p", 1.0),
            "min_p": getattr(processor, "min_p", None)}


def hf_defaults() -> dict:
    """HF's global defaults for the assisted-generation settings (used when neither model nor user sets them)."""
    defaults = GenerationConfig._get_default_generation_params()
    return {name: defaults[name] for name in ASSISTANT_SETTINGS}


def sklearn_available() -> bool:
    return importlib.util.find_spec("sklearn") is not None


@contextlib.contextmanager
def assistant_settings(model, settings: dict) -> Iterator[None]:
    config = model.generation_config
    saved = {name: getattr(config, name, None) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@dataclass
class HFBaseline(Contestant):
    name: str
    description: str
    model: object  # the target PreTrainedModel
    pad_token_id: int | None
    extra_kwargs: dict = field(default_factory=dict)  # assistant_model, tokenizers, prompt_lookup_num_tokens, ...
    assistant_config: dict = field(default_factory=dict)  # set on the assistant's generation_config for the call
    assistant_name: str | None = None
    kind: str = "hf"

    @property
    def uses_drafter_model(self) -> bool:
        return "assistant_model" in self.extra_kwargs

    def generate_kwargs(self, prompt_ids: list[int], config: DecodeConfig) -> dict:
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "max_new_tokens": config.max_new_tokens, "eos_token_id": list(config.end_ids),
                "pad_token_id": self.pad_token_id, **sampling_kwargs(config.processor), **self.extra_kwargs}

    def run(self, prompt_ids: list[int], config: DecodeConfig) -> Result:
        kwargs = self.generate_kwargs(prompt_ids, config)
        streamer = TimingStreamer()
        assistant = self.extra_kwargs.get("assistant_model")
        context = assistant_settings(assistant, self.assistant_config) if assistant is not None else \
            contextlib.nullcontext()
        if config.seed is not None:
            torch.manual_seed(config.seed)
        with context:
            start = time.perf_counter()
            out = self.model.generate(**kwargs, streamer=streamer)
            total = time.perf_counter() - start
        tokens, finished = clip(out[0, len(prompt_ids):].tolist(), config.end_ids, config.max_new_tokens)
        first = streamer.times[0] - start if streamer.times else total
        # generate exposes no draft counts: they are None
        stats = Stats.measured(len(tokens), len(streamer.sizes), first, total, tokens_by_round=streamer.sizes)
        return Result(token_ids=tokens, finished=finished, stats=stats)

    def describe(self) -> dict:
        shown = {k: (self.assistant_name if k == "assistant_model" else type(v).__name__ if "tokenizer" in k else v)
                 for k, v in self.extra_kwargs.items()}
        return {"name": self.name, "kind": self.kind, "description": self.description,
                "uses_drafter_model": self.uses_drafter_model,
                "generate_kwargs": {"max_new_tokens": "<max_new_tokens>", "eos_token_id": "<end_ids>",
                                    "pad_token_id": self.pad_token_id, "streamer": "TimingStreamer",
                                    "<sampling>": "see config.hf_sampling_kwargs", **shown},
                "assistant_generation_config": self.assistant_config}


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


def quantized_drafter(drafter, bits: str):
    """`drafter` (a LoadedModel) with `bits` weights: itself when loaded so, else a quantized copy of its dense
    weights."""
    if drafter.quantize == bits:
        return drafter.model
    quantized = unpack(copy.deepcopy(drafter.dense if drafter.dense is not None else drafter.model))
    device = next(quantized.parameters()).device
    quantized.to(activation_dtype(bits, next(quantized.parameters()).dtype, device))  # a float32 prefill copy too
    quantize_weights(quantized, bits)
    return quantized


def build_hf_baselines(names: list[str], target, drafter, universal, *, gamma: int,
                       lookup_max_ngram: int) -> tuple[list[HFBaseline], list[Skipped]]:
    """`target`, `drafter`, `universal` are LoadedModels (the last two may be None)."""
    low_bit = {"hf_assisted_int8": "int8", "hf_assisted_int4": "int4"}
    tokenizer = target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def make(name, description, extra=None, assistant=None, assistant_name=None):
        return HFBaseline(name, description, target.model, pad, extra or {}, assistant or {}, assistant_name)

    defaults = hf_defaults()
    built, skipped = [], []
    for name in names:
        if name == "hf_generate":
            built.append(make(name, "model.generate(), plain decoding"))
        elif name == "hf_prompt_lookup":
            built.append(make(name, f"prompt lookup decoding, {gamma} tokens, n-grams up to {lookup_max_ngram}",
                              {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": lookup_max_ngram}))
        elif name in ("hf_assisted", "hf_assisted_gamma", *low_bit) and drafter is None:
            skipped.append(Skipped(name, "no drafter model loaded"))
        elif name == "hf_assisted":
            built.append(make(name, "assisted generation with HF's default settings",
                              {"assistant_model": drafter.model}, defaults, drafter.label))
        elif name == "hf_assisted_gamma":
            settings = {"num_assistant_tokens": gamma, "num_assistant_tokens_schedule": "constant",
                        "assistant_confidence_threshold": 0.0}
            built.append(make(name, f"assisted generation, {gamma} drafts every round (ours: gamma), "
                                    "no confidence stop",
                              {"assistant_model": drafter.model}, settings, drafter.label))
        elif name in low_bit:
            bits, dtype = low_bit[name], next(drafter.model.parameters()).dtype
            try:  # the loader's rules for these weights (on a CPU: bfloat16 activations only)
                resolve_quantize(bits, dtype, drafter.model.device)
            except ModelLoadError as error:
                skipped.append(Skipped(name, str(error)))
                continue
            settings = {**defaults, "num_assistant_tokens": LOW_BIT_DRAFT_TOKENS}
            adaptive = "adaptive" if sklearn_available() else "fixed: scikit-learn is not installed"
            built.append(make(name, f"assisted generation, {bits} drafter (our loader's weights), "
                                    f"{LOW_BIT_DRAFT_TOKENS} draft tokens, confidence threshold "
                                    f"{defaults['assistant_confidence_threshold']} ({adaptive})",
                              {"assistant_model": quantized_drafter(drafter, bits)}, settings,
                              f"{drafter.name} ({bits})"))
        elif name == "hf_universal":
            if universal is None:
                skipped.append(Skipped(name, "no cross-tokenizer drafter (--universal-drafter) loaded"))
                continue
            built.append(make(name, f"universal assisted generation (different tokenizers), drafter {universal.name}, "
                                    "HF's default settings",
                              {"assistant_model": universal.model, "tokenizer": tokenizer,
                               "assistant_tokenizer": universal.tokenizer}, defaults, universal.name))
        else:
            raise ValueError(f"unknown HF baseline {name!r}; choose from {', '.join(HF_BASELINES)}")
    return built, skipped
