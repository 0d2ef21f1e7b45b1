"""Aggregates and outputs: per strategy and category summaries, a rich table, markdown, a PNG plot, the JSON file.

Rates are ratios of sums (`Stats.combine`: all tokens over all seconds of a group), as in SpecBench. `speedup` uses
total time (the prompt's prefill included: what a user waits for); `decode_speedup` leaves the time to first token
out; the analytic bound models decode rounds, so `efficiency` = decode_speedup / bound.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

from benchmarks.analytic import alpha_from_counts, speedup_bound
from benchmarks.costs import ForwardCosts
from benchmarks.names import REFERENCE
from models.devices import cpu_model
from sampling.base import DRAFT_COUNTS, Stats
from utils.errors import one_line

HF_REFERENCE = "hf_generate"
REPO = Path(__file__).resolve().parent.parent
ALL = "all"


# ---------------------------------------------------------------------------------------------
# Summaries


def summarize(measurements: list[dict], costs: ForwardCosts | None, gammas: dict[str, int],
              drafter_models: set[str], stops_early: set[str] = frozenset()) -> dict:
    """{"overall": {strategy: stats}, "by_category": {category: {strategy: stats}}}. `gammas`: each drafting
    strategy's draft length; `drafter_models` names the strategies whose drafts come from the drafter model (their
    bound counts T_draft, the others draft for free); `stops_early` those whose draft model drafts fewer tokens when
    unsure: their bound is the fixed-length one at their mean draft length (drafter forwards per round), so an
    efficiency above 100% is what stopping early gains over drafting that many tokens every round."""
    categories = sorted({m["category"] for m in measurements})
    by_category = {c: _group([m for m in measurements if m["category"] == c], costs, gammas, drafter_models,
                             stops_early) for c in categories}
    return {"overall": _group(measurements, costs, gammas, drafter_models, stops_early), "by_category": by_category}


def _group(measurements: list[dict], costs: ForwardCosts | None, gammas: dict[str, int],
           drafter_models: set[str], stops_early: set[str]) -> dict:
    strategies = list(dict.fromkeys(m["strategy"] for m in measurements))
    stats = {s: _stats([m for m in measurements if m["strategy"] == s]) for s in strategies}
    for name, s in stats.items():
        s["speedup_vs_autoregressive"] = _ratio(s["tokens_per_second"],
                                                stats.get(REFERENCE, {}).get("tokens_per_second"))
        s["speedup_vs_hf_generate"] = _ratio(s["tokens_per_second"],
                                             stats.get(HF_REFERENCE, {}).get("tokens_per_second"))
        s["decode_speedup_vs_autoregressive"] = _ratio(s["decode_tokens_per_second"],
                                                       stats.get(REFERENCE, {}).get("decode_tokens_per_second"))
        s["speedup_bound"] = None
        gamma = gammas.get(name)
        if name in stops_early and gamma is not None and s["rounds"]:
            gamma = min(gamma, max(1, round(s["drafter_forwards"] / s["rounds"])))
        s["bound_gamma"] = gamma
        if s["alpha"] is not None and costs is not None and gamma is not None:
            t_draft = costs.t_draft_1 if name in drafter_models else 0.0
            if t_draft is not None:
                s["speedup_bound"] = speedup_bound(s["alpha"], gamma, costs.t_target_1, costs.verify_time(gamma),
                                                   t_draft)
        s["efficiency"] = _ratio(s["decode_speedup_vs_autoregressive"], s["speedup_bound"])
    return stats


def _stats(ms: list[dict]) -> dict:
    s = Stats.combine(_measured(m) for m in ms)
    drafts = s.drafted is not None
    compared = [m["identical_to_autoregressive"] for m in ms if m["identical_to_autoregressive"] is not None]
    return {
        "runs": s.runs,
        "new_tokens": s.new_tokens,
        "total_time": s.total_time,
        "decode_time": s.decode_time,
        "tokens_per_second": s.tokens_per_second,
        "decode_tokens_per_second": s.decode_tokens_per_second,
        "mean_time_to_first_token": s.mean_time_to_first_token,
        "rounds": s.rounds,
        "mean_tokens_per_round": s.mean_tokens_per_round,
        "drafter_forwards": s.drafter_forwards or 0,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "tested": s.tested,
        "acceptance_rate": s.acceptance_rate if s.drafted else None,
        "alpha": alpha_from_counts(s.accepted, s.tested) if drafts and s.tested is not None else None,
        "acceptance_by_position": s.acceptance_by_position if drafts else None,
        "identical": sum(compared) if compared else None,
        "compared": len(compared) if compared else None,
    }


def _measured(m: dict) -> Stats:
    """One measurement's stats, as the run recorded them (a draft count it did not record is None)."""
    return Stats.measured(m["new_tokens"], m["rounds"], m["time_to_first_token"], m["total_time"],
                          m.get("tokens_by_round"), **{name: m.get(name) for name in DRAFT_COUNTS})


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------
# Machine


def machine_description(device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    import kernels

    try:
        import optimum.quanto as quanto
        quanto_version = getattr(quanto, "__version__", "installed")
    except ImportError:
        quanto_version = None
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernels": kernels.isa() or None,  # the instruction set the project's kernels ran (--kernels)
        "transformers": transformers.__version__,
        "optimum_quanto": quanto_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------
# Outputs


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _identical(s: dict) -> str:
    return "–" if s["compared"] is None else f"{s['identical']}/{s['compared']}"


COLUMNS = ("strategy", "tok/s", "× ours AR", "× HF generate", "decode ×", "TTFT s", "accept", "α", "tok/round",
           "bound", "efficiency", "identical")


def overall_rows(summary: dict) -> list[list[str]]:
    rows = []
    for name, s in summary["overall"].items():
        rows.append([name, _fmt(s["tokens_per_second"], ".1f"), _fmt(s["speedup_vs_autoregressive"], ".2f", "×"),
                     _fmt(s["speedup_vs_hf_generate"], ".2f", "×"),
                     _fmt(s["decode_speedup_vs_autoregressive"], ".2f", "×"),
                     _fmt(s["mean_time_to_first_token"], ".3f"), _fmt(s["acceptance_rate"], ".0%"),
                     _fmt(s["alpha"], ".2f"), _fmt(s["mean_tokens_per_round"], ".2f"),
                     _fmt(s["speedup_bound"], ".2f", "×"), _fmt(s["efficiency"], ".0%"), _identical(s)])
    return rows


def category_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    categories = list(summary["by_category"])
    header = ["strategy", *categories, ALL]
    rows = []
    for name, s in summary["overall"].items():
        cells = [_fmt(summary["by_category"][c].get(name, {}).get("speedup_vs_autoregressive"), ".2f", "×")
                 for c in categories]
        rows.append([name, *cells, _fmt(s["speedup_vs_autoregressive"], ".2f", "×")])
    return header, rows


def print_tables(summary: dict, console) -> None:
    from rich.table import Table

    table = Table(title="Speculative decoding benchmark (overall)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=column == "strategy")
    for row in overall_rows(summary):
        table.add_row(*row)
    console.print(table)
    header, rows = category_rows(summary)
    by_category = Table(title="Speedup over our autoregressive, by category")
    for column in header:
        by_category.add_column(column, justify="left" if column == "strategy" else "right",
                               no_wrap=column == "strategy")
    for row in rows:
        by_category.add_row(*row)
    console.print(by_category)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def shown_path(path: str, repo: Path = REPO) -> str:
    """A recorded path as a page shows it: relative to the repository where it lies inside it, as recorded elsewhere.

    results.json records the absolute path in the checkout that ran, which need not be this one: a path outside
    `repo` whose end names a file of `repo` (.../benchmarks/prompts.jsonl) is shown as that file."""
    recorded = Path(path)
    if recorded.is_relative_to(repo):
        return recorded.relative_to(repo).as_posix()
    if recorded.is_absolute():
        parts = recorded.parts[1:]
        for start in range(len(parts)):  # the longest end first
            if (repo / Path(*parts[start:])).is_file():
                return Path(*parts[start:]).as_posix()
    return path


def _instruction_sets(machine: dict) -> str:
    """", the project's kernels on avx2, torch's on AVX2" where the run recorded them (older results did not)."""
    if not machine.get("kernels"):
        return ""
    return f"; the project's kernels on {machine['kernels']}, torch's on {machine.get('torch_cpu_capability', '?')}"


def markdown(report: dict) -> str:
    m, c, summary = report["machine"], report["config"], report["summary"]
    costs = report["costs"]
    counts = ", ".join(f"{k} {v}" for k, v in c["prompt_counts"].items())
    compiled = " (short forwards compiled)" if c.get("drafter_compiled") else ""
    if c.get("draft_vocabulary"):
        compiled += f" (a draft vocabulary of {c['draft_vocabulary']} tokens)"
    target_compiled = " (whole forward compiled)" if c.get("target_compiled") else ""
    lines = [
        "## Benchmark results",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['device']}, {m['torch_threads']} torch threads, {m['dtype']}), "
        f"torch {m['torch']}, transformers {m['transformers']}{_instruction_sets(m)}.",
        f"Target `{c['target']}`{target_compiled}, drafter `{c['drafter']}`{compiled}; {c['max_new_tokens']} new "
        f"tokens at most, gamma {c['gamma']}, {c['decoding']}; prompts `{shown_path(c['prompts'])}` ({counts}; "
        "every turn of multi-turn prompts measured).",
        "",
        f"Regenerate with: `{report['command']}`",
        "",
        "### Overall",
        "",
        _md_table(list(COLUMNS), overall_rows(summary)),
        "",
        "### Speedup over our autoregressive decoding, by category",
        "",
        _md_table(*category_rows(summary)),
        "",
    ]
    if costs:
        draft = "–" if costs["t_draft_1"] is None else f"{costs['t_draft_1'] * 1e3:.1f} ms"
        ratio = "–" if costs["draft_cost_ratio"] is None else f"{costs['draft_cost_ratio']:.2f}"
        lines += [
            "### Forward costs (median of timed forwards)",
            "",
            f"At a context of {costs['context_length']} tokens: T_target(1) = {costs['t_target_1'] * 1e3:.1f} ms, "
            f"T_target({costs['gamma'] + 1}) = {costs['t_target_verify'] * 1e3:.1f} ms (verify cost "
            f"{costs['verify_cost_ratio']:.2f}× one step), T_draft(1) = {draft} "
            f"(drafter/target cost ratio c = {ratio}).",
            "The bound is Leviathan et al.'s S = E[N]·T_target(1) / (γ·T_draft + T_target(γ+1)), "
            "E[N] = (1 − α^(γ+1)) / (1 − α), with α the measured per-token acceptance (accepted / drafts checked); "
            "n-gram and lookup drafts cost nothing. A draft model that stops early (a cumulative or confidence "
            "threshold) is bounded at its mean draft length, drafter forwards per round: its efficiency above 100% is "
            "what stopping early gains over drafting that many tokens every round.",
            "",
        ]
    lines += ["### What was run", ""]
    for contestant in report["contestants"]:
        if contestant["kind"] == "hf":
            lines.append(f"- `{contestant['name']}`: {contestant['description']}; assistant generation_config "
                         f"`{json.dumps(contestant['assistant_generation_config'])}`")
        elif contestant["kind"] == "llamacpp":
            drafts = f", drafter `{contestant['drafter_gguf']}`" if contestant["drafter_gguf"] else ""
            lines.append(f"- `{contestant['name']}`: llama.cpp {contestant['version']} `{contestant['binary']}` on "
                         f"`{contestant['target_gguf']}`{drafts}, {contestant['threads']} threads, its own defaults")
        else:
            lines.append(f"- `{contestant['name']}`: ours ({contestant['class']})")
    for skipped in report["skipped_contestants"]:
        lines.append(f"- `{skipped['name']}` skipped: {skipped['reason']}")
    lines += [
        "",
        "Method: one warm-up run per strategy; strategies interleaved per prompt turn (order rotating per prompt); "
        "empty KV caches for every run; tokens counted as new token ids up to and including the first end token; "
        "tok/s = all tokens / all time (time to first token included); decode × leaves it out. HF time to first "
        "token is the first streamer put after the prompt. `identical`: outputs equal to our autoregressive output "
        "token for token (greedy only; bf16 may drift, float32 must not). α, bound and efficiency (decode × / "
        "bound) apply to drafting strategies.",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError as error:  # an install from requirements.txt alone has no plotting
        raise ImportError("the benchmark's plot needs matplotlib: pip install -r requirements-bench.txt") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summary = report["summary"]
    categories = [*summary["by_category"], ALL]
    strategies = [s for s in summary["overall"] if s != REFERENCE]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / max(len(strategies), 1)
    for i, name in enumerate(strategies):
        values = [(summary["overall"] if c == ALL else summary["by_category"][c]).get(name, {})
                  .get("speedup_vs_autoregressive") or 0.0 for c in categories]
        left.bar([x + i * width for x in range(len(categories))], values, width, label=name)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    left.set_xticks([x + width * (len(strategies) - 1) / 2 for x in range(len(categories))], categories,
                    rotation=20)
    left.set_ylabel("speedup over our autoregressive (×)")
    left.set_title("Speedup by category")
    left.legend(fontsize="small", ncol=2)
    for name, s in summary["overall"].items():
        if s["acceptance_by_position"]:
            positions = range(1, len(s["acceptance_by_position"]) + 1)
            right.plot(positions, s["acceptance_by_position"], marker="o", label=name)
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylim(0, 1.05)
    right.set_xlabel("draft position")
    right.set_ylabel("share of rounds accepting it")
    right.set_title("Acceptance by draft position")
    if right.has_data():
        right.legend(fontsize="small")
    m = report["machine"]
    fig.suptitle(f"{report['config']['target']} / {report['config']['drafter']} — {m['cpu']}, {m['dtype']}, "
                 f"{m['torch_threads']} threads", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def write_report(report: dict, out: Path, also_markdown: Path | None = None) -> None:
    """summary.md (and `also_markdown`), plot.png and results.json under `out`."""
    text = markdown(report)
    (out / "summary.md").write_text(text, encoding="utf-8")
    if also_markdown:
        also_markdown.parent.mkdir(parents=True, exist_ok=True)
        also_markdown.write_text(text, encoding="utf-8")
    plot(report, out / "plot.png")
    write_json(report, out / "results.json")


def print_report(report: dict, out: Path) -> None:
    """The summary tables on stdout, what was skipped and where the files are."""
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=200)  # a file or pipe: no 80-column squeeze
    print_tables(report["summary"], console)
    for s in report["skipped_contestants"]:
        console.print(f"[yellow]skipped {s['name']}[/yellow]: {s['reason']}")
    for s in report["skipped_prompts"]:
        console.print(f"[yellow]skipped prompt {s['prompt_id']} turn {s['turn'] + 1}[/yellow]: {s['reason']}")
    console.print(f"results in {out}/ (results.json, summary.md, plot.png)")


def results_page(results_dir: Path) -> tuple[str, int, list[str]]:
    """The page of committed results (benchmarks/RESULTS.md, beside `results_dir`): each run's summary from its
    results.json, newest first, so every number on it has its data beside it, and a link to the run's README.md (what
    was learned in it) where it has one; then the folders of other measurements (kernels, context, kld JSON), each
    with its data and notes. Links are relative to the page.

    Returns the page, the runs on it, and one line for each results.json left out (unreadable, cut short, not a run's
    report), naming it."""
    sections, skipped = [], []
    for path in sorted(results_dir.glob("*/results.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            name = path.parent.name
            body = markdown(report).replace("## Benchmark results", f"## {name}", 1).replace("\n### ", "\n#### ")
            sections.append((str(report["machine"]["date"]), body, path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            skipped.append(f"{path}: not a run's report ({type(error).__name__}: {one_line(error)}); fix or remove it")
    sections.sort(key=lambda item: item[0], reverse=True)
    lines = ["# Benchmark results", "",
             "Generated by `python bench.py --results-page` from the runs committed under `benchmarks/results/`; "
             "each section is one run, newest first, with its data (every measurement, the machine, the command) in "
             "the `results.json` it links to, and what was learned in it in its `README.md`. Compare strategies "
             "within a run only: these machines vary by up to 25% from run to run.", ""]
    if not sections:
        lines += ["No run is committed yet.", ""]
    for _, body, path in sections:
        lines += [body.rstrip(), "",
                  f"Data: {_link(path.relative_to(results_dir.parent))}{_notes(path.parent, results_dir.parent)}", ""]
    others = sorted(folder for folder in results_dir.glob("*/") if folder.is_dir()
                    and not (folder / "results.json").exists() and any(folder.glob("*.json")))
    if others:
        lines += ["## Other measurements", "",
                  "Kernel (`python -m benchmarks.kernels`), long-context (`python -m benchmarks.context`), accuracy "
                  "(`python -m benchmarks.kld`) and serving (`python -m benchmarks.serve`) runs, and runs of "
                  "`bench.py` set side by side (a change before and after, a lever off and on), by name:", ""]
        for folder in others:
            data = ", ".join(_link(path.relative_to(results_dir.parent)) for path in sorted(folder.glob("*.json")))
            lines.append(f"- `{folder.name}`{_machine(folder)}: {data}{_notes(folder, results_dir.parent)}")
        lines.append("")
    return "\n".join(lines), len(sections), skipped


def _link(path: Path) -> str:
    return f"[{path.as_posix()}]({path.as_posix()})"


def _notes(folder: Path, page_dir: Path) -> str:
    """"; notes: [link]" where the run's folder holds a README.md, else nothing."""
    notes = folder / "README.md"
    return f"; notes: {_link(notes.relative_to(page_dir))}" if notes.is_file() else ""


def _machine(folder: Path) -> str:
    """" (the CPU)" as the folder's first JSON file records it, else nothing."""
    for path in sorted(folder.glob("*.json")):
        try:
            cpu = json.loads(path.read_text(encoding="utf-8"))["machine"]["cpu"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return f" ({cpu})"
    return ""
