"""Load models from one spec: an embedded name, a saved directory, a .gguf file or a Hub id; and a target with its
drafter, on one device and dtype."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

import kernels
from models import grouped_attention
from models.devices import resolve_device, resolve_dtype
from models.formats import blocks, choice
from models.formats.base import Loaded, LoadJob, WeightFormat
from models.formats.kernel_blocks import GgufBlocks, Q8_0Blocks
from models.formats.q4k import Q4K
from models.formats.quantize import LowBit, activation_dtype, resolve_quantize
from models.gguf import pip_install_command
from models.placement import Placement, describe, plan
from models.presets import EMBEDDED, default_cache_dir
from models.store import embedded_gguf, embedded_hf_dir, gguf_file_hf_dir
from models.vocab import end_token_ids, vocab_notice
from utils.errors import ModelLoadError, one_line


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str  # the directory the weights were read from, or the Hub id
    quantize: str = "none"  # what was applied: "none" | "int8" | "int4" | "q4k" | "gguf" | "q8_0"
    dense: PreTrainedModel | None = None  # a quantized model's weights before quantizing, when asked for (prefill)
    placement: str = ""  # where a device map put its layers (`models.placement.describe`); "" on one device
    requantized: int = 0  # gguf: layers the file holds in types the kernels lack, quantized to Q8_0 at load
    smaller: int = 0  # gguf: layers the file holds in wider types, quantized again to Q4_0 at load (a drafter)

    @property
    def label(self) -> str:
        return self.name if self.quantize == "none" else f"{self.name} ({self.quantize})"

    @property
    def format(self) -> str:
        """How the weights are held and computed: "int4 weights, bfloat16 activations", "float32, oneDNN-prepacked"."""
        return FORMATS[self.quantize].describe(self.model, Loaded(self.dense, self.requantized, self.smaller))


# each `--quantize` name's format (after "auto" is resolved)
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (WeightFormat(), LowBit("int8"), LowBit("int4"), Q4K(),
                                                        GgufBlocks(), Q8_0Blocks())}


@dataclass(frozen=True)
class _Source:
    kind: str  # "embedded" | "gguf" | "directory" | "hub"
    name: str
    location: str  # what from_pretrained is given
    gguf: str | None = None  # the GGUF file it was converted from, for a .gguf spec


def load_model(
    spec: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    keep_dense: bool = False,
    trust_remote_code: bool = False,
    cache_dir: Path | None = None,
    verify: bool = False,
    progress: bool = True,
    placement: Placement | None = None,
    requantize_rest: bool = False,
) -> LoadedModel:
    """Load `spec` (embedded name, saved directory, .gguf file or Hub id) in eval mode on `device`.

    `requantize_rest`: with "auto" resolved to gguf, the layers the file holds in types the kernels lack (Q4_1, ...)
    are quantized to Q8_0 blocks at load instead of running dense, and those in types of more bits a weight than Q4_0
    (Q5_0, Q6_K, Q8_0) quantized again to Q4_0, fewer bytes a step: changes of weights only a drafter may take (its
    acceptance measured unchanged, docs/kernels.md).

    `placement`: the model's layers where its device map puts them (`models.placement`), instead of on `device`: dense
    weights only (quantize "auto" loads them; another format is refused in one line).

    `keep_dense`: a quantized model also keeps its dense weights as `dense` (for prefill: see `CachedModel`).
    `verify`: check the sha256 of every file of a converted copy (their sizes are checked on every load).
    "gguf" where the kernels cannot run, or for a model without a GGUF file, says so in one line and loads the
    model's dense weights; "auto" takes gguf where it can, else on a CPU q8_0 or int4, whichever this machine runs
    the model's layers faster in (`models.formats.choice`)."""
    if placement is not None:
        return _load_placed(spec, placement, dtype, quantize, trust_remote_code, cache_dir, verify, progress)
    torch_device = resolve_device(device)
    compute_dtype = resolve_dtype(dtype, torch_device)  # dense weights: the machine's (or the asked) dtype
    asked = quantize
    quantize = resolve_quantize(quantize, compute_dtype, torch_device, dtype_given=dtype.strip().lower() != "auto")
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with _transformers_progress(progress):
        source = _resolve_source(spec, cache_root, progress, verify)
        gguf_file = functools.cache(functools.partial(_gguf_file, spec, source, cache_root, progress))
        quantize = _file_or_timed(asked, quantize, source, gguf_file, dtype.strip().lower() == "auto", cache_root,
                                  trust_remote_code)
        weights = FORMATS[quantize]
        job = LoadJob(name=source.name, spec=spec, kind=source.kind, gguf_file=gguf_file, cache_root=cache_root,
                      device=torch_device, compute_dtype=compute_dtype,
                      activations=activation_dtype(quantize, compute_dtype, torch_device), keep_dense=keep_dense,
                      smaller=requantize_rest and asked == "auto")
        model, tokenizer = _from_pretrained(spec, source, weights.read_dtype(job), trust_remote_code)
    model.to(torch_device)  # type: ignore[arg-type]  # transformers' decorator on `to` hides its signature
    model.eval()
    loaded = weights.load(model, job)
    weights.pack(model, loaded, job)
    return LoadedModel(model=model, tokenizer=tokenizer, name=source.name, source=source.location, quantize=quantize,
                       dense=loaded.dense, requantized=loaded.requantized, smaller=loaded.smaller)


def _load_placed(spec: str, placement: Placement, dtype: str, quantize: str, trust_remote_code: bool,
                 cache_dir: Path | None, verify: bool, progress: bool) -> LoadedModel:
    """A dense model split (or put whole) by its device map; the map is computed, and checked, before any weight is
    read."""
    if quantize not in ("none", "auto"):
        raise ModelLoadError(f"{quantize} weights run on one device with the project's own layers, and a device map "
                             "places a dense checkpoint's layers. Fix: drop --device-map, or use none (or auto).")
    # the dtype of the device the map fills first; a named device is checked as --device is
    torch_dtype = resolve_dtype(dtype, resolve_device("auto" if placement.computed else placement.device_map))
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with _transformers_progress(progress):
        source = _resolve_source(spec, cache_root, progress, verify)
        try:
            device_map = plan(source.location, placement, torch_dtype, trust_remote_code, _hub_offline(), source.name)
        except (OSError, ValueError) as error:
            raise _load_failure(spec, source, error) from error
        model, tokenizer = _from_pretrained(spec, source, torch_dtype, trust_remote_code, device_map=device_map,
                                            offload_folder=placement.offload_dir)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=source.name, source=source.location,
                       placement=describe(model))


@dataclass(frozen=True)
class ModelFiles:
    name: str  # as the loaded model is named (the shipped heads are found by it)
    folder: str  # what from_pretrained reads: a converted copy's folder, a saved directory, or the Hub id
    gguf: str | None  # an embedded model's GGUF (assembled once) or the .gguf given; None for other kinds


def model_files(spec: str, cache_dir: Path | None = None, progress: bool = True, verify: bool = False) -> ModelFiles:
    """Where `spec`'s files are on disk, without loading its weights."""
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with _transformers_progress(progress):
        source = _resolve_source(spec, cache_root, progress, verify)
        gguf = _gguf_file(spec, source, cache_root, progress)
    return ModelFiles(source.name, source.location, None if gguf is None else str(gguf))


def _gguf_file(spec: str, source: _Source, cache_root: Path, progress: bool) -> Path | None:
    """The GGUF file the model was converted from (an embedded model's assembled once), or None for other kinds."""
    if source.kind == "embedded":
        return embedded_gguf(EMBEDDED[spec], cache_root, progress)
    return Path(source.gguf) if source.gguf is not None else None


def _file_or_timed(asked: str, resolved: str, source: _Source, gguf_file: Callable[[], Path | None],
                   dtype_auto: bool, cache_root: Path, trust_remote_code: bool) -> str:
    """The format "gguf" and "auto" come to once the model's files are known: the GGUF's own blocks where the kernels
    run them (else "gguf" says why in one line and loads dense weights), or on a CPU the faster of q8_0 and int4."""
    gguf, why_not = _gguf_blocks(source, gguf_file) if asked in ("gguf", "auto") else (None, "")
    if asked == "gguf" and gguf is None:
        print(f"{source.name}: no gguf weights ({why_not}); it runs on its dense weights", file=sys.stderr)
        return "none"
    if gguf is not None and (asked == "gguf" or resolved == "int4"):
        return "gguf"
    if asked == "auto" and resolved == "int4" and dtype_auto and kernels.unavailable() is None:
        return _timed_low_bit(source, cache_root, trust_remote_code)
    return resolved


def _gguf_blocks(source: _Source, gguf_file: Callable[[], Path | None]) -> tuple[Path | None, str]:
    """The GGUF file whose blocks the kernels can run for this model, or None and why not (one line)."""
    if source.kind not in ("embedded", "gguf"):
        return None, f"a {source.kind} model has no GGUF file"
    if (reason := kernels.unavailable()) is not None:
        return None, f"the kernels cannot run here: {reason}; ./setup.sh builds them where g++ is installed"
    gguf = gguf_file()
    if gguf is None or not blocks.block_linears(gguf):
        return None, f"its GGUF holds no {', '.join(kernels.BLOCKS)} linears"
    return gguf, ""


def _timed_low_bit(source: _Source, cache_root: Path, trust_remote_code: bool) -> str:
    """"q8_0" or "int4" for a dense model on this CPU, whichever its layer shapes run faster in (`formats.choice`);
    int4 for a model whose layers that timing does not know."""
    try:
        config = AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code,
                                            local_files_only=_hub_offline())
        return choice.choose(config, cache_root)
    except (OSError, ValueError, AttributeError):
        return "int4"


def _resolve_source(spec: str, cache_root: Path, progress: bool, verify: bool) -> _Source:
    if spec in EMBEDDED:
        hf_dir = embedded_hf_dir(EMBEDDED[spec], cache_root, progress, verify)
        return _Source("embedded", spec, str(hf_dir))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _Source("gguf", path.stem, str(gguf_file_hf_dir(path.resolve(), cache_root, progress, verify)),
                       str(path.resolve()))
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
    spec: str, source: _Source, dtype: torch.dtype | str, trust_remote_code: bool, **placed
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`placed`: from_pretrained's device_map and offload_folder, for a placed model."""
    # why: huggingface_hub reads HF_HUB_OFFLINE once at import; honour it when set later too.
    options = {"trust_remote_code": trust_remote_code, "local_files_only": _hub_offline()}
    try:
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **options, **placed)
        tokenizer = AutoTokenizer.from_pretrained(source.location, **options)
    except (OSError, ValueError, ImportError, SafetensorError) as error:  # SafetensorError: damaged weights
        raise _load_failure(spec, source, error) from error
    return model, tokenizer


def _hub_offline() -> bool:
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.strip().lower() in ("1", "true", "yes", "on") for flag in flags)


def _load_failure(spec: str, source: _Source, error: BaseException) -> ModelLoadError:
    reason = one_line(error)
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


@dataclass
class LoadedPair:
    target: LoadedModel
    drafter: LoadedModel | None
    end_ids: tuple[int, ...]
    vocab_notice: str | None = None  # the drafter has another tokenizer (it drafts text): the line that says so

    @property
    def tokenizers(self) -> tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase] | None:
        """(target's, drafter's) tokenizers where the drafter's vocabulary differs (`build_strategy` takes them)."""
        if self.drafter is None or self.vocab_notice is None:
            return None
        return self.target.tokenizer, self.drafter.tokenizer


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
    verify: bool = False,
    progress: bool = True,
    target_placement: Placement | None = None,
    drafter_placement: Placement | None = None,
) -> LoadedPair:
    """Load a target and an optional drafter on one device and dtype; a drafter of another vocabulary is taken
    with `vocab_notice` saying so.

    A quantized drafter keeps its dense weights too (`drafter.dense`): prompts are prefilled with them. Each model
    may have a device map of its own (`*_placement`): the drafter may run on another device than the target."""
    load = functools.partial(load_model, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                             cache_dir=cache_dir, verify=verify, progress=progress)
    loaded_target = load(target, quantize=target_quantize, placement=target_placement)
    loaded_drafter, notice = None, None
    if drafter is not None:
        loaded_drafter = load(drafter, quantize=drafter_quantize, keep_dense=True, placement=drafter_placement,
                              requantize_rest=True)  # its weights never change the output
        grouped_attention.use(loaded_drafter.model)  # nor its attention's rounding
        notice = vocab_notice(loaded_target.tokenizer, loaded_drafter.tokenizer)
    end_ids = end_token_ids(loaded_target.tokenizer, loaded_target.model.generation_config)
    return LoadedPair(target=loaded_target, drafter=loaded_drafter, end_ids=end_ids, vocab_notice=notice)
