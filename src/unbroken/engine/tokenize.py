"""vLLM's `/tokenize` and `/detokenize` (vLLM 0.32's `entrypoints/serve/tokenize`): a text
prompt or a chat rendered by the simulator's template, in the simulator's tokens (words);
token ids back to text.

vLLM's request union is told apart by its fields: a body with `messages` is a chat request,
anything else a completion request (`prompt` then required). Its answer always carries
`token_strs`, null unless `return_token_strs`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from unbroken.engine.textmodel import decode, render_chat, tokenize
from unbroken.wire.openai import ChatMessage, json_object, validate_request

__all__ = [
    "DetokenizeRequest",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "answer",
    "detokenized",
    "parse_tokenize",
]


class _Lax(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's OpenAIBaseModel accepts (and logs) extras


class TokenizeCompletionRequest(_Lax):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # no special tokens here: accepted, changes nothing
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Lax):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_generation_prompt(cls, data: Any) -> Any:
        # vLLM checks the two as given (before defaults): `add_generation_prompt` left out
        # with `continue_final_message: true` is served.
        if isinstance(data, dict) and data.get("continue_final_message"):
            if data.get("add_generation_prompt"):
                raise ValueError(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
        return data


class DetokenizeRequest(_Lax):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The request as vLLM's union reads it (module doc); 400 on malformed input."""
    raw = json_object(body)
    model = TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest
    return validate_request(model, raw)


def answer(
    req: TokenizeCompletionRequest | TokenizeChatRequest, max_model_len: int
) -> dict[str, Any]:
    """vLLM's TokenizeResponse for a parsed request."""
    if isinstance(req, TokenizeChatRequest):
        text = render_chat(
            [(m.role, m.text()) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
    else:
        text = req.prompt
    ids, strs = tokenize(text)
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": strs if req.return_token_strs else None,
    }


def detokenized(req: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's DetokenizeResponse."""
    return {"prompt": decode(req.tokens)}
