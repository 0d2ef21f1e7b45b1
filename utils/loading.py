"""Load models from one spec: an embedded name, a saved directory, a .gguf file or a Hub id.

Embedded models ship as GGUF bytes inside PyPI wheels (data only, never imported). The first load
assembles the chunks, checks the sha256, dequantizes with transformers and saves a bfloat16
safetensors copy under the cache dir; later loads read that copy. A cache directory counts only
when its `complete.json` marker names the expected GGUF sha256.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from utils.int4 import to_int4
from utils.presets import (  # noqa: F401 (re-exported: the loading API names them)
    EMBEDDED,
    PRESETS,
    QUANTIZE_CHOICES,
    EmbeddedModel,
    ModelLoadError,
    Preset,
    default_cache_dir,
    resolve_preset,
)

EMBEDDED_REQUIREMENTS = "requirements-embedded.txt"
MARKER_NAME = "complete.json"
# Tokens that close a chat turn in common templates. "<|endoftext|>" is left out on purpose: it ends
# a turn only where it is the eos token, and then the eos ids already hold it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_BLOCK_BYTES = 8 << 20
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags, and the aarch64 feature name


def pip_install_command(requirements: str = EMBEDDED_REQUIREMENTS, reinstall: bool = False) -> str:
    force = " --force-reinstall" if reinstall else ""
    return f"pip install{force} --no-deps --require-hashes -r {requirements}"


# ---------------------------------------------------------------------------------------------
# Device and dtype


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


def cpu_supports_bf16() -> bool:
    """Native bf16 arithmetic on this CPU; without it bf16 is emulated and slower than fp32."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap reliable probe, so stay with fp32
        return False
    return cpuinfo_has_bf16(cpuinfo)


def cpuinfo_has_bf16(cpuinfo: str) -> bool:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return any(flag in value.split() for flag in _CPU_BF16_FLAGS)
    return False


# ---------------------------------------------------------------------------------------------
# Assembling and verifying GGUF files


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source, _byte_bar(path.stat().st_size, f"checking {path.name}", progress) as bar:
        while block := source.read(_BLOCK_BYTES):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _byte_bar(total: int, description: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def _assemble(parts: Sequence[Path], dest: Path, expected_sha: str, progress: bool = False) -> Path:
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


def _ensure_assembled(parts: Sequence[Path], dest: Path, expected_sha: str, progress: bool = False) -> Path:
    """Reuse `dest` if its sha256 is right, else rebuild it once from the chunks."""
    if dest.is_file() and sha256_file(dest, progress) == expected_sha:
        return dest
    dest.unlink(missing_ok=True)
    return _assemble(parts, dest, expected_sha, progress)


def _verify_file(path: Path, expected_sha: str, fix: str, progress: bool = False) -> None:
    actual = sha256_file(path, progress)
    if actual != expected_sha:
        raise ModelLoadError(
            f"{path} has sha256 {actual[:16]}..., expected {expected_sha[:16]}...: the file is damaged. Fix: {fix}"
        )


# ---------------------------------------------------------------------------------------------
# Locating the chunk wheels (through their metadata; the packages are never imported)


def _locate_parts(entry: EmbeddedModel) -> list[Path]:
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
    paths = [Path(dist.locate_file(file)) for file in data]
    if len(paths) != 1 or not paths[0].is_file():
        raise ModelLoadError(
            f"The wheel {distribution} should hold exactly one data file (.bin or .gguf) but has "
            f"{len(paths)} present; it is damaged. Fix: {pip_install_command(reinstall=True)}"
        )
    return paths[0]


# ---------------------------------------------------------------------------------------------
# The converted-model cache


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

    def temp_dirs(self) -> list[Path]:
        return sorted(self.root.glob("hf.tmp-*"))


def is_complete(layout: CacheLayout, gguf_sha: str) -> bool:
    try:
        marker = json.loads(layout.marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("gguf_sha256") == gguf_sha


def _clear_incomplete(layout: CacheLayout) -> None:
    """Remove what an interrupted conversion left: temp dirs and an hf/ without a valid marker."""
    for leftover in layout.temp_dirs():
        shutil.rmtree(leftover, ignore_errors=True)
    if layout.hf_dir.exists():
        shutil.rmtree(layout.hf_dir)


def _build_cache(layout: CacheLayout, gguf_sha: str, write: Callable[[Path], None]) -> Path:
    """The complete hf/ dir: reused when its marker matches, else rebuilt by `write(temp_dir)`.

    The copy is written into a temporary sibling, marked complete last, then renamed into place, so an
    interrupted build never leaves a directory that looks usable.
    """
    if is_complete(layout, gguf_sha):
        return layout.hf_dir
    _clear_incomplete(layout)
    temp_dir = layout.root / f"hf.tmp-{os.getpid()}"
    temp_dir.mkdir(parents=True)
    try:
        write(temp_dir)
        marker = {"gguf_sha256": gguf_sha, "transformers": transformers.__version__}
        (temp_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(temp_dir, layout.hf_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return layout.hf_dir


def _convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Dequantize a GGUF with transformers and save model + tokenizer as bf16 safetensors in `dest`."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.bfloat16,  # cast right after dequantizing each tensor: lower peak memory
            quantization_config=GgufConfig(dequantize=True),  # dense weights, whatever kernels are installed
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelLoadError(
            f"transformers could not read the GGUF {gguf_path} ({_first_line(error)}). Fix: use a GGUF of an "
            "architecture transformers supports (llama, qwen2, mistral, ...) or a saved model directory."
        ) from error
    _drop_gguf_quantizer(model)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _drop_gguf_quantizer(model: PreTrainedModel) -> None:
    # why: the weights are already dense, but the attached GGUF quantizer makes save_pretrained refuse.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = [name for name, param in model.named_parameters() if not param.is_floating_point()]
    if packed:
        raise ModelLoadError(f"GGUF weights stayed packed after dequantizing ({packed[0]}, ...); cannot convert.")


def _embedded_hf_dir(entry: EmbeddedModel, cache_root: Path, progress: bool) -> Path:
    layout = CacheLayout(cache_root / entry.name)

    def write(temp_dir: Path) -> None:
        parts = _locate_parts(entry)
        _say(progress, f"Converting {entry.description} into {layout.hf_dir} (one time only, about a minute).")
        if len(parts) == 1 and parts[0].suffix == ".gguf":  # a whole GGUF in the wheel: read it in place
            _verify_file(parts[0], entry.sha256, pip_install_command(reinstall=True))
            _convert_gguf(parts[0], temp_dir)
            return
        layout.root.mkdir(parents=True, exist_ok=True)
        gguf_path = _ensure_assembled(parts, layout.gguf_path, entry.sha256, progress)
        _convert_gguf(gguf_path, temp_dir)
        gguf_path.unlink()  # the safetensors copy replaces it

    return _build_cache_or_explain(layout, entry.sha256, write)


def _gguf_file_hf_dir(gguf_path: Path, cache_root: Path, progress: bool) -> Path:
    gguf_sha = sha256_file(gguf_path, progress)
    layout = CacheLayout(cache_root / f"gguf-{gguf_sha[:16]}")

    def write(temp_dir: Path) -> None:
        _say(progress, f"Converting {gguf_path} into {layout.hf_dir} (one time only).")
        _convert_gguf(gguf_path, temp_dir)

    return _build_cache_or_explain(layout, gguf_sha, write)


def _build_cache_or_explain(layout: CacheLayout, gguf_sha: str, write: Callable[[Path], None]) -> Path:
    try:
        return _build_cache(layout, gguf_sha, write)
    except OSError as error:  # disk full, read-only cache dir, ...
        raise ModelLoadError(
            f"Could not write the converted model into {layout.root} ({_first_line(error)}). Fix: free some disk "
            "space (the 1.5B model needs about 5 GB while converting) or choose another cache directory."
        ) from error


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Loading one model


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str  # the directory the weights were read from, or the Hub id
    quantize: str = "none"  # what was applied: "none" | "int8" | "int4"
    dense: PreTrainedModel | None = None  # a quantized model's weights before quantizing, when asked for (prefill)

    @property
    def label(self) -> str:
        return self.name if self.quantize == "none" else f"{self.name} ({self.quantize})"


@dataclass(frozen=True)
class _Source:
    kind: str  # "embedded" | "gguf" | "directory" | "hub"
    name: str
    location: str  # what from_pretrained is given


def load_model(
    spec: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    keep_dense: bool = False,
    trust_remote_code: bool = False,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load `spec` (embedded name, saved directory, .gguf file or Hub id) in eval mode on `device`.

    `keep_dense`: a quantized model also keeps its dense weights as `dense` (for prefill: see `CachedModel`)."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    quantize = resolve_quantize(quantize, torch_dtype, torch_device)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with _transformers_progress(progress):
        source = _resolve_source(spec, cache_root, progress)
        model, tokenizer = _from_pretrained(spec, source, torch_dtype, trust_remote_code)
    model.to(torch_device)
    model.eval()
    dense = None
    if quantize != "none":
        dense = copy.deepcopy(model) if keep_dense else None
        quantize_weights(model, quantize)
    return LoadedModel(model=model, tokenizer=tokenizer, name=source.name, source=source.location, quantize=quantize,
                       dense=dense)


def resolve_quantize(quantize: str, dtype: torch.dtype, device: torch.device) -> str:
    """ "none", "int8" or "int4". "auto": int4 on a bfloat16 CPU, int8 with 16-bit activations on CUDA (low-bit
    weights cut the bytes a one-token forward reads), none otherwise (float32 activations make quanto's low-bit
    paths far slower). int4 runs on torch's packed int4 CPU kernel, which takes bfloat16 activations only."""
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"Unknown quantize {quantize!r}; use one of: {', '.join(QUANTIZE_CHOICES)}.")
    if quantize == "int4" and device.type != "cpu":
        raise ModelLoadError(f"int4 weights run on torch's packed int4 CPU kernel, not on {device.type}. "
                             f"Fix: use int8, or add --device cpu.")
    if quantize == "int4" and dtype != torch.bfloat16:
        raise ModelLoadError(f"int4 weights need bfloat16 activations (torch's packed int4 CPU kernel), not "
                             f"{str(dtype).removeprefix('torch.')}. Fix: add --dtype bfloat16, or use int8.")
    if quantize != "auto":
        return quantize
    if device.type == "cpu":
        return "int4" if dtype == torch.bfloat16 else "none"
    return "int8" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "none"


def _resolve_source(spec: str, cache_root: Path, progress: bool) -> _Source:
    if spec in EMBEDDED:
        hf_dir = _embedded_hf_dir(EMBEDDED[spec], cache_root, progress)
        return _Source("embedded", spec, str(hf_dir))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _Source("gguf", path.stem, str(_gguf_file_hf_dir(path.resolve(), cache_root, progress)))
    if path.is_dir():
        return _Source("directory", path.resolve().name, str(path.resolve()))
    if _looks_like_path(spec):
        raise ModelLoadError(
            f"{spec!r} is not an existing directory or .gguf file. Fix: check the path, or use an embedded "
            f"name ({', '.join(EMBEDDED)}) or a Hub id."
        )
    return _Source("hub", spec, spec)


def _looks_like_path(spec: str) -> bool:
    # why: Hub ids are "name" or "org/name"; anything else with slashes is meant as a path
    return spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1


def _from_pretrained(
    spec: str, source: _Source, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    # why: huggingface_hub reads HF_HUB_OFFLINE once at import; honour it when set later too.
    options = {"trust_remote_code": trust_remote_code, "local_files_only": _hub_offline()}
    try:
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **options)
        tokenizer = AutoTokenizer.from_pretrained(source.location, **options)
    except (OSError, ValueError, ImportError) as error:
        raise _load_failure(spec, source, error) from error
    return model, tokenizer


def _hub_offline() -> bool:
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.strip().lower() in ("1", "true", "yes", "on") for flag in flags)


def _load_failure(spec: str, source: _Source, error: BaseException) -> ModelLoadError:
    reason = _first_line(error)
    if source.kind == "hub":
        return ModelLoadError(_hub_failure_message(spec, error, reason))
    if source.kind in ("embedded", "gguf"):
        cache = Path(source.location).parent
        return ModelLoadError(
            f"The converted copy of {spec!r} in {source.location} could not be loaded ({reason}). "
            f"Fix: delete {cache} and load again to rebuild it."
        )
    return ModelLoadError(
        f"Could not load the model directory {source.location} ({reason}). Fix: point to a directory written "
        "by save_pretrained (config.json, weights and tokenizer files)."
    )


def _hub_failure_message(spec: str, error: BaseException, reason: str) -> str:
    from huggingface_hub.errors import GatedRepoError  # why: only needed on this error path

    where = "the local Hugging Face cache (offline mode)" if _hub_offline() else "the Hugging Face Hub or its cache"
    gated = isinstance(error, GatedRepoError) or "gated" in reason.lower()
    access = (
        "it is gated: run `hf auth login` and accept its license on huggingface.co"
        if gated
        else "check the id and your network, or for a gated model run `hf auth login`"
    )
    return (
        f"Could not load {spec!r} from {where} ({reason}). Fixes: {access}; or use `--preset embedded` for the "
        f"offline pair (embedded models: {', '.join(EMBEDDED)}; install them with `{pip_install_command()}`)."
    )


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = lines[0].strip() if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' progress bars for the duration when `enabled` is False."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def quantize_weights(model: PreTrainedModel, quantize: str) -> None:
    """Give `model` int8 weights (optimum-quanto) or int4 ones (`utils.int4`) in place; activations keep its dtype.

    int4 covers the linear layers of the packed kernel's shapes (`utils.int4.fits`); the others stay dense."""
    if quantize == "int8":
        from optimum.quanto import freeze, qint8, quantize as quanto_quantize  # why: slow import

        quanto_quantize(model, weights=qint8)
        freeze(model)
    elif quantize == "int4":
        to_int4(model)
    else:
        raise ValueError(f"cannot quantize weights to {quantize!r}; use int8 or int4")


# ---------------------------------------------------------------------------------------------
# Target + drafter


@dataclass
class LoadedPair:
    target: LoadedModel
    drafter: LoadedModel | None
    end_ids: tuple[int, ...]


def load_pair(
    target: str,
    drafter: str | None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    target_quantize: str = "none",
    drafter_quantize: str = "none",
    trust_remote_code: bool = False,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> LoadedPair:
    """Load a target and an optional drafter on one device and dtype; their vocabularies must match.

    A quantized drafter keeps its dense weights too (`drafter.dense`): prompts are prefilled with them."""
    shared = {
        "device": device,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "cache_dir": cache_dir,
        "progress": progress,
    }
    loaded_target = load_model(target, quantize=target_quantize, **shared)
    loaded_drafter = None
    if drafter is not None:
        loaded_drafter = load_model(drafter, quantize=drafter_quantize, keep_dense=True, **shared)
        check_same_vocab(loaded_target.tokenizer, loaded_drafter.tokenizer)
    end_ids = end_token_ids(loaded_target.tokenizer, loaded_target.model.generation_config)
    return LoadedPair(target=loaded_target, drafter=loaded_drafter, end_ids=end_ids)


def check_same_vocab(target_tok: PreTrainedTokenizerBase, drafter_tok: PreTrainedTokenizerBase) -> None:
    """Token -> id mappings must be equal (embedding rows padded past the vocabulary do not matter)."""
    target_vocab, drafter_vocab = target_tok.get_vocab(), drafter_tok.get_vocab()
    if target_vocab == drafter_vocab:
        return
    differing = len(set(target_vocab.items()) ^ set(drafter_vocab.items()))
    raise ModelLoadError(
        f"The target and drafter tokenizers differ (target {target_tok.name_or_path!r}: {len(target_vocab)} tokens, "
        f"drafter {drafter_tok.name_or_path!r}: {len(drafter_vocab)} tokens, {differing} token->id entries "
        "not shared); speculative decoding needs one vocabulary. Fix: pick a drafter from the target's model "
        "family (e.g. --preset embedded)."
    )


def end_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None) -> tuple[int, ...]:
    """Sorted ids that end generation: every eos id plus the chat template's end-of-turn token."""
    eos_ids = set(_as_ids(getattr(generation_config, "eos_token_id", None)))
    eos_ids |= set(_as_ids(tokenizer.eos_token_id))
    turn_ids = {token_id for token_id in _end_of_turn_ids(tokenizer) if token_id != tokenizer.pad_token_id}
    return tuple(sorted(eos_ids | turn_ids))


def _as_ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(item) for item in value]


def _end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(template.values())
    ids = []
    for token in END_OF_TURN_TOKENS:
        if token not in template:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        # why: an unknown token maps to the unk id (or None), which must not be taken for it
        if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token:
            ids.append(token_id)
    return ids
