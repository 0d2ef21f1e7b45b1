"""Fixtures: tiny random causal LMs built in milliseconds (float64 wherever equality is asserted)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)  # tiny models: threading costs more than it saves, and CI has two cores


def tiny_model(vocab_size: int = 97, seed: int = 0, layers: int = 2, hidden: int = 32, dtype=torch.float64,
               max_positions: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; sharpen them so sequences have structure and drafts get accepted.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def target_model():
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def small_drafter_model():
    """Shares the target's vocabulary, smaller and differently initialised: partly accepted."""
    return tiny_model(seed=1, layers=1, hidden=16)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory):
    """The converted-model cache for the whole run: real models are converted once, never into the user's cache."""
    return tmp_path_factory.mktemp("specchat-cache")
