"""``pollbridge run-all``: relay, scheduler, poller, guardian (and the demo workers) in one process."""

from __future__ import annotations

from typing import Any

import click

from bridge.cli.common import settings_of, stop_on_signals
from bridge.core.runtime import settle_heap
from bridge.core.urls import mask_url


@click.command("run-all")
@click.option("--demo-workers", is_flag=True, envvar="POLLBRIDGE_DEMO_WORKERS", show_envvar=True,
              help="Also run the demo worker pool (executes dispatched tasks of the reference schema).")
@click.option("--poll-interval", type=click.FloatRange(0.01, 3600), default=None, envvar="POLLBRIDGE_POLL_INTERVAL",
              show_envvar=True, help="Seconds between the poller's scans [default from config: 10].")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="POLLBRIDGE_METRICS_PORT",
              show_envvar=True, help="Also serve every component's Prometheus metrics on 127.0.0.1:PORT.")
@click.pass_context
def run_all(ctx: click.Context, demo_workers: bool, poll_interval: float | None, metrics_port: int | None) -> None:
    """Every component in one process, following the flags, until SIGTERM or Ctrl-C. For the embedded
    default and small deployments; in production run each component as its own command."""
    from prometheus_client import start_http_server

    from bridge.app.runall import Stack, StackOptions

    settings = settings_of(ctx)
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    stack = Stack(settings, StackOptions(poll_interval=poll_interval, demo_workers=demo_workers))
    if metrics_port is not None:
        start_http_server(metrics_port, addr="127.0.0.1", registry=stack.registry)
    try:
        settle_heap()  # before the components' threads start: nothing live is paused or frozen mid-use
        stack.start()
        click.echo(f"run-all on {mask_url(settings.database_url)} <-> {mask_url(settings.bus_url)}: relay, scheduler, "
                   f"poller, guardian{', demo workers' if demo_workers else ''}", err=True)
        stop.wait()
    finally:
        stack.stop()
    click.echo(f"run-all stopped: {_summary(stack)}", err=True)


def _summary(stack: Any) -> str:
    def value(name: str, labels: dict[str, str] | None = None) -> int:
        return int(stack.registry.get_sample_value(name, labels or {}) or 0)

    def total(metric: str) -> int:
        return sum(int(s.value) for m in stack.registry.collect() if m.name == metric
                   for s in m.samples if s.name.endswith("_total"))

    parts = [f"{total('pollbridge_relay_published')} published"]
    events = total("pollbridge_scheduler_dispatches")
    parts.append(f"{events} dispatched by events")
    parts.append(f"{value('pollbridge_poller_dispatches_total', {'path': 'poller'})} by the poller")
    parts.append(f"{value('pollbridge_poller_dispatches_total', {'path': 'fallback'})} fallback")
    return ", ".join(parts)
