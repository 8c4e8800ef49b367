"""The vLLM-compatible engine simulator (`unbroken engine`)."""

from unbroken.engine.profiles import PROFILES, EngineProfile, get_profile
from unbroken.engine.textmodel import TextModel, expected_chat, expected_completion, render_chat

__all__ = [
    "PROFILES",
    "EngineProfile",
    "TextModel",
    "expected_chat",
    "expected_completion",
    "get_profile",
    "render_chat",
]
