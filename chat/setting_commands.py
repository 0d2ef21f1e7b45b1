"""The slash-commands that change a setting, derived from its description (`app.settings.SETTINGS`): one handler
parses the words, hands the values to the session, whose settings check their own bounds (a SettingError, worded by
`dispatch`), and says what is set. Two commands do more: /length checks the context's room, /processor parses a
processor with its values."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.settings import Setting, Value
from chat.arguments import UsageError, one_word, parse_float, parse_int, parse_processor, parse_switch
from chat.render import describe_processor
from sampling.settings import StrategySettings

if TYPE_CHECKING:
    from chat.commands import Context
    from chat.session import ChatSettings


def current(settings: ChatSettings, setting: Setting) -> tuple[Any, ...]:
    """The setting's values now."""
    holder = settings.strategy if setting.of == "strategy" else settings
    return tuple(getattr(holder, field) for field in setting.fields)


def parse_values(setting: Setting, arg: str, now: tuple[Any, ...]) -> dict[str, Any]:
    """The command's words as the setting's fields; the fields not given take the dataclass's defaults."""
    if len(setting.values) == 1:
        value = setting.values[0]
        word = arg if value.type is bool else one_word(arg)
        return {value.field: parse_value(value, word, now[0])}
    words = arg.split()
    least = len(setting.values) if setting.required is None else setting.required
    if not least <= len(words) <= len(setting.values):
        raise UsageError(setting.expected)
    defaults = StrategySettings()  # for the values not given
    return {value.field: parse_value(value, words[i], now[i]) if i < len(words) else getattr(defaults, value.field)
            for i, value in enumerate(setting.values)}


def parse_value(value: Value, word: str, now: Any) -> Any:
    if value.type is bool:
        return parse_switch(word, now)
    if word.lower() in value.none:
        return None
    if value.type is int:
        return parse_int(word, value.in_chat)
    if value.type is float:
        return parse_float(word, value.in_chat)
    return word.lower()


def apply(ctx: Context, setting: Setting, changes: dict[str, Any]) -> None:
    """Set the values through the session (its dataclasses check them) and say what is set now."""
    if setting.of == "strategy":
        ctx.session.update_strategy(**changes)
    else:
        ctx.session.update(**changes)
    ctx.console.print(setting.line(*current(ctx.session.settings, setting)))


def handler(setting: Setting) -> Callable[[Context, str], None]:
    """The command for `setting`: its own where it does more, else parse, apply and say."""
    own = OWN.get(setting.name)
    if own is not None:
        return lambda ctx, arg: own(ctx, setting, arg)

    def set_it(ctx: Context, arg: str) -> None:
        apply(ctx, setting, parse_values(setting, arg, current(ctx.session.settings, setting)))

    return set_it


def shown(setting: Setting) -> Callable[[Context], str]:
    """The setting's value as /help shows it."""
    if setting.name == "processor":
        return lambda ctx: describe_processor(ctx.session.settings.processor)
    return lambda ctx: setting.show(*current(ctx.session.settings, setting))


def length(ctx: Context, setting: Setting, arg: str) -> None:
    changes = parse_values(setting, arg, current(ctx.session.settings, setting))
    room = ctx.session.context_length
    if changes["max_new_tokens"] >= room:
        raise UsageError(f"max new tokens must leave room for a prompt in the context of {room} tokens")
    apply(ctx, setting, changes)


def processor(ctx: Context, setting: Setting, arg: str) -> None:
    if arg:
        ctx.session.update(processor=parse_processor(arg))
    ctx.console.print(f"processor: {describe_processor(ctx.session.settings.processor)}")


OWN: dict[str, Callable[[Context, Setting, str], None]] = {"max_new_tokens": length, "processor": processor}
