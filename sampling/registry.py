"""Strategies by name, built from one settings object (the chat, the one-shot mode and the benchmark share this)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.retokenize import Retokenizer
from sampling.autoregressive import Autoregressive
from sampling.base import Strategy
from sampling.beam_search import BeamSearch
from sampling.drafters.combined import CombinedDrafter
from sampling.drafters.cross import CrossVocabDrafter
from sampling.drafters.lookahead import LookaheadDrafter
from sampling.drafters.model import ModelDrafter
from sampling.drafters.ngram import NGramDrafter
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.drafters.session import SessionText
from sampling.heads.eagle import EagleDrafter
from sampling.heads.medusa import MedusaDrafter
from sampling.heads.networks import DraftHead
from sampling.settings import NEEDS_DRAFTER, NEEDS_HEAD, STRATEGIES, StrategySettings
from sampling.speculative import Speculative
from utils.runner import CachedModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sampling.drafters.base import Drafter


def build_strategy(name: str, target: CachedModel, drafter: CachedModel | None,
                   settings: StrategySettings = StrategySettings(),
                   heads: dict[str, DraftHead] | None = None,
                   tokenizers: tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase] | None = None,
                   session: SessionText | None = None) -> Strategy:
    """`target` and `drafter` are the long-lived cached models (their caches carry over between prompts); `heads`
    the loaded draft heads by kind; `tokenizers` the target's and the drafter's where their vocabularies differ
    (the drafter then drafts text, `CrossVocabDrafter`); `session` the session's earlier prompts and answers, which
    auto (and a head with head_lookup) drafts from where the context holds no copy."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if name in NEEDS_DRAFTER and drafter is None:
        raise ValueError(f"strategy {name!r} needs a drafter model")
    s = settings
    if name in NEEDS_HEAD:
        head = (heads or {}).get(name)
        if head is None:
            raise ValueError(f"strategy {name!r} needs a trained {name} head (--head DIR; train one with "
                             f"train_head.py --kind {name})")
        tree = s.verify_width - 1
        made: Drafter = (EagleDrafter(target, head, s.head_branch, tree, s.head_cumulative) if name == "eagle"
                         else MedusaDrafter(target, head, s.head_branch, tree))
        typical = (s.typical_threshold, s.typical_alpha) if s.typical else None
        made, gamma = with_copies(made, s, session) if s.head_lookup else (made, s.gamma)
        return Speculative(target, made, gamma, name=name, typical=typical)
    if name == "autoregressive":
        return Autoregressive(target)
    if name == "drafter":
        assert drafter is not None  # NEEDS_DRAFTER: checked above
        if tokenizers is not None:
            raise ValueError("strategy 'drafter' runs the drafter on the target's tokens: it needs a drafter with "
                             "the target's tokenizer")
        return Autoregressive(drafter, name="drafter")
    if name == "beam":
        return BeamSearch(target.model, s.num_beams, s.beam_top_k, s.length_penalty, s.min_length)

    def model_drafter() -> Drafter:
        assert drafter is not None  # NEEDS_DRAFTER: checked above
        vocab_size = target.vocab_size if tokenizers is None else drafter.vocab_size
        made = ModelDrafter(drafter, vocab_size, s.draft_confidence, s.draft_adaptive, s.draft_alternatives,
                            s.draft_cumulative, s.verify_width - 1)
        return made if tokenizers is None else CrossVocabDrafter(made, Retokenizer(*tokenizers))

    if name == "auto":
        return Speculative(target, *with_copies(model_drafter(), s, session), name=name)
    drafters = {
        "speculative": model_drafter,
        "ngram": lambda: NGramDrafter(s.ngram_n, s.ngram_kind, s.ngram_filler_top_k, s.ngram_reset_each_prompt),
        "lookup": lambda: PromptLookupDrafter(s.lookup_max_ngram, s.lookup_min_ngram, s.verify_width - 1),
        "lookahead": lambda: LookaheadDrafter(s.lookahead_window, s.lookahead_ngram, s.lookahead_candidates,
                                              s.ngram_reset_each_prompt),
    }
    gamma = s.lookahead_ngram - 1 if name == "lookahead" else s.gamma  # lookahead's candidates are N-1 long
    return Speculative(target, drafters[name](), gamma, name=name)


def with_copies(drafter: Drafter, s: StrategySettings,
                session: SessionText | None = None) -> tuple[CombinedDrafter, int]:
    """Prompt lookup first, where at least auto_min_match tokens of context match, then the `session`'s earlier text
    where session_min_match tokens match, `drafter` (gamma tokens) elsewhere; and the loop's draft length, the longer
    of the copy's and the drafter's."""
    lookup = PromptLookupDrafter(s.lookup_max_ngram, s.auto_min_match, s.verify_width - 1)
    return CombinedDrafter(lookup, drafter, s.gamma, session=session,
                           session_match=s.session_min_match), max(s.copy_gamma, s.gamma)
