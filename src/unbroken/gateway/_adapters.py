"""LoRA adapter affinity: a request for an adapter prefers replicas that have it loaded.

vLLM runs at most `--max-loras` distinct adapters in a batch; a request for another adapter
waits until a slot frees and the adapter is loaded into it. So an adapter request sent where
that adapter already runs starts sooner than one sent where it must wait for a slot.

What each endpoint has, freshest first:

- **The engine's own view** (`vllm:lora_requests_info`, scraped by the prober into
  `Endpoint.lora`): the adapters running and waiting at its latest step, `max_lora`, and
  those that ran within `recent_s` before that step (every label set stays exposed with the
  time it was last set, so the page shows recent history). It holds for every gateway
  worker and replica alike.
- **This process's own routing** (`on_admit`): where it sent each adapter within `recent_s`;
  the only signal where engine metrics are not scraped.

An endpoint serves an adapter when the adapter is in its `/v1/models` (`Endpoint.adapters`:
cards with a `parent`, refreshed by the prober while LoRA is on, so adapters loaded at
runtime count).

`AdapterAffinity` wraps the configured policy (whatever `routing:` names), so the two
compose: for an adapter request it narrows each pool's candidates, then lets the configured
policy choose among them: first the **warm** candidates (the adapter running, waiting or
recent there), else the candidates with a **free slot** (fewer than `max_lora` adapters
running; unknown counts as free), else all of them. A narrowed set is used only while its
least-loaded member is within `balance_rel` x the least load of all candidates +
`balance_abs` (the prefix policy's bounded load), so an adapter's home never becomes a hot
spot: once it is that much busier, the adapter spreads to another replica (which loads it).
Requests for base models go to the configured policy untouched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from unbroken.gateway._policy import Candidate

if TYPE_CHECKING:
    from unbroken.gateway._policy import PickRequest, RoutingPolicy

__all__ = [
    "LORA_METRIC",
    "AdapterAffinity",
    "AdapterCandidate",
    "AdapterSettings",
    "LoraInfo",
    "parse_lora_info",
]

LORA_METRIC = "vllm:lora_requests_info"


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """An engine's `vllm:lora_requests_info` at one scrape."""

    max_lora: int | None  # None: not shown (no sample yet)
    running: frozenset[str]
    waiting: frozenset[str]
    recent: frozenset[str]  # running within `window_s` before the latest sample
    at: float  # the latest sample's value: the engine's wall-clock time of its last step

    def has(self, adapter: str) -> bool:
        return adapter in self.running or adapter in self.waiting or adapter in self.recent

    def free_slot(self) -> bool:
        return self.max_lora is None or len(self.running) < self.max_lora

    def as_dict(self) -> dict[str, Any]:
        """For the admin API, and the main process's state for its workers (`from_dict`)."""
        return {
            "max_lora": self.max_lora,
            "running": sorted(self.running),
            "waiting": sorted(self.waiting),
            "recent": sorted(self.recent),
            "at": self.at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraInfo:
        return cls(
            d.get("max_lora"),
            frozenset(d.get("running", ())),
            frozenset(d.get("waiting", ())),
            frozenset(d.get("recent", ())),
            float(d.get("at", 0.0)),
        )


def _labels(text: str, start: int) -> tuple[dict[str, str], int]:
    """Prometheus text-format labels from just after '{'; (labels, index after '}')."""
    out: dict[str, str] = {}
    i, n = start, len(text)
    while i < n:
        while i < n and text[i] in " ,":
            i += 1
        if i < n and text[i] == "}":
            return out, i + 1
        eq = text.index("=", i)
        key = text[i:eq].strip()
        i = eq + 1
        if text[i] != '"':
            raise ValueError("label value must be quoted")
        i += 1
        buf: list[str] = []
        while text[i] != '"':
            c = text[i]
            if c == "\\":
                i += 1
                c = {"n": "\n", "\\": "\\", '"': '"'}.get(text[i], "\\" + text[i])
            buf.append(c)
            i += 1
        out[key] = "".join(buf)
        i += 1
    raise ValueError("unterminated labels")


def _names(v: str) -> frozenset[str]:
    return frozenset(x.strip() for x in v.split(",") if x.strip())


def parse_lora_info(text: str, window_s: float = 30.0) -> LoraInfo | None:
    """The engine's LoRA state from a /metrics page: the sample with the latest time is the
    current one (vLLM keeps every label set it ever set); adapters running in samples up to
    `window_s` older count as recent. None when the page has no such metric (LoRA off)."""
    if LORA_METRIC not in text:
        return None
    samples: list[tuple[float, dict[str, str]]] = []
    prefix = LORA_METRIC + "{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            labels, end = _labels(line, len(prefix))
            value = float(line[end:].split()[0])
        except (ValueError, IndexError):
            continue
        samples.append((value, labels))
    if not samples:
        return LoraInfo(None, frozenset(), frozenset(), frozenset(), 0.0)
    at, latest = max(samples, key=lambda s: s[0])
    recent: set[str] = set()
    for t, labels in samples:
        if t >= at - window_s:
            recent |= _names(labels.get("running_lora_adapters", ""))
    try:
        max_lora: int | None = int(latest.get("max_lora", ""))
    except ValueError:
        max_lora = None
    return LoraInfo(
        max_lora,
        _names(latest.get("running_lora_adapters", "")),
        _names(latest.get("waiting_lora_adapters", "")),
        frozenset(recent),
        at,
    )


@dataclass(frozen=True)
class AdapterSettings:
    """The adapter-affinity knobs (docs/gateway.md, "Routing")."""

    recent_s: float = 30.0  # an adapter sent (or run) this recently counts as loaded there
    balance_abs: float = 8.0  # no preference above min load x (1 + balance_rel) + balance_abs
    balance_rel: float = 0.25


class AdapterCandidate(Candidate, Protocol):
    """An endpoint as adapter affinity reads it: also the engine's own view of its adapters
    (`_pool.Endpoint` is the one kind; a protocol, so that this module need not import the
    pool, which imports it)."""

    lora: LoraInfo | None


# Whatever endpoint type the pool routes (`_pool.Endpoint`), read as an AdapterCandidate.
Endpoint = TypeVar("Endpoint", bound=AdapterCandidate)


class AdapterAffinity(Generic[Endpoint]):
    """The configured policy, with adapter requests narrowed to warm candidates (module
    doc). Every other attribute is the wrapped policy's (`wants_hint`, its index, ...)."""

    def __init__(
        self, inner: RoutingPolicy[Endpoint], settings: AdapterSettings | None = None
    ) -> None:
        self.inner = inner
        self.s = settings or AdapterSettings()
        self.sent: dict[str, dict[str, float]] = {}  # adapter -> endpoint -> last admit
        if hasattr(inner, "pick_route"):
            self.pick_route = self._pick_route

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- the routing interface --------------------------------------------------------------
    def pick(self, candidates: list[Endpoint], request: PickRequest) -> Endpoint | None:
        return self.inner.pick(self.narrow(candidates, request.model), request)

    def _pick_route(
        self, pools: list[list[Endpoint]], request: PickRequest, *, fresh: bool = True
    ) -> Endpoint | None:
        model = request.model
        narrowed = [self.narrow(c, model) for c in pools]
        return self.inner.pick_route(narrowed, request, fresh=fresh)  # type: ignore[attr-defined,no-any-return]

    def on_admit(self, ep: Endpoint, request: PickRequest) -> None:
        if request.model in ep.adapters:
            self.sent.setdefault(request.model, {})[ep.name] = time.monotonic()
        if (inner := getattr(self.inner, "on_admit", None)) is not None:
            inner(ep, request)

    def forget(self, name: str) -> None:
        for eps in self.sent.values():
            eps.pop(name, None)
        if (inner := getattr(self.inner, "forget", None)) is not None:
            inner(name)

    # -- the narrowing ------------------------------------------------------------------------
    def warm(self, ep: Endpoint, adapter: str, now: float) -> bool:
        """Is `adapter` loaded on `ep`, as far as the engine or this process knows?"""
        if ep.lora is not None and ep.lora.has(adapter):
            return True
        t = self.sent.get(adapter, {}).get(ep.name)
        return t is not None and now - t <= self.s.recent_s

    def narrow(self, candidates: list[Endpoint], model: str) -> list[Endpoint]:
        if len(candidates) < 2 or not any(model in e.adapters for e in candidates):
            return candidates
        now = time.monotonic()
        lo = min(e.load for e in candidates)
        limit = lo * (1.0 + self.s.balance_rel) + self.s.balance_abs
        warm = [e for e in candidates if e.load <= limit and self.warm(e, model, now)]
        if warm:
            return warm
        free = [e for e in candidates if e.load <= limit and (e.lora is None or e.lora.free_slot())]
        return free or candidates

    def as_dict(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            a: sorted(n for n, t in eps.items() if now - t <= self.s.recent_s)
            for a, eps in self.sent.items()
        }
