"""Which processes map a CUDA library, and who they are: pid → container id (cgroup) →
pod and namespace (kubelet), and → endpoint when run beside `unbroken up`."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import ssl
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from unbroken.agent.functions import LIBRARY_RE

__all__ = ["ProcInfo", "cuda_libraries", "process_info", "supervisor_endpoints"]

log = logging.getLogger("unbroken.agent")
_CONTAINER_RE = re.compile(r"([0-9a-f]{64})")


def cuda_libraries() -> dict[int, set[str]]:
    """pid → paths (reachable from here, through /proc/PID/root) of CUDA libraries it maps."""
    out: dict[int, set[str]] = {}
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if b"cuda" not in data:
            continue
        libs = set()
        for line in data.splitlines():
            m = LIBRARY_RE.search(line)
            if m:
                path = line[line.index(b"/") :].decode(errors="replace")
                libs.add(f"/proc/{d}/root{path}")
        if libs:
            out[int(d)] = libs
    return out


@dataclass
class ProcInfo:
    pid: int
    comm: str = ""
    container: str = ""  # container name from the kubelet, else the container id (short)
    pod: str = ""
    namespace: str = ""
    endpoint: str = ""
    cid: str = ""  # full container id from /proc/PID/cgroup ("" outside a container)


def _container_id(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    m = _CONTAINER_RE.search(text)
    return m.group(1) if m else ""


class PodResolver:
    """Container id → (pod, namespace, container name) from the kubelet's pod list, when the
    agent runs on a Kubernetes node (KUBELET_URL, default https://$NODE_IP:10250, with the
    service account token). Off the cluster it resolves nothing. The pod list is fetched only
    while a container it does not know is seen, and at most every `min_interval` seconds:
    a container started before the kubelet listed it is resolved at a later fetch. `version`
    changes whenever the mapping does, so callers can relabel what they cached."""

    def __init__(self, min_interval: float = 10.0) -> None:
        node = os.environ.get("NODE_IP") or os.environ.get("KUBERNETES_NODE_IP")
        self.url = os.environ.get("KUBELET_URL") or (f"https://{node}:10250" if node else None)
        self.cache: dict[str, tuple[str, str, str]] = {}
        self.min_interval = min_interval
        self._fetched = -math.inf
        self.version = 0

    def wants(self, pids: Iterable[int]) -> bool:
        """Would a fetch now resolve a container of these processes that is not cached?"""
        return self.wants_cids(_container_id(pid) for pid in pids)

    def wants_cids(self, cids: Iterable[str]) -> bool:
        """Would a fetch now (rate-limited) resolve one of these container ids?"""
        if not self.url or time.monotonic() - self._fetched < self.min_interval:
            return False
        return any(cid and cid not in self.cache for cid in cids)

    def refresh(self) -> None:
        if not self.url:
            return
        self._fetched = time.monotonic()
        token_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
        headers = {}
        if token_file.exists():
            headers["Authorization"] = f"Bearer {token_file.read_text().strip()}"
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # kubelet's self-signed cert
        try:
            req = urllib.request.Request(self.url + "/pods", headers=headers)
            with urllib.request.urlopen(req, timeout=3, context=ctx) as r:
                pods = json.load(r)
        except (OSError, ValueError) as e:
            log.debug("kubelet pod list unavailable: %s", e)
            return
        cache: dict[str, tuple[str, str, str]] = {}
        for item in pods.get("items", []):
            meta = item.get("metadata", {})
            for cs in item.get("status", {}).get("containerStatuses", []) or []:
                cid = (cs.get("containerID") or "").split("://")[-1]
                if cid:
                    cache[cid] = (
                        meta.get("name", ""),
                        meta.get("namespace", ""),
                        cs.get("name", ""),
                    )
        if cache != self.cache:  # replaced, not merged: deleted pods do not stay forever
            self.cache = cache
            self.version += 1

    def lookup(self, cid: str) -> tuple[str, str, str] | None:
        return self.cache.get(cid)


def process_info(pid: int, pods: PodResolver, endpoints: dict[int, str]) -> ProcInfo:
    info = ProcInfo(pid=pid, endpoint=endpoints.get(pid, ""))
    try:
        info.comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        pass
    cid = _container_id(pid)
    if cid:
        info.cid = cid
        info.container = cid[:12]
        hit = pods.lookup(cid)
        if hit:
            info.pod, info.namespace, info.container = hit
    return info


async def supervisor_endpoints() -> dict[int, str] | None:
    """pid → name of the engines and gateway of a local `unbroken up` ({} when none runs);
    None when one runs but did not answer in time (a busy machine): the caller keeps the
    names it has rather than unlabelling every process until the next answer."""
    import aiohttp

    from unbroken.config.paths import RunInfo, state_dir

    info = RunInfo.read(state_dir())
    if info is None:
        return {}
    try:
        conn = aiohttp.UnixConnector(path=info.control_socket)
        async with (
            aiohttp.ClientSession(connector=conn) as s,
            s.get("http://supervisor/status", timeout=aiohttp.ClientTimeout(total=2)) as r,
        ):
            st = await r.json()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    out = {r["pid"]: r["name"] for r in st.get("replicas", []) if r.get("pid")}
    if st.get("gateway_pid"):
        out[st["gateway_pid"]] = "gateway"
    return out
