"""Support for the start-up page tests: a paced start-up and a real headless browser.

The test hook: `PacedStartup` is an engine factory (the `engine_factory=` every service accepts) that runs the
real default pipeline with each stage wrapped in a `PacedStage`. A paced stage has the inner stage's name, so
its span, table row and events are the real ones; before running the inner stage it sleeps `delay_s` (a
test-only stage delay, so a person watching the page can follow it) and, when the test holds it, waits until
the test releases it. Holding makes what the browser must see deterministic on a loaded machine: the test
waits for the page to show a phase, instead of hoping a sleep was long enough. Nothing of this is in the
product: the pacing lives only in this test factory.

The browser is Debian's chromium (`/usr/bin/chromium`, or GLOWPLUG_CHROMIUM) driven by Playwright for Python;
Playwright's own browser download is never used. Screenshots go to GLOWPLUG_TEST_ARTIFACTS when set, else to
pytest's tmp dir.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from glowplug.lifecycle.browser import CHROMIUM_FLAGS, chromium_path


class PacedStage:
    # One stage at a time: what the page shows then follows the pipeline's order.
    barrier = True

    def __init__(self, inner: Any, startup: PacedStartup) -> None:
        self.inner = inner
        self.name: str = inner.name
        self.needs: tuple[str, ...] = inner.needs
        self.provides: tuple[str, ...] = inner.provides
        self._startup = startup

    def run(self, ctx: Any) -> Any:
        self._startup.pace(self.name)
        return self.inner.run(ctx)


class PacedStartup:
    """Engine factory: the real pipeline, each stage delayed by `delay_s` and the stages in `hold` held."""

    def __init__(self, *, hold: tuple[str, ...] = (), delay_s: float = 0.0, timeout_s: float = 120.0) -> None:
        self.delay_s = delay_s
        self.timeout_s = timeout_s
        self.entered = {name: threading.Event() for name in hold}
        self.released = {name: threading.Event() for name in hold}

    def pace(self, stage: str) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if stage in self.entered:
            self.entered[stage].set()
            if not self.released[stage].wait(self.timeout_s):
                raise TimeoutError(f"the test never released stage {stage!r}")

    def wait_entered(self, stage: str, timeout: float = 120.0) -> None:
        assert self.entered[stage].wait(timeout), f"the start-up never reached {stage}"

    def release(self, stage: str) -> None:
        self.released[stage].set()

    def release_all(self) -> None:
        for event in self.released.values():
            event.set()

    def __call__(self, config: Any, *, on_phase: Any = None, tracing: Any = None, marks: Any = None) -> Any:
        from glowplug.engine.startup import build_engine, default_stages

        stages = [PacedStage(stage, self) for stage in default_stages()]
        return build_engine(config, on_phase=on_phase, tracing=tracing, marks=marks, stages=stages)


def artifacts_dir(tmp_path: Path) -> Path:
    root = os.environ.get("GLOWPLUG_TEST_ARTIFACTS")
    out = Path(root) if root else tmp_path / "artifacts"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _unavailable(why: str) -> None:
    # CI installs chromium (.ci/run), so there a missing browser is a failure; a developer without one is told.
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[test]')")
    exe = chromium_path()
    if exe is None:
        _unavailable("no chromium on PATH (apt-get install chromium, or set GLOWPLUG_CHROMIUM)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=exe,
            headless=True,
            args=list(CHROMIUM_FLAGS),
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()
