"""``pollbridge explain``, ``pollbridge status`` and ``pollbridge metrics serve``: seeing what both paths do.

* ``explain TASK_ID [--json]``: one task's story and the answer to "why was it (not yet) triggered?"
  (:mod:`bridge.reconcile.explain`). Exit 0; 2 for an unknown task id; 1 when the database cannot be read.
* ``status [--window S] [--json]``: the migration on one screen (:mod:`bridge.reconcile.status`). Exit 0 when every
  part could be read; 1 when the database cannot be read, or when a part could not be (the bus unreachable, the
  flag store down): everything else is still shown, that part as unknown with the reason.
* ``metrics serve [--host H] [--port P] [--window S]``: the same figures as a Prometheus endpoint,
  gathered on each scrape, on 127.0.0.1 unless ``--host`` says otherwise, until SIGTERM or Ctrl-C (exit 0).

The bus is optional for all three: when it cannot be opened or reached, what only it can tell (deliveries,
lag, pending entries, dead letters) is reported as unknown with the reason. URLs are always shown masked.
"""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from bridge.app.components import Components, OptionalBus
from bridge.cli.common import JSON_OPTION, WholeHelpGroup, components_of, stop_on_signals
from bridge.core.errors import PollbridgeError, first_line
from bridge.core.urls import mask_url
from bridge.db.engine import check_connection
from bridge.reconcile.status import DEFAULT_WINDOW

WINDOW_OPTION = click.option("--window", type=click.FloatRange(min=0.001), default=DEFAULT_WINDOW,
                             envvar="POLLBRIDGE_STATUS_WINDOW", show_envvar=True,
                             help="Seconds of recent history the dispatch and decision counts cover.")


class ObserveError(PollbridgeError):
    """pollbridge's tables cannot be read (not installed, or the database failed mid-way). Exit 1."""


def _not_readable(exc: SQLAlchemyError, engine: Engine) -> ObserveError:
    return ObserveError(f"cannot read pollbridge's tables in {mask_url(engine.url)} (is pollbridge installed? "
                        f"`pollbridge init`): {first_line(exc)}")


# --- explain -----------------------------------------------------------------------------------------------

@click.command("explain")
@click.argument("task_id")
@JSON_OPTION
@click.pass_context
def explain(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Why TASK_ID was (or was not yet) triggered: its readiness facts, events, deliveries, decisions and
    dispatches across both paths, and the phase of its type at each moment."""
    from bridge.reconcile.explain import explain_task
    from bridge.tasktable.tables import reflect_tables

    components = components_of(ctx)
    settings = components.settings
    engine = components.engine()
    bus: OptionalBus | None = None
    try:
        check_connection(engine)
        tables = reflect_tables(engine, settings.mapping)
        bus = components.optional_bus(engine)
        try:
            story = explain_task(engine, tables, task_id, bus=bus.bus, bus_error=bus.error,
                                 group=settings.scheduler.group, store=components.flag_store(engine),
                                 foreign=settings.legacy.foreign)
        except SQLAlchemyError as exc:
            raise _not_readable(exc, engine) from None
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()
    if as_json:
        click.echo(json.dumps(story.to_json(), indent=2))
        return
    _print_story(story)


def _print_story(x: Any) -> None:
    click.echo(x.answer.sentence)
    console = Console(width=160)
    r = x.readiness
    facts = Table("fact", "value", title=f"task {x.task_id}", show_header=False)
    facts.add_row("instance / key", f"{x.instance_id} / {x.task_key}")
    facts.add_row("workflow type", x.workflow_type or "")
    facts.add_row("status", f"{x.status} ({x.logical_status or 'unmapped'})")
    if x.attempts is not None:
        facts.add_row("attempts", f"{x.attempts} of {x.max_attempts}")
    facts.add_row("ready now", f"yes, since {_t(r.ready_since)}" if r.ready_now else "no")
    facts.add_row("due", "no due time" if r.due_at is None else f"{_t(r.due_at)} ({'passed' if r.due else 'future'})")
    if r.awaits_signal is not None:
        facts.add_row("awaited signal", f"{r.awaits_signal}: " + (f"arrived {_t(r.signal_received_at)}"
                                                                    if r.signal_received_at else "not arrived"))
    for s in r.signals:
        facts.add_row("signal recorded", f"{s.kind} by {s.actor or '?'} at {_t(s.received_at)}")
    flag = x.flag
    facts.add_row("flag now", f"{flag.phase}{'' if flag.percent is None else f' {flag.percent:g}%'} "
                              f"({flag.source}; grace {flag.grace_seconds:g} s; event route {flag.event_route}, "
                              f"poller route {flag.poller_route})")
    for e in x.review:
        decided = (f"; {e.decision} by {e.decided_by} at {_t(e.decided_at)}: {e.decision_reason}" if e.decision
                   else "; waiting for a person")
        facts.add_row("review queue", f"parked at {_t(e.parked_at)} by {e.parked_by}: {e.reason}{decided}")
    if x.hold is not None:
        h = x.hold
        state = ("released (dispatched by its holder) at " + _t(h.released_at) if h.released_at is not None
                 else "legitimate" if h.legit else "STALE (its holder stopped renewing it)")
        facts.add_row("backpressure hold", f"{h.reason} since {_t(h.held_at)} by {h.holder}, until {_t(h.until)}; "
                                           f"{state}")
    if x.phases:
        facts.add_row("phase history", "; ".join(f"{s.phase} from {_t(s.since) if s.since else 'the start'}"
                                                 for s in x.phases))
    console.print(facts)
    if r.dependencies:
        deps = Table("dependency", "task id", "status", "completed at", "met", title="dependencies")
        for d in r.dependencies:
            deps.add_row(d.key, d.task_id or "(missing)", d.status or "", _t(d.completed_at), "yes" if d.met else "NO")
        console.print(deps)
    events = Table(title=f"outbox events ({len(x.events)}{', latest only' if x.events_truncated else ''})")
    for column in ("event id", "change", "status", "trace id", "created", "published", "relay p.", "delivery"):
        events.add_column(column, overflow="fold")
    for e in x.events:
        d = e.delivery
        where = f" p{d.partition}#{d.entry_id}" if d.entry_id else ""
        events.add_row(e.event_id, e.change, f"{e.old_status or '-'} -> {e.new_status or '-'}", e.trace_id or "",
                       _t(e.created_at), _t(e.published_at), str(e.relay_partition), f"{d.state}{where}")
    console.print(events)
    if x.decisions:
        decs = Table("attempt", "ready at", "decided at", "latency ms", "trace id", "traced change", "phase then",
                     title="shadow decisions of the event path")
        for c in x.decisions:
            decs.add_row(str(c.attempt), _t(c.ready_at), _t(c.decided_at), _ms(c.latency_ms), c.trace_id or "",
                         _traced(c.trace_event), c.phase)
        console.print(decs)
    disp = Table("attempt", "path", "ready at", "dispatched at", "latency ms", "trace id", "traced change",
                 "phase then", title="dispatches")
    for p in x.dispatches:
        disp.add_row(str(p.attempt), p.path, _t(p.ready_at), _t(p.dispatched_at), _ms(p.latency_ms),
                     p.trace_id or "", _traced(p.trace_event), p.phase)
    console.print(disp)


# --- status ------------------------------------------------------------------------------------------------

@click.command("status")
@WINDOW_OPTION
@JSON_OPTION
@click.pass_context
def status(ctx: click.Context, window: float, as_json: bool) -> None:
    """The migration on one screen: per workflow type its phase and recent dispatches by path, fallback
    misses and shadow decisions; the outbox backlog, consumer lag, pending entries, dead letters,
    guardian demotions and the flag store's health. Exit 1 when a part could not be read."""
    components = components_of(ctx)
    engine = components.engine()
    bus: OptionalBus | None = None
    try:
        check_connection(engine)
        bus = components.optional_bus(engine)
        state = _gather(components, engine, bus, window)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()
    if as_json:
        click.echo(json.dumps(state.to_json(), indent=2))
    else:
        _print_status(state, foreign=components.settings.legacy.foreign)
    unread = _unread_parts(state)
    if unread:
        click.echo(f"pollbridge: error: status incomplete: {'; '.join(unread)}", err=True)
        ctx.exit(1)


def _unread_parts(s: Any) -> list[str]:
    """The parts of a status that could not be read, each with why."""
    parts = []
    if s.bus.state != "ok":
        parts.append(f"the bus: {s.bus.reason}")
    if not s.flag_store_up:
        parts.append(f"the flag store: {s.flag_store_detail}")
    return parts


def _gather(components: Components, engine: Engine, bus: OptionalBus, window: float) -> Any:
    from bridge.reconcile.status import gather_status

    settings = components.settings
    try:
        return gather_status(engine, bus=bus.bus, bus_label=bus.label, bus_error=bus.error,
                             group=settings.scheduler.group, window=window, store=components.flag_store(engine),
                             database_label=mask_url(settings.database_url))
    except SQLAlchemyError as exc:
        raise _not_readable(exc, engine) from None


def _print_status(s: Any, foreign: bool = False) -> None:
    console = Console(width=160)
    # A foreign scheduler's dispatches are the captured ones the relay records under the path 'poller'.
    legacy = "legacy scheduler (captured)" if foreign else "poller"
    table = Table("workflow type", "phase", legacy, "events", "fallback (misses)", "shadow decisions",
                  "guardian demotions", "parked (review)", "held back now",
                  title=f"pollbridge status: {s.database}, last {s.window_seconds:g} s (at {_t(s.checked_at)})")
    for t in s.types:
        phase = t.phase + (f" {t.percent:g}%" if t.percent is not None else "") + \
            (" (no flag)" if t.flag_source == "default" else "")
        table.add_row(t.workflow_type or "(none)", phase, str(t.dispatches.get("poller", 0)),
                      str(t.dispatches.get("events", 0)), str(t.fallback_misses), str(t.decisions),
                      str(t.guardian_demotions),
                      f"{t.parked} (oldest {t.parked_oldest_age:.0f} s)" if t.parked and t.parked_oldest_age is not None
                      else str(t.parked), str(t.held))
    if not s.types:
        table.add_row("(no workflow type with a flag or recent activity)", "", "", "", "", "", "", "", "")
    console.print(table)
    click.echo(f"outbox: {s.outbox_backlog} unpublished, oldest {s.outbox_oldest_age_seconds:.1f} s old; "
               f"{s.outbox_dead_letters} dead-lettered by the relay")
    if s.slot is not None:
        slot = s.slot
        if not slot.exists or slot.wal_status == "lost":
            click.echo("capture: write-ahead log; the replication slot is GONE (dropped or invalidated): the relay "
                       "recreates it and re-derives the unfinished tasks; `pollbridge doctor` says more")
        else:
            click.echo(f"capture: write-ahead log, slot {'streaming' if slot.active else 'NOT being read'}; "
                       f"{_size(slot.retained_bytes)} of WAL retained, {_size(slot.lag_bytes)} not yet confirmed")
    b = s.bus
    if b.state == "ok":
        parts = ", ".join(f"p{p}={n}" for p, n in sorted((b.lag_partitions or {}).items()))
        click.echo(f"bus {b.url} (group {b.group}): lag {b.lag} ({parts}); {b.pending} pending (delivered, not "
                   f"acknowledged); {b.dead_letters} dead letters")
        if b.placement is not None:
            nodes: dict[str, list[int]] = {}
            for partition, node in sorted(b.placement.items()):
                nodes.setdefault(node, []).append(partition)
            click.echo(f"bus partitions on {len(nodes)} cluster node(s): " + "; ".join(
                f"{node}: {', '.join(f'p{p}' for p in parts)}" for node, parts in sorted(nodes.items())))
    else:
        click.echo(f"bus {b.url} (group {b.group}): lag, pending and dead letters unknown: {b.reason}")
    demotions = sum(t.guardian_demotions for t in s.types)
    if s.guardian_recent:
        last = s.guardian_recent[0]
        click.echo(f"guardian: {demotions} demotion(s); latest {last.workflow_type} {last.old_phase} -> "
                   f"{last.new_phase} at {_t(last.changed_at)}: {last.reason}")
    else:
        click.echo("guardian: no demotion recorded")
    click.echo(f"flag store: {'up' if s.flag_store_up else 'DOWN'} ({s.flag_store_detail})")
    parked = sum(t.parked for t in s.types)
    if parked:
        click.echo(f"review queue: {parked} task(s) parked by the depth or dispatch-count guard wait for a person: "
                   "`pollbridge review list`")


# --- metrics serve -----------------------------------------------------------------------------------------

@click.group("metrics", cls=WholeHelpGroup)
def metrics() -> None:
    """Prometheus metrics of the whole migration."""


@metrics.command("serve")
@click.option("--host", default="127.0.0.1", envvar="POLLBRIDGE_METRICS_SERVE_HOST", show_envvar=True,
              help="Address to listen on (127.0.0.1: this host only; 0.0.0.0 exposes it to the network).")
@click.option("--port", type=click.IntRange(0, 65535), default=9464, envvar="POLLBRIDGE_METRICS_SERVE_PORT",
              show_envvar=True, help="Port to listen on (0: any free port, printed at start).")
@WINDOW_OPTION
@click.pass_context
def metrics_serve(ctx: click.Context, host: str, port: int, window: float) -> None:
    """Serve /metrics (everything `status` shows, gathered on each scrape) until SIGTERM or Ctrl-C."""
    from prometheus_client import CollectorRegistry, start_http_server

    from bridge.reconcile.status import StatusCollector

    components = components_of(ctx)
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    engine = components.engine()
    bus: OptionalBus | None = None
    try:
        check_connection(engine)
        bus = opened = components.optional_bus(engine)

        def gather() -> Any:
            return _gather(components, engine, opened, window)

        registry = CollectorRegistry()
        registry.register(StatusCollector(gather))
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise ObserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        bound = server.server_address[1]
        click.echo(f"metrics on http://{_host_text(host)}:{bound}/metrics "
                   f"({mask_url(components.settings.database_url)}, bus {opened.label}), window {window:g} s", err=True)
        try:
            stop.wait()
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
        click.echo("metrics server stopped", err=True)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# --- helpers -----------------------------------------------------------------------------------------------

def _t(value: Any) -> str:
    if value is None:
        return ""
    text: str = value.isoformat(sep=" ", timespec="milliseconds")
    return text.replace("+00:00", "Z")


def _traced(event: Any) -> str:
    """The captured change a trace id came from (``task key: change -> status``), if still in the outbox."""
    if event is None:
        return ""
    return f"{event.task_key}: {event.change} -> {event.new_status}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _size(n: int | None) -> str:
    """Bytes as a person reads them (``1.2 MB``)."""
    value = float(n or 0)
    for unit in ("bytes", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"
