"""Kept records (the invariance probe's, the low-bit format choice, the prefetch distance; the timings are in
test_calibration.py): a value of another type or out of its bounds is measured again with one line saying so, never
read as something it does not say."""

from __future__ import annotations

import json

import pytest
from torch import nn

import kernels
from app import calibration
from models import invariance
from models.formats import choice, prefetch
from models.invariance import EXACT, Invariance, TargetPath
from utils.files import checked, key_file, read_record

NOT_EXACT = Invariance(False, TargetPath("sdpa", 1), {"sdpa attention, one-token steps as 1 row": "a verify of 2 "
                                                      "tokens differs from the steps"}, {"down_proj": "exact"}, 0.5)


class Probed:
    """invariance.probe's stand-in: what it found, and how often it was asked."""

    def __init__(self, found: Invariance):
        self.found, self.calls = found, 0

    def __call__(self, target, tell=None) -> Invariance:
        self.calls += 1
        return self.found


@pytest.mark.parametrize("field, value", [
    ("exact", "false"),  # bool("false") is True: the banner claimed greedy identity the probe had not found
    ("exact", 0),
    ("exact", True),  # true, where its own path's verdict says a verify differs
    ("path", {"attention": "sdpa", "step_rows": 3}),
    ("path", {"attention": "flash", "step_rows": 1}),
    ("path", {"attention": "sdpa", "step_rows": "1"}),
    ("path", "sdpa"),
    ("tried", ["exact"]),
    ("layers", {"down_proj": 1}),
    ("seconds", -1.0),
    ("seconds", "0.5"),
])
def test_a_kept_invariance_record_with_a_bad_value_is_probed_again_with_one_line(tmp_path, monkeypatch, capsys,
                                                                                 field, value):
    probed = Probed(NOT_EXACT)
    monkeypatch.setattr(invariance, "probe", probed)
    monkeypatch.setattr(invariance, "apply", lambda target, path: True)
    key = {"target": "tiny", "cpu": "test"}
    assert calibration.probe(tmp_path, None, key) == (NOT_EXACT, True)
    assert calibration.probe(tmp_path, None, key) == (NOT_EXACT, False)  # kept, read back as it was
    assert capsys.readouterr().err == ""
    path = key_file(tmp_path, key, "invariance")
    record = json.loads(path.read_text())
    record["invariance"][field] = value
    path.write_text(json.dumps(record))
    found, probed_now = calibration.probe(tmp_path, None, key)
    assert found == NOT_EXACT and not found.exact and probed_now and probed.calls == 2
    err = capsys.readouterr().err
    assert err.startswith(f"warning: unusable kept invariance record in {path} (") and err.endswith(
        "): probed again\n") and len(err.splitlines()) == 1
    assert json.loads(path.read_text())["invariance"] == NOT_EXACT.as_dict()  # made again


def test_an_exact_record_reads_back_exact():
    exact = Invariance(True, TargetPath("eager", 2), {"sdpa attention, one-token steps as 1 row": "differs",
                                                      "eager attention, one-token steps as 2 rows": EXACT}, {}, 1.0)
    assert Invariance.from_dict(json.loads(json.dumps(exact.as_dict()))) == exact


@pytest.mark.parametrize("kept", ["int8", 4, None, ["q8_0"]])
def test_a_kept_format_choice_out_of_its_choices_is_timed_again_with_one_line(tmp_path, monkeypatch, capsys, kept):
    from transformers import LlamaConfig

    timed = []
    monkeypatch.setattr(choice, "time_formats", lambda layer: timed.append(layer) or {"q8_0": 1.0, "int4": 1.0})
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    assert choice.choose(config, tmp_path) == "q8_0" and choice.choose(config, tmp_path) == "q8_0"
    assert len(timed) == 1  # kept, read back: the key (its shapes, tuples kept as lists) matches
    capsys.readouterr()
    (path,) = (tmp_path / "calibration").glob("*.formats.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "choice": kept}))
    assert choice.choose(config, tmp_path) == "q8_0" and len(timed) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"warning: unusable kept format choice in {path} (choice must be ")
    assert len([line for line in err.splitlines() if line.startswith("warning: ")]) == 1


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
@pytest.mark.parametrize("kept", [-4096, 1 << 30, "4096", 4096.0, True])
def test_a_kept_prefetch_distance_out_of_its_bounds_is_timed_again_with_one_line(tmp_path, capsys, kept):
    seconds = {ahead: 0.5 if ahead == 8192 else 1.0 for ahead in prefetch.CANDIDATES}
    try:
        assert prefetch.tune(nn.Linear(2, 2), tmp_path, least_bytes=0, timer=lambda _: seconds) == 8192
        (path,) = (tmp_path / "calibration").glob("*.prefetch.json")
        path.write_text(json.dumps({**json.loads(path.read_text()), "ahead": kept}))
        capsys.readouterr()
        assert prefetch.tune(nn.Linear(2, 2), tmp_path, least_bytes=0, timer=lambda _: seconds) == 8192
        err = capsys.readouterr().err
        assert err.startswith(f"warning: unusable kept prefetch distance in {path} (ahead must be ")
        assert len([line for line in err.splitlines() if line.startswith("warning: ")]) == 1
        assert json.loads(path.read_text())["ahead"] == 8192
    finally:
        kernels.prefetch(0)


def test_checked_takes_a_value_of_its_type_within_its_bounds_and_names_any_other():
    assert checked("n", 3, int, (1, 5)) == 3 and checked("x", 2, float) == 2.0 and checked("b", False, bool) is False
    assert checked("s", "int4", str, among=("q8_0", "int4")) == "int4"
    for value, kind in ((True, int), (1, bool), ("1", int), (1.5, int), (None, float), (True, float), ({}, list)):
        with pytest.raises(TypeError, match="^v must be "):
            checked("v", value, kind)
    for value, bounds in ((0, (1, 5)), (6, (1, 5)), (float("nan"), (0, 1)), (float("inf"), (0, float("inf")))):
        with pytest.raises(ValueError, match="^v must be from "):
            checked("v", value, float, bounds)
    with pytest.raises(ValueError, match="^v must be one of q8_0, int4, not 'int8'$"):
        checked("v", "int8", str, among=("q8_0", "int4"))


def test_read_record_says_nothing_of_none_or_another_keys_and_names_a_damaged_one(tmp_path):
    path, key = tmp_path / "r.json", {"cpu": "x", "shapes": [(1, 2)]}
    parse = lambda data: checked("n", data["n"], int)  # noqa: E731
    assert read_record(path, key, parse, "thing") == (None, None)
    for text, problem in ((json.dumps({"key": key, "n": 4}), None), (json.dumps({"key": {"cpu": "y"}, "n": 4}), None),
                          ("{not json", "unreadable kept thing in"), (json.dumps({"key": key}), "unusable kept thing"),
                          (json.dumps({"key": key, "n": "4"}), "unusable kept thing")):
        path.write_text(text)
        kept, said = read_record(path, key, parse, "thing")
        if problem is None:
            assert said is None and kept in (4, None)
        else:
            assert kept is None and said.startswith(problem) and str(path) in said and "\n" not in said
    path.write_text(json.dumps({"key": key, "n": 4, "schema": 1}))
    assert read_record(path, key, parse, "thing", schema=2) == (None, None)
    assert read_record(path, key, parse, "thing", schema=1) == (4, None)

