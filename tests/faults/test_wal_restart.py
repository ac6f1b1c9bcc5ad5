"""PostgreSQL restarted, cleanly and by a crash, while the write-ahead-log capture streams: every committed
change is captured, none twice under two event ids, and the relay process rides both restarts out.

The database is a private server (tests/support/private_pg.py): restarting the machine's would break every
test running beside this one. Writers update five tasks without pause (each write a new ``attempts`` value and
a new due time, so each commit is one identifiable change), ``pollbridge relay run`` with ``[capture] mode
= "wal"`` streams the slot; mid-run the server is restarted with ``pg_ctl -m fast`` and later with ``-m
immediate`` (a crash: recovery replays the WAL). A write whose commit raised is *uncertain* (it may have
committed before the connection died): it may be captured or not, but a confirmed one must be.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import CaptureSettings
from bridge.db.engine import create_engine
from bridge.db.schema import outbox
from tests.support import start_relay, wait_for
from tests.support.private_pg import PrivatePostgres

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TASKS = 5


def test_restarts_and_a_crash_lose_and_double_nothing(tmp_path: Path) -> None:
    try:
        pg = PrivatePostgres()
    except FileNotFoundError as exc:
        pytest.fail(f"cannot run a private PostgreSQL: {exc} is not installed", pytrace=False)
    pg.start()
    engine = create_engine(pg.url)
    relay = None
    try:
        result = install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings(mode="wal"))
        assert result.capture_installed
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('r', 'orders')"))
            ids = [conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key, depends_on) VALUES "
                                        "('r', :k, '[]') RETURNING id"), {"k": f"t{i}"}).scalar_one()
                   for i in range(TASKS)]
        (tmp_path / "pollbridge.toml").write_text('[capture]\nmode = "wal"\n[bus]\npartitions = 2\n')
        relay = start_relay(tmp_path, pg.url, "embedded")

        confirmed: dict[int, set[int]] = defaultdict(set)
        uncertain: dict[int, set[int]] = defaultdict(set)
        writes = [0]
        stop = threading.Event()

        def writer(task_id: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                status = "queued" if n % 2 else "pending"
                try:
                    with engine.begin() as conn:
                        # A new due time each write: a watched value always changes, so every commit is a change
                        # (a status equal to the last committed one would be an unwatched update after a failed
                        # write, and rightly not captured).
                        conn.execute(sa.text("UPDATE tasks SET status = :s, attempts = :n, due_at = "
                                             "TIMESTAMPTZ '2099-01-01 00:00:00+00' + :n * INTERVAL '1 second' "
                                             "WHERE id = :id"), {"s": status, "n": n, "id": task_id})
                except sa.exc.DBAPIError:
                    uncertain[task_id].add(n)  # the server went away: committed or not, we cannot tell
                    stop.wait(0.05)  # a restart takes a moment; retrying at once only fills the log
                    continue
                confirmed[task_id].add(n)
                writes[0] += 1

        threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in ids]
        for th in threads:
            th.start()

        def more(count: int) -> None:
            target = writes[0] + count
            wait_for(lambda: writes[0] >= target, 60, what=f"{count} more committed writes")

        def captured() -> dict[int, dict[int, set[str]]]:
            out: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
            with engine.connect() as conn:
                query = sa.select(outbox.c.task_id, outbox.c.attempt, outbox.c.event_id).where(
                    outbox.c.change.in_(("status", "due")), outbox.c.published_at.is_not(None))
                for row in conn.execute(query):
                    out[int(row.task_id)][int(row.attempt)].add(row.event_id)
            return out

        def streaming_now() -> None:
            """The capture is live (it caught up with a recent write) when the server goes down under it."""
            with engine.connect() as conn:
                newest = conn.execute(sa.text("SELECT max(attempts) FROM tasks WHERE id = :id"),
                                      {"id": ids[0]}).scalar_one()
            wait_for(lambda: newest in captured()[ids[0]], 30, what="the capture to stream the writes")

        more(200)
        streaming_now()
        more(20)
        pg.restart("fast")
        more(200)
        streaming_now()
        more(20)
        pg.restart("immediate")
        more(200)
        stop.set()
        for th in threads:
            th.join(30)

        def complete() -> bool:
            got = captured()
            return all(confirmed[t] <= set(got[t]) for t in ids)

        try:
            wait_for(complete, 90, interval=0.2, what="every confirmed write to be captured and published")
        except AssertionError:
            got = captured()
            missing = {t: sorted(confirmed[t] - set(got[t])) for t in ids}
            with engine.connect() as conn:
                slot = conn.execute(sa.text("SELECT slot_name, active, confirmed_flush_lsn, restart_lsn, "
                                            "pg_current_wal_lsn() FROM pg_replication_slots")).all()
                unpublished = conn.execute(sa.select(sa.func.count()).select_from(outbox)
                                           .where(outbox.c.published_at.is_(None))).scalar_one()
            raise AssertionError(f"missing per task (first 10 each): { {t: m[:10] for t, m in missing.items()} }; "
                                 f"counts { {t: len(m) for t, m in missing.items()} }; slot {slot}; "
                                 f"unpublished outbox rows {unpublished}") from None
        assert relay.poll() is None, "the relay exited: " + "\n".join(
            p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("relay-*.log"))
        got = captured()
        for t in ids:
            seen = set(got[t])
            assert confirmed[t] <= seen, (t, sorted(confirmed[t] - seen))
            assert seen <= confirmed[t] | uncertain[t], (t, sorted(seen - confirmed[t] - uncertain[t]))
            doubled = {n: e for n, e in got[t].items() if len(e) > 1}
            assert not doubled, f"task {t}: one commit captured under several event ids: {doubled}"
        assert sum(len(v) for v in confirmed.values()) >= 600
    except BaseException:
        print(pg.log())
        for p in tmp_path.glob("relay-*.log"):
            text = p.read_text(errors="replace")
            print(f"--- {p.name}\n" + "\n".join(line[:300] for line in text.splitlines()[-60:]))
        raise
    finally:
        if relay is not None and relay.poll() is None:
            relay.terminate()
            try:
                relay.wait(20)
            except Exception:
                relay.kill()
        engine.dispose()
        pg.stop()
