"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), which vLLM
0.32 serves beside OpenAI's (vllm/entrypoints/anthropic): Claude Code and the Anthropic SDK
pointed at a vLLM server. As vLLM does it, a request is read as a chat request (`system`
first, then each message's text; a tool call by its name and input, a tool result by its
content) and the chat's outputs are written in Anthropic's shapes:

- a message: `{"id", "type": "message", "role": "assistant", "model", "content": [{"type":
  "text", "text"}], "stop_reason", "stop_sequence", "usage": {"input_tokens",
  "output_tokens"}}`, `stop_reason` from the chat's finish as vLLM maps it (`length` ->
  `max_tokens`, a matched stop string -> `stop_sequence` with the string, else `end_turn`);
- a stream of named events: `message_start` (the message without content, input tokens
  counted), `content_block_start` / `content_block_delta` (`text_delta`) /
  `content_block_stop` for the text block, `message_delta` (stop reason, output tokens),
  `message_stop`; no `[DONE]`;
- errors as Anthropic's body, `{"type": "error", "error": {"type", "message"}}`, vLLM's
  status.

Not served: tools (the simulator answers text: `tools` and `tool_choice` are refused, as a
vLLM started without a tool-call parser refuses chat's), thinking, images.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from unbroken.engine.core import Output
from unbroken.engine.render import Format
from unbroken.engine.request import RequestState
from unbroken.wire.errors import ApiError
from unbroken.wire.openai import ChatRequest

__all__ = ["CountTokensRequest", "MessagesFormat", "MessagesRequest", "anthropic_error", "as_chat"]


class MessagesRequest(BaseModel):
    """vLLM's AnthropicMessagesRequest, the fields the simulator reads (lax, as vLLM's)."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = None
    top_p: float | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None


def anthropic_error(status: int, message: str, kind: str | None = None) -> web.Response:
    """vLLM's translate_error_response: its error type, Anthropic's envelope."""
    kind = kind or {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.json_response(body, status=status)


def _text(content: Any) -> str:
    """A message's or the system's content as text: text blocks, a tool call's name and
    input, a tool result's content, joined by a newline as vLLM joins chat's parts."""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for b in content if isinstance(content, list) else ():
        if not isinstance(b, dict):
            continue
        kind = b.get("type")
        if kind == "text":
            out.append(str(b.get("text", "")))
        elif kind == "tool_use":
            out.append(f"{b.get('name', '')}{orjson.dumps(b.get('input')).decode()}")
        elif kind == "tool_result":
            out.append(_text(b.get("content")))
        elif kind is not None:
            raise ApiError(400, f"content blocks of type {kind!r} are not supported here")
    return "\n".join(out)


def conversation(system: Any, messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(role, text) pairs as chat renders them: the system prompt first."""
    pairs = [("system", _text(system))] if system else []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role: must be 'user' or 'assistant'")
        pairs.append((str(role), _text(m.get("content"))))
    return pairs


def as_chat(req: MessagesRequest) -> ChatRequest:
    """The chat request vLLM makes of it (`to_chat_completion_request`): its messages and
    sampling options (`MessagesFormat` counts a stream's usage from the request's state)."""
    if req.tools or req.tool_choice:
        raise ApiError(
            400,
            "tools are not supported by this server (as a vLLM started without "
            "--enable-auto-tool-choice and --tool-call-parser)",
            param="tools",
        )
    opts: dict[str, Any] = {
        "model": req.model,
        "messages": [{"role": r, "content": t} for r, t in conversation(req.system, req.messages)],
        "max_tokens": req.max_tokens,
        "stream": bool(req.stream),
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
    }
    return ChatRequest.model_validate(opts)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def stop_reason(finish: str | None, stop: int | str | None) -> tuple[str | None, str | None]:
    """vLLM's _to_anthropic_stop_reason, without tools."""
    if finish == "length":
        return "max_tokens", None
    if finish != "stop":
        return None, None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class MessagesFormat(Format):
    """A chat's outputs in Anthropic's shapes (module doc); one choice."""

    def __init__(
        self, req: ChatRequest, state: RequestState, model: str, prompt_tokens: int
    ) -> None:
        super().__init__(req, state, model, prompt_tokens)
        self.req = req
        self.started = False  # the text block's content_block_start is out

    def _message(self, content: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
        reason, seq = stop_reason(finish, self.state.stop_reasons[0])
        return {
            "id": self.state.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": sum(self.state.tokens)},
        }

    def head(self) -> bytes:
        start = self._message([], None)
        start["usage"]["output_tokens"] = 0
        return _event("message_start", {"type": "message_start", "message": start})

    def chunk(self, o: Output) -> bytes:
        out = b""
        if o.text or (o.finish_reason is not None and not self.started):
            if not self.started:
                self.started = True
                block = {"type": "text", "text": ""}
                out += _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": block},
                )
            if o.text:
                delta = {"type": "text_delta", "text": o.text}
                out += _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
        if o.finish_reason is not None:
            reason, seq = stop_reason(o.finish_reason, o.stop_reason)
            out += _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            usage = {"input_tokens": self.prompt_tokens, "output_tokens": sum(self.state.tokens)}
            out += _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": usage,
                },
            )
        return out

    def end(self) -> bytes:
        return _event("message_stop", {"type": "message_stop"})

    def fault(self) -> bytes:
        err = {"type": "api_error", "message": "injected failure mid-stream"}
        return _event("error", {"type": "error", "error": err})

    def collect(self, o: Output) -> None:
        self.state.texts[0].append(o.text)

    def full(self) -> dict[str, Any]:
        text = "".join(self.state.texts[0])
        return self._message([{"type": "text", "text": text}], self.state.finish[0])
