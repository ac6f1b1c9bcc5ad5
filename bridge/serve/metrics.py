"""``pollbridge serve``'s own Prometheus metrics, beside the status gauges of
:class:`bridge.reconcile.status.StatusCollector`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine

from bridge.db.engine import db_ago, millis_between, read_only
from bridge.db.schema import dispatch_log
from bridge.serve.sse import Hub

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the windowed ready->dispatch latency buckets; +Inf is added.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

SIGNAL_OUTCOMES = ("accepted", "unauthorized", "refused", "error")


class ServeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.signals = Counter("pollbridge_serve_signals", "Signal webhook requests by outcome (accepted: 202; "
                               "unauthorized: 401; refused: other 4xx/503; error: 500)", ["outcome"],
                               registry=registry)
        self.signal_seconds = Histogram("pollbridge_serve_signal_seconds", "Handling time of accepted signals",
                                        registry=registry,
                                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.sse_events = Counter("pollbridge_serve_sse_events", "Events sent to SSE clients", registry=registry)
        self.sse_dropped = Counter("pollbridge_serve_sse_dropped", "SSE clients dropped because their buffer "
                                   "filled (too slow or vanished)", registry=registry)
        self.sse_connections = Counter("pollbridge_serve_sse_connections", "SSE streams opened, by stream kind "
                                       "and whether they resumed with Last-Event-ID", ["stream", "resumed"],
                                       registry=registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


class HubCollector(Collector):
    """The SSE hub's state, read at each scrape."""

    def __init__(self, hub: Callable[[], Hub | None]) -> None:
        self._hub = hub

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        hub = self._hub()
        if hub is None:
            return
        clients = GaugeMetricFamily("pollbridge_serve_sse_clients", "Connected SSE clients by stream kind",
                                    labels=["stream"])
        for kind, n in sorted(hub.stats.clients.items()):
            clients.add_metric([kind], n)
        yield clients
        yield GaugeMetricFamily("pollbridge_serve_bus_reader_up", "1 when the SSE bus reader's last read succeeded",
                                value=1 if hub.healthy and hub.running else 0)
        yield GaugeMetricFamily("pollbridge_serve_bus_reader_last_read_timestamp_seconds",
                                "Unix time of the SSE bus reader's last successful read", value=hub.stats.last_read_at)
        yield CounterMetricFamily("pollbridge_serve_bus_reader_entries", "Bus entries the SSE bus reader read "
                                  "(tail: no consumer group)", value=hub.stats.entries_read)
        yield CounterMetricFamily("pollbridge_serve_bus_reader_failures", "Failed reads of the SSE bus reader",
                                  value=hub.stats.failures)


class LatencyCollector(Collector):
    """Ready->dispatch latency of **every** path (poller, events, fallback) from the dispatch log, over the last
    ``window`` seconds, as a *gauge histogram* ``pollbridge_dispatch_latency_window_seconds{workflow_type, path}``:
    ``_bucket{le}`` (cumulative counts per upper bound), ``_gcount`` and ``_gsum``. A gauge histogram (OpenMetrics
    ``gaugehistogram``; ``histogram`` in the Prometheus text format, with the ``_gcount``/``_gsum`` gauges) because
    the counts go down as dispatches leave the window: ``histogram_quantile`` applies to the buckets as they are,
    ``rate`` does not.

    The event path's own histogram (``pollbridge_ready_to_dispatch_seconds``) exists only in the scheduler; the
    poller keeps none, so this is the one place both paths are measured the same way. One aggregate query per
    scrape, bounded by the dispatch log's time index."""

    def __init__(self, engine: Engine, window: float) -> None:
        self._engine = engine
        self._window = window

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeHistogramMetricFamily]:
        dialect = self._engine.dialect.name
        d = dispatch_log.c
        latency = millis_between(dialect, d.ready_at, d.dispatched_at) / 1000.0
        buckets = [sa.func.sum(sa.case((latency <= b, 1), else_=0)) for b in LATENCY_BUCKETS]
        query = (sa.select(d.workflow_type, d.path, sa.func.count(), sa.func.sum(latency),
                           *buckets)
                 .where(d.dispatched_at >= db_ago(dialect, self._window), d.ready_at.is_not(None))
                 .group_by(d.workflow_type, d.path))
        try:
            with read_only(self._engine).connect() as conn:
                rows = conn.execute(query).all()
                conn.rollback()
        except Exception as exc:  # the status gauges already say the database is down
            log.debug("latency gathering failed: %s", exc)
            return
        latencies = GaugeHistogramMetricFamily(
            "pollbridge_dispatch_latency_window_seconds",
            "Ready->dispatch latency of the dispatches with a known ready time in the last window "
            "(pollbridge_status_window_seconds), by path; a gauge histogram: counts leave with the window",
            labels=["workflow_type", "path"])
        for row in rows:
            workflow_type, path, n, summed = str(row[0] or ""), str(row[1]), int(row[2]), float(row[3] or 0.0)
            counts = [(_le(bound), float(hits or 0)) for bound, hits in zip(LATENCY_BUCKETS, row[4:], strict=True)]
            latencies.add_metric([workflow_type, path], [*counts, ("+Inf", float(n))], gsum_value=summed)
        yield latencies


def _le(bound: float) -> str:
    return repr(float(bound))
