"""The start infer.py and bench.py share (app/startup.py): the probe and the calibration run once per machine and are
read back afterwards, the user's settings stay as given, and each script hears of it in the kinds of line it shows."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
from rich.console import Console

import kernels
from app.calibration import pair_key
from app.flags import hold_torch_to
from app.startup import Prepared, Records, Said, compile_step, probe_and_calibrate, records_for, use_kernels
from chat.app import ChatApp
from chat.commands import Outcome, dispatch
from chat.session import ChatSession, ChatSettings, ModelInfo
from models.loading import load_model
from models.placement import Placement
from models.presets import ModelLoadError
from sampling.settings import StrategySettings
from tests.helpers import load_tiny_pair, save_tiny_checkpoint
from utils.caching import CachedModel


class Recorder:
    """A Report that keeps what it was told."""

    def __init__(self):
        self.statuses: list[str] = []
        self.lines: list[tuple[Said, str]] = []

    def status(self, text: str):
        self.statuses.append(text)
        return contextlib.nullcontext()

    def say(self, text: str, kind: Said) -> None:
        self.lines.append((kind, text))

    def kinds(self, start: str) -> list[Said]:
        return [kind for kind, text in self.lines if text.startswith(start)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("startup"))


@pytest.fixture
def session(pair):
    return ChatSession(pair.target.tokenizer, pair.target.model, pair.drafter.model, pair.end_ids,
                       ChatSettings(max_new_tokens=4, strategy=StrategySettings(gamma=3)))


def test_the_start_probes_and_times_once_then_reads_what_it_kept(session, pair, tmp_path):
    records = records_for(pair, tmp_path)
    assert records == Records(tmp_path, pair_key(pair))
    first = Recorder()
    prepared = probe_and_calibrate(session.target, session.drafter, records, session.settings.strategy,
                                   frozenset({"gamma"}), report=first)
    found = Said.NEWS if prepared.identity.exact else Said.PROBLEM
    assert first.kinds("checking that this machine") == [Said.NEWS]  # what the probe costs, said first
    assert first.kinds("greedy identity") == [found] and first.kinds("calibrated in") == [Said.NEWS]
    tried = len(prepared.identity.tried)  # a status for the probe, each path it tried, the linear layers, the timing
    assert len(first.statuses) == 1 + tried + 1 + 1 and [k for k, _ in first.lines].count(Said.WHY) >= 3
    assert prepared.tuning is not None and prepared.tuning.settings.gamma == 3  # the user's, kept
    assert prepared.tuning.kept == ("gamma",)

    second = Recorder()
    again = probe_and_calibrate(session.target, session.drafter, records, session.settings.strategy, report=second)
    kept = Said.KEPT if prepared.identity.exact else Said.PROBLEM
    assert second.kinds("greedy identity") == [kept] and second.kinds("calibration kept") == [Said.KEPT]
    assert again.tuning is not None and again.tuning.calibration == prepared.tuning.calibration
    assert again.identity == prepared.identity

    uncalibrated = Recorder()
    none = probe_and_calibrate(session.target, session.drafter, records, session.settings.strategy,
                               calibrate=False, report=uncalibrated)
    assert none.tuning is None and len(uncalibrated.statuses) == 1


def test_the_session_adopts_the_start_and_calibrates_again_only_after_one(session, pair, tmp_path):
    app = ChatApp(session, Console(file=io.StringIO(), width=200, color_system=None),
                  ModelInfo("target", "drafter", "float32", "cpu"))
    assert dispatch(app, "/calibrate") is Outcome.CONTINUE
    assert "started with --no-calibrate" in app.console.file.getvalue()
    prepared = probe_and_calibrate(session.target, session.drafter, records_for(pair, tmp_path),
                                   session.settings.strategy, frozenset({"gamma"}))
    session.keep_settings = frozenset({"gamma"})
    session.adopt(prepared)
    assert session.invariance == prepared.identity and session.tuning == prepared.tuning
    assert prepared.tuning is not None and session.settings.strategy == prepared.tuning.settings
    assert session.records == prepared.records
    tuning = session.calibrate(again=True)
    assert tuning.measured and session.settings.strategy.gamma == 3


def test_without_calibration_the_session_keeps_its_settings(session, pair, tmp_path):
    before = session.settings
    session.adopt(Prepared(probe_and_calibrate(session.target, session.drafter, records_for(pair, tmp_path),
                                               before.strategy, calibrate=False).identity, None,
                           records_for(pair, tmp_path)))
    assert session.settings == before and session.records is None and session.tuning is None


def test_compile_step_is_skipped_unless_wanted_and_says_why_it_failed():
    report = Recorder()
    assert compile_step(None, True, report) is None and report.lines == []

    class Failing:
        def compile_step(self):
            raise RuntimeError("no compiler")

    assert compile_step(Failing(), False, report) is None and report.statuses == []
    assert compile_step(Failing(), True, report) is None
    assert report.lines == [(Said.PROBLEM, "the drafter runs uncompiled: RuntimeError: no compiler")]


@pytest.mark.skipif(len(kernels.isas()) < 2, reason="needs a CPU that runs two sets of the kernels")
def test_kernels_flag_runs_the_set_named_and_refuses_one_this_cpu_lacks():
    try:
        use_kernels(kernels.isas()[-1])
        assert kernels.isa() == kernels.isas()[-1]
        with pytest.raises(ModelLoadError, match=r"^--kernels neon: .*does not run neon kernels \(it runs: "):
            use_kernels("neon")
    finally:
        kernels.use()


def test_kernels_flag_holds_torch_to_the_same_instructions_unless_told(monkeypatch):
    held = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CACHE_DIR")
    for name in held:
        monkeypatch.delenv(name, raising=False)
    hold_torch_to("amx-int8")  # the best set: torch keeps its own best, and inductor its cache
    hold_torch_to(None)
    assert not any(name in os.environ for name in held)
    hold_torch_to("avx2")
    assert (os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_avx2")
    for name in held:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # the user's own capability: its own cache too
    hold_torch_to("avx2")
    assert (os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"]) == ("default", "AVX2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_default")


def test_the_probe_on_a_placed_model_says_its_cost_each_path_and_the_seconds_it_took(tmp_path):
    """Regression: on a model placed by a device map the one-time probe ran for minutes under one unchanging status;
    now the start says its cost first, each path as it is tried, and the seconds it took, and a second start (the
    record kept) says none of that."""
    checkpoint = save_tiny_checkpoint(tmp_path / "target")
    placed = load_model(str(checkpoint), dtype="float32", progress=False, placement=Placement("auto", {"cpu": 2**30}))
    target = CachedModel(placed.model)
    records = Records(tmp_path / "cache", {"model": "placed"})
    first = Recorder()
    prepared = probe_and_calibrate(target, None, records, StrategySettings(), calibrate=False, report=first)
    cost = first.lines[0]
    assert cost[0] is Said.NEWS and "paths of about" in cost[1] and "device map" in cost[1]
    steps = first.statuses[1:]
    assert len(steps) == len(prepared.identity.tried) + 1
    tried = zip(prepared.identity.tried, steps[:-1], strict=True)
    assert all(f"{path} ({n} of " in step for n, (path, step) in enumerate(tried, 1))
    assert "linear layer" in steps[-1]
    assert f"probed in {prepared.identity.seconds:.0f} s" in first.lines[-1][1]

    second = Recorder()
    probe_and_calibrate(target, None, records, StrategySettings(), calibrate=False, report=second)
    assert len(second.statuses) == 1 and len(second.lines) == 1 and "probed in" not in second.lines[0][1]
