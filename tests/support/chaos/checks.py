"""The invariant checks at the end of a chaos run, and its report.

SQL over the task table, the dispatch log, the outbox and the audit trail, and
:func:`bridge.reference.oracle.verify` independently, must show no lost trigger, no attempt dispatched twice,
no dispatch before its readiness, every dispatch in the log, no outbox row unpublished, every dead
letter with a reason and every malformed entry dead-lettered (unless Redis lost it afterwards).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from bridge.reference.oracle import Verdict, percentile, verify
from tests.support.chaos.fleet import CLI_FAILURES

if TYPE_CHECKING:
    from tests.support.chaos.engine import Chaos

# --- SQL checks (PostgreSQL, the reference schema) ---------------------------------------------------

#: Tasks neither completed, nor terminally failed, nor pending behind a terminally failed dependency
#: (transitively): each one is a lost trigger once the workload had time to settle.
UNSETTLED_SQL = """
WITH RECURSIVE dead(id, instance_id, task_key) AS (
    SELECT id, instance_id, task_key FROM tasks WHERE status = 'failed' AND attempts >= max_attempts
  UNION
    SELECT t.id, t.instance_id, t.task_key FROM tasks t
    JOIN dead d ON d.instance_id = t.instance_id AND t.depends_on::jsonb ? d.task_key
    WHERE t.status = 'pending'
)
SELECT t.id, t.instance_id, t.task_key, t.status, t.attempts FROM tasks t
WHERE t.status <> 'completed' AND t.id NOT IN (SELECT id FROM dead)
ORDER BY t.id
"""

#: Attempts with more than one row in the dispatch log.
DOUBLE_SQL = """
SELECT task_id, attempt, count(*) FROM pollbridge_dispatch_log GROUP BY task_id, attempt HAVING count(*) > 1
"""

#: Dispatches before the task's due time, before its awaited signal, or before a dependency completed.
EARLY_SQL = """
SELECT l.task_id, l.path, l.dispatched_at FROM pollbridge_dispatch_log l JOIN tasks t ON t.id::text = l.task_id
WHERE (t.due_at IS NOT NULL AND t.due_at > l.dispatched_at)
   OR (t.awaits_signal IS NOT NULL AND (t.signal_received_at IS NULL OR t.signal_received_at > l.dispatched_at))
   OR EXISTS (SELECT 1 FROM tasks d
              WHERE d.instance_id = t.instance_id AND t.depends_on::jsonb ? d.task_key
                AND (d.status <> 'completed' OR d.completed_at IS NULL OR d.completed_at > l.dispatched_at))
"""

#: Every worker claim increments ``attempts`` and every claim follows one dispatch: a task whose
#: attempts differ from its dispatch-log rows was dispatched outside the compare-and-set (or its log row
#: went missing). A rejected task's attempts are set to the maximum without a dispatch.
UNLOGGED_SQL = """
SELECT t.id, t.attempts, coalesce(l.n, 0) FROM tasks t
LEFT JOIN (SELECT task_id, count(*) AS n FROM pollbridge_dispatch_log GROUP BY task_id) l ON l.task_id = t.id::text
WHERE coalesce(l.n, 0) <> t.attempts
  AND t.id::text NOT IN (SELECT task_id FROM pollbridge_signals WHERE kind = 'rejection')
"""

#: Tasks a worker still has to finish, and outbox rows the relay has still to publish (while settling).
LIVE_SQL = "SELECT count(*) FROM tasks WHERE status IN ('queued', 'running')"
UNPUBLISHED_SQL = "SELECT count(*) FROM pollbridge_outbox WHERE published_at IS NULL"


@dataclass
class ChaosReport:
    """What a run did (faults, tasks, dispatches), what the checks found, and the problems (none: ``ok``)."""

    seed: int
    window_s: float
    elapsed_s: float
    faults: Counter[str]
    fault_errors: Counter[str]
    instances: int
    tasks: int
    completed: int
    failed: int
    blocked: int
    dispatches: dict[str, int]
    lost: int
    double: int
    early: int
    unlogged: int
    unpublished: int
    dead_letters: dict[str, int]
    outbox_dead: int
    signals: dict[str, int]
    guardian_demotions: int
    latency_ms: dict[str, dict[str, float | None]]
    load: dict[str, float]
    verdict: Verdict | None
    problems: list[str]
    notes: list[str]
    unexplained: int = 0
    cli_failures: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and self.lost == self.double == self.early == self.unlogged == self.unpublished == 0

    def figure_line(self) -> str:
        faults = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items()))
        paths = ", ".join(f"{k} {n}" for k, n in sorted(self.dispatches.items()))
        dead = ", ".join(f"{k} {n}" for k, n in sorted(self.dead_letters.items())) or "none"
        return (f"chaos figures: seed {self.seed}, {self.window_s:g} s of faults, {sum(self.faults.values())} faults "
                f"({faults}); {self.tasks} tasks in {self.instances} instances ({self.completed} completed, "
                f"{self.failed} failed, {self.blocked} blocked); {sum(self.dispatches.values())} dispatches "
                f"({paths}); lost {self.lost}, double {self.double}, early {self.early}, unlogged {self.unlogged}, "
                f"unpublished {self.unpublished}; dead letters: {dead} (every one with a reason: "
                f"{'NO' if self.unexplained else 'yes'}); "
                f"guardian demotions {self.guardian_demotions}")

    def latency_line(self) -> str:
        parts = [f"{path} p50 {_fmt(v['p50'])} / p99 {_fmt(v['p99'])} / max {_fmt(v['max'])} ms"
                 for path, v in sorted(self.latency_ms.items())]
        return "ready->dispatch under faults: " + ("; ".join(parts) or "none")

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "window_s": self.window_s, "elapsed_s": round(self.elapsed_s, 1),
            "faults": dict(self.faults), "fault_errors": dict(self.fault_errors), "instances": self.instances,
            "tasks": self.tasks, "completed": self.completed, "failed": self.failed, "blocked": self.blocked,
            "dispatches": self.dispatches, "lost": self.lost, "double": self.double, "early": self.early,
            "unlogged": self.unlogged, "unpublished": self.unpublished, "dead_letters": self.dead_letters,
            "outbox_dead": self.outbox_dead, "signals": self.signals, "guardian_demotions": self.guardian_demotions,
            "latency_ms": self.latency_ms, "load": self.load, "problems": self.problems, "notes": self.notes,
            "ok": self.ok, "figure_line": self.figure_line(), "unexplained_dead_letters": self.unexplained,
            "cli_failures_under_faults": self.cli_failures,
        }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def dead_letters(chaos: Chaos, *, settling: bool = False) -> list[dict[str, Any]]:
    """Every dead letter on the bus, as ``pollbridge dlq list --json`` shows them. ``settling``: a look while the run
    settles, asked again until it settles, so a failed run of the command is no problem of the run's."""
    done = chaos.fleet.cli("dlq", "list", "--json", "--limit", "100000")
    if done.returncode != 0:
        if settling:
            return []
        chaos.problems.append(f"`pollbridge dlq list` exited {done.returncode}: {done.stderr.strip()[-300:]}")
        return []
    letters: list[dict[str, Any]] = json.loads(done.stdout)
    return letters


def missing_malformed(chaos: Chaos, letters: list[dict[str, Any]]) -> list[str]:
    """The markers of the malformed entries injected that are no dead letter (yet), those Redis lost after their
    injection aside."""
    payloads = [str(letter.get("payload") or "") for letter in letters]
    injector = chaos.injector
    return [marker for marker, at in injector.malformed
            if not any(marker in p for p in payloads) and not any(loss > at for loss in injector.data_losses)]


def check(chaos: Chaos, settled: bool, elapsed: float) -> ChaosReport:
    """The checks of a finished run (see the module docstring), as a report."""
    injector = chaos.injector
    problems = chaos.problems + chaos.workload.problems
    problems += [f"crash: {c}" for c in chaos.fleet.crashes]
    with chaos.engine.connect() as conn:
        unsettled = conn.execute(sa.text(UNSETTLED_SQL)).all()
        double = conn.execute(sa.text(DOUBLE_SQL)).all()
        early = conn.execute(sa.text(EARLY_SQL)).all()
        unlogged = conn.execute(sa.text(UNLOGGED_SQL)).all()
        unpublished = int(conn.execute(sa.text(UNPUBLISHED_SQL)).scalar_one())
        by_path = {str(k): int(v) for k, v in conn.execute(sa.text(
            "SELECT path, count(*) FROM pollbridge_dispatch_log GROUP BY path")).all()}
        outbox_dead = conn.execute(sa.text("SELECT reason FROM pollbridge_outbox_dead")).scalars().all()
        blank_audit = int(conn.execute(sa.text(
            "SELECT count(*) FROM pollbridge_flag_audit WHERE trim(actor) = '' OR trim(reason) = ''")).scalar_one())
        demotions = int(conn.execute(sa.text(
            "SELECT count(*) FROM pollbridge_flag_audit WHERE action = 'guardian'")).scalar_one())
        verdict = verify(conn, chaos.tables, chaos.workload.instances)
    for row in double[:10]:
        problems.append(f"task {row[0]} attempt {row[1]} dispatched {row[2]} times")
    for row in early[:10]:
        problems.append(f"task {row[0]} dispatched early by {row[1]} at {row[2]}")
    for row in unlogged[:10]:
        problems.append(f"task {row[0]}: {row[1]} attempts but {row[2]} dispatch-log rows")
    if unpublished:
        problems.append(f"{unpublished} outbox row(s) never published")
    if blank_audit:
        problems.append(f"{blank_audit} flag change(s) without an actor or a reason")
    # The independent check must agree with the SQL one.
    if (verdict.lost, verdict.double_dispatched, verdict.early) != (len(unsettled), len(double), len(early)):
        problems.append(f"bridge.reference.oracle disagrees with the SQL checks: verify lost/double/early "
                        f"{verdict.lost}/{verdict.double_dispatched}/{verdict.early}, SQL "
                        f"{len(unsettled)}/{len(double)}/{len(early)}")
    problems += [f"verify: {p}" for p in verdict.problems[:10]]
    if not settled and not unsettled:
        problems.append("the run did not settle (see above)")

    # Dead letters: every one has a reason; every malformed entry is one, unless Redis lost it later.
    letters = dead_letters(chaos)
    kinds: Counter[str] = Counter()
    markers = {m for m, _ in injector.malformed}
    found: set[str] = set()
    unexplained = 0
    for letter in letters:
        reason = str(letter.get("reason") or "").strip()
        payload = str(letter.get("payload") or "")
        if not reason:
            unexplained += 1
            problems.append(f"dead letter {letter.get('id')} has no reason: {payload[:200]}")
        mine = next((m for m in markers if m in payload), None)
        if any(m in payload for m in injector.benign):
            problems.append(f"a well-formed event was dead-lettered ({reason}): {payload[:200]}")
        if mine is not None:
            found.add(mine)
            kinds["malformed"] += 1
        else:
            kinds[reason.split(":")[0][:40] or "no reason"] += 1
    problems += [f"malformed entry {marker} was not dead-lettered" for marker in missing_malformed(chaos, letters)]
    if len(outbox_dead) != injector.outbox_garbage:
        problems.append(f"{injector.outbox_garbage} unpublishable outbox row(s) injected, {len(outbox_dead)} set "
                        "aside by the relay")
    if any(not str(r or "").strip() for r in outbox_dead):
        unexplained += sum(1 for r in outbox_dead if not str(r or "").strip())
        problems.append("an outbox dead letter has no reason")
    if outbox_dead:
        kinds["outbox (relay)"] = len(outbox_dead)

    latency: dict[str, dict[str, float | None]] = {}
    for path, values in verdict.latencies_ms.items():
        latency[path] = {"p50": percentile(values, 50), "p99": percentile(values, 99),
                         "max": max(values) if values else None}
    if chaos.fleet.start_failures:
        chaos.notes.append("starts that failed (restarted like a service manager would): "
                           + "; ".join(chaos.fleet.failure_lines[:5]))
    if chaos.fault_errors:
        chaos.notes.append(f"faults that could not be injected: {dict(chaos.fault_errors)}")
    cli_failures = dict(CLI_FAILURES)
    CLI_FAILURES.clear()
    if cli_failures:
        chaos.notes.append(f"pollbridge commands (flag changes, signals) a fault cut, exit 1, nothing changed: "
                           f"{cli_failures} ('traceback' and 'missing table' are known bugs)")
    loads = chaos.load_samples or [os.getloadavg()[0]]
    return ChaosReport(
        seed=chaos.seed, window_s=chaos.opts.seconds, elapsed_s=elapsed, faults=chaos.faults,
        fault_errors=chaos.fault_errors, instances=len(chaos.workload.instances), tasks=verdict.tasks,
        completed=verdict.completed, failed=verdict.failed, blocked=verdict.blocked, dispatches=by_path,
        lost=len(unsettled), double=len(double), early=len(early), unlogged=len(unlogged),
        unpublished=unpublished, dead_letters=dict(kinds), outbox_dead=len(outbox_dead),
        signals=dict(chaos.workload.signals_sent), guardian_demotions=demotions, latency_ms=latency,
        load={"mean": round(sum(loads) / len(loads), 2), "max": round(max(loads), 2)},
        verdict=verdict, problems=problems, notes=chaos.notes, unexplained=unexplained,
        cli_failures=cli_failures,
    )


