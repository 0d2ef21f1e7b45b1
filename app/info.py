"""What the banner, /save and the one-shot JSON say about the loaded models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.yardstick import Yardstick
from utils.runner import input_device

if TYPE_CHECKING:
    from models.loading import LoadedPair


@dataclass(frozen=True)
class ModelInfo:
    """What the banner, /save and the one-shot JSON say about the loaded models."""

    target: str
    drafter: str | None
    dtype: str
    device: str
    target_format: str = ""  # "float32, oneDNN-prepacked", "int4 weights, bfloat16 activations", ...
    drafter_format: str = ""
    placement: str = ""  # where device maps put the layers ("target cpu: layers 0-1 · disk: layers 2-3"); "" if not
    target_spec: str = ""  # the specs the models were loaded from and the cache dir: /export finds their files
    drafter_spec: str | None = None
    cache_dir: Path | None = None
    yardstick: Yardstick | None = None  # llama.cpp's plain speed on this machine, where it is built

    @classmethod
    def of(cls, pair: LoadedPair, target_spec: str = "", drafter_spec: str | None = None,
           cache_dir: Path | None = None) -> ModelInfo:
        """A loaded pair's: each model's device, where device maps put the layers, and the specs it was loaded by."""
        target = pair.target.model
        devices = [str(input_device(target))]
        if pair.drafter is not None and str(input_device(pair.drafter.model)) != devices[0]:
            devices.append(f"drafter {input_device(pair.drafter.model)}")
        placed = [f"{name} {model.placement}" for name, model in (("target", pair.target), ("drafter", pair.drafter))
                  if model is not None and model.placement]
        return cls(target=pair.target.label, drafter=pair.drafter.label if pair.drafter else None,
                   dtype=str(target.dtype).removeprefix("torch."), device=", ".join(devices),
                   target_format=pair.target.format, drafter_format=pair.drafter.format if pair.drafter else "",
                   placement="; ".join(placed), target_spec=target_spec, drafter_spec=drafter_spec,
                   cache_dir=cache_dir)
