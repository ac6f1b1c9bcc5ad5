"""Running the poller as an APScheduler 3 interval job, and stopping it cleanly.

``coalesce`` and ``max_instances=1`` make a slow scan delay the next one instead of stacking
scans; the first scan runs immediately. A scan that raises (database restarting, say) is logged
and the job keeps its schedule: the next interval retries.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

from apscheduler.events import EVENT_JOB_ERROR, JobExecutionEvent
from apscheduler.schedulers.background import BackgroundScheduler

from legacy_poller.poller import LegacyPoller

log = logging.getLogger(__name__)
# A scan that outlasts the interval makes APScheduler skip the next run with a WARNING: that is the
# coalescing this runner asks for, not a problem worth a line every interval.
logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)


class PollerRunner:
    """Owns a background APScheduler that calls ``poller.scan_once`` every ``interval`` seconds."""

    def __init__(self, poller: LegacyPoller, interval: float, on_error: Callable[[BaseException], None] | None = None,
                 *, sweep_interval: float | None = None, scan: bool = True):
        """``sweep_interval``: also run the safety sweep over ``cutover`` types that often; ``scan=False``:
        only the sweep (beside a poller of your own that calls ``pollbridge_poller_should_handle``)."""
        self.poller = poller
        self.interval = interval
        self.errors = 0
        self._on_error = on_error
        self._scheduler = BackgroundScheduler(timezone=UTC)
        if scan:
            self._scheduler.add_job(
                self._scan,
                "interval",
                seconds=interval,
                id="pollbridge-poller-scan",
                max_instances=1,
                coalesce=True,
                next_run_time=datetime.now(UTC),
                misfire_grace_time=None,
            )
        if sweep_interval is not None:
            self._scheduler.add_job(
                self._sweep,
                "interval",
                seconds=sweep_interval,
                id="pollbridge-poller-sweep",
                max_instances=1,
                coalesce=True,
                misfire_grace_time=None,
            )
        self._scheduler.add_listener(self._job_error, EVENT_JOB_ERROR)

    def _scan(self) -> None:
        self.poller.scan_once()

    def _sweep(self) -> None:
        self.poller.sweep_once()

    def _job_error(self, event: JobExecutionEvent) -> None:
        self.errors += 1
        log.error("poller scan failed: %s", event.exception)
        if self._on_error is not None and event.exception is not None:
            self._on_error(event.exception)

    def start(self) -> None:
        self._scheduler.start()

    def stop(self) -> None:
        """Stop scheduling and wait for a scan in progress to finish."""
        if self._scheduler.running:
            self._scheduler.shutdown(wait=True)

    def run_until(self, stop: threading.Event) -> None:
        self.start()
        try:
            stop.wait()
        finally:
            self.stop()
