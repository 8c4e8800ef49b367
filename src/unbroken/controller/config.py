"""The controller's configuration: `ControllerConfig` (what a `Controller` runs with) and
`from_options`, which builds it from `unbroken controller`'s options: the settings file with
flags over it, validated as `ControllerSettings`, the admin and engine tokens, and the
gateways and agents to read. A bad option or file is a `ControllerConfigError` whose text is
the one line the command prints (exit 2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.config.spec import ControllerSettings
from unbroken.controller.actions import Tiers

__all__ = ["ControllerConfig", "ControllerConfigError", "from_options"]


@dataclass
class ControllerConfig:
    settings: ControllerSettings
    admin_urls: list[str]
    admin_token: str
    tiers: Tiers
    agent_urls: list[str] = field(default_factory=list)
    supervisor_socket: str | None = None  # dynamic precision under `unbroken up`
    # On Kubernetes: discover every gateway replica's admin API and every node's agent.
    gateway_service: str | None = None
    agent_service: str | None = None
    # The engines' admin token: where an engine has an admin API (the simulator's), its
    # max_num_seqs follows the gateway cap. None: the gateway's cap alone.
    engine_token: str | None = None


class ControllerConfigError(Exception):
    """An option or settings file the controller cannot start with."""


def _secret(path: Path, label: str) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ControllerConfigError(f"{label}: {e.strerror}") from None


def settings_from(
    config: Path | None,
    *,
    listen: str | None = None,
    interval: float | None = None,
    full_pools: Sequence[str] = (),
    degraded_pools: Sequence[str] = (),
) -> ControllerSettings:
    """The settings file (JSON or YAML), then the flags over it, validated."""
    import yaml
    from pydantic import ValidationError

    data: dict[str, object] = {}
    if config is not None:
        try:
            loaded = yaml.safe_load(config.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ControllerConfigError(f"--config {config}: {e}") from None
        if not isinstance(loaded, dict):
            raise ControllerConfigError(f"--config {config}: expected a mapping")
        data.update(loaded)
    if listen is not None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ControllerConfigError(f"--listen {listen!r}: expected HOST:PORT")
        data["host"], data["port"] = host, int(port)
    if interval is not None:
        data["interval_s"] = interval
    if full_pools:
        data["full_pools"] = list(full_pools)
    if degraded_pools:
        data["degraded_pools"] = list(degraded_pools)
    try:
        return ControllerSettings.model_validate(data)
    except ValidationError as e:
        raise ControllerConfigError(
            "controller settings: "
            + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        ) from None


def from_options(
    settings: ControllerSettings,
    *,
    gateway_admin: Sequence[str] = (),
    gateway_service: str | None = None,
    admin_token: str | None = None,
    token_file: Path | None = None,
    agent_urls: Sequence[str] = (),
    agent_service: str | None = None,
    supervisor_socket: str | None = None,
    engine_token: str | None = None,
    engine_token_file: Path | None = None,
) -> ControllerConfig:
    """The configuration from validated settings and the command's other options: a token
    given beats its file; without gateways or a gateway Service, the local gateway."""
    token = admin_token
    if token is None and token_file is not None:
        token = _secret(token_file, f"--token-file {token_file}")
    if not token:
        raise ControllerConfigError(
            "an admin token is needed: --admin-token, UNBROKEN_ADMIN_TOKEN or --token-file"
        )
    if engine_token is None and engine_token_file is not None:
        engine_token = _secret(engine_token_file, f"--engine-token-file {engine_token_file}")
    gateways = list(gateway_admin or ([] if gateway_service else ["http://127.0.0.1:8081"]))
    for url in [*gateways, *agent_urls]:
        if not url.startswith(("http://", "https://")):
            raise ControllerConfigError(f"{url!r}: expected http(s)://HOST:PORT")
    for opt, ref in (("--gateway-service", gateway_service), ("--agent-service", agent_service)):
        if ref is not None:
            ns, sep, svc = ref.partition("/")
            if not sep or not ns or not svc:
                raise ControllerConfigError(f"{opt} {ref!r}: expected NAMESPACE/SERVICE[:PORTNAME]")
    return ControllerConfig(
        settings=settings,
        admin_urls=[u.rstrip("/") for u in gateways],
        admin_token=token,
        tiers=Tiers(tuple(settings.full_pools), tuple(settings.degraded_pools)),
        agent_urls=[u.rstrip("/") for u in agent_urls],
        supervisor_socket=supervisor_socket,
        gateway_service=gateway_service,
        agent_service=agent_service,
        engine_token=engine_token or None,
    )
