"""``pollbridge flags list|set|history`` and ``pollbridge rollback``: what operators touch.

Exit codes: 0 done (or nothing to change), 1 a gate refused the promotion (or the database cannot be
read), 2 bad input (unknown phase, bad type name or percentage, a name that is no workflow type, a
skipped step without ``--force``, a missing reason). Nothing is written unless the whole change is valid
and allowed. ``--force`` and ``--all`` are taken from the command line only, never from the environment:
an override or a change to every type is typed, not inherited.
"""

from __future__ import annotations

import json
from typing import Any

import click
import sqlalchemy as sa
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy.engine import Engine

from bridge.app.components import Components
from bridge.cli.common import JSON_OPTION, WholeHelpGroup, components_of
from bridge.core.errors import FlagError, GateRefused
from bridge.core.phases import PHASES, Flag
from bridge.db.engine import check_connection, create_engine, read_only
from bridge.flags.store import FlagChange, describe, validate_type_name
from bridge.reconcile.gate import GateResult, require_known_types, unknown_type_message, unknown_types
from bridge.rollout.promotion import default_actor, rollback, set_phase
from bridge.tasktable.tables import TaskTable, reflect_tables

ACTOR_OPTION = click.option("--actor", default=None, envvar="POLLBRIDGE_ACTOR", show_envvar=True,
                            help="Who makes the change [default: the operating-system user].")


def _engine(components: Components) -> Engine:
    # Not components.engine(): create_engine is looked up in this module, so a test can cut its connections.
    return create_engine(components.settings.database_url)


def _known_types(engine: Any, tt: TaskTable) -> list[str]:
    src, workflow_type = tt.workflow_type_source(tt.tasks)
    with read_only(engine).connect() as conn:
        return sorted(str(v) for v in conn.execute(sa.select(workflow_type).select_from(src).distinct()).scalars()
                      if v is not None)


def _flag_json(flag: Flag, source: str) -> dict[str, Any]:
    return {"workflow_type": flag.workflow_type, "phase": flag.phase, "percent": flag.percent,
            "grace_seconds": flag.grace_seconds, "thresholds": flag.thresholds,
            "updated_at": flag.updated_at.isoformat() if flag.updated_at else None,
            "updated_by": flag.updated_by, "source": source}


@click.group(cls=WholeHelpGroup)
def flags() -> None:
    """Per-workflow-type phases: polling -> dual_write -> selective -> cutover."""


@flags.command("list")
@JSON_OPTION
@click.pass_context
def flags_list(ctx: click.Context, as_json: bool) -> None:
    """Every workflow type with its phase (types seen in the task table without a flag are polling)."""
    components = components_of(ctx)
    settings = components.settings
    engine = _engine(components)
    try:
        check_connection(engine)
        store = components.flag_store(engine)
        stored = store.all()
        tt = reflect_tables(engine, settings.mapping)
        rows = [(stored[name], "flag") if name in stored else (Flag(name, grace_seconds=settings.router.grace),
                                                               "default")
                for name in sorted(set(stored) | set(_known_types(engine, tt)))]
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"flags": [_flag_json(f, src) for f, src in rows]}, indent=2))
        return
    table = Table("workflow type", "phase", "percent", "grace (s)", "changed", "by", title="flags")
    for flag, source in rows:
        table.add_row(escape(flag.workflow_type), flag.phase + (" (no flag)" if source == "default" else ""),
                      "" if flag.phase != "selective" else ("100" if flag.percent is None else f"{flag.percent:g}"),
                      f"{flag.grace_seconds:g}", flag.updated_at.isoformat(timespec="seconds") if flag.updated_at
                      else "", escape(flag.updated_by or ""))
    Console().print(table)


def _parse_thresholds(values: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in values:
        name, sep, raw = item.partition("=")
        if not sep:
            raise FlagError(f"--threshold takes NAME=VALUE, got {item!r}")
        try:
            out[name.strip()] = float(raw)
        except ValueError:
            raise FlagError(f"--threshold {name.strip()}: {raw!r} is not a number") from None
    return out


def _print_gate(gate: GateResult) -> None:
    click.echo(f"gate {gate.workflow_type} -> {gate.target}:", err=True)
    for c in gate.criteria:
        click.echo(f"  [{'pass' if c.passed else 'FAIL'}] {c.name}: {c.detail}", err=True)


@flags.command("set")
@click.argument("workflow_type")
@click.argument("phase")
@click.option("--percent", type=float, default=None, envvar="POLLBRIDGE_FLAG_PERCENT", show_envvar=True,
              help="selective only: the share of instances (0-100, stable hash) the event path owns.")
@click.option("--reason", default=None, envvar="POLLBRIDGE_FLAG_REASON", show_envvar=True,
              help="Why (required; kept in the audit trail).")
@ACTOR_OPTION
@click.option("--force", is_flag=True,
              help="Override a refused gate or a skipped step (audited as forced); set a type that has no task "
                   "yet. Command line only (no environment variable).")
@click.option("--grace", type=float, default=None, envvar="POLLBRIDGE_FLAG_GRACE", show_envvar=True,
              help="Seconds a canary task may wait before the poller dispatches it as a fallback "
                   "[default from config: router.grace].")
@click.option("--threshold", "thresholds", multiple=True, metavar="NAME=VALUE", envvar="POLLBRIDGE_FLAG_THRESHOLDS",
              show_envvar=True, help="Per-type gate/guardian threshold override (repeatable): min_tasks, miss_budget, "
                                     "objective, tolerance, max_outbox_age, max_lag, max_miss_rate.")
@JSON_OPTION
@click.pass_context
def flags_set(ctx: click.Context, workflow_type: str, phase: str, percent: float | None, reason: str | None,
              actor: str | None, force: bool, grace: float | None, thresholds: tuple[str, ...], as_json: bool) -> None:
    """Move WORKFLOW_TYPE to PHASE (one of polling, dual_write, selective, cutover)."""
    validate_type_name(workflow_type)
    if phase not in PHASES:
        raise FlagError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
    if not (reason or "").strip():
        raise FlagError("a reason is required (--reason): every flag change is audited with why it was made")
    parsed = _parse_thresholds(thresholds)
    components = components_of(ctx)
    settings = components.settings
    engine = _engine(components)
    try:
        check_connection(engine)
        store = components.flag_store(engine)
        tt = reflect_tables(engine, settings.mapping)
        if not force and unknown_types(engine, tt, [workflow_type], store):
            raise FlagError(unknown_type_message(workflow_type, settings.mapping.table)
                            + ", or pass --force to set it ahead of its tasks")
        grace_value = grace if grace is not None else (settings.router.grace
                                                       if workflow_type not in store.all() else None)
        try:
            outcome = set_phase(engine, tt, store, settings.gates, workflow_type, phase, reason=reason or "",
                                actor=actor, percent=percent, force=force, grace_seconds=grace_value,
                                thresholds=parsed)
        except GateRefused as refused:
            if isinstance(refused.gate, GateResult):
                if as_json:
                    click.echo(json.dumps({"changed": False, "gate": refused.gate.to_json()}, indent=2))
                else:
                    _print_gate(refused.gate)
            raise
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"changed": outcome.change is not None,
                               "change": outcome.change.to_json() if outcome.change else None,
                               "gate": outcome.gate.to_json() if outcome.gate else None}, indent=2))
        return
    if outcome.gate is not None:
        _print_gate(outcome.gate)
    if outcome.change is None:
        click.echo(f"{workflow_type} already {describe(outcome.old)}: nothing changed")
        return
    c = outcome.change
    target = describe(Flag(workflow_type, c.new_phase, c.new_percent))  # type: ignore[arg-type]
    click.echo(f"{workflow_type}: {describe(outcome.old)} -> {target}"
               f"{' (forced)' if c.forced else ''} by {c.actor}")


def _change_line(c: FlagChange) -> str:
    old = describe(Flag(c.workflow_type, c.old_phase, c.old_percent))  # type: ignore[arg-type]
    new = describe(Flag(c.workflow_type, c.new_phase, c.new_percent))  # type: ignore[arg-type]
    return f"{old} -> {new}"


@flags.command("history")
@click.argument("workflow_type", required=False)
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=100, envvar="POLLBRIDGE_HISTORY_LIMIT",
              show_envvar=True, help="Most recent changes shown.")
@JSON_OPTION
@click.pass_context
def flags_history(ctx: click.Context, workflow_type: str | None, limit: int, as_json: bool) -> None:
    """The audit trail: every flag change with actor, reason, old and new value, time."""
    if workflow_type is not None:
        validate_type_name(workflow_type)
    components = components_of(ctx)
    engine = _engine(components)
    try:
        check_connection(engine)
        store = components.flag_store(engine)
        if workflow_type is not None and workflow_type not in store.all():
            require_known_types(engine, reflect_tables(engine, components.settings.mapping), [workflow_type], store)
        changes = store.history(workflow_type, limit=limit)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"changes": [c.to_json() for c in changes]}, indent=2))
        return
    table = Table("time", "workflow type", "action", "change", "actor", "forced", "reason", title="flag history")
    for c in changes:
        table.add_row(c.changed_at.isoformat(timespec="seconds"), escape(c.workflow_type), c.action,
                      escape(_change_line(c)), escape(c.actor), "yes" if c.forced else "", escape(c.reason))
    Console(width=160).print(table)


@click.command("rollback")
@click.argument("workflow_type", required=False)
@click.option("--all", "all_types", is_flag=True,
              help="Every workflow type that is not in polling. Command line only (no environment variable).")
@click.option("--reason", default=None, envvar="POLLBRIDGE_FLAG_REASON", show_envvar=True,
              help="Why (required; kept in the audit trail).")
@ACTOR_OPTION
@JSON_OPTION
@click.pass_context
def rollback_cmd(ctx: click.Context, workflow_type: str | None, all_types: bool, reason: str | None,
                 actor: str | None, as_json: bool) -> None:
    """Return WORKFLOW_TYPE (or --all) to polling at once. Never gated; every running process follows
    within one refresh interval."""
    if (workflow_type is None) == (not all_types):
        raise FlagError("give one workflow type or --all")
    if workflow_type is not None:
        validate_type_name(workflow_type)
    if not (reason or "").strip():
        raise FlagError("a reason is required (--reason): every flag change is audited with why it was made")
    components = components_of(ctx)
    engine = _engine(components)
    try:
        check_connection(engine)
        store = components.flag_store(engine)
        if workflow_type is not None and workflow_type not in store.all():
            # The way back must stay open: a type with a flag is rolled back without reading the task table.
            require_known_types(engine, reflect_tables(engine, components.settings.mapping), [workflow_type], store)
        changes = rollback(store, None if all_types else [workflow_type or ""], reason=reason or "",
                           actor=actor or default_actor())
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"changes": [c.to_json() for c in changes]}, indent=2))
        return
    if not changes:
        click.echo("no workflow type outside polling: nothing to roll back")
    for c in changes:
        click.echo(f"{c.workflow_type}: {_change_line(c)} (rollback by {c.actor})")
