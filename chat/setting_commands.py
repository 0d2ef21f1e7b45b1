"""The slash-commands that change a setting: each parses its argument and hands it to the session, whose settings
check their own bounds (a SettingError, worded by `dispatch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chat.arguments import (
    UsageError,
    one_word,
    parse_float,
    parse_int,
    parse_processor,
    parse_switch,
)
from chat.render import describe_processor

if TYPE_CHECKING:
    from chat.commands import Context


def gamma(ctx: Context, arg: str) -> None:
    gamma = parse_int(one_word(arg), "gamma")
    ctx.session.update_strategy(gamma=gamma)
    ctx.console.print(f"gamma (most tokens drafted per round) = {gamma}")


def length(ctx: Context, arg: str) -> None:
    n = parse_int(one_word(arg), "max new tokens")
    room = ctx.session.context_length
    if n >= room:
        raise UsageError(f"max new tokens must leave room for a prompt in the context of {room} tokens")
    ctx.session.update(max_new_tokens=n)
    ctx.console.print(f"max new tokens = {n}")


def processor(ctx: Context, arg: str) -> None:
    if arg:
        ctx.session.update(processor=parse_processor(arg))
    ctx.console.print(f"processor: {describe_processor(ctx.session.settings.processor)}")


def seed(ctx: Context, arg: str) -> None:
    word = one_word(arg).lower()
    seed = None if word in ("random", "none") else parse_int(word, "seed")
    ctx.session.update(seed=seed)
    ctx.console.print(f"seed = {'random' if seed is None else seed}")


def ngram_store(ctx: Context, arg: str) -> None:
    words = arg.split()
    if len(words) != 2:
        raise UsageError("expected a kind and a size")
    kind = words[0].lower()
    n = parse_int(words[1], "n-gram size")
    ctx.session.update_strategy(ngram_kind=kind, ngram_n=n)
    ctx.console.print(f"n-gram store: {kind}, n = {n} (a fresh store)")


def filler(ctx: Context, arg: str) -> None:
    k = parse_int(one_word(arg), "filler top-k")
    ctx.session.update_strategy(ngram_filler_top_k=k)
    ctx.console.print(f"n-gram filler top-k = {k}" + (" (off)" if k == 0 else ""))


def ngram_reset(ctx: Context, arg: str) -> None:
    reset = parse_switch(arg, ctx.session.settings.strategy.ngram_reset_each_prompt)
    ctx.session.update_strategy(ngram_reset_each_prompt=reset)
    ctx.console.print("the n-gram store " + ("starts fresh each prompt" if reset else "persists across prompts"))


def lookup_ngram(ctx: Context, arg: str) -> None:
    words = arg.split()
    if len(words) not in (1, 2):
        raise UsageError("expected MAX [MIN]")
    high = parse_int(words[0], "max n-gram")
    low = parse_int(words[1], "min n-gram") if len(words) == 2 else 1
    ctx.session.update_strategy(lookup_max_ngram=high, lookup_min_ngram=low)
    ctx.console.print(f"prompt lookup n-grams from {high} down to {low}")


def alternatives(ctx: Context, arg: str) -> None:
    n = parse_int(one_word(arg), "draft alternatives")
    ctx.session.update_strategy(draft_alternatives=n)
    ctx.console.print(f"draft alternatives = {n}" + (" (a chain)" if n == 0 else
                                                     f": the draft model's next {n} best tokens at each depth are "
                                                     "verified too (greedy only)"))


def branch(ctx: Context, arg: str) -> None:
    n = parse_int(one_word(arg), "head branch")
    ctx.session.update_strategy(head_branch=n)
    ctx.console.print(f"head branch = {n}" + (": eagle and medusa draft a chain" if n == 1 else
                                              f": eagle and medusa keep each node's {n} likeliest children"))


def typical(ctx: Context, arg: str) -> None:
    on = parse_switch(arg, ctx.session.settings.strategy.typical)
    ctx.session.update_strategy(typical=on)
    ctx.console.print("typical acceptance on for eagle and medusa when sampling: NOT lossless, the answer no longer "
                      "follows the target's distribution" if on else "typical acceptance off: lossless verification")


def width(ctx: Context, arg: str) -> None:
    n = parse_int(one_word(arg), "verify width")
    ctx.session.update_strategy(verify_width=n)
    ctx.console.print(f"verify width = {n}: a draft holds at most {n - 1} tokens with the draft model's alternatives "
                      "or prompt lookup's other copies (the chain itself is capped by gamma)")


def cumulative(ctx: Context, arg: str) -> None:
    p = parse_float(one_word(arg), "the cumulative threshold")
    ctx.session.update_strategy(draft_cumulative=p)
    ctx.console.print(f"draft cumulative threshold = {p:g}" + (": the draft model always drafts gamma tokens" if p == 0
                      else ": the draft model stops once the product of its token probabilities falls below it"))


def lookahead_params(ctx: Context, arg: str) -> None:
    words = arg.split()
    if len(words) != 3:
        raise UsageError("expected W N G")
    window = parse_int(words[0], "window W")
    ngram = parse_int(words[1], "n-gram size N")
    candidates = parse_int(words[2], "candidates G")
    ctx.session.update_strategy(lookahead_window=window, lookahead_ngram=ngram, lookahead_candidates=candidates)
    ctx.console.print(f"lookahead: window W = {window}, n-gram size N = {ngram}, candidates G = {candidates} "
                      f"(up to {(window + candidates) * (ngram - 1)} tokens per forward)")


def beams(ctx: Context, arg: str) -> None:
    n = parse_int(one_word(arg), "number of beams")
    ctx.session.update_strategy(num_beams=n)
    ctx.console.print(f"beams = {n}")
