"""A request whose max_tokens x n exceeds its tenant's completion tokens per minute is
refused at once, as OpenAI's "Request too large" (429, `type: tokens`, `rate_limit_exceeded`,
no Retry-After and `x-should-retry: false`: waiting never makes it fit, and the openai client
sends it once), taking nothing from the buckets; one that fits is admitted as before. A
reviewer's tenant with 100 completion tokens a minute got a 300-token answer (a review,
item 4)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers import MODEL, Proc, engine, gateway, metric
from test_tenants import client, tenants_config
from unbroken.config.tenants import RateLimitSettings, TenantLimits, TenantSpec
from unbroken.gateway._ratelimit import Limiter, RateLimited, TenantTable, TooLarge

KEY = "sk-tiny-secret"


def test_the_limiter_refuses_an_estimate_above_the_whole_limit() -> None:
    limits = TenantLimits(
        requests_per_minute=10, prompt_tokens_per_minute=50, completion_tokens_per_minute=100
    )
    lim = Limiter(
        [TenantSpec(name="t", limits=limits)], RateLimitSettings(), TenantTable(), {"t": 0}
    )

    async def go() -> None:
        with pytest.raises(TooLarge) as ei:
            await lim.admit("t", (10.0, 300.0))
        e = ei.value
        assert isinstance(e, RateLimited) and e.status == 429 and e.reason == "request_too_large"
        assert e.type == "tokens" and e.code == "rate_limit_exceeded"
        assert "Limit 100, Requested 300" in e.message and "max_tokens" in e.message
        assert "Retry-After" not in e.headers and "retry-after-ms" not in e.headers
        assert e.headers["x-should-retry"] == "false"  # the openai client retries other 429s
        assert e.headers["x-ratelimit-remaining-requests"] == "10"  # nothing taken
        # The prompt's estimate (characters / 4) is not judged so: a guess, exact only at the
        # engine (a base64 image or a token-id prompt would be refused wrongly).
        lease = await lim.admit("t", (50.5, 1.0))
        lim.finish(lease)
        # At the limit exactly: admitted (it fits in a full bucket).
        lease = await lim.admit("t", (50.0, 100.0))
        assert lease.headers is not None
        assert lease.headers["x-ratelimit-remaining-requests"] == "8"
        lim.finish(lease)

    asyncio.run(go())


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Proc]:
    e = engine(tmp_path)
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {
                "name": "tiny",
                "key": KEY,
                "limits": {"requests_per_minute": 30, "completion_tokens_per_minute": 100},
            }
        ],
    )
    g = gateway(tmp_path, e.url, args=("--config", str(cfg)))
    try:
        yield g
    finally:
        g.stop()
        e.stop()


def test_a_request_larger_than_the_limit_is_refused_at_once(gw: Proc) -> None:
    c = client(gw, KEY)
    for kw in ({"max_tokens": 300}, {"max_tokens": 60, "n": 2}):  # 300, and 60 x 2 = 120
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as ei:
            c.completions.create(model=MODEL, prompt="a b", stream=True, **kw)  # type: ignore[call-overload]
        assert time.monotonic() - t0 < 5
        body = ei.value.body
        assert isinstance(body, dict), body
        assert body["type"] == "tokens" and body["code"] == "rate_limit_exceeded"
        want = 300 if kw["max_tokens"] == 300 else 120
        assert f"Limit 100, Requested {want}" in body["message"], body
        assert "max_tokens" in body["message"]
        h = ei.value.response.headers
        assert "retry-after" not in h and "retry-after-ms" not in h
        assert h["x-should-retry"] == "false"
        assert h["x-ratelimit-remaining-requests"] == "30"  # the request took nothing
    # Each sent once: the openai client does not retry them (counted by reason).
    assert (
        metric(gw.url, "unbroken_gateway_tenant_rejections_total", reason="request_too_large") == 2
    )
    # One that fits is served whole, as before.
    r = httpx.post(
        gw.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": "a b", "max_tokens": 100},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 100
