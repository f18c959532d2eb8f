"""The gateway's web side: a live dashboard, ``/metrics``, probes and a config editor.

Served by the gateway process itself (service and embedded mode) with Starlette on
uvicorn, on a thread of its own (`servers.Dashboard`), bound to
``dashboard.host:dashboard.port`` and, for ``/metrics`` alone, to
``telemetry.prometheus.port``. Every request but the probes passes the token and
Host checks (`guard`); the page (`static/`) draws its charts with uPlot, shipped
with the package (no CDN).
"""
