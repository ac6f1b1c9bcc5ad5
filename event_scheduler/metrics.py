"""The event scheduler's Prometheus metrics, on an injected registry (seconds, low-cardinality labels)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.consumed = Counter("pollbridge_scheduler_consumed", "Bus entries handled", ["workflow_type"],
                                registry=registry)
        self.bus_resets = Counter("pollbridge_scheduler_bus_resets",
                                  "Times the bus's epoch of owned partitions changed (the bus lost their data): "
                                  "those partitions were caught up from the database", registry=registry)
        self.duplicates = Counter("pollbridge_scheduler_duplicate_events",
                                  "Entries whose event id was handled recently (skipped)", registry=registry)
        self.unknown = Counter("pollbridge_scheduler_unknown_events",
                               "Events for an instance with no task (acknowledged, not retried)", registry=registry)
        self.dispatches = Counter("pollbridge_scheduler_dispatches", "Tasks dispatched by the event path",
                                  ["workflow_type", "path"], registry=registry)
        self.decisions = Counter("pollbridge_scheduler_decisions", "Shadow decisions recorded (dual_write)",
                                 ["workflow_type"], registry=registry)
        self.lost_races = Counter("pollbridge_scheduler_lost_races",
                                  "Ready tasks another dispatcher took first", registry=registry)
        self.dead_letters = Counter("pollbridge_scheduler_dead_letters", "Entries moved to the dead-letter store",
                                    ["reason"], registry=registry)
        self.handler_errors = Counter("pollbridge_scheduler_handler_errors",
                                      "Batches whose handling raised (left pending for redelivery)",
                                      registry=registry)
        self.retries = Counter("pollbridge_scheduler_retries", "Failed tasks re-pended after backoff",
                               ["workflow_type"], registry=registry)
        self.timeouts = Counter("pollbridge_scheduler_timeouts", "Running tasks failed for their timeout",
                                ["workflow_type"], registry=registry)
        self.timers_fired = Counter("pollbridge_scheduler_timers_fired", "Timers that fired", ["kind"],
                                    registry=registry)
        self.held_back = Counter("pollbridge_scheduler_held_back",
                                 "Ready tasks held back by a rate limit or in-flight cap (once per task and hold, "
                                 "not per look)", ["workflow_type"],
                                 registry=registry)
        self.parked = Counter("pollbridge_scheduler_parked",
                              "Ready tasks parked in the review queue by a guard (depth or dispatches)",
                              ["workflow_type", "guard"], registry=registry)
        self.lag = Gauge("pollbridge_scheduler_lag", "Bus entries not yet delivered to the group", ["partition"],
                         registry=registry)
        self.partitions_owned = Gauge("pollbridge_scheduler_partitions_owned", "Partitions this process consumes",
                                      registry=registry)
        self.timers_pending = Gauge("pollbridge_scheduler_timers_pending", "Timers waiting", registry=registry)
        self.decision_latency = Histogram("pollbridge_scheduler_decision_seconds",
                                          "Handling time of one batch of bus entries", registry=registry,
                                          buckets=LATENCY_BUCKETS)
        self.ready_to_dispatch = Histogram("pollbridge_ready_to_dispatch_seconds",
                                           "Ready time to dispatch (or decision) time", ["path", "workflow_type"],
                                           registry=registry, buckets=LATENCY_BUCKETS)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0
