"""``pollbridge reconcile``: both paths side by side over a window, with the gate verdict per type.

Exit codes: 0 (also when a type fails, unless ``--gate``), 1 with ``--gate`` when any type fails or has
no evidence (verdict ``no_evidence``: no compared task in the window, or no dispatch observed in it: in
``dual_write`` none of the legacy scheduler's), or when the database cannot be read; 2 bad input (an
unparseable time, ``--until`` before ``--since``, a bad type name, a ``--type`` that is no workflow type, an
``--output`` that cannot be written, ``--gate`` with ``--control``), checked before the report is built.

``--control`` measures the legacy poller by the same rules (the noise floor the event path is compared
against): its verdict is ``floor``, never ``pass`` or ``fail``, so ``--gate`` does not apply to it and the
two together are refused rather than exiting 0 as if something had passed.
"""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bridge.cli.common import check_output_path, components_of, write_output
from bridge.core.errors import ConfigError
from bridge.db.clock import db_clock
from bridge.db.engine import check_connection
from bridge.flags.store import validate_type_name
from bridge.reconcile.gate import FAIL, NO_EVIDENCE, gap_detail, require_known_types
from bridge.reconcile.html import render_html
from bridge.reconcile.report import PathShare, Report, TypeReport, build_report, duration_text, parse_when
from bridge.tasktable.tables import reflect_tables

STAGES = 4  # classifying, latency percentiles, histograms, mismatches


@click.command("reconcile")
@click.option("--type", "types", multiple=True, envvar="POLLBRIDGE_RECONCILE_TYPES", show_envvar=True,
              help="Only this workflow type (repeatable) [default: every type].")
@click.option("--since", default="1h", envvar="POLLBRIDGE_RECONCILE_SINCE", show_envvar=True,
              help="Start of the window: a duration ago (30m, 2h, 1d) or an ISO time (UTC unless it says).")
@click.option("--until", default=None, envvar="POLLBRIDGE_RECONCILE_UNTIL", show_envvar=True,
              help="End of the window [default: now].")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "html"]), default="table",
              envvar="POLLBRIDGE_RECONCILE_FORMAT", show_envvar=True, help="Output format.")
@click.option("--output", metavar="FILE", default=None,
              envvar="POLLBRIDGE_RECONCILE_OUTPUT", show_envvar=True, help="Write to this file instead of stdout.")
@click.option("--gate", is_flag=True, envvar="POLLBRIDGE_RECONCILE_GATE", show_envvar=True,
              help="Exit 1 unless every type passes its criteria (a type with no compared task has no evidence). "
                   "Not with --control.")
@click.option("--control", is_flag=True, envvar="POLLBRIDGE_RECONCILE_CONTROL", show_envvar=True,
              help="Measure the legacy poller by the same rules: the noise floor the event path is compared "
                   "against (verdict 'floor', never judged by the promotion gate).")
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=1000, envvar="POLLBRIDGE_RECONCILE_LIMIT",
              show_envvar=True, help="Most mismatches listed.")
@click.pass_context
def reconcile(ctx: click.Context, types: tuple[str, ...], since: str, until: str | None, fmt: str,
              output: str | None, gate: bool, control: bool, limit: int) -> None:
    """Compare what the poller and the event path did for every task that became ready in the window."""
    if gate and control:
        raise ConfigError("--gate does not apply to --control: a control report measures the legacy poller's "
                          "noise floor and is never judged by the promotion gate; gate without --control")
    for name in types:
        validate_type_name(name)
    target = check_output_path(output) if output is not None else None
    components = components_of(ctx)
    settings = components.settings
    engine = components.engine()
    try:
        check_connection(engine)
        now = db_clock(engine)
        start = parse_when(since, now)
        end = parse_when(until, now) if until else now
        if end <= start:
            raise ConfigError(f"--until ({end.isoformat()}) must be after --since ({start.isoformat()})")
        tt = reflect_tables(engine, settings.mapping)
        store = components.flag_store(engine)
        require_known_types(engine, tt, types, store)
        # Each type's own gate thresholds, so the HTML report can say a pass was judged by laxer ones.
        thresholds = {name: dict(flag.thresholds) for name, flag in store.all().items()} if fmt == "html" else {}
        show_progress = fmt == "table" or output is not None
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True, disable=not show_progress) as bar:
            job = bar.add_task("reconciling", total=STAGES)

            def step(what: str) -> None:
                bar.update(job, description=what, advance=0 if what == "classifying" else 1)

            report = build_report(engine, tt, start, end, types=list(types) or None,
                                  settings=settings.gates, control=control, now=now,
                                  mismatch_limit=limit, progress=step)
            bar.update(job, completed=STAGES)
    finally:
        engine.dispose()
    if fmt == "json":
        text = json.dumps(report.to_json(), indent=2)
    elif fmt == "html":
        text = render_html(report, gates=settings.gates, thresholds=thresholds)
    else:
        text = ""
    if target is not None:
        write_output(target, text if fmt != "table" else _table_text(report))
        click.echo(f"report written to {output}: verdict {report.verdict}", err=True)
    elif fmt == "table":
        _print_table(report, Console(width=170))
    else:
        click.echo(text)
    if gate and report.verdict in (FAIL, NO_EVIDENCE):
        click.echo(f"pollbridge: {_gate_failure(report)}", err=True)
        ctx.exit(1)


def _gate_failure(report: Report) -> str:
    """Why ``--gate`` fails, on one line: the types that failed (with their criteria), then those with no evidence."""
    parts = []
    failed = [f"{t.workflow_type} ({', '.join(c.name for c in t.criteria if not c.passed)})"
              for t in report.types if t.verdict == FAIL]
    if failed:
        parts.append(f"gate failed for {'; '.join(failed)}")
    empty = [t for t in report.types if t.verdict == NO_EVIDENCE]
    if empty:
        parts.append("; ".join(f"no evidence for {t.workflow_type} ({t.no_evidence_reason})" for t in empty))
    if not report.types:
        parts.append("no evidence: no workflow type acted in the window")
    text = "; ".join(parts)
    return text if failed else f"gate failed: {text}"


#: The table's count columns (kind, header); the backpressure kinds only when a type has one, so the common
#: report keeps its width.
COUNT_COLUMNS = (("matched", "matched"), ("missing", "missing"), ("extra", "extra"), ("duplicate", "dup"),
                 ("early", "early"), ("late", "late"), ("held", "held"), ("pending", "pending"),
                 ("on_hold", "on hold"))
HOLD_KINDS = ("held", "on_hold")


def _table(report: Report) -> Table:
    title = f"reconcile {report.since:%Y-%m-%d %H:%M:%S} → {report.until:%H:%M:%S}"
    if report.control:
        title += " (control: the legacy poller judged, not the event path)"
    held = any(t.counts.get(k, 0) for t in report.types for k in HOLD_KINDS)
    columns = [(k, label) for k, label in COUNT_COLUMNS if held or k not in HOLD_KINDS]
    table = Table("type", "phase", "tasks", "compared", *(label for _k, label in columns),
                  "poller p50/p99", "events p50/p99", "miss ≤95%", "verdict", title=title)
    for t in report.types:
        c = t.counts

        def lat(path: str, t: TypeReport = t) -> str:
            stats = t.latency_ms.get(path)
            return f"{stats['p50']:.0f}/{stats['p99']:.0f} ms" if stats else "-"

        table.add_row(t.workflow_type, t.phase, str(sum(c.values())), str(t.compared),
                      *(str(c.get(k, 0)) for k, _label in columns),
                      lat("poller"), lat("events"), f"{t.miss_rate_upper:.3%}" if t.compared else "-", t.verdict)
    return table


def share_text(share: PathShare) -> str:
    """One path's floor figures on one line: ``348 of 360 late (96.7%), 0 missing (0.0%), p50 9.7 s``."""
    held = f", {share.held} held by backpressure" if share.held else ""
    p50 = f", p50 {duration_text(share.p50_ms)}" if share.p50_ms is not None else ""
    return (f"{share.late} of {share.judged} late ({share.late_share:.1%}), {share.missing} missing "
            f"({share.missing_share:.1%}){held}{p50}")


def _floor_lines(report: Report) -> list[str]:
    """The noise floor per type: the legacy path's late and missing share beside the event path's."""
    rows = [t for t in report.types if t.floor is not None or t.event_path is not None]
    if not rows:
        return []
    lines = ["noise floor: the legacy poller's late and missing share (as --control judges it) beside the "
             "event path's"]
    width = max(len(t.workflow_type) for t in rows)
    for t in rows:
        legacy = f"poller (floor): {share_text(t.floor)}" if t.floor else "poller (floor): nothing judged"
        events = f"events: {share_text(t.event_path)}" if t.event_path else "events: nothing judged"
        lines.append(f"  {t.workflow_type:<{width}}  {legacy}  |  {events}")
    return lines


def _print_table(report: Report, console: Console) -> None:
    console.print(_table(report))
    for line in _floor_lines(report):
        console.print(line, markup=False, highlight=False)
    for t in report.types:
        if t.verdict == NO_EVIDENCE:
            console.print(f"  {t.workflow_type}: [yellow]no evidence[/yellow]: {t.no_evidence_reason}")
            continue
        for c in t.criteria:
            if not c.passed:
                console.print(f"  {t.workflow_type}: [red]FAIL[/red] {c.name}: {c.detail}")
    if report.mismatches:
        console.print(f"mismatches ({len(report.mismatches)}{'+' if report.mismatches_truncated else ''}):")
        for m in report.mismatches[:20]:
            console.print(f"  {m.kind:<9} {m.workflow_type} task {m.task_id}: {m.detail}", markup=False,
                          highlight=False)
        if len(report.mismatches) > 20:
            console.print("  … (--format json lists them all)")
    if report.capture_gaps:
        console.print(f"capture gaps: {gap_detail(report.capture_gaps)}", markup=False, highlight=False)
    if report.control:
        console.print(f"verdict: {report.verdict} (control: this is the floor the event path is compared against; "
                      "the legacy poller is measured, not judged: no promotion gate applies)", markup=False,
                      highlight=False)
    else:
        console.print(f"verdict: {report.verdict}")


def _table_text(report: Report) -> str:
    import io

    console = Console(width=170, record=True, file=io.StringIO())
    _print_table(report, console)
    return console.export_text()
