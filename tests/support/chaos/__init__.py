"""The fault-injection engine behind ``tests/faults/test_chaos.py`` and ``python -m bench.faults``.

What runs: a private ``redis-server`` (no persistence, its own port, so it can be flushed and restarted
without touching anybody else's data) and, each as its own process group, ``pollbridge relay run``, two
``pollbridge scheduler run``, ``pollbridge poller run``, ``pollbridge guardian run`` and ``pollbridge
workers run`` on one PostgreSQL database. This process plays the users of the platform: it seeds a
mixed workload (four workflow types; chains, fan-out/fan-in and stacked diamonds; due times; tasks that
await a callback or an approval, signalled later, some rejected; workers that fail 15% of the attempts,
so tasks are retried), and injects faults at random moments, drawn from a seeded generator whose seed
is printed (the schedule of faults replays; the timing of the processes around them does not);
the kinds and what each does are listed in :mod:`tests.support.chaos.faults`.

Every kind is injected at least once (a shuffled round of all of them first, then weighted draws).
When the fault window ends every process is brought back, the remaining signals are sent and the
workload must settle; then SQL over the task table, the dispatch log, the outbox and the audit trail,
and :func:`bridge.reference.oracle.verify` independently, must show no lost trigger, no attempt dispatched twice,
no dispatch before its readiness, every dispatch in the log, no outbox row unpublished, every dead
letter with a reason and every malformed entry dead-lettered (unless Redis lost it afterwards).

Modules: :mod:`.fleet` (the processes it starts: the private Redis, the pollbridge fleet, their
configuration), :mod:`.workload` (the users: instances seeded, signals sent), :mod:`.faults` (the fault
injectors), :mod:`.checks` (the invariant checks and the report) and :mod:`.engine` (the run that ties
them together).
"""

from __future__ import annotations

from tests.support.chaos.checks import ChaosReport
from tests.support.chaos.engine import ChaosOptions, run_chaos
from tests.support.chaos.faults import KINDS
from tests.support.chaos.fleet import log_tails, new_workdir

__all__ = ["KINDS", "ChaosOptions", "ChaosReport", "log_tails", "new_workdir", "run_chaos"]
