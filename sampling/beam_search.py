"""Beam search with a KV cache: beams are batch rows, the cache is reordered with them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from sampling.base import Clock, DecodeConfig, Round, Strategy, check_prompt
from sampling.settings import check
from utils.caching import select_rows
from utils.runner import CachedModel


def length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al., 2016): ((5 + |Y|) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


@dataclass
class Hypothesis:
    tokens: list[int]
    log_prob: float
    score: float  # log_prob / length_penalty


class BeamSearch(Strategy):
    """Keeps the `num_beams` best partial sequences; each expands its `top_k` best tokens per step.

    Scores are sums of log-probabilities starting at 0; a sequence ends on an end token (never on padding), not
    before `min_length` new tokens, and is ranked by score / GNMT length penalty. Sampling processors do not apply:
    beam search ranks by the model's own log-probabilities.
    """

    def __init__(self, model, num_beams: int = 4, top_k: int | None = None, alpha: float = 1.0,
                 min_length: int = 0, name: str = "beam"):
        num_beams = check("num_beams", num_beams)
        top_k = 2 * num_beams if top_k is None else check("beam_top_k", top_k)
        self.model, self.num_beams, self.top_k = model, num_beams, top_k
        self.alpha, self.min_length, self.name = check("length_penalty", alpha), check("min_length", min_length), name
        self.device = next(model.parameters()).device

    @property
    def models(self) -> list[CachedModel]:
        return []  # it feeds the bare model, with a cache of its own per call

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device).expand(input_ids.shape[0], -1)
        out = self.model(input_ids=input_ids, past_key_values=cache, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        return torch.log_softmax(out.logits[:, -1].double(), dim=-1)  # (B, V)

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], config: DecodeConfig) -> Iterator[Round]:
        check_prompt(prompt_ids, getattr(self.model.config, "max_position_embeddings", 1 << 31))
        clock, cache = Clock(), DynamicCache(config=self.model.config)
        if config.max_new_tokens == 0:
            return
        ends = torch.tensor(config.end_ids, dtype=torch.long, device=self.device)
        log_probs = self._forward(torch.tensor([prompt_ids], device=self.device), cache, 0)
        beams = torch.zeros(1, 0, dtype=torch.long, device=self.device)  # (B, t) new tokens per beam
        scores = torch.zeros(1, dtype=torch.float64, device=self.device)  # (B,)
        finished: list[Hypothesis] = []
        steps = 1
        for t in range(1, config.max_new_tokens + 1):
            if t <= self.min_length and len(ends):
                log_probs[:, ends] = float("-inf")
            # Expand: the top_k tokens of each beam, ranked over all beams.
            top = (scores[:, None] + log_probs).topk(min(self.top_k, log_probs.shape[-1]), dim=-1)
            cand_scores, order = top.values.flatten().sort(descending=True)
            cand_rows = order // top.indices.shape[1]
            cand_tokens = top.indices.flatten()[order]
            is_end = torch.isin(cand_tokens, ends) & torch.isfinite(cand_scores)
            # Candidates that end a sequence and rank among the first num_beams become finished hypotheses.
            for i in is_end[: self.num_beams].nonzero().flatten().tolist():
                sequence = beams[cand_rows[i]].tolist() + [int(cand_tokens[i])]
                finished.append(Hypothesis(sequence, float(cand_scores[i]), float(cand_scores[i]) / self._lp(t)))
            alive = (~is_end & torch.isfinite(cand_scores)).nonzero().flatten()[: self.num_beams]
            if len(alive) == 0 or self._done(finished, float(cand_scores[alive[0]]), t):
                break
            rows, tokens, scores = cand_rows[alive], cand_tokens[alive], cand_scores[alive]
            beams = torch.cat([beams[rows], tokens[:, None]], dim=1)
            if t == config.max_new_tokens:
                break
            select_rows(cache, rows)
            log_probs = self._forward(tokens[:, None], cache, len(prompt_ids) + t - 1)
            steps += 1
        if beams.shape[1] == config.max_new_tokens:  # beams that reached the limit compete unfinished
            for row in range(beams.shape[0]):
                finished.append(Hypothesis(beams[row].tolist(), float(scores[row]), float(scores[row]) / self._lp(t)))
        if not finished:
            return
        best = max(finished, key=lambda h: h.score)
        ended = bool(best.tokens) and best.tokens[-1] in config.end_ids
        yield Round(best.tokens, target_forwards=steps, elapsed=clock(), finished=ended)

    def _lp(self, length: int) -> float:
        return length_penalty(length, self.alpha)

    def _done(self, finished: list[Hypothesis], best_alive: float, t: int) -> bool:
        """Stop once num_beams sequences are finished and the best alive beam cannot beat the worst kept one
        (log-probabilities only fall; with alpha > 0 this is HF's heuristic, exact for alpha == 0)."""
        if len(finished) < self.num_beams:
            return False
        worst_kept = sorted((h.score for h in finished), reverse=True)[self.num_beams - 1]
        return best_alive / self._lp(t) <= worst_kept
