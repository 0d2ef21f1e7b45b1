"""The README's Python example runs as written: its first ```python block, with `Engine.load` building a tiny random
pair instead of loading the preset (minutes), so that its own calls (generate, stream, reply.text, reply.stats) run
for real and the example cannot drift from the API."""

from __future__ import annotations

import contextlib
import io
import re

from app.engine import Engine
from tests.helpers import REPO, tiny_engine


def readme_example() -> str:
    found = re.search(r"^```python\n(.*?)^```$", (REPO / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    assert found, "README.md has no ```python block"
    return found.group(1)


def test_the_readme_example_is_short():
    lines = [line for line in readme_example().splitlines() if line.strip()]
    imports = [line for line in lines if line.startswith(("import ", "from "))]
    assert len(lines) < 10 and len(imports) <= 2


def test_the_readme_example_runs_on_a_tiny_pair(monkeypatch):
    loaded: list[tuple] = []

    def load(*args, **kwargs) -> Engine:
        loaded.append((args, kwargs))
        return tiny_engine()

    monkeypatch.setattr(Engine, "load", load)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(readme_example(), "README.md", "exec"), {})  # noqa: S102 (the README's own code)
    printed = out.getvalue()
    assert len(loaded) == 1
    assert re.search(r"^speculative: \d+ tokens, [\d.]+ tok/s, \d+% of drafts accepted, ", printed, re.M)
    assert len(printed.splitlines()) >= 2


