"""The benchmark's contestants by name and its prompt set: plain data, importable without torch (bench.py checks
--strategies before it imports torch)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")  # read by `utils.prompts.load_prompts`

HF_BASELINES = ("hf_generate", "hf_assisted", "hf_assisted_gamma", "hf_assisted_int8", "hf_assisted_int4",
                "hf_universal", "hf_prompt_lookup")
NEEDS_SAME_VOCAB = ("hf_assisted", "hf_assisted_gamma", "hf_assisted_int8", "hf_assisted_int4")  # HF's drafter
LLAMACPP = ("llamacpp", "llamacpp_speculative")  # built by ./setup.sh --llamacpp (benchmarks/llamacpp.py)
REFERENCE = "autoregressive"  # every run's baseline; its answers build the later turns of a conversation
