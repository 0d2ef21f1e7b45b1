"""Each setting the user can change, described once: its flag, its chat command, its help and what the chat says.

The command lines' flags (`app/flags.py`), the chat's setting commands and their lines in /help (`chat/commands.py`,
`chat/setting_commands.py`) are derived from `SETTINGS`. The bounds are not here: they live in the settings
dataclasses (`sampling.settings.StrategySettings`, `sampling.base.DecodeConfig`, the processors), and a flag or a
command answers their `SettingError` in its own words (`flag_of`, `word_of`). Importable without torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sampling.settings import CALIBRATED, STORE_KINDS, StrategySettings
from utils.logits_processor import PROCESSORS, LogitsProcessor


@dataclass(frozen=True)
class Value:
    """One field of a settings dataclass that a setting sets."""

    field: str  # its name in the dataclass (and in its SettingError)
    type: type = int  # int, float, bool (a switch) or str (one word, lower-cased)
    word: str = ""  # its name in the chat's messages ("window W"); default: the field's name
    metavar: str = "N"  # the command line's
    none: tuple[str, ...] = ()  # words the chat takes for None ("random" for the seed)

    @property
    def in_chat(self) -> str:
        return self.word or self.field


@dataclass(frozen=True)
class Setting:
    """A setting the user can change: by a flag, a chat command or both. Its values are one dataclass's fields."""

    name: str
    help: str
    values: tuple[Value, ...]
    of: Literal["strategy", "decoding", "processor"] = "strategy"  # StrategySettings, the chat's and DecodeConfig's
    # fields, or the logits processor the flags build (the chat sets the processor as a whole: /processor)
    flags: tuple[str, ...] = ()  # the first names it in errors
    command: str | None = None  # /command
    arguments: str = "N"  # the chat's usage after the command
    required: int | None = None  # words the chat needs (the rest take the dataclass's defaults); None: all
    expected: str = ""  # the chat's answer to a wrong count of words (one value: "expected one value")
    done: Callable[..., str] | None = None  # the chat's line once the values are set
    shown: Callable[..., str] | None = None  # the value /help shows (default: the values, on/off for a switch)

    @property
    def usage(self) -> str:
        return f"/{self.command} {self.arguments}"

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(value.field for value in self.values)

    @property
    def dest(self) -> str:
        """The flag's name in argparse's namespace."""
        return self.flags[0].removeprefix("--").replace("-", "_")

    @property
    def calibrated(self) -> bool:
        """Chosen per machine unless given (app/calibration.py): its flag has no default of its own."""
        return any(field in CALIBRATED for field in self.fields)

    def show(self, *values: Any) -> str:
        if self.shown is not None:
            return self.shown(*values)
        return " ".join(on_off(v) if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)
                        for v in values)

    def line(self, *values: Any) -> str:
        """What the chat says once `values` are set."""
        if self.done is not None:
            return self.done(*values)
        return f"{self.values[0].in_chat} = {self.show(*values)}"


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def processor_params(cls: type[LogitsProcessor]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]


SHORT_NAMES = {"temperature": "T", "top_k": "K", "top_p": "P", "min_p": "MINP"}


def processor_forms() -> str:
    """greedy | multinomial [T] | topk [T [K]] | ...: each processor with its values in order."""
    forms = []
    for name, cls in PROCESSORS.items():
        values = [SHORT_NAMES.get(p.name, p.name.upper()) for p in processor_params(cls)]
        forms.append(" ".join([name] + ([f"[{' '.join(values)}]"] if values else [])))
    return " | ".join(forms)


_s = StrategySettings


def _alternatives(n: int) -> str:
    return f"draft alternatives = {n}" + (" (a chain)" if n == 0 else f": the draft model's next {n} best tokens at "
                                                                       "each depth are verified too (greedy only)")


def _cumulative(p: float) -> str:
    return f"draft cumulative threshold = {p:g}" + (": the draft model always drafts gamma tokens" if p == 0 else
                                                    ": the draft model stops once the product of its token "
                                                    "probabilities falls below it")


def _typical(on: bool) -> str:
    return ("typical acceptance on for eagle and medusa when sampling: NOT lossless, the answer no longer follows the "
            "target's distribution" if on else "typical acceptance off: lossless verification")


SETTINGS: tuple[Setting, ...] = (
    Setting("gamma", "the most tokens drafted per round (speculative, auto, ngram, lookup, eagle, medusa)",
            (Value("gamma"),), flags=("--gamma", "--draft-max", "--num-assistant-tokens"), command="gamma",
            done=lambda n: f"gamma (most tokens drafted per round) = {n}"),
    Setting("max_new_tokens", "max new tokens per answer", (Value("max_new_tokens", word="max new tokens"),),
            of="decoding", flags=("--max-new-tokens", "-n", "--n-predict"), command="length"),
    Setting("temperature", "0 = greedy", (Value("temperature", float, metavar="T"),), of="processor",
            flags=("--temperature", "--temp")),
    Setting("top_k", "top-k sampling (with --temperature > 0)", (Value("top_k", metavar="K"),), of="processor",
            flags=("--top-k",)),
    Setting("top_p", "nucleus sampling (with --temperature > 0)", (Value("top_p", float, metavar="P"),),
            of="processor", flags=("--top-p",)),
    Setting("min_p", "min-p sampling (with --temperature > 0; replaces --top-k and --top-p)",
            (Value("min_p", float, metavar="P"),), of="processor", flags=("--min-p",)),
    Setting("processor", f"sampling: {processor_forms()}; values in order or as key=value (top_p=0.9), defaults for "
            "the rest", (Value("processor", LogitsProcessor),), of="decoding", command="processor",
            arguments="NAME [VALUES]"),
    Setting("seed", "sampling seed (same seed, same output)", (Value("seed", none=("random", "none")),),
            of="decoding", flags=("--seed", "-s"), command="seed", arguments="N|random",
            shown=lambda seed: "random" if seed is None else str(seed)),
    Setting("draft_alternatives", "greedy: also verify the draft model's next N best tokens at each depth (0: a chain)",
            (Value("draft_alternatives", word="draft alternatives"),), flags=("--alternatives",),
            command="alternatives", done=_alternatives),
    Setting("verify_width", "the most tokens one verify forward takes: the draft model's alternatives and prompt "
            "lookup's other copies fill up to it, the least likely dropped first",
            (Value("verify_width", word="verify width", metavar="W"),), flags=("--verify-width",), command="width",
            arguments="W", done=lambda n: f"verify width = {n}: a draft holds at most {n - 1} tokens with the draft "
                                          "model's alternatives or prompt lookup's other copies (the chain itself is "
                                          "capped by gamma)"),
    Setting("draft_cumulative", "the draft model stops once the product of its token probabilities (its estimate "
            "that the whole draft is accepted) falls below P (0: always gamma tokens)",
            (Value("draft_cumulative", float, word="the cumulative threshold", metavar="P"),),
            flags=("--draft-cumulative",), command="cumulative", arguments="P", done=_cumulative),
    Setting("ngram_store", "n-gram store kind and size n (contexts of n-1 tokens)",
            (Value("ngram_kind", str, word="store kind"), Value("ngram_n", word="n-gram size")),
            command="ngram-store", arguments=f"{'|'.join(STORE_KINDS)} N", expected="expected a kind and a size",
            done=lambda kind, n: f"n-gram store: {kind}, n = {n} (a fresh store)"),
    Setting("ngram_filler_top_k", "add the target's top-K predictions to the n-gram store (0: off)",
            (Value("ngram_filler_top_k", word="filler top-k"),), command="filler", arguments="K",
            done=lambda k: f"n-gram filler top-k = {k}" + (" (off)" if k == 0 else "")),
    Setting("ngram_reset_each_prompt", "on: a fresh n-gram store for each prompt; off: it persists",
            (Value("ngram_reset_each_prompt", bool),), command="ngram-reset", arguments="[on|off]",
            done=lambda reset: "the n-gram store " + ("starts fresh each prompt" if reset else
                                                       "persists across prompts")),
    Setting("lookup_ngram", "prompt lookup n-gram sizes",
            (Value("lookup_max_ngram", word="max n-gram"), Value("lookup_min_ngram", word="min n-gram")),
            command="lookup-ngram", arguments="MAX [MIN]", required=1, expected="expected MAX [MIN]",
            done=lambda high, low: f"prompt lookup n-grams from {high} down to {low}"),
    Setting("head_branch", "eagle and medusa: each draft node's likeliest children kept in the tree (1: a chain)",
            (Value("head_branch", word="head branch"),), flags=("--head-branch",), command="branch",
            done=lambda n: f"head branch = {n}" + (": eagle and medusa draft a chain" if n == 1 else
                                                   f": eagle and medusa keep each node's {n} likeliest children")),
    Setting("head_lookup", "eagle and medusa: prompt lookup drafts where the context holds a copy, the head elsewhere "
            "(auto's rule); off: the head alone", (Value("head_lookup", bool),), flags=("--head-lookup",),
            command="head-lookup", arguments="[on|off]",
            done=lambda on: "eagle and medusa: " + ("prompt lookup where the context holds a copy, the head elsewhere"
                                                    if on else "the head alone drafts")),
    Setting("session_min_match", "auto, eagle and medusa: where the context holds no copy, the session's earlier "
            "prompts and answers draft the round where the context's last N tokens occurred in them (0: off)",
            (Value("session_min_match", word="session match"),), flags=("--session-match",),
            command="session-match",
            done=lambda n: "drafts from the session's earlier text: " + (f"where {n} tokens or more match" if n
                                                                        else "off")),
    Setting("typical", f"sampling with eagle or medusa: Medusa's typical acceptance (threshold "
            f"{_s.typical_threshold:g}, alpha {_s.typical_alpha:g}). NOT lossless: the answer no longer follows the "
            "target's distribution", (Value("typical", bool),), flags=("--typical",), command="typical",
            arguments="[on|off]", done=_typical),
    Setting("lookahead", "lookahead: Jacobi window W, n-gram size N, verified candidates G",
            (Value("lookahead_window", word="window W", metavar="W"),
             Value("lookahead_ngram", word="n-gram size N", metavar="N"),
             Value("lookahead_candidates", word="candidates G", metavar="G")),
            flags=("--lookahead",), command="lookahead-params", arguments="W N G", expected="expected W N G",
            done=lambda w, n, g: f"lookahead: window W = {w}, n-gram size N = {n}, candidates G = {g} "
                                 f"(up to {(w + g) * (n - 1)} tokens per forward)"),
    Setting("num_beams", "beam width for the beam strategy", (Value("num_beams", word="number of beams"),),
            flags=("--num-beams",), command="beams", done=lambda n: f"beams = {n}"),
)

BY_NAME = {setting.name: setting for setting in SETTINGS}


def flag_of(field: str) -> str:
    """The flag that sets `field`, as the command line's errors name it ("--lookahead N"); else the field."""
    for setting in SETTINGS:
        if setting.flags and field in setting.fields:
            many = len(setting.values) > 1
            return setting.flags[0] + (f" {setting.values[setting.fields.index(field)].metavar}" if many else "")
    return field


def word_of(field: str) -> str:
    """`field` in the chat's words ("window W"); else the field."""
    for setting in SETTINGS:
        for value in setting.values:
            if value.field == field and setting.command:
                return value.in_chat
    return field
