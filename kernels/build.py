"""Building the kernels' shared library with g++ against the installed torch, once per source and torch version.

`python -m kernels` (run by setup.sh) builds it into the cache dir; a later start checks it against the record its
build wrote beside it (size and sha256) and only loads it. A library that does not match (a disk that filled, a copy
cut short) would kill the process that maps it (SIGBUS): it is rebuilt instead, with one line on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from utils.files import exclusive, write_record
from utils.paths import default_cache_dir

SOURCES = Path(__file__).parent / "csrc"
ABI = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
COMMON = ["-std=c++17", "-O3", "-fPIC", "-ffp-contract=off", ABI]  # no contraction: the float steps as written
# each instruction set's kernels built with its own flags; the op (ops.cpp) picks one at run time
UNITS = {"ops.cpp": ["-fopenmp"], "attention.cpp": ["-fopenmp", "-mavx2", "-mfma"],
         "blocks_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
         "blocks_avx512.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
                               "-mavx512vnni"],
         "blocks_tiles.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
                              "-mavx512vnni"],
         "blocks_amx.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
                            "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
         "rows.cpp": ["-fopenmp"], "lanes.cpp": []}
LIBRARY = "specchat_kernels.so"
RECORD = LIBRARY + ".json"  # the library's size and sha256, written once the library is in place


class BuildError(RuntimeError):
    """The kernels could not be built; the message holds the compiler's last lines."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path(cache_dir: Path | None = None) -> Path:
    """Where the library built from these sources for this torch lives (its name changes with either)."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(SOURCES.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(repr((COMMON, UNITS)).encode())
    return (cache_dir or default_cache_dir()) / "kernels" / digest.hexdigest()[:16] / LIBRARY


def build(cache_dir: Path | None = None) -> Path:
    """The library's path, compiled first where it is missing or does not match its record (the damage said in one
    line on stderr). One process builds at a time (its directory locked: another waits, then finds it built); it
    compiles into a temporary directory, moves the library in place, then writes its record."""
    target = library_path(cache_dir)
    if damage(target) is None:
        return target
    with exclusive(target.parent):
        problem = damage(target)  # again: another process may have built it while this one waited
        if problem is None:
            return target
        if target.exists():
            print(f"kernels: {problem}; rebuilding it", file=sys.stderr)
        _compile(target)
        write_record(target.parent / RECORD, {"size": target.stat().st_size, "sha256": _sha256(target)})
    return target


def damage(library: Path) -> str | None:
    """None where `library` is the file its build recorded; else what is wrong with it (one line)."""
    if not library.is_file():
        return f"{library} is missing"
    try:
        record = json.loads((library.parent / RECORD).read_text(encoding="utf-8"))
        size, sha256 = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, TypeError, KeyError):
        return f"{library} has no record of a finished build"
    if library.stat().st_size != size:
        return f"{library} is {library.stat().st_size} bytes where its build wrote {size}"
    if _sha256(library) != sha256:
        return f"{library} differs from the file its build wrote"
    return None


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _compile(target: Path) -> None:
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler (g++) found")
    includes = [f"-I{path}" for path in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    torch_lib = str(Path(torch.__file__).parent / "lib")
    with tempfile.TemporaryDirectory(dir=target.parent) as temp:
        objects = []
        for unit, flags in UNITS.items():
            obj = Path(temp) / (unit + ".o")
            _run([cxx, *COMMON, *flags, *includes, "-c", str(SOURCES / unit), "-o", str(obj)])
            objects.append(str(obj))
        built = Path(temp) / LIBRARY
        _run([cxx, "-shared", "-fopenmp", *objects, f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu",
              "-ltorch", "-o", str(built)])
        os.replace(built, target)


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise BuildError(f"{Path(command[0]).name} failed:\n{tail}")


def main() -> int:
    try:
        print(f"kernels: {build()}")
    except (BuildError, OSError) as error:  # OSError: the compiler named by CXX does not run
        print(f"kernels not built ({error}); the app runs on its other weight formats", file=sys.stderr)
    return 0
