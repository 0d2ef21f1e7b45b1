"""app.calibration: timed forwards kept per machine, and the drafting settings derived from them."""

import json

import pytest
import torch

from app.calibration import (
    Calibration,
    calibrate,
    choose,
    expected_tokens,
    key_file,
    load,
    machine_key,
    measure,
    tune,
)
from sampling.settings import StrategySettings
from utils.runner import CachedModel


def calibration(target_ms: dict[int, float], drafter_ms: float | None = 10.0) -> Calibration:
    return Calibration(key={"k": 1}, target_ms=target_ms, drafter_ms=drafter_ms, context=128, seconds=1.0,
                       date="2026-12-01T00:00:00+00:00")


FLAT_TO_14 = {1: 100.0, 2: 100.0, 4: 100.0, 8: 101.0, 12: 102.0, 14: 103.0, 16: 125.0, 20: 140.0}
LINEAR = {n: 100.0 * n for n in (1, 2, 4, 8, 14, 20)}  # a verify of n tokens costs n steps


def test_verify_cost_interpolates_between_timed_widths_and_extends_past_the_last():
    cal = calibration({1: 100.0, 4: 160.0, 8: 200.0})
    assert cal.verify_cost(1) == 1.0
    assert cal.verify_cost(2) == pytest.approx(1.2)
    assert cal.verify_cost(6) == pytest.approx(1.8)
    assert cal.verify_cost(16) == pytest.approx(4.0)  # 2.0 at 8, linear beyond


def test_a_one_token_step_the_machine_slowed_gives_way_to_the_wider_forwards_timings():
    noisy = calibration({1: 42.0, 2: 32.0, 3: 52.0, 4: 49.0, 6: 47.0, 8: 58.0, 20: 133.0}, drafter_ms=13.0)
    assert noisy.forward_ms == {1: 32.0, 2: 32.0, 3: 47.0, 4: 47.0, 6: 47.0, 8: 58.0, 20: 133.0}
    assert noisy.verify_cost(2) == 1.0 and noisy.draft_cost == pytest.approx(13 / 32)
    widths = sorted(noisy.forward_ms)
    assert all(noisy.verify_cost(a) <= noisy.verify_cost(b) for a, b in zip(widths, widths[1:], strict=False))


def test_a_flat_verify_curve_drafts_long_and_fills_the_flat_width_with_alternatives():
    choice = choose(calibration(FLAT_TO_14, drafter_ms=9.0))
    s = choice.settings
    assert 8 <= s.gamma <= 13
    assert s.verify_width == 14  # 16 tokens cost 25% more: past the slack
    assert s.draft_alternatives == StrategySettings().draft_alternatives
    assert s.draft_cumulative == pytest.approx(0.09 * choice.tokens_per_step, abs=0.01)
    assert len(choice.reasons) == 4 and "c = 0.09" in choice.reasons[1]


def test_a_verify_that_costs_a_step_per_token_drafts_short_and_verifies_a_chain():
    choice = choose(calibration(LINEAR, drafter_ms=10.0))
    s = choice.settings
    assert s.gamma <= 2
    assert s.verify_width == s.gamma + 1 and s.draft_alternatives == 0
    assert "no room for alternatives" in choice.reasons[-1]


def test_a_dearer_drafter_stops_earlier_and_drafts_less():
    cheap, dear = choose(calibration(FLAT_TO_14, 5.0)), choose(calibration(FLAT_TO_14, 40.0))
    assert dear.settings.gamma < cheap.settings.gamma
    assert dear.settings.draft_cumulative > cheap.settings.draft_cumulative


def test_without_a_drafter_the_cumulative_stop_is_left_as_it_was():
    base = StrategySettings(draft_cumulative=0.3)
    choice = choose(calibration(FLAT_TO_14, drafter_ms=None), base)
    assert choice.settings.draft_cumulative == 0.3
    assert choice.settings.num_beams == base.num_beams  # the rest carries over


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0) == pytest.approx(1.0)
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


@pytest.fixture(scope="module")
def tiny_pair():
    from tests.helpers import tiny_model

    return CachedModel(tiny_model(seed=0, dtype=torch.float32)), CachedModel(
        tiny_model(seed=1, layers=1, hidden=16, dtype=torch.float32))


def test_measure_times_every_width_and_leaves_the_caches_empty(tiny_pair):
    target, drafter = tiny_pair
    cal = measure(target, drafter, {"k": 1}, widths=(1, 2, 4), context=16, repeats=1)
    assert sorted(cal.target_ms) == [1, 2, 4] and all(ms > 0 for ms in cal.target_ms.values())
    assert cal.drafter_ms > 0 and cal.context == 16
    assert target.tokens == [] and drafter.tokens == []


def test_calibrate_keeps_the_timings_per_key_and_measures_again_when_asked(tiny_pair, tmp_path, monkeypatch):
    import app.calibration as calibration_module

    target, drafter = tiny_pair
    monkeypatch.setattr(calibration_module, "WIDTHS", (1, 2))
    monkeypatch.setattr(calibration_module, "CONTEXT", 8)
    key = machine_key("tiny", "float32", "tinier", "float32", torch.device("cpu"))
    first, measured, damaged = calibrate(tmp_path, target, drafter, key)
    assert measured and damaged is None and key_file(tmp_path, key).exists()
    again, measured, _ = calibrate(tmp_path, target, drafter, key)
    assert not measured and again == first
    other = {**key, "target_format": "prepacked"}
    _, measured, _ = calibrate(tmp_path, target, drafter, other)
    assert measured and key_file(tmp_path, other) != key_file(tmp_path, key)
    _, measured, _ = calibrate(tmp_path, target, drafter, key, again=True)
    assert measured
    key_file(tmp_path, key).write_text("{not json")  # a damaged file is measured anew, not an error
    _, measured, damaged = calibrate(tmp_path, target, drafter, key)
    assert measured and "unreadable" in damaged


def test_the_machine_key_names_the_cpu_torch_models_formats_and_threads():
    key = machine_key("t", "bfloat16", "d", "int4", torch.device("cpu"))
    assert key["torch"] == torch.__version__ and key["threads"] == torch.get_num_threads()
    assert ((key["target"], key["target_format"], key["drafter"], key["drafter_format"])
            == ("t", "bfloat16", "d", "int4"))
    assert isinstance(key["cpu_flags"], list) and key["hardware"]


@pytest.mark.parametrize("field, value", [
    ("target_ms", {"1": 100.0, "1000000000": 200.0}),  # the settings search walked to it: hung past 120 s
    ("target_ms", {"1": 0, "2": 120.0}),  # ZeroDivisionError
    ("drafter_ms", "abc"),  # TypeError
    ("target_ms", {}),  # KeyError
    ("target_ms", {"1": 100.0}),  # no wider forward: max() of nothing
    ("target_ms", {"1": float("nan"), "2": 120.0}),
    ("target_ms", {"1": 100.0, "-5": 120.0}),
    ("target_ms", {"1": 100.0, "0": 120.0}),
    ("target_ms", {"1": 1e300, "2": 1e300}),  # SettingError from the settings it called for
    ("target_ms", {"1": 1e-300, "2": 1e-300}),
    ("drafter_ms", -5.0),  # was shown: "drafter step -5 ms"
    ("target_ms", [100.0, 120.0]),
])
def test_a_kept_file_with_a_bad_value_is_timed_again_with_one_line_saying_so(tiny_pair, tmp_path, monkeypatch,
                                                                             field, value):
    """Regression: these values crashed or hung every start, even with every drafting setting on the command line."""
    import app.calibration as calibration_module

    target, drafter = tiny_pair
    monkeypatch.setattr(calibration_module, "WIDTHS", (1, 2))
    monkeypatch.setattr(calibration_module, "CONTEXT", 8)
    key = machine_key("tiny", "float32", "tinier", "float32", torch.device("cpu"))
    calibrate(tmp_path, target, drafter, key)
    path = key_file(tmp_path, key)
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    kept, damaged = load(path, key)
    assert kept is None and str(path) in damaged and "timed again" in damaged
    tuning = tune(tmp_path, target, drafter, key, StrategySettings())
    assert tuning.measured and tuning.damaged == damaged
    assert tuning.calibration.drafter_ms > 0 and all(ms > 0 for ms in tuning.calibration.target_ms.values())
