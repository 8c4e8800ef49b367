"""Loop-side state of one HTTP request, and its ids."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

from unbroken.engine.core import Output
from unbroken.wire.errors import ApiError

__all__ = ["INT64_MAX", "INT64_MIN", "RequestState", "client_request_id", "max_tokens_for"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A direct write goes out only while the client's socket holds less than this unsent (below
# asyncio's default high-water mark, so it never needs to wait).
DIRECT_LIMIT = 64 * 1024


def client_request_id(header: str | None) -> str:
    """vLLM's convention: a caller's X-Request-Id becomes the response id. Used for the
    response and the logs only: two requests may carry the same one."""
    rid = header or ""
    return rid if 0 < len(rid) <= 128 and rid.isprintable() else uuid.uuid4().hex


def _vllm_invalid(message: str, param: str, value: int, code: str = "invalid_value") -> ApiError:
    """A 400 in the words of vLLM's VLLMValidationError (its parameter and value appended)."""
    return ApiError(400, f"{message} (parameter={param}, value={value})", param=param, code=code)


def max_tokens_for(
    prompt_tokens: int,
    requested: int | None,
    max_model_len: int,
    param: str,
    *,
    token_prompt: bool = False,
) -> int:
    """A sequence's max_tokens as vLLM 0.32 sets it: TokenizeParams refuses a `param`
    (max_tokens, max_completion_tokens, max_output_tokens) beyond max_model_len and a prompt
    that alone exceeds it (a text prompt is tokenized truncated to max_model_len + 1, hence
    its "at least"; a `token_prompt` is counted whole); get_max_tokens then clips the request
    to the context left, and a prompt that fills the context leaves 0, which SamplingParams
    refuses. A requested 0 (completions' echo) stays 0."""
    if requested is not None and requested > max_model_len:
        raise _vllm_invalid(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
            requested,
        )
    if prompt_tokens > max_model_len:
        n = prompt_tokens if token_prompt else max_model_len + 1
        raise _vllm_invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {'' if token_prompt else 'at least '}{n} input tokens, which "
            "exceeds this limit even without any output tokens. Please reduce the length of "
            "the input prompt.",
            "input_tokens",
            n,
            code="context_length_exceeded",
        )
    left = max_model_len - prompt_tokens
    limit = left if requested is None else min(requested, left)
    if limit < 1 and requested != 0:
        raise _vllm_invalid(f"max_tokens must be at least 1, got {limit}.", "max_tokens", limit)
    return limit


class RequestState:
    """Outputs handed over by the core, per choice. `request_id` is what the client sees;
    `key` is unique within the process and names the request to the core (aborts, tracking),
    so a client reusing an id cannot abort or hijack another request."""

    __slots__ = (
        "arrival",
        "created",
        "direct",
        "event",
        "fail_after",
        "finish",
        "first",
        "key",
        "last",
        "n",
        "pending",
        "remaining",
        "render",
        "request_id",
        "stop_reasons",
        "texts",
        "tokens",
        "wire",
    )

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.key = uuid.uuid4().hex
        self.n = n
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.pending: list[Output] = []
        self.event = asyncio.Event()
        self.remaining = n
        self.first: list[float | None] = [None] * n
        self.last = [0.0] * n
        self.tokens = [0] * n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.stop_reasons: list[str | None] = [None] * n
        self.fail_after: int | None = None
        # `direct`: the client's transport, once the stream task has sent the headers of a
        # chunked HTTP/1.1 response it frames itself; `wire` is armed with it only while the
        # task waits in `batches`, and then `deliver` writes straight to the socket.
        self.direct: asyncio.WriteTransport | None = None
        self.wire: asyncio.WriteTransport | None = None
        self.render: Callable[[Output], bytes] | None = None

    def deliver(self, out: Output) -> None:
        """Hand `out` to the client. An output with nothing queued ahead of it is rendered and
        written here, in the core's callback (one HTTP chunk): at a thousand streams a task
        wake-up and aiohttp's writer per token cost more CPU than the tokens themselves. The
        last output of a choice, and any while the stream task is writing or the socket is
        backed up, goes through the task (`batches`), which keeps the order and waits."""
        w = self.wire
        if (
            w is not None
            and out.finish_reason is None
            and not self.pending
            and not w.is_closing()
            and w.get_write_buffer_size() < DIRECT_LIMIT
        ):
            assert self.render is not None
            self.tokens[out.seq.index] += out.tokens
            data = self.render(out)
            if data:
                w.write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        self.push(out)

    def push(self, out: Output) -> None:
        self.pending.append(out)
        i = out.seq.index
        self.tokens[i] += out.tokens
        if out.finish_reason is not None:
            self.finish[i] = out.finish_reason
            self.stop_reasons[i] = out.stop_reason
            self.remaining -= 1
        self.event.set()

    @property
    def done(self) -> bool:
        return self.remaining == 0

    async def batches(self) -> AsyncIterator[list[Output]]:
        while True:
            if not self.pending:
                if self.remaining == 0:
                    return
                self.event.clear()
                self.wire = self.direct
                try:
                    await self.event.wait()
                finally:
                    self.wire = None  # a direct write now would overtake the next batch
                continue
            batch, self.pending = self.pending, []
            yield batch
