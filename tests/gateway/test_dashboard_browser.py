"""The dashboard in a real browser: Debian's chromium, headless, driven by Selenium.

The page is loaded from a real gateway process; lookups driven through a real client
while it is open must show up in its numbers and charts; without the token it is refused.
The screenshot is written to the test's tmp path (``docs/dashboard.png`` is one kept copy).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dashboard_harness import TOKEN, ports_of
from gateway_harness import WAIT_S, Lab, closing_client, keys_of, put_values
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHUNK_TOKENS = 16

SERIES_PIXELS = """
const canvas = document.querySelector(arguments[0] + ' canvas');
if (!canvas) return 0;
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
let drawn = 0;
for (let i = 0; i < data.length; i += 4)
  if (Math.abs(data[i] - 47) < 30 && Math.abs(data[i + 1] - 111) < 30 && Math.abs(data[i + 2] - 223) < 30) drawn += 1;
return drawn;
"""
"""How many pixels of a chart's canvas have its first series' colour (#2f6fdf in dashboard.js):
the line and points, not the axes and grid (grey)."""


def series_drawn(chart: str) -> Callable[[webdriver.Chrome], bool]:
    """Whether ``chart`` (a CSS selector) has drawn more than 20 pixels of its first series."""
    return lambda browser: browser.execute_script(SERIES_PIXELS, chart) > 20


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if shutil.which(path) is None]
    assert not missing, f"{', '.join(missing)} missing: apt-get install -y chromium chromium-driver (scripts/setup.sh)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1300"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_shows_live_numbers_and_charts(lab: Lab, browser: webdriver.Chrome, tmp_path: Path) -> None:
    dashboard = {"auth_token": TOKEN, "refresh_interval_ms": 250, "history_interval_s": 0.25}
    gateway = lab.gateway(lab.config(dashboard=dashboard)).start()
    ports = ports_of(gateway)
    assert ports is not None, gateway.log()
    url = f"http://127.0.0.1:{ports.dashboard}/"

    browser.get(url)
    refused = browser.find_element(By.TAG_NAME, "body").text
    assert json.loads(refused) == {"error": "unauthorized"}, refused

    browser.get(url + f"?token={TOKEN}")
    wait = WebDriverWait(browser, WAIT_S)
    wait.until(lambda b: b.find_element(By.ID, "state").text == "live")
    assert browser.find_element(By.ID, "lookups").text == "0"
    assert "ram" in browser.find_element(By.ID, "tiers").text
    assert browser.execute_script(SERIES_PIXELS, "#chart-hit-rate") == 0, "no lookup yet, no hit rate drawn"

    with closing_client(gateway.client("browser-test")) as client:
        stored = keys_of(3, tag=5)
        put_values(client, [(key, 4096) for key in stored])
        for _ in range(4):
            client.lookup([*stored, *keys_of(1, tag=6)], CHUNK_TOKENS)
    wait.until(lambda b: b.find_element(By.ID, "lookups").text == "4")
    wait.until(lambda b: b.find_element(By.ID, "hit-rate-total").text == "75.0 %")
    # Each chart draws its first series (the hit rate of the interval that saw the lookups, the
    # RAM tier's usage, its evictions), not only axes.
    for chart in ("#chart-hit-rate", "#chart-usage", "#chart-evictions"):
        wait.until(series_drawn(chart))
    wait.until(lambda b: "kvharbor: client 'browser-test'" in b.find_element(By.ID, "log").text)
    history_rates = browser.execute_script(
        "return fetch('api/history', {headers: {Authorization: 'Bearer ' + arguments[0]}})"
        ".then(r => r.json()).then(h => h.hit_rate.filter(x => x !== null));",
        TOKEN,
    )
    assert 0.75 in history_rates, history_rates
    screenshot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(screenshot)), "no screenshot"
    assert screenshot.stat().st_size > 10_000
