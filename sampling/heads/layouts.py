"""This project's heads in the layouts serving engines load, and a head directory's kind read from its config alone.

`write_eagle`: an eagle head in the EAGLE-1 authors' layout (config.json, fc.weight and layers.0.*), the names vLLM's
"eagle" method and SGLang's EAGLE load (vllm/model_executor/models/llama_eagle.py); `sampling.heads.load_head` reads it
back. docs/scale.md says what differs there.
"""

from __future__ import annotations

import json
from pathlib import Path

from sampling.heads.networks import CONFIG, FORMAT, WEIGHTS, HeadConfig
from utils.errors import ModelLoadError
from utils.files import write_atomically

EAGLE_WEIGHTS = "model.safetensors"
TOKEN_MAP = "token_map.pt"  # SGLang's --speculative-token-map: the token ids the head drafts from (FR-Spec)
LAYOUTS = ("vllm", "sglang")
# What serving engines do otherwise with an exported head (one line: the export says it)
EAGLE_DIFFERENCES = ("vLLM's eagle method and SGLang's EAGLE run it as one decoder layer without its input norm over "
                     "the target's whole vocabulary (the same arithmetic)")


def write_eagle(head_dir: str | Path, out: str | Path, target_config, layout: str = "vllm") -> list[str]:
    """The eagle head in `head_dir` (this project's format) in the EAGLE-1 authors' layout in `out`: config.json and
    model.safetensors with fc.weight and layers.0.* (the decoder layer without its input norm), its weights in the
    dtype they are stored in. `target_config`: the target's (vocabulary, context, token ids). Returns what differs
    there, one line each. `load_head` reads the layout back.

    `layout`: "vllm", the authors' own config (LlamaForCausalLM, which vLLM's eagle method maps to its EAGLE layer), or
    "sglang", whose config names SGLang's EAGLE classes (LlamaForCausalLMEagle; Qwen2ForCausalLMEagle for a head with
    biases on q, k and v), and beside it the head's draft vocabulary as SGLang's token map (TOKEN_MAP). Both hold an
    fc.bias (zeros for a head without one): SGLang's fc has one, vLLM skips it."""
    import torch
    from safetensors.torch import load_file, save_file

    if layout not in LAYOUTS:
        raise ValueError(f"unknown EAGLE layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    head_dir, out = Path(head_dir), Path(out)
    if not (head_dir / CONFIG).is_file():
        raise ModelLoadError(f"{head_dir} holds no {CONFIG}: not a head of this project (a head in the EAGLE layout "
                             "is served as it is)")
    meta = json.loads((head_dir / CONFIG).read_text())
    if meta.get("format") != FORMAT or meta.get("kind") != "eagle":
        raise ModelLoadError(f"{head_dir} is a {meta.get('kind', 'unknown')} head: only an eagle head has an EAGLE "
                             "layout")
    c = HeadConfig.from_dict({**meta["config"], "kind": "eagle"})
    state = load_file(str(head_dir / WEIGHTS))
    vocab = state.pop("draft_vocab", None)
    norm = "layers.0.post_attention_layernorm"
    tensors = {(f"{norm}.weight" if name == norm else name): t.contiguous() for name, t in state.items()}
    tensors.setdefault("fc.bias", tensors["fc.weight"].new_zeros(c.hidden_size))
    qwen = layout == "sglang" and c.attention_bias  # SGLang's Llama layer has no switch for biases on q, k, v only
    architecture = {"vllm": "LlamaForCausalLM", "sglang": "Qwen2ForCausalLMEagle" if qwen else "LlamaForCausalLMEagle"}
    config = {
        "architectures": [architecture[layout]], "model_type": "qwen2" if qwen else "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "hidden_act": "silu",
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        # q, k and v with biases and o_proj without (Qwen's): vLLM's and transformers' Llama read qkv_bias for that
        "attention_bias": False, "qkv_bias": c.attention_bias, "mlp_bias": False,
        "vocab_size": target_config.vocab_size,
        "max_position_embeddings": getattr(target_config, "max_position_embeddings", 4096),
        "bos_token_id": getattr(target_config, "bos_token_id", None),
        "eos_token_id": getattr(target_config, "eos_token_id", None),
        "tie_word_embeddings": False, "torch_dtype": str(tensors["fc.weight"].dtype).removeprefix("torch."),
    }

    def write_config(file: Path) -> None:
        file.write_text(json.dumps(config, indent=2) + "\n")

    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / EAGLE_WEIGHTS, lambda file: save_file(tensors, str(file)))
    (out / TOKEN_MAP).unlink(missing_ok=True)
    if vocab is not None and layout == "sglang":
        write_atomically(out / TOKEN_MAP, lambda file: torch.save(vocab.to(torch.int64), file))
    write_atomically(out / "config.json", write_config)  # the config last: a folder with one is whole
    notes = [EAGLE_DIFFERENCES]
    if vocab is not None and layout == "sglang":
        notes.append(f"SGLang drafts from the head's own {vocab.numel()} tokens (its token map, FR-Spec's)")
    elif vocab is not None:
        notes.append(f"the head drafts from its {vocab.numel()} most frequent tokens here; the EAGLE-1 layout has no "
                     f"draft vocabulary, so there it drafts from all {target_config.vocab_size}")
    if c.fc_bias and layout == "vllm":
        notes.append("its fc has a bias, which vLLM's eagle layer has no place for: vLLM skips it")
    return notes


def head_kind(path: Path) -> str | None:
    """"eagle" or "medusa" as the head directory's config says (no weights read); None for no head there."""
    try:
        if (path / CONFIG).is_file():
            return json.loads((path / CONFIG).read_text()).get("kind")
        if (path / "config.json").is_file():
            return "medusa" if "medusa_num_heads" in json.loads((path / "config.json").read_text()) else "eagle"
    except (OSError, ValueError):
        return None
    return None
