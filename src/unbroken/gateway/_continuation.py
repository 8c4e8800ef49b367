"""Mid-stream continuation: which requests can be continued on another engine, and the
request that continues one.

Two paths. **Tokens** (when the engine returned the prompt's and the generated token ids,
vLLM's `return_token_ids`): the continuation is a `/v1/completions` request whose prompt is
those ids, so the engine resumes from exactly the state it was in; a chat stream's
continuation is re-wrapped into chat chunks by the relay. Byte-exact for greedy decoding with
any tokenizer. **Text** (any other engine): completions continue with prompt + text generated
so far; chat with a trailing assistant message holding that text and
`continue_final_message: true, add_generation_prompt: false` (vLLM semantics). Exact only
where the text re-tokenizes to the same ids.

Token budgets shrink by the tokens the client already received (counted as the engine counts
them, see `_stream`). Requests whose output cannot be spliced safely are refused: several
choices (`n > 1`), tools, structured or guided output, logprobs, stop strings; on the
text path also token-id prompts and `suffix`. `echo`: the echoed prompt is not generated text
(`continuation_body` strips it from the text it continues after, or raises `NotExact`).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "NotExact",
    "augment",
    "augmentable",
    "continuation_body",
    "not_migratable",
    "token_continuation_body",
]

_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structured_outputs",
    "guided_whitespace_pattern",
)
# Chat-only fields that a /v1/completions continuation must not carry.
_CHAT_ONLY = (
    "messages",
    "max_completion_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
    "echo",
    "mm_processor_kwargs",
    "reasoning_effort",
    "include_reasoning",
    "add_special_tokens",
)


class NotExact(Exception):
    """No exact continuation on this path (the argument: why); an explicit error beats a
    guessed prompt."""


def augmentable(raw: dict[str, Any]) -> bool:
    """Whether `augment` keeps the client's own verdict: `stream_options` absent or an
    object whose usage flags are booleans or null, `return_token_ids` a boolean or null.
    Anything else is left to the engine to refuse (vLLM answers 400 for `"stream_options":
    "x"`): overwritten by `augment`, the engine would have taken it."""
    so = raw.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            return False
        flags = (so.get("include_usage"), so.get("continuous_usage_stats"))
        if any(v is not None and not isinstance(v, bool) for v in flags):
            return False
    ids = raw.get("return_token_ids")
    return ids is None or isinstance(ids, bool)


def augment(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` asking the engine for what exact continuation needs: usage on every chunk (the
    exact token count) and the token ids. The relay strips what the client did not ask for.

    Not the token ids of an `echo` request: vLLM 0.32 then sends the echoed prompt's text
    empty (its prompt is in `prompt_token_ids` only, serving.py: `if
    request.return_token_ids: prompt_text = ""`), and the client, who asked for neither,
    lost its echo. Such a stream continues on the text path (`continuation_body`'s echo
    rule)."""
    body = dict(raw)
    so = raw.get("stream_options")
    so = dict(so) if isinstance(so, dict) else {}
    so["include_usage"] = True
    so["continuous_usage_stats"] = True
    body["stream_options"] = so
    if not raw.get("echo"):
        body["return_token_ids"] = True
    return body


def not_migratable(raw: dict[str, Any], chat: bool, *, tokens: bool = False) -> str | None:
    """Why this request cannot be continued elsewhere, or None if it can. `tokens`: the
    token path is available (a token-id prompt can then be continued too)."""
    if raw.get("n", 1) not in (1, None) or raw.get("best_of", 1) not in (1, None):
        return "n>1"
    if any(raw.get(k) is not None for k in _GUIDED):
        return "structured_output"
    if raw.get("stop"):
        # The engine holds text back while it could still be the start of a stop string, so
        # the tokens counted run ahead of the text sent: a continuation would skip text.
        return "stop"
    rf = raw.get("response_format")  # vLLM honours it on completions too
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return "structured_output"
    if chat:
        if raw.get("tools") or raw.get("tool_choice") not in (None, "none", "auto"):
            return "tools"
        if raw.get("logprobs") or raw.get("top_logprobs"):
            return "logprobs"
    else:
        if raw.get("logprobs") is not None:
            return "logprobs"
        if raw.get("suffix"):
            return "suffix"
        p = raw.get("prompt")
        if not tokens and not (
            isinstance(p, str) or (isinstance(p, list) and len(p) == 1 and isinstance(p[0], str))
        ):
            return "prompt_form"
        if isinstance(p, list) and len(p) != 1 and not all(isinstance(t, int) for t in p):
            return "prompt_form"  # several prompts
    return None


def _limit(raw: dict[str, Any], chat: bool) -> tuple[str, Any]:
    if chat:
        key = (
            "max_completion_tokens"
            if raw.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        return key, raw.get(key)
    return "max_tokens", raw.get("max_tokens", 16)


def _left(limit: Any, sent: int) -> int | bool | None:
    """Tokens left of `limit` after `sent`; False when spent; None when unlimited."""
    if limit is None:
        return None
    try:
        left = int(limit) - sent
    except (TypeError, ValueError):
        return None
    return left if left > 0 else False


def continuation_body(
    raw: dict[str, Any], chat: bool, text: str, sent: int
) -> dict[str, Any] | None:
    """The text-path request that continues `raw` after `text` (`sent` tokens) reached the
    client. None when the token budget is already spent (the stream only lacks its finish).
    NotExact when the prompt is not text (token ids: the token path's) or an echoed prompt
    cannot be told from the text (`echo`: the client's text begins with the prompt, which is
    not generated text and is not echoed again)."""
    prompt = ""
    if not chat:
        p = raw.get("prompt")
        p = p[0] if isinstance(p, list) and p else p
        if not isinstance(p, str):
            raise NotExact("prompt_form")
        prompt = p
        if raw.get("echo"):
            if not text.startswith(prompt):
                raise NotExact("echo")
            text = text[len(prompt) :]
    body = copy.deepcopy(raw)
    body["stream"] = True
    key, limit = _limit(raw, chat)
    left = _left(limit, sent)
    if left is False:
        return None
    if left is not None:
        body[key] = left
    if chat:
        if text:
            msgs = body["messages"]
            if raw.get("continue_final_message"):
                last = msgs[-1]
                last["content"] = _content_text(last.get("content")) + text
            else:
                msgs.append({"role": "assistant", "content": text})
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
    else:
        body["prompt"] = prompt + text
        body["echo"] = False
    _min_tokens(raw, body, sent)
    return body


def token_continuation_body(
    raw: dict[str, Any], chat: bool, ids: list[int], sent: int
) -> dict[str, Any] | None:
    """The token-path request (always for `/v1/completions`) that continues `raw` from `ids`
    (the prompt's token ids followed by the `sent` generated ones). None when the budget is
    spent."""
    _, limit = _limit(raw, chat)
    left = _left(limit, sent)
    if left is False:
        return None
    body = {k: v for k, v in raw.items() if k not in _CHAT_ONLY} if chat else dict(raw)
    body.pop("suffix", None)
    body["prompt"] = list(ids)
    body["stream"] = True
    body["echo"] = False
    # Unlimited chat: completions would default to 16, so say "up to the context" (null).
    body["max_tokens"] = left
    _min_tokens(raw, body, sent)
    return body


def _min_tokens(raw: dict[str, Any], body: dict[str, Any], sent: int) -> None:
    if isinstance(raw.get("min_tokens"), int):
        body["min_tokens"] = max(0, raw["min_tokens"] - sent)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"
    )
