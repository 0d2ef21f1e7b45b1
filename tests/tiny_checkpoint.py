"""A tiny random causal LM with a real byte-level BPE tokenizer and a chat template, saved like a hub checkpoint.

Tests of the loader, the chat app and the benchmark pass its directory as --target/--drafter.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the target verifies them.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Hello! How are you today? I am fine, thank you. What is two plus two? Two plus two is four.",
]


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS,
                            show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None, unk_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_checkpoint(directory: Path, seed: int = 0, layers: int = 2, hidden: int = 32,
                         vocab_padding: int = 0, dtype=torch.float32, max_positions: int = 1024) -> Path:
    """Write model + tokenizer + generation_config to `directory`; `vocab_padding` pads the embedding rows."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer) + vocab_padding, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper than random init, so outputs have structure
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_tiny_pair(root: Path):
    """A saved tiny target and a smaller drafter (same tokenizer), loaded like any pair: float32 on the CPU."""
    from utils.loading import load_pair

    target = save_tiny_checkpoint(Path(root) / "target", seed=0)
    drafter = save_tiny_checkpoint(Path(root) / "drafter", seed=1, layers=1, hidden=16)
    return load_pair(str(target), str(drafter), device="cpu", dtype="float32", progress=False)
