"""Reading an engine's /metrics by name (`?name[]=`, `wire.metrics.filtered_path`) and falling
back to the whole page where the filter loses the series. The server here is
prometheus_client's own exposition (`make_wsgi_app`, real HTTP on a real socket) over a
collector without `describe()`, which is how prometheus_client's multiprocess collector
(a vLLM served with PROMETHEUS_MULTIPROC_DIR through `make_asgi_app`) is registered: asked
for names, it answers an empty page."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

import httpx
import pytest
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from unbroken.config.spec import ControllerSettings
from unbroken.controller.actions import EndpointView, Tiers
from unbroken.controller.config import ControllerConfig
from unbroken.controller.metrics import ControllerMetrics
from unbroken.controller.sensing import Sensing
from unbroken.controller.signals import ENGINE_METRICS_PATH
from unbroken.gateway._prober import METRICS_PATH
from unbroken.wire.metrics import FILTER_PROBE


class _NoDescribe:
    """vLLM's series from a collector with `collect()` only (as MultiProcessCollector)."""

    def __init__(self) -> None:
        self.running = 7.0
        self.requests = 0  # what reads reached the server (the whole page or filtered)

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("vllm:num_requests_running", "running", labels=["model_name"])
        g.add_metric(["m"], self.running)
        yield g
        w = GaugeMetricFamily("vllm:num_requests_waiting", "waiting", labels=["model_name"])
        w.add_metric(["m"], 2.0)
        yield w
        h = HistogramMetricFamily("vllm:inter_token_latency_seconds", "itl", labels=["model_name"])
        h.add_metric(["m"], [("0.01", 1.0), ("+Inf", 4.0)], sum_value=0.2)
        yield h


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def multiproc_server() -> Iterator[tuple[str, _NoDescribe, list[str]]]:
    registry = CollectorRegistry()
    coll = _NoDescribe()
    registry.register(coll)  # type: ignore[arg-type]
    app = make_wsgi_app(registry)
    paths: list[str] = []

    def logged(environ: dict[str, Any], start: Any) -> Any:
        paths.append(environ.get("QUERY_STRING", ""))
        return app(environ, start)

    srv = make_server("127.0.0.1", 0, logged, handler_class=_Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_port}", coll, paths
    srv.shutdown()


def test_prometheus_clients_multiprocess_page_loses_the_series_when_filtered(
    multiproc_server: tuple[str, _NoDescribe, list[str]],
) -> None:
    """What the fallback detects: the filtered page lacks FILTER_PROBE, the whole page has it."""
    url, _, _ = multiproc_server
    for path in (ENGINE_METRICS_PATH, METRICS_PATH):
        r = httpx.get(url + path, timeout=10)
        assert r.status_code == 200 and FILTER_PROBE not in r.text, r.text
    assert FILTER_PROBE in httpx.get(url + "/metrics", timeout=10).text


async def test_controller_reads_the_whole_page_where_the_filter_loses_the_series(
    multiproc_server: tuple[str, _NoDescribe, list[str]],
) -> None:
    url, coll, paths = multiproc_server
    cfg = ControllerConfig(
        settings=ControllerSettings(),
        admin_urls=["http://127.0.0.1:9"],
        admin_token="t",
        tiers=Tiers(full=("primary",), degraded=("fallback",)),
    )
    sensing = Sensing(cfg, ControllerMetrics(), lambda c: None)  # type: ignore[arg-type,return-value]
    sensing.open()
    view = EndpointView("e", "primary", url, "ready", 0, 8, None, "normal")
    try:
        w = await sensing.read_engine(view)
        assert w is not None and (w.running, w.waiting) == (7.0, 2.0)
        asked = parse_qs(ENGINE_METRICS_PATH.split("?", 1)[1])
        assert [parse_qs(q) for q in paths] == [asked, {}]  # filtered, then whole
        coll.running = 3.0
        w = await sensing.read_engine(view)
        assert w is not None and w.running == 3.0
        assert paths[2:] == [""]  # from then on the whole page only
    finally:
        await sensing.close()
