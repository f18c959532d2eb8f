"""The gateway's HTTP listeners: uvicorn serving the dashboard app, on a thread of its own.

`Dashboard.start` binds ``dashboard.host:dashboard.port`` (the whole app) and
``telemetry.prometheus.port`` (``/metrics`` alone) itself, before uvicorn runs, so that
a port already taken is known at once and the port the system picked for 0 can be
logged and reported (`DashboardStatus`). Neither ever stops the gateway:

- the dashboard port taken (another rank's gateway, another server): said once, no
  dashboard, the gateway serves the engine on;
- the Prometheus port taken: said once, ``/metrics`` stays on the dashboard port;
- a bind other than loopback without ``dashboard.auth_token``: refused, said once
  (`guard.exposure_problem`): the figures and the config editor would be open to the
  network. Both listeners stay off then; the gateway serves on.

- the web stack missing (uvicorn or starlette not importable: an install that left out
  kvharbor's dependencies): said once, naming the module, no dashboard; the gateway,
  which needs neither to serve engines, imports them only here.

``dashboard.enabled: false`` starts neither. uvicorn's own log lines are kept to its
errors: they lack the ``kvharbor:`` prefix, and a client sending malformed requests
would have it log one line per request; refusals are answered, not logged.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import logging
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvharbor.dashboard.config_edit import ConfigEditor
from kvharbor.dashboard.guard import addresses, exposure_problem
from kvharbor.dashboard.history import History
from kvharbor.dashboard.hooks import GatewayHooks
from kvharbor.dashboard.logbuffer import RecentLog
from kvharbor.telemetry.log import get_logger

if TYPE_CHECKING:
    import uvicorn

_log = get_logger("kvharbor.dashboard")

WEB_STACK = ("starlette", "uvicorn")
"""What the dashboard needs beyond the gateway: imported only when it starts."""
LISTEN_BACKLOG = 64
STOP_TIMEOUT_S = 5.0
"""How long `Dashboard.stop` waits for uvicorn to finish the requests it serves."""
KEEP_ALIVE_TIMEOUT_S = 5


@dataclass(frozen=True, slots=True)
class DashboardStatus:
    """Where the gateway's HTTP side answers, for ``kvharbor status`` and the page."""

    host: str
    port: int
    """The bound port (the one the system picked when ``dashboard.port`` is 0)."""
    metrics_port: int | None
    """``telemetry.prometheus.port`` as bound; None: taken, ``/metrics`` is on ``port`` only."""

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}/"

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else f"http://{self._host}:{self.metrics_port}/metrics"

    @property
    def _host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as ``host`` resolves); raises OSError."""
    try:
        family, address = addresses(host, port)[0]
    except UnicodeError as err:
        raise OSError(f"dashboard.host {host!r} is not a host name: {err}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Not SO_REUSEPORT: a second gateway must find the port taken, not share it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def _why(err: OSError) -> str:
    return "address already in use" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))


class Dashboard:
    """The running HTTP side of one gateway; `start` returns None when it does not run."""

    def __init__(self, servers: list[tuple[uvicorn.Server, socket.socket]], status: DashboardStatus,
                 history: History, recent: RecentLog) -> None:  # fmt: skip
        self.status = status
        self._servers = servers
        self._history = history
        self._recent = recent
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvharbor-dashboard")

    @classmethod
    def start(cls, hooks: GatewayHooks) -> Dashboard | None:
        """Bind and serve; None (said in the log) when disabled, refused or the port is taken.
        Nothing that goes wrong here stops the gateway: an internal error is said and the
        gateway serves on without a dashboard."""
        try:
            return cls._serve(hooks)
        except ImportError as err:
            _log.error(
                "kvharbor: dashboard not started: %s is not installed (%s); the gateway serves on without it "
                "and without /metrics. Install kvharbor with its dependencies (pip install kvharbor)",
                err.name or "a module it needs", err,
            )  # fmt: skip
            return None
        except Exception as err:
            _log.exception("kvharbor: dashboard not started: internal error %s; the gateway serves on without it", err)
            return None

    @classmethod
    def _serve(cls, hooks: GatewayHooks) -> Dashboard | None:
        settings = hooks.config().dashboard
        if not settings.enabled:
            return None
        for module in WEB_STACK:  # Before any port is bound; ImportError: no dashboard, said by `start`.
            importlib.import_module(module)
        from kvharbor.dashboard.app import build_app, build_metrics_app

        problem = exposure_problem(settings)
        if problem is not None:
            _log.error("kvharbor: dashboard not started: %s; the gateway serves on without it", problem)
            return None
        try:
            main = _bind(settings.host, settings.port)
        except OSError as err:
            _log.warning(
                "kvharbor: dashboard port %d unavailable (%s); another process (e.g. another rank's gateway) is "
                "probably serving it; this gateway serves on without a dashboard (dashboard.port)",
                settings.port, _why(err),
            )  # fmt: skip
            return None
        prometheus_port = hooks.config().telemetry.prometheus.port
        metrics: socket.socket | None
        try:
            metrics = _bind(settings.host, prometheus_port)
        except OSError as err:
            metrics = None
            _log.warning(
                "kvharbor: prometheus port %d unavailable (%s); /metrics is still on the dashboard port "
                "(telemetry.prometheus.port)",
                prometheus_port, _why(err),
            )  # fmt: skip
        try:
            history = History(hooks.store_status, settings.history_interval_s, settings.history_samples_max)
            recent = RecentLog(settings.log_lines_max)
            editor = ConfigEditor(hooks.config_path, hooks.config, hooks.apply_config)
            servers = [(_server(build_app(hooks, history, recent, editor), settings.request_header_bytes_max), main)]
            if metrics is not None:
                servers.append((_server(build_metrics_app(hooks), settings.request_header_bytes_max), metrics))
        except BaseException:
            # A port bound but never served would take connections that no one answers.
            for sock in (main, metrics):
                if sock is not None:
                    sock.close()
            raise
        metrics_port = None if metrics is None else metrics.getsockname()[1]
        bound = DashboardStatus(settings.host, main.getsockname()[1], metrics_port)
        dashboard = cls(servers, bound, history, recent)
        recent.attach()
        history.start()
        dashboard._thread.start()
        _log.info(
            "kvharbor: dashboard at %s%s",
            bound.url,
            "" if bound.metrics_port is None else f"; /metrics also on port {bound.metrics_port}",
        )
        return dashboard

    def stop(self) -> None:
        """Stop serving (requests under way get ``STOP_TIMEOUT_S`` to finish) and close the ports."""
        for server, _ in self._servers:
            server.should_exit = True
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            for server, _ in self._servers:
                server.force_exit = True
            self._thread.join(STOP_TIMEOUT_S)
        for _, sock in self._servers:
            sock.close()
        self._history.stop()
        self._recent.detach()

    def _run(self) -> None:
        async def serve_all() -> None:
            await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in self._servers))

        asyncio.run(serve_all())


def _server(app: Any, header_bytes_max: int) -> uvicorn.Server:
    import uvicorn

    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.ERROR)
    config = uvicorn.Config(
        app,
        http="h11",  # Its limit on the request line and headers is a setting (httptools' is not).
        h11_max_incomplete_event_size=header_bytes_max,
        lifespan="off",
        access_log=False,
        log_config=None,
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        server_header=False,
    )
    return uvicorn.Server(config)
