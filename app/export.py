"""The command line that serves the chat's pair on a serving engine: vLLM, SGLang or llama.cpp's server, with the
drafter, trained head or prompt-lookup settings the chat runs (its first drafting strategy) and its gamma.

`export` is plain data in, plain data out (importable without torch): a `Serving` (where the models' files are) and
the strategy settings give an `Export` (the argv and a line for each thing the engine does otherwise or cannot do);
`serving` finds the files (a converted model's folder, its GGUF, a head written in the EAGLE layout) and imports
torch. The engines' option names are those their documentation lists (tests/test_export.py names the sources).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sampling.settings import StrategySettings

ENGINES = ("vllm", "sglang", "llamacpp")
NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}
# What a strategy drafts with, as the engines know it: a draft model, an EAGLE head, or n-grams of the context
# ("drafter", the draft model alone, and beam search serve no speculation)
KINDS = {"speculative": "draft", "auto": "draft", "eagle": "eagle", "lookup": "lookup",
         "ngram": "lookup", "lookahead": "lookup", "medusa": "draft"}
# Each engine's name for each kind ("" where it has none)
METHODS = {
    "vllm": {"draft": "draft_model", "eagle": "eagle", "lookup": "ngram"},
    "sglang": {"draft": "STANDALONE", "eagle": "EAGLE", "lookup": "NGRAM"},
    "llamacpp": {"draft": "draft-simple", "eagle": "", "lookup": "ngram-simple"},
}


@dataclass(frozen=True)
class Serving:
    """Where the pair's files are: the folder (or Hub id) vLLM and SGLang read, the GGUF llama.cpp reads (None: the
    model has none), and an eagle head in the EAGLE layout (with what differs there, one line each)."""

    target: str
    target_gguf: str | None = None
    drafter: str | None = None
    drafter_gguf: str | None = None
    eagle: str | None = None
    eagle_notes: tuple[str, ...] = ()
    token_map: str | None = None  # SGLang's: the token ids the head drafts from
    same_vocab: bool = True  # False: the drafter has another tokenizer than the target's


@dataclass(frozen=True)
class Export:
    engine: str
    argv: list[str]
    notes: list[str] = field(default_factory=list)  # one line each: what the engine does otherwise, or cannot do

    @property
    def command(self) -> str:
        """The argv as one POSIX shell command line (each word quoted: `shell_word`)."""
        return " ".join(shell_word(word) for word in self.argv)

    def script(self) -> str:
        """A shell script: the notes as comments (one line each, whatever the paths in them hold), then the command."""
        return "#!/bin/sh\n" + "".join(f"# {printable(note)}\n" for note in self.notes) + f"exec {self.command}\n"


# The characters Python decodes a path's bytes that are not UTF-8 into (os.fsdecode's surrogate escapes)
UNDECODABLE = re.compile("([\udc80-\udcff]+)")


def shell_word(word: str) -> str:
    """`word` as one word of a POSIX shell, quoted (shlex.quote: nothing in it expands, a newline included); a byte
    that is not UTF-8 (a path's) is written by printf's octal escape, so the line is text and the word its bytes."""
    parts = UNDECODABLE.split(word)
    quoted = [shlex.quote(part) if index % 2 == 0 else
              "\"$(printf '" + "".join(f"\\{ord(c) - 0xDC00:03o}" for c in part) + "')\""
              for index, part in enumerate(parts) if part]
    return "".join(quoted) or "''"


def printable(text: str) -> str:
    """`text` with each character that could end or disturb a line (a newline, a control or format character, a byte
    that is not UTF-8) written as its escape: a note stays one line, in a script's comment or on a terminal."""
    return "".join(c if c.isprintable() else f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff"
                   else c.encode("unicode_escape").decode("ascii") for c in text)


def drafting_strategy(strategies: tuple[str, ...]) -> str | None:
    """The first enabled strategy that drafts (the one the chat's answer comes from, or the next), None if none."""
    return next((name for name in strategies if name in KINDS), None)


def export(engine: str, serving: Serving, strategies: tuple[str, ...], settings: StrategySettings) -> Export:
    """The command that serves `serving`'s target on `engine` with the first drafting strategy of `strategies`."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    notes: list[str] = []
    strategy = drafting_strategy(strategies)
    kind = _kind(engine, strategy, serving, notes)
    build = {"vllm": _vllm, "sglang": _sglang, "llamacpp": _llamacpp}[engine]
    argv = build(kind, serving, settings, notes)
    return Export(engine, argv, [printable(note) for note in notes])  # a path in a note may hold a newline


def _kind(engine: str, strategy: str | None, serving: Serving, notes: list[str]) -> str | None:
    """What the engine drafts with for `strategy`; the nearest where it has no equivalent, said in `notes`."""
    name = NAMES[engine]
    if strategy is None:
        notes.append("no drafting strategy enabled: served without speculative decoding")
        return None
    kind = KINDS[strategy]
    if kind == "draft" and serving.drafter is None:
        kind = "lookup"
    if kind == "draft" and not serving.same_vocab:
        if engine == "vllm":
            notes.append("a drafter of another tokenizer: vLLM's use_heterogeneous_vocab drafts only the tokens both "
                         "vocabularies share, greedily (here: the drafter's text, re-tokenized)")
        else:
            kind = "lookup"
            notes.append(f"a drafter of another tokenizer: no {name} equivalent (its draft model shares the "
                         f"target's vocabulary); nearest: {METHODS[engine][kind]}")
    if kind == "eagle" and (serving.eagle is None or not METHODS[engine]["eagle"]):
        kind = "draft" if serving.drafter is not None else "lookup"
        why = "" if serving.eagle is None else " (llama.cpp drafts with EAGLE-3 heads, and this head is EAGLE-1's)"
        notes.append(f"eagle: no {name} equivalent{why}; nearest: {METHODS[engine][kind]}")
    elif strategy in ("auto", "ngram", "lookahead", "medusa"):
        what = {"auto": "prompt lookup where the context repeats, the draft model elsewhere",
                "ngram": "an n-gram store of the conversation", "lookahead": "Jacobi guesses and an n-gram pool",
                "medusa": "this project's Medusa heads share the target's output layer"}[strategy]
        notes.append(f"{strategy} ({what}): no {name} equivalent; nearest: {METHODS[engine][kind]}")
    return kind


def _head_lookup_note(s: StrategySettings, engine: str) -> list[str]:
    return [f"{engine} drafts with the head alone (here prompt lookup drafts where the context holds a copy: "
            "--no-head-lookup compares the same)"] if s.head_lookup else []


def _vllm(kind: str | None, serving: Serving, s: StrategySettings, notes: list[str]) -> list[str]:
    argv = ["vllm", "serve", serving.target]
    if kind is None:
        return argv
    config: dict[str, Any] = {"method": METHODS["vllm"][kind]}
    if kind == "draft":
        config["model"] = serving.drafter
        if not serving.same_vocab:
            config["use_heterogeneous_vocab"] = True
    elif kind == "eagle":
        config["model"] = serving.eagle
        notes.extend([*serving.eagle_notes, *_head_lookup_note(s, "vLLM")])
        notes.append(f"vLLM drafts a chain of {s.gamma} from the head (here: EAGLE-2's tree of up to "
                     f"{s.verify_width - 1} tokens)")
    config["num_speculative_tokens"] = s.gamma
    if kind == "lookup":
        config.update(prompt_lookup_min=s.lookup_min_ngram, prompt_lookup_max=s.lookup_max_ngram)
    return argv + ["--speculative-config", json.dumps(config)]


def _sglang(kind: str | None, serving: Serving, s: StrategySettings, notes: list[str]) -> list[str]:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", serving.target]
    if kind is None:
        return argv
    argv += ["--speculative-algorithm", METHODS["sglang"][kind]]
    if kind == "lookup":
        return argv + ["--speculative-num-draft-tokens", str(s.gamma + 1),
                       "--speculative-ngram-min-match-window-size", str(s.lookup_min_ngram),
                       "--speculative-ngram-max-match-window-size", str(s.lookup_max_ngram)]
    if kind == "eagle":
        notes.extend([*serving.eagle_notes, *_head_lookup_note(s, "SGLang")])
        # EAGLE-2's tree as SGLang shapes it: gamma levels, `head_branch` children a node, the verify width in all
        token_map = ["--speculative-token-map", serving.token_map] if serving.token_map else []
        return argv + ["--speculative-draft-model-path", str(serving.eagle), "--speculative-num-steps", str(s.gamma),
                       "--speculative-eagle-topk", str(s.head_branch),
                       "--speculative-num-draft-tokens", str(s.verify_width), *token_map]
    return argv + ["--speculative-draft-model-path", str(serving.drafter), "--speculative-num-steps", str(s.gamma),
                   "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(s.gamma + 1)]


def _llamacpp(kind: str | None, serving: Serving, s: StrategySettings, notes: list[str]) -> list[str]:
    argv = ["llama-server", "-m", _gguf(serving.target, serving.target_gguf, notes)]
    if kind is None:
        return argv
    if kind == "lookup":
        return argv + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(s.lookup_max_ngram),
                       "--spec-ngram-simple-size-m", str(s.gamma)]
    notes.append("llama.cpp stops a draft on each token's probability (--spec-draft-p-min), not on the product of them "
                 "as here: left at its default")
    return argv + ["-md", _gguf(str(serving.drafter), serving.drafter_gguf, notes), "--spec-type", "draft-simple",
                   "--spec-draft-n-max", str(s.gamma)]


def _gguf(model: str, gguf: str | None, notes: list[str]) -> str:
    if gguf is not None:
        return gguf
    name = f"{Path(model).name}.gguf"
    notes.append(f"llama.cpp reads GGUF files and {model} has none: convert it with llama.cpp's "
                 f"convert_hf_to_gguf.py and give its path for {name}")
    return name


def serving(engine: str, target: str, drafter: str | None, eagle_head: str | None, target_config,
            cache_dir: Path | None, progress: bool = False, same_vocab: bool = True) -> Serving:
    """The files of the pair `target`/`drafter` (specs as --target takes them) on disk, and the eagle head in the
    EAGLE layout `engine` loads: one of this project's is written into the cache dir (exports/), a published one is
    used as it is. Imports torch; ModelLoadError (one line) where a file cannot be made."""
    from models.loading import model_files
    from models.presets import default_cache_dir
    from sampling.heads.layouts import LAYOUTS, TOKEN_MAP, write_eagle
    from sampling.heads.networks import CONFIG

    target_files = model_files(target, cache_dir, progress)
    drafter_files = model_files(drafter, cache_dir, progress) if drafter is not None else None
    eagle, notes, token_map = eagle_head, tuple[str, ...](), None
    if eagle_head is not None and (Path(eagle_head) / CONFIG).is_file() and engine in LAYOUTS:
        name = f"{Path(eagle_head).resolve().name}-{engine}"
        eagle = str((cache_dir or default_cache_dir()) / "exports" / name)
        notes = tuple(write_eagle(eagle_head, eagle, target_config, layout=engine))
        token_map = str(Path(eagle) / TOKEN_MAP) if (Path(eagle) / TOKEN_MAP).is_file() else None
    return Serving(target_files.folder, target_files.gguf, drafter_files.folder if drafter_files else None,
                   drafter_files.gguf if drafter_files else None, eagle, notes, token_map, same_vocab)
