"""Builders of tiny random causal LMs for the tests, built in milliseconds: in memory (float64 wherever equality is
asserted), or saved like a hub checkpoint with a real tokenizer for the loader, the chat app and the benchmark (which
take its directory as --target/--drafter).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
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

WORD_SPECIALS = ["<unk>", "<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
WORD_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)

REPO = Path(__file__).resolve().parent.parent  # the scripts' folder


def tiny_model(vocab_size: int = 97, seed: int = 0, layers: int = 2, hidden: int = 32, dtype=torch.float64,
               max_positions: int = 512, intermediate: int | None = None, eos_token_id: int | None = None,
               pad_token_id: int | None = None) -> LlamaForCausalLM:
    """A random Llama in eval mode; `seed` fixes its weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; sharpen them so sequences have structure and drafts get accepted.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def noisy_copy(model: LlamaForCausalLM, seed: int = 7, scale: float = 0.25) -> LlamaForCausalLM:
    """`model` with perturbed output weights: its first choice is often the original's, its second sometimes."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = noisy.lm_head.weight
        w.add_(torch.randn(w.shape, generator=generator, dtype=w.dtype) * w.std() * scale)
    return noisy


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on CORPUS, with the ChatML template: any text encodes."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS,
                            show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None, unk_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def word_tokenizer(words: int = 59, chat_template: str | None = WORD_CHAT_TEMPLATE,
                   **special) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORD_SPECIALS + w0..w{words-1}: ids are predictable (<eos> is 2, <|im_end|> 4)."""
    vocab = {token: index for index, token in enumerate(WORD_SPECIALS + [f"w{i}" for i in range(words)])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokens = {"unk_token": "<unk>", "pad_token": "<pad>", "eos_token": "<eos>", **special}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    tokenizer.chat_template = chat_template
    return tokenizer


def save_tiny_checkpoint(directory: Path, seed: int = 0, layers: int = 2, hidden: int = 32, vocab_padding: int = 0,
                         dtype=torch.float32, max_positions: int = 1024, intermediate: int | None = None,
                         tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """Write model + tokenizer (build_tokenizer's unless given) + generation_config to `directory`;
    `vocab_padding` adds embedding rows past the tokenizer's."""
    tokenizer = tokenizer or build_tokenizer()
    model = tiny_model(len(tokenizer) + vocab_padding, seed, layers, hidden, dtype, max_positions, intermediate,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id],
                                               pad_token_id=tokenizer.pad_token_id)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_pair(root: Path, **options) -> tuple[Path, Path]:
    """A saved tiny target and a smaller, differently seeded drafter with the same tokenizer: (target, drafter)."""
    return (save_tiny_checkpoint(Path(root) / "target", seed=0, **options),
            save_tiny_checkpoint(Path(root) / "drafter", seed=1, layers=1, hidden=16, **options))


def load_tiny_pair(root: Path):
    """save_tiny_pair's models loaded like any pair: float32 on the CPU."""
    from models.loading import load_pair

    target, drafter = save_tiny_pair(root)
    return load_pair(str(target), str(drafter), device="cpu", dtype="float32", progress=False)


def tiny_engine(drafter: bool = True):
    """An Engine on a float64 tiny target (and a smaller drafter) over `build_tokenizer`'s vocabulary and template:
    greedy outputs compare exactly, text round-trips."""
    from app.engine import Engine

    tokenizer = build_tokenizer()
    return Engine(tiny_model(len(tokenizer), seed=0), tokenizer,
                  tiny_model(len(tokenizer), seed=1, layers=1, hidden=16) if drafter else None)


def random_head(model, kind: str, seed: int = 1, std: float = 0.2, vocab=None):
    """An untrained eagle or medusa head of random weights bound to `model` in its dtype (any head keeps the output
    lossless; a trained one is made by train_head.py)."""
    from sampling.heads.networks import HeadConfig, bind, build, eagle_config

    config = (eagle_config(model.config, 2 * model.config.hidden_size) if kind == "eagle"
              else HeadConfig("medusa", model.config.hidden_size, num_heads=3))
    module = build(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
    return bind(config, module, model, vocab, dtype=next(model.parameters()).dtype)


def random_heads(model) -> dict:
    return {kind: random_head(model, kind) for kind in ("eagle", "medusa")}


def save_random_heads(target_dir: Path) -> list[str]:
    """An eagle and a medusa head of random weights saved beside a saved tiny target, as --head takes them."""
    from transformers import AutoModelForCausalLM

    from sampling.heads.networks import save_head

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    dirs = []
    for kind in ("eagle", "medusa"):
        head = random_head(model, kind)
        save_head(Path(target_dir).parent / f"head-{kind}", head.config, head.module, None, {"held_out": {}})
        dirs.append(str(Path(target_dir).parent / f"head-{kind}"))
    return dirs


def random_q4k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K bytes, (rows, cols / 256 * 144): random codes, 6-bit scales and mins, small fp16 block scales."""
    from models.formats import q4k

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // q4k.BLOCK, q4k.BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 1e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 1e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def q4k_weight(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    from models.formats import q4k

    codes, scale, low = q4k.groups(raw, rows, cols)
    return (codes.view(rows, -1, q4k.GROUP) * scale[..., None] - low[..., None]).view(rows, cols)


def write_q4k_gguf(path, model, corrupt: str | None = None) -> None:
    """Every decoder linear of `model` as random Q4_K in a GGUF file (tensors only), the model's weights set to
    them; the tensor named `corrupt` gets other weights than the model's."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from models.formats import q4k

    writer = GGUFWriter(str(path), arch="llama")
    names = {v: k for k, v in q4k.MODULES.items()}
    for index, layer in enumerate(model.model.layers):
        for position, (module_name, gguf_name) in enumerate(names.items()):
            linear = layer.get_submodule(module_name)
            rows, cols = linear.weight.shape
            raw = random_q4k(rows, cols, seed=10 * index + position)
            with torch.no_grad():
                linear.weight.copy_(q4k_weight(raw, rows, cols))
            name = f"blk.{index}.{gguf_name}.weight"
            writer.add_tensor(name, random_q4k(rows, cols, seed=99) if name == corrupt else raw,
                              raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_interrupted_while_importing(script: str, tmp_path: Path):
    """`python script --help` with SIGINT raised in the process itself when its imports reach sampling.settings (a
    sitecustomize module does it, so the signal lands there every time): the finished process."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import signal, sys\n"
        "class InterruptOnImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sampling.settings':\n"
        "            sys.meta_path.remove(self)\n"
        "            signal.raise_signal(signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, InterruptOnImport())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def heavy_modules_imported(script: str, argv: list[str]) -> list[str]:
    """Which of torch and transformers `script`'s main(argv) imported before it returned or exited."""
    import subprocess
    import sys

    code = (f"import sys, {script}\n"
            f"try:\n    {script}.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('imported:', *[m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    return done.stdout.splitlines()[-1].split()[1:]


def q4k_gguf(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A .gguf spec holding a tiny model's decoder linears in Q4_K, converted (faked) into that very model: the path
    and a saved directory of the same model."""
    directory = save_tiny_checkpoint(tmp_path / "tiny", hidden=256, intermediate=512)
    from transformers import AutoModelForCausalLM

    from models import store as model_cache

    model = AutoModelForCausalLM.from_pretrained(directory)
    gguf_path = tmp_path / "my-model.gguf"
    write_q4k_gguf(gguf_path, model)
    model.save_pretrained(directory)  # with the file's weights
    monkeypatch.setattr(model_cache, "convert_gguf",
                        lambda path, dest: shutil.copytree(directory, dest, dirs_exist_ok=True))
    return gguf_path, directory
