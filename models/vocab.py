"""Whether the target and the drafter share one vocabulary, and the token ids that end a reply."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import GenerationConfig, PreTrainedTokenizerBase

# Tokens that close a chat turn in common templates. "<|endoftext|>" is left out on purpose: it ends
# a turn only where it is the eos token, and then the eos ids already hold it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def vocab_notice(target_tok: PreTrainedTokenizerBase, drafter_tok: PreTrainedTokenizerBase) -> str | None:
    """None where the token -> id mappings are equal (embedding rows padded past the vocabulary do not matter);
    else the one line that says the drafter drafts text for the target."""
    target_vocab, drafter_vocab = target_tok.get_vocab(), drafter_tok.get_vocab()
    if target_vocab == drafter_vocab:
        return None
    differing = len(set(target_vocab.items()) ^ set(drafter_vocab.items()))
    return (f"the drafter's tokenizer differs from the target's (target {target_tok.name_or_path!r}: "
            f"{len(target_vocab)} tokens, drafter {drafter_tok.name_or_path!r}: {len(drafter_vocab)} tokens, "
            f"{differing} token->id entries not shared): its drafts go to the target as text, re-tokenized")


def end_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None) -> tuple[int, ...]:
    """Sorted ids that end generation: every eos id plus the chat template's end-of-turn token."""
    eos_ids = set(_as_ids(getattr(generation_config, "eos_token_id", None)))
    eos_ids |= set(_as_ids(tokenizer.eos_token_id))
    turn_ids = {token_id for token_id in _end_of_turn_ids(tokenizer) if token_id != tokenizer.pad_token_id}
    return tuple(sorted(eos_ids | turn_ids))


def _as_ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(item) for item in value]


def _end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(template.values())
    ids: list[int] = []
    for token in END_OF_TURN_TOKENS:
        if token not in template:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        # why: an unknown token maps to the unk id (or None), which must not be taken for it
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
            ids.append(token_id)
    return ids
