"""OpenAI request models, shared by the engine (which serves them) and the gateway (which
refuses malformed requests before they reach an engine).

The engine's models are as lax as vLLM 0.32's pydantic models (its default, lax mode):
`"5"` and `5.0` are the integer 5, `"true"`, `"yes"` and `1` are true, `"0"` is the number
0; `"five"`, `5.5` for an integer or a number for a string are still refused. Custom chat
roles pass, as vLLM's custom message parameter takes any role. The gateway does not use
them: it must never refuse what its engine accepts, so `gateway_view` reads only what the
gateway itself needs (model, stream, fan-out) and leaves every other verdict, status and
body, to the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from unbroken.wire.errors import ApiError

__all__ = [
    "MAX_TOKENS_LIMIT",
    "CacheSalted",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "GatewayView",
    "StreamOptions",
    "check_cache_salt",
    "gateway_view",
    "parse_request",
    "usage_of",
    "validation_message",
]

# Beyond any context window served today; the engine applies its own max_model_len.
MAX_TOKENS_LIMIT = 1_048_576

T = TypeVar("T", bound=BaseModel)

NonNegInt = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]


class _Model(BaseModel):
    # Lax, as vLLM's request models (a review against vLLM 0.32 found `max_tokens: "5"`,
    # `stream: "true"`, `n: 2.0`, `seed: "1"` served there and refused here).
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


CACHE_SALT_MAX = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: object) -> None:
    """vLLM 0.32's validate_cache_salt (entrypoints/generate/base/protocol.py), its words:
    a request's `cache_salt` keeps its prompt's KV blocks apart from every other salt's."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > CACHE_SALT_MAX or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        raise ValueError(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL."
        )


class CacheSalted(BaseModel):
    """vLLM's `cache_salt` (chat, completions, the Responses API): checked as vLLM checks it
    (`check_cache_salt`), before the field's own type."""

    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_cache_salt(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_cache_salt(data.get("cache_salt"))
        return data


class _Sampling(_Model, CacheSalted):
    # Optional as in vLLM (`str | None`): absent, null or "" is the served model.
    model: Annotated[str, Field(max_length=512)] | None = None
    stream: bool | None = False  # vLLM's type: `"stream": null` is a plain request
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    user: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _check_sampling(self) -> _Sampling:
        """vLLM 0.32's SamplingParams._verify_args for what the fields above do not bound,
        its words (a review found each served here and refused there)."""
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        rp = self.repetition_penalty
        if rp is not None and not math.isfinite(rp):
            raise ValueError(f"repetition_penalty must be a finite number, got {rp}.")
        if rp is not None and rp <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {rp}.")
        limit = self._limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={limit}, "
                f"got {self.min_tokens}."
            )
        return self

    def _limit(self) -> int | None:
        return None


TokenId = Annotated[int, Field(ge=0)]  # vLLM's: a negative id is a 400


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: NonNegInt | None = 16
    echo: bool = False

    def _limit(self) -> int | None:
        return self.max_tokens or None  # 0 (an echo alone) is judged elsewhere

    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    # vLLM's CustomChatCompletionMessageParam: any role (a custom one renders as its name).
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # vLLM's chat utils join a message's text parts with a newline
        return "\n".join(p.text or "" for p in self.content if p.type == "text")


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def _limit(self) -> int | None:
        return self.token_limit

    @property
    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @model_validator(mode="after")
    def _check_continuation(self) -> ChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        return self


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """First error as (message, param) in OpenAI style."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith("function-"))
    # A model validator's own words, without pydantic's "Value error, " before them.
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return f"'{loc}' is a required property", loc or None
    return (f"{loc}: {msg}" if loc else msg), (loc or None)


def parse_request(model: type[T], body: bytes) -> tuple[T, dict[str, Any]]:
    """Bytes → (validated model, raw dict). Raises ApiError(400) on any malformed input."""
    raw = json_object(body)
    return validate_request(model, raw), raw


def json_object(body: bytes) -> dict[str, Any]:
    """A request body's JSON object; ApiError(400) for anything else."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return raw


def validate_request(model: type[T], raw: dict[str, Any]) -> T:
    """A body's object as `model`; ApiError(400) in OpenAI's words when it is not one."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param, code="invalid_value") from None
    except (ValueError, TypeError, RecursionError) as e:  # pathological inputs
        raise ApiError(400, f"invalid request: {e}", code="invalid_value") from None


@dataclass(frozen=True, slots=True)
class GatewayView:
    """What the gateway needs of a completions or chat request."""

    model: str | None  # None: not given (the engine picks its one model)
    stream: bool
    sequences: int  # prompts x max(n, best_of): the slots the request takes
    raw: dict[str, Any]


_TRUE = {"true", "1", "yes", "on", "t", "y"}
_FALSE = {"false", "0", "no", "off", "f", "n"}


def lax_bool(v: Any) -> bool | None:
    """A boolean as pydantic's lax mode (vLLM's) reads one; None when it is not one."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        low = v.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    return None


def lax_int(v: Any) -> int | None:
    """An integer as pydantic's lax mode reads one ("5", 5.0); None when it is not one."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def gateway_view(body: bytes, chat: bool) -> GatewayView:
    """The gateway's reading of a request body. 400 only for what the gateway cannot route: a
    body that is not a JSON object, or a model that is not a string. An empty `model` is a
    missing one, as vLLM 0.32 takes it (it serves its model; some clients send "" when none
    is configured)."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    model = raw.get("model") or None
    if model is not None and (not isinstance(model, str) or len(model) > 512):
        raise ApiError(400, "model: a string is required", param="model", code="invalid_value")
    # An unreadable `stream` is left to the engine to refuse: sent as a plain request.
    stream = bool(lax_bool(raw.get("stream", False)))
    fan = max(lax_int(raw.get("n")) or 1, lax_int(raw.get("best_of")) or 1, 1)
    prompts = 1
    if not chat:
        p = raw.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            prompts = len(p)
    return GatewayView(model, stream, prompts * fan, raw)


def usage_of(obj: Any) -> tuple[int | None, int | None] | None:
    """(prompt, completion) tokens of an answer or an event: Chat and Completions' `usage`
    (`prompt_tokens`, `completion_tokens`) or the Responses API's (`input_tokens`,
    `output_tokens`, top level or in its events' `response`); None without usage."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if not isinstance(u, dict):
        r = obj.get("response")
        u = r.get("usage") if isinstance(r, dict) else None
        if not isinstance(u, dict):
            return None
    p = u.get("prompt_tokens", u.get("input_tokens"))
    c = u.get("completion_tokens", u.get("output_tokens"))
    return (
        p if isinstance(p, int) and not isinstance(p, bool) else None,
        c if isinstance(c, int) and not isinstance(c, bool) else None,
    )
