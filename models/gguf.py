"""Embedded GGUF files: locating the chunk wheels (through their metadata; the packages are never imported),
assembling the chunks into one file and verifying its sha256; and the tensors a GGUF file holds, from its header."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from models.presets import EmbeddedModel
from utils.errors import ModelLoadError

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


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file, from its header: `shape` in GGUF order (columns first), its bytes at `data_offset`."""

    name: str
    type_name: str  # GGML's name of its type: "Q4_K", "F32", ...
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def tensor_infos(path: str | Path) -> list[TensorInfo]:
    """The tensors a GGUF file holds, read from its header alone (gguf-py's reader parses every metadata value, the
    tokenizer's 150k strings included, in seconds; this skips them). Kept per file, size and time of change."""
    stat = Path(path).stat()
    return list(_tensor_infos(str(path), stat.st_size, stat.st_mtime_ns))


@functools.cache
def _tensor_infos(path: str, size: int, changed: int) -> tuple[TensorInfo, ...]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is no GGUF file")
        at = 4

        def take(fmt: str) -> Any:
            nonlocal at
            value = struct.unpack_from("<" + fmt, data, at)[0]
            at += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal at
            length = take("Q")
            at += length
            return bytes(data[at - length:at]).decode("utf-8", errors="replace")

        def skip(value_type: int) -> Any:
            nonlocal at
            if value_type == _STRING:
                return string()
            if value_type == _ARRAY:
                item_type, count = take("I"), take("Q")
                if item_type in _SCALARS:  # a run of fixed-size values: stepped over at once
                    at += count * struct.calcsize(_SCALARS[item_type])
                else:
                    for _ in range(count):
                        skip(item_type)
                return None
            return take(_SCALARS[value_type])

        take("I")  # version
        tensors, fields = take("Q"), take("Q")
        alignment = 32
        for _ in range(fields):
            key, value = string(), skip(take("I"))
            if key == "general.alignment":
                alignment = int(value)
        headers = []
        for _ in range(tensors):
            name = string()
            shape = tuple(take("Q") for _ in range(take("I")))
            headers.append((name, GGMLQuantizationType(take("I")), shape, take("Q")))
        start = -(-at // alignment) * alignment
    infos = []
    for name, kind, shape, offset in headers:
        per_block, block_bytes = GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape, dtype=np.int64))
        infos.append(TensorInfo(name, kind.name, shape, start + offset, count // per_block * block_bytes))
    return tuple(infos)


def tensor_bytes(path: str | Path, tensor: TensorInfo) -> np.ndarray:
    """A tensor's bytes, uint8 (rows, bytes per row) with rows its last GGUF dimension, mapped from the file."""
    rows = tensor.shape[-1] if len(tensor.shape) > 1 else 1
    return np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.data_offset,
                     shape=(rows, tensor.n_bytes // rows))
