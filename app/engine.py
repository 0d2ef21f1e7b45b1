"""The one way in: a target and its drafter loaded, probed, calibrated and compiled, then asked for text.

    engine = Engine.load("embedded")
    reply = engine.generate("Reverse a string in Python.", strategy="speculative", max_new_tokens=64)
    for piece in engine.stream([{"role": "user", "content": "And in Rust?"}]):
        print(piece, end="")

`Engine.load` is the whole start in one call: the pair and its draft heads, the identity probe, this machine's
calibration and the compiled graphs. `Engine(...)` wraps models already in memory (the tests' tiny ones). infer.py,
bench.py and train_head.py start through it; the chat (chat/session.py) keeps a conversation on top of one.

Its cached models live as long as it does: a prompt that extends the last one's tokens prefills only the new ones.
One generation at a time: it is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from app.compiling import Compiles, drafter_compiles_by_default, target_compiles_by_default
from app.info import ModelInfo
from app.startup import SILENT, Records, Report, Said, probe_and_calibrate, records_for, use_kernels
from app.text import Detokenizer, chat_ids
from app.yardstick import Contestant, Yardstick
from sampling.base import DecodeConfig, Result, Round, Strategy
from sampling.drafters.session import SessionText
from sampling.registry import build_strategy
from sampling.settings import NEEDS_DRAFTER, NEEDS_HEAD, STRATEGIES, StrategySettings
from utils.logits_processor import make_processor
from utils.runner import CachedModel

if TYPE_CHECKING:
    from app.calibration import Tuning
    from models.draft_vocabulary import DraftVocabulary
    from models.invariance import Invariance
    from models.loading import LoadedPair
    from sampling.heads.networks import DraftHead

DEFAULT_MAX_NEW_TOKENS = 256
SAMPLING = ("temperature", "top_k", "top_p", "min_p")
DECODING = ("max_new_tokens", *SAMPLING, "seed", "ignore_eos", "stop")
STRATEGY_SETTINGS = tuple(f.name for f in fields(StrategySettings))


@dataclass(frozen=True)
class ReplyStats:
    """One generation's numbers: the prompt's prefill (to the first token), then the decode after it."""

    strategy: str
    prompt_tokens: int
    prompt_seconds: float  # to the first new token: the prefill and the first round
    new_tokens: int
    decode_seconds: float  # after the first round
    tokens_per_second: float  # new tokens over the whole generation's time
    drafted: int | None  # None: the strategy drafts nothing
    accepted: int | None
    rounds: int

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted and self.accepted is not None else None

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def __str__(self) -> str:
        accepted = f", {self.acceptance:.0%} of drafts accepted" if self.acceptance is not None else ""
        return (f"{self.strategy}: {self.new_tokens} tokens, {self.tokens_per_second:.1f} tok/s{accepted}, "
                f"{self.tokens_per_round:.2f} tokens a round ({self.prompt_tokens} prompt tokens in "
                f"{self.prompt_seconds:.2f} s)")


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: list[int]  # the new tokens, without the end token that closed them
    stats: ReplyStats
    finish_reason: str  # "stop": an end token, a stop string or the caller; "length": the token budget or the context


class Stream:
    """Text pieces as a generation decodes them; `reply` (and `stats`) once it is exhausted or closed. `close()`, a
    `with` block's end or a `break` stops it between rounds, where the caches hold only committed tokens."""

    def __init__(self, engine: Engine, prompt_ids: list[int], rounds: Generator[Round, None, None], strategy: str,
                 max_new_tokens: int, stop: tuple[str, ...], remember: bool = True):
        self.prompt_ids, self.strategy = prompt_ids, strategy
        self.reply: Reply | None = None
        self._engine, self._rounds, self._max_new_tokens, self._stop = engine, rounds, max_new_tokens, stop
        self._remember = remember
        self._pieces = self._run()

    @property
    def stats(self) -> ReplyStats | None:
        return None if self.reply is None else self.reply.stats

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> Generator[str, None, None]:
        engine, result = self._engine, Result()
        detokenizer = Detokenizer(engine.tokenizer, self.prompt_ids)
        text, sent, stopped = "", 0, False
        try:
            with engine.compiles.paused():
                for r in self._rounds:
                    result.add(r)
                    text += detokenizer.push(_answer(r.tokens, r.finished, engine.end_ids))
                    if (cut := _stop_at(text, self._stop)) is not None:
                        text, stopped = text[:cut], True
                        break
                    ready = len(text) - _held_back(text, self._stop)
                    if ready > sent:
                        yield text[sent:ready]
                        sent = ready
                else:
                    text += detokenizer.flush()
                    if (cut := _stop_at(text, self._stop)) is not None:
                        text, stopped = text[:cut], True
        finally:
            self._rounds.close()  # between rounds: the caches hold the committed tokens
            self.reply = self._reply(result, text, stopped)
            if self._remember:
                engine.session.add(self.prompt_ids + self.reply.token_ids)
        if len(text) > sent:
            yield text[sent:]

    def _reply(self, result: Result, text: str, stopped: bool) -> Reply:
        s, ids = result.stats, _answer(result.token_ids, result.finished, self._engine.end_ids)
        room = min(self._max_new_tokens, self._engine.context_length - len(self.prompt_ids))
        ran_out = not (result.finished or stopped) and len(result.token_ids) >= room
        stats = ReplyStats(self.strategy, len(self.prompt_ids), s.time_to_first_token, s.new_tokens, s.decode_time,
                           s.tokens_per_second, s.drafted or None, s.accepted if s.drafted else None, s.rounds)
        return Reply(text, ids, stats, "length" if ran_out else "stop")


def shipped_vocabulary(target_name: str, drafter_model) -> DraftVocabulary | None:
    """The draft vocabulary counted on the answers of `target_name` the project ships (heads/answers/), for a
    drafter sharing its tokenizer; None where none ship."""
    from models.draft_vocabulary import DraftVocabulary
    from sampling.heads.networks import shipped_answers

    path = shipped_answers(target_name)
    return DraftVocabulary.from_answers(drafter_model, path) if path is not None else None


def llamacpp_speed(runner: Contestant | None, cache_dir: Path | None, report: Report) -> Yardstick | None:
    """llama.cpp's plain speed on the target's GGUF here, timed once and kept (`app.yardstick`); None without a
    runner (llama.cpp not built, or the target has no embedded GGUF)."""
    from app.yardstick import yardstick
    from models.presets import default_cache_dir

    if runner is None:
        return None
    with report.status("timing llama.cpp's plain decoding of the same file (once) …"):
        found, made = yardstick(cache_dir or default_cache_dir(), runner)
    if found is not None and made:
        report.say(found.line(), Said.NEWS)
    return found


def _answer(tokens: list[int], finished: bool, end_ids: tuple[int, ...]) -> list[int]:
    """A round's tokens without the end token that closes the answer."""
    return tokens[:-1] if finished and tokens and tokens[-1] in end_ids else tokens


def _stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string begins in `text`; None if none is there."""
    found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin a stop string: they wait for the next round."""
    return max((n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1)
                if stop.startswith(text[-n:])), default=0)


class Engine:
    """A loaded pair with what the start found out about it: `identity` (the probe's verdict), `settings` (the
    drafting settings calibrated for this machine), `compiles` (the compiled graphs), `info` (what the banner shows);
    asked with `generate` or `stream`."""

    def __init__(self, target_model, tokenizer, drafter_model=None, *, end_ids: tuple[int, ...] | None = None,
                 drafter_prefill_model=None, drafter_tokenizer=None, heads: dict[str, DraftHead] | None = None,
                 settings: StrategySettings = StrategySettings(), keep: frozenset[str] = frozenset(),
                 info: ModelInfo | None = None, pair: LoadedPair | None = None):
        """`drafter_tokenizer`: the drafter's, where its vocabulary differs from the target's (it then drafts text);
        `end_ids`: default, the tokenizer's and the generation config's end tokens; `keep`: the settings the user
        chose, which calibration leaves as they are."""
        from models.vocab import end_token_ids

        self.tokenizer = tokenizer
        self.tokenizers = None if drafter_tokenizer is None else (tokenizer, drafter_tokenizer)
        self.target = CachedModel(target_model)
        self.drafter = CachedModel(drafter_model, drafter_prefill_model) if drafter_model is not None else None
        self.heads = dict(heads or {})  # the trained draft heads by kind (eagle, medusa)
        self.end_ids = tuple(end_ids) if end_ids is not None else \
            end_token_ids(tokenizer, getattr(target_model, "generation_config", None))
        self.settings, self.keep = settings, frozenset(keep)
        self.pair = pair  # what the loader gave, where it loaded the models (the benchmark's baselines read it)
        self.info = info or ModelInfo(type(target_model).__name__, type(drafter_model).__name__ if drafter_model
                                      is not None else None, str(target_model.dtype).removeprefix("torch."),
                                      str(self.target.device))
        self.identity: Invariance | None = None  # whether a verify rounds as the steps do here (`prepare`)
        self.tuning: Tuning | None = None  # the calibration the settings came from; None: not calibrated
        self.records: Records | None = None  # where this machine's probe and timings are kept
        self.compiles = Compiles()
        self._strategies: dict[str, tuple[StrategySettings, Strategy]] = {}
        # The draft model's output layer, restricted or whole (`use_vocabulary`); None where it has no draft
        # vocabulary. `vocabulary_set`: the size the user chose (None: the calibration's).
        self.vocabulary: DraftVocabulary | None = None
        self.vocabulary_set: int | None = None
        self.session = SessionText()  # the prompts and answers so far, which auto drafts from (`stream`'s remember)

    @classmethod
    def load(cls, preset: str | None = None, *, target: str | None = None, drafter: str | None = None,
             heads: list[str] | None = None, cache_dir: Path | None = None, compile: bool | None = None,
             probe: bool = True, calibrate: bool = True, report: Report | None = None,
             settings: StrategySettings | None = None,
             keep: frozenset[str] = frozenset(), background: bool = False, kernels: str | None = None,
             progress: bool = False, yardstick: Callable[[LoadedPair], Contestant | None] | None = None,
             draft_vocabulary: int | None = None, **model_options: Any) -> Engine:
        """Load a preset's pair ("auto", "embedded", "llama-3.2"), or `target` with `drafter` (None with a preset:
        its drafter; "none": none), and start it:
        - the draft heads (`heads`: directories; None: those the project ships for the target);
        - the identity probe and this machine's calibration (`calibrate` False: `settings` as given; `probe` False:
          neither, the models as loaded, for a script that trains on them), leaving the settings in `keep` be;
        - `draft_vocabulary`: the draft model's output layer restricted to that many of the target's most frequent
          tokens (0: the whole vocabulary; None: as the calibration chooses, where the project ships answers of the
          target to count them on);
        - `yardstick`: what runs llama.cpp on the pair's target, timed once here, before the compiles, for `info`;
        - the compiles (`compile` None: where they pay, `app.compiling`), in the foreground unless `background`.
        `model_options` are `models.loading.load_pair`'s (device, dtype, target_quantize, ...).
        ModelLoadError, one line, where a model cannot be loaded."""
        from models.loading import load_pair
        from models.presets import resolve_preset
        from sampling.heads.networks import load_heads
        from utils.errors import ModelLoadError

        if target is None:
            chosen = resolve_preset(preset or "auto")
            target, drafter = chosen.target, drafter or chosen.drafter
            model_options = {"device": chosen.device, "target_quantize": chosen.target_quantize,
                             "drafter_quantize": chosen.drafter_quantize, **model_options}
        if drafter is not None and drafter.lower() == "none":
            drafter = None
        if kernels:
            use_kernels(kernels)
        report = report or SILENT
        pair = load_pair(target, drafter, cache_dir=cache_dir, progress=progress, **model_options)
        if pair.vocab_notice:
            report.say(pair.vocab_notice, Said.PROBLEM)
        engine = cls.from_pair(pair, load_heads(heads, pair.target.name, pair.target.model), settings=settings,
                               keep=keep, info=ModelInfo.of(pair, target, drafter, cache_dir))
        if draft_vocabulary != 0 and pair.drafter is not None and pair.tokenizers is None:
            engine.vocabulary = shipped_vocabulary(pair.target.name, pair.drafter.model)
            engine.vocabulary_set = draft_vocabulary
            if draft_vocabulary is not None and engine.vocabulary is None:
                report.say(f"draft vocabulary {draft_vocabulary}: the project ships no answers of "
                           f"{pair.target.name} to count tokens on; the drafter drafts from its whole vocabulary",
                           Said.PROBLEM)
        engine.warm_up()
        if probe:
            engine.prepare(records_for(pair, cache_dir), calibrate=calibrate, report=report)
        if engine.vocabulary is not None and draft_vocabulary:  # after the timings, which time the whole one too
            try:
                engine.use_vocabulary(draft_vocabulary)
            except ValueError as error:
                raise ModelLoadError(f"--draft-vocabulary {draft_vocabulary}: {error}") from None
        if yardstick is not None:  # before the compiles: a compile beside it would slow llama.cpp down
            engine.info = replace(engine.info, yardstick=llamacpp_speed(yardstick(pair), cache_dir, report))
        engine.compile(compile, compile, background=background, report=report)
        return engine

    @classmethod
    def from_pair(cls, pair: LoadedPair, heads: dict[str, DraftHead] | None = None,
                  settings: StrategySettings | None = None, keep: frozenset[str] = frozenset(),
                  info: ModelInfo | None = None) -> Engine:
        """An engine on a pair `models.loading.load_pair` loaded, not yet probed, calibrated or compiled."""
        drafter = pair.drafter
        return cls(pair.target.model, pair.target.tokenizer, drafter.model if drafter else None, end_ids=pair.end_ids,
                   drafter_prefill_model=drafter.dense if drafter else None,
                   drafter_tokenizer=pair.tokenizers[1] if pair.tokenizers else None, heads=heads,
                   settings=settings or StrategySettings(), keep=keep, info=info or ModelInfo.of(pair), pair=pair)

    # -- the start ---------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """A small prefill and one decode step per model, so that the first generation measured does not pay alone
        for first-touch costs (weights paged in from the memory-mapped files, kernels chosen)."""
        with torch.inference_mode():
            for lm in self.models:
                lm.extend([0] * 8)
                lm.extend([0] * 9)
                lm.reset()

    def prepare(self, records: Records, calibrate: bool = True, report: Report = SILENT) -> None:
        """Probe the target's path (`identity`), then (`calibrate`) take the drafting settings this machine's timed
        forwards call for, but those in `keep`; each probed or timed once per machine, then read back."""
        prepared = probe_and_calibrate(self.target, self.drafter, records, self.settings, self.keep,
                                       calibrate=calibrate, report=report, vocabulary=self._chosen_vocabulary)
        self.identity = prepared.identity
        if prepared.tuning is not None:
            self.tuning, self.records, self.settings = prepared.tuning, records, prepared.tuning.settings
            self._take_vocabulary(prepared.tuning)

    def calibrate(self, settings: StrategySettings, again: bool = False) -> Tuning:
        """Probe and time this machine again (`again`), or read what was kept, from `settings`: the drafting settings
        they call for, but those in `keep`, become `self.settings`. ValueError where the start did not calibrate."""
        if self.records is None:
            raise ValueError("this session was not calibrated at start, so it has nothing to time against")
        prepared = probe_and_calibrate(self.target, self.drafter, self.records, settings, self.keep, again=again,
                                       vocabulary=self._chosen_vocabulary)
        assert prepared.tuning is not None
        self.identity, self.tuning, self.settings = prepared.identity, prepared.tuning, prepared.tuning.settings
        self._take_vocabulary(prepared.tuning)
        return prepared.tuning

    def use_vocabulary(self, size: int) -> None:
        """Draft with the draft model's output layer restricted to its `size` most frequent tokens (0: all of them);
        the banner's drafter line says which. ValueError where the drafter has no draft vocabulary or `size` is out
        of its bounds. A drafter already compiled compiles its step again at its next forward."""
        if self.vocabulary is None:
            raise ValueError("this drafter has no draft vocabulary (no answers of the target ship to count on)")
        self.vocabulary.use(size)
        base = self.info.drafter_format.split(" · draft vocabulary")[0]
        self.info = replace(self.info, drafter_format=base + (f" · draft vocabulary {size}" if size else ""))

    @property
    def draft_vocabulary(self) -> int:
        """The tokens the draft model drafts from where restricted (`use_vocabulary`); 0: its whole vocabulary."""
        return self.vocabulary.size if self.vocabulary is not None else 0

    @property
    def _chosen_vocabulary(self) -> DraftVocabulary | None:
        """The draft vocabulary whose size the calibration chooses: none where the user set it."""
        return self.vocabulary if self.vocabulary_set is None else None

    def _take_vocabulary(self, tuning: Tuning) -> None:
        """The calibration's draft vocabulary size, where the user chose none."""
        if self.vocabulary is not None and self.vocabulary_set is None \
                and tuning.choice.draft_vocabulary != self.vocabulary.size:
            self.use_vocabulary(tuning.choice.draft_vocabulary)

    def compile(self, drafter: bool | None = None, target: bool | None = None, *, background: bool = False,
                report: Report = SILENT):
        """Compile the drafter's short forwards, then the target's whole forward (None: where it pays); now, the
        target's graph taken at once, or on a background thread (returned) that a generation holds while it runs."""
        if drafter is None:
            drafter = self.drafter is not None and drafter_compiles_by_default(self.drafter.model)
        if target is None:
            target = target_compiles_by_default(self.target.model)
        jobs = [(name, lm) for name, lm, wanted in (("drafter", self.drafter, drafter), ("target", self.target, target))
                if wanted and lm is not None]
        thread = self.compiles.start(jobs, background, report)
        if not background:
            self.target.adopt_compiled()
        return thread

    # -- generation --------------------------------------------------------------------------------

    @property
    def models(self) -> list[CachedModel]:
        return [self.target] + ([self.drafter] if self.drafter is not None else [])

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategies this pair can run (a drafter's need one, a head's its trained head)."""
        return tuple(name for name in STRATEGIES if (name not in NEEDS_DRAFTER or self.drafter is not None)
                     and (name not in NEEDS_HEAD or name in self.heads))

    @property
    def context_length(self) -> int:
        return min(lm.max_length for lm in self.models)

    def build(self, name: str, settings: StrategySettings | None = None) -> Strategy:
        """Strategy `name` on this engine's cached models (`sampling.registry.build_strategy`)."""
        return build_strategy(name, self.target, self.drafter, settings or self.settings, self.heads, self.tokenizers,
                              self.session)

    def encode(self, prompt: str | list[dict[str, str]], chat: bool = True) -> list[int]:
        """Prompt ids: messages, or a string as one user message, through the chat template; a string as it is
        where `chat` is False or the tokenizer has no template."""
        if isinstance(prompt, str) and not (chat and getattr(self.tokenizer, "chat_template", None)):
            return self.tokenizer(prompt)["input_ids"]
        return chat_ids(self.tokenizer, [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def generate(self, prompt: str | list[dict[str, str]], strategy: str = "auto", *, chat: bool = True,
                 **settings: Any) -> Reply:
        """The whole reply to `prompt` (see `stream`)."""
        with self.stream(prompt, strategy, chat=chat, **settings) as pieces:
            for _ in pieces:
                pass
        assert pieces.reply is not None
        return pieces.reply

    def stream(self, prompt: str | list[dict[str, str]], strategy: str = "auto", *, chat: bool = True,
               remember: bool = True, **settings: Any) -> Stream:
        """Stream the reply to `prompt` (a string, or {"role", "content"} messages) by `strategy` ("auto" without a
        drafter: autoregressive). `settings`: any `StrategySettings` field (gamma, verify_width, ...), and
        max_new_tokens, temperature, top_k, top_p, min_p, seed, ignore_eos, stop (strings that end the reply).
        `remember`: the prompt and its reply join `session`, the text later prompts' drafts may copy from (False for
        a run that another strategy repeats: it would copy this one's answer).
        ValueError, one line, for an unknown strategy or setting or a value out of its bounds."""
        name = "autoregressive" if strategy == "auto" and self.drafter is None else strategy
        if name not in self.strategies:
            raise ValueError(f"strategy {strategy!r} does not run on this engine; choose from "
                             f"{', '.join(self.strategies)}")
        unknown = sorted(set(settings) - set(DECODING) - set(STRATEGY_SETTINGS))
        if unknown:
            raise ValueError(f"unknown setting {unknown[0]!r}; settings: {', '.join(DECODING + STRATEGY_SETTINGS)}")
        chosen = replace(self.settings, **{k: v for k, v in settings.items() if k in STRATEGY_SETTINGS})
        processor = make_processor(**{k: settings[k] for k in SAMPLING if k in settings})
        budget = settings.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        config = DecodeConfig(budget, processor, () if settings.get("ignore_eos") else self.end_ids,
                              settings.get("seed"))
        stop = settings.get("stop") or ()
        ids = self.encode(prompt, chat)
        self.target.adopt_compiled()  # between generations: one target graph from a generation's start to its end
        rounds = cast(Generator[Round, None, None], self._strategy(name, chosen).stream(ids, config))
        return Stream(self, ids, rounds, name, budget, (stop,) if isinstance(stop, str) else tuple(stop), remember)

    def _strategy(self, name: str, settings: StrategySettings) -> Strategy:
        """The strategy built for these settings, kept while they stay (an n-gram store learns across prompts)."""
        kept = self._strategies.get(name)
        if kept is None or kept[0] != settings:
            kept = self._strategies[name] = (settings, self.build(name, settings))
        return kept[1]
