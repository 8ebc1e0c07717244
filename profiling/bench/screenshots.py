"""`glowplug bench screenshots --out DIR [--under-load N]`: the live start-up page during and after a real start.

Starts `glowplug serve MODEL` on a free local port, opens the page in headless chromium (Debian's, driven by
Playwright; see glowplug.lifecycle.browser) as soon as the port answers, saves `page-starting.png` while a phase
is running (when the start is slow enough to catch one), then `page.png` (1280 px wide) and `page-phone.png`
(390 px) once READY, and stops the server with SIGTERM. With `--under-load N`, after READY it runs `glowplug bench
serve --base-url` against the same server (N concurrent clients) and saves `page-serving.png` while that load runs,
so the serving charts show real traffic; the load is stopped once that screenshot is taken.

Every png carries, at the bottom of the page, "glowplug <commit> · <date UTC>": the code and the moment it shows
(the commit `glowplug bench all` measured, else this checkout's). DIR/screenshots.json lists the commit, the date
and every file; DIR/screenshots.md shows them under the usual report header. Run it twice in a row to see the ETA
and the ghosts of the phases still to come: they come from the previous start of the same config.

Without chromium or Playwright the command fails (exit 2) with the reason, and screenshots.json records it: a run
of `glowplug bench all` shows that reason in its index instead of leaving the screenshots silently stale.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .cli_support import AddModelFlags, add_command

JSON_NAME = "screenshots.json"
STAMP_ID = "glowplug-stamp"
# A plain block appended to <body>: in the flow, so a full-page capture shows it below the page's own footer
# whatever the viewport, and the page's own renderers (which replace their containers' children) never remove it.
_STAMP_JS = """(text) => {
  let el = document.getElementById(%r);
  if (!el) { el = document.createElement("div"); el.id = %r; document.body.append(el); }
  el.textContent = text;
  el.setAttribute("style", "max-width:1100px;margin:8px auto;padding:4px 16px;font:12px ui-monospace,monospace;" +
    "color:#777;text-align:right;border-top:1px dashed #999");
}""" % (STAMP_ID, STAMP_ID)  # noqa: UP031 - JavaScript braces read better unescaped


class ScreenshotsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = "smollm2"
    out: Path = Field(Path("screenshots"), description="Folder of the pngs, screenshots.json and screenshots.md.")
    under_load: int = Field(
        0,
        ge=0,
        description="After READY, screenshot the serving view under `glowplug bench "
        "serve` with this many clients (0: no page-serving.png).",
    )
    timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for the server to reach READY.")
    chromium: str | None = Field(
        None, description="The chromium binary (default: GLOWPLUG_CHROMIUM, else chromium on PATH)."
    )
    serve_args: tuple[str, ...] = Field((), description="More `glowplug serve` flags, e.g. --quantization=int8.")


class ScreenshotError(RuntimeError):
    """Why no screenshots could be taken (no browser, the server did not start): the command's one-line reason."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ScreenshotError(f"glowplug serve exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ScreenshotError(f"glowplug serve did not listen on {port} within {timeout:g} s")


def stamp_text(commit: str | None, dirty: bool, date: str) -> str:
    """The visible footer of every png: 12 hex digits name the commit to a reader; the JSON has all 40."""
    return f"glowplug {(commit or 'unknown')[:12]}{' (DIRTY RUN)' if dirty else ''} · {date}"


def _utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _browser_or_reason(chromium: str | None) -> tuple[str, Any]:
    """The chromium path and Playwright's sync API, or ScreenshotError saying what is missing."""
    from glowplug.lifecycle.browser import chromium_path

    path = chromium or chromium_path()
    if not path:
        raise ScreenshotError("no chromium found: apt-get install chromium, or set GLOWPLUG_CHROMIUM / --chromium")
    try:
        from playwright import sync_api
    except ImportError as e:
        raise ScreenshotError(
            f"playwright is not installed ({e}): pip install playwright (the browser used is "
            "the system chromium, not Playwright's download)"
        ) from e
    return path, sync_api


def take_screenshots(cfg: ScreenshotsConfig, stamp: Callable[[str], str]) -> list[dict[str, Any]]:
    """Start the server, capture the pages, stop it. `stamp` gives the footer text for a capture's date.
    Returns one {file, width, date} per png written."""
    from glowplug.lifecycle.browser import CHROMIUM_FLAGS

    chromium, sync_api = _browser_or_reason(cfg.chromium)
    cfg.out.mkdir(parents=True, exist_ok=True)
    # An earlier run's pngs would sit beside this run's under an old stamp (a fast start takes no
    # page-starting.png): a folder holds one run's screenshots only.
    for old in cfg.out.glob("page*.png"):
        old.unlink()
    shots: list[dict[str, Any]] = []
    glowplug = [sys.executable, "-m", "glowplug.cli"]  # this interpreter and checkout, not whatever is on PATH
    port = free_port()
    cmd = [*glowplug, "serve", cfg.model, *cfg.serve_args, "--port", str(port), "--log-format", "json"]
    log_path = Path(tempfile.gettempdir()) / f"glowplug-page-serve-{port}.log"
    timeout_ms = cfg.timeout_s * 1000

    def capture(page: Any, name: str) -> None:
        date = _utc_now()
        page.evaluate(_STAMP_JS, stamp(date))
        page.screenshot(path=str(cfg.out / name), full_page=True)
        shots.append({"file": name, "width": page.viewport_size["width"], "date": date})

    with ExitStack() as stack:
        log = stack.enter_context(open(log_path, "wb"))
        pw = stack.enter_context(sync_api.sync_playwright())
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_port(port, proc, 120.0)
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=list(CHROMIUM_FLAGS))
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/")
            if page.evaluate("document.body.dataset.state") == "starting":
                # Mid start-up: a stage span is running (after the engine import), ideally with ghosts after it.
                page.wait_for_function(
                    "document.querySelector('#phase-list li[data-status=running]') || "
                    "document.body.dataset.state !== 'starting'",
                    timeout=timeout_ms,
                )
                try:  # the ghosts of the phases to come appear once the engine import has read the last start
                    page.wait_for_function(
                        "document.querySelector('#phase-list li[data-status=expected]') || "
                        "document.body.dataset.state !== 'starting'",
                        timeout=10_000,
                    )
                except sync_api.TimeoutError:
                    pass  # no earlier start of this config: no ghosts to wait for
                if page.evaluate("document.body.dataset.state") == "starting":
                    page.wait_for_timeout(1000)
                    capture(page, "page-starting.png")
            page.wait_for_function("document.body.dataset.state === 'ready'", timeout=timeout_ms)
            page.wait_for_selector("#phase-table tbody tr[data-row=actual_total_time]", timeout=timeout_ms)
            page.wait_for_timeout(3000)  # a few metrics ticks for the serving charts
            capture(page, "page.png")
            if cfg.under_load:
                load_out = Path(tempfile.mkdtemp(prefix="glowplug-page-load-"))
                load = subprocess.Popen(
                    [
                        *glowplug,
                        "bench",
                        "serve",
                        "--base-url",
                        f"http://127.0.0.1:{port}",
                        "--concurrency",
                        str(cfg.under_load),
                        "--num-prompts",
                        str(cfg.under_load * 8),
                        "--runs",
                        "1",
                        "--input-len",
                        "128",
                        "--output-len",
                        "128",
                        "--out-dir",
                        str(load_out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
                try:
                    # Running requests on the chart: the load has reached the engine, plus a few metrics ticks.
                    page.wait_for_function(
                        "Number((document.querySelector('#chart-requests .now')?.textContent.match("
                        "/running \\(solid\\) (\\d+)/) || [0, 0])[1]) > 0",
                        timeout=120_000,
                    )
                    page.wait_for_timeout(8000)
                    capture(page, "page-serving.png")
                finally:
                    # Only the picture is wanted: the rest of the load would only make the step longer.
                    load.terminate()
                    try:
                        load.wait(30)
                    except subprocess.TimeoutExpired:
                        load.kill()
                        load.wait()
            page.set_viewport_size({"width": 390, "height": 844})
            page.wait_for_timeout(500)
            capture(page, "page-phone.png")
            browser.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return shots


def render_markdown(record: dict[str, Any], header: str) -> str:
    """screenshots.md: the header, then each png with what it shows (or the reason there are none)."""
    what = {
        "page-starting.png": "mid start-up: the running phase and the ghosts of the phases to come",
        "page.png": "READY, 1280 px wide: the phase table and the serving charts",
        "page-serving.png": "the serving charts under `glowplug bench serve` load",
        "page-phone.png": "READY at 390 px wide (a phone)",
    }
    lines = [header]
    if record.get("error"):
        lines += [f"**No screenshots: {record['error']}**", ""]
    for shot in record["files"]:
        lines += [
            f"## {shot['file']}",
            "",
            f"{what.get(shot['file'], '')}; {shot['width']} px viewport, taken {shot['date']}.",
            "",
            f"![{shot['file']}]({shot['file']})",
            "",
        ]
    return "\n".join(lines)


def main(cfg: ScreenshotsConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    from .machine import command_line, report_git_state, report_header

    err = Console(stderr=True)
    state = report_git_state()
    record: dict[str, Any] = {
        "command": command_line(argv),
        "commit": state.commit,
        "dirty": state.dirty,
        "date": _utc_now(),
        "files": [],
        "error": None,
    }
    try:
        record["files"] = take_screenshots(cfg, lambda date: stamp_text(state.commit, state.dirty, date))
    except ScreenshotError as e:
        record["error"] = str(e)
    except Exception as e:  # a browser or page failure: recorded, then the same one-line reason
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / JSON_NAME).write_text(json.dumps(record, indent=2) + "\n")
    (cfg.out / "screenshots.md").write_text(render_markdown(record, report_header("Start-up page screenshots", argv)))
    if record["error"]:
        # The last line is the reason: `bench all` puts it in its index.
        err.print(f"glowplug bench screenshots: {record['error']}", markup=False, soft_wrap=True)
        return 2
    err.print(f"wrote {len(record['files'])} screenshots to {cfg.out}", markup=False)
    return 0


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "screenshots",
        help_text="Screenshots of the live start-up page of a real `glowplug serve`.",
        description=__doc__,
        config_cls=ScreenshotsConfig,
        add_model_flags=add_model_flags,
        runner=main,
    )
