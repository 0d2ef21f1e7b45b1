"""Placement by device map (models/placement.py): a target split between the CPU and disk by accelerate decodes exactly
as the same model loaded whole, through every kind of round; a map that cannot hold the model is refused before
loading; the flags' words; the refusal of kernel formats; on a GPU, a split across the GPU and the CPU."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from app.calibration import pair_key
from app.flags import FlagError, add_model_flags, check_model_names, model_choice
from models import invariance
from models.loading import LoadedPair, load_model, load_pair
from models.placement import Placement, check_device_map_name, describe, parse_max_memory
from models.presets import resolve_preset
from sampling.base import DecodeConfig
from sampling.registry import build_strategy
from tests.helpers import save_tiny_checkpoint
from utils.errors import ModelLoadError
from utils.logits_processor import TopKProcessor
from utils.runner import CachedModel, input_device

PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
LAYER_BYTES = 4 * (4 * 64 * 64 // 2 + 3 * 64 * 128 + 64)  # a float32 decoder layer of the tiny target below, roughly


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    return (save_tiny_checkpoint(root / "target", layers=4, hidden=64),
            save_tiny_checkpoint(root / "drafter", seed=1, layers=1, hidden=16))


@pytest.fixture(scope="module")
def split(checkpoints, tmp_path_factory):
    """The target with room on the CPU for its embedding and about two layers: the rest offloaded to disk."""
    offload = tmp_path_factory.mktemp("offload")
    placement = Placement("auto", {"cpu": 120_000 + 3 * LAYER_BYTES}, offload)
    return load_model(str(checkpoints[0]), dtype="float32", progress=False, placement=placement)


def test_the_split_target_holds_layers_on_the_cpu_and_on_disk(split):
    devices = set(split.model.hf_device_map.values())
    assert devices == {"cpu", "disk"}, split.model.hf_device_map
    assert "cpu:" in split.placement and "disk:" in split.placement
    assert input_device(split.model) == torch.device("cpu")


@pytest.mark.parametrize("name", ["autoregressive", "speculative", "lookup", "auto"])
def test_a_split_target_decodes_greedy_identical_to_the_whole_one(checkpoints, split, name):
    whole = load_model(str(checkpoints[0]), device="cpu", dtype="float32", progress=False)
    drafter = load_model(str(checkpoints[1]), device="cpu", dtype="float32", progress=False)
    config = DecodeConfig(max_new_tokens=40)
    outputs = []
    for target in (whole.model, split.model):
        strategy = build_strategy(name, CachedModel(target), CachedModel(drafter.model))
        outputs.append(strategy.generate(PROMPT, config).token_ids)
    assert len(outputs[0]) == 40
    assert outputs[1] == outputs[0]


@pytest.fixture(scope="module")
def on_disk(checkpoints, tmp_path_factory):
    """The target with no room on the CPU: every layer, the embedding first, offloaded to disk (meta weights)."""
    placement = Placement("auto", {"cpu": 1024}, tmp_path_factory.mktemp("all-offloaded"))
    return load_model(str(checkpoints[0]), dtype="float32", progress=False, placement=placement)


def test_a_target_all_on_disk_starts_and_answers_as_the_whole_one(checkpoints, on_disk, tmp_path, capsys):
    """Regression: the start's identity probe fed the linear layers on the first weight's device, meta for a model
    whose embedding is offloaded: "Cannot copy out of meta tensor" instead of an answer. Here the whole start (load,
    probe, calibration) and a one-shot answer, through infer.py, with and without the device map."""
    import infer

    assert set(on_disk.model.hf_device_map.values()) == {"disk"}
    assert next(on_disk.model.parameters()).device.type == "meta"
    base = ["--target", str(checkpoints[0]), "--drafter", "none", "--dtype", "float32", "--prompt", "hi", "--json",
            "-n", "12", "--strategy", "autoregressive", "--no-chat", "--cache-dir", str(tmp_path / "cache")]
    placed = ["--device-map", "auto", "--max-memory", "cpu=1KiB", "--offload-dir", str(tmp_path / "offload")]
    answers = []
    for argv in (base + ["--device", "cpu"], base + placed):
        assert infer.main(argv) == 0
        answers.append(json.loads(capsys.readouterr().out)["results"][0]["token_ids"])
    assert len(answers[0]) == 12 and answers[1] == answers[0]


def test_the_probe_runs_on_a_target_all_on_disk(on_disk):
    found = invariance.probe(CachedModel(on_disk.model), width=4)
    assert found.layers and found.tried


def test_a_split_target_rolls_a_token_tree_back_layer_by_layer(split):
    """`crop_to_path` moves a tree's accepted rows in every layer's cache on its layer's device, as a fresh forward."""
    lm = CachedModel(split.model)
    lm.extend_tree(PROMPT, [3, 4, 7], [-1, -1, 1])  # nodes 0 and 1 are siblings; 2 follows 1
    lm.crop_to_path(len(PROMPT), [len(PROMPT) + 1, len(PROMPT) + 2])
    fresh = CachedModel(split.model)
    expected = fresh.extend(PROMPT + [4, 7, 9])
    assert lm.tokens == PROMPT + [4, 7]
    torch.testing.assert_close(lm.extend(PROMPT + [4, 7, 9]), expected)


def test_the_banner_says_where_the_layers_went(checkpoints, split):
    from app.engine import ModelInfo

    drafter = load_model(str(checkpoints[1]), device="cpu", dtype="float32", progress=False)
    info = ModelInfo.of(LoadedPair(target=split, drafter=drafter, end_ids=()), "t", "d", None)
    assert info.device == "cpu" and info.placement == f"target {split.placement}"
    assert (info.target_spec, info.drafter_spec) == ("t", "d")


def test_a_split_target_is_calibrated_apart_from_the_whole_one(checkpoints, split):
    """Regression: the per-machine timings were kept under the model and its format alone, so a target offloaded to
    disk would have read back (or overwritten) the timings of the same model loaded whole."""
    whole = load_model(str(checkpoints[0]), dtype="float32", progress=False,
                       placement=Placement("auto", {"cpu": 2**30}))
    assert whole.placement == "" and whole.format == split.format  # the same weights, one of them split
    keys = [pair_key(LoadedPair(target=loaded, drafter=None, end_ids=())) for loaded in (whole, split)]
    assert keys[0] != keys[1]


def test_a_map_that_cannot_hold_the_model_says_so_before_loading(checkpoints):
    with pytest.raises(ModelLoadError) as error:
        load_model(str(checkpoints[0]), dtype="float32", progress=False, placement=Placement("auto", {"cpu": 50_000}))
    message = str(error.value)
    assert "cannot hold" in message and "--offload-dir" in message and "\n" not in message


def test_a_device_too_small_for_the_whole_model_says_so_before_loading(checkpoints, monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda max_memory=None: {"cpu": 10_000})
    with pytest.raises(ModelLoadError, match="does not fit cpu: .* 0.0 MiB free. Fix: --device-map auto"):
        load_model(str(checkpoints[0]), dtype="float32", progress=False, placement=Placement("cpu"))


def test_a_refusal_names_the_model_not_its_converted_folder(monkeypatch):
    """Regression: the embedded SmolLM2 is read from its converted copy's folder `hf`, and the refusal said "hf does not
    fit cpu"."""
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda max_memory=None: {"cpu": 10_000})
    with pytest.raises(ModelLoadError) as error:
        load_model("smollm2-135m", dtype="float32", progress=False, placement=Placement("cpu"))
    assert str(error.value).lower().startswith("smollm2"), str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_max_memory_on_a_gpu_this_machine_lacks_is_one_line(checkpoints):
    """Regression: --max-memory 0=20GiB without a GPU reached transformers, whose RuntimeError ("Cannot access
    accelerator device") came out as a traceback."""
    with pytest.raises(ModelLoadError) as error:
        load_model(str(checkpoints[0]), dtype="float32", progress=False, placement=Placement("auto", {0: 2**30}))
    message = str(error.value)
    assert "GPU 0" in message and "cpu=SIZE" in message and "\n" not in message


def test_a_kernel_format_with_a_device_map_is_refused_in_one_line(checkpoints):
    with pytest.raises(ModelLoadError, match="device map"):
        load_model(str(checkpoints[0]), quantize="int4", progress=False, placement=Placement("cpu"))


def test_a_whole_device_map_puts_the_drafter_apart_and_describes_nothing(checkpoints):
    pair = load_pair(str(checkpoints[0]), str(checkpoints[1]), device="cpu", dtype="float32", progress=False,
                     drafter_placement=Placement("cpu"))
    assert pair.drafter is not None and pair.drafter.placement == "" and pair.target.placement == ""
    assert input_device(pair.drafter.model) == torch.device("cpu")


@pytest.mark.parametrize("text, expected", [
    ("0=20GiB,cpu=40GiB", {0: 20 * 2**30, "cpu": 40 * 2**30}),
    ("cuda:1=1.5GB, disk=100MiB", {1: 1_500_000_000, "disk": 100 * 2**20}),
    ("cpu=4096", {"cpu": 4096}),
])
def test_max_memory_reads_as_accelerate_takes_it(text, expected):
    assert parse_max_memory(text) == expected


@pytest.mark.parametrize("text, words", [
    ("20GiB", "DEVICE=SIZE"), ("gpu=1GiB", "DEVICE=SIZE"), ("cpu=lots", "not a size"), ("cpu=0", "no room"),
    ("cpu=1GiB,cpu=2GiB", "twice"),
])
def test_a_bad_max_memory_is_one_line_naming_the_flag(text, words):
    with pytest.raises(ModelLoadError, match=words) as error:
        parse_max_memory(text)
    assert str(error.value).startswith("--max-memory")


def test_device_map_names():
    assert [check_device_map_name(n) for n in ("auto", " Balanced", "cpu", "cuda", "cuda:1", "mps")] == \
        ["auto", "balanced", "cpu", "cuda", "cuda:1", "mps"]
    with pytest.raises(ModelLoadError, match="--drafter-device-map 'sequentially'"):
        check_device_map_name("sequentially", "--drafter-device-map")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    parser.add_argument("--dtype-unused", default=None)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, words", [
    (["--max-memory", "cpu=1GiB"], "--max-memory needs --device-map auto or balanced"),
    (["--device-map", "cpu", "--max-memory", "cpu=1GiB"], "not a whole device"),
    (["--device-map", "cpu", "--offload-dir", "x"], "--offload-dir needs"),
    (["--drafter-device-map", "gpu"], "--drafter-device-map 'gpu'"),
])
def test_placement_flags_are_checked_before_loading(argv, words):
    with pytest.raises(FlagError, match=words):
        check_model_names(_args(*argv))


def test_a_device_map_gives_the_presets_low_bit_formats_way_but_not_a_flags(tmp_path):
    args = _args("--preset", "embedded", "--device-map", "auto", "--max-memory", "cpu=1GiB", "--offload-dir",
                 str(tmp_path))
    choice = model_choice(args, lambda name: resolve_preset(name, cuda_available=False))
    assert choice.target_quantize == "none" and choice.drafter_quantize != "none"  # the drafter has no map
    assert choice.target_placement == Placement("auto", {"cpu": 2**30}, tmp_path)
    flagged = model_choice(_args("--preset", "embedded", "--device-map", "cpu", "--target-quantize", "gguf"),
                           lambda name: resolve_preset(name, cuda_available=False))
    assert flagged.target_quantize == "gguf"  # the loader refuses it in one line


def test_describe_groups_consecutive_layers_by_device():
    class Placed:
        hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": "cpu",
                         "model.layers.3": "disk", "model.norm": "disk", "lm_head": "disk"}

    assert describe(Placed()) == "cuda:0: embed_tokens, layers 0-1 · cpu: layers 2 · disk: layers 3, norm, lm_head"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_target_split_across_the_gpu_and_the_cpu_decodes_as_the_whole_one(checkpoints):
    whole = load_model(str(checkpoints[0]), device="cuda", dtype="float32", progress=False)
    split = load_model(str(checkpoints[0]), dtype="float32", progress=False,
                       placement=Placement("auto", {0: 120_000 + 2 * LAYER_BYTES, "cpu": 2**30}))
    assert set(split.model.hf_device_map.values()) == {0, "cpu"}, split.model.hf_device_map
    drafter = load_model(str(checkpoints[1]), device="cpu", dtype="float32", progress=False)  # on another device
    config = DecodeConfig(max_new_tokens=40)
    for name in ("autoregressive", "speculative"):
        outputs = [build_strategy(name, CachedModel(target), CachedModel(drafter.model)).generate(PROMPT, config)
                   .token_ids for target in (whole.model, split.model)]
        assert outputs[1] == outputs[0]
    # sampling with the drafter on the CPU and the target on the GPU: its own generator, its q moved to the target's
    sampled = DecodeConfig(max_new_tokens=30, processor=TopKProcessor(0.9, 20), seed=3)
    runs = [build_strategy("speculative", CachedModel(split.model), CachedModel(drafter.model))
            .generate(PROMPT, sampled).token_ids for _ in range(2)]
    assert len(runs[0]) == 30 and runs[0] == runs[1]
