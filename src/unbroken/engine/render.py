"""Response bodies of the OpenAI APIs: stream chunks, usage chunks and full responses of
/v1/completions and /v1/chat/completions, built from the core's outputs."""

from __future__ import annotations

import hashlib
import re
import uuid
import zlib
from typing import Any

from unbroken import __version__
from unbroken.engine.core import Output
from unbroken.engine.request import RequestState
from unbroken.engine.structured import ToolMode, ToolStream, tool_calls_of
from unbroken.engine.textmodel import VOCAB
from unbroken.wire.openai import ChatRequest, CompletionRequest
from unbroken.wire.sse import encode_data, encode_json

__all__ = ["ChatFormat", "CompletionFormat", "Format", "alternatives", "prompt_pieces"]

# The `system_fingerprint` of every answer, as vLLM's `--fingerprint-mode hash`
# (`vllm-<version>-<hash8>`, its hash over the engine's config): the simulator's version and a
# hash of it; a stream has it on its finishing chunk, or on its usage chunk when one follows.
FINGERPRINT = f"unbroken-sim-{__version__}-{hashlib.sha256(__version__.encode()).hexdigest()[:8]}"

_PIECE = re.compile(r"\s*\S+(?:\s+$)?")


def prompt_pieces(text: str) -> list[str]:
    """A prompt as the simulator counts its tokens (`count_tokens`: whitespace-separated
    words), each piece with the whitespace before it, so that the pieces join to `text`."""
    return _PIECE.findall(text) or ([text] if text else [])


def alternatives(token: str, logprob: float, k: int, salt: int) -> list[tuple[str, float]]:
    """The `k` most likely tokens where `token` was chosen with `logprob`, as a model's
    top-k: `token` first, then k-1 other words, deterministic, each less likely than the one
    before (the simulator's choice is its argmax). vLLM returns this many entries (its
    sampled token among them)."""
    if k <= 0:
        return []
    out = [(token, logprob)]
    h = zlib.crc32(token.encode(), salt)
    lead = " " if token.startswith(" ") else ""
    seen = {token}
    step = 1
    while len(out) < k:
        word = lead + VOCAB[(h + 7919 * step) % len(VOCAB)]
        step += 1
        if word in seen:
            continue
        seen.add(word)
        out.append((word, round(out[-1][1] - 0.5 - 0.25 * ((h >> len(out)) % 3), 6)))
    return out


def _prompt_logprob(piece: str) -> float:
    return -round(1.0 + (zlib.crc32(piece.encode()) % 700) / 100.0, 4)


class Format:
    """What completions and chat streams share: usage options, the response envelope and the
    usage chunk."""

    chunk_object = ""
    full_object = ""

    def __init__(
        self,
        req: CompletionRequest | ChatRequest,
        state: RequestState,
        model: str,
        prompt_tokens: int,
    ) -> None:
        self.state, self.model = state, model
        self.prompt_tokens = prompt_tokens  # counted once, by the handler
        self.usage_on = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM: continuous usage only with include_usage (include_usage and continuous_...).
        self.continuous = self.usage_on and bool(
            req.stream_options and req.stream_options.continuous_usage_stats
        )

    def _usage(self) -> dict[str, int]:
        p, c = self.prompt_tokens, sum(self.state.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _envelope(
        self,
        choices: list[dict[str, Any]],
        *,
        usage: bool,
        full: bool = False,
        fingerprint: bool = False,
    ) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.state.request_id,
            "object": self.full_object if full else self.chunk_object,
            "created": self.state.created,
            "model": self.model,
            "choices": choices,
        }
        if full:  # vLLM's order: the fingerprint before usage in an answer, after in a chunk
            obj["system_fingerprint"] = FINGERPRINT
        if usage:
            obj["usage"] = self._usage()
        if fingerprint and not full:
            obj["system_fingerprint"] = FINGERPRINT
        return obj

    def _finishing(self, finish_reason: str | None) -> bool:
        """Whether a chunk carries the fingerprint: as vLLM, a choice's finishing chunk when
        no usage chunk follows (else that one, `usage_chunk`)."""
        return finish_reason is not None and not self.usage_on

    def usage_chunk(self) -> bytes | None:
        if not self.usage_on:
            return None
        return encode_json(self._envelope([], usage=True, fingerprint=True))

    # What `Engine._stream` asks of a stream's format beside its chunks.
    direct = True  # chunks may be written from the core's callback (`RequestState.direct`)

    def end(self) -> bytes:
        """After the last chunk: the usage chunk if asked for, then `[DONE]`."""
        return (self.usage_chunk() or b"") + encode_data(b"[DONE]")

    def fault(self) -> bytes:
        """An injected failure mid-stream: an error event, then `[DONE]`."""
        err = {
            "message": "injected failure mid-stream",
            "type": "internal_server_error",
            "param": None,
            "code": 500,
        }
        return encode_json({"error": err}) + encode_data(b"[DONE]")


class CompletionFormat(Format):
    chunk_object = full_object = "text_completion"

    def __init__(
        self,
        req: CompletionRequest,
        state: RequestState,
        model: str,
        prompts: list[str],
        prompt_tokens: int,
    ) -> None:
        super().__init__(req, state, model, prompt_tokens)
        self.req, self.prompts = req, prompts
        self.offsets = [0] * state.n
        self.echoed = [False] * state.n
        self.lp_echoed = [False] * state.n
        self.lp: list[dict[str, list[Any]]] = [
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for _ in range(state.n)
        ]

    def _prefix(self, i: int) -> str:
        if self.req.echo and not self.echoed[i]:
            self.echoed[i] = True
            return self.prompts[i // self.req.n]
        return ""

    def _logprobs(self, o: Output) -> dict[str, Any] | None:
        k = self.req.logprobs
        if k is None or o.logprob is None:
            return None
        i = o.seq.index
        d: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [] if k else None,
            "text_offset": [],
        }
        if self.req.echo and not self.lp_echoed[i]:
            # vLLM's echo: the prompt's tokens first (the first without a logprob), the
            # offsets then running on through the generated text.
            self.lp_echoed[i] = True
            for j, piece in enumerate(prompt_pieces(self.prompts[i // self.req.n])):
                lp = None if j == 0 else _prompt_logprob(piece)
                d["tokens"].append(piece)
                d["token_logprobs"].append(lp)
                if k:
                    d["top_logprobs"].append(
                        None if lp is None else dict(alternatives(piece, lp, k, j))
                    )
                d["text_offset"].append(self.offsets[i])
                self.offsets[i] += len(piece)
        d["tokens"].append(o.text)
        d["token_logprobs"].append(o.logprob)
        if k:
            d["top_logprobs"].append(dict(alternatives(o.text, o.logprob, k, self.offsets[i])))
        d["text_offset"].append(self.offsets[i])
        self.offsets[i] += len(o.text)
        return d

    def head(self) -> bytes:
        return b""

    def chunk(self, o: Output) -> bytes:
        text = self._prefix(o.seq.index) + o.text
        if not text and o.finish_reason is None:
            return b""
        choice = {
            "index": o.seq.index,
            "text": text,
            "logprobs": self._logprobs(o),
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        return encode_json(
            self._envelope(
                [choice], usage=self.continuous, fingerprint=self._finishing(o.finish_reason)
            )
        )

    def collect(self, o: Output) -> None:
        i = o.seq.index
        self.state.texts[i].append(self._prefix(i) + o.text)
        if (lp := self._logprobs(o)) is not None:
            for k, v in lp.items():
                self.lp[i][k].extend(v or [])

    def full(self) -> dict[str, Any]:
        st = self.state
        choices = [
            {
                "index": i,
                "text": "".join(st.texts[i]),
                "logprobs": self.lp[i] if self.req.logprobs is not None else None,
                "finish_reason": st.finish[i],
                "stop_reason": st.stop_reasons[i],
            }
            for i in range(st.n)
        ]
        return self._envelope(choices, usage=True, full=True)


def tool_call_id() -> str:
    """vLLM's make_tool_call_id: `chatcmpl-tool-` and 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


class ChatFormat(Format):
    chunk_object = "chat.completion.chunk"
    full_object = "chat.completion"

    def __init__(
        self,
        req: ChatRequest,
        state: RequestState,
        model: str,
        prompt_tokens: int,
        tools: ToolMode | None = None,
    ) -> None:
        super().__init__(req, state, model, prompt_tokens)
        self.req = req
        self.lp: list[list[dict[str, Any]]] = [[] for _ in range(state.n)]
        # A forced tool call, and per choice its parser state (`_tool_delta`).
        self.tools = tools
        self.streams: list[ToolStream | None] = [None] * state.n

    def _tool_delta(self, o: Output) -> dict[str, Any] | None:
        """The delta of a forced tool call (vLLM's DeltaToolCall dumps: id, type and name on
        a call's first delta; later ones of "required" say `name: null`, a named call's leave
        it out)."""
        assert self.tools is not None
        i = o.seq.index
        ts = self.streams[i]
        if ts is None:
            ts = self.streams[i] = ToolStream(self.tools, o.seq.script)
        calls: list[dict[str, Any]] = []
        for index, name, args in ts.feed(o.text):
            if name is not None:
                calls.append(
                    {
                        "id": tool_call_id(),
                        "type": "function",
                        "index": index,
                        "function": {"name": name, "arguments": args},
                    }
                )
            elif self.tools.name is None:
                calls.append({"index": index, "function": {"name": None, "arguments": args}})
            else:
                calls.append({"index": index, "function": {"arguments": args}})
        return {"tool_calls": calls} if calls else None

    def _logprobs(self, o: Output) -> dict[str, Any] | None:
        if not self.req.logprobs or o.logprob is None:
            return None
        entry = {"token": o.text, "logprob": o.logprob, "bytes": list(o.text.encode())}
        top = [
            {"token": t, "logprob": lp, "bytes": list(t.encode())}
            for t, lp in alternatives(o.text, o.logprob, self.req.top_logprobs or 0, o.seq.index)
        ]
        return {"content": [{**entry, "top_logprobs": top}]}

    def head(self) -> bytes:
        return b"".join(
            encode_json(
                self._envelope(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    usage=self.continuous,
                )
            )
            for i in range(self.state.n)
        )

    def chunk(self, o: Output) -> bytes:
        if not o.text and o.finish_reason is None:
            return b""
        finish = o.finish_reason
        lp = self._logprobs(o)
        if self.tools is not None:
            d = self._tool_delta(o)
            if d is None and finish is None and lp is None:
                return b""  # vLLM: nothing to stream yet
            delta = d or {}
            ts = self.streams[o.seq.index]
            if finish == "stop" and self.tools.name is None and ts is not None and ts.announced:
                finish = "tool_calls"  # vLLM: "required" calls end so; a named call "stop"
        else:
            delta = {"content": o.text} if o.text or finish is None else {}
        choice = {
            "index": o.seq.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish,
        }
        if o.finish_reason is not None:
            # vLLM sets it on the finishing chunk only (the others are serialised with
            # exclude_unset, so they leave the key out).
            choice["stop_reason"] = o.stop_reason
        return encode_json(
            self._envelope(
                [choice], usage=self.continuous, fingerprint=self._finishing(o.finish_reason)
            )
        )

    def collect(self, o: Output) -> None:
        self.state.texts[o.seq.index].append(o.text)
        if (lp := self._logprobs(o)) is not None:
            self.lp[o.seq.index].extend(lp["content"])

    def full(self) -> dict[str, Any]:
        st = self.state
        choices = [
            {
                "index": i,
                "message": self._message("".join(st.texts[i])),
                "logprobs": {"content": self.lp[i]} if self.req.logprobs else None,
                "finish_reason": "tool_calls"
                if self.tools is not None and self.tools.name is None and st.finish[i] == "stop"
                else st.finish[i],
                "stop_reason": st.stop_reasons[i],
            }
            for i in range(st.n)
        ]
        return self._envelope(choices, usage=True, full=True)

    def _message(self, text: str) -> dict[str, Any]:
        """vLLM's message: a forced tool call's text becomes `tool_calls` (left out when none
        parse, as vLLM's serializer drops an empty list) and the content is ""."""
        if self.tools is None:
            return {"role": "assistant", "content": text}
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        calls = tool_calls_of(text, self.tools)
        if calls:
            msg["tool_calls"] = [
                {
                    "id": tool_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                for name, args in calls
            ]
        return msg
