"""Locust load for an unbroken gateway (or any OpenAI-compatible server), as in the seed:

    locust -f benchmarks/locustfile.py --host http://127.0.0.1:8080 --users 200 --spawn-rate 10

Each user streams chat completions and reports, besides the request itself, two custom
entries in Locust's statistics: `TTFT` (time to the first token event) and `ITL` (every gap
between token events), both in milliseconds, so percentiles show up in the web UI and CSVs.
A stream that ends without its finish and [DONE] is reported as a failure.

Environment: UNBROKEN_MODEL (default unbroken-sim), UNBROKEN_MAX_TOKENS (default 64),
UNBROKEN_PRIORITY (x-unbroken-priority header, default standard).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

MODEL = os.environ.get("UNBROKEN_MODEL", "unbroken-sim")
MAX_TOKENS = int(os.environ.get("UNBROKEN_MAX_TOKENS", "64"))
PRIORITY = os.environ.get("UNBROKEN_PRIORITY", "standard")
WORDS = "the quick brown fox jumps over a lazy dog while streaming tokens never stop".split()


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
        fire = self.environment.events.request.fire
        t0 = time.perf_counter()
        first = last = None
        finish = done = False
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            stream=True,
            headers={"x-unbroken-priority": PRIORITY},
            name="/v1/chat/completions (stream)",
            catch_response=True,
        ) as resp:
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
                        if first is None:
                            first = now
                            fire(
                                request_type="SSE",
                                name="TTFT",
                                response_time=(now - t0) * 1e3,
                                response_length=0,
                                exception=None,
                                context={},
                            )
                        else:
                            fire(
                                request_type="SSE",
                                name="ITL",
                                response_time=(now - last) * 1e3,
                                response_length=0,
                                exception=None,
                                context={},
                            )
                        last = now
                    if ch.get("finish_reason"):
                        finish = True
            if not (finish and done):
                resp.failure("stream ended without its finish")
            else:
                resp.success()
