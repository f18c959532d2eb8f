"""What the dashboard costs the engine: bench/ipc.py's LOOKUP round trip with and without scraping.

Against one real ``kvharbor gateway`` subprocess (a RAM tier, its dashboard and
``/metrics`` listener on ports the system picks), the p50 of a one-key LOOKUP
(`ipc.round_trips`, one client process) is measured alternately:

- **A**: nothing else talks to the gateway;
- **B**: a scraper process fetches ``/metrics`` from ``telemetry.prometheus.port``
  ``--scrape-hz`` (10) times a second, and, as one open page does, the page's
  ``/api/status``, ``/api/history`` and ``/api/log`` every ``dashboard.refresh_interval_ms``.

A B A B ... ``--rounds`` (3) times each; every run's p50 is printed, then per setup the
median and the spread (min-max) of its runs, and B's median over A's. Target: within
5 % (``b_vs_a_p50`` <= 1.05). Nothing is asserted.

    .venv/bin/python bench/dashboard.py [--rounds 3] [--samples 20000] [--scrape-hz 10] [--json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit
from ipc import FINGERPRINT, gateway, percentile, round_trips

from kvharbor.gateway.client import GatewayClient

TARGET_B_VS_A = 1.05
PAGE_PATHS = ("/api/status", "/api/history", "/api/log")
VALUE_BYTES = 4096


def _scraper(metrics_url: str, page_url: str, scrape_hz: float, refresh_s: float, stop: Any, counts: Any) -> None:
    """Fetch /metrics ``scrape_hz`` times a second and the page's API every ``refresh_s`` until ``stop``."""
    scrapes = page_fetches = 0
    next_page = time.monotonic()
    while not stop.wait(1 / scrape_hz):
        with urllib.request.urlopen(metrics_url, timeout=10) as answer:
            answer.read()
        scrapes += 1
        if time.monotonic() >= next_page:
            for path in PAGE_PATHS:
                with urllib.request.urlopen(page_url + path, timeout=10) as answer:
                    answer.read()
            page_fetches += 1
            next_page += refresh_s
    counts.put((scrapes, page_fetches))


def ports(client: GatewayClient) -> tuple[int, int]:
    """The dashboard's and the /metrics listener's ports, from the gateway's status."""
    status = client.status()
    if status.dashboard_url is None or status.metrics_url is None:
        raise SystemExit("the gateway serves no dashboard or no /metrics listener; see its log")
    dashboard, metrics = urlsplit(status.dashboard_url).port, urlsplit(status.metrics_url).port
    assert dashboard is not None and metrics is not None
    return dashboard, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each setup, alternating A B")
    parser.add_argument("--samples", type=int, default=20_000, help="LOOKUP round trips per run")
    parser.add_argument("--scrape-hz", type=float, default=10.0, help="/metrics scrapes per second in B")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    refresh_ms = 2000
    sections = {
        "dashboard": {"port": 0, "refresh_interval_ms": refresh_ms},
        "telemetry": {"prometheus": {"port": 0}},
    }
    context = multiprocessing.get_context("spawn")
    p50s: dict[str, list[float]] = {"A": [], "B": []}
    fetched = []
    with (
        tempfile.TemporaryDirectory(prefix="kvh-bench-") as tmp,
        gateway(Path(tmp), 64, 0.25, 1, sections) as (
            section,
            _,
        ),
    ):
        client = GatewayClient.connect(section, "bench-dashboard")
        key = os.urandom(16)
        batch = client.prepare_put(FINGERPRINT, [(key, VALUE_BYTES)])
        for view in batch.views:
            if view is not None:
                view[:] = os.urandom(VALUE_BYTES)
        client.commit_put(batch)
        dashboard_port, metrics_port = ports(client)
        client.close()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        page_url = f"http://127.0.0.1:{dashboard_port}"
        for run in range(args.rounds):
            for setup in ("A", "B"):
                stop, counts = context.Event(), context.Queue()
                scraper = None
                if setup == "B":
                    scraper = context.Process(
                        target=_scraper, args=(metrics_url, page_url, args.scrape_hz, refresh_ms / 1000, stop, counts)
                    )
                    scraper.start()
                timings = round_trips(section, key, 1, args.samples)
                if scraper is not None:
                    stop.set()
                    fetched.append(counts.get(timeout=60))
                    scraper.join(60)
                p50 = percentile(timings, 0.50) / 1e3
                p50s[setup].append(p50)
                extra = (
                    "" if scraper is None else f" (beside {fetched[-1][0]} scrapes, {fetched[-1][1]} page refreshes)"
                )
                p99 = percentile(timings, 0.99) / 1e3
                print(f"run {run + 1} {setup}: LOOKUP p50 {p50:6.2f} us, p99 {p99:7.2f} us{extra}")

    figures: dict[str, float] = {"cpus": float(os.cpu_count() or 0), "rounds": args.rounds, "scrape_hz": args.scrape_hz}
    for setup, values in p50s.items():
        figures[f"{setup.lower()}_p50_us_median"] = statistics.median(values)
        figures[f"{setup.lower()}_p50_us_min"] = min(values)
        figures[f"{setup.lower()}_p50_us_max"] = max(values)
    ratios = {"b_vs_a_p50": figures["b_p50_us_median"] / figures["a_p50_us_median"]}
    for setup in ("a", "b"):
        low, high, mid = (
            figures[f"{setup}_p50_us_min"],
            figures[f"{setup}_p50_us_max"],
            figures[f"{setup}_p50_us_median"],
        )
        label = "A (no scraping)" if setup == "a" else f"B (/metrics {args.scrape_hz:g}/s + page)"
        print(f"{label:28s} p50 median {mid:6.2f} us, spread {low:6.2f}-{high:6.2f} us ({(high - low) / mid:.1%})")
    print(f"B / A p50: {ratios['b_vs_a_p50']:.3f} (target <= {TARGET_B_VS_A})")
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()
