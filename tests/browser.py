"""Debian's chromium driven by Playwright, for the pages' tests (never a browser Playwright downloads).

`.ci/run` installs chromium; a machine without it skips the browser tests, saying so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("PHASESERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run"]
# screenshots the tests save, to be looked at (runs/ is not committed)
SCREENSHOTS = ROOT / "runs" / "ui-screenshots"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 360, "height": 780}


@contextlib.contextmanager
def chromium():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(page, name: str) -> Path:
    """A full-page PNG under runs/ui-screenshots, its path printed (pytest -s shows it)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
