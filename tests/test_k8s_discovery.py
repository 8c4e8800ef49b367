"""EndpointSlice discovery: real gateway processes in front of real simulator engines, with
endpoints coming from a Kubernetes API server.

The API server is a stand-in (tests/k8s_apiserver.py): no real one can run on our machines
(no kind, k3s or etcd). It speaks the list and watch protocol of discovery.k8s.io/v1
EndpointSlices the way the real one does, including `410 Gone` and watches cut mid-stream,
and it is the only thing here that is not real: the gateway talks to it with lightkube over
HTTP, and every stream runs through the gateway to real engines and is checked byte for
byte against the simulator's deterministic text.

In a cluster every pod has its own IP and the same port; here the engines share 127.0.0.1
with different ports, so each engine gets its own slice (slices group endpoints by port set,
so this is a shape the real API also produces).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from helpers import MODEL, TOKEN, Proc, admin, engine, gateway, metric, wait_endpoints, wait_for
from k8s_apiserver import ApiServer, Ep
from unbroken.engine.textmodel import expected_completion
from unbroken.gateway._discovery import cap_share
from unbroken.k8s import hooks
from unbroken.k8s.discovery import (
    ServiceRef,
    SliceEndpoint,
    SliceWatcher,
    gateway_settings,
    slice_endpoints,
)
from unbroken.wire.sse import SSEDecoder

NS = "default"
SLOW = ("--decode-base-s", "0.01")  # 300 tokens take 3 s or more: time to act mid-stream


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ApiServer]:
    srv = ApiServer()
    monkeypatch.setenv("KUBECONFIG", str(srv.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    yield srv
    srv.close()


def put(api: ApiServer, pod: str, e: Proc, service: str = "eng", **conditions: Any) -> None:
    api.put_slice(NS, f"{service}-{pod}", service, [Ep(pod, **conditions)], e.port, "http")


def names(g: Proc) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}


def read_stream(
    url: str, body: dict[str, Any], after: int, action: Callable[[str], None]
) -> tuple[str, str]:
    """Stream a completion; call `action(endpoint)` once `after` tokens arrived. Returns
    (text, the endpoint that started the stream)."""
    dec = SSEDecoder()
    text: list[str] = []
    tokens = 0
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        first = r.headers["x-unbroken-endpoint"]
        for chunk in r.iter_raw():
            for ev in dec.feed(chunk):
                if ev.data is None or ev.is_done:
                    continue
                obj = orjson.loads(ev.data)
                assert "error" not in obj, obj
                for c in obj.get("choices", []):
                    if c.get("text"):
                        text.append(c["text"])
                        tokens += 1
                        if tokens == after:
                            action(first)
    return "".join(text), first


def count(g: Proc, name: str) -> float:
    """A counter's total; a counter with no sample yet counts 0."""
    try:
        return metric(g.url, name)
    except KeyError:
        return 0.0


def served_by(g: Proc) -> str:
    r = httpx.post(
        g.url + "/v1/completions",
        json={"model": MODEL, "prompt": "who", "max_tokens": 2, "temperature": 0},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-unbroken-endpoint"]


def k8s_gateway(tmp: Path, *args: str, name: str = "gateway") -> Proc:
    return gateway(
        tmp, args=("--k8s-service", f"primary={NS}/eng:http", *args), wait_ready=0, name=name
    )


def test_cap_share_adds_up() -> None:
    for total in range(1, 12):
        for n in range(1, total + 1):
            shares = [cap_share(total, n, i) for i in range(n)]
            assert sum(shares) == total and max(shares) - min(shares) <= 1
    assert [cap_share(2, 3, i) for i in range(3)] == [1, 1, 1]  # never 0: overshoot, logged


def test_lifecycle_from_endpointslices(tmp_path: Path, api: ApiServer) -> None:
    """ready → added after warm-up; terminating → drained, its stream finishes in place;
    removed → its stream migrates; 410 Gone, a dropped watch and an unreachable API server
    leave the gateway serving from what it knew."""
    a = engine(tmp_path, *SLOW, name="a")
    b = engine(tmp_path, *SLOW, name="b")
    c = engine(tmp_path, *SLOW, name="c")
    put(api, "a", a)
    put(api, "b", b, ready=False)  # not ready yet: the gateway must not add it
    g = k8s_gateway(tmp_path)
    procs = [g, a, b, c]
    try:
        wait_endpoints(
            g, lambda eps: any(e["name"] == "a.default" and e["state"] == "ready" for e in eps)
        )
        assert set(names(g)) == {"a.default"}
        assert api.watches and api.watches[0] == str(api.rv)  # watched from the list's version

        # Addition: ready in the slice → added, and traffic only after our own warm-up.
        put(api, "b", b)
        wait_endpoints(
            g, lambda eps: {e["name"]: e["state"] for e in eps}.get("b.default") == "ready"
        )
        assert "b.default: stage 2 passed" in g.tail(200)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}
        expected = expected_completion("Once upon a time", 300).text

        # terminating → drain: no new requests, the stream in flight finishes where it is.
        pods = {"a.default": ("a", a), "b.default": ("b", b)}  # the header names the endpoint
        seen: dict[str, str] = {}

        def terminate(first: str) -> None:
            pod, proc = pods[first]
            put(api, pod, proc, ready=False, serving=True, terminating=True)
            wait_endpoints(g, lambda eps: {e["name"]: e["state"] for e in eps}[first] == "draining")
            seen["other"] = served_by(g)

        text, first = read_stream(g.url, body, after=20, action=terminate)
        assert text == expected
        assert seen["other"] != first  # new work went elsewhere while the stream went on
        assert count(g, "unbroken_gateway_streams_migrated_total") == 0
        wait_endpoints(g, lambda eps: first not in {e["name"] for e in eps})
        api.delete_slice(NS, f"eng-{pods[first][0]}")  # the pod is gone
        survivor_pod = pods[seen["other"]][0]

        # removed → what still streams migrates at once (drain with deadline 0).
        put(api, "c", c)
        wait_endpoints(
            g, lambda eps: {e["name"]: e["state"] for e in eps}.get("c.default") == "ready"
        )
        on: dict[str, str] = {}

        def remove(first: str) -> None:
            on["first"] = first
            pod = "c" if first == "c.default" else survivor_pod
            api.delete_slice(NS, f"eng-{pod}")

        text, first = read_stream(g.url, body, after=20, action=remove)
        assert text == expected
        assert count(g, "unbroken_gateway_streams_migrated_total") == 1
        left = {e["name"] for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
        assert len(left) == 1  # the removed one is gone, the other serves

        # 410 Gone: the gateway lists again and keeps watching.
        lists = api.lists
        api.compact()
        wait_for(lambda: api.lists > lists, 10, what="re-list after 410")
        assert metric(g.url, "unbroken_gateway_k8s_watch_restarts_total", reason="gone") >= 1
        # A watch cut mid-stream: listed again, and changes after it still arrive.
        lists = api.lists
        api.drop_watches()
        wait_for(lambda: api.lists > lists, 10, what="re-list after a dropped watch")
        put(api, "a2", a)  # a new pod (on a's engine process)
        wait_endpoints(
            g, lambda eps: {e["name"]: e["state"] for e in eps}.get("a2.default") == "ready"
        )

        # preStop's drain reaches the gateway before the slice says `terminating`: the
        # endpoint, let go while its slice still says ready, must not come back.
        assert admin(g, "POST", "/admin/endpoints/a2.default/drain", {}).status_code == 200
        wait_endpoints(g, lambda eps: "a2.default" not in {e["name"] for e in eps})
        time.sleep(3)  # more than the 2 s re-apply of the last known view
        assert "a2.default" not in names(g)
        put(api, "a2", a, ready=False)  # readiness flaps: ready again is a fresh start
        put(api, "a2", a)
        wait_endpoints(
            g, lambda eps: {e["name"]: e["state"] for e in eps}.get("a2.default") == "ready"
        )

        # Unreachable: serve from the last known state, and say so.
        api.stop()
        wait_for(lambda: metric(g.url, "unbroken_gateway_k8s_api_up") == 0, 15, what="api_up 0")
        assert "unreachable, serving the last known endpoints" in g.tail(200)
        text, _ = read_stream(g.url, body, after=10**9, action=lambda _: None)
        assert text == expected
        api.start()
        wait_for(lambda: metric(g.url, "unbroken_gateway_k8s_api_up") == 1, 40, what="api_up 1")
        assert count(g, "unbroken_gateway_streams_dropped_total") == 0
    finally:
        for p in procs:
            p.stop()


def test_two_gateways_share_an_engines_cap(tmp_path: Path, api: ApiServer) -> None:
    """Two gateway replicas in front of one engine with a cap of 2 for the engine as a whole:
    each takes 1 while both are live, and the engine never runs more than 2 at once; when
    one replica leaves its Service, the other takes the whole cap."""
    e = engine(tmp_path, *SLOW, name="e")
    put(api, "e", e)
    for pod in ("gw-0", "gw-1"):
        api.put_slice(NS, f"gw-{pod}", "gw", [Ep(pod)], 8081, "admin")
    peers = ("--k8s-peers", f"{NS}/gw:admin", "--pool-cap", "primary=2", "--pod-namespace", NS)
    g0 = k8s_gateway(tmp_path, *peers, "--pod-name", "gw-0", name="gw0")
    g1 = k8s_gateway(tmp_path, *peers, "--pod-name", "gw-1", name="gw1")
    try:
        for g in (g0, g1):
            wait_endpoints(g, lambda eps: [(x["state"], x["cap"]) for x in eps] == [("ready", 1)])
        assert metric(g0.url, "unbroken_gateway_k8s_gateway_replicas") == 2

        running: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                running.append(metric(e.url, "vllm:num_requests_running"))
                time.sleep(0.02)

        body = {"model": MODEL, "prompt": "cap", "max_tokens": 60, "temperature": 0}
        texts: list[str] = []

        def one(g: Proc) -> None:
            r = httpx.post(g.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])

        sampler = threading.Thread(target=sample)
        sampler.start()
        users = [threading.Thread(target=one, args=(g,)) for g in (g0, g1) for _ in range(3)]
        for t in users:
            t.start()
        for t in users:
            t.join(90)
        stop.set()
        sampler.join()
        assert texts == [expected_completion("cap", 60).text] * 6
        assert max(running) == 2, running  # both replicas used their share, never more

        # One replica leaves: the other takes the whole cap.
        api.delete_slice(NS, "gw-gw-1")
        wait_endpoints(g0, lambda eps: [x["cap"] for x in eps] == [2])
        assert metric(g0.url, "unbroken_gateway_k8s_gateway_replicas") == 1
    finally:
        for p in (g0, g1, e):
            p.stop()


def test_ready_hook(tmp_path: Path) -> None:
    """The two-stage check the engine pods' readiness probe runs (stdlib only)."""
    e = engine(tmp_path, name="r")
    try:
        ok, why = hooks.ready(e.url, budget_ms=5000)
        assert ok, why
        ok, why = hooks.ready(e.url, budget_ms=0.001)  # no completion is that fast
        assert not ok, why
        cli = [sys.executable, "-m", "unbroken", "ready", "--url", e.url, "--budget-ms"]
        p = subprocess.run([*cli, "5000"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "ready (warm-up" in p.stderr, p.stderr
        assert subprocess.run([*cli, "0.001"], capture_output=True, timeout=60).returncode == 1
    finally:
        e.stop()
    ok, why = hooks.ready(e.url, budget_ms=5000)
    assert not ok and "Connection refused" in why, why


def test_prestop_drain_hook_on_every_gateway(tmp_path: Path) -> None:
    """The preStop hook, run as the engine container runs it (a plain `python3 -S` on the
    copied file: no site-packages), drains the endpoint and returns only once the gateway has
    let it go, while the stream in flight finishes whole; then the hook's function drains on
    two gateway replicas at once."""
    e = engine(tmp_path, *SLOW, name="p")
    g0 = gateway(tmp_path, e.url, name="g0")
    g1 = gateway(tmp_path, e.url, name="g1")
    name = f"127.0.0.1:{e.port}"
    installed = hooks.install(tmp_path / "opt")
    result: dict[str, Any] = {}

    def run_hook() -> None:
        argv = ["python3", "-S", str(installed), "drain", name, "--admin", g0.admin_url]
        p = subprocess.run(
            [*argv, "--timeout", "30"],
            env={"UNBROKEN_ADMIN_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        result.update(rc=p.returncode, err=p.stderr)

    hook = threading.Thread(target=run_hook)
    try:
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 150, "temperature": 0}
        text, _ = read_stream(g0.url, body, after=10, action=lambda _: hook.start())
        hook.join(60)
        assert result["rc"] == 0, result["err"]
        assert "draining" in result["err"] and "drained on 1 gateway" in result["err"]
        assert text == expected_completion("drain me", 150).text
        assert name not in names(g0)
        assert hooks.drain_everywhere(
            name,
            [g1.admin_url, g0.admin_url],
            token=TOKEN,
            deadline_s=1.0,
            timeout=20,
            log=lambda m: None,
        )
        assert name not in names(g1)
        # The CLI form, token from a file (a mounted Secret), on an endpoint added back.
        add = {"url": e.url, "name": name, "warmup": False}
        assert admin(g1, "POST", "/admin/endpoints", add).status_code == 201
        wait_endpoints(g1, lambda eps: [x["state"] for x in eps] == ["ready"])
        (tmp_path / "token").write_text(TOKEN + "\n")
        argv = [sys.executable, "-m", "unbroken", "drain", name, "--admin-url", g1.admin_url]
        p = subprocess.run(
            [*argv, "--token-file", str(tmp_path / "token"), "--timeout", "20"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        assert name not in names(g1)
        assert hooks.gateway_addresses("localhost:8081", every_address=True)[0].endswith(":8081")
    finally:
        for p in (g0, g1, e):
            p.stop()


def test_slice_endpoints_conditions_and_names() -> None:
    """Table: how one EndpointSlice maps to endpoints (nil conditions as the API documents)."""
    from lightkube.resources.discovery_v1 import EndpointSlice

    obj = EndpointSlice.from_dict(
        {
            "metadata": {"name": "s", "namespace": "ns"},
            "addressType": "IPv6",
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["fd00::1"], "targetRef": {"kind": "Pod", "name": "p1"}},
                {"addresses": ["fd00::2"], "conditions": {"ready": False, "terminating": True}},
                {"addresses": ["fd00::3"], "conditions": {"ready": False, "serving": True}},
            ],
        }
    )
    eps = {e.name: e for e in slice_endpoints(obj, "http")}
    assert eps["p1.ns"] == SliceEndpoint("p1.ns", "http://[fd00::1]:8000", True, True, False)
    assert eps["fd00::2:8000"].terminating and not eps["fd00::2:8000"].serving
    assert eps["fd00::3:8000"].serving and not eps["fd00::3:8000"].ready
    assert slice_endpoints(obj, "grpc") == []  # no such port: nothing to route to
    assert {e.url for e in slice_endpoints(obj, None)} == {
        "http://[fd00::1]:9000",
        "http://[fd00::2]:9000",
        "http://[fd00::3]:9000",
    }


@pytest.mark.parametrize(
    ("services", "peers", "caps", "pod", "error"),
    [
        (["primary"], None, [], None, "--k8s-service 'primary'"),
        (["primary=ns"], None, [], None, "expected NAMESPACE/SERVICE"),
        (["primary=ns/svc"], None, ["primary=0"], None, "--pool-cap 'primary=0'"),
        (["primary=ns/svc"], "ns/gw", [], None, "needs this pod's name"),
    ],
)
def test_gateway_settings_errors(
    services: list[str], peers: str | None, caps: list[str], pod: str | None, error: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        gateway_settings(services, peers, caps, pod, "ns")
    ok = gateway_settings(["primary=ns/svc:http"], "ns/gw:admin", ["primary=4"], "gw-0", "ns")
    assert ok.services["primary"] == ServiceRef("ns", "svc", "http")
    assert (ok.pod, ok.pool_caps, str(ok.peers)) == ("gw-0.ns", {"primary": 4}, "ns/gw:admin")


def test_rendered_pod_commands_run(tmp_path: Path, api: ApiServer) -> None:
    """The commands `render k8s --engine simulator` writes, run as written (paths and ports
    moved to this machine): the initContainers' scripts, the engine, the gateway with its
    rendered config and discovery options, the engine's readiness probe, and its preStop drain
    finding the endpoint under the name discovery gave it."""
    import yaml

    from unbroken.config.spec import default_spec
    from unbroken.k8s import RenderOptions, render
    from unbroken.wire.http import free_port

    objs = render(default_spec(), RenderOptions(engine="simulator"))
    dep = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    pod = dep["unbroken-primary"]["spec"]["template"]["spec"]
    gw_c = dep["unbroken-gateway"]["spec"]["template"]["spec"]["containers"][0]
    config = next(o for o in objs if o["metadata"]["name"] == "unbroken-gateway-config")
    port, gw_port, admin_port = free_port(), free_port(), free_port()
    subs = {
        "/models": str(tmp_path / "models"),
        "/opt/unbroken": str(tmp_path / "opt"),
        "/etc/unbroken/gateway.yaml": str(tmp_path / "gateway.yaml"),
        "0.0.0.0": "127.0.0.1",
        "127.0.0.1:8000": f"127.0.0.1:{port}",
        # --every-address resolves this name; localhost has one IPv4 address, as a headless
        # Service with one gateway pod would.
        "unbroken-gateway-admin.unbroken.svc:8081": f"localhost:{admin_port}",
    }

    def local(cmd: list[str]) -> list[str]:
        out = []
        for i, arg in enumerate(cmd):
            for k, v in subs.items():
                arg = arg.replace(k, v)
            if arg == "8000" and cmd[i - 1] == "--port":
                arg = str(port)
            out.append(arg)
        return out

    cli = [sys.executable, "-m", "unbroken"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    for init in pod["initContainers"]:  # hooks install, weights + prewarm
        cmd = local(init["command"])
        cmd = [*cli[:1], *cmd[1:]] if cmd[0] == "python3" else cmd
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (init["name"], p.stdout, p.stderr)
    assert (tmp_path / "opt" / "hooks.py").exists()
    assert list((tmp_path / "models" / "primary").glob("*.safetensors"))

    c = pod["containers"][0]
    e = Proc([*cli, *local(c["args"])], port, tmp_path / "engine.log").start()
    settings = yaml.safe_load(config["stringData"]["gateway.yaml"])  # a Secret
    settings |= {"host": "127.0.0.1", "port": gw_port, "admin_host": "127.0.0.1"}
    settings["admin_port"] = admin_port
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(settings))
    pod_name = "unbroken-primary-7d9c-x2x"
    api.put_slice("unbroken", "p-1", "unbroken-primary", [Ep(pod_name)], port, "http")
    g = Proc(
        [*cli, *local(gw_c["args"])],
        gw_port,
        tmp_path / "gateway.log",
        env={"UNBROKEN_ADMIN_TOKEN": TOKEN, "POD_NAME": "gw-0", "POD_NAMESPACE": "unbroken"},
        admin_port=admin_port,
    ).start()
    try:
        wait_endpoints(
            g,
            lambda eps: (
                [(x["name"], x["state"]) for x in eps] == [(f"{pod_name}.unbroken", "ready")]
            ),
        )
        assert api.watches  # the rendered --k8s-peers and --k8s-service are watched
        # The rendered gateway does not name its pods to clients (endpoint_header off), so
        # the request is checked by its answer and the engine's own count.
        served = metric(e.url, "vllm:request_success_total")
        r = httpx.post(
            g.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200 and "x-unbroken-endpoint" not in r.headers, r.headers
        assert metric(e.url, "vllm:request_success_total") == served + 1
        hook_env = {"PATH": "/usr/bin:/bin", "UNBROKEN_ADMIN_TOKEN": TOKEN}
        ready = subprocess.run(
            local(c["readinessProbe"]["exec"]["command"]), env=hook_env, capture_output=True
        )
        assert ready.returncode == 0, ready.stderr
        hook_env |= {"POD_NAME": pod_name, "POD_NAMESPACE": "unbroken"}
        pre = subprocess.run(
            local(c["lifecycle"]["preStop"]["exec"]["command"]),
            env=hook_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert pre.returncode == 0, pre.stderr
        assert names(g) == {}
    finally:
        g.stop()
        e.stop()


# -- the watch loop itself, in this process against the stand-in API server --------------
async def until(cond: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def watching(**kw: Any) -> AsyncIterator[SliceWatcher]:
    """A SliceWatcher of `default/eng:http` running in this loop, after its first list."""
    w = SliceWatcher(ServiceRef(NS, "eng", "http"), lambda eps: None, **kw)
    task = asyncio.create_task(w.run())
    try:
        await until(lambda: w.synced, 10, "the first list")
        yield w
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def put_elsewhere(api: ApiServer, n: int) -> None:
    """The cluster moves on: changes that no watch of `eng` sees."""
    for i in range(n):
        api.put_slice("other", f"x-{i}", "other", [Ep(f"x{i}")], 8000, "http")


async def test_watch_resumes_without_listing_when_the_server_ends_it(api: ApiServer) -> None:
    """Every WATCH asks for bookmarks with the server's timeout, and a watch the server ends
    (timeoutSeconds) is renewed from the last version seen, without a LIST. (The API server is
    the stand-in, the one thing faked here.)"""
    api.put_slice(NS, "eng-a", "eng", [Ep("p1")], 8000, "http")
    async with watching(server_timeout_s=1) as w:
        await until(lambda: api.watches, 5, "a watch")
        api.put_slice(NS, "eng-b", "eng", [Ep("p2")], 8000, "http")
        await until(lambda: "p2.default" in w.endpoints, 5, "the change")
        changed = str(api.rv)
        await until(lambda: len(api.watches) >= 3, 5, "two renewals")
    assert api.lists == 1
    assert api.watches[-1] == changed  # from the change's version, not the list's
    for q in api.watch_params:
        assert q["allowWatchBookmarks"] == "true", q
        assert q["timeoutSeconds"] == "1" and q["labelSelector"] == "kubernetes.io/service-name=eng"


async def test_minimal_bookmarks_keep_a_quiet_watch_current(api: ApiServer) -> None:
    """A quiet Service's watch follows the cluster's version through bookmarks in the minimal
    form the Kubernetes docs show (only metadata.resourceVersion): once older versions are
    compacted, the renewed watch starts from the bookmark's version, so no 410 and no LIST.
    (The API server is the stand-in, the one thing faked here.)"""
    api.put_slice(NS, "eng-a", "eng", [Ep("p1")], 8000, "http")
    async with watching(server_timeout_s=1) as w:
        await until(lambda: api.watches, 5, "a watch")
        put_elsewhere(api, 3)
        version = str(api.rv)
        api.bookmark()
        # The server ends the watch each second: the next one starts from the bookmark.
        await until(lambda: api.watches[-1] == version, 5, "a watch from the bookmark's version")
        assert w.version == version
        api.compact(cut_watches=False)  # the list's version is gone now
        n = len(api.watches)
        await until(lambda: len(api.watches) >= n + 2, 5, "two renewals")
        assert api.lists == 1
        assert api.watches[-1] == version
        api.put_slice(NS, "eng-b", "eng", [Ep("p2")], 8000, "http")
        await until(lambda: "p2.default" in w.endpoints, 5, "a change after the bookmarks")
        assert "p1.default" in w.endpoints and api.lists == 1


@pytest.mark.parametrize(("code", "reason"), [(410, "Expired"), (500, "InternalError")])
async def test_watch_failing_at_once_backs_off_and_reports_down(
    api: ApiServer, caplog: pytest.LogCaptureFixture, code: int, reason: str
) -> None:
    """Every watch refused right after its (successful) LIST: the lists back off (0.25 s
    doubling to 2 s: at most 5 lists in 4 s, where a delay reset after each list gave 7 or
    more), and after 3 such watches the API is reported down (gauge 0, a WARNING); a watch
    that lives again reports it up. (The API server is the stand-in, the one thing faked.)"""
    api.put_slice(NS, "eng-a", "eng", [Ep("p1")], 8000, "http")
    ups: list[tuple[bool, str | None]] = []
    kw: dict[str, Any] = {"backoff": (0.25, 2.0), "server_timeout_s": 2}
    async with watching(on_api=lambda up, why: ups.append((up, why)), **kw) as w:
        await until(lambda: api.watches, 5, "a watch")
        api.fail_watches = (code, reason)
        lists = api.lists
        api.drop_watches()
        await asyncio.sleep(4.0)
        assert 3 <= api.lists - lists <= 5, api.lists - lists
        assert not w.api_up and ups[-1] == (False, "watch failing"), ups
        assert any(
            r.levelno == logging.WARNING and "watch failing" in r.getMessage()
            for r in caplog.records
        )
        assert "p1.default" in w.endpoints  # the last known state stays
        api.fail_watches = None
        await until(lambda: w.api_up, 10, "api up once a watch lives")
        assert ups[-1] == (True, None)


def test_endpoint_moving_between_slices_keeps_its_stream(tmp_path: Path, api: ApiServer) -> None:
    """The EndpointSlice controller moves a pod's endpoint to another slice: the old slice is
    rewritten without it, then the new slice added (two events). The endpoint, briefly in no
    slice, stays ready and its stream is not migrated; gone for good, it is removed after
    the grace. (The API server is the stand-in, the one thing faked here.)"""
    a = engine(tmp_path, *SLOW, name="a")
    b = engine(tmp_path, *SLOW, name="b")
    put(api, "a", a)
    put(api, "b", b)
    g = k8s_gateway(tmp_path)
    try:
        wait_endpoints(g, lambda eps: [e["state"] for e in eps] == ["ready", "ready"])
        body = {"model": MODEL, "prompt": "move", "max_tokens": 300, "temperature": 0}
        states: list[str] = []

        def move(first: str) -> None:
            pod, proc = {"a.default": ("a", a), "b.default": ("b", b)}[first]
            api.put_slice(NS, f"eng-{pod}", "eng", [], proc.port, "http")
            api.put_slice(NS, f"eng-{pod}-2", "eng", [Ep(pod)], proc.port, "http")
            deadline = time.monotonic() + 2.5  # longer than the grace
            while time.monotonic() < deadline:
                states.append(names(g).get(first, {}).get("state", "absent"))
                time.sleep(0.05)

        text, first = read_stream(g.url, body, after=10, action=move)
        assert set(states) == {"ready"}, states
        assert text == expected_completion("move", 300).text
        assert count(g, "unbroken_gateway_streams_migrated_total") == 0
        assert "left its EndpointSlice" not in g.tail(200)
        pod = first.split(".")[0]
        api.delete_slice(NS, f"eng-{pod}-2")  # gone for good: removed once the grace is over
        wait_endpoints(g, lambda eps: first not in {e["name"] for e in eps}, timeout=10)
    finally:
        for p in (g, a, b):
            p.stop()
