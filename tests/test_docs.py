"""The front page and the docs: every relative link resolves (to a file, and to a heading where it names one), the
README's headline table holds its runs' own numbers, and the results page links each run's notes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tests.helpers import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
RESULTS = REPO / "benchmarks" / "results"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md",
            *sorted(RESULTS.glob("*/README.md"))]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or not resolved.is_relative_to(root):
            broken.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_the_readme_the_docs_and_the_runs_notes_resolves():
    assert [broken for page in pages() for broken in broken_links(page)] == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    tmp_path = tmp_path.resolve()
    (tmp_path / "a.md").write_text("# Title here\n\n[ok](b.md#the-end) [gone](c.md) [bad](b.md#nowhere) "
                                   "[self](#title-here) [web](https://example.com)\n```\n[code](d.md)\n```\n")
    (tmp_path / "b.md").write_text("## The end\n")
    assert broken_links(tmp_path / "a.md", root=tmp_path) == ["a.md: c.md (no such file)",
                                                              "a.md: b.md#nowhere (no such heading)"]


def test_the_readme_headline_table_holds_its_runs_numbers():
    """Each row: a CPU class linking its run's folder, `auto` and our autoregressive as multiples of llama.cpp's plain
    decoding (all tokens over all time, as the run's summary computes them), and auto's identical answers."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \[[^\]]+\]\((benchmarks/results/[^)/]+)/?\) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$",
                      readme, re.M)
    assert len(rows) >= 3
    for folder, auto, autoregressive, identical in rows:
        report = json.loads((REPO / folder / "results.json").read_text(encoding="utf-8"))
        overall = report["summary"]["overall"]
        plain = overall["llamacpp"]["tokens_per_second"]
        assert report["config"]["decoding"] == "greedy", folder
        assert auto.strip(" *×") == f"{overall['auto']['tokens_per_second'] / plain:.2f}", folder
        assert autoregressive.strip(" *×") == f"{overall['autoregressive']['tokens_per_second'] / plain:.2f}", folder
        assert identical.strip() == f"{overall['auto']['identical']}/{overall['auto']['compared']}", folder


def test_the_results_page_links_each_runs_notes_and_lists_the_other_measurements(tmp_path):
    from benchmarks.report import results_page

    results = tmp_path / "benchmarks" / "results"
    (results / "chat").mkdir(parents=True)
    shutil.copy(RESULTS / "avx2-greedy" / "results.json", results / "chat" / "results.json")
    (results / "chat" / "README.md").write_text("# chat\n")
    (results / "bare").mkdir()
    shutil.copy(RESULTS / "avx2-greedy" / "results.json", results / "bare" / "results.json")
    (results / "kernels").mkdir()
    shutil.copy(RESULTS / "xeon-amx-kernels" / "kernels.json", results / "kernels" / "kernels.json")
    (results / "kernels" / "README.md").write_text("# kernels\n")
    page, runs, skipped = results_page(results)
    assert (runs, skipped) == (2, [])
    assert ("Data: [results/chat/results.json](results/chat/results.json); notes: "
            "[results/chat/README.md](results/chat/README.md)") in page
    assert "Data: [results/bare/results.json](results/bare/results.json)\n" in page  # no notes: no link
    assert ("- `kernels` (Intel(R) Xeon(R) Processor (family 6, model 167)): "
            "[results/kernels/kernels.json](results/kernels/kernels.json); notes: "
            "[results/kernels/README.md](results/kernels/README.md)") in page


def test_the_committed_results_page_is_the_generated_one():
    from benchmarks.report import results_page

    assert (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8") == results_page(RESULTS)[0], \
        "benchmarks/RESULTS.md is stale: python bench.py --results-page"
