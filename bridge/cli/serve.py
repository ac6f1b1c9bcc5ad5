"""``pollbridge serve``: the signal webhook, SSE feeds from the bus, /tasks, /healthz and /metrics (docs/serve.md)."""

from __future__ import annotations

import click

from bridge.app.components import OptionalBus
from bridge.cli.common import components_of, stop_on_signals
from bridge.core.urls import mask_url
from bridge.db.engine import check_connection


@click.command("serve", epilog="The webhook's shared secret comes from the environment variable "
                               "POLLBRIDGE_SIGNAL_SECRET (or serve.signal_secret in the configuration file; "
                               "at least 16 characters) and is never printed. Without one, POST /signals "
                               "answers 503 and everything else works.")
@click.option("--host", default=None, envvar="POLLBRIDGE_SERVE_HOST", show_envvar=True,
              help="Address to listen on [default from config: 127.0.0.1, this host only; 0.0.0.0 exposes "
                   "the service to the network].")
@click.option("--port", type=click.IntRange(0, 65535), default=None, envvar="POLLBRIDGE_SERVE_PORT",
              show_envvar=True, help="Port to listen on [default from config: 8470; 0: any free port, printed "
                                     "at start].")
@click.pass_context
def serve(ctx: click.Context, host: str | None, port: int | None) -> None:
    """Serve POST /signals/{task_id} (HMAC-signed), GET /instances/{id}/events and
    GET /types/{type}/events (Server-Sent Events from the bus, resumable with Last-Event-ID),
    GET /tasks/{id}, GET /healthz and GET /metrics, until SIGTERM or Ctrl-C (exit 0)."""
    from bridge.serve.app import BackgroundServer, ServeApp, ServeContext, ServeError, resolve_secret
    from bridge.tasktable.tables import reflect_tables

    components = components_of(ctx)
    settings = components.settings
    secret = resolve_secret(settings)
    host = host if host is not None else settings.serve.host
    port = port if port is not None else settings.serve.port
    stop = stop_on_signals()  # first, so a SIGTERM during start-up is a clean stop too
    engine = components.engine()
    bus: OptionalBus | None = None
    try:
        check_connection(engine)
        tables = reflect_tables(engine, settings.mapping)
        bus = components.optional_bus(engine)
        app = ServeApp(ServeContext(settings, engine, tables, bus.bus, secret, bus_label=bus.label,
                                    bus_error=bus.error, store=components.flag_store(engine)))
        server = BackgroundServer(app, host, port).start()
        click.echo(f"serving on {server.url} ({mask_url(settings.database_url)}, bus {bus.label}); signals "
                   f"{'enabled' if secret else 'disabled (no POLLBRIDGE_SIGNAL_SECRET)'}", err=True)
        try:
            while not stop.wait(0.5):
                if not server.alive:
                    raise ServeError("the server stopped unexpectedly (see the log above)")
        finally:
            server.stop()
        click.echo("server stopped", err=True)
    finally:
        if bus is not None:
            bus.close()
        engine.dispose()
