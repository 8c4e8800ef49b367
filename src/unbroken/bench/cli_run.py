"""`unbroken bench` from its options: checks them, builds the load (`LoadConfig`, the
workload), finds the running pipeline (its gateway, control socket and admin sampler) or the
user's own scenario command, and runs `runner.run_bench` on uvloop. Kept out of the CLI so
that the command only parses; a bad option is a `BenchOptionError` whose text is the line
the command prints (exit 2)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from unbroken.config._base import Priority

if TYPE_CHECKING:
    from rich.console import Console

    from unbroken.bench.control import PipelineControl, Sampler
    from unbroken.bench.workloads import WorkloadSpec

__all__ = ["BenchOptionError", "BenchOptions", "run"]

PRIORITIES: tuple[str, ...] = get_args(Priority)


class BenchOptionError(Exception):
    """An option the run cannot start with (not a ValueError: workloads raise those)."""


@dataclass
class BenchOptions:
    """The command's options, as given (defaults are the command's)."""

    url: str | None = None
    scenario: str = "steady"
    users: int | None = None  # None: 50 (closed loop)
    spawn_rate: float | None = None  # None: 10
    rate: float | str | None = None  # open loop: requests per second, or "R1,R2,..." (a sweep)
    arrival: str = "poisson"
    max_concurrency: int | None = None
    duration: float = 60.0
    at: float = 20.0
    pool: str = "primary"
    deadline: float = 5.0
    max_tokens: str = "32:128"
    prompt_words: str = "16:64"
    chat_fraction: float = 0.5
    priority_mix: str = "standard=1"
    slow_fraction: float = 0.0
    verify: bool = True
    reference_url: str | None = None
    scenario_command: str | None = None
    model: str = "unbroken-sim"
    max_error_rate: float = 0.01
    out: Path = Path("bench-out")
    workload: str = "random"
    # None: the workload's own default (SharedPrefix: inference-perf's; MultiTurn: chat's shape)
    num_groups: int | None = None
    num_prompts_per_group: int | None = None
    system_prompt_len: int | None = None
    question_len: int | None = None
    output_len: int | None = None
    num_turns: int | None = None
    seed: int = 1
    engine_metrics: list[str] | None = None
    session_header: str = "x-session-id"


def parse_range(text: str, what: str) -> tuple[int, int]:
    """`N` or `LO:HI` as (lo, hi), 1 <= lo <= hi."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise BenchOptionError(f"{what}: expected N or LO:HI, got {text!r}") from None
    if a < 1 or b < a:
        raise BenchOptionError(f"{what}: need 1 <= LO <= HI, got {text!r}")
    return a, b


def _workload(o: BenchOptions) -> WorkloadSpec | None:
    from unbroken.bench.workloads import MultiTurn, SharedPrefix

    # inference-perf's spelling (shared_prefix) is the same workload.
    workload = o.workload.replace("_", "-")
    if workload not in ("random", "shared-prefix", "multi-turn"):
        raise BenchOptionError("--workload must be random, shared-prefix or multi-turn")
    lengths = {
        "system_prompt_len": o.system_prompt_len,
        "question_len": o.question_len,
        "output_len": o.output_len,
    }
    if workload == "random":
        # A workload's option with the random prompts would be ignored: say so.
        given = lengths | {
            "num_groups": o.num_groups,
            "num_prompts_per_group": o.num_prompts_per_group,
            "num_turns": o.num_turns,
        }
        named = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        if named:
            raise BenchOptionError(
                f"{', '.join(named)}: options of --workload shared-prefix or multi-turn; the "
                "random workload takes --prompt-words, --max-tokens and --chat-fraction"
            )
    try:
        if workload == "shared-prefix":
            if o.num_turns is not None:
                raise ValueError("--num-turns is multi-turn's option")
            given = lengths | {
                "num_groups": o.num_groups,
                "num_prompts_per_group": o.num_prompts_per_group,
            }
            return SharedPrefix(**{k: v for k, v in given.items() if v is not None})
        if workload == "multi-turn":
            if o.num_groups is not None or o.num_prompts_per_group is not None:
                raise ValueError("--num-groups and --num-prompts-per-group are shared-prefix's")
            given = lengths | {"num_turns": o.num_turns}
            return MultiTurn(**{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise BenchOptionError(f"--workload {workload}: {e}") from None
    return None


def _priority_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        name = k.strip()
        try:
            share = float(v)
        except ValueError:
            raise BenchOptionError(f"--priority-mix: bad entry {part!r}") from None
        if name not in PRIORITIES:
            raise BenchOptionError(
                f"--priority-mix: unknown priority {name!r} (one of {', '.join(PRIORITIES)})"
            )
        if not share >= 0:
            raise BenchOptionError(f"--priority-mix: {part!r}: a share is a number >= 0")
        mix[name] = share
    if not sum(mix.values()) > 0:
        raise BenchOptionError("--priority-mix: the shares add up to 0")
    return mix


DEFAULT_USERS, DEFAULT_SPAWN_RATE = 50, 10.0


def _rates(rate: float | str) -> tuple[float, ...]:
    """`--rate`: one rate or a sweep ("2,4,8"), each a number of requests per second > 0."""
    parts = [rate] if isinstance(rate, int | float) else str(rate).split(",")
    out: list[float] = []
    for part in parts:
        try:
            r = float(part)
        except ValueError:
            raise BenchOptionError(
                f"--rate: {str(part).strip()!r} is not a number (R, or R1,R2,... for a sweep)"
            ) from None
        if not (r > 0 and r != float("inf")):
            raise BenchOptionError(f"--rate must be requests per second, more than 0: got {r:g}")
        out.append(r)
    return tuple(out)


def _check_loop(o: BenchOptions) -> tuple[int, float, tuple[float, ...]]:
    """The closed loop's (users, spawn rate, ()), or the open loop's (0, 0, its rates)
    checked: each loop's options refused with the other (they would be ignored)."""
    if o.rate is None:
        if o.max_concurrency is not None:
            raise BenchOptionError(
                "--max-concurrency caps an open loop (--rate); a closed loop's cap is --users"
            )
        if o.arrival != "poisson":
            raise BenchOptionError("--arrival is --rate's (the open loop's) option")
        users = DEFAULT_USERS if o.users is None else o.users
        spawn = DEFAULT_SPAWN_RATE if o.spawn_rate is None else o.spawn_rate
        if users < 1:
            raise BenchOptionError("--users must be at least 1")
        if not spawn >= 0:
            raise BenchOptionError("--spawn-rate must be >= 0 (0 starts every user at once)")
        return users, spawn, ()
    named = [n for n, v in (("--users", o.users), ("--spawn-rate", o.spawn_rate)) if v is not None]
    if named:
        raise BenchOptionError(
            f"{' and '.join(named)}: the closed loop's; with --rate the load is an open loop "
            "(cap its open requests with --max-concurrency)"
        )
    rates = _rates(o.rate)
    if len(rates) > 1 and o.scenario != "steady":
        raise BenchOptionError(
            f"a rate sweep (--rate {o.rate}) runs no scenario: its windows are the rates"
        )
    if o.arrival not in ("poisson", "constant"):
        raise BenchOptionError(f"--arrival must be poisson or constant, got {o.arrival!r}")
    if o.max_concurrency is not None and o.max_concurrency < 1:
        raise BenchOptionError("--max-concurrency must be at least 1")
    return 0, 0.0, rates


def _check_numbers(o: BenchOptions) -> None:
    """Ranges the load generator would otherwise take silently (0 users ran nothing and
    failed; --duration 0 or less still sent a spawn interval's worth of requests)."""
    if not o.duration > 0:
        raise BenchOptionError("--duration must be more than 0 seconds")
    for name, v in (("--chat-fraction", o.chat_fraction), ("--slow-fraction", o.slow_fraction)):
        if not 0 <= v <= 1:
            raise BenchOptionError(f"{name} must be between 0 and 1, got {v:g}")
    if o.scenario != "steady":
        # A scenario at or after the load's end ran without traffic and verified nothing.
        if not o.at >= 0:
            raise BenchOptionError(f"--at must be >= 0 seconds, got {o.at:g}")
        if o.at >= o.duration:
            raise BenchOptionError(
                f"--at {o.at:g} is not before the load's end (--duration {o.duration:g}): the "
                f"{o.scenario} would run without traffic; give a --duration longer than --at "
                "(the load goes on past it until the scenario ends, and 5 s more)"
            )


DEFAULT_URL = "http://127.0.0.1:8080"


def _target(o: BenchOptions) -> tuple[str, str, PipelineControl | None, Sampler | None]:
    """The URL to load, where it came from (a line to print: --url, the running pipeline, or
    the default), and how to act and sample: the running `unbroken up`'s control socket and
    gateway admin API, else the user's scenario command."""
    from unbroken.bench.control import PipelineControl, Sampler
    from unbroken.config.paths import RunInfo, read_admin_token, state_dir

    info = RunInfo.read(state_dir())
    if o.url is not None:
        url, source = o.url, "from --url"
        if info is not None and o.scenario != "steady" and not _same_port(o.url, info.gateway_url):
            # The scenario acts through this state dir's supervisor, whatever --url loads.
            source += (
                f"; NOTE the {o.scenario} acts on the pipeline running in {state_dir()} "
                f"(its gateway is {info.gateway_url}), which this URL may not reach"
            )
    elif info is not None:
        url, source = info.gateway_url, f"the gateway of the pipeline running in {state_dir()}"
    else:
        url, source = (
            DEFAULT_URL,
            f"the default: no --url, and no pipeline running in {state_dir()} "
            "(UNBROKEN_STATE_DIR); whatever listens there is what gets measured",
        )
    control = sampler = None
    if info is not None:
        control = PipelineControl(info.control_socket)
        token = read_admin_token(state_dir(), info)
        sampler = Sampler(info.admin_url, token) if token else None
    elif o.scenario != "steady" and o.scenario_command:
        from unbroken.bench.usercontrol import CommandControl

        control = CommandControl(o.scenario_command)  # type: ignore[assignment]
    elif o.scenario != "steady":
        raise BenchOptionError(
            f"scenario {o.scenario} needs a running `unbroken up`, or --scenario-command with "
            "what to do to your own engines"
        )
    return url, source, control, sampler


def _same_port(a: str, b: str) -> bool:
    from urllib.parse import urlsplit

    try:
        return urlsplit(a).port == urlsplit(b).port
    except ValueError:
        return False


def _status(control: PipelineControl) -> dict[str, Any] | str:
    """The running pipeline's status (one read for every check below), or why not."""
    import asyncio

    from unbroken.clients import SupervisorError

    try:
        return asyncio.run(control.status())
    except SupervisorError as e:
        return str(e)


def _pipeline_engines(url: str, st: dict[str, Any] | str) -> list[str] | None:
    """The engines of the running `unbroken up` whose gateway `url` loads (their /metrics
    give the hit rate and the load spread): None for another URL or an unreadable status."""
    if isinstance(st, str) or not _same_port(url, str(st.get("gateway_url") or "")):
        return None
    return [str(r["url"]) for r in st.get("replicas", []) if r.get("url")] or None


def _check_pool(o: BenchOptions, st: dict[str, Any] | str) -> None:
    """A scenario's --pool must be one of the pipeline's: found out before the load, not as
    a rollout refused (or a kill with no replica) halfway through it."""
    if isinstance(st, str):
        raise BenchOptionError(f"cannot read the pipeline's pools: {st}")
    pools = sorted(st.get("pools") or {r.get("pool") for r in st.get("replicas", [])})
    if o.pool not in pools:
        raise BenchOptionError(
            f"--pool {o.pool!r}: the pipeline has no such pool (its pools: "
            f"{', '.join(pools) or 'none'})"
        )


def run(o: BenchOptions, console: Console) -> int:
    """Check the options, run the load and its scenario, write the report; 0 when the run
    passed, 1 when it failed (`run_bench` prints why)."""
    from unbroken.bench.load import LoadConfig, base_url
    from unbroken.bench.runner import run_bench

    if o.scenario not in ("steady", "rollout", "chaos"):
        raise BenchOptionError("--scenario must be steady, rollout or chaos")
    users, spawn_rate, rates = _check_loop(o)
    _check_numbers(o)
    spec = _workload(o)
    for u in o.engine_metrics or ():
        if not u.startswith(("http://", "https://")):
            raise BenchOptionError(f"--engine-metrics {u!r}: expected http(s)://HOST:PORT")
    # The engine's base URL, as --url takes it: its /metrics page or its /v1 base is read
    # as the engine's (/metrics was appended again, and every engine read 404).
    o.engine_metrics = [
        base_url(u.strip().rstrip("/").removesuffix("/metrics")) for u in o.engine_metrics or ()
    ] or None
    mix = _priority_mix(o.priority_mix)
    if o.url is not None and not o.url.startswith(("http://", "https://")):
        raise BenchOptionError(
            f"--url {o.url!r}: expected http(s)://HOST:PORT (a trailing /v1 is fine)"
        )
    url, source, control, sampler = _target(o)
    from rich.markup import escape

    from unbroken.bench.control import PipelineControl

    style = "yellow" if url == DEFAULT_URL and o.url is None else "bold"
    console.print(f"target: [{style}]{escape(url)} ({escape(source)})[/]", highlight=False)

    needs_status = o.scenario != "steady" or o.engine_metrics is None
    st = _status(control) if needs_status and isinstance(control, PipelineControl) else None
    if o.scenario != "steady" and st is not None:
        _check_pool(o, st)
    discover = False
    if o.engine_metrics is None and st is not None:
        o.engine_metrics = _pipeline_engines(url, st)
        discover = bool(o.engine_metrics)
        if o.engine_metrics:
            console.print(
                f"engines: {', '.join(o.engine_metrics)} (the running pipeline's; "
                "--engine-metrics to name others)",
                highlight=False,
            )
    if o.reference_url is not None and not o.reference_url.startswith(("http://", "https://")):
        raise BenchOptionError(f"--reference-url {o.reference_url!r}: expected http(s)://HOST:PORT")
    cfg = LoadConfig(
        url=url.rstrip("/"),
        model=o.model,
        users=users,
        spawn_rate=spawn_rate,
        rate=rates[0] if rates else None,
        sweep=rates if len(rates) > 1 else (),
        arrival=o.arrival,
        max_concurrency=o.max_concurrency,
        duration=o.duration,
        prompt_words=parse_range(o.prompt_words, "--prompt-words"),
        max_tokens=parse_range(o.max_tokens, "--max-tokens"),
        chat_fraction=o.chat_fraction,
        priorities=mix,
        slow_fraction=o.slow_fraction,
        verify=o.verify,
        reference_url=o.reference_url,
        seed=o.seed,
        workload=spec,
        session_header=o.session_header,
    )
    if not 0 <= o.max_error_rate <= 1:
        raise BenchOptionError("--max-error-rate must be between 0 and 1")
    import uvloop  # the load generator's CPU per token: 0.64x asyncio's (loadgen_cpu.py)

    result = uvloop.run(
        run_bench(
            cfg,
            scenario=o.scenario,
            at=o.at,
            pool=o.pool,
            deadline_s=o.deadline,
            out=o.out,
            control=control,
            sampler=sampler,
            console=console,
            max_error_rate=o.max_error_rate,
            command=" ".join(["unbroken", *sys.argv[1:]]),
            engine_metrics=o.engine_metrics,
            discover_engines=discover,
        )
    )
    return 1 if result["failures"] else 0
