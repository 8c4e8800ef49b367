from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from unbroken.wire.sse import SSEDecoder, encode_comment, encode_data, encode_json

STREAM = (
    encode_json({"a": 1})
    + encode_comment("ping")
    + encode_data(b"x\ny".replace(b"\n", b""))
    + b"data: line1\ndata: line2\n\n"
    + encode_data(b"[DONE]")
)


def _decode(chunks: list[bytes]) -> list[bytes | None]:
    d = SSEDecoder()
    out = []
    for c in chunks:
        out += [e.data for e in d.feed(c)]
    out += [e.data for e in d.flush()]
    return out


EXPECTED = [b'{"a":1}', None, b"xy", b"line1\nline2", b"[DONE]"]


def test_every_two_way_split() -> None:
    for i in range(len(STREAM) + 1):
        assert _decode([STREAM[:i], STREAM[i:]]) == EXPECTED, i


@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split(cuts: list[int]) -> None:
    pts = sorted(set(cuts))
    chunks = [STREAM[a:b] for a, b in zip([0, *pts], [*pts, len(STREAM)], strict=True)]
    assert _decode(chunks) == EXPECTED


def test_crlf_and_cr_line_ends() -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    for i in range(len(crlf) + 1):
        assert _decode([crlf[:i], crlf[i:]]) == EXPECTED, i
    assert _decode([STREAM.replace(b"\n", b"\r")]) == EXPECTED


def test_raw_bytes_are_kept_for_relaying() -> None:
    d = SSEDecoder()
    evs = d.feed(STREAM)
    assert b"".join(e.raw for e in evs) == STREAM


def test_unterminated_last_event_is_flushed() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: tail") == []
    assert [e.data for e in d.flush()] == [b"tail"]
