"""Each setting described once (app/settings.py): its flag on both command lines, its chat command and its line in
/help come from the description, and a bad value gets the settings dataclass's own error through the flag and the
command alike, each in its own words."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

import bench
import infer
from app.engine import Engine
from app.flags import decoding
from app.settings import SETTINGS, Setting, flag_of, word_of
from chat.commands import Outcome, build_commands, dispatch
from chat.repl import ChatRepl
from chat.session import ChatSession, ChatSettings, ModelInfo
from sampling.settings import CALIBRATED, StrategySettings
from tests.helpers import load_tiny_pair
from utils.checks import SettingError

FLAGGED = [s for s in SETTINGS if s.flags]
COMMANDED = [s for s in SETTINGS if s.command]
# Settings with a flag and a command that take numbers (a switch flag takes no value to get wrong).
BOTH = [s for s in FLAGGED if s.command and s.values[0].type in (int, float)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("settings"))


@pytest.fixture
def app(pair):
    session = ChatSession(Engine.from_pair(pair), ChatSettings(max_new_tokens=4))
    return ChatRepl(session, Console(file=io.StringIO(), width=300, color_system=None),
                   ModelInfo("target", "drafter", "float32", "cpu"))


def said(app: ChatRepl, line: str) -> str:
    app.console.file.seek(0)
    app.console.file.truncate()
    assert dispatch(app, line) is Outcome.CONTINUE
    return app.console.file.getvalue()


def dataclass_error(setting: Setting, field: str, value) -> SettingError | None:
    """What the setting's dataclass says of `value` for `field` (None: it takes it)."""
    try:
        if setting.of == "strategy":
            StrategySettings(**{field: value})
        else:
            ChatSettings(**{field: value})
    except SettingError as error:
        return error
    return None


def out_of_bounds(setting: Setting, field: str):
    """A value the dataclass refuses for `field`, and its error."""
    for value in (0, -1, 1000, 1.0, -1.0):
        value = float(value) if setting.values[setting.fields.index(field)].type is float else int(value)
        error = dataclass_error(setting, field, value)
        if error is not None:
            return value, error
    raise AssertionError(f"no bad value found for {field}")


def words_with(setting: Setting, field: str, value) -> list[str]:
    """The setting's values as words, `field` set to `value`, the others at their defaults."""
    defaults = StrategySettings()
    return [str(value) if f == field else str(getattr(defaults, f)) for f in setting.fields]


def test_every_flag_is_on_both_command_lines_with_the_setting_dest():
    for parser in (infer.build_parser(), bench.build_parser()):
        options = {option for action in parser._actions for option in action.option_strings}
        dests = {action.dest for action in parser._actions}
        for setting in FLAGGED:
            assert set(setting.flags) <= options, setting.name
            assert setting.dest in dests, setting.name


def test_every_command_comes_from_its_description():
    commands = build_commands()
    for setting in COMMANDED:
        command = commands[setting.command]
        assert (command.usage, command.help) == (setting.usage, setting.help)


def test_the_names_of_settings_flags_and_commands_are_each_given_once():
    for names in ([s.name for s in SETTINGS], [f for s in SETTINGS for f in s.flags],
                  [s.command for s in COMMANDED], [f for s in SETTINGS for f in s.fields]):
        assert len(names) == len(set(names))


def test_the_calibrated_settings_have_flags_without_defaults():
    """Calibration chooses them unless the user gave them; a flag's default would count as given."""
    calibrated = {field for setting in FLAGGED if setting.calibrated for field in setting.fields}
    assert calibrated == set(CALIBRATED)
    args = infer.build_parser().parse_args([])
    assert all(getattr(args, s.dest) is None for s in FLAGGED if s.calibrated)
    assert decoding(args).explicit == frozenset()
    given = infer.build_parser().parse_args(["--gamma", "5", "--verify-width", "9"])
    assert decoding(given).explicit == {"gamma", "verify_width"}


def test_help_lists_each_setting_once_with_its_description_and_value(app):
    lines = said(app, "/help").splitlines()
    for setting in COMMANDED:
        rows = [line for line in lines if line.startswith(setting.usage + " ")]
        assert len(rows) == 1, setting.usage
        assert re.sub(r"\s+", " ", rows[0]).startswith(f"{setting.usage} {setting.help[:40]}")
    gamma = next(line for line in lines if line.startswith("/gamma N"))
    assert gamma.rstrip().endswith(str(app.session.settings.strategy.gamma))


@pytest.mark.parametrize("setting", BOTH, ids=lambda s: s.name)
def test_a_bad_value_gets_the_dataclass_error_through_the_flag_and_the_command(app, capsys, setting):
    for field in setting.fields:
        value, error = out_of_bounds(setting, field)
        words = words_with(setting, field, value)
        assert infer.main([setting.flags[0], *words, "--prompt", "hi"]) == infer.USAGE_EXIT
        assert f"{flag_of(field)} {error.requirement}, got {value}" in capsys.readouterr().err
        before = app.session.settings
        text = said(app, f"/{setting.command} {' '.join(words)}")
        assert f"{word_of(field)} {error.requirement}, got {value!r}  (usage: {setting.usage})" in text
        assert app.session.settings == before


@pytest.mark.parametrize("setting", [s for s in BOTH if s.of == "strategy"], ids=lambda s: s.name)
def test_a_good_value_sets_the_same_field_through_the_flag_and_the_command(app, setting):
    field = setting.fields[-1]
    default = getattr(StrategySettings(), field)
    value = next(v for v in (default + 1, default - 1, default / 2) if dataclass_error(setting, field, v) is None)
    words = words_with(setting, field, value)
    args = infer.build_parser().parse_args([setting.flags[0], *words])
    assert getattr(decoding(args).strategy, field) == value
    said(app, f"/{setting.command} {' '.join(words)}")
    assert getattr(app.session.settings.strategy, field) == value


def test_a_switch_flag_sets_its_field_either_way_and_leaves_the_default_where_not_given():
    parse = infer.build_parser().parse_args
    assert StrategySettings().head_lookup and not StrategySettings().typical
    assert decoding(parse([])).strategy == StrategySettings()
    assert not decoding(parse(["--no-head-lookup"])).strategy.head_lookup
    assert decoding(parse(["--head-lookup", "--typical"])).strategy.typical


def test_the_flag_and_the_word_of_a_field_of_a_setting_of_several_values():
    assert (flag_of("lookahead_ngram"), word_of("lookahead_ngram")) == ("--lookahead N", "n-gram size N")
    assert (flag_of("gamma"), word_of("max_new_tokens")) == ("--gamma", "max new tokens")
    assert (flag_of("ngram_n"), word_of("top_k")) == ("ngram_n", "top_k")  # no flag; no command of its own


def test_gamma_has_an_upper_bound_through_the_flag_and_the_command(app, capsys):
    """Bug: `/gamma 100000` and `--gamma 100000` were taken (no bound above), and exported as
    `num_speculative_tokens 100000`."""
    assert StrategySettings(gamma=64).gamma == 64
    with pytest.raises(SettingError, match="gamma must be an integer from 1 to 64, got 65"):
        StrategySettings(gamma=65)
    assert infer.main(["--gamma", "100000", "--prompt", "hi"]) == infer.USAGE_EXIT
    assert "--gamma must be an integer from 1 to 64, got 100000" in capsys.readouterr().err
    before = app.session.settings
    assert "gamma must be an integer from 1 to 64, got 100000" in said(app, "/gamma 100000")
    assert app.session.settings == before
    said(app, "/gamma 64")
    assert app.session.settings.strategy.gamma == 64
