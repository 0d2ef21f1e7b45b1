"""Strategy names and the settings every strategy is built from: plain data, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("autoregressive", "speculative", "auto", "drafter", "ngram", "lookup", "lookahead", "beam")
NEEDS_DRAFTER = ("speculative", "auto", "drafter")


@dataclass(frozen=True)
class StrategySettings:
    # The most tokens a round drafts. Prompt lookup and the n-gram store draft what they have up to it (4, 8 or 12:
    # the same speed within noise, 12 prompts); the draft model stops earlier by draft_cumulative, so a higher cap
    # only lets it run on where it is sure. Embedded pair, int4 drafter, 12 prompts interleaved: 8 -> 12 took
    # speculative's median over autoregressive from 2.16x to 2.39x (7.5% fewer rounds for 2% more drafter forwards),
    # auto's from 2.28x to 2.34x (7% fewer rounds), lookup's 1.20x / 1.17x (the same rounds).
    gamma: int = 12
    # The draft model: stop drafting below this confidence (0: never); HF's grow/shrink draft-length schedule.
    draft_confidence: float = 0.0
    draft_adaptive: bool = False
    # The draft model: stop drafting once the product of its probabilities of its tokens (its estimate that the whole
    # draft is accepted) falls below this (0: always gamma tokens). One more draft costs a drafter forward, c target
    # steps, and is worth a token with that probability: it pays while P / c exceeds the tokens per target step the
    # loop commits, r. Embedded pair, bf16 CPU, int8 drafter: c ~0.29, r ~2, so 0.6 (12 prompts interleaved, twice:
    # speculative's median over autoregressive 1.54x / 1.57x with gamma 4 and no stop, 1.75x / 1.73x with 0.6; HF's
    # per-token confidence 0.4 instead 1.52x). The int4 drafter: a one-token forward 33 ms against the target's 287 ms
    # (c ~0.12) and r ~2.3, so lower; 12 prompts interleaved: speculative 2.28x / 2.13x / 2.10x median at 0.6 / 0.4 /
    # 0.25, auto 2.11x / 2.39x at 0.6 / 0.4 — within noise, so the choice is the cost model's: target forwards plus c
    # times drafter forwards, counted in the same run, give 2.62x / 2.72x / 2.77x (speculative) and 2.60x / 2.68x
    # (auto); 0.4 was the measured setting nearest c * r. With the drafter's one-token forward compiled (24 ms, c ~0.09)
    # the same count over 12 prompts (one-token drafter forwards at 0.09 target steps, multi-token ones at their
    # measured cost), tokens per target step at 0.5 / 0.4 / 0.3 / 0.2 / 0.15 / 0.1: speculative 2.91 / 3.03 / 3.10 /
    # 3.13 / 3.18 / 2.99, auto 2.87 / 3.00 / 3.05 / 3.09 / 3.11 / 2.97; timed, interleaved, auto 2.7% faster at 0.2
    # than at 0.4 (59.7 s -> 58.1 s, median per prompt 1.028x). 0.2: on the flat top, short of where it falls.
    draft_cumulative: float = 0.2
    # Greedy: the draft model's next-best tokens at each depth verified beside its chain (a token tree; 0: a chain).
    # Embedded pair, bf16, 12 prompts interleaved: 1 took speculative's median from 1.56x to 1.88x, auto's from 1.62x
    # to 1.77x. In float32 on a CPU a wider verify costs more (5 tokens: 1.85x one step): use 0 there.
    draft_alternatives: int = 4
    # The most tokens one verify forward takes (the last committed token and the draft): alternatives are dropped,
    # the least likely first, where the chain and they would exceed it. bf16 1.5B on a 2-core CPU at a 250-token
    # context, medians of 6: 1-14 tokens cost the same as 1, 15-16 1.11x, 17-20 1.31x, 25 1.27x, 33 1.45x, 49 1.65x.
    # With that curve and the drafter's forwards (c 0.11) as the cost of the same 12 prompts' rounds (64 tokens, int4
    # drafter), tokens per target step, mean: speculative 2.86 with 1 alternative and no cap, 2.99 capped at 14,
    # 3.11 / 3.14 / 3.14 with 3 / 4 / 6 alternatives at 14 (3.07 at 12); auto 2.87 -> 3.10 (1 uncapped -> 3 at 14).
    verify_width: int = 14
    # auto: prompt lookup drafts up to copy_gamma tokens where it matches at least auto_min_match tokens of context;
    # the draft model (gamma tokens) elsewhere.
    copy_gamma: int = 8
    auto_min_match: int = 2
    ngram_n: int = 3
    ngram_kind: str = "basic"
    ngram_filler_top_k: int = 0
    ngram_reset_each_prompt: bool = True
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1
    # Lookahead: window W, n-gram size N, candidates G. A forward feeds up to 1 + (N-1)W - 1 + G(N-1) tokens (6 here),
    # and on a 2-core CPU a bf16 1.5B forward costs ~351 ms for 1 token, ~324 ms for 5, ~339 ms for 8, ~416 ms for 12
    # (at a 200-token context). Greedy on two chat prompts with the embedded 0.5B, (W, N, G) = (2, 3, 1) committed
    # 1.39 tokens per forward, (3, 3, 2) 1.45, (4, 3, 3) 1.42, (3, 4, 2) 1.45: wider windows and more candidates do
    # not pay for their tokens on this CPU.
    lookahead_window: int = 2
    lookahead_ngram: int = 3
    lookahead_candidates: int = 1
    num_beams: int = 4
    beam_top_k: int | None = None
    length_penalty: float = 1.0
    min_length: int = 0
