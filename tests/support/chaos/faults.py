"""The fault injectors of a chaos run, one per kind, drawn by :class:`tests.support.chaos.engine.Chaos`
from a seeded generator:

============================  ==================================================================
``kill:<role>``               SIGKILL of the relay, a scheduler (sometimes both), the poller, the
                              guardian or the workers, restarted after 0-3 s
``redis:flushall``            ``FLUSHALL`` on the private Redis: every stream, group and dead
                              letter gone
``redis:restart``             the private Redis SIGKILLed and started again empty after 0.5-3 s
``pg:terminate``              ``pg_terminate_backend`` of every connection pollbridge's processes
                              hold on the test database (``datname`` filtered; this harness's own
                              connections are spared by their ``application_name``)
``pg:long_transaction``       a transaction holding row locks on live tasks for 2-6 s, which also
                              records a signal and so commits an outbox row out of id order
``bus:duplicate``             recent (or the oldest) entries of a partition stream added again,
                              shuffled: duplicated, reordered and stale events
``bus:malformed``             entries that are not CloudEvents (no payload field, not UTF-8, not
                              JSON, missing attributes, wrong specversion, bad time, bad depth,
                              non-object data), well-formed events about nothing (an unknown
                              instance, garbage data) and sometimes an outbox row the relay cannot
                              publish
``flags:flip``                ``pollbridge flags set TYPE PHASE [--percent P] --force --reason chaos``
``flags:rollback``            ``pollbridge rollback (TYPE | --all) --reason chaos``
============================  ==================================================================

Every kind is injected at least once (a shuffled round of all of them first, then weighted draws).
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from bridge.bus.keys import BusKeys
from tests.support.chaos.fleet import (
    HARNESS_APP,
    NAMESPACE,
    PARTITIONS,
    ROLES,
    Fleet,
    PrivateCluster,
    PrivateRedis,
    classify_cli_failure,
)
from tests.support.chaos.workload import TYPES, Workload

#: Every kind of fault (see the table above).
KINDS = (
    "kill:relay", "kill:scheduler", "kill:poller", "kill:guardian", "kill:workers",
    "redis:flushall", "redis:restart", "pg:terminate", "pg:long_transaction",
    "bus:duplicate", "bus:malformed", "flags:flip", "flags:rollback",
)
#: Relative weights of the draws after the first round.
WEIGHTS = {
    "kill:relay": 2, "kill:scheduler": 3, "kill:poller": 1, "kill:guardian": 1, "kill:workers": 2,
    "redis:flushall": 1, "redis:restart": 1, "pg:terminate": 2, "pg:long_transaction": 2,
    "bus:duplicate": 2, "bus:malformed": 2, "flags:flip": 3, "flags:rollback": 1,
}
#: Well-formed events that mean nothing (an unknown instance, garbage in ``data``): acknowledged, not dead-lettered.
BENIGN = ("unknown instance", "garbage data")
#: The phases ``flags:flip`` sets.
PHASES = ("polling", "dual_write", "selective", "cutover")


class FaultInjector:
    """Injects one fault at a time (:meth:`inject`) and remembers what the checks need to know: when Redis
    lost data, which malformed (and which merely meaningless) entries were added, how many unpublishable
    outbox rows. A process a fault stopped is started again later by :meth:`run_due`.

    ``rng`` is the run's seeded generator (the draws of the schedule and of each fault's details replay
    together); ``problems`` is the run's list, appended to; ``engine`` is the harness's own (spared by
    ``pg:terminate``); ``db_url`` is the database's URL without it.
    """

    def __init__(self, *, rng: random.Random, db_url: str, engine: Engine, redis: PrivateRedis | PrivateCluster,
                 fleet: Fleet, workload: Workload, say: Callable[[str], None], problems: list[str]) -> None:
        self.rng = rng
        self.db_url = db_url
        self.engine = engine
        self.redis = redis
        self.fleet = fleet
        self.workload = workload
        self.say = say
        self.problems = problems
        self.data_losses: list[float] = []
        self.malformed: list[tuple[str, float]] = []  # (marker, injected at)
        self.benign: list[str] = []  # well-formed events about nothing: acknowledged, never dead letters
        self.outbox_garbage = 0
        self.long_txn: threading.Thread | None = None
        self.pending: list[tuple[float, Callable[[], None]]] = []  # restarts due after a fault's downtime
        self.cli_busy = threading.Event()
        self.cli_thread: threading.Thread | None = None

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + delay, action))

    def run_due(self, everything: bool = False) -> None:
        """Run the restarts whose downtime is over (``everything``: all of them, now)."""
        now = time.monotonic()
        due = [a for a in self.pending if everything or a[0] <= now]
        self.pending = [a for a in self.pending if a not in due]
        for _, action in sorted(due, key=lambda a: a[0]):
            try:
                action()
            except Exception as exc:
                self.problems.append(f"restart after a fault failed: {type(exc).__name__}: {exc}")

    # --- faults ----------------------------------------------------------------------------------------
    def inject(self, kind: str) -> str:
        """Inject one fault of ``kind`` (one of :data:`KINDS`); what was done, for the log."""
        family, _, what = kind.partition(":")
        if family == "kill":
            return self._kill(what)
        handler: Callable[[], str] = {
            "redis:flushall": self._flushall, "redis:restart": self._redis_restart, "pg:terminate": self._terminate,
            "pg:long_transaction": self._long_transaction, "bus:duplicate": self.duplicate,
            "bus:malformed": self.add_malformed, "flags:flip": self._flip, "flags:rollback": self._rollback,
        }[kind]
        return handler()

    def _kill(self, what: str) -> str:
        roles = [r for r in ROLES if r == what or r.startswith(what + "-")]
        if len(roles) > 1 and self.rng.random() >= 0.25:
            roles = [self.rng.choice(roles)]
        downtime = self.rng.uniform(0.0, 3.0)
        pids = [self.fleet.kill(r) for r in roles]
        for r in roles:
            self._later(downtime, lambda r=r: self.fleet.start(r))  # type: ignore[misc]
        return f"SIGKILL {', '.join(f'{r} (pid {p})' for r, p in zip(roles, pids, strict=True))}, " \
               f"restarted in {downtime:.1f} s"

    def _flushall(self) -> str:
        client = self.redis.client()
        try:
            keys = client.dbsize()
            client.flushall()
        finally:
            client.close()
        self.data_losses.append(time.monotonic())
        return f"{keys} keys gone"

    def _redis_restart(self) -> str:
        if not self.redis.running:
            raise RuntimeError("redis-server is down already")
        downtime = self.rng.uniform(0.5, 3.0)
        self.redis.kill()
        self.data_losses.append(time.monotonic())
        self._later(downtime, self.redis.start)
        if isinstance(self.redis, PrivateCluster):
            return (f"a cluster primary ({self.redis.down[-1]}) SIGKILLed, its replica takes over; started again "
                    f"(as a replica) in {downtime:.1f} s")
        return f"redis-server killed, started again empty in {downtime:.1f} s"

    def _terminate(self) -> str:
        with self.engine.connect() as conn:
            killed = conn.execute(sa.text(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                "AND coalesce(application_name, '') NOT LIKE :harness"), {"harness": f"{HARNESS_APP}%"}).scalar_one()
            conn.commit()
        return f"{killed} backend(s) of pollbridge's processes terminated"

    def _long_transaction(self) -> str:
        if self.long_txn is not None and self.long_txn.is_alive():
            self.long_txn.join(10)
        hold = self.rng.uniform(2.0, 6.0)
        rows = self.rng.randint(5, 30)
        signal_task = self.workload.take_signal_task()
        ready = threading.Event()
        info: dict[str, Any] = {}

        def body() -> None:
            url = make_url(self.db_url).set(drivername="postgresql")
            try:
                with psycopg.connect(url.render_as_string(hide_password=False), connect_timeout=10,
                                     application_name=f"{HARNESS_APP}-lock") as conn:
                    locked = conn.execute(
                        "SELECT id FROM tasks WHERE status IN ('pending', 'queued', 'running') "
                        "ORDER BY random() LIMIT %s FOR UPDATE", (rows,)).fetchall()
                    info["locked"] = len(locked)
                    if signal_task is not None:
                        # A signal recorded by the legacy side in this long transaction: its outbox row gets
                        # its id now and commits seconds later, after many larger ids were published.
                        info["signalled"] = conn.execute(
                            "UPDATE tasks SET signal_received_at = clock_timestamp(), updated_at = clock_timestamp() "
                            "WHERE id = %s AND status = 'pending' AND signal_received_at IS NULL",
                            (signal_task,)).rowcount
                    ready.set()
                    time.sleep(hold)
                info["committed"] = True
            except Exception as exc:
                info["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                ready.set()
                if signal_task is not None and not (info.get("committed") and info.get("signalled")):
                    self.workload.give_back(signal_task)  # not recorded here: the signaller sends it

        self.long_txn = threading.Thread(target=body, name="chaos-long-transaction", daemon=True)
        self.long_txn.start()
        ready.wait(30)
        if "error" in info:
            raise RuntimeError(info["error"])
        extra = f", signal of task {signal_task} recorded in it" if info.get("signalled") else ""
        return f"{info.get('locked', 0)} task rows locked for {hold:.1f} s{extra}"

    def duplicate(self) -> str:
        client = self.redis.client()
        try:
            partition = self.rng.randrange(PARTITIONS)
            stream = f"{NAMESPACE}:events:{{{NAMESPACE}:p{partition}}}"
            stale = self.rng.random() < 0.3
            count = self.rng.randint(5, 40)
            entries = client.xrange(stream, count=count) if stale else client.xrevrange(stream, count=count)
            picked = [fields for _, fields in entries if b"payload" in fields]
            # Each entry once or twice, in a shuffled order.
            picked += [f for f in picked if self.rng.random() < 0.5]
            self.rng.shuffle(picked)
            pipe = client.pipeline(transaction=False)
            for fields in picked:
                pipe.xadd(stream, fields)
            pipe.execute()
            self._ring(client, [partition])
        finally:
            client.close()
        return f"{len(picked)} {'oldest' if stale else 'recent'} entries of partition {partition} added again, shuffled"

    def add_malformed(self, final: bool = False) -> str:
        client = self.redis.client()
        made: list[str] = []
        try:
            pipe = client.pipeline(transaction=False)
            rung: list[int] = []
            benign: list[str] = []
            malformed: list[str] = []
            for n in range(self.rng.randint(1, 4) + (2 if final else 0)):
                marker = f"chaos-malformed-{uuid.uuid4().hex[:12]}"
                partition = self.rng.randrange(PARTITIONS)
                stream = f"{NAMESPACE}:events:{{{NAMESPACE}:p{partition}}}"
                variant, fields = self._malformed_entry(marker, harmful=final and n < 2)
                pipe.xadd(stream, fields)
                rung.append(partition)
                made.append(variant)
                (benign if variant in BENIGN else malformed).append(marker)
            pipe.execute()
            # Counted as injected only once Redis took them: an injection that failed (Redis restarting) was counted,
            # and its entries, never written, were then "not dead-lettered" (found by seed 134048612).
            at = time.monotonic()
            self.benign += benign
            self.malformed += [(marker, at) for marker in malformed]
            self._ring(client, rung)
        finally:
            client.close()
        if self.rng.random() < 0.3:  # and an outbox row the relay cannot turn into an event
            with self.engine.begin() as conn:
                conn.execute(sa.text(
                    "INSERT INTO pollbridge_outbox (event_id, task_id, instance_id, task_key, change, old_status, "
                    "new_status, created_at, relay_partition) VALUES (:e, NULL, 'chaos-ghost', 'k', 'status', "
                    "'pending', 'no-such-status', clock_timestamp(), 0)"), {"e": str(uuid.uuid4())})
            self.outbox_garbage += 1
            made.append("unpublishable outbox row")
        return ", ".join(made)

    def _ring(self, client: Any, partitions: list[int]) -> None:
        """On a cluster, ring the bus's doorbell as a pollbridge publish does (its readers wait on it, not on the
        streams: see bridge/bus/redis_streams.py); a single server's readers block on the streams themselves."""
        if isinstance(self.redis, PrivateCluster) and partitions:
            client.xadd(BusKeys(NAMESPACE).wake, {"p": ",".join(map(str, sorted(set(partitions))))})

    def _malformed_entry(self, marker: str, harmful: bool = False) -> tuple[str, dict[str, Any]]:
        instance = self.rng.choice(self.workload.instances) if self.workload.instances else "none"
        base = {"specversion": "1.0", "id": marker, "source": "chaos", "type": "task.status_changed",
                "subject": "1", "time": "2024-01-01T00:00:00Z", "partitionkey": instance, "data": {}}
        variants: list[tuple[str, dict[str, Any]]] = [
            ("no payload field", {"id": marker, "junk": "x"}),
            ("not UTF-8", {"id": marker, "payload": b"\xff\xfe\xfa" + marker.encode()}),
            ("not JSON", {"id": marker, "payload": "{not json " + marker}),
            ("JSON array", {"id": marker, "payload": json.dumps([marker])}),
            ("missing attributes", {"id": marker, "payload": json.dumps({"specversion": "1.0", "id": marker})}),
            ("wrong specversion", {"id": marker, "payload": json.dumps({**base, "specversion": "0.3"})}),
            ("bad time", {"id": marker, "payload": json.dumps({**base, "time": "yesterday"})}),
            ("negative depth", {"id": marker, "payload": json.dumps({**base, "depth": -1})}),
            ("data not an object", {"id": marker, "payload": json.dumps({**base, "data": [1, 2]})}),
            ("unknown instance", {"id": marker, "payload": json.dumps({**base, "partitionkey": f"ghost-{marker}"})}),
            ("garbage data", {"id": marker, "payload": json.dumps(
                {**base, "data": {"task_key": 12, "change": "status", "new_status": None, "workflow_type": []}})}),
        ]
        return self.rng.choice([v for v in variants if v[0] not in BENIGN] if harmful else variants)

    def _cli_fault(self, kind: str, args: list[str]) -> str:
        """Run a ``pollbridge`` command on the CLI thread (starting Python takes seconds under load); its
        outcome is printed when it finished (see :func:`classify_cli_failure` for a failed one)."""
        if self.cli_busy.is_set():
            raise RuntimeError("the previous flag command is still running")
        self.cli_busy.set()

        def body() -> None:
            try:
                done = self.fleet.cli(*args)
                if done.returncode != 0 and classify_cli_failure(done.returncode, done.stderr) is None:
                    self.problems.append(f"`pollbridge {' '.join(args)}` exited {done.returncode}: "
                                         f"{done.stderr.strip()[-400:]}")
                out = "; ".join(done.stdout.strip().splitlines()) or done.stderr.strip().splitlines()[-1:]
                self.say(f"  {kind} done (exit {done.returncode}): {out}")
            except Exception as exc:
                self.problems.append(f"`pollbridge {' '.join(args)}` failed: {type(exc).__name__}: {exc}")
            finally:
                self.cli_busy.clear()

        self.cli_thread = threading.Thread(target=body, name="chaos-cli", daemon=True)
        self.cli_thread.start()
        return "pollbridge " + " ".join(args)

    def _flip(self) -> str:
        workflow_type = self.rng.choice(TYPES)
        # Mostly towards the event path: rollbacks and the guardian pull the other way.
        phase = self.rng.choices(PHASES, (1, 1, 2, 3))[0]
        args = ["flags", "set", workflow_type, phase, "--force", "--reason", "chaos", "--actor", "chaos"]
        if phase == "selective" and self.rng.random() < 0.6:
            args += ["--percent", self.rng.choice(("10", "50", "90", "33.33"))]
        return self._cli_fault("flags:flip", args)

    def _rollback(self) -> str:
        target = ["--all"] if self.rng.random() < 0.3 else [self.rng.choice(TYPES)]
        return self._cli_fault("flags:rollback", ["rollback", *target, "--reason", "chaos rollback",
                                                  "--actor", "chaos"])

