"""How glowplug's own tools open the start-up page in a real browser: Debian's chromium (`chromium` on PATH, or
GLOWPLUG_CHROMIUM), driven headless by Playwright; Playwright's own browser download is never used. The page tests
(tests/lifecycle/page_support.py) and `glowplug bench screenshots` (profiling/bench/screenshots.py, which
scripts/page_screenshot.py wraps) launch it the same way from here. The server never imports this module.
"""

from __future__ import annotations

import os
import shutil

# Headless, no sandbox (CI containers run as root), and nothing that reaches out to the network on its own: the page
# under test is on 127.0.0.1, and a browser fetching updates or sync state would only add noise and delay.
CHROMIUM_FLAGS: tuple[str, ...] = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium_path() -> str | None:
    """GLOWPLUG_CHROMIUM when set, else the system chromium on PATH; None when there is none."""
    given = os.environ.get("GLOWPLUG_CHROMIUM")
    if given:
        return given
    return shutil.which("chromium") or shutil.which("chromium-browser")
