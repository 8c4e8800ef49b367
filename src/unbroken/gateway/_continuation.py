"""Mid-stream continuation: which requests can be continued on another engine, and the
request that continues one.

Completions continue with prompt + text generated so far; chat with a trailing assistant
message holding that text and `continue_final_message: true, add_generation_prompt: false`
(vLLM semantics). Token budgets shrink by what the client already received. Requests whose
output cannot be spliced safely are refused: several choices (`n > 1`), tools, structured or
guided output, logprobs, and token-id prompts.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["continuation_body", "not_migratable"]

_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structured_outputs",
    "guided_whitespace_pattern",
)


def not_migratable(raw: dict[str, Any], chat: bool) -> str | None:
    """Why this request cannot be continued elsewhere, or None if it can."""
    if raw.get("n", 1) != 1 or raw.get("best_of", 1) not in (1, None):
        return "n>1"
    if any(raw.get(k) is not None for k in _GUIDED):
        return "structured_output"
    if chat:
        rf = raw.get("response_format")
        if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
            return "structured_output"
        if raw.get("tools") or raw.get("tool_choice") not in (None, "none", "auto"):
            return "tools"
        if raw.get("logprobs") or raw.get("top_logprobs"):
            return "logprobs"
    else:
        if raw.get("logprobs") is not None:
            return "logprobs"
        p = raw.get("prompt")
        if not (
            isinstance(p, str) or (isinstance(p, list) and len(p) == 1 and isinstance(p[0], str))
        ):
            return "prompt_form"
        if raw.get("suffix"):
            return "suffix"
    return None


def continuation_body(
    raw: dict[str, Any], chat: bool, text: str, sent: int
) -> dict[str, Any] | None:
    """The request that continues `raw` after `text` (`sent` tokens) reached the client.
    None when the token budget is already spent (the stream only lacks its finish)."""
    body = copy.deepcopy(raw)
    body["stream"] = True
    if chat:
        key = (
            "max_completion_tokens"
            if raw.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        if raw.get(key) is not None:
            left = raw[key] - sent
            if left <= 0:
                return None
            body[key] = left
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
        limit = raw.get("max_tokens", 16)
        if limit is not None:
            left = limit - sent
            if left <= 0:
                return None
            body["max_tokens"] = left
        p = raw["prompt"]
        body["prompt"] = (p if isinstance(p, str) else p[0]) + text
        body["echo"] = False
    if isinstance(raw.get("min_tokens"), int):
        body["min_tokens"] = max(0, raw["min_tokens"] - sent)
    return body


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"
    )
