"""Where the controller reads and acts: the gateway admin APIs and the node agents, given as
URLs or discovered on Kubernetes from their Services' EndpointSlices.

A cluster runs several gateway replicas (each keeps its own view of conditions, caps and
routes, so every one must be told) and one agent per GPU node (each sees only its node's
engines). Locally there is one of each.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["Sources"]

log = logging.getLogger("unbroken.controller")


class Sources:
    def __init__(
        self,
        gateways: list[str],
        agents: list[str],
        *,
        gateway_service: str | None = None,
        agent_service: str | None = None,
        client_factory: Any = None,
    ) -> None:
        self.static_gateways = [u.rstrip("/") for u in gateways]
        self.static_agents = [u.rstrip("/") for u in agents]
        self.gateway_service = gateway_service
        self.agent_service = agent_service
        self.client_factory = client_factory
        self._found: dict[str, list[str]] = {"gateway": [], "agent": []}
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def gateways(self) -> list[str]:
        return _unique(self.static_gateways + self._found["gateway"])

    @property
    def agents(self) -> list[str]:
        return _unique(self.static_agents + self._found["agent"])

    @property
    def has_agents(self) -> bool:
        return bool(self.static_agents or self.agent_service)

    def describe(self) -> str:
        g = ", ".join(
            self.static_gateways + ([self.gateway_service] if self.gateway_service else [])
        )
        a = ", ".join(self.static_agents + ([self.agent_service] if self.agent_service else []))
        return f"gateways {g or '-'}; agents {a or 'off (engine and gateway signals only)'}"

    def start(self) -> None:
        """Watch the Services' EndpointSlices (ready endpoints only)."""
        for kind, ref in (("gateway", self.gateway_service), ("agent", self.agent_service)):
            if ref is None:
                continue
            from unbroken.k8s.discovery import SliceWatcher, default_client, parse_service_ref

            def on_change(eps: dict[str, Any], kind: str = kind) -> None:
                urls = sorted(e.url for e in eps.values() if e.ready and not e.terminating)
                if urls != self._found[kind]:
                    log.info("%s endpoints: %s", kind, ", ".join(urls) or "none")
                self._found[kind] = urls

            w = SliceWatcher(
                parse_service_ref(ref),
                on_change,
                client_factory=self.client_factory or default_client,
            )
            self._tasks.append(asyncio.create_task(w.run(), name=f"watch-{kind}s"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _unique(urls: list[str]) -> list[str]:
    return list(dict.fromkeys(urls))
