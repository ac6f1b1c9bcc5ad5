"""The reference polling scheduler.

It stands for the user's existing scheduler in the demo, the tests and the benchmarks: an
APScheduler interval job that scans the task table for ready tasks and dispatches each with the
shared compare-and-set. After cutover it is also what remains as the fallback sweeper.
"""

from __future__ import annotations

from legacy_poller.poller import LegacyPoller, ScanResult

__all__ = ["LegacyPoller", "ScanResult"]
