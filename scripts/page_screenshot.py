"""Screenshots of the live start-up page during and after a real `glowplug serve` start.

    .venv/bin/python scripts/page_screenshot.py [--out reports/startup] [-- SERVE ARGS...]

Starts `glowplug serve` (the default model unless SERVE ARGS name another) on a free local port, opens the page in
headless chromium (Debian's, driven by Playwright) as soon as the port answers, saves `page-starting.png` while a
phase is running, then `page.png` (1280 px wide) and `page-phone.png` (390 px) once READY, and stops the server
with SIGTERM. Run it twice in a row to see the ETA and the ghosts of the phases still to come: they come from
the previous start of the same config. With `--under-load N`, after READY it runs `glowplug bench serve
--base-url` against the same server (N concurrent clients) and saves `page-serving.png` while that load runs, so
the serving charts show real traffic.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from glowplug.lifecycle.browser import CHROMIUM_FLAGS, chromium_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"glowplug serve exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"glowplug serve did not listen on {port} within {timeout:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("reports/startup"))
    parser.add_argument("--chromium", default=chromium_path())
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for READY")
    parser.add_argument("--under-load", type=int, default=0, metavar="N",
                        help="after READY, screenshot the serving view under `glowplug bench serve` with N clients")
    parser.add_argument("serve_args", nargs="*", help="passed to `glowplug serve` (after --)")
    args = parser.parse_args()
    if not args.chromium:
        raise SystemExit("no chromium found: apt-get install chromium, or pass --chromium PATH")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    glowplug = Path(sys.executable).with_name("glowplug")
    cmd = [str(glowplug), "serve", *args.serve_args, "--port", str(port), "--log-format", "json"]
    log_path = Path(tempfile.gettempdir()) / "glowplug-page-serve.log"
    with open(log_path, "wb") as log, sync_playwright() as pw:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_port(port, proc, 120.0)
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True, args=list(CHROMIUM_FLAGS))
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/")
            timeout_ms = args.timeout * 1000
            if page.evaluate("document.body.dataset.state") == "starting":
                # Mid start-up: a stage span is running (after the engine import), ideally with ghosts after it.
                page.wait_for_function(
                    "document.querySelector('#phase-list li[data-status=running]') || document.body.dataset.state !== 'starting'",
                    timeout=timeout_ms,
                )
                try:  # the ghosts of the phases to come appear once the engine import has read the last start
                    page.wait_for_function(
                        "document.querySelector('#phase-list li[data-status=expected]') || document.body.dataset.state !== 'starting'",
                        timeout=10_000,
                    )
                except PlaywrightTimeout:
                    pass  # no earlier start of this config: no ghosts to wait for
                page.wait_for_timeout(1000)
                page.screenshot(path=str(args.out / "page-starting.png"), full_page=True)
            page.wait_for_function("document.body.dataset.state === 'ready'", timeout=timeout_ms)
            page.wait_for_selector("#phase-table tbody tr[data-row=actual_total_time]", timeout=timeout_ms)
            page.wait_for_timeout(3000)  # a few metrics ticks for the serving charts
            page.screenshot(path=str(args.out / "page.png"), full_page=True)
            if args.under_load:
                load_out = Path(tempfile.mkdtemp(prefix="glowplug-page-load-"))
                load = subprocess.Popen(
                    [str(glowplug), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                     "--concurrency", str(args.under_load), "--num-prompts", str(args.under_load * 8),
                     "--runs", "1", "--input-len", "128", "--output-len", "128", "--out-dir", str(load_out)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
                try:
                    # Running requests on the chart: the load has reached the engine, plus a few metrics ticks.
                    page.wait_for_function(
                        "Number((document.querySelector('#chart-requests .now')?.textContent.match("
                        "/running \\(solid\\) (\\d+)/) || [0, 0])[1]) > 0",
                        timeout=120_000,
                    )
                    page.wait_for_timeout(8000)
                    page.screenshot(path=str(args.out / "page-serving.png"), full_page=True)
                finally:
                    load.wait(600)
            page.set_viewport_size({"width": 390, "height": 844})
            page.wait_for_timeout(500)
            page.screenshot(path=str(args.out / "page-phone.png"), full_page=True)
            browser.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"screenshots in {args.out}; server log in {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
