"""The conversation: the settings the user changes, the history, and the turns it runs on one `app.engine.Engine`.

KV reuse: the engine keeps one `CachedModel` per model for its whole life. Each prompt is the whole conversation
rendered with the chat template; `CachedModel.extend` finds the longest prefix its cache already holds and feeds only
the rest, so a new turn prefills only the new tokens. Before each strategy runs, the caches it feeds are cropped back
to what they shared with the prompt when the turn began, so every strategy in a comparison prefills the same tokens.
Caches a strategy does not feed are left alone: cropping the drafter's before an autoregressive run would throw away
the turn the drafter just saw, and it would prefill the whole conversation again next turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from app.calibration import Tuning
from app.compiling import COMPILING
from app.engine import Engine, ModelInfo
from app.startup import Records
from app.text import chat_ids
from models.invariance import Invariance
from sampling.base import MAX_SEED, DecodeConfig, Result, Round, Stats, Strategy
from sampling.settings import NEEDS_DRAFTER, NEEDS_HEAD, STRATEGIES, StrategySettings
from sampling.speculative import Speculative
from utils.caching import common_prefix_length
from utils.checks import integer
from utils.logits_processor import GreedyProcessor, LogitsProcessor
from utils.runner import CachedModel

__all__ = ["COMPILING", "ChatSession", "ChatSettings", "ContextOverflow", "Message", "ModelInfo", "Plan", "Run"]


class ContextOverflow(ValueError):
    """The prompt does not fit the context. The message says why; `advice(option)` adds the fix in the caller's own
    words, since the option that lowers max new tokens is /length in the REPL and --max-new-tokens on the command
    line."""

    def __init__(self, reason: str, shorten: bool = True):
        super().__init__(reason)
        self.shorten = shorten  # False: shortening the prompt cannot help, only fewer new tokens can

    def advice(self, length_option: str) -> str:
        return f"{self}: {'shorten it or lower' if self.shorten else 'lower'} {length_option}"


@dataclass(frozen=True)
class Message:
    role: str  # "user" | "assistant"
    content: str


@dataclass(frozen=True)
class ChatSettings:
    strategies: tuple[str, ...] = ("speculative", "autoregressive")  # enabled; the first one's answer is kept
    strategy: StrategySettings = StrategySettings()
    processor: LogitsProcessor = field(default_factory=GreedyProcessor)
    max_new_tokens: int = 256
    seed: int | None = None
    chat_template: bool = True
    system: str | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.strategies:
            raise ValueError("at least one strategy must be enabled")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError("a strategy is listed twice")
        integer("max_new_tokens", self.max_new_tokens, 1)
        if self.seed is not None:
            integer("seed", self.seed, 0, MAX_SEED)


@dataclass
class Plan:
    """The prompt of one turn: its token ids and how many of the oldest turns were dropped to fit the context."""

    ids: list[int]
    dropped_turns: int = 0
    reused: int = 0  # prompt tokens the target's cache already held when the turn began


@dataclass
class Run:
    """One strategy's answer to one prompt: the rounds streamed so far, read as a `Result`."""

    strategy: str
    rounds: list[Round] = field(default_factory=list)
    interrupted: bool = False
    error: str | None = None  # why it failed, where a turn goes on past a failed strategy (the one-shot mode)
    lossless: bool = True  # False: typical acceptance while sampling (the output does not follow the target's)
    identity: str | None = None  # greedy identity with autoregressive: `ChatSession.greedy_identity`
    claims_identity: bool = True  # False: greedy output may differ from autoregressive's by design (beam search)

    @property
    def result(self) -> Result:
        return Result.from_rounds(self.rounds)

    @property
    def token_ids(self) -> list[int]:
        return self.result.token_ids

    @property
    def finished(self) -> bool:
        return self.result.finished

    @property
    def stats(self) -> Stats:
        return self.result.stats


class ChatSession:
    keep_after_drop = 0.5  # the share of the prompt room a conversation that outgrew the context is cut down to

    def __init__(self, engine: Engine, settings: ChatSettings = ChatSettings()):
        """A conversation on `engine` (loaded, probed, calibrated and compiling as it was started)."""
        self.engine = engine
        self.history: list[Message] = []  # what the model sees: user/assistant pairs, oldest first
        self.settings = settings
        self._strategies: dict[str, Strategy] = {}
        self._reuse: dict[int, int] = {}
        self.configure(settings)

    # -- what the engine holds, as the chat shows it ------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def target(self) -> CachedModel:
        return self.engine.target

    @property
    def drafter(self) -> CachedModel | None:
        return self.engine.drafter

    @property
    def tokenizers(self):
        """(target's, drafter's) where the drafter's vocabulary differs (it drafts text); None where it is the same."""
        return self.engine.tokenizers

    @property
    def heads(self) -> dict:
        return self.engine.heads

    @property
    def end_ids(self) -> tuple[int, ...]:
        return self.engine.end_ids

    @property
    def invariance(self) -> Invariance | None:
        """Whether a verify rounds as the steps do on this machine (the engine's probe); None: not probed."""
        return self.engine.identity

    @property
    def tuning(self) -> Tuning | None:
        return self.engine.tuning

    @property
    def records(self) -> Records | None:
        return self.engine.records

    @property
    def compile_status(self) -> str | None:
        """The drafter's compiled one-token step: None (not asked) or its state."""
        return self.engine.compiles.status("drafter")

    @property
    def target_compile_status(self) -> str | None:
        """The target's compiled forward, likewise."""
        return self.engine.compiles.status("target")

    @property
    def compiling(self) -> bool:
        return self.engine.compiles.running

    def compile_paused(self) -> contextlib.AbstractContextManager:
        """Hold a background compile while the block runs (a turn: its timings then compare with later turns')."""
        return self.engine.compiles.paused()

    # -- settings ---------------------------------------------------------------------------------

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def configure(self, settings: ChatSettings) -> None:
        """Apply new settings; on a ValueError nothing changes. Strategies are rebuilt only when their settings
        change (an n-gram store that persists across prompts lives inside its strategy)."""
        missing = [s for s in settings.strategies if s in NEEDS_DRAFTER and self.drafter is None]
        if missing:
            raise ValueError(f"strategy {missing[0]!r} needs a drafter model (start with --drafter)")
        headless = [s for s in settings.strategies if s in NEEDS_HEAD and s not in self.heads]
        if headless:
            raise ValueError(f"strategy {headless[0]!r} needs a trained {headless[0]} head (start with --head DIR)")
        keep = self._strategies if settings.strategy == self.settings.strategy else {}
        built = {name: keep.get(name) or self.engine.build(name, settings.strategy) for name in settings.strategies}
        self._strategies = {**keep, **built}
        self.settings = settings

    def update(self, **changes) -> ChatSettings:
        self.configure(replace(self.settings, **changes))
        return self.settings

    def update_strategy(self, **changes) -> ChatSettings:
        return self.update(strategy=replace(self.settings.strategy, **changes))

    def greedy_identity(self, name: str) -> str | None:
        """For a strategy whose greedy output must equal autoregressive's, token for token: "exact" where this
        machine computes a verify as its steps, "not exact on this machine", or "not probed"; None when sampling
        and for the strategies that make no such claim (autoregressive itself, beam search, the drafter alone)."""
        if not self.settings.processor.is_greedy or not isinstance(self._strategies.get(name), Speculative):
            return None
        if self.invariance is None:
            return "not probed"
        return "exact" if self.invariance.exact else "not exact on this machine"

    def claims_greedy_identity(self, name: str) -> bool:
        """Whether strategy `name`'s greedy output is meant to equal autoregressive's: autoregressive's own and every
        speculative one's; beam search (the likeliest sequence) and the drafter alone (another model) make no claim."""
        return name == "autoregressive" or isinstance(self._strategies.get(name), Speculative)

    def calibrate(self, again: bool = False) -> Tuning:
        """Probe the target's path and time this machine's forwards again (`again`), or take what was kept for it,
        and set the drafting settings they call for, except those the user chose at start (`Engine.keep`)."""
        tuning = self.engine.calibrate(self.settings.strategy, again=again)
        self.update(strategy=tuning.settings)
        return tuning

    def reset(self) -> None:
        """Forget the conversation (and any n-gram store, and the session's text that auto drafts from); the caches
        stay and are re-synced by the next prompt."""
        self.history.clear()
        self.engine.session.clear()
        self._strategies.clear()
        self.configure(self.settings)

    def retract(self, user_text: str) -> list[Message]:
        """Take the last exchange out of the history where it answers `user_text` (a turn that asks it again then
        replaces it); what was taken, for `restore` ([] where the history does not end with that exchange)."""
        if len(self.history) >= 2 and self.history[-2] == Message("user", user_text) and \
                self.history[-1].role == "assistant":
            taken = self.history[-2:]
            del self.history[-2:]
            return taken
        return []

    def restore(self, messages: list[Message]) -> None:
        """Put back what `retract` took."""
        self.history += messages

    def load(self, settings: ChatSettings, history: list[Message]) -> None:
        """Resume a saved conversation: its settings first (on a ValueError nothing changes), then its history, with
        fresh strategies (an n-gram store starts empty, as after `reset`, and so does the session's text that auto
        drafts from). The caches stay: the next prompt keeps whatever start it shares with them."""
        kept = self._strategies
        self._strategies = {}
        try:
            self.configure(settings)
        except ValueError:
            self._strategies = kept
            raise
        self.history = list(history)
        self.engine.session.clear()

    @property
    def uses_template(self) -> bool:
        return self.settings.chat_template and self.has_template

    @property
    def context_length(self) -> int:
        """The shortest context of the models the enabled strategies use (the target's at most)."""
        fed = [lm for name in self.settings.strategies for lm in self._strategies[name].models]
        return min([self.target.max_length] + [lm.max_length for lm in fed])

    @property
    def context_limit(self) -> int:
        """The longest prompt that leaves room for max_new_tokens."""
        return self.context_length - self.settings.max_new_tokens

    # -- prompts ----------------------------------------------------------------------------------

    def render(self, messages: list[Message]) -> list[int]:
        """Token ids of `messages` (after the system prompt) through the chat template, ready for the reply."""
        chat = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return chat_ids(self.tokenizer, chat + [{"role": m.role, "content": m.content} for m in messages])

    def plan(self, user_text: str) -> Plan:
        """The prompt for `user_text`: the conversation so far through the template (or the bare text without it).
        A conversation that outgrew the context loses its oldest turns in one chunk, down to about half the room
        (`keep_after_drop`), so the start of the prompt, and with it the cache, then stays the same for the turns
        that follow; dropping one turn at a time would change it, and re-prefill nearly all of it, every turn.
        The system prompt always stays. Raises ContextOverflow if even the new message alone is too long."""
        limit = self.context_limit
        if limit < 1:
            raise ContextOverflow(f"max new tokens ({self.settings.max_new_tokens}) leaves no room for a prompt in "
                                  f"the model's context ({self.context_length})", shorten=False)
        if not self.uses_template:
            ids = self.tokenizer(user_text)["input_ids"]
            return self._fit(ids, limit, 0)
        message = Message("user", user_text)
        ids = self.render(self.history + [message])
        if len(ids) <= limit:
            return self._fit(ids, limit, 0)
        fitting = None  # the fewest dropped turns that fit: the answer where no drop gets the prompt down to half
        for dropped in range(1, len(self.history) // 2 + 1):
            ids = self.render(self.history[2 * dropped:] + [message])
            if len(ids) <= limit * self.keep_after_drop:
                return self._fit(ids, limit, dropped)
            if fitting is None and len(ids) <= limit:
                fitting = self._fit(ids, limit, dropped)
        return fitting or self._fit(ids, limit, len(self.history) // 2)

    def _fit(self, ids: list[int], limit: int, dropped: int) -> Plan:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > limit:
            raise ContextOverflow(f"the prompt has {len(ids)} tokens; the context allows {limit} "
                                  f"(max positions minus {self.settings.max_new_tokens} new tokens)")
        return Plan(ids, dropped)

    def begin(self, plan: Plan) -> None:
        """Start a turn: drop the turns the plan dropped, take the target's compiled forward if it is ready, and note
        how much of the prompt each cache holds."""
        del self.history[: 2 * plan.dropped_turns]
        self.target.adopt_compiled()
        self._reuse = {}
        for lm in self._models():
            self._reuse[id(lm)] = common_prefix_length(lm.tokens, plan.ids)
        plan.reused = self._reuse[id(self.target)]

    def lossless(self, name: str) -> bool:
        """Whether `name` keeps the target's output distribution with the current settings."""
        return self.settings.processor.is_greedy or getattr(self._strategies.get(name), "lossless", True)

    def stream(self, name: str, plan: Plan) -> Iterator[Round]:
        """The rounds of strategy `name` on the planned prompt, from caches cropped back to the turn's start."""
        strategy = self._strategies[name]
        for lm in strategy.models:  # an interrupted forward leaves a cache empty (CachedModel resets it): min()
            lm.crop(min(len(lm.tokens), self._reuse.get(id(lm), 0)))
        return strategy.stream(plan.ids, self.decode_config())

    def decode_config(self) -> DecodeConfig:
        s = self.settings
        return DecodeConfig(s.max_new_tokens, s.processor, () if s.ignore_eos else self.end_ids, s.seed)

    def answer_ids(self, run: Run) -> list[int]:
        """The answer without the end token that closed it."""
        ids = run.token_ids
        return ids[:-1] if run.finished and ids and ids[-1] in self.end_ids else ids

    def decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)

    def record(self, user_text: str, answer: str, ids: list[int]) -> None:
        """Add a finished (or interrupted) turn to the history the model sees (raw completions are not chat), and its
        prompt and answer `ids` to the session's text the turns after draft from: once a turn's every run is over,
        so that no strategy of the turn copies another's answer."""
        self.engine.session.add(ids)
        if self.uses_template:
            self.history += [Message("user", user_text), Message("assistant", answer)]

    def _models(self) -> list[CachedModel]:
        return [self.target] + ([self.drafter] if self.drafter is not None else [])

