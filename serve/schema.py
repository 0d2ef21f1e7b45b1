"""The request bodies the server takes, as pydantic models: OpenAI's fields the engine can honour, checked by type
(strictly: "0.5" is not a number), with the `specchat` extension object that chooses the strategy and its settings.

Fields OpenAI's clients send that change nothing here (`user`, `logit_bias` left empty...) are ignored; a field
asking for what the engine cannot do (`n` above 1, `logprobs`, penalties) is refused rather than silently dropped.
A setting's bounds are the engine's (`sampling.settings.BOUNDS`, the logits processor's): the schema checks types,
the extension's names and the bounds that `sampling.settings.check` states, and leaves the rest to the engine, whose
ValueError the server answers with a 400 too.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sampling.settings import BOUNDS, check
from serve.errors import APIError

MAX_STOP_STRINGS = 16
EXTENSION = "specchat"  # the request's extension object: {"strategy": "speculative", "gamma": 4, ...}
EXTENSION_SWITCHES = ("ignore_eos",)  # decoding switches the extension takes beside the strategy settings


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_engine_message(self) -> dict[str, str]:
        """{"role", "content"} with the text parts joined; OpenAI's "developer" role is the system prompt."""
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationRequest(Strict):
    """What the chat and the completion endpoints share: the decoding settings and the extension."""

    model: str | None = None  # one model pair is served, whatever the name
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # llama.cpp's and vLLM's extensions
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    specchat: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is served (one generation per request)")
        return n

    @field_validator("logprobs")
    @classmethod
    def no_logprobs(cls, logprobs: bool | int | None) -> bool | int | None:
        if logprobs not in (None, False, 0):
            raise ValueError("logprobs are not served")
        return logprobs

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def no_penalty(cls, penalty: float | None) -> float | None:
        if penalty not in (None, 0):
            raise ValueError("penalties are not served (the target's distribution is what speculation keeps)")
        return penalty

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stop

    @field_validator("specchat")
    @classmethod
    def extension(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        for name, value in (options or {}).items():
            if name == "strategy":
                if not isinstance(value, str):
                    raise ValueError(f"strategy must be a strategy's name, got {value!r}")
            elif name in EXTENSION_SWITCHES:
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
            elif name in BOUNDS:
                check(name, value)
            else:
                raise ValueError(f"unknown setting {name!r}; choose from strategy, "
                                 f"{', '.join((*EXTENSION_SWITCHES, *BOUNDS))}")
        return options

    @property
    def strategy(self) -> str | None:
        return (self.specchat or {}).get("strategy")

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def settings(self) -> dict[str, Any]:
        """The engine's settings this request gives (the server's defaults fill in the rest)."""
        given = {"max_new_tokens": self.new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                 "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
                 "stop": [self.stop] if isinstance(self.stop, str) else self.stop}
        extension = {name: value for name, value in (self.specchat or {}).items() if name != "strategy"}
        return {**{name: value for name, value in given.items() if value is not None}, **extension}


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("one prompt per request (a list of one string, or a string)")
        return prompt

    @field_validator("echo")
    @classmethod
    def no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not served")
        return echo

    @field_validator("suffix")
    @classmethod
    def no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (insertion) is not served")
        return suffix

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


Request = TypeVar("Request", bound=GenerationRequest)


def parse(model: type[Request], body: bytes) -> Request:
    """The request in `body`, or an APIError 400 naming the first field that is wrong and why."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise APIError(400, describe(error), param=_param(error)) from None


def describe(error: ValidationError) -> str:
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return f"the body is not valid JSON ({first['ctx'].get('error', 'malformed')})" if first.get("ctx") else \
            "the body is not valid JSON"
    if first["type"] == "model_type" or not first["loc"]:
        return "the body must be a JSON object"
    message = first["msg"].removeprefix("Value error, ")
    return f"{_param(error)}: {message}"


def _param(error: ValidationError) -> str | None:
    loc = error.errors(include_url=False)[0]["loc"]
    # a union's member type (`str`, `list[TextPart]`) is not a field of the body: leave it out of the name
    names = [str(part) for part in loc if not (isinstance(part, str) and ("[" in part or part in ("str", "int")))]
    return ".".join(names) or None
