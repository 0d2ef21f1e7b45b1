"""Serving-engine exports (app/export.py, /export, infer.py --export) checked against the engines' published options,
not by running them (no GPU here); and the EAGLE layout (sampling/heads/layouts.py): what our writer writes, our reader
loads, and drafts the same tokens from.

The engines' options, as their documentation lists them:
- vLLM: the fields of `SpeculativeConfig` in vllm/config/speculative.py (github.com/vllm-project/vllm, commit
  002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443), passed as JSON to `vllm serve MODEL --speculative-config`; its EAGLE-1
  weight names from vllm/model_executor/models/llama_eagle.py (commit 00da92319af4b2ad2cde8525b7b609c779bdc52f) and
  the Llama layer's `qkv_bias` from vllm/model_executor/models/llama.py.
- SGLang's EAGLE-1 classes: python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle, commit
  034b3be819faf3f84c5aae5a4cda27bdf2e12de0) and qwen2_eagle.py (Qwen2ForCausalLMEagle), each with `fc` biased.
- SGLang: docs/advanced_features/server_arguments.md (github.com/sgl-project/sglang, commit
  b36e8e198b71553316b55bce53de6ecf9b3a9a47), sections "Model and tokenizer", "Speculative decoding" and "Ngram
  speculative decoding".
- llama.cpp: tools/server/README.md (github.com/ggml-org/llama.cpp, commit 00dc8057ab28c9cb4c79a6dd6dfce07fe779f63b),
  the server's speculative options (`--draft-max` and friends are listed there as removed).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

import infer
import train_head
from app.export import ENGINES, Serving, drafting_strategy, export, printable
from sampling.heads.eagle import EagleDrafter
from sampling.heads.layouts import head_kind, write_eagle
from sampling.heads.networks import HeadConfig, build, eagle_config, load_head, save_head
from sampling.settings import STRATEGIES, StrategySettings
from tests.helpers import save_tiny_pair, tiny_model
from utils.logits_processor import GreedyProcessor
from utils.runner import CachedModel

VLLM_SPECULATIVE_CONFIG_KEYS = {
    "enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size", "tensor_parallel_size",
    "quantization", "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len", "revision",
    "code_revision", "disable_padded_drafter_batch", "use_local_argmax_reduction", "use_heterogeneous_vocab",
    "prompt_lookup_max", "prompt_lookup_min", "parallel_drafting", "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
    "rejection_sample_method", "draft_sample_method",
}
VLLM_METHODS = {"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3"}
VLLM_EAGLE_WEIGHTS = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                      "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                      "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                      "layers.0.post_attention_layernorm.weight"}
SGLANG_ARGUMENTS = {
    "--model-path", "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model-revision",
    "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
    "--speculative-accept-threshold-single", "--speculative-accept-threshold-acc", "--speculative-token-map",
    "--speculative-ngram-min-match-window-size", "--speculative-ngram-max-match-window-size",
    "--speculative-ngram-min-bfs-breadth", "--speculative-ngram-max-bfs-breadth", "--speculative-ngram-branch-length",
}
SGLANG_ALGORITHMS = {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"}
LLAMACPP_ARGUMENTS = {
    "-m", "-md", "--spec-draft-model", "--model-draft", "--spec-draft-n-max", "--spec-draft-n-min",
    "--spec-draft-p-min", "--spec-type", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m",
    "--spec-ngram-simple-min-hits",
}
LLAMACPP_SPEC_TYPES = {"none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark",
                       "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"}

SERVING = Serving("/models/target", "/models/target.gguf", "/models/drafter", "/models/drafter.gguf",
                  "/heads/eagle-layout", ("the head drafts from all of the vocabulary there",),
                  "/heads/eagle-layout/token_map.pt")
SETTINGS = StrategySettings(gamma=5, lookup_min_ngram=2, lookup_max_ngram=4, head_branch=3, verify_width=9)


def flags(argv: list[str]) -> dict[str, str]:
    """Each option of an argv and the value after it."""
    return {word: argv[i + 1] for i, word in enumerate(argv) if word.startswith("-") and i + 1 < len(argv)}


def check_vllm(argv: list[str]) -> dict:
    assert argv[:3] == ["vllm", "serve", SERVING.target]
    if len(argv) == 3:
        return {}
    assert argv[3] == "--speculative-config" and len(argv) == 5
    config = json.loads(argv[4])
    assert set(config) <= VLLM_SPECULATIVE_CONFIG_KEYS and config["method"] in VLLM_METHODS
    return config


def check_sglang(argv: list[str]) -> dict[str, str]:
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    options = flags(argv[3:])
    assert set(options) <= SGLANG_ARGUMENTS and options["--model-path"] == SERVING.target
    assert options.get("--speculative-algorithm", "EAGLE") in SGLANG_ALGORITHMS
    return options


def check_llamacpp(argv: list[str]) -> dict[str, str]:
    assert argv[0] == "llama-server"
    options = flags(argv[1:])
    assert set(options) <= LLAMACPP_ARGUMENTS and options["-m"] == SERVING.target_gguf
    assert set(options.get("--spec-type", "none").split(",")) <= LLAMACPP_SPEC_TYPES
    return options


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("engine", ENGINES)
def test_every_export_uses_only_the_engines_published_options(engine, strategy):
    result = export(engine, SERVING, (strategy, "autoregressive"), SETTINGS)
    check = {"vllm": check_vllm, "sglang": check_sglang, "llamacpp": check_llamacpp}[engine]
    check(result.argv)
    assert shlex.split(result.command) == result.argv
    assert all("\n" not in note for note in result.notes)


def test_a_draft_model_carries_its_path_and_gamma_everywhere():
    strategies = ("speculative",)
    vllm = check_vllm(export("vllm", SERVING, strategies, SETTINGS).argv)
    assert vllm == {"method": "draft_model", "model": SERVING.drafter, "num_speculative_tokens": 5}
    sglang = check_sglang(export("sglang", SERVING, strategies, SETTINGS).argv)
    assert (sglang["--speculative-algorithm"], sglang["--speculative-draft-model-path"]) == ("STANDALONE",
                                                                                            SERVING.drafter)
    assert (sglang["--speculative-num-steps"], sglang["--speculative-eagle-topk"],
            sglang["--speculative-num-draft-tokens"]) == ("5", "1", "6")
    llamacpp = check_llamacpp(export("llamacpp", SERVING, strategies, SETTINGS).argv)
    assert (llamacpp["-md"], llamacpp["--spec-draft-n-max"]) == (SERVING.drafter_gguf, "5")


def test_a_drafter_of_another_tokenizer_is_served_where_the_engine_can_and_named_where_not():
    """vLLM's draft_model takes one with use_heterogeneous_vocab (vllm/config/speculative.py, PR #38174); SGLang's
    STANDALONE and llama.cpp's draft model need the target's vocabulary: the nearest is n-grams, said in one line."""
    other = Serving(SERVING.target, SERVING.target_gguf, SERVING.drafter, SERVING.drafter_gguf, same_vocab=False)
    vllm = export("vllm", other, ("speculative",), SETTINGS)
    assert check_vllm(vllm.argv) == {"method": "draft_model", "model": SERVING.drafter, "num_speculative_tokens": 5,
                                     "use_heterogeneous_vocab": True}
    assert any("use_heterogeneous_vocab" in note for note in vllm.notes)
    for engine, check, method in (("sglang", check_sglang, "NGRAM"), ("llamacpp", check_llamacpp, "ngram-simple")):
        result = export(engine, other, ("speculative",), SETTINGS)
        options = check(result.argv)
        assert options.get("--speculative-algorithm", options.get("--spec-type")) == method
        assert "-md" not in options and "--speculative-draft-model-path" not in options
        assert any("another tokenizer" in note for note in result.notes)


def test_lookup_carries_its_n_gram_sizes():
    vllm = check_vllm(export("vllm", SERVING, ("lookup",), SETTINGS).argv)
    assert vllm == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    sglang = check_sglang(export("sglang", SERVING, ("lookup",), SETTINGS).argv)
    assert (sglang["--speculative-ngram-min-match-window-size"], sglang["--speculative-ngram-max-match-window-size"]) \
        == ("2", "4")
    llamacpp = check_llamacpp(export("llamacpp", SERVING, ("lookup",), SETTINGS).argv)
    assert (llamacpp["--spec-type"], llamacpp["--spec-ngram-simple-size-n"]) == ("ngram-simple", "4")


def test_an_eagle_head_is_served_where_the_engine_can_and_named_where_it_cannot():
    vllm = export("vllm", SERVING, ("eagle",), SETTINGS)
    assert check_vllm(vllm.argv) == {"method": "eagle", "model": SERVING.eagle, "num_speculative_tokens": 5}
    assert SERVING.eagle_notes[0] in vllm.notes
    sglang = check_sglang(export("sglang", SERVING, ("eagle",), SETTINGS).argv)
    assert (sglang["--speculative-algorithm"], sglang["--speculative-draft-model-path"],
            sglang["--speculative-eagle-topk"], sglang["--speculative-num-draft-tokens"]) == ("EAGLE", SERVING.eagle,
                                                                                             "3", "9")
    assert sglang["--speculative-token-map"] == SERVING.token_map
    llamacpp = export("llamacpp", SERVING, ("eagle",), SETTINGS)
    assert check_llamacpp(llamacpp.argv)["--spec-type"] == "draft-simple"
    note = llamacpp.notes[0]
    assert note.startswith("eagle: no llama.cpp equivalent") and "nearest: draft-simple" in note


@pytest.mark.parametrize("engine, nearest", [("vllm", "ngram"), ("sglang", "NGRAM"), ("llamacpp", "ngram-simple")])
def test_what_an_engine_cannot_do_is_named_in_one_line_with_the_nearest(engine, nearest):
    result = export(engine, Serving("/models/target", "/models/target.gguf"), ("lookahead",), SETTINGS)
    name = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}[engine]
    assert any(note.startswith("lookahead (") and f"no {name} equivalent; nearest: {nearest}" in note
               for note in result.notes)


def test_without_a_drafting_strategy_the_target_is_served_plain():
    assert drafting_strategy(("autoregressive", "beam")) is None
    result = export("vllm", SERVING, ("autoregressive",), SETTINGS)
    assert result.argv == ["vllm", "serve", SERVING.target] and "without speculative decoding" in result.notes[0]


def test_a_model_without_a_gguf_gets_a_named_placeholder_and_how_to_make_it():
    result = export("llamacpp", Serving("/models/target", None, "/models/drafter", None), ("speculative",), SETTINGS)
    options = flags(result.argv[1:])
    assert (options["-m"], options["-md"]) == ("target.gguf", "drafter.gguf")
    assert sum("convert_hf_to_gguf.py" in note for note in result.notes) == 2


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("export"))


@pytest.fixture(scope="module")
def our_eagle(pair_dirs, tmp_path_factory):
    """An eagle head of random weights in this project's format, stored in float32, for the saved tiny target."""
    model = tiny_model(dtype=torch.float32)
    config = eagle_config(model.config, 48)
    module = build(config)
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("heads") / "ours-eagle"
    save_head(path, config, module, torch.arange(0, 90), {}, dtype=torch.float32)
    return path


def test_the_eagle_layout_has_the_names_vllm_loads(our_eagle, tmp_path):
    notes = write_eagle(our_eagle, tmp_path / "layout", tiny_model().config)
    weights = load_file(str(tmp_path / "layout" / "model.safetensors"))
    assert set(weights) == VLLM_EAGLE_WEIGHTS  # fc.bias: zeros, for SGLang's biased fc (vLLM skips it)
    assert not weights["fc.bias"].any()
    config = json.loads((tmp_path / "layout" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert AutoConfig.for_model(**config).hidden_size == 32  # transformers reads it as a Llama config
    assert any("90 most frequent tokens" in note for note in notes)
    assert head_kind(tmp_path / "layout") == "eagle" and head_kind(our_eagle) == "eagle"


def test_an_exported_eagle_head_drafts_the_same_tokens_as_ours(our_eagle, tmp_path):
    """Round trip: our reader loads what our writer wrote; the same drafts (the draft vocabulary aside, which the
    EAGLE-1 layout has no place for: both draft from the whole vocabulary here)."""
    model = tiny_model(dtype=torch.float32)
    write_eagle(our_eagle, tmp_path / "layout", model.config)
    ours, theirs = load_head(our_eagle, model), load_head(tmp_path / "layout", model)
    ours.vocab, ours.out = None, model.get_output_embeddings().weight.detach()  # the whole vocabulary, as theirs
    assert theirs.config == HeadConfig(**{**ours.config.__dict__, "fc_bias": True})  # a bias of zeros
    ids = [5, 17, 42, 8, 5, 17, 42, 9, 33]
    drafts = []
    for head in (ours, theirs):
        target = CachedModel(model)
        target.keep_hidden()
        target.extend(ids)
        drafts.append(EagleDrafter(target, head, branch=3).propose(ids, 4, GreedyProcessor(), None))
    assert drafts[0].tokens and drafts[0].tokens == drafts[1].tokens and drafts[0].parents == drafts[1].parents


@pytest.mark.parametrize("layout, architecture", [("vllm", "LlamaForCausalLM"), ("sglang", "Qwen2ForCausalLMEagle")])
def test_a_qwen_style_head_keeps_its_qkv_biases(tmp_path, layout, architecture):
    model = tiny_model(dtype=torch.float32)
    config = HeadConfig(**{**eagle_config(model.config, 48).__dict__, "attention_bias": True})
    save_head(tmp_path / "ours", config, build(config), None, {}, dtype=torch.float32)
    write_eagle(tmp_path / "ours", tmp_path / "layout", model.config, layout)
    written = json.loads((tmp_path / "layout" / "config.json").read_text())
    assert written["qkv_bias"] is True and written["architectures"] == [architecture]
    assert "layers.0.self_attn.q_proj.bias" in load_file(str(tmp_path / "layout" / "model.safetensors"))
    assert load_head(tmp_path / "layout", model).config.attention_bias


def test_the_sglang_layout_names_sglangs_eagle_class_and_keeps_the_draft_vocabulary(our_eagle, tmp_path):
    notes = write_eagle(our_eagle, tmp_path / "layout", tiny_model().config, "sglang")
    assert json.loads((tmp_path / "layout" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert set(load_file(str(tmp_path / "layout" / "model.safetensors"))) == VLLM_EAGLE_WEIGHTS
    token_map = torch.load(tmp_path / "layout" / "token_map.pt", weights_only=True)  # as SGLang reads it
    assert token_map.tolist() == list(range(90)) and any("own 90 tokens" in note for note in notes)
    write_eagle(our_eagle, tmp_path / "layout", tiny_model().config, "vllm")  # vLLM's has no place for it
    assert not (tmp_path / "layout" / "token_map.pt").exists()


def test_train_head_exports_an_eagle_head_and_refuses_a_medusa_one(pair_dirs, our_eagle, tmp_path, capsys):
    target = str(pair_dirs[0])
    assert train_head.main(["--target", target, "--out", str(our_eagle), "--export-eagle",
                            str(tmp_path / "layout"), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["eagle"] == str(tmp_path / "layout")
    assert (tmp_path / "layout" / "config.json").is_file()
    medusa = tmp_path / "medusa"
    save_head(medusa, HeadConfig("medusa", 32, num_heads=2), build(HeadConfig("medusa", 32, num_heads=2)), None, {})
    assert train_head.main(["--target", target, "--out", str(medusa), "--export-eagle", str(tmp_path / "m"),
                            "--no-progress"]) == train_head.FAILED_EXIT
    err = capsys.readouterr().err
    assert "only an eagle head has an EAGLE layout" in err and err.count("\n") == 1


def test_infer_export_prints_the_command_and_writes_it(pair_dirs, tmp_path, capsys):
    target, drafter = map(str, pair_dirs)
    script = tmp_path / "serve.sh"
    argv = ["--target", target, "--drafter", drafter, "--strategy", "speculative", "--gamma", "4",
            "--cache-dir", str(tmp_path / "cache")]
    assert infer.main([*argv, "--export", "sglang", str(script)]) == 0
    out = capsys.readouterr()
    command = out.out.strip().splitlines()[0]
    options = flags(shlex.split(command))
    assert options["--model-path"] == target and options["--speculative-draft-model-path"] == drafter
    assert options["--speculative-num-steps"] == "4" and "gamma" not in out.err  # given, so not the default's note
    assert script.read_text().rstrip().endswith(command) and script.stat().st_mode & 0o100
    assert infer.main([*argv, "--export", "sglang", str(script)]) == infer.USAGE_EXIT  # an existing file is kept
    assert "exists" in capsys.readouterr().err
    assert infer.main([*argv, "--export", "tgi"]) == infer.USAGE_EXIT
    assert "--export takes an engine (vllm, sglang, llamacpp)" in capsys.readouterr().err


def test_chat_export_command_prints_and_writes(pair_dirs, tmp_path):
    import io

    from rich.console import Console

    from app.engine import Engine
    from chat.commands import dispatch
    from chat.repl import ChatRepl
    from chat.session import ChatSession, ChatSettings, ModelInfo
    from models.loading import load_pair

    pair = load_pair(*map(str, pair_dirs), device="cpu", dtype="float32", progress=False)
    session = ChatSession(Engine.from_pair(pair), ChatSettings(strategies=("lookup", "speculative"), max_new_tokens=4))
    console = Console(file=io.StringIO(), width=400, color_system=None)
    info = ModelInfo("target", "drafter", "float32", "cpu", target_spec=str(pair_dirs[0]),
                     drafter_spec=str(pair_dirs[1]), cache_dir=tmp_path / "cache")
    app = ChatRepl(session, console, info)
    dispatch(app, "/gamma 3")
    console.file.truncate(0)
    console.file.seek(0)
    dispatch(app, f"/export vllm {tmp_path / 'serve.sh'}")
    text = console.file.getvalue()
    config = json.loads(shlex.split(text.splitlines()[0])[-1])
    assert config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert (tmp_path / "serve.sh").is_file() and f"wrote {tmp_path / 'serve.sh'}" in text
    console.file.truncate(0)
    console.file.seek(0)
    dispatch(app, "/export tgi")
    assert "expected an engine: vllm, sglang, llamacpp" in console.file.getvalue()


def test_infer_export_writes_the_head_in_the_layout_each_engine_loads(pair_dirs, our_eagle, tmp_path, capsys):
    argv = ["--target", str(pair_dirs[0]), "--head", str(our_eagle), "--strategy", "eagle", "--cache-dir",
            str(tmp_path)]
    assert infer.main([*argv, "--export", "sglang"]) == 0
    options = flags(shlex.split(capsys.readouterr().out.strip()))
    layout = Path(options["--speculative-draft-model-path"])
    assert json.loads((layout / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert options["--speculative-token-map"] == str(layout / "token_map.pt")
    assert infer.main([*argv, "--export", "vllm"]) == 0
    config = json.loads(shlex.split(capsys.readouterr().out.strip())[-1])
    assert config["method"] == "eagle" and config["model"] != str(layout)
    assert json.loads((Path(config["model"]) / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


# Names a path may have that a shell would read as more than a word: a newline and a command, substitutions, quotes,
# spaces, an escape sequence, a carriage return, bytes that are not UTF-8 (os.fsdecode's surrogate escapes).
HOSTILE = ["m\ntouch PWNED\n#", "$(touch PWNED)", "`touch PWNED`", "it's \"quoted\"; touch PWNED", "a b  c",
           "\x1b[31mred\r", "bytes \udcff\udcfe"]


def fake_engines(tmp_path: Path) -> dict[str, str]:
    """An environment whose vllm, python and llama-server write their argv (NUL-separated) to argv.bin instead."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("vllm", "python", "llama-server"):
        (bin_dir / name).write_text(f"#!/bin/sh\nprintf '%s\\0' \"$0\" \"$@\" > '{tmp_path / 'argv.bin'}'\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}


def run_script(script: Path, tmp_path: Path) -> list[bytes]:
    """`sh script` in tmp_path with the fake engines: the argv the engine got, its own name dropped."""
    import subprocess

    subprocess.run(["sh", str(script)], cwd=tmp_path, env=fake_engines(tmp_path), check=True, timeout=60)
    return (tmp_path / "argv.bin").read_bytes().split(b"\0")[1:-1]


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("engine", ENGINES)
def test_a_script_runs_exactly_its_command_whatever_the_paths_hold(tmp_path, engine, name):
    """Bug: a note naming a path with a newline ended its comment line: `sh s.sh` ran what followed."""
    import os

    folder = f"/models/{name}"
    serving = Serving(folder, None, f"{folder}-drafter", None)  # no GGUF: the notes name the folders
    result = export(engine, serving, ("speculative",), SETTINGS)
    script = tmp_path / "serve.sh"
    script.write_text(result.script(), encoding="utf-8")
    lines = result.script().split("\n")
    exec_line = next(i for i, line in enumerate(lines) if line.startswith("exec "))
    assert lines[0] == "#!/bin/sh" and all(line.startswith("# ") and line.isprintable() for line in lines[1:exec_line])
    assert engine != "llamacpp" or any(printable(folder) in line for line in lines[1:exec_line])
    assert run_script(script, tmp_path) == [os.fsencode(word) for word in result.argv[1:]]
    assert not (tmp_path / "PWNED").exists()


def test_infer_export_of_a_folder_named_with_a_command_writes_a_script_that_runs_none(pair_dirs, tmp_path, capsys):
    """Bug: a saved model folder named `m<newline>touch PWNED<newline>#`, exported for llama.cpp (it has no GGUF, so a
    note names the folder): `sh s.sh` ran the touch."""
    import shutil

    folder = tmp_path / "m\ntouch PWNED\n#"
    shutil.copytree(pair_dirs[0], folder)
    script = tmp_path / "s.sh"
    argv = ["--target", str(folder), "--drafter", "none", "--strategy", "lookup", "--gamma", "3", "--cache-dir",
            str(tmp_path / "cache"), "--export", "llamacpp", str(script)]
    assert infer.main(argv) == 0
    err = capsys.readouterr().err
    assert "touch PWNED\n" not in err and "wrote" in err
    argv_seen = run_script(script, tmp_path)
    assert argv_seen[:2] == [b"-m", b"m\ntouch PWNED\n#.gguf"] and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("file, message", [
    ("missing/x.sh", "--export: the folder {tmp}/missing does not exist; make it or give another path"),
    ("a-file/x.sh", "--export: {tmp}/a-file/x.sh lies under the file {tmp}/a-file; give a path in a folder"),
    ("dangling.sh", "--export: {tmp}/dangling.sh exists; give a new file name"),
    ("bad\nname/x.sh", "--export: the folder {tmp}/bad\\nname does not exist"),
])
def test_an_export_file_that_cannot_be_written_is_refused_in_one_line_before_loading(tmp_path, capsys, monkeypatch,
                                                                                       file, message):
    """Bug: these ended in a FileNotFoundError, NotADirectoryError or (a dangling symlink) FileExistsError traceback
    after the models' configs were read."""
    from app.engine import Engine

    monkeypatch.setattr(Engine, "load", None)  # nothing may load
    (tmp_path / "a-file").write_text("")
    (tmp_path / "dangling.sh").symlink_to(tmp_path / "nowhere")
    argv = ["--target", str(tmp_path / "no-model"), "--export", "vllm", str(tmp_path / file)]
    assert infer.main(argv) == infer.USAGE_EXIT
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("infer.py: error: " + message.format(tmp=tmp_path))
    assert not (tmp_path / "nowhere").exists()


def test_a_folder_that_refuses_the_script_is_said_in_one_line(pair_dirs, tmp_path, capsys):
    """Bug: a read-only folder gave a PermissionError traceback. Where the process may write anywhere (root), a file
    system that refuses the write stands in for it."""
    import os

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    refused = folder if not os.access(folder, os.W_OK) else Path("/sys")  # sysfs refuses new files, even to root
    if not refused.is_dir():
        pytest.skip("no folder here refuses a new file")
    argv = ["--target", str(pair_dirs[0]), "--drafter", "none", "--strategy", "lookup", "--cache-dir",
            str(tmp_path / "cache"), "--export", "vllm", str(refused / "x.sh")]
    assert infer.main(argv) == infer.USAGE_EXIT
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("infer.py: error: --export")
    assert "not writable" in captured.err or "Permission denied" in captured.err
    assert not (refused / "x.sh").exists()


def test_an_export_never_carries_a_gamma_past_the_bound(pair_dirs, tmp_path, capsys):
    """Bug: `--gamma 100000 --export vllm` (and `/gamma 100000`, then `/export`) wrote `num_speculative_tokens 100000`.
    The settings refuse it, so the highest gamma an export can carry is the bound."""
    config = check_vllm(export("vllm", SERVING, ("speculative",), StrategySettings(gamma=64)).argv)
    assert config["num_speculative_tokens"] == 64
    script = tmp_path / "serve.sh"
    argv = ["--target", str(pair_dirs[0]), "--drafter", "none", "--strategy", "lookup", "--gamma", "100000",
            "--cache-dir", str(tmp_path / "cache"), "--export", "vllm", str(script)]
    assert infer.main(argv) == infer.USAGE_EXIT
    captured = capsys.readouterr()
    assert captured.out == "" and "--gamma must be an integer from 1 to 64, got 100000" in captured.err
    assert not script.exists()


def test_chat_export_after_a_refused_gamma_carries_the_last_good_one(pair_dirs, tmp_path):
    import io

    from rich.console import Console

    from app.engine import Engine
    from chat.commands import dispatch
    from chat.repl import ChatRepl
    from chat.session import ChatSession, ChatSettings, ModelInfo
    from models.loading import load_pair

    pair = load_pair(*map(str, pair_dirs), device="cpu", dtype="float32", progress=False)
    session = ChatSession(Engine.from_pair(pair), ChatSettings(strategies=("lookup",), max_new_tokens=4))
    console = Console(file=io.StringIO(), width=400, color_system=None)
    info = ModelInfo("target", "drafter", "float32", "cpu", target_spec=str(pair_dirs[0]),
                     drafter_spec=str(pair_dirs[1]), cache_dir=tmp_path / "cache")
    app = ChatRepl(session, console, info)
    dispatch(app, "/gamma 7")
    dispatch(app, "/gamma 100000")
    assert "gamma must be an integer from 1 to 64, got 100000" in console.file.getvalue()
    console.file.truncate(0)
    console.file.seek(0)
    dispatch(app, "/export vllm")
    config = json.loads(shlex.split(console.file.getvalue().splitlines()[0])[-1])
    assert config["num_speculative_tokens"] == 7
