"""``pollbridge``: the command-line interface.

Every option can also be set through the environment variable shown in ``--help``. Exit codes:
0 ok, 1 a check or gate failed (or the database could not be reached), 2 usage or bad input.
Expected errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bridge import __version__
from bridge.app import install
from bridge.cli.common import (
    JSON_OPTION,
    PollbridgeGroup,
    bus_error,
    components_of,
    err_console,
    fail,
    settings_of,
    stop_on_signals,
)
from bridge.cli.flags import flags, rollback_cmd
from bridge.cli.guardian import guardian
from bridge.cli.observe import explain, metrics, status
from bridge.cli.preflight import preflight
from bridge.cli.reconcile import reconcile
from bridge.cli.runall import run_all
from bridge.cli.serve import serve
from bridge.core.runtime import enable_stack_dumps, settle_heap
from bridge.core.settings import ENV_BUS_URL, ENV_CONFIG, ENV_DATABASE_URL
from bridge.core.urls import mask_url
from bridge.db.engine import check_connection


@click.group(cls=PollbridgeGroup, context_settings={"show_default": True, "max_content_width": 110})
@click.option("--config", "config", type=click.Path(dir_okay=False), envvar=ENV_CONFIG, show_envvar=True,
              help="Configuration file (default: ./pollbridge.toml if present).")
@click.option("--database-url", envvar=ENV_DATABASE_URL, show_envvar=True,
              help="Database URL [default from config: sqlite:///pollbridge.db].")
@click.option("--bus-url", envvar=ENV_BUS_URL, show_envvar=True,
              help="Event bus URL: 'embedded' or redis://… [default from config: embedded].")
@click.option("--log-level", envvar="POLLBRIDGE_LOG_LEVEL", show_envvar=True, default="WARNING",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.version_option(__version__, prog_name="pollbridge")
@click.pass_context
def cli(ctx: click.Context, config: str | None, database_url: str | None, bus_url: str | None,
        log_level: str) -> None:
    """Move a workflow platform from a polling scheduler to an event-driven one."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    enable_stack_dumps()  # as early as the CLI can: before it, SIGUSR1 still meets its default action (exit)
    ctx.obj = {"config": config, "database_url": database_url, "bus_url": bus_url, "settings": None}


@cli.command()
@click.option("--demo-schema", is_flag=True, envvar="POLLBRIDGE_DEMO_SCHEMA", show_envvar=True,
              help="Also create the reference legacy tables (workflow_instances, tasks) if missing.")
@click.pass_context
def init(ctx: click.Context, demo_schema: bool) -> None:
    """Install pollbridge's own objects (idempotent)."""
    settings = settings_of(ctx)
    engine = components_of(ctx).engine()
    try:
        result = install.init(engine, demo_schema=demo_schema, mapping=settings.mapping, capture=settings.capture)
    finally:
        engine.dispose()
    if result.demo_tables_created:
        click.echo(f"created demo tables: {', '.join(result.demo_tables_created)}")
    if result.capture_installed:
        click.echo(f"capture triggers installed on {settings.mapping.table} (wake-up: {settings.capture.wake})")
    if result.revision_before == result.revision_after:
        click.echo(f"pollbridge already at {result.revision_after} in {mask_url(settings.database_url)}")
    else:
        click.echo(f"pollbridge migrated {result.revision_before or 'empty'} -> {result.revision_after} "
                   f"in {mask_url(settings.database_url)}")


@cli.command()
@click.option("--yes", is_flag=True, envvar="POLLBRIDGE_YES", show_envvar=True,
              help="Do not ask for confirmation.")
@click.pass_context
def uninstall(ctx: click.Context, yes: bool) -> None:
    """Remove pollbridge's objects. The scheduler's own tables are never touched."""
    settings = settings_of(ctx)
    if not yes and not click.confirm(f"Remove pollbridge's objects from {mask_url(settings.database_url)}?"):
        fail("aborted: nothing removed", 1)
    engine = components_of(ctx).engine()
    try:
        dropped = install.uninstall(engine)
    finally:
        engine.dispose()
    click.echo(f"removed: {', '.join(dropped)}" if dropped else "nothing to remove")


@cli.command()
@JSON_OPTION
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check connectivity, the mapping against the real tables, migrations and DAGs. Exit 1 on a failure."""
    from bridge.rollout.doctor import to_json

    components = components_of(ctx)
    engine = components.engine()
    try:
        checks = components.doctor(engine)
    finally:
        engine.dispose()
    ok = all(c.passed for c in checks)
    if as_json:
        click.echo(json.dumps(to_json(checks), indent=2))
    else:
        for c in checks:
            click.echo(f"[{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
    sys.exit(0 if ok else 1)


@cli.command()
@click.option("--instances", default=30, type=click.IntRange(1, 1_000_000), envvar="POLLBRIDGE_DEMO_INSTANCES",
              show_envvar=True, help="Workflow instances to seed.")
@click.option("--tasks-per-instance", default=6, type=click.IntRange(1, 1000),
              envvar="POLLBRIDGE_DEMO_TASKS_PER_INSTANCE", show_envvar=True, help="Tasks in each instance's DAG.")
@click.option("--poll-interval", default=1.0, type=click.FloatRange(0.01, 3600), envvar="POLLBRIDGE_POLL_INTERVAL",
              show_envvar=True, help="Seconds between the poller's scans.")
@click.option("--timeout", default=300.0, type=click.FloatRange(1, 86400), envvar="POLLBRIDGE_DEMO_TIMEOUT",
              show_envvar=True, help="Give up (exit 1) after this many seconds.")
@click.option("--workload", "workload_file", type=click.Path(dir_okay=False, exists=True),
              envvar="POLLBRIDGE_DEMO_WORKLOAD", show_envvar=True,
              help="JSON file of instances to run instead of the generated ones.")
@click.option("--json", "as_json", is_flag=True, envvar="POLLBRIDGE_JSON", show_envvar=True,
              help="Print the summary as JSON on stdout.")
@click.pass_context
def demo(ctx: click.Context, instances: int, tasks_per_instance: int, poll_interval: float, timeout: float,
         workload_file: str | None, as_json: bool) -> None:
    """Walk a workload through the whole migration (polling, dual_write with the reconciler's report,
    selective 50%, cutover, rollback), every component in this process; compare the two paths and check
    the invariants (exit 1 if any task was lost, dispatched twice or early)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from bridge.app.demo import DemoOptions, passed, run_demo

    settings = settings_of(ctx)
    options = DemoOptions(instances=instances, tasks_per_instance=tasks_per_instance,
                          poll_interval=poll_interval, timeout=timeout, workload_file=workload_file)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=as_json) as bar:
        task = bar.add_task("tasks settled", total=None)

        def report(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        def stage(label: str) -> None:
            bar.update(task, description=f"{label}: tasks settled", completed=0, total=None)

        summary = run_demo(settings, options, progress=report, stage_started=stage)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _print_demo(summary)
    sys.exit(0 if passed(summary) else 1)


def _print_demo(s: dict[str, Any]) -> None:
    console = Console(width=None if sys.stdout.isatty() else 150)
    phases = s.get("phases", [])

    def lat(stage: dict[str, Any], path: str) -> str:
        p = stage["paths"].get(path)
        return f"{p['p50_ms']} / {p['p99_ms']} ms" if p else "-"

    table = Table(title=f"pollbridge demo: the migration on {s['database']} ({', '.join(s.get('workflow_types', []))})")
    table.add_column("measure")
    for stage in phases:
        table.add_column(stage["phase"] + (f" {stage['percent']:g}%" if stage.get("percent") else ""), justify="right")
    rows: list[tuple[str, Any]] = [
        ("tasks", lambda st: str(st["tasks"])),
        ("poller: ready→dispatch p50 / p99", lambda st: lat(st, "poller")),
        ("events: ready→dispatch p50 / p99", lambda st: lat(st, "events")),
        ("fallback dispatches (misses)", lambda st: str(st["misses"])),
        ("statements per dispatch: poller", lambda st: str(st["statements_per_dispatch"]["poller"] or "-")),
        ("statements per dispatch: events", lambda st: str(st["statements_per_dispatch"]["events"] or "-")),
        ("idle statements/s: poller", lambda st: str(st["idle_statements_per_s"]["poller"])),
        ("idle statements/s: events", lambda st: str(st["idle_statements_per_s"]["events"])),
        ("lost / double / early", lambda st: f"{st['lost']} / {st['double_dispatched']} / {st['early']}"),
        ("gate", lambda st: "-" if not st.get("gate") else
         ("passed" if all(g["passed"] for g in st["gate"].values()) else "refused, forced")),
    ]
    for name, cell in rows:
        table.add_row(name, *(cell(stage) for stage in phases))
    console.print(table)
    polling = next((st for st in phases if st["phase"] == "polling"), None)
    cutover = next((st for st in phases if st["phase"] == "cutover"), None)
    if polling and cutover:
        side = Table(title="the two paths side by side (polling stage vs cutover stage)")
        side.add_column("measure")
        side.add_column("legacy poller", justify="right")
        side.add_column("event path", justify="right")
        side.add_row("ready→dispatch p50 / p99", lat(polling, "poller"), lat(cutover, "events"))
        side.add_row("statements per dispatch", str(polling["statements_per_dispatch"]["poller"]),
                     str(cutover["statements_per_dispatch"]["events"]))
        side.add_row("idle statements per second", str(polling["idle_statements_per_s"]["poller"]),
                     str(cutover["idle_statements_per_s"]["events"]))
        side.add_row("misses", "-", str(cutover["misses"]))
        side.add_row("lost / double / early",
                     f"{polling['lost']} / {polling['double_dispatched']} / {polling['early']}",
                     f"{cutover['lost']} / {cutover['double_dispatched']} / {cutover['early']}")
        console.print(side)
    for stage in phases:
        rec = stage.get("reconcile")
        if rec:
            counts = ", ".join(f"{t['workflow_type']}: {t['matched']} matched, {t['missing']} missing, "
                               f"{t['early']} early" for t in rec["types"])
            console.print(f"reconciler in dual_write: verdict {rec['verdict']} ({counts})")
    console.print(f"overall: {s['tasks']} tasks, {s['dispatches']} dispatches, lost {s['lost']}, "
                  f"double {s['double_dispatched']}, early {s['early']}, {s['elapsed_s']} s")
    for problem in s["problems"]:
        console.print(f"[red]problem:[/red] {problem}")


@cli.group()
def poller() -> None:
    """The reference legacy poller."""


@poller.command("run")
@click.option("--interval", type=click.FloatRange(0.01, 3600), default=None, envvar="POLLBRIDGE_POLL_INTERVAL",
              show_envvar=True, help="Seconds between scans [default from config: 10].")
@click.option("--sweep-interval", type=click.FloatRange(0.01, 86400), default=None,
              envvar="POLLBRIDGE_SWEEP_INTERVAL", show_envvar=True,
              help="Seconds between safety sweeps over cutover types [default from config: router.sweep_interval].")
@click.option("--sweep-only", is_flag=True, envvar="POLLBRIDGE_SWEEP_ONLY", show_envvar=True,
              help="Only the safety sweep: for deployments that keep their own poller.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="POLLBRIDGE_METRICS_PORT",
              show_envvar=True, help="Also serve Prometheus metrics on 127.0.0.1:PORT.")
@click.pass_context
def poller_run(ctx: click.Context, interval: float | None, sweep_interval: float | None, sweep_only: bool,
               metrics_port: int | None) -> None:
    """Scan the task table every INTERVAL seconds and dispatch ready tasks, following the flags, until
    SIGTERM or Ctrl-C."""
    from prometheus_client import CollectorRegistry, start_http_server

    from bridge.tasktable.tables import reflect_tables
    from legacy_poller.runner import PollerRunner

    components = components_of(ctx)
    settings = components.settings
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    engine = components.engine()
    router = None
    try:
        check_connection(engine)
        tables = reflect_tables(engine, settings.mapping)
        registry = CollectorRegistry()
        if metrics_port is not None:
            start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
        router = components.flag_router(engine, registry=registry).start()
        poller_ = components.poller(engine, tables, router, registry=registry)
        every = interval or settings.poller.interval
        sweep_every = sweep_interval or settings.router.sweep_interval
        click.echo(f"poller {'sweeping' if sweep_only else 'scanning'} {settings.mapping.table} every "
                   f"{sweep_every if sweep_only else every} s on {mask_url(settings.database_url)}", err=True)
        settle_heap()
        PollerRunner(poller_, every, sweep_interval=sweep_every, scan=not sweep_only).run_until(stop)
        m = poller_.metrics
        click.echo(f"poller stopped: {int(m.value('pollbridge_poller_scans_total'))} scans, "
                   f"{int(m.value('pollbridge_poller_dispatches_total', {'path': 'poller'}))} dispatches, "
                   f"{int(m.value('pollbridge_poller_dispatches_total', {'path': 'fallback'}))} fallback", err=True)
    finally:
        if router is not None:
            router.stop()
        engine.dispose()


@cli.group()
def relay() -> None:
    """The outbox relay: captured changes to the event bus."""


@relay.command("run")
@click.option("--partition", type=click.IntRange(0, 1023), default=0, envvar="POLLBRIDGE_RELAY_PARTITION",
              show_envvar=True, help="Relay partition to serve (one active relay per partition; others stand by).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="POLLBRIDGE_METRICS_PORT",
              show_envvar=True, help="Also serve Prometheus metrics on 127.0.0.1:PORT.")
@click.pass_context
def relay_run(ctx: click.Context, partition: int, metrics_port: int | None) -> None:
    """Publish captured changes to the bus until SIGTERM or Ctrl-C."""
    from prometheus_client import CollectorRegistry, start_http_server

    components = components_of(ctx)
    settings = components.settings
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    engine = components.engine()
    bus = None
    try:
        check_connection(engine)
        bus = components.bus(engine)
        registry = CollectorRegistry()
        if metrics_port is not None:
            start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
        relay_ = components.relay(engine, bus, partition=partition, registry=registry)
        click.echo(f"relay partition {partition} ({relay_.leadership.holder}) on {mask_url(settings.database_url)} "
                   f"-> {mask_url(settings.bus_url)}, wake-up {settings.capture.wake}", err=True)
        settle_heap()
        relay_.run(stop)
        click.echo(f"relay stopped: {int(relay_.metrics.value('pollbridge_relay_published_total'))} published",
                   err=True)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()


@cli.group()
def scheduler() -> None:
    """The event-driven scheduler."""


@scheduler.command("run")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="POLLBRIDGE_METRICS_PORT",
              show_envvar=True, help="Also serve Prometheus metrics on 127.0.0.1:PORT.")
@click.option("--phase", type=click.Choice(["polling", "dual_write", "selective", "cutover"]), default=None,
              envvar="POLLBRIDGE_SCHEDULER_PHASE", show_envvar=True,
              help="Assume this phase for every workflow type instead of following the flags (benchmarks, tests) "
                   "[default from config: follow the flags].")
@click.pass_context
def scheduler_run(ctx: click.Context, metrics_port: int | None, phase: str | None) -> None:
    """Consume task events and dispatch ready tasks, until SIGTERM or Ctrl-C."""
    from prometheus_client import CollectorRegistry, start_http_server

    from bridge.core.phases import EventRouter, FixedRouter
    from bridge.flags.router import FlagRouter
    from bridge.tasktable.tables import reflect_tables

    components = components_of(ctx)
    settings = components.settings
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    engine = components.engine()
    bus = None
    flag_router: FlagRouter | None = None
    try:
        check_connection(engine)
        tables = reflect_tables(engine, settings.mapping)
        bus = components.bus(engine)
        registry = CollectorRegistry()
        if metrics_port is not None:
            start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
        fixed = phase or settings.scheduler.phase
        router: EventRouter
        if fixed is not None:
            router = FixedRouter(fixed)  # type: ignore[arg-type]
        else:
            flag_router = components.flag_router(engine, registry=registry).start()
            router = flag_router
        try:
            sched = components.scheduler(engine, tables, bus, router, registry=registry)
        except Exception as exc:  # the bus is down at start: one line, exit 1 (a supervisor restarts us)
            bus_error(ctx, exc)
            raise
        if flag_router is not None:
            flag_router.on_event_share_growth(sched.request_catch_up)
        click.echo(f"scheduler {sched.holder} on {mask_url(settings.database_url)} <- {mask_url(settings.bus_url)}, "
                   f"{'phase ' + fixed if fixed else 'following the flags'}", err=True)
        settle_heap()
        sched.run(stop)
        dispatched = sum(s.value for m in registry.collect() if m.name == "pollbridge_scheduler_dispatches"
                         for s in m.samples if s.name.endswith("_total"))
        click.echo(f"scheduler stopped: {int(dispatched)} dispatched", err=True)
    finally:
        if flag_router is not None:
            flag_router.stop()
        if bus is not None:
            bus.close()
        engine.dispose()


@cli.command("signal")
@click.argument("task_id")
@click.option("--kind", type=click.Choice(["callback", "approval", "rejection"]), required=True,
              envvar="POLLBRIDGE_SIGNAL_KIND", show_envvar=True, help="What arrived for the task.")
@click.option("--payload", default=None, envvar="POLLBRIDGE_SIGNAL_PAYLOAD", show_envvar=True,
              help="JSON payload to record with the signal.")
@click.option("--actor", default=None, envvar="POLLBRIDGE_ACTOR", show_envvar=True,
              help="Who sends it [default: the operating-system user].")
@click.pass_context
def signal_(ctx: click.Context, task_id: str, kind: str, payload: str | None, actor: str | None) -> None:
    """Record an external callback, approval or rejection for TASK_ID."""
    from bridge.tasktable.tables import reflect_tables
    from event_scheduler.signals import record_signal

    components = components_of(ctx)
    engine = components.engine()
    try:
        check_connection(engine)
        tables = reflect_tables(engine, components.settings.mapping)
        result = record_signal(engine, tables, task_id, kind, payload=payload, actor=actor)
    finally:
        engine.dispose()
    click.echo(f"task {result.task_id}: {result.kind} recorded (status {result.new_status})")



@cli.group()
def dlq() -> None:
    """Dead letters of the event path: list, replay after a fix, purge."""


def _open_bus_of(ctx: click.Context) -> tuple[Any, Any]:
    components = components_of(ctx)
    engine = components.engine()
    check_connection(engine)
    return engine, components.bus(engine)


@dlq.command("list")
@click.option("--limit", type=click.IntRange(1, 100_000), default=100, envvar="POLLBRIDGE_DLQ_LIMIT",
              show_envvar=True, help="Most entries to show.")
@JSON_OPTION
@click.pass_context
def dlq_list(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List dead letters with their reasons."""
    engine, bus = _open_bus_of(ctx)
    try:
        letters = bus.dead_letters(limit)
    except Exception as exc:
        bus_error(ctx, exc)
        raise
    finally:
        bus.close()
        engine.dispose()
    if as_json:
        click.echo(json.dumps([letter.__dict__ for letter in letters], indent=2))
        return
    table = Table(title=f"{len(letters)} dead letter(s)")
    for column in ("id", "group", "partition", "reason", "payload"):
        table.add_column(column)
    for letter in letters:
        table.add_row(escape(letter.id), escape(letter.group), str(letter.partition), escape(letter.reason),
                      escape(letter.payload[:60]))
    Console().print(table)


@dlq.command("replay")
@click.argument("ids", nargs=-1)
@click.option("--all", "replay_all", is_flag=True, envvar="POLLBRIDGE_DLQ_ALL", show_envvar=True,
              help="Replay every dead letter.")
@click.pass_context
def dlq_replay(ctx: click.Context, ids: tuple[str, ...], replay_all: bool) -> None:
    """Publish dead letters to the bus again (after the cause was fixed) and remove them from the store."""
    from bridge.core.events import CloudEvent, EventFormatError

    if not ids and not replay_all:
        raise click.UsageError("name the dead letters to replay (ids from `pollbridge dlq list`) or use --all")
    engine, bus = _open_bus_of(ctx)
    try:
        letters = {letter.id: letter for letter in bus.dead_letters(100_000)}
        chosen = list(letters) if replay_all else list(ids)
        unknown = [i for i in chosen if i not in letters]
        if unknown:
            fail(f"no dead letter with id {', '.join(unknown)}; see `pollbridge dlq list`", 2)
        events, bad = [], []
        for i in chosen:
            try:
                events.append(CloudEvent.from_json(letters[i].payload))
            except EventFormatError as exc:
                bad.append(f"{i}: {exc}")
        if bad:
            fail("cannot replay entries that are still malformed (purge them instead): " + "; ".join(bad), 1)
        bus.publish(events)
        bus.remove_dead_letters(chosen)
    except Exception as exc:
        bus_error(ctx, exc)
        raise
    finally:
        bus.close()
        engine.dispose()
    click.echo(f"replayed {len(chosen)} dead letter(s)")


@dlq.command("purge")
@click.argument("ids", nargs=-1)
@click.option("--all", "purge_all", is_flag=True, envvar="POLLBRIDGE_DLQ_ALL", show_envvar=True,
              help="Purge every dead letter.")
@click.option("--yes", is_flag=True, envvar="POLLBRIDGE_YES", show_envvar=True, help="Do not ask for confirmation.")
@click.pass_context
def dlq_purge(ctx: click.Context, ids: tuple[str, ...], purge_all: bool, yes: bool) -> None:
    """Delete dead letters for good."""
    if not ids and not purge_all:
        raise click.UsageError("name the dead letters to purge or use --all")
    engine, bus = _open_bus_of(ctx)
    try:
        letters = {letter.id for letter in bus.dead_letters(100_000)}
        chosen = sorted(letters) if purge_all else list(ids)
        unknown = [i for i in chosen if i not in letters]
        if unknown:
            fail(f"no dead letter with id {', '.join(unknown)}; see `pollbridge dlq list`", 2)
        if not yes and not click.confirm(f"Delete {len(chosen)} dead letter(s) for good?"):
            fail("aborted: nothing purged", 1)
        removed = bus.remove_dead_letters(chosen)
    except Exception as exc:
        bus_error(ctx, exc)
        raise
    finally:
        bus.close()
        engine.dispose()
    click.echo(f"purged {removed} dead letter(s)")


@cli.group()
def workers() -> None:
    """The demo worker pool."""


@workers.command("run")
@click.option("--concurrency", type=click.IntRange(1, 256), default=None, envvar="POLLBRIDGE_WORKERS_CONCURRENCY",
              show_envvar=True, help="Worker threads [default from config: 4].")
@click.pass_context
def workers_run(ctx: click.Context, concurrency: int | None) -> None:
    """Execute dispatched tasks and write results back, until SIGTERM or Ctrl-C."""
    from dataclasses import replace

    from bridge.tasktable.tables import reflect_tables

    components = components_of(ctx)
    settings = components.settings
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    worker_settings = replace(settings.workers, concurrency=concurrency) if concurrency else settings.workers
    engine = components.engine(pool_size=worker_settings.concurrency + 1)
    try:
        check_connection(engine)
        tables = reflect_tables(engine, settings.mapping)
        pool = components.workers(engine, tables, settings=worker_settings)
        click.echo(f"{worker_settings.concurrency} workers on {mask_url(settings.database_url)}", err=True)
        pool.start()
        stop.wait()
        pool.stop()
        stats = pool.stats()
        click.echo(f"workers stopped: {stats.completed} completed, {stats.failed} failed", err=True)
    finally:
        engine.dispose()


# The subcommands defined in their own modules (each imports bridge.cli.common, never this module).
for _command in (flags, rollback_cmd, reconcile, run_all, guardian, explain, status, metrics, preflight, serve):
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="pollbridge")


if __name__ == "__main__":
    main()
