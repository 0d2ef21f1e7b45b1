"""What the HTTP server costs: tokens per second through the OpenAI API (streamed and whole) against the same engine
called directly, on the same prompts, interleaved, in one process.

    python -m benchmarks.serve [--preset embedded | --target SPEC --drafter SPEC] [--strategy speculative]
                               [--prompts 1] [--max-new-tokens 128] [--repeats 3] [--json FILE]

The server runs on a thread of this process, on a free loopback port (`serve.Background`), as `infer.py --serve` runs
it: its event loop beside the generation thread. Each prompt (the first turn of each category's first prompts in
benchmarks/prompts.jsonl, `--prompts` of each) is generated greedily to exactly --max-new-tokens (end tokens
ignored) once per contestant per repeat, the contestants' order rotating from one prompt to the next; every cache is
emptied before each generation, so each prefills the whole prompt. Wall time is from the call (the request) to the
last token (the last byte); the texts are checked equal. Prints one line per contestant: tokens / seconds summed,
the ratio to the engine, and the median extra wall time per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from app.flags import FlagError, add_model_flags, check_model_names, model_choice
from benchmarks.names import DEFAULT_PROMPTS
from utils.prompts import load_prompts

CONTESTANTS = ("engine", "api", "api-stream")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--strategy", default="auto", help="the strategy every contestant runs")
    parser.add_argument("--prompts", type=int, default=1, help="prompts of each category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the timings here")
    args = parser.parse_args(argv)
    try:
        check_model_names(args)
    except FlagError as error:
        print(f"benchmarks.serve: {error}", file=sys.stderr)
        return 2

    from app.engine import Engine
    from app.startup import load_options
    from models.presets import resolve_preset
    from serve import Background, ServeConfig, create_app

    engine = Engine.load(**load_options(args, model_choice(args, resolve_preset)), progress=True)
    prompts = [[{"role": "user", "content": p.turns[0]}] for p in load_prompts(DEFAULT_PROMPTS, limit=args.prompts)]
    settings = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": 0.0}
    seconds: dict[str, list[float]] = {name: [] for name in CONTESTANTS}
    tokens: dict[str, int] = dict.fromkeys(CONTESTANTS, 0)
    mismatches = 0
    with Background(create_app(engine, ServeConfig(queue_size=1))) as server:
        runs = {"engine": lambda m: direct(engine, m, args.strategy, settings),
                "api": lambda m: through_api(server.url, m, args.strategy, settings, stream=False),
                "api-stream": lambda m: through_api(server.url, m, args.strategy, settings, stream=True)}
        for run in runs.values():  # untimed: first-call costs (allocations, the client's connection) paid once
            run(prompts[0])
        turn = 0
        for _ in range(args.repeats):
            for messages in prompts:
                order = CONTESTANTS[turn % 3:] + CONTESTANTS[: turn % 3]
                turn += 1
                texts = {}
                for name in order:
                    for lm in engine.models:  # the server is idle between requests: each run prefills it all
                        lm.reset()
                    texts[name], new_tokens, elapsed = runs[name](messages)
                    seconds[name].append(elapsed)
                    tokens[name] += new_tokens
                mismatches += len(set(texts.values())) > 1
    for line in summary(seconds, tokens, mismatches):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"strategy": args.strategy, "max_new_tokens": args.max_new_tokens,
                                         "target": engine.info.target, "drafter": engine.info.drafter,
                                         "seconds": seconds, "tokens": tokens, "mismatches": mismatches}, indent=1))
    return 0


def direct(engine, messages: list[dict[str, str]], strategy: str, settings: dict) -> tuple[str, int, float]:
    start = time.perf_counter()
    reply = engine.generate(messages, strategy, **settings)
    return reply.text, reply.stats.new_tokens, time.perf_counter() - start


def through_api(url: str, messages: list[dict[str, str]], strategy: str, settings: dict,
                stream: bool) -> tuple[str, int, float]:
    """One request with the standard library's client (no client library's own costs in the number)."""
    body = {"messages": messages, "max_tokens": settings["max_new_tokens"], "temperature": settings["temperature"],
            "stream": stream, "stream_options": {"include_usage": True} if stream else None,
            "specchat": {"strategy": strategy, "ignore_eos": settings["ignore_eos"]}}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as response:
        raw = response.read()
    elapsed = time.perf_counter() - start
    if not stream:
        answer = json.loads(raw)
        return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"], elapsed
    text, new_tokens = "", 0
    for event in raw.decode().split("\n\n"):
        if not event.startswith("data: {"):
            continue
        chunk = json.loads(event.removeprefix("data: "))
        text += "".join(choice["delta"].get("content") or "" for choice in chunk["choices"])
        new_tokens = (chunk.get("usage") or {}).get("completion_tokens", new_tokens)
    return text, new_tokens, elapsed


def summary(seconds: dict[str, list[float]], tokens: dict[str, int], mismatches: int) -> list[str]:
    base = tokens["engine"] / sum(seconds["engine"])
    lines = []
    for name in CONTESTANTS:
        rate = tokens[name] / sum(seconds[name])
        extra_ms = statistics.median(s - e for s, e in zip(seconds[name], seconds["engine"], strict=True)) * 1e3
        lines.append(f"{name:<11} {rate:8.2f} tok/s  {rate / base:6.3f}x the engine  "
                     f"{extra_ms:+8.1f} ms a request (median)")
    if mismatches:
        lines.append(f"warning: {mismatches} prompt(s) answered differently by the contestants")
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
