"""train_head.py's run directory on a tiny target: what OUT holds is never lost (refused without --resume or
--overwrite, resumed by the prompts answered, checkpointed at a Ctrl-C, written whole, damaged files made again,
locked), bad input refused before loading, and the time budget bounding the whole run."""

from __future__ import annotations

import json
import time

import pytest
import torch

import kernels
import train_head
import training.data as training_data
import training.learning as training_learning
from tests.helpers import q4k_gguf, save_tiny_checkpoint
from utils.files import exclusive, write_atomically


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("train_head") / "target")


def prompt_file(path, count: int):
    """`count` prompts, `turns` only: the help names no `category`, so none is needed."""
    path.write_text("\n".join(json.dumps({"turns": [f"question {i}: the fox"]}) for i in range(count)) + "\n")
    return path


def argv(target, out, prompts, *more: str) -> list[str]:
    return ["--target", str(target), "--kind", "medusa", "--out", str(out), "--prompts", str(prompts),
            "--max-new-tokens", "6", "--epochs", "2", "--time-budget", "5", "--no-progress", *more]


def training(out) -> dict:
    return json.loads((out / "head.json").read_text())["training"]


def recorded_prompts(out) -> list[str]:
    return sorted(row["prompt"] for file in (out / "data").glob("batch-*.pt")
                  for row in torch.load(file, weights_only=True))


def interrupt_on_call(monkeypatch, module, name: str, call: int) -> None:
    """`module.name` raises KeyboardInterrupt (a Ctrl-C) on its `call`-th call, as if the user pressed it then."""
    real, calls = getattr(module, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, interrupted)


def test_a_non_empty_out_is_refused_before_anything_is_touched(tmp_path, capsys):
    """Bug: without --resume, an OUT holding 46 minutes of answers lost them all first (and the run then failed)."""
    out = tmp_path / "head"
    (out / "data").mkdir(parents=True)
    (out / "data" / "batch-0000.pt").write_bytes(b"answers")
    (out / "checkpoint.pt").write_bytes(b"checkpoint")
    missing_target = tmp_path / "no-model"  # refused before loading: a load would fail with exit 1
    assert train_head.main(argv(missing_target, out, prompt_file(tmp_path / "p.jsonl", 4), "--time-budget",
                                "0.01")) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {out} is not empty (checkpoint.pt, data): pass --resume to continue from it, --overwrite "
                   "to start it over, or choose another --out\n")
    assert (out / "data" / "batch-0000.pt").read_bytes() == b"answers"
    assert (out / "checkpoint.pt").read_bytes() == b"checkpoint"


def test_overwrite_starts_a_non_empty_out_over(target, tmp_path, capsys):
    out = tmp_path / "head"
    (out / "data").mkdir(parents=True)
    (out / "data" / "batch-0000.pt").write_bytes(b"old answers")
    (out / "notes.txt").write_text("mine")
    assert train_head.main(argv(target, out, prompt_file(tmp_path / "p.jsonl", 4), "--overwrite")) == 0
    assert "damaged" not in capsys.readouterr().err  # the old batch was removed, not read
    assert training(out)["answers"] == 4 and recorded_prompts(out) == [f"question {i}: the fox" for i in range(4)]
    assert (out / "notes.txt").read_text() == "mine"  # only what train_head.py writes is removed
    with pytest.raises(SystemExit):
        train_head.parse_args(argv(target, out, tmp_path / "p.jsonl", "--overwrite", "--resume"))


def test_a_resume_with_another_batch_size_answers_every_prompt_once(target, tmp_path, monkeypatch, capsys):
    """Bug: the resume point was files x batch: a --batch 2 run stopped after 3 files and resumed with --batch 4
    started at prompt 12, never answering 6-11."""
    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 10)
    interrupt_on_call(monkeypatch, training_data, "_answer", 4)
    assert train_head.main(argv(target, out, prompts, "--batch", "2")) == train_head.INTERRUPTED_EXIT
    assert capsys.readouterr().err.startswith("interrupted: ")
    assert len(recorded_prompts(out)) == 6
    monkeypatch.undo()
    assert train_head.main(argv(target, out, prompts, "--batch", "4", "--resume")) == 0
    assert recorded_prompts(out) == sorted(f"question {i}: the fox" for i in range(10))
    assert training(out)["answers"] == 10


def test_ctrl_c_during_training_checkpoints_there_and_resume_goes_on_from_it(target, tmp_path, monkeypatch, capsys):
    """Bug: a Ctrl-C while training printed a KeyboardInterrupt traceback and lost every step since the last epoch's
    end."""
    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 6)  # 1 held out, 5 trained on: 10 steps
    interrupt_on_call(monkeypatch, training_learning, "losses", 7)
    assert train_head.main(argv(target, out, prompts)) == train_head.INTERRUPTED_EXIT
    assert "interrupted" in capsys.readouterr().err
    state = torch.load(out / "checkpoint.pt", weights_only=True)["state"]
    assert (state["epoch"], state["step"]) == (1, 6)
    monkeypatch.undo()
    assert train_head.main(argv(target, out, prompts, "--resume")) == 0
    assert (training(out)["steps"], training(out)["epochs"]) == (10, 2)


def test_damaged_answers_and_checkpoint_are_named_and_made_again(target, tmp_path, capsys):
    """Bug: a batch or checkpoint cut short by an interrupted save made --resume crash (OSError, ValueError)."""
    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 6)
    assert train_head.main(argv(target, out, prompts, "--batch", "2")) == 0
    batch = out / "data" / "batch-0001.pt"
    batch.write_bytes(batch.read_bytes()[:100])
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert train_head.main(argv(target, out, prompts, "--batch", "2", "--resume")) == 0
    err = capsys.readouterr().err
    assert f"warning: {batch} is damaged (" in err and "its prompts are answered again" in err
    assert f"warning: {out / 'checkpoint.pt'} cannot be continued (" in err and "training starts over" in err
    assert training(out)["answers"] == 6 and training(out)["epochs"] == 2
    assert sorted(p.name for p in (out / "data").iterdir()) == ["batch-0000.pt", "batch-0001.pt", "batch-0002.pt",
                                                                 "batch-0003.pt"]  # no temporary file left
    assert sorted(p.name for p in out.iterdir()) == ["answers.jsonl.gz", "checkpoint.pt", "data", "head.json",
                                                    "head.safetensors"]


def test_a_write_cut_short_leaves_the_old_file(tmp_path):
    path = tmp_path / "batch-0000.pt"
    path.write_bytes(b"whole")

    def cut_short(temporary):
        temporary.write_bytes(b"par")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, cut_short)
    assert path.read_bytes() == b"whole" and [p.name for p in tmp_path.iterdir()] == ["batch-0000.pt"]


def test_a_second_run_on_one_out_is_refused_while_the_first_holds_it(target, tmp_path, capsys):
    """Bug: two runs on one --out both went on, writing the same files, and both reported success."""
    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 4)
    out.mkdir()
    with exclusive(out, wait=False):  # what a running train_head.py holds
        assert train_head.main(argv(target, out, prompts)) == 2
    assert capsys.readouterr().err == (f"error: another train_head.py run is using {out}: wait for it to end, or "
                                       "choose another --out\n")
    assert list(out.iterdir()) == []
    assert train_head.main(argv(target, out, prompts)) == 0  # released: the next run goes on


def test_the_time_budget_bounds_the_whole_run(target, tmp_path):
    """Bug: --time-budget 1 ran 2 min 26 s on the tiny models: a batch of answers and the held-out evaluation ran past
    it."""
    prompts = prompt_file(tmp_path / "p.jsonl", 40)
    started = time.monotonic()
    assert train_head.main(argv(target, tmp_path / "head", prompts, "--kind", "eagle", "--intermediate", "64",
                                "--time-budget", "0.1", "--max-new-tokens", "400", "--batch", "8", "--epochs", "1000",
                                "--held-out", "0.3")) == 0
    assert time.monotonic() - started < 6 + 3  # the budget, and a margin for saving and a loaded machine (was 43 s)


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
def test_a_gguf_target_answers_on_its_own_blocks_unless_told_otherwise(tmp_path, monkeypatch):
    """The data comes from the target the chat runs: a GGUF-backed target on the GGUF's blocks (the kernels);
    --target-quantize none makes it from the dense weights."""
    gguf_path, _ = q4k_gguf(tmp_path, monkeypatch)
    prompts = prompt_file(tmp_path / "p.jsonl", 4)
    for quantize, expected in (("gguf", "Q4_K blocks"), ("none", "float32")):
        out = tmp_path / f"head-{quantize}"
        assert train_head.main(argv(gguf_path, out, prompts, "--kind", "eagle", "--intermediate", "64",
                                    "--target-quantize", quantize, "--held-out", "0")) == 0
        assert expected in training(out)["target_format"] and training(out)["answers"] == 4


@pytest.mark.parametrize("lines, flag, message", [
    ("", "--prompts", "no prompts in "),
    ('["an", "array"]\n', "--prompts", "p.jsonl:1: not a JSON object"),
    (None, "--prompts", "no prompt file at"),
    ("", "--out", "is a file, not a directory"),
    ("", "--out-under", "lies under the file"),
])
def test_bad_input_is_refused_in_one_line_before_loading(tmp_path, capsys, lines, flag, message):
    """Bug: an empty prompt file said "the budget left fewer than 2 answers"; a line that is an array, or an --out
    that is a file, ended in a traceback after the target loaded."""
    prompts = tmp_path / "p.jsonl"
    if lines is not None:
        prompts.write_text(lines)
    out = tmp_path / "head"
    if flag.startswith("--out"):
        prompt_file(prompts, 2)
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / ("head" if flag == "--out-under" else "")
    assert train_head.main(argv(tmp_path / "no-model", out, prompts)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_answers_made_together_are_each_prompts_own_with_its_hidden_states_and_finished_rows_leave_the_batch():
    """The batched answer loop (left padding, rows leaving the batch as they end) against each prompt answered alone
    by full forwards: the same greedy tokens, and the last hidden state at every position but the last."""
    from tests.helpers import tiny_model

    model = tiny_model(dtype=torch.float64, pad_token_id=0)
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]]
    free = training_data._answer(model, rows, 0, set(), 8, 1e9)
    end = int(free[0]["ids"][len(rows[0]) + 1])  # row 0's second token ends it: rows leave at different steps
    sizes = []
    hook = model.model.register_forward_pre_hook(lambda _, args, kwargs: sizes.append(len(kwargs["input_ids"])),
                                                 with_kwargs=True)
    answers = training_data._answer(model, rows, 0, {end}, 8, 1e9)
    hook.remove()
    for prompt, made in zip(rows, answers, strict=True):
        ids = list(prompt)
        with torch.inference_mode():
            while len(ids) - len(prompt) < 8 and (len(ids) == len(prompt) or ids[-1] != end):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            hidden = model.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
        assert made["ids"].tolist() == ids and made["start"] == len(prompt)
        torch.testing.assert_close(made["features"], hidden.to(torch.float16))
    assert sizes[0] == len(rows) and sizes[-1] < len(rows) and sizes == sorted(sizes, reverse=True)
    assert len(answers[0]["ids"]) == len(rows[0]) + 2


def test_a_runs_answers_are_kept_as_token_ids_and_a_later_run_trains_on_them_without_asking_again(target, tmp_path,
                                                                                                  monkeypatch):
    """OUT/answers.jsonl.gz holds every answer a run trained on (its features take a GB on the real target, its ids a
    few hundred KB): `--answers` in another run makes their features again by one forward each, the same up to
    rounding, and answers only the prompts they do not cover."""
    import gzip

    first, prompts = tmp_path / "first", prompt_file(tmp_path / "p.jsonl", 6)
    assert train_head.main(argv(target, first, prompts, "--kind", "eagle", "--intermediate", "64")) == 0
    made = {row["prompt"]: row for file in sorted((first / "data").glob("batch-*.pt"))
            for row in torch.load(file, weights_only=True)}
    with gzip.open(first / "answers.jsonl.gz", "rt") as file:
        kept = [json.loads(line) for line in file]
    assert sorted(row["prompt"] for row in kept) == sorted(made)
    for row in kept:
        assert row["ids"] == made[row["prompt"]]["ids"].tolist() and row["start"] == made[row["prompt"]]["start"]

    asked = []
    real = training_data._answer
    monkeypatch.setattr(training_data, "_answer", lambda model, rows, *rest: asked.extend(rows) or real(model, rows,
                                                                                                         *rest))
    second, more = tmp_path / "second", prompt_file(tmp_path / "more.jsonl", 8)  # prompts 6 and 7 are new
    assert train_head.main(argv(target, second, more, "--kind", "eagle", "--intermediate", "64", "--answers",
                                str(first / "answers.jsonl.gz"))) == 0
    assert len(asked) == 2 and training(second)["answers"] == 8
    again = {row["prompt"]: row for file in (second / "data").glob("batch-*.pt")
             for row in torch.load(file, weights_only=True)}
    for prompt, row in made.items():
        assert torch.equal(again[prompt]["ids"], row["ids"]) and again[prompt]["start"] == row["start"]
        torch.testing.assert_close(again[prompt]["features"], row["features"], rtol=2e-3, atol=2e-3)
    with gzip.open(second / "answers.jsonl.gz", "rt") as file:
        assert len(file.readlines()) == 8  # the reused answers and the new ones: the next run reads them all


@pytest.mark.parametrize("content, message", [
    (None, "no answers file at"),
    (b"not gzip", "not a gzipped answers file"),
    (b"", "answers.jsonl.gz: no answers in it (an empty file)"),  # was taken silently as none
    ("\n\n", "answers.jsonl.gz: no answers in it (blank lines only)"),
    ('{"prompt": "q", "start": 1, "ids": [1, 2]}\nnot json\n', "answers.jsonl.gz:2: not JSON"),
    ('{"prompt": "q", "start": 2, "ids": [1, 2]}\n', 'answers.jsonl.gz:1: not an answer: "start" must be'),
    ('{"prompt": "q", "start": 1, "ids": [1, -2]}\n', 'answers.jsonl.gz:1: not an answer: "ids" holds -2'),
    ('\n{"prompt": "q", "start": 1, "ids": [1, 9223372036854775808]}\n',  # was "Overflow when unpacking long long"
     'answers.jsonl.gz:2: not an answer: "ids" holds 9223372036854775808: a token id is an integer from 0 to 2^63'),
    ('{"prompt": "q", "start": 1, "ids": [1, 2.0]}\n', 'answers.jsonl.gz:1: not an answer: "ids" holds 2.0'),
    ('{"prompt": "q", "start": 1, "ids": [1, null]}\n', 'answers.jsonl.gz:1: not an answer: "ids" holds null'),
    ('{"prompt": "q", "start": 1, "ids": [1]}\n', 'answers.jsonl.gz:1: not an answer: "ids" must be a list'),
    ('[1, 2]\n', "answers.jsonl.gz:1: not an answer: a JSON object"),
    ('{"prompt": 3, "start": 1, "ids": [1, 2]}\n', 'answers.jsonl.gz:1: not an answer: "prompt" must be text'),
])
def test_a_bad_answers_file_is_refused_in_one_line_before_loading(tmp_path, capsys, content, message):
    import gzip

    answers = tmp_path / "answers.jsonl.gz"
    if isinstance(content, bytes):
        answers.write_bytes(content)
    elif content is not None:
        with gzip.open(answers, "wt") as file:
            file.write(content)
    assert train_head.main(argv(tmp_path / "no-model", tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 2),
                                "--answers", str(answers))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and str(answers) in err and len(err.splitlines()) == 1, err


def test_blank_lines_in_an_answers_file_are_skipped(tmp_path):
    """Bug: a blank line (an editor's last newline, two files joined) was refused as "not JSON"."""
    import gzip

    answers = tmp_path / "answers.jsonl.gz"
    with gzip.open(answers, "wt") as file:
        file.write('\n{"prompt": "q", "start": 1, "ids": [1, 2]}\n\n  \n{"start": 2, "ids": [3, 4, 5]}\n\n')
    rows = training_data.read_answers([answers])
    assert [(row["ids"].tolist(), row["start"], row.get("prompt")) for row in rows] == [([1, 2], 1, "q"),
                                                                                      ([3, 4, 5], 2, None)]


def kept_answers(out) -> list[dict]:
    import gzip

    with gzip.open(out / "answers.jsonl.gz", "rt") as file:
        return sorted((json.loads(line) for line in file), key=lambda row: row["prompt"])


def test_a_resume_whose_data_was_removed_keeps_the_answers_file_and_makes_their_features_again(target, tmp_path,
                                                                                               monkeypatch, capsys):
    """Bug: `--resume` after `rm -r OUT/data` said "the budget left 0 answers" and rewrote OUT/answers.jsonl.gz from
    the empty OUT/data before that check: 12 answers became 0."""
    import shutil

    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 6)
    assert train_head.main(argv(target, out, prompts, "--kind", "eagle", "--intermediate", "64")) == 0
    kept = kept_answers(out)
    written = (out / "answers.jsonl.gz").read_bytes()
    assert len(kept) == 6
    shutil.rmtree(out / "data")
    capsys.readouterr()
    assert train_head.main(argv(target, out, prompts, "--kind", "eagle", "--intermediate", "64", "--resume",
                                "--time-budget", "0.00001")) == train_head.FAILED_EXIT  # no time to make any again
    assert "the budget left 0 answers" in capsys.readouterr().err
    assert (out / "answers.jsonl.gz").read_bytes() == written  # not touched

    asked = []
    real = training_data._answer
    monkeypatch.setattr(training_data, "_answer", lambda model, rows, *rest: asked.extend(rows) or real(model, rows,
                                                                                                         *rest))
    shutil.rmtree(out / "data", ignore_errors=True)
    assert train_head.main(argv(target, out, prompts, "--kind", "eagle", "--intermediate", "64", "--resume")) == 0
    assert asked == []  # the kept answers' features made again, no prompt asked again
    assert training(out)["answers"] == 6 and kept_answers(out) == kept
    assert recorded_prompts(out) == sorted(row["prompt"] for row in kept)


def test_the_answers_file_never_loses_what_it_kept(target, tmp_path, monkeypatch):
    """A resume that trains on fewer answers than OUT kept (the budget spent before their features were all made
    again) writes every kept answer back, those it did not reach included."""
    import shutil

    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 6)
    assert train_head.main(argv(target, out, prompts, "--kind", "eagle", "--intermediate", "64")) == 0
    kept = kept_answers(out)
    shutil.rmtree(out / "data")
    real = train_head.make_data
    monkeypatch.setattr(train_head, "make_data", lambda *args: real(*args)[:4])  # the budget spent after 4
    assert train_head.main(argv(target, out, prompts, "--kind", "eagle", "--intermediate", "64", "--resume")) == 0
    assert training(out)["answers"] == 4 and kept_answers(out) == kept


def test_a_damaged_answers_file_is_moved_aside_on_a_resume_and_written_again(target, tmp_path, capsys):
    import gzip

    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 4)
    assert train_head.main(argv(target, out, prompts)) == 0
    kept = kept_answers(out)
    with gzip.open(out / "answers.jsonl.gz", "wt") as file:
        file.write(json.dumps(kept[0]) + "\nnot json\n")
    damaged = (out / "answers.jsonl.gz").read_bytes()
    capsys.readouterr()
    assert train_head.main(argv(target, out, prompts, "--resume")) == 0
    assert f"warning: {out / 'answers.jsonl.gz'}:2: not JSON (" in capsys.readouterr().err
    assert (out / "answers.jsonl.gz.damaged").read_bytes() == damaged and kept_answers(out) == kept


@pytest.mark.parametrize("held", ["config.json", "model.safetensors", "token_map.pt"])
def test_export_eagle_refuses_to_replace_a_heads_files_without_force(target, tmp_path, capsys, held):
    """Bug: --export-eagle DIR replaced another head's config.json and model.safetensors in DIR without a word."""
    from sampling.heads.networks import build, eagle_config, save_head
    from tests.helpers import tiny_model

    config = eagle_config(tiny_model().config, 48)
    ours = tmp_path / "ours"
    save_head(ours, config, build(config), None, {})
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / held).write_text("another head's")
    export = ["--target", str(target), "--out", str(ours), "--export-eagle", str(layout), "--no-progress"]
    assert train_head.main(export) == train_head.USAGE_EXIT
    assert capsys.readouterr().err == (f"error: --export-eagle: {layout} already holds {held}: pass --force to "
                                       "replace it, or give another directory\n")
    assert [p.name for p in layout.iterdir()] == [held] and (layout / held).read_text() == "another head's"
    assert train_head.main([*export, "--force"]) == 0
    assert json.loads((layout / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(SystemExit):
        train_head.parse_args(argv(target, tmp_path / "head", tmp_path / "p.jsonl", "--force"))


def test_answers_of_another_tokenizer_are_refused_once_the_target_is_loaded(target, tmp_path, capsys):
    import gzip

    answers = tmp_path / "answers.jsonl.gz"
    with gzip.open(answers, "wt") as file:
        file.write(json.dumps({"prompt": "q", "start": 1, "ids": [1, 10**6]}) + "\n")
    out = tmp_path / "head"
    assert train_head.main(argv(target, out, prompt_file(tmp_path / "p.jsonl", 2), "--answers", str(answers))) == 1
    assert "--answers hold token id 1000000, past the target's" in capsys.readouterr().err
    assert not (out / "data").exists()  # refused before any answer was made


def test_init_trains_on_from_a_heads_weights_and_draft_vocabulary(target, tmp_path, monkeypatch, capsys):
    """A run that adds answers goes on from the head before (`--init`): training starts from its weights, keeps its
    shape and draft vocabulary, and head.json says so; a head of another kind is refused before any answer."""
    from safetensors.torch import load_file

    first, prompts = tmp_path / "first", prompt_file(tmp_path / "p.jsonl", 4)
    assert train_head.main(argv(target, first, prompts, "--kind", "eagle", "--intermediate", "48",
                                "--draft-vocab", "20")) == 0
    before = load_file(str(first / "head.safetensors"))
    started = {}
    real = training_learning.train

    def spy(head, module, *rest):
        started.update({name: value.detach().clone() for name, value in module.state_dict().items()})
        return real(head, module, *rest)

    monkeypatch.setattr(train_head, "train", spy)
    second = tmp_path / "second"
    assert train_head.main(argv(target, second, prompt_file(tmp_path / "more.jsonl", 6), "--kind", "eagle",
                                "--init", str(first), "--draft-vocab", "30")) == 0
    vocab = before.pop("draft_vocab")
    assert started.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(started[name], value.float()), name
    after = load_file(str(second / "head.safetensors"))
    assert torch.equal(after["draft_vocab"], vocab)  # the head's own, not a new one of 30
    assert after["layers.0.mlp.gate_proj.weight"].shape[0] == 48  # its shape, not argv's --intermediate
    assert training(second)["init"] == {"head": str(first), "answers": 4, "answer_tokens": training(first)[
        "answer_tokens"], "steps": training(first)["steps"], "train_seconds": training(first)["train_seconds"]}
    assert not any(torch.equal(after[name].float(), value.float()) for name, value in before.items()
                   if value.is_floating_point() and value.numel() > 1)  # and it trained on

    third = tmp_path / "third"
    assert train_head.main(argv(target, third, prompts, "--init", str(first))) == 1  # argv's --kind medusa
    assert "holds a head of kind eagle, and --kind asks for medusa" in capsys.readouterr().err
    assert not (third / "data").exists()


def test_text_the_target_reads_is_trained_on_kept_with_the_answers_and_never_held_out(target, tmp_path):
    """--read: each piece of a text file becomes an answer to READ_ASKED, its features made by one forward (the same
    as a forward over it gives), kept in answers.jsonl.gz marked "read", trained on and never held out; a later run
    that reads that file back keeps the mark."""
    import gzip

    text = tmp_path / "notes.md"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60)))
    out, prompts = tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 4)
    assert train_head.main(argv(target, out, prompts, "--read", str(text), "--held-out", "0.5")) == 0
    info = training(out)
    pieces = training_data.read_texts([text])
    assert len(pieces) == info["read_pieces"] >= 2 and info["read_tokens"] > 0
    assert info["answers"] == 4 and info["held_out_answers"] == 2  # half of the four answers; no piece held out
    with gzip.open(out / "answers.jsonl.gz", "rt") as file:
        kept = [json.loads(line) for line in file]
    read = [row for row in kept if row.get("read")]
    assert len(read) == len(pieces) and len(kept) == 4 + len(pieces)
    rows = {row["prompt"]: row for file in (out / "data").glob("batch-*.pt") for row in torch.load(file,
                                                                                                 weights_only=True)}
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    for row in read:
        stored = rows[row["prompt"]]
        assert stored["ids"].tolist() == row["ids"] and stored["start"] == row["start"]
        torch.testing.assert_close(stored["features"], training_data._features(model, row["ids"]))
    again = training_data.read_answers([out / "answers.jsonl.gz"])
    assert sum(1 for row in again if row.get("read")) == len(pieces)


def test_read_texts_cuts_at_line_ends_near_the_piece_size(tmp_path):
    text = tmp_path / "a.txt"
    lines = [f"{i:04d} " + "x" * 94 + "\n" for i in range(40)]  # 100 characters a line
    text.write_text("".join(lines))
    pieces = training_data.read_texts([text])
    assert "".join(piece for _, piece in pieces) == "".join(lines)
    assert all(name == "a.txt" and piece.endswith("\n") for name, piece in pieces)
    assert [len(piece) for _, piece in pieces] == [training_data.READ_CHARACTERS] * 2 + [800]


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "--read: no file at"),
    (lambda p: p.write_bytes(b"\xff\xfe\x00x"), "is not UTF-8 text"),
    (lambda p: p.write_bytes(b"ab\x00cd"), "is binary"),
    (lambda p: p.write_text(" \n\n"), "is empty"),
    (lambda p: p.mkdir(), "is a directory"),
])
def test_bad_read_input_is_refused_in_one_line_before_loading(tmp_path, capsys, make, message):
    path = tmp_path / "text"
    make(path)
    assert train_head.main(argv(tmp_path / "no-model", tmp_path / "head", prompt_file(tmp_path / "p.jsonl", 2),
                                "--read", str(path))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --read: ") and message in err and len(err.splitlines()) == 1, err
