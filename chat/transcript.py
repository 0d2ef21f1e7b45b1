"""The transcript of a chat: every turn asked (the model's history may have dropped some), as JSON or markdown; the
JSON also holds what resumes the chat (/load): the history the model sees and the settings, read back by
`read_conversation`, which checks all of it before the chat changes anything."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from chat.arguments import parse_processor
from chat.render import describe_processor
from chat.session import ChatSession, ChatSettings, Message, ModelInfo
from chat.turn import Turn
from sampling.settings import StrategySettings

FORMAT = "specchat chat"  # the JSON's "format": what /load takes
READ_LIMIT = 16 * 2**20  # bytes: a saved chat is text; a larger file is not one


@dataclass
class Conversation:
    """A chat read back from its JSON: what resumes it, and its transcript's turns (for the next /save)."""

    settings: ChatSettings
    history: list[Message]
    compare: bool
    target: str
    turns: list[dict]


class ConversationError(ValueError):
    """The file is not a chat saved as JSON, or is damaged; the message says which part."""


def transcript(session: ChatSession, info: ModelInfo, turns: list[Turn], compare: bool = True,
               earlier: list[dict] | None = None) -> dict:
    """The chat as one JSON-ready dict; `earlier`: the turns of the conversation it resumed, as their file had them."""
    settings = session.settings
    entries = list(earlier or [])
    for turn in turns:
        results = [{"strategy": run.strategy, "text": session.decode(session.answer_ids(run)),
                    "new_tokens": run.stats.new_tokens, "tokens_per_second": run.stats.tokens_per_second,
                    "interrupted": run.interrupted} for run in turn.runs]
        history_from = turn.runs[0].strategy if turn.answer is not None else None
        entries.append({"user": turn.user, "history_from": history_from, "results": results})
    return {"format": FORMAT, "target": info.target, "drafter": info.drafter, "dtype": info.dtype,
            "device": info.device, "processor": describe_processor(settings.processor), "system": settings.system,
            "settings": {"strategies": list(settings.strategies), "strategy": asdict(settings.strategy),
                         "max_new_tokens": settings.max_new_tokens, "seed": settings.seed,
                         "chat_template": settings.chat_template, "ignore_eos": settings.ignore_eos,
                         "compare": compare},
            "history": [{"role": m.role, "content": m.content} for m in session.history], "turns": entries}


def read_conversation(path: Path) -> Conversation:
    """The chat saved in `path` (/save FILE.json), every part checked; OSError or ConversationError, one line."""
    if path.is_dir():
        raise ConversationError("it is a directory; give a .json file /save wrote")
    if path.stat().st_size > READ_LIMIT:
        raise ConversationError("it is too large to be a saved chat")
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversationError(f"it is not JSON ({error})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ConversationError("it is not a chat saved with /save FILE.json")
    saved = _field(record, "settings", dict)
    strategy_fields = {f.name for f in fields(StrategySettings)}
    strategy = _field(saved, "strategy", dict)
    unknown = sorted(set(strategy) - strategy_fields)
    if unknown:
        raise ConversationError(f"its settings have an unknown strategy setting {unknown[0]!r}")
    try:
        settings = ChatSettings(
            strategies=tuple(_field(saved, "strategies", list)), strategy=StrategySettings(**strategy),
            processor=parse_processor(_field(record, "processor", str)),
            max_new_tokens=_field(saved, "max_new_tokens", int), seed=_field(saved, "seed", (int, type(None))),
            chat_template=_field(saved, "chat_template", bool), system=_field(record, "system", (str, type(None))),
            ignore_eos=_field(saved, "ignore_eos", bool))
    except (TypeError, ValueError) as error:  # the dataclasses' and the processor's own checks
        raise ConversationError(f"its settings are invalid: {error}") from None
    history = [_message(entry, i) for i, entry in enumerate(_field(record, "history", list))]
    turns = _field(record, "turns", list)
    if not all(isinstance(turn, dict) for turn in turns):
        raise ConversationError("its turns are damaged")
    return Conversation(settings, history, _field(saved, "compare", bool), str(record.get("target", "")), turns)


def _field(record: dict, name: str, kind):
    value = record.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConversationError(f"its {name!r} is missing or damaged")
    return value


def _message(entry, i: int) -> Message:
    role = ("user", "assistant")[i % 2]
    if not isinstance(entry, dict) or entry.get("role") != role or not isinstance(entry.get("content"), str):
        raise ConversationError(f"its history is damaged at message {i + 1} (expected the {role}'s text)")
    return Message(role, entry["content"])


def transcript_markdown(transcript: dict) -> str:
    lines = [f"# Chat with {transcript['target']}", "",
             f"drafter: {transcript['drafter'] or 'none'} · dtype: {transcript['dtype']} · "
             f"processor: {transcript['processor']}", ""]
    if transcript["system"]:
        lines += ["## System", "", transcript["system"], ""]
    for turn in transcript["turns"]:
        lines += ["## User", "", turn["user"], ""]
        for result in turn["results"]:
            kept = " (kept in history)" if result["strategy"] == turn["history_from"] else ""
            stats = (f"{result['new_tokens']} tokens, {result['tokens_per_second']:.1f} tok/s"
                     + (", interrupted" if result["interrupted"] else ""))
            lines += [f"### {result['strategy']}{kept}", "", result["text"], "", f"*{stats}*", ""]
    return "\n".join(lines)


def write_file(path: Path, text: str, replace: bool = False) -> None:
    """Write `text` to `path` whole or not at all (through a temporary file beside it, moved into place).

    Without `replace` an existing name, a symlink (even a dangling one) included, raises FileExistsError and is left
    as it was; with it the name itself is replaced: a symlink by the file, never the file it points to.
    """
    if not replace:  # claim the name first: O_EXCL fails on anything already there and never follows a symlink
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "x", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if not replace:
            with contextlib.suppress(OSError):
                os.unlink(path)  # the empty file that held the name
        raise
