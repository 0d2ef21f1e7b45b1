"""bench.py end to end on two tiny saved checkpoints (float32, cpu), and the HF baselines' settings.

No test asserts a timing: on tiny models they are noise.
"""

import json
import struct
import sys
from pathlib import Path

import pytest

import bench
from benchmarks.analytic import speedup_bound
from benchmarks.costs import ForwardCosts
from benchmarks.hf_baselines import build_hf_baselines, quantized_drafter, sampling_kwargs
from benchmarks.report import plot, summarize
from benchmarks.runner import first_difference
from models.loading import load_model
from sampling.base import DecodeConfig
from sampling.settings import STRATEGIES
from tests.helpers import save_random_heads, save_tiny_pair
from utils.logits_processor import make_processor

REPO = Path(__file__).resolve().parent.parent
# Every strategy the default run measures is lossless: greedy output equals autoregressive output.
LOSSLESS = tuple(s for s in STRATEGIES if s not in bench.NOT_BY_DEFAULT)
HF = ("hf_generate", "hf_assisted", "hf_assisted_gamma", "hf_assisted_int8", "hf_assisted_int4", "hf_universal",
      "hf_prompt_lookup")
MEASUREMENT_KEYS = {
    "prompt_id": str, "category": str, "turn": int, "strategy": str, "kind": str, "order": int,
    "prompt_tokens": int, "new_tokens": int, "finished": bool, "time_to_first_token": float, "decode_time": float,
    "total_time": float, "tokens_per_second": float, "decode_tokens_per_second": float, "rounds": int,
    "mean_tokens_per_round": float, "tokens_by_round": list, "drafted": (int, type(None)),
    "accepted": (int, type(None)), "tested": (int, type(None)), "drafted_by_position": (list, type(None)),
    "accepted_by_position": (list, type(None)), "target_forwards": (int, type(None)),
    "drafter_forwards": (int, type(None)), "drafter_counts": dict, "identical_to_autoregressive": bool,
    "first_difference": (int, type(None)), "token_ids": list, "text": str,
}
SUMMARY_KEYS = {"runs", "new_tokens", "total_time", "decode_time", "tokens_per_second", "decode_tokens_per_second",
                "mean_time_to_first_token", "rounds", "mean_tokens_per_round", "drafter_forwards", "drafted",
                "accepted", "tested", "acceptance_rate", "alpha", "acceptance_by_position", "identical", "compared",
                "speedup_vs_autoregressive", "speedup_vs_hf_generate", "decode_speedup_vs_autoregressive",
                "bound_gamma", "speedup_bound", "efficiency"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny_pair(root)


@pytest.fixture(scope="module")
def quick_run(checkpoints, tmp_path_factory):
    target, drafter = checkpoints
    out = tmp_path_factory.mktemp("bench")
    eagle, medusa = save_random_heads(target)
    argv = ["--quick", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32", "--device", "cpu",
            "--head", eagle, "--head", medusa,
            "--strategies", ",".join(LOSSLESS + HF), "--out", str(out / "run"), "--markdown",
            str(out / "README_results.md"), "--no-progress", "--cost-repeats", "2"]
    assert bench.main(argv) == 0
    return out


@pytest.mark.slow
def test_quick_run_writes_every_file(quick_run):
    run = quick_run / "run"
    png = (run / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    width, height = struct.unpack(">II", png[16:24])
    assert width > 500 and height > 200
    md = (quick_run / "README_results.md").read_text()
    assert md == (run / "summary.md").read_text()
    assert md.startswith("## Benchmark results") and "| speculative |" in md and "python bench.py --quick" in md


@pytest.mark.slow
def test_quick_run_json(quick_run):
    report = json.loads((quick_run / "run" / "results.json").read_text())
    assert set(report) == {"schema_version", "command", "machine", "config", "contestants", "skipped_contestants",
                           "skipped_prompts", "costs", "prompts", "summary", "measurements", "files"}
    machine = report["machine"]
    for key in ("cpu", "torch_threads", "torch", "transformers", "dtype", "device", "date"):
        assert machine[key] not in (None, "")
    assert machine["dtype"] == "float32" and machine["device"] == "cpu"
    config = report["config"]  # a float32 drafter is oneDNN-prepacked, which torch.compile cannot lower: left eager
    assert config["drafter_compiled"] is False and config["drafter_compile_seconds"] is None
    assert isinstance(machine["torch_threads"], int)
    config = report["config"]
    assert config["greedy"] is True and config["max_new_tokens"] == 16
    calibration = config["calibration"]  # the chat's defaults on this machine: the calibrated drafting settings
    assert calibration["target_ms"]["1"] > 0 and calibration["drafter_ms"] > 0
    assert config["gamma"] == config["strategy_settings"]["gamma"] == report["contestants"][1]["settings"]["gamma"]
    assert config["prompt_counts"] == {"chat": 1, "code": 1}

    costs = report["costs"]
    assert all(costs[k] > 0 for k in ("t_target_1", "t_target_verify", "t_draft_1", "draft_cost_ratio"))

    # hf_universal needs a model with another tokenizer: skipped with its reason; every other one ran.
    skipped = ["hf_assisted_int8", "hf_assisted_int4", "hf_universal"]  # float32: low-bit CPU weights need bf16
    assert [s["name"] for s in report["skipped_contestants"]] == skipped
    assert "need bfloat16 activations" in report["skipped_contestants"][0]["reason"]
    names = [c["name"] for c in report["contestants"]]
    assert names == [n for n in LOSSLESS + HF if n not in skipped]

    measurements = report["measurements"]
    # 2 prompts: the multi-turn chat one (2 turns, both measured) and a code one: 3 turns per contestant.
    assert len(measurements) == 3 * len(names)
    for m in measurements:
        assert set(m) == set(MEASUREMENT_KEYS)
        for key, kind in MEASUREMENT_KEYS.items():
            assert isinstance(m[key], kind), (key, m[key])
        assert 1 <= m["new_tokens"] == len(m["token_ids"]) <= 16
        assert m["total_time"] >= m["time_to_first_token"] > 0
        assert sum(m["tokens_by_round"]) == m["new_tokens"]
    for m in measurements:
        if m["kind"] == "ours":
            assert m["drafted"] is not None
    assert {m["turn"] for m in measurements if m["category"] == "chat"} == {0, 1}

    # float32 greedy: our lossless strategies reproduce autoregressive decoding token for token.
    for m in measurements:
        if m["strategy"] in LOSSLESS:
            assert m["identical_to_autoregressive"] is True and m["first_difference"] is None, m["strategy"]

    summary = report["summary"]
    assert set(summary) == {"overall", "by_category"} and set(summary["by_category"]) == {"chat", "code"}
    for stats in summary["overall"].values():
        assert set(stats) == SUMMARY_KEYS
    assert summary["overall"]["autoregressive"]["speedup_vs_autoregressive"] == pytest.approx(1.0)
    assert summary["overall"]["hf_generate"]["speedup_vs_hf_generate"] == pytest.approx(1.0)
    speculative = summary["overall"]["speculative"]
    assert 0 <= speculative["alpha"] <= 1 and speculative["speedup_bound"] > 0
    # The draft model stops early by default: bounded at its mean draft length, every verify width up to gamma timed.
    gamma = report["config"]["gamma"]  # calibrated for this machine
    assert 1 <= speculative["bound_gamma"] <= len(speculative["acceptance_by_position"]) <= gamma
    # Every other contestant's own draft length is timed too (the calibrated gamma may be smaller than theirs).
    others = {c["gamma"] for c in report["contestants"] if c.get("gamma")}
    expected = {str(g) for g in {*range(1, gamma + 1), *others}}
    assert set(report["costs"]["t_target_verify_by_gamma"]) == expected
    assert summary["overall"]["hf_generate"]["alpha"] is None


def test_hf_num_assistant_tokens_reaches_the_assistant(checkpoints):
    """Assisted generation reads num_assistant_tokens from the assistant's generation_config, not from generate's
    kwargs: with the target as its own drafter every draft is accepted, so rounds commit gamma + 1 tokens."""
    target = load_model(str(checkpoints[0]), device="cpu", dtype="float32", progress=False)
    same = load_model(str(checkpoints[0]), device="cpu", dtype="float32", progress=False)
    baselines, skipped = build_hf_baselines(["hf_generate", "hf_assisted_gamma"], target, same, None, gamma=3,
                                            lookup_max_ngram=3)
    assert not skipped
    config = DecodeConfig(max_new_tokens=12, end_ids=(), seed=0)
    prompt = target.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    plain, assisted = (b.run(prompt, config) for b in baselines)
    assert assisted.token_ids == plain.token_ids
    assert assisted.stats.tokens_by_round == [4, 4, 4]
    assert same.model.generation_config.num_assistant_tokens != 3  # restored after the call


def test_low_bit_baselines_are_skipped_in_float32_by_the_loaders_rules(checkpoints):
    target = load_model(str(checkpoints[0]), device="cpu", dtype="float32", progress=False)
    drafter = load_model(str(checkpoints[1]), device="cpu", dtype="float32", progress=False)
    built, skipped = build_hf_baselines(["hf_assisted_int8"], target, drafter, None, gamma=4, lookup_max_ngram=3)
    assert not built and "float32" in skipped[0].reason
    built, skipped = build_hf_baselines(["hf_assisted_int8", "hf_assisted"], target, None, None, gamma=4,
                                        lookup_max_ngram=3)
    assert not built and all(s.reason == "no drafter model loaded" for s in skipped)
    built, skipped = build_hf_baselines(["hf_assisted_int4"], target, drafter, None, gamma=4, lookup_max_ngram=3)
    assert not built and "bfloat16" in skipped[0].reason


def test_the_quantized_baseline_drafter_is_the_loaded_one_or_a_copy_of_the_dense_weights(checkpoints):
    dense = load_model(str(checkpoints[1]), device="cpu", dtype="bfloat16", progress=False)
    int8 = load_model(str(checkpoints[1]), device="cpu", dtype="bfloat16", quantize="int8", keep_dense=True,
                      progress=False)
    assert quantized_drafter(int8, "int8") is int8.model
    loaded = type(dense.model.model.layers[0].mlp.up_proj)  # Linear, or PackedLinear where oneDNN has native bf16
    copied = quantized_drafter(dense, "int8")
    assert type(copied.model.layers[0].mlp.up_proj).__name__ == "Int8Linear"
    assert type(dense.model.model.layers[0].mlp.up_proj) is loaded  # the loaded drafter is untouched


def test_sampling_kwargs_are_explicit():
    assert sampling_kwargs(make_processor(0.0)) == {"repetition_penalty": 1.0, "num_beams": 1, "do_sample": False}
    kwargs = sampling_kwargs(make_processor(0.7, top_p=0.9))
    assert kwargs["do_sample"] and kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.9 and kwargs["top_k"] == 0


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_summary_is_ratio_of_sums():
    def m(strategy, tokens, seconds):
        return {"category": "c", "strategy": strategy, "new_tokens": tokens, "total_time": seconds,
                "decode_time": seconds / 2, "time_to_first_token": seconds / 2, "rounds": tokens, "drafted": None,
                "accepted": None, "tested": None, "identical_to_autoregressive": None}
    ms = [m("autoregressive", 10, 1.0), m("autoregressive", 30, 1.0), m("x", 20, 0.5), m("x", 20, 0.5)]
    overall = summarize(ms, None, {}, set())["overall"]
    assert overall["autoregressive"]["tokens_per_second"] == pytest.approx(20.0)
    assert overall["x"]["speedup_vs_autoregressive"] == pytest.approx(2.0)
    assert overall["x"]["speedup_vs_hf_generate"] is None


@pytest.mark.parametrize("stops_early, gamma", [(set(), 4), ({"speculative"}, 2)])
def test_bound_of_a_drafter_that_stops_early_is_taken_at_its_mean_draft_length(stops_early, gamma):
    costs = ForwardCosts(context_length=10, gamma=4, repeats=1, t_target_1=1.0, t_target_verify=1.2, t_draft_1=0.25,
                         t_target_verify_by_gamma={2: 1.1, 4: 1.2})
    common = {"category": "c", "new_tokens": 30, "time_to_first_token": 0.5, "identical_to_autoregressive": None}
    ms = [{**common, "strategy": "autoregressive", "total_time": 30.0, "decode_time": 29.0, "rounds": 30,
           "drafted": None, "accepted": None, "tested": None},
          {**common, "strategy": "speculative", "total_time": 15.0, "decode_time": 14.0, "rounds": 10,
           "drafter_forwards": 21, "drafted": 21, "accepted": 16, "tested": 20,  # 2.1 drafts per round
           "drafted_by_position": [10, 8, 3], "accepted_by_position": [9, 6, 1]}]
    s = summarize(ms, costs, {"speculative": 4}, {"speculative"}, stops_early)["overall"]["speculative"]
    assert s["bound_gamma"] == gamma
    assert s["speedup_bound"] == pytest.approx(speedup_bound(0.8, gamma, 1.0, costs.verify_time(gamma), 0.25))
    assert s["efficiency"] == pytest.approx(s["decode_speedup_vs_autoregressive"] / s["speedup_bound"])


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--strategies", "autoregressive,warp"])
    assert "unknown strategies warp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--no-hf", "--strategies", "hf_generate"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--gamma", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--alternatives", "-1"])
    assert "--alternatives must be an integer from 0 to 8, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--draft-cumulative", "1.5"])
    assert "--draft-cumulative must be a number in [0, 1), got 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lookahead", "1", "3", "1"], "--lookahead W must be an integer from 2 to 16, got 1"),
    (["--top-p", "2"], "--top-p must be a number in (0, 1], got 2.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0.001 (use 0 for greedy), got nan"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 9223372036854775807, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--dtype", "float8"], "Unknown dtype 'float8'"),
    (["--device", "gpu"], "Unknown device 'gpu'"),
    (["--preset", "tiny"], "Unknown preset 'tiny'"),
])
def test_bench_refuses_what_the_settings_refuse_before_loading(capsys, argv, message):
    """Bug: bench.py kept its own copy of the bounds (and none for the sampling flags, the seed or the model names,
    which failed after loading): now the settings' checks, in the flag's words, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_and_infer_share_the_decoding_and_model_flags():
    import infer

    def flags(parser):
        return {option: action.default for action in parser._actions for option in action.option_strings}

    ours, theirs = flags(infer.build_parser()), flags(bench.build_parser())
    shared = ("--gamma", "--temperature", "--top-k", "--top-p", "--min-p", "--num-beams", "--alternatives",
              "--verify-width", "--draft-cumulative", "--lookahead", "--preset", "--target", "--drafter", "--device",
              "--dtype", "--target-quantize", "--drafter-quantize", "--trust-remote-code", "--cache-dir")
    assert {f: ours[f] for f in shared} == {f: theirs[f] for f in shared}
    assert bench.parse_args(["--temperature", "0.5", "--min-p", "0.2"]).decoding.config.processor.min_p == 0.2


def test_default_selection():
    ours, hf = bench.selected_strategies(bench.parse_args([]))
    assert ours[0] == "autoregressive" and "drafter" not in ours and "beam" not in ours and "speculative" in ours
    assert hf == list(HF)
    ours, hf = bench.selected_strategies(bench.parse_args(["--no-hf", "--strategies", "lookup"]))
    assert ours == ["autoregressive", "lookup"] and hf == []


@pytest.mark.slow
def test_an_interrupted_run_resumes_from_its_checkpoint(checkpoints, tmp_path, capsys):
    target, drafter = checkpoints
    out = tmp_path / "run"
    argv = ["--quick", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32", "--device", "cpu",
            "--strategies", "autoregressive,speculative,lookup", "--out", str(out), "--no-progress",
            "--cost-repeats", "1", "--no-compile"]
    assert bench.main(argv) == 0
    assert json.loads((out / "results.json").read_text())["config"]["drafter_compiled"] is False
    header, first, second = (out / "progress.jsonl").read_text().splitlines()
    assert json.loads(first)["prompt_id"] != json.loads(second)["prompt_id"]
    # Interrupted during the second prompt: its line was cut short. The first prompt's record is marked.
    record = json.loads(first)
    for m in record["measurements"]:
        m["decode_time"] = 1234.5
    (out / "progress.jsonl").write_text("\n".join([header, json.dumps(record), second[: len(second) // 2]]))

    assert bench.main(argv + ["--resume"]) == 0
    assert "resuming: 1 prompts already measured" in capsys.readouterr().err
    measurements = json.loads((out / "results.json").read_text())["measurements"]
    kept = [m for m in measurements if m["prompt_id"] == record["prompt_id"]]
    fresh = [m for m in measurements if m["prompt_id"] != record["prompt_id"]]
    assert len(kept) == len(record["measurements"]) and all(m["decode_time"] == 1234.5 for m in kept)
    assert fresh and all(m["decode_time"] != 1234.5 for m in fresh)
    assert {m["strategy"] for m in fresh} == {"autoregressive", "speculative", "lookup"}
    lines = (out / "progress.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["prompt_id"] == json.loads(second)["prompt_id"]  # cut line gone

    assert bench.main(argv + ["--resume", "--max-new-tokens", "8"]) == 2  # other settings: refused, file untouched
    assert "differs in: max_new_tokens" in capsys.readouterr().err
    assert (out / "progress.jsonl").read_text().splitlines() == lines


def test_resume_needs_an_output_directory(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--resume"])
    assert "--resume needs --out" in capsys.readouterr().err


def test_the_plot_without_matplotlib_names_the_requirements_file(monkeypatch, tmp_path):
    """matplotlib moved out of requirements.txt: a benchmark without it says what to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install -r requirements-bench\.txt"):
        plot({"summary": {}}, tmp_path / "plot.png")


@pytest.mark.slow
def test_the_results_page_shows_each_committed_run_with_a_link_to_its_data(quick_run, tmp_path):
    from benchmarks.report import results_page

    results = tmp_path / "benchmarks" / "results"
    for name in ("older", "newer"):
        (results / name).mkdir(parents=True)
        report = json.loads((quick_run / "run" / "results.json").read_text())
        report["machine"]["date"] = "2026-01-01" if name == "older" else "2026-02-01"
        (results / name / "results.json").write_text(json.dumps(report))
    page, runs, skipped = results_page(results)
    assert (runs, skipped) == (2, [])
    assert page.startswith("# Benchmark results") and "python bench.py --results-page" in page
    assert page.index("## newer") < page.index("## older")  # newest first
    assert "[results/newer/results.json](results/newer/results.json)" in page and "| speculative |" in page
    assert "No run is committed yet." in results_page(tmp_path / "nothing")[0]


def test_the_results_page_shows_recorded_paths_relative_to_the_repository():
    """Bug: RESULTS.md showed the prompts as /work/main/benchmarks/prompts.jsonl, the checkout that ran them."""
    from benchmarks.report import REPO, shown_path

    assert shown_path(str(REPO / "benchmarks" / "prompts.jsonl")) == "benchmarks/prompts.jsonl"
    assert shown_path("/elsewhere/prompts.jsonl") == "/elsewhere/prompts.jsonl"  # outside it: as recorded
    assert shown_path("mine.jsonl") == "mine.jsonl"
    assert str(REPO / "benchmarks") not in (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")


COMMITTED_RUN = REPO / "benchmarks" / "results" / "avx2-greedy" / "results.json"


def test_the_results_page_skips_a_damaged_results_json_naming_it(tmp_path):
    """Bug: one truncated results.json ended `bench.py --results-page` in a JSONDecodeError."""
    from benchmarks.report import results_page

    results = tmp_path / "benchmarks" / "results"
    text = COMMITTED_RUN.read_text(encoding="utf-8")
    for name, body in (("good", text), ("cut", text[: len(text) // 2]), ("list", "[]"), ("binary", "\udcff")):
        (results / name).mkdir(parents=True)
        (results / name / "results.json").write_text(body, encoding="utf-8", errors="surrogateescape")
    page, runs, skipped = results_page(results)
    assert runs == 1 and "## good" in page and "## cut" not in page
    assert sorted(line.split(":")[0] for line in skipped) == sorted(str(results / n / "results.json")
                                                                   for n in ("binary", "cut", "list"))
    assert all("not a run's report" in line and "\n" not in line for line in skipped)


def test_the_results_page_shows_prompts_relative_to_the_repository_whatever_checkout_ran_them(tmp_path):
    """Bug: the page regenerated in another checkout than the one that ran showed /work/main/benchmarks/prompts.jsonl
    where the committed page shows benchmarks/prompts.jsonl."""
    from benchmarks.report import REPO, results_page, shown_path

    assert shown_path("/some/other/checkout/benchmarks/prompts.jsonl") == "benchmarks/prompts.jsonl"
    assert shown_path("/some/other/checkout/benchmarks/prompts.jsonl", repo=tmp_path) == \
        "/some/other/checkout/benchmarks/prompts.jsonl"  # not a file of that repository: as recorded
    report = json.loads(COMMITTED_RUN.read_text(encoding="utf-8"))
    report["config"]["prompts"] = "/some/other/checkout/benchmarks/prompts.jsonl"
    (tmp_path / "results" / "run").mkdir(parents=True)
    (tmp_path / "results" / "run" / "results.json").write_text(json.dumps(report))
    page = results_page(tmp_path / "results")[0]
    assert "prompts `benchmarks/prompts.jsonl`" in page and "/some/other" not in page and str(REPO) not in page
