"""`unbroken bench` (options to `bench.cli_run.run`) and `unbroken demo` (options to
`bench.demo.run_demo`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import app, console, fail, setup_logging


@app.command()
def bench(
    url: Annotated[
        str | None,
        typer.Option(help="OpenAI-compatible base URL [the running pipeline's gateway]."),
    ] = None,
    scenario: Annotated[str, typer.Option(help="steady, rollout or chaos.")] = "steady",
    users: Annotated[
        int | None,
        typer.Option(
            help="Concurrent streaming users, each sending its next request when the last "
            "ends (closed loop) [default: 50]."
        ),
    ] = None,
    spawn_rate: Annotated[
        float | None,
        typer.Option(help="Users started per second (0: all at once) [default: 10]."),
    ] = None,
    rate: Annotated[
        str | None,
        typer.Option(
            help="Open loop instead of users: requests per second, sent whether or not "
            "earlier ones have ended (vllm bench serve's --request-rate); R1,R2,... sweeps "
            "them in turn, --duration split evenly, a row each."
        ),
    ] = None,
    arrival: Annotated[
        str,
        typer.Option(help="--rate's arrivals: poisson (random) or constant (evenly spaced)."),
    ] = "poisson",
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            help="With --rate: at most this many requests open at once; arrivals past it "
            "wait in the client (the wait is reported)."
        ),
    ] = None,
    duration: Annotated[
        float,
        typer.Option(help="Seconds of load (more while a scenario's window is not over)."),
    ] = 60.0,
    at: Annotated[
        float, typer.Option(help="When the scenario acts (s); before --duration.")
    ] = 20.0,
    pool: Annotated[
        str, typer.Option(help="Pool the scenario acts on (checked before the load).")
    ] = "primary",
    deadline: Annotated[float, typer.Option(help="Rollout drain deadline (s).")] = 5.0,
    max_tokens: Annotated[str, typer.Option(help="Output tokens, N or LO:HI.")] = "32:128",
    prompt_words: Annotated[str, typer.Option(help="Prompt words, N or LO:HI.")] = "16:64",
    chat_fraction: Annotated[float, typer.Option(help="Share of chat requests.")] = 0.5,
    priority_mix: Annotated[
        str, typer.Option(help="e.g. critical=0.1,standard=0.8,sheddable=0.1")
    ] = "standard=1",
    slow_fraction: Annotated[float, typer.Option(help="Share of slow-reading users.")] = 0.0,
    verify: Annotated[
        bool,
        typer.Option(
            help="Check every text: against the simulator's output, or --reference-url's."
        ),
    ] = True,
    reference_url: Annotated[
        str | None,
        typer.Option(
            help="An engine to verify against (the same greedy request, undisturbed); "
            "without it a target that is not the simulator is not verified."
        ),
    ] = None,
    scenario_command: Annotated[
        str | None,
        typer.Option(
            help="Without `unbroken up`: the shell command that is the rollout or the chaos "
            "on your own engines (e.g. 'kill -TERM 4242'), run at --at."
        ),
    ] = None,
    model: Annotated[str, typer.Option(help="Model name to request.")] = "unbroken-sim",
    max_error_rate: Annotated[
        float, typer.Option(help="Exit 1 when more than this share of requests end in an error.")
    ] = 0.01,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("bench-out"),
    workload: Annotated[
        str,
        typer.Option(
            help="random (--prompt-words, --chat-fraction), shared-prefix (inference-perf's "
            "shared_prefix; that spelling too) or multi-turn (conversations carrying their "
            "history)."
        ),
    ] = "random",
    num_groups: Annotated[
        int | None, typer.Option(help="shared-prefix: system prompts [default: 10].")
    ] = None,
    num_prompts_per_group: Annotated[
        int | None, typer.Option(help="shared-prefix: questions per system prompt [default: 10].")
    ] = None,
    system_prompt_len: Annotated[
        int | None,
        typer.Option(
            help="Words of the shared system prompt [default: shared-prefix 100, multi-turn "
            "200; multi-turn: 0 for none]."
        ),
    ] = None,
    question_len: Annotated[
        int | None,
        typer.Option(
            help="Words per question / user turn [default: shared-prefix 50, multi-turn 70]."
        ),
    ] = None,
    output_len: Annotated[
        int | None,
        typer.Option(
            help="Tokens per answer, workloads other than random [default: shared-prefix 50, "
            "multi-turn 215]."
        ),
    ] = None,
    num_turns: Annotated[
        int | None, typer.Option(help="multi-turn: turns per conversation [default: 6].")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the prompts.")] = 1,
    session_header: Annotated[
        str,
        typer.Option(
            help="multi-turn: the header naming each conversation (the body's `user` carries "
            "it too), e.g. x-user-id for a production-stack router started with "
            "--session-key x-user-id."
        ),
    ] = "x-session-id",
    engine_metrics: Annotated[
        list[str] | None,
        typer.Option(
            help="An engine's URL (repeat for each): its /metrics before and after the run "
            "give the prefix-cache hit rate and the load spread."
        ),
    ] = None,
) -> None:
    """Load-test an OpenAI endpoint; measure TTFT/ITL/TPOT, dropped and corrupted streams.

    --url takes the server root or the SDK-style base URL ending in /v1. Exit 0 when the run
    passed; 1 when no request succeeded, errors exceeded --max-error-rate, or any stream was
    dropped or corrupted, or the scenario failed (the reasons are printed); 2 for bad options.
    The first line says which URL is loaded, and why (--url, the running pipeline, or the
    default http://127.0.0.1:8080)."""

    from unbroken.bench.cli_run import BenchOptionError, BenchOptions, run

    opts = BenchOptions(
        url=url,
        scenario=scenario,
        users=users,
        spawn_rate=spawn_rate,
        rate=rate,
        arrival=arrival,
        max_concurrency=max_concurrency,
        duration=duration,
        at=at,
        pool=pool,
        deadline=deadline,
        max_tokens=max_tokens,
        prompt_words=prompt_words,
        chat_fraction=chat_fraction,
        priority_mix=priority_mix,
        slow_fraction=slow_fraction,
        verify=verify,
        reference_url=reference_url,
        scenario_command=scenario_command,
        model=model,
        max_error_rate=max_error_rate,
        out=out,
        workload=workload,
        num_groups=num_groups,
        num_prompts_per_group=num_prompts_per_group,
        system_prompt_len=system_prompt_len,
        question_len=question_len,
        output_len=output_len,
        num_turns=num_turns,
        seed=seed,
        engine_metrics=engine_metrics,
        session_header=session_header,
    )
    try:
        rc = run(opts, console())
    except BenchOptionError as e:
        fail(str(e))
    raise typer.Exit(rc)


@app.command()
def demo(
    users: Annotated[
        int,
        typer.Option(help="Streaming users (fewer: fewer requests per window, see above)."),
    ] = 200,
    steady: Annotated[
        float,
        typer.Option(help="Seconds of the steady window (the ratios' denominator; see above)."),
    ] = 40.0,
    contention: Annotated[
        float,
        typer.Option(help="Seconds of the bus-contention episode (slow_cuda; see above)."),
    ] = 15.0,
    contention_extra_ms: Annotated[
        float, typer.Option(help="Contention severity: ms added to each CUDA call.")
    ] = 30.0,
    recovery: Annotated[
        float,
        typer.Option(
            help="Seconds from the contention episode's end to the rollout (the controller's "
            "step-by-step undo, ~10 s with the default spec, ends before the rollout's window)."
        ),
    ] = 12.0,
    deadline: Annotated[float, typer.Option(help="Rollout drain deadline (s).")] = 5.0,
    settle: Annotated[
        float, typer.Option(help="Seconds from the rollout's end to the SIGKILL of a replica.")
    ] = 4.0,
    after_kill: Annotated[
        float,
        typer.Option(
            help="Seconds from the killed replica's replacement to the chaos window's end."
        ),
    ] = 4.0,
    ramp: Annotated[
        float, typer.Option(help="Seconds from the last user's start to the steady window.")
    ] = 3.0,
    weights_size: Annotated[str, typer.Option(help="Weights per pool (generated once).")] = "1GiB",
    max_ttft_ratio: Annotated[
        float, typer.Option(help="Pass when p99.9 TTFT (rollout, contention) <= this x steady.")
    ] = 1.5,
    stall_ms: Annotated[
        float, typer.Option(help="An inter-token gap above this is a stall spike.")
    ] = 150.0,
    storage_mbps: Annotated[
        float, typer.Option(help="Read cap on the weights' disk for both passes (MB/s).")
    ] = 300.0,
    baseline: Annotated[bool, typer.Option(help="Also run the standard deployment's pass.")] = True,
    realtime_loadgen: Annotated[
        bool,
        typer.Option(
            help="Run the load generator at SCHED_FIFO while it measures (root), so that its "
            "clock is not delayed by what it measures on the same cores."
        ),
    ] = True,
    agent: Annotated[
        bool,
        typer.Option(
            help="Start the eBPF node agent in unbroken's pass as its default pipeline does "
            "(as root with kernel BTF); --no-agent: without it (the controller then judges "
            "replicas by engine and gateway signals alone)."
        ),
    ] = True,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("demo-out"),
) -> None:
    """The main job: the seed's results table, a standard deployment vs unbroken, measured.

    The verdict compares p99.9 TTFT per window with the steady window's (--max-ttft-ratio).
    That is a 1-in-1,000 tail only in windows of well over 1,000 requests; in fewer (say ~140
    first tokens) the p99.9 is the window's one slowest request, so short windows (a small
    --steady, --contention or --users) make the ratio checks unreliable: one slow moment
    passes or fails them. The table says which request each p99.9 is."""
    from unbroken.bench.demo import DemoSettings, run_demo
    from unbroken.bench.passes import Contention, Phases

    setup_logging(False)
    logging.getLogger().setLevel(logging.WARNING)
    waits = {"recovery": recovery, "settle": settle, "after-kill": after_kill, "ramp": ramp}
    for name, v in waits.items():
        if v < 0:
            fail(f"--{name} must be >= 0 seconds")
    settings = DemoSettings(
        users=users,
        phases=Phases(
            steady_s=steady,
            contention=Contention(seconds=contention, extra_ms=contention_extra_ms),
            recovery_s=recovery,
            deadline_s=deadline,
            settle_s=settle,
            after_kill_s=after_kill,
            ramp_s=ramp,
        ),
        weights_size=weights_size,
        max_ratio=max_ttft_ratio,
        stall_ms=stall_ms,
        baseline=baseline,
        storage_bps=int(storage_mbps * 1e6),
        realtime_loadgen=realtime_loadgen,
        agent=agent,
    )
    raise typer.Exit(run_demo(out=out, settings=settings, console=console()))
