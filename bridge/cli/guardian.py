"""``pollbridge guardian run|check``: the guardian (see :mod:`bridge.rollout.guardian`) from the command line.

``guardian run`` checks every ``--interval`` seconds until SIGTERM or Ctrl-C (exit 0); a failed check is
logged and counted, never the end of the loop. ``guardian check`` runs one check, prints the measured
figure of each criterion and what it demoted (with ``--dry-run``: what it would demote, changing
nothing), and exits 0 once the check completed; 1 when the database cannot be read, 2 on bad input.
The bus is optional for both: when it cannot be opened or reached, the lag criterion is reported as
unknown and skipped, and the outbox and miss-rate criteria still run.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import click
from sqlalchemy.engine import Engine

from bridge.app.components import OptionalBus
from bridge.cli.common import JSON_OPTION, WholeHelpGroup, components_of, stop_on_signals
from bridge.core.errors import FlagStoreUnavailable
from bridge.core.runtime import settle_heap
from bridge.core.urls import mask_url
from bridge.db.engine import check_connection
from bridge.rollout.guardian import CheckReport, Guardian

log = logging.getLogger(__name__)


def _guardian(ctx: click.Context, engine: Engine, interval: float | None, registry: Any = None
              ) -> tuple[Guardian, OptionalBus]:
    """The guardian and its bus (optional: when it cannot be opened, the lag is unknown)."""
    components = components_of(ctx)
    check_connection(engine)
    store = components.flag_store(engine)
    try:
        store.all()  # fail at start (one line, exit 1) when pollbridge is not installed in this database
    except FlagStoreUnavailable as exc:
        raise FlagStoreUnavailable(f"{exc} (is pollbridge installed in this database? `pollbridge init`)") from None
    bus = components.optional_bus(engine)
    label = f"bus {bus.label}" if bus.error is None else bus.error
    return components.guardian(engine, bus=bus.bus, store=store, registry=registry, bus_label=label,
                               interval=interval), bus


@click.group(cls=WholeHelpGroup)
def guardian() -> None:
    """The guardian: demotes a workflow type to polling when its event path fails (stuck outbox,
    consumer lag, fallback misses)."""


@guardian.command("run")
@click.option("--interval", type=click.FloatRange(0.01, 86400), default=None, envvar="POLLBRIDGE_GUARDIAN_INTERVAL",
              show_envvar=True, help="Seconds between checks [default from config: guardian.interval, 5].")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="POLLBRIDGE_METRICS_PORT",
              show_envvar=True, help="Also serve Prometheus metrics on 127.0.0.1:PORT.")
@click.pass_context
def guardian_run(ctx: click.Context, interval: float | None, metrics_port: int | None) -> None:
    """Check every INTERVAL seconds and demote failing types to polling, until SIGTERM or Ctrl-C."""
    from prometheus_client import CollectorRegistry, start_http_server

    components = components_of(ctx)
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    engine = components.engine()
    bus: OptionalBus | None = None
    try:
        registry = CollectorRegistry()
        guard, bus = _guardian(ctx, engine, interval, registry)
        if metrics_port is not None:
            start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
        click.echo(f"guardian checking every {guard.settings.interval:g} s on "
                   f"{mask_url(components.settings.database_url)}, "
                   f"lag of group {guard.group} on {guard.bus_label}", err=True)
        settle_heap()
        guard.run(stop)
        demotions = sum(s.value for m in registry.collect() if m.name == "pollbridge_guardian_demotions"
                        for s in m.samples if s.name.endswith("_total"))
        click.echo(f"guardian stopped: {int(guard.value('pollbridge_guardian_checks_total'))} checks, "
                   f"{int(demotions)} demotion(s), {int(guard.value('pollbridge_guardian_errors_total'))} failed",
                   err=True)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()


@guardian.command("check")
@click.option("--dry-run", is_flag=True, envvar="POLLBRIDGE_GUARDIAN_DRY_RUN", show_envvar=True,
              help="Only report what would be demoted; change nothing.")
@JSON_OPTION
@click.pass_context
def guardian_check(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Run one check: print each criterion's measured figure and demote (or with --dry-run, name) the
    types that tripped one."""
    engine = components_of(ctx).engine()
    bus: OptionalBus | None = None
    try:
        guard, bus = _guardian(ctx, engine, None)
        report = guard.check_once(act=not dry_run)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        _print_report(report)


def _print_report(report: CheckReport) -> None:
    s = report.settings
    click.echo(f"outbox: {report.unpublished} unpublished, oldest {report.outbox_age:.1f} s old "
               f"(max_outbox_age {s.max_outbox_age:g} s)")
    if report.lag is None:
        click.echo(f"lag: unknown, skipped ({report.lag_detail})")
    else:
        click.echo(f"lag: {report.lag} entries not yet delivered to group {report.group} (max_lag {s.max_lag})")
    click.echo(f"miss rate: over the last {s.window:g} s, judged from {s.min_tasks} dispatches "
               f"(max_miss_rate {s.max_miss_rate:.2%})")
    for gap in report.capture_gaps:
        click.echo(f"capture gap at {gap.detected_at:%Y-%m-%d %H:%M:%S} UTC ({gap.source}): {gap.detail} "
                   "(reported, not demoted for; promotion gates refuse a window that holds it)")
    for verdict in report.verdicts:
        click.echo(f"{verdict.workflow_type} ({verdict.phase}):")
        for f in verdict.findings:
            mark = {"ok": "ok", "exceeded": "EXCEEDED", "unknown": "unknown", "not_judged": "not judged"}[f.state]
            click.echo(f"  [{mark}] {f.criterion}: {f.detail}")
        if verdict.action == "demoted":
            click.echo("  -> demoted to polling")
        elif verdict.action == "would_demote":
            click.echo("  -> would be demoted to polling (dry run)")
        elif verdict.action == "skipped":
            click.echo("  -> left alone: its flag changed during the check")
    if report.unguarded:
        click.echo("not guarded (the poller is authoritative): "
                   + ", ".join(f"{name} ({phase})" for name, phase in sorted(report.unguarded.items())))
    if not report.verdicts:
        click.echo("no workflow type in selective or cutover: nothing to guard")
    if report.dry_run:
        click.echo(f"would demote: {', '.join(report.would_demote) or 'nothing'}")
    else:
        click.echo(f"demoted: {', '.join(report.demoted) or 'nothing'}")
