"""Headless Chromium (the system's: Debian's `chromium`, which .ci/run installs) driven by Playwright."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One browser for a module; each test opens its own context (its own session storage)."""
    playwright = pytest.importorskip("playwright.sync_api", reason="the `test` extra installs playwright")
    if shutil.which(CHROMIUM) is None:
        pytest.skip("no Chromium: `apt-get install chromium` (.ci/run does)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
