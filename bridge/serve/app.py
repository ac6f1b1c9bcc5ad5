"""The ASGI application of ``pollbridge serve`` (Starlette) and a uvicorn server to run it.

Routes (``docs/serve.md`` has the details):

* ``POST /signals/{task_id}``: a signed webhook (:mod:`bridge.serve.auth`) for external callbacks and
  human approvals/rejections, recorded through the same internal path as ``pollbridge signal``;
  ``202`` with the event id.
* ``GET /instances/{id}/events``, ``GET /types/{workflow_type}/events``: Server-Sent Events of task
  status changes, fed from the bus (:mod:`bridge.serve.sse`), resumable with ``Last-Event-ID``.
* ``GET /tasks/{id}``: the task's current status.
* ``GET /healthz``: 200 when the database answers and the SSE bus reader reads, else 503 saying why.
* ``GET /metrics``: Prometheus: everything ``pollbridge status`` shows plus the service's own metrics.

Errors are JSON: ``{"error": "<code>", "message": "<one line>"}``. Blocking work (the database, the bus)
runs in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bridge.bus.base import EventBus
from bridge.core.errors import ConfigError, PollbridgeError, first_line
from bridge.core.settings import Settings
from bridge.core.urls import mask_url
from bridge.db.engine import check_connection
from bridge.flags.store import FlagStore
from bridge.reconcile.status import DEFAULT_WINDOW, StatusCollector, gather_status
from bridge.serve.auth import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureVerifier, TooManyRequests, Unauthorized
from bridge.serve.metrics import HubCollector, LatencyCollector, ServeMetrics
from bridge.serve.sse import CursorError, Filter, Hub, event_stream, parse_cursor, stream_headers
from bridge.serve.tasks import MAX_BODY, RequestError, accept_signal, parse_signal_body, task_status
from bridge.tasktable.tables import TaskTable

log = logging.getLogger(__name__)

ENV_SIGNAL_SECRET = "POLLBRIDGE_SIGNAL_SECRET"
MIN_SECRET = 16


class ServeError(PollbridgeError):
    """The service cannot start (address in use, ...). Exit 1."""


def resolve_secret(settings: Settings, environ: Mapping[str, str] | None = None) -> str | None:
    """The webhook secret: ``POLLBRIDGE_SIGNAL_SECRET`` if set, else ``serve.signal_secret``, else none."""
    env = os.environ if environ is None else environ
    secret = env.get(ENV_SIGNAL_SECRET) or settings.serve.signal_secret
    if secret is not None and len(secret) < MIN_SECRET:
        raise ConfigError(f"{ENV_SIGNAL_SECRET} must be at least {MIN_SECRET} characters")
    return secret


@dataclass
class ServeContext:
    """What the application needs; the caller owns (and closes) the engine and the bus."""

    settings: Settings
    engine: Engine
    tables: TaskTable
    bus: EventBus | None
    secret: str | None
    bus_label: str = "embedded"
    bus_error: str | None = None
    window: float = DEFAULT_WINDOW
    #: The flag store ``/metrics`` reads (from the composition root); ``None``: the status gathering's default.
    store: FlagStore | None = None


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status)


class ServeApp:
    """Builds the Starlette application; ``hub``, ``metrics`` and ``verifier`` are here for tests and the CLI."""

    def __init__(self, context: ServeContext, *, registry: CollectorRegistry | None = None) -> None:
        self.context = context
        serve = context.settings.serve
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ServeMetrics(self.registry)
        self.hub: Hub | None = None
        if context.bus is not None:
            self.hub = Hub(context.bus, buffer_size=serve.sse_buffer,
                           on_drop=lambda _sub: self.metrics.sse_dropped.inc())
        self.verifier = SignatureVerifier(context.secret, serve.max_clock_skew) if context.secret else None
        self.registry.register(HubCollector(lambda: self.hub))
        self.registry.register(StatusCollector(self._gather))
        self.registry.register(LatencyCollector(context.engine, context.window))
        self._metrics_lock = threading.Lock()
        self.asgi = Starlette(
            routes=[
                Route("/signals/{task_id}", self.post_signal, methods=["POST"]),
                Route("/instances/{instance_id}/events", self.instance_events, methods=["GET"]),
                Route("/types/{workflow_type}/events", self.type_events, methods=["GET"]),
                Route("/tasks/{task_id}", self.get_task, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/metrics", self.get_metrics, methods=["GET"]),
            ],
            lifespan=self._lifespan,
            # An unknown route (404) or method (405, with its Allow header) answers JSON like every other error.
            exception_handlers=dict.fromkeys((404, 405), lambda request, exc: JSONResponse(
                {"error": "not_found" if exc.status_code == 404 else "method_not_allowed",
                 "message": f"{exc.detail}: {request.method} {request.url.path}"},
                status_code=exc.status_code, headers=exc.headers)),
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        if self.hub is not None:
            self.hub.start()
        try:
            yield
        finally:
            if self.hub is not None:
                await asyncio.to_thread(self.hub.stop)

    # --- POST /signals/{task_id} --------------------------------------------------------------------------
    async def post_signal(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        if self.verifier is None:
            self.metrics.signals.labels(outcome="refused").inc()
            return _error(503, "signals_disabled", f"the signal webhook has no secret: set {ENV_SIGNAL_SECRET} "
                                                   "(or serve.signal_secret) and restart")
        body = await _read_body(request)
        if body is None:
            self.metrics.signals.labels(outcome="refused").inc()
            return _error(413, "too_large", f"the body is larger than {MAX_BODY} bytes")
        try:
            self.verifier.verify(request.headers.get(TIMESTAMP_HEADER), request.headers.get(SIGNATURE_HEADER), body)
        except Unauthorized as exc:
            self.metrics.signals.labels(outcome="unauthorized").inc()
            log.info("signal for task %s refused: %s", task_id, exc)
            return _error(401, "unauthorized", str(exc))
        except TooManyRequests as exc:
            self.metrics.signals.labels(outcome="refused").inc()
            return _error(503, "too_many_requests", str(exc))
        started = time.perf_counter()
        try:
            signal = parse_signal_body(body)
            accepted = await asyncio.to_thread(accept_signal, self.context.engine, self.context.tables, task_id,
                                               signal)
        except RequestError as exc:
            self.metrics.signals.labels(outcome="refused").inc()
            return _error(exc.status, exc.code, str(exc))
        except Exception:
            self.metrics.signals.labels(outcome="error").inc()
            log.exception("signal for task %s failed", task_id)
            return _error(500, "internal", "the signal could not be recorded (see the server's log); nothing "
                                           "is recorded unless GET /tasks shows it")
        self.metrics.signals.labels(outcome="accepted").inc()
        self.metrics.signal_seconds.observe(time.perf_counter() - started)
        return JSONResponse(accepted.to_json(), status_code=202)

    # --- SSE ----------------------------------------------------------------------------------------------
    async def instance_events(self, request: Request) -> Response:
        return self._stream(request, Filter("instance", request.path_params["instance_id"]))

    async def type_events(self, request: Request) -> Response:
        return self._stream(request, Filter("type", request.path_params["workflow_type"]))

    def _stream(self, request: Request, filter_: Filter) -> Response:
        hub = self.hub
        if hub is None:
            return _error(503, "no_bus", f"no event bus: {self.context.bus_error or 'not configured'}")
        if not hub.ready:
            return _error(503, "not_ready", "the bus reader has not reached the bus yet (see /healthz); retry")
        raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        resume = None
        if raw:
            try:
                resume = parse_cursor(raw, hub.partitions_of(filter_), hub.bus.partitions)
            except CursorError as exc:
                return _error(400, "bad_last_event_id", str(exc))
        self.metrics.sse_connections.labels(stream=filter_.kind, resumed="yes" if resume else "no").inc()
        return StreamingResponse(
            event_stream(hub, filter_, resume, self.context.settings.serve.sse_keepalive,
                         on_sent=self.metrics.sse_events.inc),
            media_type="text/event-stream", headers=stream_headers())

    # --- GET /tasks/{task_id} -----------------------------------------------------------------------------
    async def get_task(self, request: Request) -> Response:
        try:
            doc = await asyncio.to_thread(task_status, self.context.engine, self.context.tables,
                                          request.path_params["task_id"])
        except RequestError as exc:
            return _error(exc.status, exc.code, str(exc))
        except Exception as exc:
            log.warning("GET /tasks failed: %s", exc)
            return _error(503, "database", f"the task table cannot be read: {first_line(exc)}")
        return JSONResponse(doc)

    # --- GET /healthz -------------------------------------------------------------------------------------
    async def healthz(self, _request: Request) -> Response:
        database = {"up": True, "detail": mask_url(self.context.engine.url)}
        try:
            await asyncio.to_thread(check_connection, self.context.engine)
        except Exception as exc:
            database = {"up": False, "detail": first_line(exc)}
        hub = self.hub
        if hub is None:
            reader: dict[str, Any] = {"up": False, "detail": self.context.bus_error or "no bus configured"}
        else:
            age = time.time() - hub.stats.last_read_at if hub.stats.last_read_at else None
            up = hub.running and hub.healthy and hub.ready
            reader = {"up": up, "detail": ("reading " + self.context.bus_label) if up else
                      (hub.stats.last_error or "starting"),
                      "last_read_age_seconds": None if age is None else round(age, 3),
                      "clients": dict(hub.stats.clients)}
        healthy = bool(database["up"]) and bool(reader["up"])
        doc = {"status": "ok" if healthy else "unavailable", "database": database, "bus_reader": reader,
               "signals": "enabled" if self.verifier is not None else "disabled (no secret)"}
        return JSONResponse(doc, status_code=200 if healthy else 503)

    # --- GET /metrics -------------------------------------------------------------------------------------
    async def get_metrics(self, _request: Request) -> Response:
        body = await asyncio.to_thread(self._render_metrics)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def _render_metrics(self) -> bytes:
        with self._metrics_lock:  # one scrape at a time: the status queries are not free
            return generate_latest(self.registry)

    def _gather(self) -> Any:
        c = self.context
        return gather_status(c.engine, bus=c.bus, bus_label=c.bus_label, bus_error=c.bus_error,
                             group=c.settings.scheduler.group, window=c.window, store=c.store,
                             database_label=mask_url(c.settings.database_url))


async def _read_body(request: Request) -> bytes | None:
    """The body, or ``None`` when it is larger than :data:`MAX_BODY` (read no further than that)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
    return b"".join(chunks)



# --- running it -------------------------------------------------------------------------------------------

def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port); :class:`ServeError` saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """uvicorn serving a :class:`ServeApp` on a thread of its own (signals stay with the caller's main thread)."""

    def __init__(self, app: ServeApp, host: str, port: int) -> None:
        import uvicorn

        self.app = app
        self.host = host
        self.socket = bind_socket(host, port)
        self.port = int(self.socket.getsockname()[1])
        config = uvicorn.Config(app.asgi, log_config=None, access_log=False, lifespan="on", http="h11",
                                ws="none", loop="asyncio", timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                        name="pollbridge-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise ServeError(f"the server on {self.url} stopped while starting (see the log above)")
            if time.monotonic() > deadline:
                raise ServeError(f"the server on {self.url} did not start within {timeout:g} s")
            time.sleep(0.01)
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 15.0) -> None:
        if self.app.hub is not None:  # open streams end now, so the graceful shutdown need not wait for them
            self.app.hub.close_all("the server is shutting down; reconnect with the last event id to resume")
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.socket.close()
