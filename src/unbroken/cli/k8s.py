"""Kubernetes: `unbroken ready` (the two-stage readiness probe, `k8s.hooks.ready`) and
`unbroken render k8s` (a spec to manifests, `k8s.render` and `k8s.write`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import app, console, fail

render_app = typer.Typer(no_args_is_help=True, help="Render a pipeline for another platform.")


@app.command()
def ready(
    url: Annotated[str, typer.Option(help="Engine base URL.")] = "http://127.0.0.1:8000",
    budget_ms: Annotated[
        float, typer.Option(help="Stage 2: the warm-up completion must finish within this.")
    ] = 5000.0,
    model: Annotated[str | None, typer.Option(help="Model to warm [the first listed].")] = None,
) -> None:
    """Two-stage readiness of an engine (health, then a warm completion within budget)."""
    from unbroken.k8s.hooks import ready as check_ready

    ok, why = check_ready(url, budget_ms=budget_ms, model=model)
    console().print(why)
    raise typer.Exit(0 if ok else 1)


@render_app.command("k8s")
def render_k8s(
    spec: Annotated[Path | None, typer.Argument(help="Pipeline spec (YAML) [the default].")] = None,
    out: Annotated[
        Path,
        typer.Option(
            help="Directory for the manifests; an earlier render's files there are replaced "
            "(its admin token kept), a directory holding other files is refused."
        ),
    ] = Path("k8s-out"),
    namespace: Annotated[str, typer.Option(help="Namespace of the pipeline.")] = "unbroken",
    image: Annotated[str | None, typer.Option(help="The unbroken image.")] = None,
    agent_image: Annotated[str | None, typer.Option(help="The agent's image.")] = None,
    vllm_image: Annotated[
        str | None,
        typer.Option(help="The vLLM image, vLLM 0.32.0 or later [vllm/vllm-openai:v0.32.0]."),
    ] = None,
    engine: Annotated[
        str, typer.Option(help="vllm (GPU nodes) or simulator (no GPUs: kind, k3s).")
    ] = "vllm",
    gateway_replicas: Annotated[int, typer.Option(help="Gateway replicas (2 or more).")] = 2,
    agent_old_kernel: Annotated[
        bool, typer.Option(help="Nodes run a kernel older than 5.11: add SYS_RESOURCE.")
    ] = False,
    autoscaler: Annotated[
        str,
        typer.Option(help="Pools with a replica range: keda (ScaledObject), hpa or none."),
    ] = "keda",
    prometheus_url: Annotated[
        str | None,
        typer.Option(
            help="The Prometheus KEDA's trigger reads "
            "[http://prometheus-operated.monitoring.svc:9090]."
        ),
    ] = None,
    runtime_class: Annotated[
        str | None,
        typer.Option(
            help="RuntimeClass of the vLLM pods, where the GPU runtime is not the nodes' "
            "default (stock k3s: nvidia)."
        ),
    ] = None,
    monitor_label: Annotated[
        list[str] | None,
        typer.Option(
            help="KEY=VALUE on the PodMonitors and the PrometheusRule, for a Prometheus that "
            "selects them by label (kube-prometheus-stack: release=NAME). Repeat for more."
        ),
    ] = None,
) -> None:
    """Write Kubernetes manifests for a pipeline spec (one YAML file per object)."""
    from dataclasses import replace

    from unbroken.config.spec import SpecError, load_spec
    from unbroken.k8s import PolicyError, RenderOptions, previous_token, render, write

    if str(out) == "-":
        fail("--out -: the render writes a directory (one file per object), not stdout")
    labels = []
    for item in monitor_label or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            fail(f"--monitor-label {item!r}: expected KEY=VALUE")
        labels.append((key, value))
    try:
        pipeline = load_spec(spec)
    except SpecError as e:
        fail(str(e))
    opts = RenderOptions(
        namespace=namespace,
        engine=engine,
        gateway_replicas=gateway_replicas,
        agent_old_kernel=agent_old_kernel,
        autoscaler=autoscaler,
        monitor_labels=tuple(labels),
        runtime_class=runtime_class,
    )
    images = {
        "image": image,
        "agent_image": agent_image,
        "vllm_image": vllm_image,
        "prometheus_url": prometheus_url,
    }
    opts = replace(opts, **{k: v for k, v in images.items() if v})
    # The token of an earlier render into `out`: re-rendering changes nothing it need not.
    opts = replace(opts, admin_token=previous_token(out, opts.prefix) if out.is_dir() else None)
    try:
        paths = write(render(pipeline, opts), out)
    except (PolicyError, ValueError) as e:
        fail(str(e))
    keda = "; KEDA: keda/, once KEDA runs" if any(p.parent.name == "keda" for p in paths) else ""
    console().print(
        f"wrote {len(paths)} object(s) to {out} (Prometheus Operator: monitoring/{keda})"
    )
    from rich.markup import escape

    from unbroken.k8s.autoscale import autoscale_cautions
    from unbroken.k8s.manifests import SCRAPE_S
    from unbroken.k8s.render import vllm_cautions

    lines = vllm_cautions(pipeline) if engine == "vllm" else []
    lines += autoscale_cautions(pipeline, autoscaler=autoscaler, engine=engine, scrape_s=SCRAPE_S)
    if pipeline.rate_limit.store == "local":
        from unbroken.config.tenants import local_overruns

        lines += local_overruns(pipeline.tenants, gateway_replicas)
    for line in lines:
        console().print(f"[yellow]warning:[/yellow] {escape(line)}")


# After `ready`: sub-apps are listed after every command, in the order they are added.
app.add_typer(render_app, name="render")
