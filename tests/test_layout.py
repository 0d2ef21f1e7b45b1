"""The house's floors: a package imports only from its own floor or the floors below (docs/design.md's picture),
and `utils/` holds the shared helpers only."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

# entry scripts on top
FLOORS = {"utils": 0, "kernels": 0, "models": 1, "sampling": 2, "app": 3, "chat": 4, "benchmarks": 4, "training": 4}
SHARED = {"__init__", "caching", "runner", "compiling", "timing", "logits_processor", "checks", "errors", "files",
          "paths", "prompts"}


def imports(path: Path) -> set[str]:
    """The top-level project packages `path` imports, at any depth of the file (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found |= {name.split(".")[0] for name in names}
    return found & set(FLOORS)


def test_no_package_imports_from_a_floor_above_its_own():
    upward = [f"{path.relative_to(REPO)} imports {package}"
              for floor_name, floor in FLOORS.items() for path in sorted((REPO / floor_name).rglob("*.py"))
              for package in imports(path) if FLOORS[package] > floor]
    assert upward == []


def test_packages_on_one_floor_do_not_import_each_other():
    # chat, benchmarks and training share a floor: none may lean on another
    crossing = [f"{path.relative_to(REPO)} imports {package}" for name in ("chat", "benchmarks", "training")
                for path in sorted((REPO / name).rglob("*.py")) for package in imports(path)
                if package != name and FLOORS[package] == FLOORS[name]]
    assert crossing == []


def test_utils_holds_the_shared_helpers_only():
    assert {path.stem for path in (REPO / "utils").glob("*.py")} <= SHARED


def test_no_module_is_longer_than_450_lines():
    long = {str(path.relative_to(REPO)) for path in sorted(REPO.glob("**/*.py"))
            if ".venv" not in path.parts and "tests" not in path.parts
            and len(path.read_text(encoding="utf-8").splitlines()) > 450}
    assert long == set()


def test_the_readme_is_a_front_page_and_each_doc_a_page():
    """Past 120 lines the README has grown results prose again, past 300 a page of docs/ its dated logs: a run's
    measurements belong in its folder (benchmarks/results/<run>/README.md), beside its data."""
    lines = {str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
             for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    too_long = {name: count for name, count in lines.items() if count > (120 if name == "README.md" else 300)}
    assert too_long == {}


def module_imports(path: Path) -> set[str]:
    """The project modules `path` imports (dotted, as files of this repository), lazy imports too."""
    def ours(name: str) -> bool:
        where = REPO / name.replace(".", "/")
        return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            submodules = {f"{node.module}.{a.name}" for a in node.names if ours(f"{node.module}.{a.name}")}
            # `from package import module` reads the module, not the package's own names
            found |= submodules | ({node.module} if len(submodules) < len(node.names) else set())
    return {name for name in found if ours(name)}


def test_no_modules_import_each_other_in_a_circle():
    # why: a circle hides behind lazy imports, and neither module can then be read, tested or moved without the other
    modules = {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
               for path in sorted(REPO.glob("**/*.py")) if not {".venv", "tests"} & set(path.parts)}
    edges = {name: module_imports(path) - {name} for name, path in modules.items()}
    circles = []
    for start in modules:  # a circle through `start`: a path from one of its imports back to it
        seen, todo = set(), list(edges[start])
        while todo:
            name = todo.pop()
            if name == start:
                circles.append(start)
                break
            if name not in seen:
                seen.add(name)
                todo.extend(edges.get(name, ()))
    left = {"chat.commands", "chat.setting_commands", "chat.message_commands"}  # Context beside its handlers: to split
    assert set(circles) <= left
