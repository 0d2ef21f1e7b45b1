"""The transcript of a chat: every turn asked (the model's history may have dropped some), as JSON or markdown."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from chat.render import describe_processor
from chat.session import ChatSession, ModelInfo
from chat.turn import Turn


def transcript(session: ChatSession, info: ModelInfo, turns: list[Turn]) -> dict:
    settings = session.settings
    entries = []
    for turn in turns:
        results = [{"strategy": run.strategy, "text": session.decode(session.answer_ids(run)),
                    "new_tokens": run.stats.new_tokens, "tokens_per_second": run.stats.tokens_per_second,
                    "interrupted": run.interrupted} for run in turn.runs]
        history_from = turn.runs[0].strategy if turn.answer is not None else None
        entries.append({"user": turn.user, "history_from": history_from, "results": results})
    return {"target": info.target, "drafter": info.drafter, "dtype": info.dtype, "device": info.device,
            "processor": describe_processor(settings.processor), "system": settings.system, "turns": entries}


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
