"""The simulator's deterministic "language model".

The next token is a pure function of (model seed, LoRA adapter, sampling salt, whole context
text): the context is hashed incrementally (a keyed BLAKE2b state extended by every emitted
piece), so any prefix of an output, appended to its prompt, continues exactly as the
uninterrupted run would, on any replica serving the same seed and adapter.
Tokens are vocabulary words; a piece is the word preceded by one space unless the context is
empty or already ends in whitespace. Tests and the verifier call `expected_completion` /
`expected_chat` to know the exact text an engine must produce.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "VOCAB",
    "Cursor",
    "Expected",
    "StopChecker",
    "TextModel",
    "count_tokens",
    "decode",
    "expected_chat",
    "expected_completion",
    "model_key",
    "piece_id",
    "render_chat",
    "sampling_salt",
    "text_piece_id",
    "token_ids",
    "tokenize",
]

# A fixed vocabulary. Part of the "model": changing it changes every output.
VOCAB: tuple[str, ...] = tuple(
    """the of and to in is was for on that with as by at from his her it an were are which this
be or has had not but also have one their its new first after who they two been other time she
all there more when may into over only between during most some used where him year city such
three made world then part later these many would under while school known about well century
high both name film since work out state through being can team including part people area
united four back early number around before government each called what season same group
second within until five long life house music series family river large could national south
village north album any against several major did song public small best day following among
found however place without game home company became final late along left form town due us
play like different them won members still main played law system based end general given
series line several local took began development published water along just short land set
old around central down around five even market story based top side point like show often
light field power modern station post next sea road west east across though common book road
named region human once further production club military received given period church member
although television held royal major less moved army court side away population office death
released record much service political air built forces great three those war include total
four british original art total western history career office final received period battle
known word open field design position river stage order today better force language union
body area despite instead event support version live women building list community children
every make tower bridge lake garden river valley forest stone silver golden quiet gentle rapid
bright dark warm cold early late small large ancient modern simple complex steady sudden
calm wild""".split()
)


# A vocabulary word's token id is its (first) index; any other word's is a CRC-32 of its bytes
# with the top bit set, so the two never meet and the ids are the same in every process.
_VOCAB_ID: dict[str, int] = {w: i for i, w in reversed(list(enumerate(VOCAB)))}


def _word_id(word: str) -> int:
    return zlib.crc32(word.encode()) | 0x8000_0000


def _words(text: str) -> list[str]:
    """A prompt's tokens as text: its whitespace-separated words; a non-empty text without
    any (whitespace only) is one token."""
    words = text.split()
    return words if words or not text else [text]


def token_ids(text: str) -> list[int]:
    """Token ids of a prompt, one per token `count_tokens` counts (the prefix cache hashes
    them). About 0.1 µs a vocabulary word; other words cost a CRC-32 each."""
    return _ids(_words(text))


def _ids(words: list[str]) -> list[int]:
    ids: list[int | None] = list(map(_VOCAB_ID.get, words))
    if None in ids:
        ids = [_word_id(w) if i is None else i for w, i in zip(words, ids, strict=True)]
    return ids  # type: ignore[return-value]


# Words outside the vocabulary that `tokenize` (the /tokenize route) gave ids, so that
# `decode` turns those ids back into them: the most recent _SEEN_MAX, in this process only.
# The hot path (`token_ids`) records nothing.
_SEEN: dict[int, str] = {}
_SEEN_MAX = 65536


def tokenize(text: str) -> tuple[list[int], list[str]]:
    """`token_ids` of `text` and each token's string (its word), remembering the words
    outside the vocabulary so that `decode` of these ids gives the text back (whitespace
    runs as single spaces)."""
    words = _words(text)
    ids = _ids(words)
    for w, i in zip(words, ids, strict=True):
        if i >= len(VOCAB) and i not in _SEEN:
            _SEEN[i] = w
            if len(_SEEN) > _SEEN_MAX:
                del _SEEN[next(iter(_SEEN))]
    return ids, words


def decode(ids: Iterable[int]) -> str:
    """The text of token ids, words joined by single spaces: a vocabulary id is its word, an
    id `tokenize` gave an unknown word is that word, any other id the word at its index
    modulo the vocabulary (so every id is some token: the simulator has no unknown ids)."""
    n = len(VOCAB)
    return " ".join(VOCAB[i] if 0 <= i < n else _SEEN.get(i) or VOCAB[i % n] for i in ids)


def piece_id(piece: str) -> int:
    """The token id of a generated piece (a vocabulary word, perhaps after one space)."""
    return _VOCAB_ID[piece.lstrip(" ")]


def text_piece_id(piece: str) -> int:
    """The token id of a piece of constrained output (one non-whitespace run after optional
    whitespace): what `token_ids` gives that word, so the ids of an output are those of its
    text."""
    ids = token_ids(piece)
    return ids[0] if ids else _word_id(piece)


def count_tokens(text: str) -> int:
    """Tokens of a prompt: whitespace-separated words (at least one for non-empty text)."""
    n = len(text.split())
    return n if n or not text else 1


def model_key(seed: int, adapter: str = "") -> bytes:
    """The hash key of a model: its seed, and a LoRA adapter's name when one is applied, so
    every adapter writes its own text (a request routed to the wrong adapter or to the base
    differs byte for byte) while one adapter writes the same text on every replica."""
    key = seed.to_bytes(8, "little", signed=True)
    if adapter:
        key += hashlib.blake2b(adapter.encode(), digest_size=32, person=b"lora").digest()
    return key


@dataclass(frozen=True, slots=True)
class TextModel:
    seed: int = 0
    eos_rate: float = 0.0  # per-token probability of end-of-sequence (deterministic too)
    adapter: str = ""  # a LoRA adapter's name ("" for the base model)

    def cursor(self, context: str, *, salt: bytes = b"") -> Cursor:
        h = hashlib.blake2b(digest_size=16, key=model_key(self.seed, self.adapter), salt=salt[:16])
        h.update(context.encode())
        return Cursor(h, not context or context[-1].isspace(), self.eos_rate)

    def token_text(self, ids: Iterable[int]) -> str:
        return decode(ids)


class Cursor:
    """Generation state over one context. `next()` returns (piece, is_eos)."""

    __slots__ = ("_at_space", "_eos_threshold", "_h")

    def __init__(self, h: hashlib._Hash, at_space: bool, eos_rate: float) -> None:
        self._h = h
        self._at_space = at_space
        self._eos_threshold = int(eos_rate * (1 << 32))

    def next(self, allow_eos: bool = True) -> tuple[str, bool]:
        d = int.from_bytes(self._h.copy().digest(), "little")
        if allow_eos and self._eos_threshold and (d >> 96) < self._eos_threshold:
            return "", True
        word = VOCAB[d % len(VOCAB)]
        piece = word if self._at_space else " " + word
        self._h.update(piece.encode())
        self._at_space = False
        return piece, False

    def digest(self) -> bytes:
        """The state over the context so far: the seed of a constrained output (structured.py),
        so it depends on model, adapter, salt and prompt as the text does."""
        return self._h.copy().digest()

    def feed(self, piece: str) -> None:
        """Extend the context by a piece produced elsewhere (a constrained output's)."""
        self._h.update(piece.encode())
        self._at_space = piece[-1:].isspace()

    def logprob(self) -> float:
        """A deterministic stand-in log-probability for the piece about to be produced."""
        d = int.from_bytes(self._h.copy().digest()[8:12], "little")
        return -round((d / 2**32) * 2.5, 4)


class StopChecker:
    """vLLM-style stop strings: text that could be the start of a stop string is held back
    until it is known not to be one; the stop string itself is not returned."""

    __slots__ = ("_hold", "_stops", "emitted", "matched", "text")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None  # the stop string that ended the text (vLLM's stop_reason)

    def add(self, piece: str) -> tuple[str, bool]:
        """Append a piece; return (text now safe to send, stopped)."""
        prev_len = len(self.text)
        self.text += piece
        if self._stops:
            start = max(0, prev_len - self._hold)
            hits = [(i, s) for s in self._stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda h: h[0])
                self.text = self.text[:at]
                out = self.text[self.emitted :]
                self.emitted = len(self.text)
                return out, True
            safe = len(self.text) - self._hold
        else:
            safe = len(self.text)
        if safe <= self.emitted:
            return "", False
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def render_chat(
    messages: Sequence[tuple[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The simulator's chat template. An assistant turn renders as
    ``<|assistant|>\\n{content}<|end|>\\n``, so continuing a partial final message gives the
    same context as the generation that produced it."""
    parts: list[str] = []
    last = len(messages) - 1
    for i, (role, content) in enumerate(messages):
        if continue_final_message and i == last:
            parts.append(f"<|{role}|>\n{content}")
        else:
            parts.append(f"<|{role}|>\n{content}<|end|>\n")
    if add_generation_prompt and not continue_final_message:
        parts.append("<|assistant|>\n")
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class Expected:
    text: str
    finish_reason: str  # "length" or "stop"
    completion_tokens: int


def generate(
    model: TextModel,
    context: str,
    max_tokens: int,
    *,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    min_tokens: int = 0,
    salt: bytes = b"",
) -> Expected:
    cur = model.cursor(context, salt=salt)
    checker = StopChecker(stop)
    n = 0
    while n < max_tokens:
        piece, eos = cur.next(allow_eos=not ignore_eos and n >= min_tokens)
        if eos:
            return Expected(checker.text, "stop", n)
        n += 1
        _, stopped = checker.add(piece)
        if stopped:
            return Expected(checker.text, "stop", n)
    return Expected(checker.text, "length", n)


def sampling_salt(seed: int, index: int) -> bytes:
    """The salt of choice `index` of a sampled request with this `seed` (the engine's): its
    text is then as reproducible as a greedy one's; pass it to expected_* as `salt`."""
    return seed.to_bytes(8, "little", signed=True) + index.to_bytes(4, "little")


def expected_completion(
    prompt: str,
    max_tokens: int,
    *,
    seed: int = 0,
    eos_rate: float = 0.0,
    adapter: str = "",
    **kw: object,
) -> Expected:
    """What a greedy /v1/completions request returns from a simulator with this seed (and,
    with `adapter`, for a request naming that LoRA adapter); with `salt=sampling_salt(s, i)`,
    choice i of a sampled request with `"seed": s`."""
    model = TextModel(seed, eos_rate, adapter)
    return generate(model, prompt, max_tokens, **kw)  # type: ignore[arg-type]


def expected_chat(
    messages: Sequence[tuple[str, str]] | Sequence[dict[str, str]],
    max_tokens: int,
    *,
    seed: int = 0,
    eos_rate: float = 0.0,
    adapter: str = "",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **kw: object,
) -> Expected:
    """What a greedy /v1/chat/completions request returns (the assistant's content)."""
    pairs = [(m["role"], m["content"]) if isinstance(m, dict) else m for m in messages]
    ctx = render_chat(
        pairs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    return generate(TextModel(seed, eos_rate, adapter), ctx, max_tokens, **kw)  # type: ignore[arg-type]
