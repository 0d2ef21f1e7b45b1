"""Embedded GGUF files: locating the chunk wheels (through their metadata; the packages are never imported),
assembling the chunks into one file and verifying its sha256."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from models.presets import EmbeddedModel, ModelLoadError

EMBEDDED_REQUIREMENTS = "requirements-embedded.txt"
_BLOCK_BYTES = 8 << 20


def pip_install_command(requirements: str = EMBEDDED_REQUIREMENTS, reinstall: bool = False) -> str:
    force = " --force-reinstall" if reinstall else ""
    return f"pip install{force} --no-deps --require-hashes -r {requirements}"


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source, _byte_bar(path.stat().st_size, f"checking {path.name}", progress) as bar:
        while block := source.read(_BLOCK_BYTES):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _byte_bar(total: int, description: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def assemble(parts: Sequence[Path], dest: Path, expected_sha: str, progress: bool = False) -> Path:
    """Concatenate `parts` into `dest`, checking the sha256. On a mismatch nothing is left behind."""
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    total = sum(part.stat().st_size for part in parts)
    with partial.open("wb") as out, _byte_bar(total, f"assembling {dest.parent.name}", progress) as bar:
        for part in parts:
            with part.open("rb") as source:
                while block := source.read(_BLOCK_BYTES):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != expected_sha:
        partial.unlink()
        raise ModelLoadError(
            f"The GGUF assembled from {len(parts)} chunk file(s) has sha256 {digest.hexdigest()[:16]}..., expected "
            f"{expected_sha[:16]}...: the installed chunk wheels are damaged or the wrong version. Fix: "
            f"{pip_install_command(reinstall=True)}"
        )
    os.replace(partial, dest)
    return dest


def ensure_assembled(parts: Sequence[Path], dest: Path, expected_sha: str, progress: bool = False) -> Path:
    """Reuse `dest` if its sha256 is right, else rebuild it once from the chunks."""
    if dest.is_file() and sha256_file(dest, progress) == expected_sha:
        return dest
    dest.unlink(missing_ok=True)
    return assemble(parts, dest, expected_sha, progress)


def verify_file(path: Path, expected_sha: str, fix: str, progress: bool = False) -> None:
    actual = sha256_file(path, progress)
    if actual != expected_sha:
        raise ModelLoadError(
            f"{path} has sha256 {actual[:16]}..., expected {expected_sha[:16]}...: the file is damaged. Fix: {fix}"
        )


def locate_parts(entry: EmbeddedModel) -> list[Path]:
    missing = [name for name in entry.distributions if not _is_installed(name)]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(
            f"The embedded model {entry.name!r} needs the wheel(s) {shown}, which are not installed. "
            f"Fix: run `{pip_install_command()}` in the repository root, or use another --model/--preset."
        )
    return [_data_file(name) for name in entry.distributions]


def _is_installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _data_file(distribution: str) -> Path:
    dist = importlib.metadata.distribution(distribution)
    data = [file for file in dist.files or () if file.suffix in (".bin", ".gguf")]
    paths = [Path(str(dist.locate_file(file))) for file in data]
    if len(paths) != 1 or not paths[0].is_file():
        raise ModelLoadError(
            f"The wheel {distribution} should hold exactly one data file (.bin or .gguf) but has "
            f"{len(paths)} present; it is damaged. Fix: {pip_install_command(reinstall=True)}"
        )
    return paths[0]
