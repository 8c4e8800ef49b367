"""The gateway's settings from `unbroken gateway`'s options: static endpoints, the settings
file with flags over it (read again at each reload), and Kubernetes discovery. Kept apart
from the CLI so that the command only parses options; every error is a ValueError whose text
is the one line the command prints."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from unbroken.gateway._server import GatewayConfig, StaticEndpoint

if TYPE_CHECKING:
    from unbroken.k8s.discovery import K8sSettings

__all__ = ["Launch", "prepare", "static_endpoints"]


@dataclass
class Launch:
    """What `run_gateway` needs besides the process options."""

    cfg: GatewayConfig
    static: list[StaticEndpoint]
    k8s: K8sSettings | None
    load: Callable[[], GatewayConfig]  # the settings on disk now (SIGHUP reload)


def _bad_url(url: str) -> str | None:
    """Why an engine URL cannot work, caught at start (a review: such URLs were taken and
    the endpoint stayed "starting" for ever, logging the probe's failure each second)."""
    from urllib.parse import urlsplit

    if "," in url or any(c.isspace() for c in url):
        return "one URL per --endpoint (repeat the flag for each engine)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises on a port that is not a number in range
    except ValueError as e:
        return f"not a URL: {e}"
    if not parts.hostname:
        return "expected [POOL=]http(s)://HOST:PORT"
    if parts.query or parts.fragment:
        return "the engine's base URL takes no query or fragment"
    if parts.path.rstrip("/").endswith("/v1"):
        base = url[: url.rstrip("/").rfind("/v1")]
        return f"the engine's base URL, without /v1 (the gateway adds the API paths): {base}"
    return None


def static_endpoints(items: Sequence[str]) -> list[StaticEndpoint]:
    """`--endpoint [POOL=]URL` values as endpoints (pool `default` when not named)."""
    static = []
    for item in items:
        pool, _, url = item.rpartition("=") if "=" in item.split("://", 1)[0] else ("", "", item)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint {item!r}: expected [POOL=]http(s)://HOST:PORT")
        if why := _bad_url(url):
            raise ValueError(f"--endpoint {item!r}: {why}")
        static.append(StaticEndpoint(url=url.rstrip("/"), pool=pool or "default"))
    return static


def prepare(
    endpoints: Sequence[str],
    config: Path | None,
    flags: Mapping[str, object],
    *,
    k8s_service: Sequence[str] = (),
    k8s_peers: str | None = None,
    pool_cap: Sequence[str] = (),
    pod_name: str | None = None,
    pod_namespace: str | None = None,
) -> Launch:
    """Validate the options in the order the command reports them: endpoints, the settings
    file (flags that are not None override its keys), then Kubernetes discovery."""
    import yaml
    from pydantic import ValidationError

    static = static_endpoints(endpoints)
    given = {k: v for k, v in flags.items() if v is not None}

    def load() -> GatewayConfig:  # again at each reload (SIGHUP): the settings on disk now
        base = (yaml.safe_load(config.read_text()) or {}) if config else {}
        return GatewayConfig.model_validate({**base, **given})

    try:
        cfg = load()
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read {config}: {e}") from e
    except ValidationError as e:
        from unbroken.config.spec import format_errors

        raise ValueError(format_errors(e)) from e
    k8s = None
    if k8s_service or k8s_peers:
        from unbroken.k8s.discovery import gateway_settings

        k8s = gateway_settings(
            list(k8s_service), k8s_peers, list(pool_cap), pod_name, pod_namespace
        )
    return Launch(cfg, static, k8s, load)
