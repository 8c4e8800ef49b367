"""Response bodies of the OpenAI APIs: stream chunks, usage chunks and full responses of
/v1/completions and /v1/chat/completions, built from the core's outputs."""

from __future__ import annotations

from typing import Any

from unbroken.engine.core import Output
from unbroken.engine.request import RequestState
from unbroken.wire.openai import ChatRequest, CompletionRequest
from unbroken.wire.sse import encode_json

__all__ = ["ChatFormat", "CompletionFormat", "Format"]


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
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def _usage(self) -> dict[str, int]:
        p, c = self.prompt_tokens, sum(self.state.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _envelope(
        self, choices: list[dict[str, Any]], *, usage: bool, full: bool = False
    ) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.state.request_id,
            "object": self.full_object if full else self.chunk_object,
            "created": self.state.created,
            "model": self.model,
            "choices": choices,
        }
        if usage:
            obj["usage"] = self._usage()
        return obj

    def usage_chunk(self) -> bytes | None:
        if not self.usage_on:
            return None
        return encode_json(self._envelope([], usage=True))


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
        if self.req.logprobs is None or o.logprob is None:
            return None
        i = o.seq.index
        d = {
            "tokens": [o.text],
            "token_logprobs": [o.logprob],
            "top_logprobs": [{o.text: o.logprob}] if self.req.logprobs else None,
            "text_offset": [self.offsets[i]],
        }
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
        return encode_json(self._envelope([choice], usage=self.continuous))

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


class ChatFormat(Format):
    chunk_object = "chat.completion.chunk"
    full_object = "chat.completion"

    def __init__(
        self, req: ChatRequest, state: RequestState, model: str, prompt_tokens: int
    ) -> None:
        super().__init__(req, state, model, prompt_tokens)
        self.req = req
        self.lp: list[list[dict[str, Any]]] = [[] for _ in range(state.n)]

    def _logprobs(self, o: Output) -> dict[str, Any] | None:
        if not self.req.logprobs or o.logprob is None:
            return None
        entry = {"token": o.text, "logprob": o.logprob, "bytes": list(o.text.encode())}
        top = [dict(entry)] if self.req.top_logprobs else []
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
        delta = {"content": o.text} if o.text or o.finish_reason is None else {}
        choice = {
            "index": o.seq.index,
            "delta": delta,
            "logprobs": self._logprobs(o),
            "finish_reason": o.finish_reason,
        }
        if o.finish_reason is not None:
            # vLLM sets it on the finishing chunk only (the others are serialised with
            # exclude_unset, so they leave the key out).
            choice["stop_reason"] = o.stop_reason
        return encode_json(self._envelope([choice], usage=self.continuous))

    def collect(self, o: Output) -> None:
        self.state.texts[o.seq.index].append(o.text)
        if (lp := self._logprobs(o)) is not None:
            self.lp[o.seq.index].extend(lp["content"])

    def full(self) -> dict[str, Any]:
        st = self.state
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(st.texts[i])},
                "logprobs": {"content": self.lp[i]} if self.req.logprobs else None,
                "finish_reason": st.finish[i],
                "stop_reason": st.stop_reasons[i],
            }
            for i in range(st.n)
        ]
        return self._envelope(choices, usage=True, full=True)
