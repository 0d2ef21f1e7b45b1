"""The start every entry point makes through the Engine (app/startup.py, app/engine.py): the probe and the calibration
run once per machine and are read back afterwards, the user's settings stay as given, each script hears of it in the
kinds of line it shows, and a compile that fails leaves its model eager and says why."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
from rich.console import Console

import kernels
from app.calibration import pair_key
from app.engine import Engine
from app.flags import hold_torch_to
from app.startup import Records, Said, probe_and_calibrate, records_for, use_kernels
from chat.commands import Outcome, dispatch
from chat.repl import ChatRepl
from chat.session import ChatSession, ChatSettings, ModelInfo
from models.loading import load_model
from models.placement import Placement
from sampling.settings import StrategySettings
from tests.helpers import load_tiny_pair, save_tiny_checkpoint
from utils.errors import ModelLoadError
from utils.runner import CachedModel


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
def engine(pair):
    return Engine.from_pair(pair, settings=StrategySettings(gamma=3), keep=frozenset({"gamma"}))


def test_the_start_probes_and_times_once_then_reads_what_it_kept(engine, pair, tmp_path):
    records = records_for(pair, tmp_path)
    assert records == Records(tmp_path, pair_key(pair))
    first = Recorder()
    prepared = probe_and_calibrate(engine.target, engine.drafter, records, engine.settings, engine.keep, report=first)
    found = Said.NEWS if prepared.identity.exact else Said.PROBLEM
    assert first.kinds("checking that this machine") == [Said.NEWS]  # what the probe costs, said first
    assert first.kinds("greedy identity") == [found] and first.kinds("calibrated in") == [Said.NEWS]
    tried = len(prepared.identity.tried)  # a status for the probe, each path it tried, the linear layers, the timing
    assert len(first.statuses) == 1 + tried + 1 + 1 and [k for k, _ in first.lines].count(Said.WHY) >= 3
    assert prepared.tuning is not None and prepared.tuning.settings.gamma == 3  # the user's, kept
    assert prepared.tuning.kept == ("gamma",)

    second = Recorder()
    again = probe_and_calibrate(engine.target, engine.drafter, records, engine.settings, report=second)
    kept = Said.KEPT if prepared.identity.exact else Said.PROBLEM
    assert second.kinds("greedy identity") == [kept] and second.kinds("calibration kept") == [Said.KEPT]
    assert again.tuning is not None and again.tuning.calibration == prepared.tuning.calibration
    assert again.identity == prepared.identity

    uncalibrated = Recorder()
    none = probe_and_calibrate(engine.target, engine.drafter, records, engine.settings, calibrate=False,
                               report=uncalibrated)
    assert none.tuning is None and len(uncalibrated.statuses) == 1


def test_the_session_takes_the_engines_start_and_calibrates_again_only_after_one(engine, pair, tmp_path):
    def chat() -> ChatRepl:
        session = ChatSession(engine, ChatSettings(max_new_tokens=4, strategy=engine.settings))
        return ChatRepl(session, Console(file=io.StringIO(), width=200, color_system=None),
                       ModelInfo("target", "drafter", "float32", "cpu"))

    app = chat()
    assert dispatch(app, "/calibrate") is Outcome.CONTINUE
    assert "started with --no-calibrate" in app.console.file.getvalue()
    engine.prepare(records_for(pair, tmp_path))
    assert engine.identity is not None and engine.tuning is not None and engine.settings == engine.tuning.settings
    assert engine.records == records_for(pair, tmp_path) and engine.settings.gamma == 3  # the user's, kept
    session = chat().session
    assert session.invariance == engine.identity and session.tuning == engine.tuning
    tuning = session.calibrate(again=True)
    assert tuning.measured and session.settings.strategy == tuning.settings and session.settings.strategy.gamma == 3


def test_without_calibration_the_engine_keeps_its_settings(engine, pair, tmp_path):
    before = engine.settings
    engine.prepare(records_for(pair, tmp_path), calibrate=False)
    assert engine.identity is not None
    assert engine.settings == before and engine.records is None and engine.tuning is None


def test_a_compile_is_skipped_unless_wanted_and_says_why_it_failed(pair):
    report = Recorder()
    plain = Engine(pair.target.model, pair.target.tokenizer)
    assert plain.compile(drafter=True, target=False, report=report) is None
    assert report.lines == [] and plain.compiles.drafter is None

    class Failing:
        def compile_step(self, workers=None):
            raise RuntimeError("no compiler\nmore detail")

    failing = Engine.from_pair(pair)
    failing.drafter = Failing()
    failing.compile(drafter=False, target=False, report=report)
    assert report.statuses == [] and failing.compiles.drafter is None
    failing.compile(drafter=True, target=False, report=report)
    assert report.statuses == ["compiling the drafter's short forwards …"]
    assert report.lines == [(Said.PROBLEM, "the drafter runs uncompiled: RuntimeError: no compiler")]
    assert failing.compiles.status("drafter") == "not compiled (RuntimeError: no compiler)"


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


def test_infer_starts_through_one_engine_load(monkeypatch, capsys):
    """infer.py's whole start is one `Engine.load` (the flags as its keywords); the one-shot answer comes from it."""
    import json

    import infer
    from tests.helpers import tiny_engine

    calls = []

    def load(*args, **kwargs):
        calls.append(kwargs)
        return tiny_engine()

    monkeypatch.setattr(Engine, "load", load)
    code = infer.main(["--target", "tiny-target", "--drafter", "tiny-drafter", "-p", "Hello!", "--json", "-n", "5",
                       "--strategy", "speculative,autoregressive", "--gamma", "2"])
    assert code == 0 and len(calls) == 1
    assert (calls[0]["target"], calls[0]["drafter"], calls[0]["compile"], calls[0]["keep"]) == \
        ("tiny-target", "tiny-drafter", False, frozenset({"gamma"}))  # one prompt compiles only when asked
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["strategy"] for r in results] == ["speculative", "autoregressive"]
    assert results[0]["token_ids"] == results[1]["token_ids"] and len(results[0]["token_ids"]) <= 5


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
