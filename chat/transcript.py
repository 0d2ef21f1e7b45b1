"""The transcript of a chat: every turn asked (the model's history may have dropped some), as JSON or markdown."""

from __future__ import annotations

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
