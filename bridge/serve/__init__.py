"""``pollbridge serve``: push at the edges. A signed signal webhook, SSE feeds of task status changes from the bus,
the current status of a task, health and Prometheus metrics (see docs/serve.md)."""

from bridge.serve.app import BackgroundServer, ServeApp, ServeContext, ServeError, resolve_secret

__all__ = ["BackgroundServer", "ServeApp", "ServeContext", "ServeError", "resolve_secret"]
