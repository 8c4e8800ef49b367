"""vllm-router's worker routes on the gateway's admin port (`/workers`, `/list_workers`,
`/get_loads`, `POST /add_worker?url=`, `POST /remove_worker?url=`): the shapes its scripts
and autoscaler hooks read, behind the admin token. Real engines (simulator) and a real gateway
with two workers, so that an added worker serves from every worker process."""

from __future__ import annotations

from pathlib import Path

import httpx

from helpers import MODEL, TOKEN, Proc, gateway, wait_for


def _call(g: Proc, method: str, path: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, g.admin_url + path, headers=headers, timeout=10)


def test_vllm_router_worker_routes(tmp_path: Path, two_engines: list[Proc]) -> None:
    a, b = two_engines
    g = gateway(tmp_path, a.url, args=("--workers", "2"))
    try:
        assert _call(g, "GET", "/workers", token=None).status_code == 401
        # On the public port: told where they are.
        pub = httpx.get(g.url + "/workers", timeout=10)
        assert pub.status_code == 404 and "admin port" in pub.json()["error"]["message"]
        r = _call(g, "GET", "/workers")
        assert r.status_code == 200
        w = r.json()
        assert w["total"] == 1 and w["stats"]["regular_count"] == 1
        (one,) = w["workers"]
        assert one["url"] == a.url and one["is_healthy"] is True and one["load"] == 0
        assert one["model_id"] == MODEL and one["worker_type"] == "regular"
        assert _call(g, "GET", "/list_workers").json() == {"urls": [a.url]}
        assert _call(g, "GET", "/get_loads").json() == {"workers": [{"worker": a.url, "load": 0}]}

        r = _call(g, "POST", f"/add_worker?url={b.url}/")  # a trailing slash is the same URL
        assert r.status_code == 200 and r.text == f"Successfully added worker: {b.url}"
        again = _call(g, "POST", f"/add_worker?url={b.url}")
        assert again.status_code == 400 and "already exists" in again.json()["error"]["message"]
        assert _call(g, "POST", "/add_worker").status_code == 400  # no url
        bad = _call(g, "POST", "/add_worker?url=not-a-url")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"

        def ready() -> bool:
            return all(x["is_healthy"] for x in _call(g, "GET", "/workers").json()["workers"])

        wait_for(ready, timeout=20, what="the added worker ready")
        assert sorted(_call(g, "GET", "/list_workers").json()["urls"]) == sorted([a.url, b.url])
        served = set()
        for i in range(8):  # both serve, whichever gateway worker takes the request
            r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": f"q{i}",
                           "max_tokens": 2}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            served.add(r.headers["x-unbroken-endpoint"])
        assert len(served) == 2, served

        r = _call(g, "POST", f"/remove_worker?url={a.url}")
        assert r.status_code == 200 and r.text == f"Successfully removed worker: {a.url}"
        assert _call(g, "GET", "/list_workers").json() == {"urls": [b.url]}
        gone = _call(g, "POST", f"/remove_worker?url={a.url}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
        for i in range(4):
            r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": f"r{i}",
                           "max_tokens": 2}, timeout=30)  # fmt: skip
            assert (
                r.status_code == 200 and r.headers["x-unbroken-endpoint"] == b.url.split("://")[1]
            )
    finally:
        g.stop()


def test_vllm_router_and_production_stack_flags(tmp_path: Path, two_engines: list[Proc]) -> None:
    """`--worker-urls A B` (one option, several URLs), `--policy cache_aware`, production-
    stack's `--session-key`: accepted as ours, and the resolved policy said at start."""
    a, b = two_engines
    g = gateway(
        tmp_path,
        args=(
            "--worker-urls",
            a.url,
            b.url,
            "--policy",
            "consistent_hash",
            "--session-key",
            "x-user",
        ),
        wait_ready=2,
    )
    try:
        assert sorted(_call(g, "GET", "/list_workers").json()["urls"]) == sorted([a.url, b.url])
        status = _call(g, "GET", "/admin/status").json()
        assert status["routing"] == "session"
        assert "routing: session (asked as 'consistent_hash')" in g.log.read_text()
        # The session header is x-user: one conversation, one engine; others spread. Homes
        # are rendezvous hashes of the key and the engine's name (its URL, a free port):
        # 6 conversations all had one home once in a full suite (a 2 x 2^-6 chance), 16 have a
        # chance of 2 x 2^-16.
        homes = set()
        for conv in range(16):
            seen = {
                httpx.post(
                    g.url + "/v1/completions",
                    headers={"x-user": f"c{conv}"},
                    json={"model": MODEL, "prompt": f"turn {t}", "max_tokens": 2},
                    timeout=30,
                ).headers["x-unbroken-endpoint"]
                for t in range(3)
            }
            assert len(seen) == 1, (conv, seen)
            homes |= seen
        assert len(homes) == 2, homes
    finally:
        g.stop()
