"""``pollbridge review list|release|reject``: the review queue of the depth and dispatch-count guards.

A parked task waits for a person (:mod:`bridge.tasktable.review`): ``release`` lets it be dispatched (and
exempts it from the guards from then on), ``reject`` fails it. Every decision is recorded with the actor,
the time and the reason (``review list --all`` shows the trail; ``explain TASK`` shows it for one task).

Exit codes: 0 every id decided, 1 some id could not be (not parked, moved by someone else; the others are
still decided, each one its own transaction), 2 bad input (an id that is not a task id, an empty reason).
``--reason`` is required for a rejection; nothing about a decision is taken from the environment but the
actor.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime

import click
import sqlalchemy as sa
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bridge.cli.common import JSON_OPTION, WholeHelpGroup, components_of
from bridge.core.errors import ReviewError
from bridge.db.clock import as_utc
from bridge.db.engine import check_connection, db_now, read_only
from bridge.rollout.promotion import default_actor
from bridge.tasktable import review as queue
from bridge.tasktable.tables import parse_task_id, reflect_tables

ACTOR_OPTION = click.option("--actor", default=None, envvar="POLLBRIDGE_ACTOR", show_envvar=True,
                            help="Who decides [default: the operating-system user].")


@click.group(cls=WholeHelpGroup)
def review() -> None:
    """The review queue: tasks the depth guard parked, for a person to release or reject."""


def _age(since: datetime, now: datetime) -> str:
    seconds = max(0.0, (now - since).total_seconds())
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@review.command("list")
@click.option("--all", "include_decided", is_flag=True, envvar="POLLBRIDGE_REVIEW_ALL", show_envvar=True,
              help="Also the decided entries (the audit trail).")
@click.option("--type", "workflow_type", default=None, envvar="POLLBRIDGE_REVIEW_TYPE", show_envvar=True,
              help="Only this workflow type.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=1000, show_default=True,
              envvar="POLLBRIDGE_REVIEW_LIMIT", show_envvar=True, help="Most entries to show.")
@JSON_OPTION
@click.pass_context
def list_cmd(ctx: click.Context, include_decided: bool, workflow_type: str | None, limit: int, as_json: bool) -> None:
    """Parked tasks, oldest first: which guard stopped each, what it measured, since when."""
    engine = components_of(ctx).engine()
    try:
        check_connection(engine)
        with read_only(engine).connect() as conn:
            found = queue.entries(conn, include_decided=include_decided, workflow_type=workflow_type, limit=limit)
            # Ages by the database's clock, the one that stamped parked_at.
            now = as_utc(conn.execute(sa.select(db_now(engine.dialect.name))).scalar_one()) or datetime.now(UTC)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps([e.as_dict() for e in found], indent=2))
        return
    if not found:
        click.echo("the review queue is empty" + ("" if include_decided else " (nothing parked)"))
        return
    table = Table(box=None, pad_edge=False)
    for name in ("task", "instance", "key", "type", "why", "parked", "by"):
        table.add_column(name)
    if include_decided:
        table.add_column("decision")
    for e in found:
        row = [e.task_id, e.instance_id, e.task_key, e.workflow_type or "-", e.reason,
               f"{_age(e.parked_at, now)} ago", e.parked_by]
        if include_decided:
            row.append(f"{e.decision} by {e.decided_by}: {e.decision_reason}" if e.decision else "parked")
        table.add_row(*(escape(str(v)) for v in row))
    Console(width=None if sys.stdout.isatty() else 200, highlight=False).print(table)
    parked = sum(1 for e in found if e.decision is None)
    if parked:
        click.echo(f"{parked} parked; `pollbridge review release ID...` lets a task run, "
                   "`pollbridge review reject ID... --reason TEXT` fails it")
    else:
        click.echo("nothing parked now")


def _decide(ctx: click.Context, task_ids: tuple[str, ...], decision: queue.Decision, actor: str | None,
            reason: str, as_json: bool) -> None:
    if not reason.strip():
        raise ReviewError("--reason must not be empty: say why, for the audit trail")
    who = actor or default_actor()
    components = components_of(ctx)
    engine = components.engine()
    outcomes: list[queue.Outcome] = []
    try:
        check_connection(engine)
        tables = reflect_tables(engine, components.settings.mapping)
        for task_id in task_ids:  # every id checked before any decision: bad input changes nothing
            parse_task_id(tables, task_id, ReviewError)
        store = components.flag_store(engine)
        with engine.begin() as conn:  # each id in a savepoint of its own: one that fails leaves the others
            outcomes = queue.decide(conn, tables, list(dict.fromkeys(task_ids)), decision, actor=who,
                                    reason=reason.strip(), phase_of=lambda t: store.get(t or "").phase,
                                    relay_partitions=components.settings.capture.relay_partitions)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps([{"task_id": o.task_id, "done": o.done, "detail": o.detail} for o in outcomes],
                              indent=2))
    else:
        for o in outcomes:
            click.echo(f"task {o.task_id}: {o.detail}")
    if not all(o.done for o in outcomes):
        ctx.exit(1)


@review.command("release")
@click.argument("task_ids", nargs=-1, required=True)
@click.option("--reason", default="released after review", show_default=True, envvar="POLLBRIDGE_REVIEW_REASON",
              show_envvar=True, help="Why (recorded).")
@ACTOR_OPTION
@JSON_OPTION
@click.pass_context
def release_cmd(ctx: click.Context, task_ids: tuple[str, ...], reason: str, actor: str | None,
                as_json: bool) -> None:
    """Let parked tasks run: each goes back to pending (if it was moved to review) and is exempt from the
    guards from then on."""
    _decide(ctx, task_ids, "released", actor, reason, as_json)


@review.command("reject")
@click.argument("task_ids", nargs=-1, required=True)
@click.option("--reason", required=True, envvar="POLLBRIDGE_REVIEW_REASON", show_envvar=True,
              help="Why the task must not run (recorded).")
@ACTOR_OPTION
@JSON_OPTION
@click.pass_context
def reject_cmd(ctx: click.Context, task_ids: tuple[str, ...], reason: str, actor: str | None,
               as_json: bool) -> None:
    """Fail parked tasks for good: each moves to the failed status with its attempts at their maximum, so no
    retry brings it back."""
    _decide(ctx, task_ids, "rejected", actor, reason, as_json)
