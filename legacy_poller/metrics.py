"""The poller's Prometheus metrics, registered on an injected registry (seconds as the unit)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class PollerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.scans = Counter("pollbridge_poller_scans", "Scans of the task table by the poller", registry=registry)
        self.empty_scans = Counter(
            "pollbridge_poller_empty_scans", "Scans that found no ready task", registry=registry
        )
        self.rows_examined = Counter(
            "pollbridge_poller_rows_examined",
            "Pending rows the readiness condition was evaluated on",
            registry=registry,
        )
        self.dispatches = Counter(
            "pollbridge_poller_dispatches", "Tasks the poller dispatched", ["path"], registry=registry
        )
        self.lost_races = Counter(
            "pollbridge_poller_lost_races",
            "Ready tasks another dispatcher took first (compare-and-set lost)",
            registry=registry,
        )
        self.retries = Counter(
            "pollbridge_poller_repended", "Failed tasks with attempts left put back to pending", registry=registry
        )
        self.timeouts = Counter(
            "pollbridge_poller_timeouts", "Tasks running longer than [poller] running_timeout, failed",
            registry=registry,
        )
        self.held_back = Counter(
            "pollbridge_poller_held_back",
            "Ready tasks the poller left for a later scan because their type's rate or in-flight cap was reached",
            ["workflow_type"], registry=registry)
        self.sweeps = Counter("pollbridge_poller_sweeps", "Safety sweeps over cutover types", registry=registry)
        self.fallback_misses = Counter(
            "pollbridge_fallback_misses",
            "Tasks the poller dispatched because the event path had not within the grace period",
            ["workflow_type"],
            registry=registry,
        )
        self.types_left_out = Gauge(
            "pollbridge_poller_types_left_out", "Workflow types in cutover, left out of the regular scan",
            registry=registry,
        )
        self.scan_seconds = Histogram(
            "pollbridge_poller_scan_seconds",
            "Duration of one scan, dispatches included",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when never incremented)."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
