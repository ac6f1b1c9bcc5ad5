"""The relay's Prometheus metrics, on an injected registry (seconds as the unit)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.backlog = Gauge("pollbridge_outbox_backlog", "Unpublished outbox rows", ["partition"],
                             registry=registry)
        self.oldest_age = Gauge("pollbridge_outbox_oldest_unpublished_age_seconds",
                                "Age of the oldest unpublished outbox row", ["partition"], registry=registry)
        self.published = Counter("pollbridge_relay_published", "Outbox rows published to the bus",
                                 registry=registry)
        self.noticed = Counter("pollbridge_relay_notified_published",
                               "Events published from their capture notification, before the claim marked their rows",
                               registry=registry)
        self.batch_size = Histogram("pollbridge_relay_batch_size", "Rows per published batch", registry=registry,
                                    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000))
        self.publish_latency = Histogram(
            "pollbridge_relay_publish_latency_seconds",
            "Outbox row creation (database clock) to bus acknowledgement, per batch (its oldest row)",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.bus_resets = Counter("pollbridge_relay_bus_resets", "Times the bus was found to have lost data",
                                  registry=registry)
        self.republished = Counter("pollbridge_relay_republished",
                                   "Retained outbox rows queued for republishing after a bus reset",
                                   registry=registry)
        self.dead_letters = Counter("pollbridge_outbox_dead_letters", "Malformed outbox rows set aside",
                                    registry=registry)
        self.purged = Counter("pollbridge_outbox_purged", "Published rows purged after retention",
                              registry=registry)
        self.bus_trimmed = Counter("pollbridge_bus_trimmed", "Bus entries trimmed after retention (read and "
                                   "acknowledged by every group)", registry=registry)
        self.wakeups = Counter("pollbridge_relay_wakeups", "Relay wake-ups by cause", ["cause"], registry=registry)
        self.errors = Counter("pollbridge_relay_errors", "Relay cycles that failed (then retried with backoff)",
                              ["kind"], registry=registry)
        self.paused = Gauge("pollbridge_relay_paused", "1 while publishing is paused for bus memory pressure",
                            registry=registry)
        self.leader = Gauge("pollbridge_relay_leader", "1 while this relay holds its partition", ["partition"],
                            registry=registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0
