"""``pollbridge preflight PHASE --type T [--percent P] [--json]``: the checklist that gates a phase change.

Exit codes: 0 every check passed, 1 a check failed, 2 bad input (unknown phase, bad type name or
percentage, a type with no flag and no task). The checks and which phases they gate are the registry in
:mod:`bridge.rollout.preflight`; the help text below is built from it.
"""

from __future__ import annotations

import json
import sys

import click

from bridge.cli.common import JSON_OPTION, components_of
from bridge.core.phases import PHASES, Flag
from bridge.flags.store import describe
from bridge.rollout.preflight import CHECKS, PreflightReport, validate_request


def _matrix_help() -> str:
    width = max(len(c.name) for c in CHECKS)
    lines = [f"{'check':<{width}}  " + "  ".join(PHASES)]
    for c in CHECKS:
        cells = "  ".join(f"{'x' if ph in c.phases else '-':^{len(ph)}}" for ph in PHASES)
        lines.append(f"{c.name:<{width}}  {cells}".rstrip())
    return "\n".join(lines)


HELP = f"""Run the checks that gate moving WORKFLOW_TYPE (--type) into PHASE and print a checklist:
each check passes or fails with the reason. Exit 1 when any fails. Nothing is written.

PHASE is one of {', '.join(PHASES)}. The checks per target phase:

\b
{_matrix_help()}

Thresholds are in [preflight] (rollback_rehearsal_days, max_backlog_age, max_lag, max_dead_letters,
heartbeat_timeouts) and [gates]."""


@click.command("preflight", help=HELP)
@click.argument("phase")
@click.option("--type", "workflow_type", required=True, envvar="POLLBRIDGE_PREFLIGHT_TYPE", show_envvar=True,
              help="The workflow type to move.")
@click.option("--percent", type=float, default=None, envvar="POLLBRIDGE_PREFLIGHT_PERCENT", show_envvar=True,
              help="selective only: the share of instances the step would give the event path (as `flags set`).")
@JSON_OPTION
@click.pass_context
def preflight(ctx: click.Context, phase: str, workflow_type: str, percent: float | None, as_json: bool) -> None:
    validate_request(workflow_type, phase, percent)  # bad input: exit 2 before reading the configuration
    components = components_of(ctx)
    engine = components.engine()
    try:
        report = components.preflight(engine, workflow_type, phase, percent=percent)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        _print(report)
    sys.exit(0 if report.passed else 1)


def _print(report: PreflightReport) -> None:
    target = describe(Flag(report.workflow_type, report.phase, report.percent))
    if report.current_phase is None:
        current = "unknown phase"
    else:
        current = describe(Flag(report.workflow_type, report.current_phase, report.current_percent))
    click.echo(f"preflight {report.workflow_type}: {current} -> {target}")
    for r in report.results:
        click.echo(f"[{'pass' if r.passed else 'FAIL'}] {r.name}: {r.detail}")
    total = len(report.results)
    if report.passed:
        click.echo(f"ready: {total} of {total} checks passed")
    else:
        names = ", ".join(r.name for r in report.failed)
        click.echo(f"not ready: {len(report.failed)} of {total} checks failed: {names}")
