"""Where a model's layers go: one device, or split by accelerate's big-model inference across GPUs, the CPU and disk.

`Placement` is what --device-map, --max-memory and --offload-dir describe; `parse_max_memory` and
`check_device_map_name` read them without torch (a bad flag is refused at once). `plan` computes the map before any
weight is read, on a model built on the meta device (accelerate's `init_empty_weights`, `infer_auto_device_map`,
`get_balanced_memory`), so a map that cannot hold the model is said in one line before loading. `describe` says where
the layers went, for the banner.

Only dense checkpoints are split: the project's own formats (gguf blocks, q8_0, int4, q4k, int8) replace layers after
loading and run on one device (docs/scale.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from utils.errors import ModelLoadError

DEVICE_MAPS = ("auto", "balanced")  # computed by accelerate; a device name puts the whole model there
DEVICE_MAP_NAMES = "auto, balanced, cpu, cuda, cuda:N, mps"
_DEVICE = re.compile(r"(cpu|mps|cuda(:\d+)?)")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?", re.IGNORECASE)
_MEMORY_KEY = re.compile(r"\d+|cpu|mps|disk|cuda:\d+")


@dataclass(frozen=True)
class Placement:
    """How one model is placed: `device_map` "auto" | "balanced" | a device name; `max_memory` accelerate's (device
    index or "cpu"/"mps"/"disk" -> bytes) for the computed maps; `offload_dir` for weights that fit nowhere else."""

    device_map: str
    max_memory: dict[int | str, int] = field(default_factory=dict)
    offload_dir: Path | None = None

    @property
    def computed(self) -> bool:
        return self.device_map in DEVICE_MAPS


def check_device_map_name(text: str, flag: str = "--device-map") -> str:
    """`text` normalised, if it names a map (whether this machine has the device is the loader's question)."""
    name = text.strip().lower()
    if name not in DEVICE_MAPS and not _DEVICE.fullmatch(name):
        raise ModelLoadError(f"{flag} {text!r} is not a device map; use one of: {DEVICE_MAP_NAMES}.")
    return name


def parse_max_memory(text: str, flag: str = "--max-memory") -> dict[int | str, int]:
    """"0=20GiB,cpu=40GiB" as accelerate's max_memory: GPU index (or cpu, mps, disk) -> bytes."""
    memory: dict[int | str, int] = {}
    for item in text.split(","):
        key, sep, size = item.partition("=")
        key = key.strip().lower()
        if not sep or not _MEMORY_KEY.fullmatch(key):
            raise ModelLoadError(f"{flag} takes DEVICE=SIZE pairs separated by commas (0=20GiB,cpu=40GiB; a device "
                                 f"is a GPU index, cpu, mps or disk), got {item.strip()!r}")
        device: int | str = int(key.removeprefix("cuda:")) if key[-1].isdigit() else key
        if device in memory:
            raise ModelLoadError(f"{flag} names {key} twice")
        memory[device] = _bytes(size, flag)
    return memory


def _bytes(text: str, flag: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ModelLoadError(f"{flag}: {text.strip()!r} is not a size (a number with B, KB, MB, GB, KiB, MiB or GiB)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}[unit]
    if number * scale < 1:
        raise ModelLoadError(f"{flag}: {text.strip()!r} leaves no room; give a size above 0")
    return int(number * scale)


def gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**27 else f"{size / 2**20:.1f} MiB"


def plan(location: str, placement: Placement, dtype: Any, trust_remote_code: bool, local_only: bool,
         name: str = "") -> dict[str, int | str] | str:
    """The device map `from_pretrained` gets for the model `name` (its folder's name if not given): accelerate's for
    "auto"/"balanced" (computed on an empty model of this config and dtype), else the device name. ModelLoadError
    (one line) where it cannot hold the model or names a device this machine lacks."""
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import compute_module_sizes, get_balanced_memory, get_max_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    name = name or Path(location).name
    check_memory_devices(placement.max_memory)
    config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code, local_files_only=local_only)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if not placement.computed:
        device = torch.device(placement.device_map)
        key = (device.index or 0) if device.type == "cuda" else device.type
        total, room = compute_module_sizes(empty, dtype=dtype)[""], get_max_memory().get(key)
        if room is not None and total > room:
            raise ModelLoadError(f"{name} does not fit {placement.device_map}: {gib(total)} of weights, "
                                 f"{gib(room)} free. Fix: --device-map auto (with --offload-dir DIR for what fits "
                                 "nowhere).")
        return placement.device_map
    no_split = list(getattr(empty, "_no_split_modules", None) or [])
    # accelerate's rule: given --max-memory, only the devices it names hold weights (and disk, with --offload-dir)
    memory = get_max_memory(dict(placement.max_memory) or None)
    if placement.device_map == "balanced" and torch.cuda.device_count() > 1:
        memory = get_balanced_memory(empty, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
    device_map = infer_auto_device_map(empty, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
    on_disk = [name for name, device in device_map.items() if device == "disk"]
    if on_disk and placement.offload_dir is None:
        total = compute_module_sizes(empty, dtype=dtype)[""]
        room = sum(size for device, size in memory.items() if device != "disk")
        raise ModelLoadError(f"the device map cannot hold {name}: {gib(total)} of weights, "
                             f"{gib(room)} of room ({_memory_text(memory)}), {len(on_disk)} module(s) left over. "
                             "Fix: give --offload-dir DIR for the rest, or more --max-memory.")
    return device_map


def check_memory_devices(max_memory: dict[int | str, int], flag: str = "--max-memory") -> None:
    """ModelLoadError (one line) where `max_memory` gives room on a GPU (or MPS) this machine does not have: accelerate
    would place layers there and fail on the first one."""
    import torch

    gpus = [device for device in max_memory if isinstance(device, int)]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [device for device in gpus if device >= count]
    if missing:
        seen = f"only {count} CUDA GPU(s) exist" if count else f"torch {torch.__version__} sees no CUDA GPU"
        raise ModelLoadError(f"{flag} gives room on GPU {missing[0]} but {seen}; name cpu=SIZE (and disk with "
                             "--offload-dir), or install a CUDA build of torch.")
    if "mps" in max_memory and not torch.backends.mps.is_available():
        raise ModelLoadError(f"{flag} gives room on mps but this machine has no usable MPS; name cpu=SIZE instead.")


def _memory_text(memory: dict) -> str:
    return ", ".join(f"{device}={gib(size)}" for device, size in memory.items() if device != "disk")


def describe(model: Any) -> str:
    """Where a placed model's layers went ("cpu: embed_tokens, layers 0-1 · disk: layers 2-3, norm, lm_head"); "" for
    a model on one device."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map or len(set(device_map.values())) < 2:
        return ""
    by_device: dict[str, list[str]] = {}
    for name, device in device_map.items():
        by_device.setdefault(_device_name(device), []).append(name)
    return " · ".join(f"{device}: {_modules(names)}" for device, names in by_device.items())


def _device_name(device: int | str) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def _modules(names: list[str]) -> str:
    """Module names with consecutive decoder layers as one range ("layers 0-13")."""
    parts: list[str] = []
    run: list[int] = []

    def close() -> None:
        if run:
            parts.append(f"layers {run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
            run.clear()

    for name in names:
        *_, last = name.split(".")
        if last.isdigit() and ".layers." in f".{name}":
            if run and int(last) != run[-1] + 1:
                close()
            run.append(int(last))
        else:
            close()
            parts.append(last or "all")
    close()
    return ", ".join(parts)

