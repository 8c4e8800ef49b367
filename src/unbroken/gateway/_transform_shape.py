"""The general path's helpers for a stream's events (`_transform.Transform._event`): is an
event a completion chunk a client can read, does it carry text, and a token-path leg's
/v1/completions chunk as the chat chunk the client's stream is made of.

Pure functions of the event's decoded dict, apart from `Transform` so that its module holds
the per-stream state and accounting, this the shapes of chunks.
"""

from __future__ import annotations

from typing import Any


def _has_text(obj: dict[str, Any]) -> bool:
    for ch in obj.get("choices") or ():
        if isinstance(ch, dict) and (ch.get("text") or (ch.get("delta") or {}).get("content")):
            return True
    return False


def _is_chunk(obj: dict[str, Any], chat: bool) -> bool:
    """Is `obj` a completion (or chat) chunk the relay and a client can read? Cheap: one
    look at each choice, which carries at most a few tokens."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    for ch in choices:
        if not isinstance(ch, dict) or not isinstance(ch.get("index", 0), int):
            return False
        if chat:
            d = ch.get("delta")
            if d is not None and not (
                isinstance(d, dict) and isinstance(d.get("content") or "", str)
            ):
                return False
        elif not isinstance(ch.get("text") or "", str):
            return False
    return True


def _as_chat(obj: dict[str, Any]) -> dict[str, Any]:
    """A /v1/completions chunk of a token-path leg, as the chat stream's chunk."""
    choices = []
    for ch in obj.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        c: dict[str, Any] = {
            "index": ch.get("index", 0),
            "delta": {"content": ch.get("text") or ""},
            "logprobs": None,
            "finish_reason": ch.get("finish_reason"),
        }
        # vLLM's chat chunks carry stop_reason on the finishing chunk only.
        keys = ("stop_reason", "token_ids") if c["finish_reason"] is not None else ("token_ids",)
        for k in keys:
            if k in ch:
                c[k] = ch[k]
        choices.append(c)
    out: dict[str, Any] = {
        "id": obj.get("id"),
        "object": "chat.completion.chunk",
        "created": obj.get("created"),
        "model": obj.get("model"),
        "choices": choices,
    }
    if "usage" in obj:
        out["usage"] = obj["usage"]
    if "system_fingerprint" in obj:  # vLLM's, on the usage chunk (or a finishing one)
        out["system_fingerprint"] = obj["system_fingerprint"]
    return out
