"""Row invariance: whether this machine computes a verify's rows with the same bits as the one-token steps.

Greedy speculative output equals greedy autoregressive output token for token only if the target gives each row of a
verify exactly the logits (and keys and values) it gives that token in a one-token step. The float64 tests show the
loop is right; whether the arithmetic agrees depends on the kernels this CPU, torch build and weight format run: some
compute a lone row by another path than the same row among several (bf16 `F.linear`, oneDNN on AVX-512), some give a
row other bits with the number of rows beside it (SDPA's query blocking). So the target's paths are tried here, on
this machine, in order of cost, and the first whose verifies equal its steps bit for bit is the one the app runs:

- the attention implementation (transformers' `sdpa`, then `eager`), and
- one-token steps fed as one row, or as two (`CachedModel.min_rows`: the spare row is dropped), so that a step takes
  the kernels a verify takes.

Each linear layer kind is probed alone as well, to name what breaks where no path is exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn
from transformers.cache_utils import CacheLayerMixin

from models import row_attention
from utils.files import checked
from utils.runner import CachedModel, input_device

CONTEXT = 64  # cached tokens before the probed forwards
WIDTH = 20  # the widest verify probed: the calibration's widest timed forward
VERIFY_WIDTHS = (2, 4, 8, 14, WIDTH)
ATTENTION = ("sdpa", "eager", row_attention.NAME)  # in order of cost
STEP_ROWS = (1, 2)


@dataclass(frozen=True)
class TargetPath:
    """How the target runs: its attention implementation and the rows a one-token step is fed as."""

    attention: str
    step_rows: int

    def __str__(self) -> str:
        return f"{self.attention} attention, one-token steps as {self.step_rows} row{'s' if self.step_rows > 1 else ''}"


@dataclass(frozen=True)
class Invariance:
    """What the probe found: the path chosen, whether it is exact, and what differed elsewhere."""

    exact: bool
    path: TargetPath  # the first exact path; where none is, the first tried
    tried: dict[str, str] = field(default_factory=dict)  # str(path) -> "exact" or the first forward that differed
    layers: dict[str, str] = field(default_factory=dict)  # linear kind (q_proj, lm_head, ...) -> "exact" or what
    seconds: float = 0.0

    @property
    def summary(self) -> str:
        """One line for the banner."""
        if self.exact:
            return f"exact: verify rows equal the one-token steps bit for bit ({self.path})"
        return f"NOT exact on this machine: {self.reasons[0]}; sampled output still follows the target's distribution"

    @property
    def reasons(self) -> tuple[str, ...]:
        """What breaks exact identity, one line each (empty when exact)."""
        if self.exact:
            return ()
        lone = [kind for kind, verdict in self.layers.items() if verdict == LONE_ROW]
        rows = [kind for kind, verdict in self.layers.items() if verdict == ROWS]
        reasons = []
        if rows:
            reasons.append(f"the linear layers ({', '.join(rows)}) give a row other bits with the rows beside it")
        if lone:
            reasons.append(f"the linear layers ({', '.join(lone)}) compute a lone row differently (steps as 2 rows "
                           "avoid that)")
        if not rows:  # each linear kind alone agreed on random rows: the attention, or an operator between them
            reasons.append("the attention (or an operator between the linear layers, which agree alone) gives a row "
                           "other bits with the number of query rows")
        return (*reasons, *(f"{path}: {verdict}" for path, verdict in self.tried.items()))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Invariance:
        """What a kept record holds (`as_dict`); TypeError, ValueError or KeyError naming a value of another type or
        out of its bounds: an "exact" that is not a JSON boolean, or that its path's own verdict contradicts, is
        refused, never read as a claim of identity."""
        path = checked("path", data["path"], dict)
        tried, layers = ({str(k): checked(f"{name}[{k!r}]", v, str) for k, v in checked(name, data[name], dict).items()}
                         for name in ("tried", "layers"))
        found = cls(checked("exact", data["exact"], bool),
                    TargetPath(checked("path.attention", path["attention"], str, among=ATTENTION),
                               checked("path.step_rows", path["step_rows"], int, among=STEP_ROWS)),
                    tried, layers, checked("seconds", data["seconds"], float, (0, float("inf"))))
        if found.exact != (tried.get(str(found.path)) == EXACT):
            raise ValueError(f"exact is {found.exact} where its path's verdict is {tried.get(str(found.path))!r}")
        return found


EXACT, LONE_ROW, ROWS = "exact", "a lone row differs", "rows differ with their count"


def apply(lm: CachedModel, path: TargetPath) -> bool:
    """Run `lm` along `path`; False where its model cannot switch to that attention implementation."""
    model = lm.model
    if path.attention == row_attention.NAME:
        row_attention.register()
    if model.config._attn_implementation != path.attention:
        model.set_attn_implementation(path.attention)
        if model.config._attn_implementation != path.attention:  # the model does not switch (it says why in a warning)
            return False
    lm.min_rows = path.step_rows
    return True


def probe(lm: CachedModel, width: int = WIDTH, context: int = CONTEXT,
          tell: Callable[[str], None] | None = None) -> Invariance:
    """Try the target's paths on this machine, leave `lm` on the first exact one (else the first), say what broke;
    `tell` hears each step as it starts (which path, how far, the seconds so far): a path costs about
    FORWARDS_PER_PATH forwards, a minute or more on a model split by its device map or read from disk."""
    started = time.perf_counter()
    width = max(2, min(width, lm.max_length - context - 1))
    vocab = lm.vocab_size
    ids = [(i * 7919 + 13) % vocab for i in range(context + width)]  # any tokens will do
    paths = [TargetPath(a, r) for a in ATTENTION for r in STEP_ROWS]
    tried: dict[str, str] = {}
    chosen = None
    for number, path in enumerate(paths, 1):
        if not apply(lm, path):
            continue
        if tell is not None:
            elapsed = time.perf_counter() - started
            pace = f", {elapsed / len(tried):.0f} s a path" if tried else ""
            tell(f"{path} ({number} of {len(paths)}, {elapsed:.0f} s so far{pace})")
        tried[str(path)] = whole_model(lm, ids[:context], ids[context:]) or EXACT
        if tried[str(path)] == EXACT:
            chosen = path
            break
    exact = chosen is not None
    path = chosen or paths[0]
    apply(lm, path)
    if tell is not None:
        tell(f"each kind of linear layer alone ({time.perf_counter() - started:.0f} s so far)")
    layers = linear_kinds(lm.model, width, context + width)
    return Invariance(exact, path, tried, layers, time.perf_counter() - started)


FORWARDS_PER_PATH = 2 + WIDTH + 2 * len(VERIFY_WIDTHS) + 2  # context, steps, verifies (and the crops'), tree, prefill


@torch.inference_mode()
def whole_model(lm: CachedModel, context: list[int], new: list[int]) -> str | None:
    """None if every verify over `new` (chains of VERIFY_WIDTHS, a tree, the first round's prefill with its verify)
    gives the logits and the keys and values that one-token steps over `new` give; else the first that differed."""
    lm.reset()
    try:
        lm.forward(context)
        steps = []
        for m, token in enumerate(new, 1):
            steps.append(lm.forward([token]))
            if m in VERIFY_WIDTHS or m == len(new):  # the same rows again as one verify, from the steps' cache
                kv = cache_rows(lm)
                lm.crop(len(context))
                if not torch.equal(lm.forward(new[:m], logits_rows=m), torch.cat(steps)):
                    return f"a verify of {m} tokens differs from the steps"
                if not all(torch.equal(a, b) for a, b in zip(cache_rows(lm), kv, strict=True)):
                    return f"a verify of {m} tokens leaves other keys and values than the steps"
        steps_logits = torch.cat(steps)  # (len(new), V)
        # a tree: a chain over new[1:k + 1] with a sibling leaf beside each node, no wider than the chains above
        chain = new[1 : (len(new) + 1) // 2]
        tree = [t for pair in zip(chain, reversed(chain), strict=True) for t in pair]
        parents = [p for i in range(len(chain)) for p in (2 * i - 2 if i else -1,) * 2]
        rows = lm.extend_tree(context + new[:1], tree, parents)
        if not torch.equal(rows[[0, *range(1, len(tree) + 1, 2)]], steps_logits[: len(chain) + 1]):
            return f"a tree verify of {len(tree)} nodes differs from the steps"
        lm.reset()  # the first round of a turn: the prompt and the drafts in one forward
        if not torch.equal(lm.forward(context + new, logits_rows=len(new)), steps_logits):
            return f"a prefill of {len(context)} tokens with a verify of {len(new)} differs from the steps"
        return None
    finally:
        lm.reset()


def cache_rows(lm: CachedModel) -> list[Tensor]:
    """Copies of every cached key and value tensor."""
    layers = [layer for layer in lm.cache.layers if isinstance(layer, CacheLayerMixin)]
    return [t.clone() for layer in layers for t in (layer.keys, layer.values) if t is not None]


@torch.inference_mode()
def linear_kinds(model, width: int, rows: int | None = None) -> dict[str, str]:
    """Each kind of linear layer (q_proj, ..., lm_head: the first of each name), fed random rows: EXACT, LONE_ROW
    (one row alone gets other bits than among 2..width, which agree) or ROWS (2..width rows disagree with the same
    rows among `rows`, default width: a first round's prompt and drafts, which a GEMM may block otherwise)."""
    kinds: dict[str, tuple[nn.Module, int]] = {}
    outer = "\0"  # a layer found: what it wraps is not another kind
    for name, module in model.named_modules():
        width_in = getattr(module, "in_features", None)
        if isinstance(width_in, int) and hasattr(module, "out_features") and not name.startswith(outer + "."):
            kinds.setdefault(name.rsplit(".", 1)[-1], (module, width_in))
            outer = name
    generator = torch.Generator().manual_seed(0)
    verdicts = {}
    for kind, (layer, width_in) in kinds.items():
        x = torch.randn((1, max(rows or width, width), width_in), generator=generator).to(runs_on(layer, model),
                                                                                          model.dtype)
        full = layer(x)
        if not all(torch.equal(layer(x[:, :m]), full[:, :m]) for m in range(2, width + 1) if m < x.shape[1]):
            verdicts[kind] = ROWS
        else:
            verdicts[kind] = EXACT if torch.equal(layer(x[:, :1]), full[:, :1]) else LONE_ROW
    return verdicts


def runs_on(layer: nn.Module, model: nn.Module) -> torch.device:
    """Where `layer` computes: the device accelerate's hook moves its inputs to (its weights may be on the meta device,
    offloaded and read back at each call), else its own weights' device, else where the model's inputs go."""
    device = getattr(getattr(layer, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device(device)
    tensor = next(iter([*layer.parameters(recurse=False), *layer.buffers(recurse=False)]), None)
    return input_device(model) if tensor is None or tensor.device.type == "meta" else tensor.device
