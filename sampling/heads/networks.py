"""Trained draft heads on the target's own hidden states: EAGLE (one decoder layer that predicts the next feature)
and Medusa (residual blocks that each predict a token further ahead), in the project's format and the published ones.

Both read the target's last hidden state (after its final norm: `hidden_states[-1]` of a transformers model) and turn
features into tokens with the target's own output layer, restricted to a draft vocabulary (the most frequent tokens,
as EAGLE-3 and FR-Spec do: the output layer is most of a head's cost at a 150k vocabulary).

Formats read by `load_head`:
- the project's: `head.json` ({"format": "specchat-head", "kind": "eagle" | "medusa", "config": ..., "training": ...})
  and `head.safetensors` (the weights, and `draft_vocab`: the token ids the head drafts from, when restricted);
- EAGLE-1/2 authors' heads: `config.json` (a Llama-style config) with `pytorch_model.bin` or `model.safetensors`
  holding `fc.weight` and `layers.0.*` (their layer 0 skips its input norm, as here);
  `sampling.heads.layouts.write_eagle` writes an EAGLE head of this project in that layout;
- Medusa authors' heads: `config.json` with `medusa_num_heads` and `medusa_num_layers`, weights in
  `medusa_lm_head.safetensors` or `.pt` as `{head}.{block}.linear.weight|bias` and `{head}.{blocks}.weight` (each head's
  own output layer over the whole vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.formats.layers import linear_rows, linear_weight
from utils.errors import ModelLoadError, one_line

FORMAT = "specchat-head"
KINDS = ("eagle", "medusa")
WEIGHTS, CONFIG = "head.safetensors", "head.json"


@dataclass(frozen=True)
class HeadConfig:
    kind: str
    hidden_size: int
    # eagle: its decoder layer
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    fc_bias: bool = False
    # medusa: heads, residual blocks per head, and whether each head has its own output layer (the published format)
    num_heads: int = 0
    num_layers: int = 1
    own_lm_head: bool = False
    vocab_size: int = 0  # the whole vocabulary (a published Medusa head's output size)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose from {', '.join(KINDS)}")

    @classmethod
    def from_dict(cls, data: dict) -> HeadConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary position embedding (the half-split layout of Llama and Qwen), x: (1, heads, T, d), positions: (T,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None]  # (T, d/2)
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


class HeadCache:
    """The keys and values an EAGLE head has computed, one column per head position (batch of one)."""

    def __init__(self):
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if self.keys is None or self.values is None:  # both or neither
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = torch.cat([self.keys, keys], -2), torch.cat([self.values, values], -2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[..., :length, :], self.values[..., :length, :]


class Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None, cache: HeadCache | None) -> Tensor:
        """x: (1, T, H); mask: (T, T_cached + T) bool, True where a row may look; None: causal, no cache."""
        c, t = self.c, x.shape[1]
        q = self.q_proj(x).view(1, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta)
        if cache is not None:
            k, v = cache.append(k, v)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(1, t, -1))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """A Llama/Qwen decoder layer without its input norm (EAGLE's layer 0: its input is already a mix of features)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.eps = c.rms_norm_eps
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None, cache: HeadCache | None) -> Tensor:
        x = x + self.self_attn(x, positions, mask, cache)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.eps))


class EagleHead(nn.Module):
    """(target feature at position i, embedding of token i + 1) -> the target's feature at position i + 1."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([Layer(config)])

    def forward(self, features: Tensor, embeds: Tensor, positions: Tensor, mask: Tensor | None = None,
                cache: HeadCache | None = None) -> Tensor:
        """features, embeds: (1, T, H); positions: (T,). Without a cache and mask: a causal pass (training)."""
        x = self.fc(torch.cat([embeds, features], -1))
        return self.layers[0](x, positions, mask, cache)


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: each head first predicts what the target does

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    """`num_heads` heads on the target's feature at position i: head k's feature gives the token at i + k + 2."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList()
        for _ in range(config.num_heads):
            blocks: list[nn.Module] = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
            if config.own_lm_head:
                blocks.append(nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            self.heads.append(nn.Sequential(*blocks))

    def forward(self, features: Tensor) -> list[Tensor]:
        """Each head's output: a feature for the target's output layer, or logits with its own."""
        return [head(features) for head in self.heads]


@dataclass
class DraftHead:
    """A loaded head with the target's embeddings and output layer it reads (the output layer restricted to
    `vocab`, the token ids it may draft, or the whole vocabulary for None)."""

    config: HeadConfig
    module: nn.Module
    embed: nn.Module  # the target's input embedding, shared with it: a lookup in its format (rows cast when read)
    out: Tensor  # (N, H) the target's output layer, rows of `vocab` only
    vocab: Tensor | None  # (N,) token ids, or None: all V
    info: dict = field(default_factory=dict)  # the project's format: how it was trained, held-out acceptance
    weights: str = "dense"  # "dense", or "int8" / "int4" with bfloat16 activations (`compact`)
    out_layer: nn.Module | None = None  # `out` as a low-bit layer (`compact`)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in."""
        return torch.bfloat16 if self.out_layer is not None else self.out.dtype

    def embeds(self, token_ids: Tensor) -> Tensor:
        """The target's input embeddings of `token_ids`, in the head's dtype (no gradient reaches the target)."""
        with torch.no_grad():
            return self.embed(token_ids).to(self.dtype)

    def logits(self, features: Tensor) -> Tensor:
        """(..., N) draft logits over the draft vocabulary, float32 or wider."""
        if self.out_layer is not None:
            return self.out_layer(features.to(self.dtype)).float()
        logits = features @ self.out.T
        return logits if logits.dtype == torch.float64 else logits.float()

    def token_ids(self, index: Tensor) -> Tensor:
        """Draft-vocabulary indices to token ids."""
        return index if self.vocab is None else self.vocab[index]

    @property
    def size(self) -> int:
        """Its weights, counted before `compact` packed them."""
        return self.info.get("parameters") or sum(p.numel() for p in self.module.parameters())


def compact(head: DraftHead, weights: str) -> DraftHead:
    """The head with its linear layers and output rows in int8 or int4 weights, bfloat16 activations (torch's CPU
    kernels, as the drafter model's low-bit formats): on a CPU a draft step reads its weights once per depth, and
    float32 reads of a few rows are slow there. Drafts only: the output stays lossless."""
    from models.formats.int4 import Int4Linear, fits
    from models.formats.int8 import Int8Linear
    from models.formats.layers import replace_layers

    if weights not in ("int8", "int4"):
        raise ValueError(f"head weights are int8 or int4, not {weights!r}")

    def low_bit(linear: nn.Linear) -> nn.Module:
        linear = linear.to(torch.bfloat16)
        return Int4Linear(linear) if weights == "int4" and fits(linear) else Int8Linear(linear, torch.bfloat16)

    head.info.setdefault("parameters", head.size)
    module = head.module.to(torch.bfloat16)
    replace_layers(module, nn.Linear, low_bit)
    out = nn.Linear(head.out.shape[1], head.out.shape[0], bias=False)
    with torch.no_grad():
        out.weight.copy_(head.out)
    return DraftHead(head.config, module, head.embed, head.out, head.vocab, head.info, weights, low_bit(out))


def bind(config: HeadConfig, module: nn.Module, model, vocab: Tensor | None, info: dict | None = None,
         dtype: torch.dtype = torch.float32) -> DraftHead:
    """A head for `model`: its sizes checked against the target's, its weights and the target's output rows it reads
    in `dtype`; the target's input embedding shared, whatever its format."""
    out_layer = model.get_output_embeddings()
    hidden, size = out_layer.in_features, out_layer.out_features
    if config.hidden_size != hidden:
        raise ModelLoadError(f"the head reads features of width {config.hidden_size}, the target's are {hidden}: "
                             "it was trained for another model")
    if vocab is not None and (vocab.numel() == 0 or int(vocab.max()) >= size or int(vocab.min()) < 0):
        raise ModelLoadError(f"the head's draft vocabulary has token ids outside the target's {size}")
    if config.own_lm_head and config.vocab_size > size:
        raise ModelLoadError(f"the head's vocabulary ({config.vocab_size}) is larger than the target's ({size})")
    # only the draft vocabulary's rows: a whole output layer in blocks would be widened to float32 for them
    rows = linear_weight(out_layer) if vocab is None else linear_rows(out_layer, vocab.to(model.device))
    module = module.to(device=rows.device, dtype=dtype).eval().requires_grad_(False)
    return DraftHead(config, module, model.get_input_embeddings(), rows.detach().to(dtype).contiguous(),
                     None if vocab is None else vocab.to(rows.device), info or {})


def build(config: HeadConfig) -> nn.Module:
    return EagleHead(config) if config.kind == "eagle" else MedusaHead(config)


def save_head(path: Path, config: HeadConfig, module: nn.Module, vocab: Tensor | None, info: dict,
              dtype: torch.dtype = torch.bfloat16) -> None:
    """The project's format; weights stored in `dtype` (bfloat16 halves the file, the head runs in float32)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in module.state_dict().items()}
    if vocab is not None:
        tensors["draft_vocab"] = vocab.to(torch.int64).contiguous()
    save_file(tensors, str(path / WEIGHTS))
    meta = {"format": FORMAT, "version": 1, "kind": config.kind, "config": asdict(config), "training": info}
    (path / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")


def load_head(path: str | Path, model, dtype: torch.dtype = torch.float32) -> DraftHead:
    """A head directory in any of the formats above, bound to `model` (the target it drafts for)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"no head directory at {path}")
    try:
        if (path / CONFIG).is_file():
            config, state, vocab, info = _read_ours(path)
        elif (path / "config.json").is_file():
            config, state, vocab, info = _read_published(path)
        else:
            raise ModelLoadError(f"{path} has neither {CONFIG} (this project's heads) nor config.json (the EAGLE and "
                                 "Medusa authors' heads)")
        _check_sizes(config, path)
        module = build(config)
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing:
            raise ModelLoadError(f"the head in {path} lacks {', '.join(missing[:4])}"
                                 f"{' and more' if len(missing) > 4 else ''}: not a {config.kind} head of this layout")
        if unexpected:  # a head.json that names another kind (or size) than its weights are
            raise ModelLoadError(f"the head in {path}: its {config.kind} config has no place for weights "
                                 f"{', '.join(unexpected[:4])}{' and more' if len(unexpected) > 4 else ''}: a config "
                                 "of another kind or size than the weights; retrain the head or fix its config")
        return bind(config, module, model, vocab, info, dtype)
    except ModelLoadError:
        raise
    except Exception as error:  # a damaged file, a config of another shape
        raise ModelLoadError(f"cannot read the head in {path}: {one_line(error)}") from error


def _check_sizes(config: HeadConfig, path: Path) -> None:
    """Refuse a config whose kind lacks the sizes that kind needs (as another kind's config does)."""
    needed = (("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
              if config.kind == "eagle" else ("num_heads", "num_layers"))
    absent = [name for name in needed if not isinstance(getattr(config, name), int) or getattr(config, name) < 1]
    if absent:
        raise ModelLoadError(f"the head in {path}: its {config.kind} config has no {', '.join(absent)}: a config "
                             "of another kind than the weights, or damaged; retrain the head or fix its config")


def _read_tensors(file: Path) -> dict[str, Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)


def _read_ours(path: Path):
    meta = json.loads((path / CONFIG).read_text())
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{path / CONFIG} is not a {FORMAT} file")
    config = HeadConfig.from_dict({**meta["config"], "kind": meta["kind"]})
    state = _read_tensors(path / WEIGHTS)
    vocab = state.pop("draft_vocab", None)
    return config, {k: v.float() for k, v in state.items()}, vocab, meta.get("training", {})


def _read_published(path: Path):
    raw = json.loads((path / "config.json").read_text())
    if "medusa_num_heads" in raw:
        weights = _first(path, "medusa_lm_head.safetensors", "medusa_lm_head.pt")
        state = {f"heads.{k}": v.float() for k, v in _read_tensors(weights).items()}
        hidden = raw.get("hidden_size") or next(v.shape[1] for k, v in state.items() if k.endswith("linear.weight"))
        layers = int(raw.get("medusa_num_layers", 1))
        vocab_size = next((v.shape[0] for k, v in state.items() if k.endswith(f".{layers}.weight")), 0)
        config = HeadConfig("medusa", int(hidden), num_heads=int(raw["medusa_num_heads"]), num_layers=layers,
                            own_lm_head=bool(vocab_size), vocab_size=int(vocab_size))
        return config, state, None, {"source": "Medusa authors' format"}
    weights = _first(path, "model.safetensors", "pytorch_model.bin")
    state = {k: v.float() for k, v in _read_tensors(weights).items()
             if k.startswith(("fc.", "layers.0.self_attn", "layers.0.mlp"))}
    norm = _read_tensors(weights).get("layers.0.post_attention_layernorm.weight")
    if "fc.weight" not in state or norm is None:
        raise ModelLoadError(f"{weights} is not an EAGLE-1/2 head (no fc.weight and layers.0)")
    state["layers.0.post_attention_layernorm"] = norm.float()
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    config = HeadConfig("eagle", hidden, num_attention_heads=heads,
                        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                        head_dim=int(raw.get("head_dim") or hidden // heads),
                        intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps",
                                                                                                     1e-6)),
                        rope_theta=float(raw.get("rope_theta", 10000.0)),
                        attention_bias="layers.0.self_attn.q_proj.bias" in state, fc_bias="fc.bias" in state)
    return config, state, None, {"source": "EAGLE authors' format"}


def _first(path: Path, *names: str) -> Path:
    for name in names:
        if (path / name).is_file():
            return path / name
    raise ModelLoadError(f"{path} has none of {', '.join(names)}")


def eagle_config(model_config, intermediate_size: int) -> HeadConfig:
    """An EAGLE head shaped like one decoder layer of the target (its attention), with an MLP of `intermediate_size`."""
    c = model_config
    heads = c.num_attention_heads
    theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return HeadConfig("eagle", c.hidden_size, num_attention_heads=heads,
                      num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                      intermediate_size=intermediate_size, rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
                      rope_theta=float(theta), attention_bias=bool(getattr(c, "attention_bias", False)
                                                                   or c.model_type == "qwen2"))


HEADS_DIR = Path(__file__).resolve().parents[2] / "heads"  # the heads that ship with the project: <root>/heads


ANSWERS_DIR = HEADS_DIR / "answers"  # the target's own answers the shipped heads trained on, as token ids


def shipped_answers(target_name: str) -> Path | None:
    """The project's answers of a target of this name (heads/answers/<name>.jsonl.gz), or None."""
    path = ANSWERS_DIR / f"{target_name}.jsonl.gz"
    return path if path.is_file() else None


def shipped_heads(target_name: str) -> list[Path]:
    """The project's heads for a target of this name: heads/<name>-<kind>/."""
    return [d for d in sorted(HEADS_DIR.glob(f"{target_name}-*")) if (d / CONFIG).is_file()]


def load_heads(specs: list[str] | None, target_name: str, model) -> dict[str, DraftHead]:
    """The heads of `--head` (directories; 'none': none), else the shipped ones for the target, by kind. On a CPU they
    draft with int4 weights and bfloat16 activations (`compact`: the same acceptance as float32 at a third of the
    cost, docs/heads.md), elsewhere in the target's dtype."""
    if specs and any(spec.strip().lower() == "none" for spec in specs):
        return {}
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        # a head reads the target's embedding and output rows on one device; the shipped ones are left out
        if specs:
            raise ModelLoadError("draft heads need the target on one device, and --device-map split it. Fix: drop "
                                 "--head, or give the target one device (--device-map cuda:0 or cpu).")
        return {}
    paths = [Path(spec) for spec in specs] if specs else shipped_heads(target_name)
    on_cpu = model.device.type == "cpu"
    dtype = torch.float32 if on_cpu else model.dtype
    heads: dict[str, DraftHead] = {}
    for path in paths:
        head = load_head(path, model, dtype)
        if on_cpu:
            head = compact(head, "int4")
        kind = head.config.kind
        if kind in heads:
            raise ModelLoadError(f"two {kind} heads given ({heads[kind].info.get('path')} and {path}): give one")
        head.info["path"] = str(path)
        heads[kind] = head
    return heads
