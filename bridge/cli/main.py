"""``pollbridge``: the command-line interface.

Every option can also be set through the environment variable shown in ``--help``, except the ones that
override a gate or destroy data (``--force``, ``--yes``, ``--all``): those are taken from the command line
only. Exit codes: 0 ok, 1 a check or gate failed (or the database or the bus could not be reached),
2 usage or bad input. Expected errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bridge import __version__
from bridge.cli.common import (
    JSON_OPTION,
    PollbridgeGroup,
    WholeHelpGroup,
    bus_error,
    components_of,
    confirm,
    err_console,
    fail,
    mask_urls,
    settings_of,
    stop_on_signals,
)
from bridge.core.errors import first_line
from bridge.core.runtime import enable_stack_dumps, settle_heap
from bridge.core.settings import ENV_BUS_URL, ENV_CONFIG, ENV_DATABASE_URL
from bridge.core.urls import bus_scheme, mask_url
from bridge.db.engine import check_connection
from bridge.db.migrate import require_head

#: The subcommands defined in their own modules (each imports bridge.cli.common, never this module), imported
#: only when run or listed (:class:`PollbridgeGroup`).
LAZY_COMMANDS = {
    "flags": "bridge.cli.flags:flags",
    "rollback": "bridge.cli.flags:rollback_cmd",
    "reconcile": "bridge.cli.reconcile:reconcile",
    "review": "bridge.cli.review:review",
    "run-all": "bridge.cli.runall:run_all",
    "guardian": "bridge.cli.guardian:guardian",
    "explain": "bridge.cli.observe:explain",
    "status": "bridge.cli.observe:status",
    "metrics": "bridge.cli.observe:metrics",
    "preflight": "bridge.cli.preflight:preflight",
    "serve": "bridge.cli.serve:serve",
}


@click.group(cls=PollbridgeGroup, lazy=LAZY_COMMANDS,
             context_settings={"show_default": True, "max_content_width": 110})
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
@JSON_OPTION
@click.pass_context
def init(ctx: click.Context, demo_schema: bool, as_json: bool) -> None:
    """Install pollbridge's own objects (idempotent)."""
    from bridge.app import install

    settings = settings_of(ctx)
    components = components_of(ctx)
    engine = components.engine()
    bus = None
    try:
        check_connection(engine)  # first: an unreachable database is one line naming the (masked) URL
        if settings.capture.mode == "trigger" and install.wal_installed(engine):
            # Back from the write-ahead log: its share is streamed to its end before the slot goes, here if no
            # relay streams it.
            bus = components.bus(engine)
        result = install.init(engine, demo_schema=demo_schema, mapping=settings.mapping, capture=settings.capture,
                              bus=bus)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()
    if as_json:
        click.echo(json.dumps({
            "database": mask_url(settings.database_url), "revision_before": result.revision_before,
            "revision_after": result.revision_after, "migrated": result.revision_before != result.revision_after,
            "demo_tables_created": list(result.demo_tables_created),
            "capture_installed": result.capture_installed, "table": settings.mapping.table,
            "wake": settings.capture.wake, "capture_mode": settings.capture.mode}, indent=2))
        return
    if result.demo_tables_created:
        click.echo(f"created demo tables: {', '.join(result.demo_tables_created)}")
    if result.capture_installed and settings.capture.mode == "wal":
        click.echo(f"write-ahead-log capture of {settings.mapping.table}: publication and replication slot ready "
                   "(the relay of partition 0 streams it)")
    elif result.capture_installed:
        on = ", ".join([settings.mapping.table, *(r.table for r in settings.mapping.related)])
        click.echo(f"capture triggers installed on {on} (wake-up: {settings.capture.wake})")
    if result.revision_before == result.revision_after:
        click.echo(f"pollbridge already at {result.revision_after} in {mask_url(settings.database_url)}")
    else:
        click.echo(f"pollbridge migrated {result.revision_before or 'empty'} -> {result.revision_after} "
                   f"in {mask_url(settings.database_url)}")


@cli.command()
@click.option("--yes", is_flag=True,
              help="Do not ask for confirmation. Command line only (no environment variable).")
@click.option("--keep-bus", is_flag=True, envvar="POLLBRIDGE_UNINSTALL_KEEP_BUS", show_envvar=True,
              help="Leave the Redis bus's keys (pollbridge's namespace) as they are; they are listed as left.")
@JSON_OPTION
@click.pass_context
def uninstall(ctx: click.Context, yes: bool, keep_bus: bool, as_json: bool) -> None:
    """Remove pollbridge's objects and its bus's data (on Redis, every key of pollbridge's namespace; the
    embedded bus's tables go with the other tables). The scheduler's own tables are never touched. When
    the bus cannot be reached, nothing is removed (exit 1) unless --keep-bus says to leave it."""
    import redis

    from bridge.app import install
    from bridge.app.components import BUS_TIMEOUT

    components = components_of(ctx)
    settings = components.settings
    database = mask_url(settings.database_url)
    embedded = bus_scheme(settings.bus_url) == "embedded"
    bus_label = f"the keys of namespace {settings.bus.namespace!r} on {mask_url(settings.bus_url)}"
    what = f"pollbridge's objects from {database}" + ("" if embedded or keep_bus else f" and {bus_label}")
    if not yes and not confirm(f"Remove {what}?"):
        fail("aborted: nothing removed", 1)
    engine = components.engine()
    bus = None
    try:
        if not embedded and not keep_bus:
            bus = components.bus(engine, timeout=BUS_TIMEOUT)
        try:
            result = install.uninstall_all(engine, bus, components.settings.mapping)
        except (redis.RedisError, OSError) as exc:
            fail(f"cannot reach the bus {mask_url(settings.bus_url)}: {first_line(exc).rstrip('.')}; nothing removed "
                 "(--keep-bus removes pollbridge from the database alone and leaves the bus's keys)", 1)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()
    if embedded:
        bus_state, bus_text = "dropped", "the embedded bus's tables went with pollbridge's tables"
    elif keep_bus:
        bus_state, bus_text = "kept", f"left (--keep-bus): {bus_label}"
    elif result.bus_error is not None:
        bus_state, bus_text = "left", f"left: {bus_label} (the bus failed: {result.bus_error})"
    else:
        bus_state, bus_text = "removed", f"bus: removed {result.bus_removed} key(s) of namespace " \
                                         f"{settings.bus.namespace!r} on {mask_url(settings.bus_url)}"
    if as_json:
        click.echo(json.dumps({"database": database, "removed": list(result.dropped),
                               "bus": {"url": mask_url(settings.bus_url),
                                       "namespace": None if embedded else settings.bus.namespace,
                                       "state": bus_state, "keys_removed": result.bus_removed,
                                       "error": result.bus_error}}, indent=2))
    else:
        click.echo(f"removed: {', '.join(result.dropped)}" if result.dropped else "nothing to remove")
        click.echo(bus_text)
    if result.bus_error is not None:
        fail(f"the bus's data is left: {mask_urls(result.bus_error)}", 1)


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
@click.option("--instances", default=150, type=click.IntRange(1, 1_000_000), envvar="POLLBRIDGE_DEMO_INSTANCES",
              show_envvar=True, help="Workflow instances to seed, split over the five stages (fewer than the "
              "default give the gates too little evidence: they are then forced, and the output says why).")
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
    # Transient: the bar is gone once the demo ends, so an error after it is still one line on stderr.
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("tasks settled", total=None)

        def report(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        def stage(label: str) -> None:
            bar.update(task, description=f"{label}: tasks settled", completed=0, total=None)

        def say(line: str) -> None:  # on stderr, above the bar: stdout keeps only the result (or the JSON)
            bar.console.print(line, markup=False, highlight=False, soft_wrap=True)

        summary = run_demo(settings, options, progress=report, stage_started=stage, say=say)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _print_demo(summary)
    sys.exit(0 if passed(summary) else 1)


def _print_demo(s: dict[str, Any]) -> None:
    """The demo's result for a person: the verdict first, then each stage, then how to read the figures."""
    from bridge.app.demo import gate_brief, gate_text, passed

    # Prose is not wrapped here (the terminal wraps it, a pipe gets whole lines); the table fits the width.
    console = Console(width=None if sys.stdout.isatty() else 150, highlight=False, soft_wrap=True)
    phases = s.get("phases", [])
    ok = passed(s)

    def name(st: dict[str, Any]) -> str:
        return f"{st['phase']} {st['percent']:g}%" if st.get("percent") is not None else str(st["phase"])

    def num(value: float | None) -> str:
        if value is None:
            return "-"
        if value == int(value) or abs(value) >= 10:
            return f"{value:,.0f}"
        return f"{value:.2f}" if abs(value) < 1 else f"{value:.1f}"

    def pair(values: dict[str, Any] | None, kind: str) -> str:
        """``poller / event path`` (``-``: that path made no dispatch in the stage)."""
        cells = []
        for path in ("poller", "events"):
            figures = (values or {}).get(path)
            if figures is None:
                cells.append("-")
            elif kind == "rest":  # pollbridge's own tables and transaction control
                cells.append(num(figures.get("pollbridge", 0) + figures.get("other", 0)))
            else:
                cells.append(num(figures.get(kind, 0)))
        return " / ".join(cells)

    def latency(quantile: str) -> Any:
        def cell(st: dict[str, Any]) -> str:
            return " / ".join(num(st["paths"].get(path, {}).get(quantile)) for path in ("poller", "events"))
        return cell

    def dispatches(st: dict[str, Any]) -> str:
        by = st.get("dispatches_by_path", {})
        events = f"{st['shadow_decisions']} shadow" if st.get("shadow_decisions") else str(by.get("events", "-"))
        return f"{by.get('poller', '-')} / {events}"

    def missed(st: dict[str, Any]) -> str:
        if st.get("reconcile"):
            return str(sum(t.get("missing", 0) for t in st["reconcile"]["types"]))
        return str(st["misses"]) if st["flag"] in ("selective", "cutover") else "-"

    backend = s.get("backend", {})
    console.print(f"[bold]pollbridge demo[/bold]: {s.get('instances') or 'the'} workflow instances of "
                  f"{', '.join(s.get('workflow_types', []))} ({s['tasks']} tasks) through "
                  f"{' → '.join(name(st) for st in phases) or 'nothing'}")
    console.print(f"figures from {escape(backend.get('description', s['database']))}")
    console.print()
    colours = ("bold", "bold green" if ok else "bold red", "bold")
    for colour, line in zip(colours, s.get("verdict", []), strict=False):
        console.print(f"  [{colour}]{escape(line)}[/{colour}]")
    console.print()

    table = Table(title="stage by stage, a fresh slice of the workload each (cells: poller / event path)",
                  title_justify="left")
    table.add_column("")
    for st in phases:
        table.add_column(name(st), justify="right")
    rows: list[tuple[str, Any]] = [
        ("instances / tasks", lambda st: f"{st['instances']} / {st['tasks']}"),
        ("dispatches", dispatches),
        ("ready→dispatch p50, ms", latency("p50_ms")),
        ("ready→dispatch p99, ms", latency("p99_ms")),
        ("missed by the event path", missed),
        ("task-table statements per dispatch ¹", lambda st: pair(st.get("statements_per_dispatch_by_table"),
                                                                 "task_table")),
        ("bus statements per dispatch ²", lambda st: pair(st.get("statements_per_dispatch_by_table"), "bus")),
        ("other statements per dispatch ³", lambda st: pair(st.get("statements_per_dispatch_by_table"), "rest")),
        ("task-table statements per idle s ¹", lambda st: pair(st.get("idle_statements_per_s_by_table"),
                                                               "task_table")),
        ("bus statements per idle s ²", lambda st: pair(st.get("idle_statements_per_s_by_table"), "bus")),
        ("other statements per idle s ³", lambda st: pair(st.get("idle_statements_per_s_by_table"), "rest")),
        ("lost / double / early", lambda st: f"{st['lost']} / {st['double_dispatched']} / {st['early']}"),
        ("gate into the phase", gate_brief),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(st) for st in phases))
    console.print(table)
    tables = ", ".join(s.get("task_tables", [])) or "the task table"
    console.print(f"¹ statements naming the scheduler's tables ({tables}): what scanning them costs")
    console.print("² " + ("the embedded bus reading and writing its own log, in this same database (on Redis: "
                          "Redis commands)" if backend.get("bus_statements_counted", True) else
                          "none: the bus is Redis, whose commands are not database statements"))
    console.print("³ pollbridge's outbox, dispatch log, decisions, flags and leases, and transaction control")
    console.print("counted on each path's own connections; per dispatch: over the stage (dual_write: per shadow "
                  "decision); per idle s: 2 s with nothing to do")
    console.print()

    gates = s.get("gate_settings", {})
    demo_gates, prod = gates.get("demo"), gates.get("production_defaults", {})
    if demo_gates:
        console.print(f"gates (demo settings for this run): min_tasks {demo_gates['min_tasks']} per type (production "
                      f"default {prod['min_tasks']:,}), miss budget {demo_gates['miss_budget']:.0%} "
                      f"({prod['miss_budget']:.1%})")
        console.print(f"  at {demo_gates['confidence']:.0%} confidence, no early or duplicate dispatch; "
                      "each judged on the evidence since the type entered its current phase")
    for st in phases:
        if st.get("gate"):
            console.print(f"  into {name(st)}: {escape(gate_text(st['gate']))}")
        elif st["phase"] == "rollback":
            console.print("  into rollback: never gated, the way back is always open")
    for st in phases:
        rec = st.get("reconcile")
        if rec:
            matched = ", ".join(f"{t['workflow_type']} {t['matched']}" for t in rec["types"])
            console.print(f"reconciler over dual_write: {rec['verdict']}, matched {matched}; "
                          f"{sum(t['missing'] for t in rec['types'])} missing, "
                          f"{sum(t['early'] for t in rec['types'])} early")
    console.print(f"overall: {s['tasks']} tasks, {s['dispatches']} dispatches, lost {s['lost']}, double "
                  f"{s['double_dispatched']}, early {s['early']}, {s['elapsed_s']:.0f} s"
                  + ("" if ok else ": [bold red]FAILED[/bold red]"))
    for problem in s["problems"]:
        console.print(f"[red]problem:[/red] {escape(problem)}")


@cli.group(cls=WholeHelpGroup)
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
        require_head(engine)
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


@cli.group(cls=WholeHelpGroup)
def capture() -> None:
    """Change capture: row triggers, or PostgreSQL's write-ahead log."""


@capture.command("switch")
@click.option("--to", "mode", type=click.Choice(["trigger", "wal"]), required=True,
              envvar="POLLBRIDGE_CAPTURE_SWITCH_TO", show_envvar=True,
              help="The capture to switch to (wal: PostgreSQL with wal_level = logical).")
@click.option("--timeout", type=click.FloatRange(min=1.0), default=120.0, show_default=True,
              envvar="POLLBRIDGE_CAPTURE_SWITCH_TIMEOUT", show_envvar=True,
              help="Seconds to wait for the write-ahead log's share to be streamed when switching back.")
@click.pass_context
def capture_switch(ctx: click.Context, mode: str, timeout: float) -> None:
    """Move a running installation to the other capture without losing or doubling a change.

    One transaction installs the new capture and removes the old one, holding the task table against
    writes for its duration (milliseconds), and marks the switch in the write-ahead log: the triggers own
    what committed before the mark, the log what commits after it (or the reverse). Switching back to the
    triggers waits until the log's share is streamed to the mark (by the running relay, else here), then
    drops the replication slot. Set `[capture] mode` to the same value; after a switch to the log, restart the
    relay of partition 0, which streams the slot from then on (the slot keeps every change until then)."""
    from dataclasses import replace as _replace

    from bridge.app import install
    from bridge.tasktable.tables import reflect_tables

    components = components_of(ctx)
    settings = components.settings
    engine = components.engine()
    bus = None
    try:
        check_connection(engine)
        tables = reflect_tables(engine, settings.mapping)
        if mode == "wal":
            with engine.connect() as conn:
                from bridge.capture import wal as _wal

                problems = _wal.settings_problems(conn) if conn.dialect.name == "postgresql" else \
                    ["the write-ahead log is PostgreSQL's: SQLite captures by trigger only"]
                _wal.captured_columns(conn, tables) if not problems else None
            if problems:
                raise click.ClickException(problems[0])
        else:
            bus = components.bus(engine)
        install.switch_capture(engine, tables, _replace(settings.capture, mode=mode), bus=bus, timeout=timeout)
    except TimeoutError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()
    click.echo(f"capture is now {'the write-ahead log' if mode == 'wal' else 'by trigger'} on "
               f"{settings.mapping.table}; set [capture] mode = \"{mode}\" in pollbridge.toml"
               + (" and restart the relay of partition 0 (it streams the slot from its next start)" if mode == "wal"
                  else ""))


@cli.group(cls=WholeHelpGroup)
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
        require_head(engine)
        bus = components.bus(engine)
        registry = CollectorRegistry()
        if metrics_port is not None:
            start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
        relay_ = components.relay(engine, bus, partition=partition, registry=registry)
        click.echo(f"relay partition {partition} ({relay_.leadership.holder}) on {mask_url(settings.database_url)} "
                   f"-> {mask_url(settings.bus_url)}, wake-up {settings.capture.wake}", err=True)
        streamers: list[Any] = []
        # The relay of partition 0 streams the write-ahead log while its capture is installed and it leads the
        # partition (one process reads the slot at a time: a standby's waits with its relay).
        stream = components.log_stream(engine, bus, relay_, streamers)
        if stream is not None:
            threading.Thread(target=stream, args=(stop,), name="pollbridge-wal", daemon=True).start()
            if settings.capture.mode == "wal":
                click.echo(f"streaming the write-ahead log of {settings.mapping.table}", err=True)
        settle_heap()
        relay_.run(stop)
        total = sum(int(getattr(w, "captured", 0)) for w in streamers)
        captured = f", {total} captured from the write-ahead log" if total else ""
        click.echo(f"relay stopped: {int(relay_.metrics.value('pollbridge_relay_published_total'))} published"
                   f"{captured}", err=True)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()


@cli.group(cls=WholeHelpGroup)
def scheduler() -> None:
    """The event-driven scheduler."""


@scheduler.command("run")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="POLLBRIDGE_METRICS_PORT",
              show_envvar=True, help="Also serve Prometheus metrics on 127.0.0.1:PORT.")
@click.option("--phase", type=click.Choice(["polling", "dual_write", "selective", "cutover"]), default=None,
              envvar="POLLBRIDGE_SCHEDULER_PHASE", show_envvar=True, hidden=True,
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
        require_head(engine)
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
@JSON_OPTION
@click.pass_context
def signal_(ctx: click.Context, task_id: str, kind: str, payload: str | None, actor: str | None,
            as_json: bool) -> None:
    """Record an external callback, approval or rejection for TASK_ID. A task that awaits a signal named
    callback takes only a callback; one that awaits approval an approval or a rejection (exit 2 otherwise,
    nothing recorded)."""
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
    if as_json:
        click.echo(json.dumps({"task_id": result.task_id, "kind": result.kind, "status": result.new_status},
                              indent=2))
        return
    click.echo(f"task {result.task_id}: {result.kind} recorded (status {result.new_status})")



@cli.group(cls=WholeHelpGroup)
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
@click.option("--all", "replay_all", is_flag=True,
              help="Replay every dead letter. Command line only (no environment variable).")
@JSON_OPTION
@click.pass_context
def dlq_replay(ctx: click.Context, ids: tuple[str, ...], replay_all: bool, as_json: bool) -> None:
    """Publish dead letters to the bus again (after the cause was fixed) and remove them from the store."""
    from bridge.core.events import CloudEvent, EventFormatError

    if not ids and not replay_all:
        raise click.UsageError("name the dead letters to replay (ids from `pollbridge dlq list`) or use --all")
    engine, bus = _open_bus_of(ctx)
    try:
        letters = {letter.id: letter for letter in bus.dead_letters(100_000)}
        chosen = list(letters) if replay_all else list(dict.fromkeys(ids))
        unknown = [i for i in chosen if i not in letters]
        if unknown:
            fail(f"no dead letter with id {', '.join(unknown)}; see `pollbridge dlq list`", 2)
        if not chosen:
            _dlq_done(as_json, "replayed", [], "no dead letter: nothing to replay")
            return
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
    _dlq_done(as_json, "replayed", chosen, f"replayed {len(chosen)} dead letter(s)")


def _dlq_done(as_json: bool, verb: str, ids: list[str], text: str) -> None:
    if as_json:
        click.echo(json.dumps({verb: len(ids), "ids": ids}, indent=2))
    else:
        click.echo(text)


@dlq.command("purge")
@click.argument("ids", nargs=-1)
@click.option("--all", "purge_all", is_flag=True,
              help="Purge every dead letter. Command line only (no environment variable).")
@click.option("--yes", is_flag=True,
              help="Do not ask for confirmation. Command line only (no environment variable).")
@JSON_OPTION
@click.pass_context
def dlq_purge(ctx: click.Context, ids: tuple[str, ...], purge_all: bool, yes: bool, as_json: bool) -> None:
    """Delete dead letters for good."""
    if not ids and not purge_all:
        raise click.UsageError("name the dead letters to purge or use --all")
    engine, bus = _open_bus_of(ctx)
    try:
        letters = {letter.id for letter in bus.dead_letters(100_000)}
        chosen = sorted(letters) if purge_all else list(dict.fromkeys(ids))
        unknown = [i for i in chosen if i not in letters]
        if unknown:
            fail(f"no dead letter with id {', '.join(unknown)}; see `pollbridge dlq list`", 2)
        if not chosen:
            _dlq_done(as_json, "purged", [], "no dead letter: nothing to purge")
            return
        if not yes and not confirm(f"Delete {len(chosen)} dead letter(s) for good?"):
            fail("aborted: nothing purged", 1)
        removed = bus.remove_dead_letters(chosen)
    except Exception as exc:
        bus_error(ctx, exc)
        raise
    finally:
        bus.close()
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"purged": removed, "ids": chosen}, indent=2))
    else:
        click.echo(f"purged {removed} dead letter(s)")


@cli.group(cls=WholeHelpGroup)
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


def main() -> None:
    cli(prog_name="pollbridge")


if __name__ == "__main__":
    main()
