"""Gateway replicas tell each other what they sent where (`prefix_share_url`, a Redis
channel): a prompt one replica sent to an engine is credited there by the other replica's
index before that replica ever saw it, whether the other runs one process or workers (then
its main process records into the workers' shared table); Redis gone, both keep serving.
Real processes: redis-server (the distribution's, started here), two simulated engines, two
gateways."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from helpers import MODEL, Proc, gateway, metric, wait_for
from test_tenants_redis import REDIS, Redis
from unbroken.engine.textmodel import VOCAB

pytestmark = pytest.mark.skipif(
    REDIS is None, reason="redis-server is not installed (scripts/bootstrap.sh installs it)"
)


def _words(n: int, seed: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(VOCAB) for _ in range(n))


def _hits(g: Proc) -> float:
    return metric(g.url, "unbroken_gateway_prefix_hit_blocks_total")


def _gateways(tmp: Path, urls: list[str], share: str | None, b_workers: int) -> list[Proc]:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "gw.yaml"
    cfg.write_text(f"prefix_share_url: {share}\n" if share else "{}\n")
    return [
        gateway(tmp, *urls, args=("--config", str(cfg), "--workers", str(w)), name=f"gw{i}")
        for i, w in enumerate((1, b_workers))
    ]


def _first_on_b_is_credited(tmp: Path, urls: list[str], share: str | None, workers: int) -> bool:
    """Prompts sent through A; then each once through B: did B's index credit them?"""
    a, b = _gateways(tmp, urls, share, workers)
    try:
        prompts = [_words(500, 300 + i) for i in range(4)]
        where = {}
        for p in prompts:
            r = httpx.post(a.url + "/v1/completions", json={"model": MODEL, "prompt": p,
                           "max_tokens": 2}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            where[p] = r.headers["x-unbroken-endpoint"]
        time.sleep(0.5)  # published, received, recorded
        before = _hits(b)
        for p in prompts:
            r = httpx.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": p,
                           "max_tokens": 2}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.headers["x-unbroken-endpoint"] == where[p]  # the home, or what A knew
        # With workers, their counts reach the main process's /metrics with their report.
        deadline = time.monotonic() + 3
        while _hits(b) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        return _hits(b) > before
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_replica_credits_what_another_sent(
    tmp_path: Path, two_engines: list[Proc], workers: int
) -> None:
    redis = Redis(tmp_path).start()
    try:
        url = f"redis://127.0.0.1:{redis.port}/0"
        urls = [e.url for e in two_engines]
        assert _first_on_b_is_credited(tmp_path / "shared", urls, url, workers)
        if workers == 1:  # the control, once: without the share B knows nothing of it
            for e in two_engines:
                httpx.post(e.url + "/reset_prefix_cache", timeout=10)
            assert not _first_on_b_is_credited(tmp_path / "own", urls, None, workers)
    finally:
        redis.kill()


def test_redis_gone_keeps_serving_and_says_so_once(tmp_path: Path, two_engines: list[Proc]) -> None:
    redis = Redis(tmp_path).start()
    url = f"redis://127.0.0.1:{redis.port}/0"
    a, b = _gateways(tmp_path, [e.url for e in two_engines], url, 1)
    try:
        redis.kill()
        for i in range(6):
            for g in (a, b):
                r = httpx.post(g.url + "/v1/completions", json={"model": MODEL,
                               "prompt": _words(200, i), "max_tokens": 2}, timeout=30)  # fmt: skip
                assert r.status_code == 200, r.text
        wait_for(lambda: "prefix share: Redis at" in a.log.read_text(), timeout=15, what=a.tail)
        said = a.log.read_text().count("prefix share: Redis at redis://127.0.0.1")
        assert said == 1, a.tail(30)
    finally:
        a.stop()
        b.stop()
