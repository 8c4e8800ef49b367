"""`unbroken reload` under `unbroken up`: the supervisor re-reads its spec, renders the
gateway's settings again and reloads the gateway (real pipeline, real processes, streams
checked byte for byte across the reload); a spec that no longer validates changes nothing."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from helpers import MODEL, Up, metric, stream, stream_text, wait_for
from unbroken.engine.textmodel import expected_completion

SPEC = """
model: {model}
pools:
  - name: main
    replicas: 1
    cap: {cap}
    weights_size: 8MiB
    engine: {{profile: fp16, overrides: {{decode_base_s: 0.01}}}}
  - name: spare
    replicas: {spare}
    weights_size: 8MiB
    engine: {{profile: fp8, overrides: {{decode_base_s: 0.01}}}}
controller: {{enabled: false}}
gateway:
  default_priority: {priority}
  probe_interval_s: {probe}
  routes: {{sheddable: [{sheddable}]}}
"""


def write_spec(path: Path, **kw: Any) -> None:
    values = {
        "model": MODEL,
        "cap": 8,
        "spare": 1,
        "priority": "standard",
        "probe": 1.0,
        "sheddable": "spare",
        **kw,
    }
    path.write_text(SPEC.format(**values))


def gw_admin(up: Up, path: str) -> Any:
    token = (up.state / "admin-token").read_text().strip()
    r = httpx.get(
        f"http://127.0.0.1:{up.admin_port}{path}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    r.raise_for_status()
    return r.json()


def stream_ok(url: str, prompt: str, n: int) -> str:
    """'' when the stream arrived whole and byte-exact, else what was wrong."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
    try:
        events, r = stream(url, "/v1/completions", body)
    except httpx.HTTPError as e:
        return f"{prompt}: {e!r}"
    if r.status_code != 200:
        return f"{prompt}: HTTP {r.status_code}"
    if events[-1:] != ["[DONE]"] or any(isinstance(e, dict) and "error" in e for e in events):
        return f"{prompt}: cut or error event: {events[-2:]}"
    if stream_text(events, chat=False) != expected_completion(prompt, n).text:
        return f"{prompt}: altered"
    return ""


def reload(up: Up) -> subprocess.CompletedProcess[str]:
    return up.run("reload", timeout=120)


def start(tmp_path: Path, **kw: Any) -> tuple[Up, Path]:
    spec = tmp_path / "pipeline.yaml"
    write_spec(spec, **kw)
    up = Up(tmp_path, spec)
    wait_for(
        lambda: (
            sum(e["state"] == "ready" for e in gw_admin(up, "/admin/endpoints")["endpoints"]) == 2
        ),
        timeout=60,
        what="both endpoints ready",
    )
    return up, spec


def test_reload_applies_the_edited_spec_live(tmp_path: Path) -> None:
    """Edit the spec (default priority, a route, a pool's cap; and things a reload cannot
    apply), `unbroken reload` while 6 streams run: the new settings are live in the gateway
    (admin API, behaviour), every stream completes byte-exact, the gateway keeps its pid, and
    what needs a restart is listed as not applied."""
    up, spec = start(tmp_path)
    try:
        pid = up.status()["gateway_pid"]
        assert gw_admin(up, "/admin/routes")["routes"]["sheddable"] == ["spare"]
        write_spec(spec, priority="sheddable", sheddable="main", cap=3, spare=2, probe=0.5)
        with ThreadPoolExecutor(6) as pool:
            jobs = [pool.submit(stream_ok, up.url, f"reload {i}", 300) for i in range(6)]
            wait_for(
                lambda: metric(up.url, "unbroken_gateway_active_streams") >= 6,
                timeout=10,
                what="streams running",
            )
            r = reload(up)
            problems = [p for j in jobs if (p := j.result())]
        print(r.stdout)
        assert r.returncode == 0, r.stderr
        assert not problems, problems
        out = r.stdout
        assert f"pid {pid}" in out and str(spec) in out
        changed, _, rest = out.partition("not applied; restart `unbroken up` to apply:")
        assert "gateway.default_priority: standard -> sheddable" in changed
        assert 'gateway.routes.sheddable: ["spare"] -> ["main"]' in changed
        assert "pools.main.cap: 8 -> 3" in changed
        assert "pools.spare.replicas: 1 -> 2" in rest
        assert "gateway.probe_interval_s: 1.0 -> 0.5" in rest
        assert "replicas" not in changed and "probe_interval_s" not in changed

        # Live: routes and caps through the admin API, the default priority by behaviour.
        assert gw_admin(up, "/admin/routes")["routes"]["sheddable"] == ["main"]
        eps = {e["name"]: e for e in gw_admin(up, "/admin/endpoints")["endpoints"]}
        assert eps["main-1"]["cap"] == 3 and eps["main-1"]["configured_cap"] == 3
        wait_for(
            lambda: gw_admin(up, "/admin/status")["workers"]["draining"] == 0,
            timeout=60,
            what="old workers gone",
        )
        ws = gw_admin(up, "/admin/status")["workers"]
        assert ws["generation"] == 1 and ws["main_pid"] == pid
        before = metric(up.url, "unbroken_gateway_requests_total", priority="sheddable")
        assert stream_ok(up.url, "after", 5) == ""  # no priority header: now sheddable
        after = metric(up.url, "unbroken_gateway_requests_total", priority="sheddable")
        assert after == before + 1
        cfg = json.loads((up.state / "gateway.json").read_text())
        assert cfg["default_priority"] == "sheddable" and cfg["probe_interval_s"] == 1.0
        st = up.status()
        assert st["gateway_pid"] == pid
        events = [e["event"] for e in st["events"]]
        assert "gateway_reloaded" in events and "gateway_died" not in events

        # Again, with nothing edited: no setting changes; what is not applied still shows.
        r = reload(up)
        assert r.returncode == 0, r.stderr
        assert "gateway settings: no change" in r.stdout
        assert "pools.spare.replicas: 1 -> 2" in r.stdout
        assert gw_admin(up, "/admin/status")["workers"]["generation"] == 2
    finally:
        assert up.stop() == 0


def test_reload_with_a_broken_spec_changes_nothing(tmp_path: Path) -> None:
    """A spec that no longer parses or validates (a `redis_url` redis-py refuses included),
    or that routes to a pool the pipeline does not run: `unbroken reload` says why and exits
    1; gateway.json, the workers and the stream running meanwhile are untouched."""
    up, spec = start(tmp_path)
    try:
        cfg = (up.state / "gateway.json").read_bytes()
        ws = gw_admin(up, "/admin/status")["workers"]
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(stream_ok, up.url, "untouched", 200)
            cases = [
                ("pools: [\n", "invalid YAML"),
                (spec.read_text().replace("standard", "urgent"), "gateway.default_priority"),
                (spec.read_text() + "  surprise: 1\n", "gateway.surprise"),
                (
                    spec.read_text()
                    .replace("[spare]", "[extra]")
                    .replace("controller:", "  - name: extra\ncontroller:"),
                    "does not run: extra",
                ),
                # redis-py would refuse it in every new worker: refused when read (it used
                # to pass, and leave the gateway replacing its dying workers for ever).
                (
                    spec.read_text()
                    + 'rate_limit: {store: redis, redis_url: "http://127.0.0.1:26379/0"}\n',
                    "rate_limit.redis_url: must start with redis://",
                ),
            ]
            for text, expect in cases:
                spec.write_text(text)
                r = reload(up)
                print(r.stderr)
                assert r.returncode == 1, (text, r.stdout, r.stderr)
                assert expect in r.stderr and "nothing changed" in r.stderr, r.stderr
                assert r.stdout == ""
            assert job.result() == ""
        assert (up.state / "gateway.json").read_bytes() == cfg
        now = gw_admin(up, "/admin/status")["workers"]
        assert now["generation"] == ws["generation"] == 0 and now["pids"] == ws["pids"]
        assert gw_admin(up, "/admin/routes")["routes"]["sheddable"] == ["spare"]
        assert "gateway_reloaded" not in [e["event"] for e in up.status()["events"]]
        assert stream_ok(up.url, "still serving", 5) == ""
    finally:
        assert up.stop() == 0


def test_reload_report_never_shows_a_secret() -> None:
    """API keys (a pool's, and priority_keys, whose keys are API keys) and engine environment
    values do not appear in what a reload reports; that they changed does."""
    from unbroken.config.spec import parse_spec
    from unbroken.pipeline.supervisor import _diff, _flatten, _not_applied, render_gateway_settings

    def spec(key: str, env: str) -> Any:
        return parse_spec(
            {
                "pools": [{"name": "a", "api_key": key, "engine": {"env": {"HF_TOKEN": env}}}],
                "gateway": {"priority_keys": {key: "critical"}},
            }
        )

    old, new = spec("sk-old-secret", "hf-old-secret"), spec("sk-new-secret", "hf-new-secret")
    report = _not_applied(old, new) + _diff(
        _flatten(render_gateway_settings(old).model_dump(mode="json"), "gateway."),
        _flatten(render_gateway_settings(new).model_dump(mode="json"), "gateway."),
    )
    keys = {c["key"] for c in report}
    assert {"pools.a.api_key", "pools.a.engine.env.HF_TOKEN", "gateway.priority_keys"} <= keys
    assert "secret" not in json.dumps(report), report


TENANT_SPEC = """
model: {model}
pools:
  - name: main
    replicas: 1
    weights_size: 8MiB
    engine: {{profile: fp16, overrides: {{decode_base_s: 0.01}}}}
controller: {{enabled: false}}
tenants:
{tenants}
"""


def _tenant(name: str, key: str, rpm: int) -> str:
    import hashlib

    digest = hashlib.sha256(key.encode()).hexdigest()
    return (
        f"  - name: {name}\n    api_keys: ['sha256:{digest}']\n"
        f"    limits: {{requests_per_minute: {rpm}}}\n"
    )


def test_reload_applies_changed_tenants_and_limits(tmp_path: Path) -> None:
    """The spec's top-level `tenants:` are gateway settings: a reload applies a changed
    limit and a removed tenant (its key is refused from then on), and its report says so
    without a key. It used to render them from the running spec ("no change", the removed
    tenant's key kept working; found by a review with the openai client)."""
    spec = tmp_path / "pipeline.yaml"
    both = _tenant("acme", "sk-acme-secret", 30) + _tenant("beta", "sk-beta-secret", 30)
    spec.write_text(TENANT_SPEC.format(model=MODEL, tenants=both))
    up = Up(tmp_path, spec)

    def ask(key: str) -> httpx.Response:
        body = {"model": MODEL, "prompt": "tenant", "max_tokens": 2}
        return httpx.post(
            up.url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )

    try:
        wait_for(lambda: ask("sk-acme-secret").status_code == 200, timeout=60, what="serving")
        assert ask("sk-acme-secret").headers["x-ratelimit-limit-requests"] == "30"
        assert ask("sk-beta-secret").status_code == 200
        spec.write_text(
            TENANT_SPEC.format(model=MODEL, tenants=_tenant("acme", "sk-acme-secret", 5))
        )
        r = reload(up)
        assert r.returncode == 0, r.stderr
        assert "no change" not in r.stdout and "gateway.tenants.acme." in r.stdout, r.stdout
        assert "secret" not in r.stdout and "sha256" not in r.stdout, r.stdout
        assert ask("sk-acme-secret").headers["x-ratelimit-limit-requests"] == "5"
        assert ask("sk-beta-secret").status_code == 401
        # The supervisor's spec is the applied one: a second reload changes nothing.
        r = reload(up)
        assert r.returncode == 0 and "gateway settings: no change" in r.stdout, r.stdout
    finally:
        assert up.stop() == 0


def test_a_reload_report_hides_keys_and_says_when_there_are_none() -> None:
    """A tenant added without keys read `api_keys: (absent) -> (hidden)`, as if keys had
    been set (a review); a count says what changed without saying the keys."""
    from unbroken.pipeline.reload import change

    assert change("gateway.tenants.anon.api_keys", "(absent)", [])["new"] == "none"
    assert change("gateway.tenants.a.api_keys", [], ["sha256:ab", "sha256:cd"])["new"] == (
        "2 key(s), hidden"
    )
    assert change("pools.p.api_key", None, "secret") == {
        "key": "pools.p.api_key",
        "old": "none",
        "new": "(hidden)",
    }
    assert change("pools.p.engine.env.TOKEN", "a", "b")["new"] == "(hidden)"
