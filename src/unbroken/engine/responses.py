"""vLLM 0.32's OpenAI Responses API (`POST /v1/responses`) for an ordinary chat model (vLLM's
non-harmony `SimpleContext` path): the request model, the conversation it renders, the
response object and SSE events built from the core's outputs, and the store.

The text is the simulator's for the rendered conversation, so a Responses request and a chat
request of the same messages and limit answer byte for byte the same text (a gateway's
misrouting shows). As vLLM, `store` is honoured only with VLLM_ENABLE_RESPONSES_API_STORE=1;
vLLM's store never forgets (its own FIXME: a leak), this one keeps the newest
`STORE_MAX` responses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from aiohttp import web
from pydantic import ConfigDict, Field

from unbroken.engine import structured
from unbroken.engine.core import Output
from unbroken.engine.render import alternatives, tool_call_id
from unbroken.engine.request import RequestState, max_tokens_for
from unbroken.wire.errors import ApiError
from unbroken.wire.openai import CacheSalted

__all__ = [
    "STORE_ENV",
    "ResponsesAPI",
    "ResponsesFormat",
    "ResponsesRequest",
    "conversation",
    "output_limit",
    "random_id",
]

log = logging.getLogger("unbroken.engine")

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
STORE_MAX_ENV = "UNBROKEN_RESPONSES_STORE_MAX"
STORE_MAX = 1024

_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below it, sampling is greedy and top_p is reset to 1


def random_id() -> str:
    """vLLM's random_uuid: 16 hex digits."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def store_enabled() -> bool:
    """vLLM's `bool(int(os.getenv("VLLM_ENABLE_RESPONSES_API_STORE", "0")))`; a value that is
    not an integer (which stops vLLM) reads as off."""
    try:
        return bool(int(os.environ.get(STORE_ENV, "0")))
    except ValueError:
        log.warning("%s is not an integer: the store stays off", STORE_ENV)
        return False


class ResponsesRequest(CacheSalted):
    """vLLM's ResponsesRequest, the fields the simulator acts on or echoes; unknown fields are
    accepted and ignored (vLLM's OpenAIBaseModel). Strict types, as the engine's other
    request models."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: Annotated[str, Field(max_length=512)] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = 0
    truncation: Literal["auto", "disabled"] | None = "disabled"
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    prompt: dict[str, Any] | None = None
    # vLLM's extra: the response's id (default resp_ and 16 hex digits).
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    # -- what Engine._seqs and _salt read of a request --------------------------------------
    @property
    def n(self) -> int:
        return 1

    @property
    def min_tokens(self) -> int:
        return 0  # not a Responses parameter in vLLM

    @property
    def greedy(self) -> bool:
        return (self.temperature is not None and self.temperature < _EPS) or self.top_k == 1

    @property
    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    @property
    def logprobs(self) -> bool:
        """vLLM's is_include_output_logprobs."""
        return bool(self.include) and "message.output_text.logprobs" in (self.include or [])


def _bad(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported")


def vllm_error(status: int, message: str, type_: str, param: str | None) -> web.Response:
    """vLLM's ErrorResponse: its own type names and the status as the code."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def not_found(response_id: str) -> web.Response:
    return vllm_error(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


# -- validation ------------------------------------------------------------------------------
_TEXT_FORMATS = ("text", "json_object", "json_schema")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")
_INCLUDES = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
)


def validate(req: ResponsesRequest, enable_store: bool) -> None:
    """What vLLM refuses (its messages), then what the simulator cannot do (400, `code:
    unsupported`, as chat's structured output)."""
    if req.prompt is not None:
        raise _bad("prompt template is not supported", "prompt")
    if req.background and req.store is False:
        raise _bad("background can only be used when `store` is true", "background")
    for item in req.include or []:
        if item not in _INCLUDES:
            raise _bad(f"include: unknown value {item!r}", "include")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise _bad(f"temperature must be in [0, 2], got {req.temperature}.", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {req.top_p}.", "top_p")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {req.max_output_tokens}.", "max_tokens")
    tools = req.tools or []
    for t in tools:
        if not isinstance(t.get("type"), str):
            raise _bad("tools: each tool needs a type", "tools")
        if t["type"] == "custom" and isinstance(f := t.get("format"), dict):
            if f.get("type") == "grammar":
                raise _bad(
                    "Custom tools with a grammar format are not supported; only free-form "
                    "text custom tools are accepted.",
                    "tools",
                )
    choice = req.tool_choice
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not tools:
        if choice == "required":
            raise _bad(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
            )
        if named:
            raise _bad("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise _bad(f"tool_choice: unknown value {choice!r}", "tool_choice")
    text = req.text or {}
    fmt = text.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in _TEXT_FORMATS:
            raise _bad("text.format: type must be text, json_object or json_schema", "text")
        if fmt["type"] == "json_schema" and (
            not isinstance(fmt.get("name"), str) or fmt.get("schema") is None
        ):
            raise _bad("text.format: a json_schema format needs a name and a schema", "text")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise _bad("text.verbosity must be low, medium or high", "text")
    r = req.reasoning or {}
    if r.get("effort") not in (None, *_EFFORTS):
        raise _bad(f"reasoning.effort must be one of {', '.join(_EFFORTS)}", "reasoning")
    for k in ("summary", "generate_summary"):
        if r.get(k) not in (None, *_SUMMARIES):
            raise _bad(f"reasoning.{k} must be auto, concise or detailed", "reasoning")
    if req.background and not enable_store:
        raise ApiError(
            400,
            "This vLLM engine does not support `store=True` and therefore does not support "
            "the background mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            param="background",
        )
    if req.background and req.stream:
        raise _unsupported("background streaming is not supported by the simulator", "background")


def constraint(
    req: ResponsesRequest,
) -> tuple[structured.Constraint | None, structured.ToolMode | None]:
    """vLLM's: a forced tool call (required, or a named function) constrains the output to
    the function's parameters (or the array of calls) as chat's does, replacing `text.format`
    (`tool_calling_response`); otherwise text.format json_object / json_schema, or vLLM's
    `structured_outputs` (not both)."""
    fns = [
        {"name": t.get("name"), "parameters": t.get("parameters")}
        for t in req.tools or []
        if t.get("type") == "function" and isinstance(t.get("name"), str)
    ]
    choice = req.tool_choice
    mode: structured.ToolMode | None = None
    schema: Any = None
    if isinstance(choice, dict) and choice.get("type") == "custom" and req.tools:
        raise _unsupported(
            "forced custom tool calls are not supported by the simulator", "tool_choice"
        )
    if isinstance(choice, dict) and choice.get("type") == "function" and req.tools:
        name = choice.get("name")
        match = [f for f in fns if f["name"] == name]
        if not match:
            raise _bad(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
        schema = structured.params_schema(match[0])
        mode = structured.ToolMode(name)
    elif choice == "required" and fns:
        schema = structured.required_schema(fns, req.parallel_tool_calls)
        mode = structured.ToolMode(None)
    if mode is not None:
        c = structured.Constraint("json", structured.schema_value(schema))
        c.check()
        req.text = {
            "format": {
                "name": "tool_calling_response",
                "schema": schema,
                "type": "json_schema",
                "description": None,
                "strict": True,
            },
            "verbosity": None,
        }
        return c, mode
    fmt = (req.text or {}).get("format")
    so = getattr(req, "structured_outputs", None)
    if fmt is not None and so is not None:
        raise _bad("Cannot specify both structured_outputs and text.format", "structured_outputs")
    if fmt is None or fmt.get("type") == "text":
        return structured.completion_constraint({"structured_outputs": so}), None
    if fmt["type"] == "json_object":
        c = structured.Constraint("json_object")
    else:
        c = structured.Constraint("json", structured.schema_value(fmt["schema"]))
    c.check()
    return c, None


# -- the conversation ------------------------------------------------------------------------
Message = dict[str, Any]  # {"role": ..., "content": str | None}


def _part_text(part: Any, i: int) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise _bad(f"input[{i}].content: each part needs a type", "input")
    kind = part["type"]
    if kind in ("input_text", "output_text"):
        if not isinstance(part.get("text"), str):
            raise _bad(f"input[{i}].content: a {kind} part needs a text", "input")
        return part["text"]
    if kind == "refusal":
        return part.get("refusal") or ""
    if kind in ("input_image", "input_file", "input_audio"):
        raise _unsupported(f"{kind} is not supported by the simulator (text only)", "input")
    raise _bad(f"input[{i}].content: unknown part type {kind!r}", "input")


def _item_message(item: Any, i: int, prev: Message | None) -> Message | None:
    """vLLM's _construct_message_from_response_item for the item types a chat model takes;
    None where the item merged into `prev` (a tool call or reasoning after an assistant
    message)."""
    if not isinstance(item, dict):
        raise _bad(f"input[{i}] must be an object", "input")
    kind = item.get("type", "message")
    assistant = prev if prev is not None and prev["role"] == "assistant" else None
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise _bad(f"input[{i}].role must be user, assistant, system or developer", "input")
        content = item.get("content")
        if isinstance(content, str):
            return {"role": role, "content": content}
        if not isinstance(content, list):
            raise _bad(f"input[{i}].content must be a string or a list of parts", "input")
        texts = [_part_text(p, i) for p in content]
        if role == "assistant":
            # vLLM reads an output message's first part only.
            text = texts[0] if texts else ""
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
        return {"role": role, "content": "\n".join(texts)}  # as chat joins its text parts
    if kind in ("function_call", "custom_tool_call"):
        if assistant is not None:
            return None  # vLLM adds the call to the assistant message before it
        return {"role": "assistant", "content": None}
    if kind in ("function_call_output", "custom_tool_call_output"):
        out = item.get("output")
        return {"role": "tool", "content": out if isinstance(out, str) else ""}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise _bad("Encrypted content is not supported.", "input")
        if assistant is not None and "reasoning" not in assistant:
            assistant["reasoning"] = True
            return None
        return {"role": "assistant", "content": None, "reasoning": True}
    raise _unsupported(f"input items of type {kind!r} are not supported by the simulator", "input")


def _continues(items: list[dict[str, Any]]) -> bool:
    """vLLM's should_continue_final_message: a final message or reasoning item whose status
    is in_progress or incomplete is continued, not answered."""
    if not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress",
        "incomplete",
    )


@dataclass
class Stored:
    """A stored response and the messages it was generated from (vLLM's response_store and
    msg_store)."""

    response: dict[str, Any]
    messages: list[Message]


def conversation(req: ResponsesRequest, prev: Stored | None) -> tuple[list[Message], bool]:
    """vLLM's construct_input_messages: the instructions as a system message, the previous
    conversation without its system messages (instructions do not carry over), the previous
    response's output messages, then the new input. Returns (messages, continue_final)."""
    messages: list[Message] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if prev is not None:
        messages += [dict(m) for m in prev.messages if m["role"] != "system"]
        for item in prev.response["output"]:
            if item.get("type") == "message":
                messages += [{"role": "assistant", "content": c["text"]} for c in item["content"]]
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages, False
    new: list[Message] = []
    for i, item in enumerate(req.input):
        m = _item_message(item, i, new[-1] if new else None)
        if m is not None:
            new.append(m)
    return messages + new, _continues(req.input)


def chat_pairs(messages: list[Message]) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content") or "") for m in messages]


def output_limit(prompt_tokens: int, requested: int | None, max_model_len: int) -> int:
    """vLLM's Responses limits: max_output_tokens beyond max_model_len, or a prompt longer
    than it, refused as chat's max_tokens is (TokenizeParams); a prompt that fills the
    context refused in the words of _validate_generator_input; else max_output_tokens is
    clipped to the context left (get_max_tokens)."""
    if prompt_tokens == max_model_len and (requested or 0) <= max_model_len:
        raise ApiError(
            400,
            f"The engine prompt length {prompt_tokens} exceeds the max_model_len "
            f"{max_model_len}. Please reduce prompt.",
            param="input",
        )
    return max_tokens_for(prompt_tokens, requested, max_model_len, "max_output_tokens")


# -- the response object and its events --------------------------------------------------------
def _tool(t: dict[str, Any]) -> dict[str, Any]:
    """A function tool as vLLM echoes it (openai's FunctionTool dumped); other tools as sent."""
    if t.get("type") != "function":
        return t
    return {
        "name": t.get("name"),
        "parameters": t.get("parameters"),
        "strict": t.get("strict"),
        "type": "function",
        "allowed_callers": t.get("allowed_callers"),
        "async": t.get("async"),
        "defer_loading": t.get("defer_loading"),
        "description": t.get("description"),
        "output_schema": t.get("output_schema"),
    }


def _sse(event: dict[str, Any]) -> bytes:
    """vLLM's framing: an `event:` line naming the type, then the JSON."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponsesFormat:
    """The Responses body for one request, with the interface of ChatFormat (head, chunk,
    usage_chunk, collect, full). Events follow vLLM's SimpleStreamingEventProcessor for a
    text answer; the final response reuses the streamed item (vLLM's streamed_output_items)."""

    def __init__(
        self,
        req: ResponsesRequest,
        state: RequestState,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        messages: list[Message],
        store: ResponsesAPI | None,
        tools: structured.ToolMode | None = None,
    ) -> None:
        self.req, self.state, self.model = req, state, model
        # A forced tool call: its output is function_call items (vLLM's parser reads the
        # text), streamed with function_call_arguments events.
        self.tools = tools
        self.ts: structured.ToolStream | None = None
        self.calls: list[dict[str, Any]] = []
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.messages, self.store = messages, store
        self.seq = 0
        self.item_id = ""
        self.text: list[str] = []
        self.lps: list[dict[str, Any]] = []
        self.open = False
        self.output: list[dict[str, Any]] | None = None  # the streamed items, once closed
        self.cached = 0
        self.created = state.created

    # -- pieces -------------------------------------------------------------------------
    def response(self, status: str, output: list[dict[str, Any]], usage: bool) -> dict[str, Any]:
        """vLLM's ResponsesResponse.from_request, its fields in its order."""
        r = self.req
        temperature = 1.0 if r.temperature is None else float(r.temperature)
        top_p = 1.0 if r.top_p is None or temperature < _EPS else float(r.top_p)
        text = None
        if r.text is not None:
            fmt = r.text.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
                # openai's ResponseFormatTextJSONSchemaConfig as vLLM dumps it
                fmt = {
                    "name": fmt.get("name"),
                    "schema": fmt.get("schema"),
                    "type": "json_schema",
                    "description": fmt.get("description"),
                    "strict": fmt.get("strict"),
                }
            text = {"format": fmt, "verbosity": r.text.get("verbosity")}
        reasoning = None
        if r.reasoning is not None:
            reasoning = {
                k: r.reasoning.get(k)
                for k in ("context", "effort", "generate_summary", "mode", "summary")
            }
        tools = [_tool(t) for t in r.tools or []]
        return {
            "id": self.state.request_id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": r.instructions,
            "metadata": r.metadata,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "temperature": temperature,
            # vLLM: without tools, "auto" (the default) reads as "none".
            "tool_choice": r.tool_choice if tools else "none",
            "tools": tools,
            "top_p": top_p,
            "background": bool(r.background),
            "max_output_tokens": self.max_tokens,
            "max_tool_calls": r.max_tool_calls,
            "previous_response_id": r.previous_response_id,
            "prompt": None,
            "reasoning": reasoning,
            "service_tier": r.service_tier,
            "status": status,
            "text": text,
            "top_logprobs": (r.top_logprobs or 0) if r.logprobs else None,
            "truncation": r.truncation or "disabled",
            "usage": self._usage() if usage else None,
            "user": r.user,
            "presence_penalty": float(r.presence_penalty or 0.0),
            "frequency_penalty": float(r.frequency_penalty or 0.0),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _usage(self) -> dict[str, Any]:
        p, n = self.prompt_tokens, sum(self.state.tokens)
        return {
            "input_tokens": p,
            "input_tokens_details": {
                "cached_tokens": self.cached,
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": n,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": p + n,
        }

    def _status(self) -> str:
        return "incomplete" if self.state.finish[0] == "length" else "completed"

    def _logprob(self, o: Output) -> dict[str, Any] | None:
        if not self.req.logprobs or o.logprob is None:
            return None
        k = self.req.top_logprobs or 0
        top = alternatives(o.text, o.logprob, k, o.seq.index) if k else []
        return {
            "token": o.text,
            "bytes": list(o.text.encode()),
            "logprob": o.logprob,
            "top_logprobs": [
                {"token": t, "bytes": list(t.encode()), "logprob": lp} for t, lp in top
            ],
        }

    def _part(self, final: bool) -> dict[str, Any]:
        return {
            "annotations": [],
            "text": "".join(self.text),
            "type": "output_text",
            "logprobs": (self.lps or None) if final else [],
        }

    def _message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
            "phase": None,
        }

    def _event(self, event: dict[str, Any]) -> bytes:
        """Numbered in order of sending. The keys keep the order of openai's models (which
        vLLM dumps): `sequence_number` comes right before `type` unless an event holds its
        place (output_text.done's `text` sorts after it)."""
        if "sequence_number" in event:
            event["sequence_number"] = self.seq
        else:
            kind = event.pop("type")
            event["sequence_number"] = self.seq
            event["type"] = kind
        self.seq += 1
        return _sse(event)

    def _save(self, response: dict[str, Any]) -> None:
        if self.store is not None and self.req.store:
            self.store.save(response, self.messages)

    # -- the ChatFormat interface -------------------------------------------------------------
    def head(self) -> bytes:
        initial = self.response("in_progress", [], usage=False)
        return self._event({"response": initial, "type": "response.created"}) + self._event(
            {"response": initial, "type": "response.in_progress"}
        )

    def _call(
        self, name: str, arguments: str, status: str, item_id: str, call_id: str
    ) -> dict[str, Any]:
        """A function_call item, vLLM's fields in its order."""
        return {
            "arguments": arguments,
            "call_id": call_id,
            "name": name,
            "type": "function_call",
            "id": item_id,
            "async": None,
            "caller": None,
            "namespace": None,
            "status": status,
        }

    def _tool_chunk(self, o: Output) -> bytes:
        assert self.tools is not None
        if self.ts is None:
            self.ts = structured.ToolStream(self.tools, o.seq.script)
        self.text.append(o.text)
        parts = []
        for index, name, args in self.ts.feed(o.text):
            if name is not None:
                call = {"name": name, "arguments": "", "id": f"fc_{random_id()}"}
                call["call_id"] = tool_call_id()
                self.calls.append(call)
                item = self._call(name, "", "in_progress", call["id"], call["call_id"])
                parts.append(
                    self._event(
                        {"item": item, "output_index": index, "type": "response.output_item.added"}
                    )
                )
            call = self.calls[index]
            if args:
                call["arguments"] += args
                parts.append(
                    self._event(
                        {
                            "delta": args,
                            "item_id": call["id"],
                            "output_index": index,
                            "type": "response.function_call_arguments.delta",
                        }
                    )
                )
        return b"".join(parts)

    def _tool_close(self) -> list[bytes]:
        parts = []
        assert self.output is not None
        for index, call in enumerate(self.calls):
            parts.append(
                self._event(
                    {
                        "arguments": call["arguments"],
                        "item_id": call["id"],
                        "output_index": index,
                        "sequence_number": None,
                        "type": "response.function_call_arguments.done",
                        "name": call["name"],
                    }
                )
            )
            item = self._call(
                call["name"], call["arguments"], "completed", call["id"], call["call_id"]
            )
            parts.append(
                self._event(
                    {"item": item, "output_index": index, "type": "response.output_item.done"}
                )
            )
            self.output.append(item)
        return parts

    def chunk(self, o: Output) -> bytes:
        self.cached = o.seq.cached_tokens
        if self.tools is not None:
            return self._tool_chunk(o)
        if not o.text:
            return b""  # vLLM: a delta without content opens nothing
        parts = []
        if not self.open:
            self.open = True
            self.item_id = f"msg_{random_id()}"
            ids = {"output_index": 0}
            parts.append(
                self._event(
                    {
                        "item": self._message("in_progress", []),
                        **ids,
                        "type": "response.output_item.added",
                    }
                )
            )
            parts.append(
                self._event(
                    {
                        "content_index": 0,
                        "item_id": self.item_id,
                        **ids,
                        "part": self._part(final=False),
                        "type": "response.content_part.added",
                    }
                )
            )
        self.text.append(o.text)
        lp = self._logprob(o)
        if lp is not None:
            self.lps.append(lp)
        stream_lps = (
            []
            if lp is None
            else [
                {
                    "token": lp["token"],
                    "logprob": lp["logprob"],
                    "top_logprobs": [
                        {"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]
                    ],
                }
            ]
        )
        parts.append(
            self._event(
                {
                    "content_index": 0,
                    "delta": o.text,
                    "item_id": self.item_id,
                    "logprobs": stream_lps,
                    "output_index": 0,
                    "type": "response.output_text.delta",
                }
            )
        )
        return b"".join(parts)

    # What `Engine._stream` asks of a stream's format beside its chunks: vLLM's Responses
    # stream has no `[DONE]`, and its events are numbered as they are sent, so none is
    # written from the core's callback.
    direct = False

    def end(self) -> bytes:
        return self.usage_chunk()

    def fault(self) -> bytes:
        return self._event(
            {
                "type": "error",
                "code": "injected_fault",
                "message": "injected failure mid-stream",
                "param": None,
            }
        )

    def usage_chunk(self) -> bytes:
        """The closing events and response.completed (whatever the status, as vLLM)."""
        parts = []
        self.output = []
        if self.tools is not None:
            parts += self._tool_close()
        elif self.open:
            part = self._part(final=True)
            text = part["text"]
            parts.append(
                self._event(
                    {
                        "content_index": 0,
                        "item_id": self.item_id,
                        "logprobs": [],
                        "output_index": 0,
                        "sequence_number": None,
                        "text": text,
                        "type": "response.output_text.done",
                    }
                )
            )
            parts.append(
                self._event(
                    {
                        "content_index": 0,
                        "item_id": self.item_id,
                        "output_index": 0,
                        "part": part,
                        "type": "response.content_part.done",
                    }
                )
            )
            item = self._message("completed", [part] if text else [])
            parts.append(
                self._event({"item": item, "output_index": 0, "type": "response.output_item.done"})
            )
            self.output = [item]
        final = self.response(self._status(), self.output, usage=True)
        self._save(final)
        parts.append(self._event({"response": final, "type": "response.completed"}))
        return b"".join(parts)

    def collect(self, o: Output) -> None:
        self.cached = o.seq.cached_tokens
        self.text.append(o.text)
        if (lp := self._logprob(o)) is not None:
            self.lps.append(lp)

    def full(self) -> dict[str, Any]:
        self.item_id = f"msg_{random_id()}"
        text = "".join(self.text)
        if self.tools is not None:
            calls = structured.tool_calls_of(text, self.tools) or []
            output = [
                self._call(name, args, "completed", f"fc_{random_id()}", tool_call_id())
                for name, args in calls
            ]
            resp = self.response(self._status(), output, usage=True)
            self._save(resp)
            return resp
        part = {
            "annotations": [],
            "text": text,
            "type": "output_text",
            "logprobs": self.lps if self.req.logprobs else None,
        }
        # vLLM's fallback (no parser): one message, its content empty for an empty answer.
        resp = self.response(
            self._status(), [self._message("completed", [part] if text else [])], usage=True
        )
        self._save(resp)
        return resp


# -- the store ---------------------------------------------------------------------------------
class ResponsesAPI:
    """The store and the routes around it: GET /v1/responses/{id}, POST .../cancel, and
    background requests. Off (nothing kept, every id 404) unless VLLM_ENABLE_RESPONSES_API_STORE
    is set, as in vLLM."""

    def __init__(self, enabled: bool | None = None, limit: int | None = None) -> None:
        self.enabled = store_enabled() if enabled is None else enabled
        if limit is None:
            try:
                limit = int(os.environ.get(STORE_MAX_ENV, STORE_MAX))
            except ValueError:
                log.warning("%s is not an integer: keeping %d responses", STORE_MAX_ENV, STORE_MAX)
                limit = STORE_MAX
        self.limit = max(1, limit)
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        if self.enabled:
            log.warning(
                "`%s` is enabled: the newest %d responses are kept in memory",
                STORE_ENV,
                self.limit,
            )

    def effective_store(self, req: ResponsesRequest) -> None:
        """vLLM silently turns store off when the store is disabled (store=True is the
        default and most callers do not mean it)."""
        if req.store and not self.enabled:
            req.store = False

    def previous(self, req: ResponsesRequest) -> Stored | None:
        rid = req.previous_response_id
        if rid is None:
            return None
        return self.items[rid]  # KeyError: the handler answers vLLM's 404

    def save(self, response: dict[str, Any], messages: list[Message]) -> None:
        rid = response["id"]
        old = self.items.get(rid)
        if old is not None and old.response["status"] == "cancelled":
            return  # vLLM: a cancelled response stays cancelled
        self.items[rid] = Stored(response, messages)
        self.items.move_to_end(rid)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def start_background(
        self, fmt: ResponsesFormat, run: Coroutine[Any, Any, None]
    ) -> web.Response:
        """vLLM's background mode: answer `queued` at once, generate in a task."""
        queued = fmt.response("queued", [], usage=False)
        self.save(queued, fmt.messages)
        rid = queued["id"]

        async def task() -> None:
            try:
                await run
            except ApiError:
                stored = self.items.get(rid)
                if stored is not None and stored.response["status"] not in (
                    "completed",
                    "cancelled",
                ):
                    stored.response["status"] = "failed"

        t = asyncio.get_running_loop().create_task(task(), name=f"create_{rid}")
        self.tasks[rid] = t
        t.add_done_callback(lambda _: self.tasks.pop(rid, None))
        return web.Response(body=orjson.dumps(queued), content_type="application/json")

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        stored = self.items.get(rid)
        if stored is None:
            return not_found(rid)
        if request.query.get("stream", "").lower() in ("true", "1"):
            raise _unsupported(
                "streaming a stored response is not supported by the simulator", "stream"
            )
        return web.Response(body=orjson.dumps(stored.response), content_type="application/json")

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        stored = self.items.get(rid)
        if stored is None:
            return not_found(rid)
        if stored.response["status"] not in ("queued", "in_progress"):
            return vllm_error(
                400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id"
            )
        stored.response["status"] = "cancelled"
        if (t := self.tasks.get(rid)) is not None:
            t.cancel()  # the task's finally releases the engine's request
            try:
                await t
            except asyncio.CancelledError:
                pass
        return web.Response(body=orjson.dumps(stored.response), content_type="application/json")
