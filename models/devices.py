"""Device and dtype resolution: "auto" picks the best device there is and the dtype that runs natively on it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from utils.errors import ModelLoadError

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags, and the aarch64 feature name


def resolve_device(device: str) -> torch.device:
    """auto -> cuda, else mps, else cpu. An explicit device that is not there is an error."""
    name = device.strip().lower()
    if name == "auto":
        return _best_device()
    try:
        resolved = torch.device(name)
    except RuntimeError:
        raise ModelLoadError(f"Unknown device {device!r}; use one of: auto, cpu, cuda, cuda:N, mps.") from None
    if resolved.type not in ("cpu", "cuda", "mps"):
        raise ModelLoadError(f"Unsupported device {device!r}; use one of: auto, cpu, cuda, cuda:N, mps.")
    _check_device_available(resolved)
    return resolved


def _best_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _check_device_available(device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"Device {str(device)!r} was requested but torch {torch.__version__} sees no CUDA GPU; "
                "use --device cpu (or auto), or install a CUDA build of torch."
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"Device {str(device)!r} was requested but only {torch.cuda.device_count()} CUDA GPU(s) exist; "
                "pick a smaller index."
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("Device 'mps' was requested but this machine has no usable MPS; use --device cpu.")


_DTYPES_BY_NAME = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto -> bf16 on a CPU with native bf16 (else fp32), bf16 or fp16 on CUDA, fp16 on MPS."""
    name = dtype.strip().lower()
    if name == "auto":
        return _auto_dtype(device)
    if name not in _DTYPES_BY_NAME:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; use one of: auto, {', '.join(_DTYPES_BY_NAME)}.")
    return _DTYPES_BY_NAME[name]


def _auto_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


NATIVE_BF16_ENV = "SPECCHAT_NATIVE_BF16"  # 0 or 1: overrides the CPU probe (an AVX-512 machine run on AVX2 kernels)


def cpu_supports_bf16() -> bool:
    """Native bf16 arithmetic on this CPU; without it bf16 is emulated and slower than fp32.

    SPECCHAT_NATIVE_BF16=0 takes the path of a CPU without it, as `ATEN_CPU_CAPABILITY=avx2` and
    `ONEDNN_MAX_CPU_ISA=AVX2` make torch's and oneDNN's kernels do on an AVX-512 machine; 1 takes the other."""
    override = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if override in ("0", "1"):
        return override == "1"
    if override:
        raise ModelLoadError(f"{NATIVE_BF16_ENV} must be 0 or 1, got {override!r}")
    return cpuinfo_has_bf16(_cpuinfo())


def cpuinfo_has_bf16(cpuinfo: str) -> bool:
    return bool(set(_CPU_BF16_FLAGS) & set(_cpuinfo_field(cpuinfo, ("flags", "Features")).split()))


def cpu_flags() -> set[str]:
    """This CPU's feature flags (x86 flags, aarch64 features); none where /proc/cpuinfo cannot be read (not Linux:
    no cheap reliable probe, so no native bf16 is assumed)."""
    return set(_cpuinfo_field(_cpuinfo(), ("flags", "Features")).split())


def cpu_model() -> str:
    return _cpuinfo_field(_cpuinfo(), ("model name", "Model", "Hardware")) or platform.processor() or "unknown"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_field(cpuinfo: str, names: tuple[str, ...]) -> str:
    """The first value of any of these /proc/cpuinfo fields ("" if none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return ""
