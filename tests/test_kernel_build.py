"""kernels/build.py: the library is built once, recorded, checked against its record at every start, and rebuilt (one
line) where it does not match; two processes building at once compile once. A stand-in compiler (CXX) writes the
files, so these run where g++ is missing too; one test loads a real library the stand-in copies."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kernels.build import RECORD, build, damage, library_path

REPO = Path(__file__).resolve().parent.parent


def stand_in_compiler(tmp_path: Path, library: bytes | Path = b"a whole library", link_seconds: float = 0.0) -> Path:
    """A CXX that writes an empty object for each unit and, when linking, `library` (bytes, or a file's copy) after
    `link_seconds`; each link adds a line to links.log beside it."""
    script = tmp_path / "cxx"
    source = library if isinstance(library, Path) else tmp_path / "library.bin"
    if not isinstance(library, Path):
        source.write_bytes(library)
    script.write_text(f"""#!/bin/sh
out=; shared=; prev=
for arg in "$@"; do
    [ "$prev" = -o ] && out=$arg
    [ "$arg" = -shared ] && shared=1
    prev=$arg
done
if [ -n "$shared" ]; then
    echo link >> '{tmp_path / "links.log"}'
    sleep {link_seconds}
    cp '{source}' "$out"
else
    : > "$out"
fi
""")
    script.chmod(0o755)
    return script


def links(tmp_path: Path) -> int:
    log = tmp_path / "links.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def truncate(library: Path) -> None:
    library.write_bytes(library.read_bytes()[:5])


def same_size_other_bytes(library: Path) -> None:
    library.write_bytes(bytes(len(library.read_bytes())))


def no_record(library: Path) -> None:
    (library.parent / RECORD).unlink()


@pytest.mark.parametrize("damage_it, said", [(truncate, "is 5 bytes where its build wrote 15"),
                                             (same_size_other_bytes, "differs from the file its build wrote"),
                                             (no_record, "has no record of a finished build")])
def test_a_damaged_library_is_rebuilt_with_one_line(tmp_path, monkeypatch, capsys, damage_it, said):
    """Bug: a library cut short (a full disk, an interrupted copy) was loaded as it was: the process died of SIGBUS
    and printed nothing."""
    monkeypatch.setenv("CXX", str(stand_in_compiler(tmp_path)))
    library = build(tmp_path / "cache")
    assert library == library_path(tmp_path / "cache") and damage(library) is None and links(tmp_path) == 1
    assert build(tmp_path / "cache") == library and links(tmp_path) == 1  # checked, not rebuilt
    assert capsys.readouterr().err == ""
    damage_it(library)
    assert damage(library) is not None
    assert build(tmp_path / "cache") == library and links(tmp_path) == 2
    assert library.read_bytes() == b"a whole library" and damage(library) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kernels: ") and said in err and "rebuilding it" in err


def test_two_processes_building_at_once_compile_once(tmp_path, monkeypatch):
    """The second builder waits for the first and finds the library built (each build holds a lock beside it)."""
    monkeypatch.setenv("CXX", str(stand_in_compiler(tmp_path, link_seconds=0.5)))
    start, built, failed = threading.Barrier(2), [], []

    def builder() -> None:
        start.wait()
        try:
            built.append(build(tmp_path / "cache"))
        except Exception as error:  # noqa: BLE001 (the assertion below names it)
            failed.append(error)

    threads = [threading.Thread(target=builder) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failed == [] and len(built) == 2 and built[0] == built[1]
    assert links(tmp_path) == 1 and damage(built[0]) is None


def test_a_truncated_library_costs_a_rebuild_and_one_line_not_the_app(tmp_path):
    """Bug: `head -c 1000` of the library over it, then any start that loads the kernels died of SIGBUS, silently.
    Here the stand-in compiler relinks by copying a real library; the damaged one is never mapped."""
    import kernels

    if kernels.unavailable() is not None:
        pytest.skip(f"kernels: {kernels.unavailable()}")
    real = build()  # the suite's, checked against its record
    cache = tmp_path / "cache"
    library = library_path(cache)
    library.parent.mkdir(parents=True)
    library.write_bytes(real.read_bytes()[:1000])
    (library.parent / RECORD).write_text((real.parent / RECORD).read_text())
    env = {**os.environ, "CXX": str(stand_in_compiler(tmp_path, real))}
    code = f"import kernels; from pathlib import Path; print(kernels.unavailable(Path({str(cache)!r})))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stdout) == (0, "None\n"), done.stderr
    assert done.stderr.count("\n") == 1 and "is 1000 bytes where its build wrote" in done.stderr
    assert links(tmp_path) == 1 and library.read_bytes() == real.read_bytes()
