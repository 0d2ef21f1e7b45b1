"""Training prompts for a head from the Python standard library's docstrings: summaries, reading questions and
translations, the chat's categories that MT-bench, GSM8K and HumanEval do not cover. Deterministic for one Python.

    python heads/docstring_prompts.py --count 30 > prompts.jsonl   # 30 per category, MT-bench layout
    python heads/docstring_prompts.py --packages --every-task --count 600 > more.jsonl  # every passage thrice
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese")
QUESTIONS = ("What is the main purpose of what the passage describes?",
             "Which names does the passage mention, and what does each one do?",
             "What should a programmer watch out for, according to the passage?",
             "Explain in plain words what the passage says, for someone new to Python.")


# subpackages left out of --packages: tests, and the GUI and tooling code whose docstrings are not the library's
SKIPPED = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "tkinter", "turtledemo"}


def paragraphs(root: Path, packages: bool = False) -> list[str]:
    """Prose paragraphs (no code, no tables) of the modules' docstrings and their classes' and functions'; with
    `packages`, of the subpackages' modules too."""
    found = []
    files = root.rglob("*.py") if packages else root.glob("*.py")
    for path in sorted(f for f in files if not SKIPPED & set(f.relative_to(root).parts[:-1])):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                for block in (doc or "").split("\n\n"):
                    if _prose(block):
                        found.append(" ".join(block.split()))
    return sorted(set(found))


def _prose(block: str) -> bool:
    """Unindented sentences of words: no code, listing or table."""
    text = " ".join(block.split())
    words = sum(len(w) for w in re.findall(r"[A-Za-z]+", text))
    return (200 <= len(text) <= 1200 and not re.search(r"^\s", block, re.M) and text[0].isupper()
            and text.endswith(".") and text.count(". ") >= 1 and words >= 0.75 * len(text)
            and len(re.findall(r"[()_=\[\]{}<>*`']", text)) <= 4)


def sentences(text: str, most: int) -> str:
    return " ".join(re.split(r"(?<=[.!?])\s+", text)[:most])


def prompts(count: int, seed: int = 0, packages: bool = False, every_task: bool = False) -> list[dict]:
    """`count` prompts a category, each on its own passage; `every_task`: every passage in each category (three
    prompts a passage, as many passages in all as a category takes)."""
    rng = random.Random(seed)
    pool = paragraphs(Path(sysconfig.get_paths()["stdlib"]), packages)
    rng.shuffle(pool)
    rows = []
    tasks = (_summary, _question, _translation)
    for n, make in enumerate(tasks):
        passages = pool[:count] if every_task else pool[n * count:(n + 1) * count]
        rows += [make(text, rng) for text in passages]
    for n, row in enumerate(rows):
        row["question_id"] = f"doc-{n}"
    return rows


def _summary(text: str, rng: random.Random) -> dict:
    return {"category": "summarization",
            "turns": [f"Summarize the following passage in {rng.choice((2, 3))} sentences.\n\n{text}"]}


def _question(text: str, rng: random.Random) -> dict:
    return {"category": "qa", "turns": [f"Read the passage and answer the question.\n\nPassage: {text}\n\n"
                                        f"Question: {rng.choice(QUESTIONS)}"]}


def _translation(text: str, rng: random.Random) -> dict:
    return {"category": "translation", "turns": [f"Translate into {rng.choice(LANGUAGES)}:\n\n{sentences(text, 3)}"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=30, help="prompts per category")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--packages", action="store_true", help="the subpackages' docstrings too (not only the modules')")
    p.add_argument("--every-task", action="store_true", help="every passage in all three categories")
    args = p.parse_args()
    for row in prompts(args.count, args.seed, args.packages, args.every_task):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
