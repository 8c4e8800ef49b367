"""Locust load for an unbroken gateway (or any OpenAI-compatible server), as in the seed:

    locust -f benchmarks/locustfile.py --host http://127.0.0.1:8080 --users 200 --spawn-rate 10

`--host` may be the server's root or the SDK-style base URL ending in `/v1`.

What each row of Locust's statistics means here:
- `/v1/chat/completions (stream)`: one entry per request, its response time is the whole
  stream (request sent to [DONE]), its size the tokens received; a stream that ends without
  its finish and [DONE] is a failure. Its req/s is the real request rate.
- `TTFT` (type SSE): one entry per request that got a token: time to the first token.
- `Aggregated` therefore counts two entries per request: read the rows, not the total.

Inter-token latency is not a Locust entry (one entry per gap would swamp every total): the
gaps are collected and, when the run stops, printed and written to `<--csv prefix>_itl.csv`:
ITL over every gap (what `unbroken bench` calls ITL) and the per-request mean gap (TPOT, what
guidellm and aiperf call ITL), p50/p90/p99/p99.9 in milliseconds.

Environment: UNBROKEN_MODEL (default unbroken-sim), UNBROKEN_MAX_TOKENS (default 64),
UNBROKEN_PRIORITY (x-unbroken-priority header, default standard).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Any

from locust import HttpUser, between, events, task

MODEL = os.environ.get("UNBROKEN_MODEL", "unbroken-sim")
MAX_TOKENS = int(os.environ.get("UNBROKEN_MAX_TOKENS", "64"))
PRIORITY = os.environ.get("UNBROKEN_PRIORITY", "standard")
WORDS = "the quick brown fox jumps over a lazy dog while streaming tokens never stop".split()
PCTS = (50, 90, 99, 99.9)

GAPS_MS: list[float] = []  # every inter-token gap, this process
TPOT_MS: list[float] = []  # each request's mean gap after its first token


def _path(host: str) -> str:
    return "/chat/completions" if host.rstrip("/").endswith("/v1") else "/v1/chat/completions"


class StreamingUser(HttpUser):
    wait_time = between(0.1, 0.5)

    @task
    def chat_stream(self) -> None:
        prompt = " ".join(random.choices(WORDS, k=random.randint(8, 32)))
        body = {
            "model": MODEL,
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        }
        t0 = time.perf_counter()
        first = last = None
        gaps: list[float] = []
        tokens = 0
        finish = done = False
        with self.client.post(
            _path(self.host or ""),
            json=body,
            stream=True,
            headers={"x-unbroken-priority": PRIORITY},
            name="/v1/chat/completions (stream)",
            catch_response=True,
        ) as resp:
            try:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}")
                    return
                for line in resp.iter_lines():
                    if not line or not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        resp.failure(f"error event: {obj['error'].get('message')}")
                        return
                    for ch in obj.get("choices", []):
                        if (ch.get("delta") or {}).get("content"):
                            now = time.perf_counter()
                            tokens += 1
                            if first is None:
                                first = now
                                self.environment.events.request.fire(
                                    request_type="SSE",
                                    name="TTFT",
                                    response_time=(now - t0) * 1e3,
                                    response_length=0,
                                    exception=None,
                                    context={},
                                )
                            else:
                                gaps.append((now - last) * 1e3)  # type: ignore[operator]
                            last = now
                        if ch.get("finish_reason"):
                            finish = True
                if not (finish and done):
                    resp.failure("stream ended without its finish")
                else:
                    resp.success()
            except Exception as e:  # a broken connection mid-stream is a failed request
                resp.failure(f"{type(e).__name__}: {e}")
            finally:
                # The request's entry: the whole stream, not the time to its headers.
                resp.request_meta["response_time"] = (time.perf_counter() - t0) * 1e3
                resp.request_meta["response_length"] = tokens
                GAPS_MS.extend(gaps)
                if gaps:
                    TPOT_MS.append(sum(gaps) / len(gaps))


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(p * len(s) / 100) - 1))]


def itl_rows() -> list[tuple[str, int, list[float]]]:
    return [
        (name, len(xs), [_pct(xs, p) for p in PCTS])
        for name, xs in (("ITL (every gap)", GAPS_MS), ("TPOT (mean gap per request)", TPOT_MS))
        if xs
    ]


@events.test_stop.add_listener
def _report_itl(environment: Any, **_kw: Any) -> None:
    rows = itl_rows()
    if not rows:
        return
    head = f"{'name':<30}{'count':>9}" + "".join(f"{'p' + format(p, 'g'):>10}" for p in PCTS)
    print("\n" + head)
    for name, n, vals in rows:
        print(f"{name:<30}{n:>9}" + "".join(f"{v:>10.1f}" for v in vals))
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        with open(f"{prefix}_itl.csv", "w") as f:
            f.write("Name,Count," + ",".join(f"p{p:g} (ms)" for p in PCTS) + "\n")
            for name, n, vals in rows:
                f.write(f"{name},{n}," + ",".join(f"{v:.3f}" for v in vals) + "\n")
