"""A chaos run from start to end: the fleet up, the workload seeded, faults until the window ends, every
process back, the workload settled, then the checks (see :mod:`tests.support.chaos`)."""

from __future__ import annotations

import os
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.db.schema import dispatch_log
from bridge.flags.store import FlagStore
from bridge.tasktable.tables import reflect_tables
from tests.support.chaos.checks import (
    LIVE_SQL,
    UNPUBLISHED_SQL,
    UNSETTLED_SQL,
    ChaosReport,
    check,
    dead_letters,
    missing_malformed,
)
from tests.support.chaos.faults import KINDS, WEIGHTS, FaultInjector
from tests.support.chaos.fleet import (
    CONFIG,
    HARNESS_APP,
    NAMESPACE,
    PARTITIONS,
    ROLES,
    Fleet,
    PrivateCluster,
    PrivateRedis,
    tail,
)
from tests.support.chaos.workload import Workload


@dataclass
class ChaosOptions:
    """What to run: the database (pollbridge installed, the reference schema), for how long, how hard."""

    db_url: str
    workdir: Path
    seconds: float = 60.0
    seed: int | None = None
    rate: float = 2.0                 # instances seeded per second during the window
    initial_instances: int = 40
    fault_gap: tuple[float, float] = (1.0, 3.0)
    warmup: float = 3.0
    settle_timeout: float = 120.0
    retention: float = 3600.0         # the relay's retention window (bus-loss replay)
    bus: str = "redis"                # or "redis-cluster": a private 3+3 cluster, its faults kill a primary
    progress_every: float = 30.0
    cli_signal_every: int = 12        # one signal in this many through `pollbridge signal`
    say: Callable[[str], None] = field(default=print)


class Chaos:
    """One run: starts everything, draws the faults (:class:`FaultInjector` injects them), settles, checks."""

    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        self.seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1, 10**9)
        self.rng = random.Random(self.seed)
        self.t0 = time.monotonic()
        self.workdir = opts.workdir
        self.faults: Counter[str] = Counter()
        self.fault_errors: Counter[str] = Counter()
        self.notes: list[str] = []
        self.problems: list[str] = []
        self.load_samples: list[float] = []
        self.redis: PrivateRedis | PrivateCluster = (
            PrivateCluster(self.workdir) if opts.bus == "redis-cluster" else PrivateRedis(self.workdir))

    # --- output ------------------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        self.opts.say(f"[{time.monotonic() - self.t0:7.1f}s] {message}")

    # --- the run -------------------------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        opts = self.opts
        self.say(f"chaos: seed {self.seed} (set it again to replay the fault schedule), {opts.seconds:g} s of "
                 f"faults, logs in {self.workdir}")
        (self.workdir / "pollbridge.toml").write_text(CONFIG.format(
            namespace=NAMESPACE, partitions=PARTITIONS, retention=opts.retention))
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
        env.update({"POLLBRIDGE_DATABASE_URL": opts.db_url, "POLLBRIDGE_BUS_URL": self.redis.url,
                    "POLLBRIDGE_LOG_LEVEL": "INFO", "POLLBRIDGE_ACTOR": "chaos"})
        self.env = env
        sep = "&" if "?" in opts.db_url else "?"
        self.engine = create_engine(f"{opts.db_url}{sep}application_name={HARNESS_APP}")
        self.fleet = Fleet(self.workdir, env, self.say)
        threads: list[threading.Thread] = []
        workload: Workload | None = None
        injector: FaultInjector | None = None
        try:
            self.redis.start()
            self.tables = reflect_tables(self.engine, TaskTableMapping())
            store = FlagStore(self.engine)
            for workflow_type, phase, percent in (("orders", "cutover", None), ("reports", "selective", 50.0),
                                                  ("etl", "dual_write", None), ("billing", "polling", None)):
                store.change(workflow_type, phase, actor="chaos", reason="chaos: initial phases", percent=percent,
                             forced=True)
            workload = self.workload = Workload(self.engine, self.tables, opts, env, self.workdir, self.seed)
            injector = self.injector = FaultInjector(
                rng=self.rng, db_url=opts.db_url, engine=self.engine, redis=self.redis, fleet=self.fleet,
                workload=workload, say=self.say, problems=self.problems)
            for role in ROLES:
                self.fleet.start(role)
            self.fleet.wait_ready(list(ROLES))
            self.fleet.ensure_all_up()
            self.say("fleet up: " + ", ".join(f"{r} pid {p.pid}" for r, p in self.fleet.procs.items()))
            workload.seed_batch(opts.initial_instances)
            started = time.monotonic()
            window_end = started + opts.warmup + opts.seconds
            threads = [threading.Thread(target=workload.seeder, args=(window_end,), name="chaos-seeder",
                                        daemon=True),
                       threading.Thread(target=workload.signaller, name="chaos-signaller", daemon=True)]
            for t in threads:
                t.start()
            self._fault_loop(started + opts.warmup, window_end)
            self._recover()
            settled = self._settle()
            codes = self.fleet.stop_all()
            for role, code in codes.items():
                if self.fleet.procs[role].pid not in self.fleet.killed and code != 0:
                    self.problems.append(f"{role} exited with {code} on SIGTERM: {tail(self.fleet.logs[role], 5)}")
            workload.stop.set()
            for t in threads:
                t.join(30)
            return check(self, settled, time.monotonic() - started)
        finally:
            if workload is not None:
                workload.stop.set()
            self.fleet.kill_all()
            self.redis.stop()
            if injector is not None and injector.long_txn is not None:
                injector.long_txn.join(15)
            self.engine.dispose()

    def _fault_loop(self, first: float, end: float) -> None:
        """Inject faults until ``end``. Nothing here waits for a process to come back: restarts are
        queued (:meth:`FaultInjector.run_due`) and CLI faults run on a thread, so faults keep coming at their pace
        even when starting a Python process takes seconds on a loaded machine."""
        schedule = list(KINDS)
        self.rng.shuffle(schedule)
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        next_progress = time.monotonic() + self.opts.progress_every
        wait_until = first
        while True:
            while time.monotonic() < wait_until:
                self.injector.run_due()
                self.fleet.supervise()
                time.sleep(0.05)
            if time.monotonic() >= end:
                return
            kind = schedule.pop(0) if schedule else self.rng.choices(kinds, weights)[0]
            try:
                detail = self.injector.inject(kind)
                self.faults[kind] += 1
                self.say(f"fault {kind}: {detail}")
            except Exception as exc:
                self.fault_errors[kind] += 1
                self.say(f"fault {kind} could not be injected now ({type(exc).__name__}: {exc}); later again")
                if kind not in self.faults:
                    schedule.append(kind)  # every kind is injected at least once
            self.injector.run_due()
            self.fleet.supervise()
            self.load_samples.append(os.getloadavg()[0])
            if time.monotonic() >= next_progress:
                next_progress = time.monotonic() + self.opts.progress_every
                self.say(self._progress())
            wait_until = time.monotonic() + self.rng.uniform(*self.opts.fault_gap)

    def _progress(self) -> str:
        with self.engine.connect() as conn:
            by_path = {str(k): int(v) for k, v in conn.execute(
                sa.select(dispatch_log.c.path, sa.func.count()).group_by(dispatch_log.c.path)).all()}
            unpublished = conn.execute(sa.text(UNPUBLISHED_SQL)).scalar_one()
        return (f"progress: {sum(self.faults.values())} faults, {self.workload.tasks} tasks seeded, dispatches "
                f"{dict(sorted(by_path.items()))}, {unpublished} outbox rows unpublished, "
                f"load {os.getloadavg()[0]:.1f}")

    # --- the end -----------------------------------------------------------------------------------------
    def _recover(self) -> None:
        self.say("fault window over: every process back, remaining signals sent")
        injector = self.injector
        injector.run_due(everything=True)
        if injector.cli_thread is not None:
            injector.cli_thread.join(120)
        if not self.redis.running:
            self.redis.start()
        if injector.long_txn is not None:
            injector.long_txn.join(15)
        self.fleet.ensure_all_up()
        self.workload.seeding_stopped.wait(30)
        self.workload.flush_signals.set()
        # One more round of bad and repeated entries after the last data loss, so the dead-letter and
        # duplicate checks always have something to check.
        final: list[tuple[str, Callable[[], str]]] = [("bus:malformed", lambda: injector.add_malformed(final=True)),
                                                      ("bus:duplicate", injector.duplicate)]
        for kind, inject in final:
            try:
                detail = inject()
                self.faults[kind] += 1
                self.say(f"fault {kind} (after the window): {detail}")
            except Exception as exc:
                self.problems.append(f"the final {kind} could not be injected: {type(exc).__name__}: {exc}")

    def _settle(self) -> bool:
        deadline = time.monotonic() + self.opts.settle_timeout
        next_say = time.monotonic() + 10
        while True:
            self.fleet.supervise()
            with self.engine.connect() as conn:
                unsettled = conn.execute(sa.text(UNSETTLED_SQL)).all()
                live = conn.execute(sa.text(LIVE_SQL)).scalar_one()
                unpublished = conn.execute(sa.text(UNPUBLISHED_SQL)).scalar_one()
            with self.workload.lock:
                signals_left = len(self.workload.pending_signals)
            # The malformed entries injected last are read by a scheduler that may still be taking its partitions
            # after the window's kills: asked (a CLI run) only once everything else has settled.
            malformed = len(missing_malformed(self, dead_letters(self, settling=True))) if (
                not unsettled and not live and not unpublished and not signals_left) else None
            if malformed == 0:
                self.say("settled: every task finished, every outbox row published, every malformed entry "
                         "dead-lettered")
                return True
            left = "" if malformed is None else f", {malformed} malformed entries not dead-lettered yet"
            now = time.monotonic()
            if now > deadline:
                sample = ", ".join(f"{r.id} ({r.instance_id}/{r.task_key} {r.status}, attempts {r.attempts})"
                                   for r in unsettled[:10])
                self.problems.append(f"not settled after {self.opts.settle_timeout:g} s: {len(unsettled)} task(s) "
                                     f"unsettled ({sample}), {live} queued/running, {unpublished} unpublished, "
                                     f"{signals_left} signals unsent{left}")
                return False
            if now >= next_say:
                next_say = now + 10
                self.say(f"settling: {len(unsettled)} unsettled, {live} queued/running, {unpublished} unpublished, "
                         f"{signals_left} signals to send{left}")
            time.sleep(0.5)


def run_chaos(opts: ChaosOptions) -> ChaosReport:
    """Run the whole scenario (see the module docstring); every process it started is gone when it returns."""
    chaos = Chaos(opts)
    try:
        return chaos.run()
    except BaseException:
        chaos.say("chaos run failed:\n" + traceback.format_exc())
        raise


