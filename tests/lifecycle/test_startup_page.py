"""The live start-up page in a real browser (headless Debian chromium through Playwright) against real servers on
the tiny model: the start-up filling in live, READY with the phase table equal to /startup's, a failed start,
the SSE stream surviving a server restart, the polling fallback, and the serving charts.

The start-up is paced by the test factory in page_support.py (held stages, plus a small per-stage delay), so what
the browser must see is waited for, never timed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lifecycle_harness import ThreadServer, engine_config, free_port
from page_support import PacedStartup, artifacts_dir, browser  # noqa: F401 - the fixture

from glowplug.engine.startup import default_stages
from glowplug.lifecycle.config import ServeConfig
from glowplug.profiling.names import Row

PIPELINE = tuple(stage.name for stage in default_stages())
WAIT_MS = 60_000

# Records, in order, every phase-list item whose status changes to a done state (finished / skipped / failed).
OBSERVE_DONE = """() => {
  window.__done = [];
  const list = document.getElementById('phase-list');
  const seen = new Set([...list.children].filter(li => ['finished', 'skipped', 'failed'].includes(li.dataset.status))
                                        .map(li => li.dataset.stage));
  new MutationObserver(() => {
    for (const li of list.children) {
      const s = li.dataset.status;
      if (['finished', 'skipped', 'failed'].includes(s) && !seen.has(li.dataset.stage)) {
        seen.add(li.dataset.stage); window.__done.push([li.dataset.stage, s]);
      }
    }
  }).observe(list, {subtree: true, childList: true, attributes: true, attributeFilter: ['data-status']});
}"""


def _fmt(seconds: float | None) -> str:
    # The CLI table's cell format, written out here independently of the code under test.
    return "--" if seconds is None else f"{seconds:.3f}"


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:  # noqa: F811 - the fixture
    p = browser.new_page()
    yield p
    p.close()


def _table_cells(page: Any) -> dict[str, str]:
    return page.eval_on_selector_all(
        "#phase-table tbody tr",
        "rows => Object.fromEntries(rows.map(r => [r.dataset.row, r.querySelector('td.seconds').textContent]))",
    )


def test_startup_renders_live_then_ready_table(page: Any, tiny_model: Path, tmp_path: Path) -> None:
    config = engine_config(tiny_model, max_num_seqs=4)
    from glowplug.engine.startup import build_engine

    build_engine(config)  # the last start of this config: the ETA and the ghosts come from it
    pacing = PacedStartup(hold=("load_weights", "kv_cache_init"), delay_s=0.2)
    srv = ThreadServer(config, ServeConfig(port=0), engine_factory=pacing).start()
    out = artifacts_dir(tmp_path)
    try:
        pacing.wait_entered("load_weights")
        page.goto(srv.base_url + "/")
        page.wait_for_function(
            "document.getElementById('current-phase').textContent === 'load_weights'", timeout=WAIT_MS
        )
        assert page.text_content("#state") == "STARTING"
        assert "Starting: phase load_weights" in page.text_content("#announce")
        assert page.get_attribute("#phase-list li[data-stage=load_weights]", "data-status") == "running"
        # Phases still to come are drawn as ghosts with last start's durations; the ETA is shown.
        assert page.get_attribute("#phase-list li[data-stage=warmup]", "data-status") == "expected"
        assert page.locator("#timeline-svg g[data-status=expected]").count() >= 5
        # The ETA comes with the service's once-a-second sample, which may predate the last start's profile.
        page.wait_for_function(
            "/about [\\d.]+ (s|min)/.test(document.getElementById('eta').textContent)", timeout=WAIT_MS
        )
        for stage in ("model_prepare", "tokenizer_init"):  # finished before the page opened
            assert page.get_attribute(f"#phase-list li[data-stage={stage}]", "data-status") == "finished"

        page.evaluate(OBSERVE_DONE)
        pacing.release("load_weights")
        pacing.wait_entered("kv_cache_init")
        page.wait_for_function(
            "document.getElementById('current-phase').textContent === 'kv_cache_init'", timeout=WAIT_MS
        )
        done = page.evaluate("window.__done")
        names = [stage for stage, _ in done]
        expected_order = [s for s in PIPELINE if s in names]
        assert names == expected_order, done
        assert names[:1] == ["load_weights"] and "kv_cache_profiling" in names
        assert sum(1 for _, status in done if status == "finished") >= 2, done
        # A finished bar carries its seconds and the phase-table note (quantization none -> skipped and why).
        assert "quantization none" in page.text_content("#phase-list li[data-stage=quantize_weights]")
        assert re.search(r"\d+\.\d{3} s", page.text_content("#phase-list li[data-stage=load_weights] .ph-secs"))
        page.screenshot(path=str(out / "startup-live.png"), full_page=True)

        pacing.release("kv_cache_init")
        page.wait_for_function("document.body.dataset.state === 'ready'", timeout=WAIT_MS)
        page.wait_for_selector("#phase-table tbody tr[data-row=actual_total_time]", timeout=WAIT_MS)
        with srv.http() as http:
            info = http.get("/startup").json()
        table = info["phase_table"]["phases"]
        cells = _table_cells(page)
        assert list(cells) == list(table)  # same rows, same order
        assert cells == {name: _fmt(seconds) for name, seconds in table.items()}
        assert page.text_content("#state") == "READY"
        actual = _fmt(table[Row.ACTUAL_TOTAL_TIME])
        assert page.text_content("#announce") == f"Ready after {actual} s"
        assert page.locator("#timeline-svg g[data-status=expected]").count() == 0
        # The finished phases' seconds on the page are the span times /startup reports.
        spans = {p["stage"]: p["seconds"] for p in info["timeline"]["phases"]}
        for stage in ("load_weights", "kv_cache_init", "warmup"):
            shown = page.text_content(f"#phase-list li[data-stage={stage}] .ph-secs")
            assert shown == f"{spans[stage]:.3f} s"
        assert page.get_attribute("#dl-chrome", "href") == "/startup/trace.json"
        assert page.get_attribute("#dl-otlp", "href") == "/startup/otlp.json"
        page.screenshot(path=str(out / "startup-ready.png"), full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.screenshot(path=str(out / "startup-ready-phone.png"), full_page=True)
        assert (out / "startup-ready.png").stat().st_size > 10_000
    finally:
        pacing.release_all()
        srv.stop()


def test_failed_start_shows_stage_and_cause_in_red(page: Any, tiny_model: Path, tmp_path: Path) -> None:
    # A real failure: the KV cache cannot hold one sequence, so kv_cache_profiling fails with the engine's cause
    # (a budget from --memory-utilization is checked there, where the activation peak it depends on is measured).
    config = engine_config(tiny_model, num_gpu_blocks_override=None, memory_utilization=1e-9)
    srv = ThreadServer(config, ServeConfig(port=0)).start()
    try:
        page.goto(srv.base_url + "/")
        page.wait_for_function("document.body.dataset.state === 'failed'", timeout=WAIT_MS)
        with srv.http() as http:
            info = http.get("/startup").json()
        assert info["state"] == "failed" and info["failed_stage"] == "kv_cache_profiling"
        failure = page.locator("#failure")
        assert failure.is_visible()
        assert page.text_content("#failed-stage") == "kv_cache_profiling"
        cause = page.text_content("#failure-cause")
        assert cause.startswith("KVCacheTooSmall: the KV cache cannot hold one sequence")
        assert info["reason"] == f"kv_cache_profiling: {cause}"
        assert "Start-up failed in stage kv_cache_profiling" in failure.text_content()
        assert "Start-up failed in kv_cache_profiling" == page.text_content("#announce")
        assert failure.get_attribute("role") == "alert"
        # Red, and said in words too.
        assert page.eval_on_selector("#failure", "e => getComputedStyle(e).color") == "rgb(197, 48, 48)"
        item = "#phase-list li[data-stage=kv_cache_profiling]"
        assert page.get_attribute(item, "data-status") == "failed"
        assert "✗ failed" in page.text_content(item) and cause in page.text_content(item)
        assert page.get_attribute("#phase-list li[data-stage=load_weights]", "data-status") == "finished"
        assert page.locator("#table-section").is_hidden()
        page.screenshot(path=str(artifacts_dir(tmp_path) / "startup-failed.png"), full_page=True)
    finally:
        srv.stop()


def test_page_reconnects_to_a_restarted_server(page: Any, tiny_model: Path) -> None:
    port = free_port()
    config = engine_config(tiny_model)
    first = ThreadServer(config, ServeConfig(port=port)).start()
    try:
        first.wait_ready()
        page.goto(first.base_url + "/")
        page.wait_for_function("document.body.dataset.state === 'ready'", timeout=WAIT_MS)
        assert page.text_content("#transport") == "live (server-sent events)"
        old_boot = page.evaluate("document.body.dataset.boot")
    finally:
        first.stop()
    pacing = PacedStartup(hold=("model_init",))
    second = ThreadServer(config, ServeConfig(port=port), engine_factory=pacing).start()
    try:
        pacing.wait_entered("model_init")
        # The same page, never reloaded: its stream reconnects and shows the new server's start-up from scratch.
        page.wait_for_function(
            f"document.body.dataset.boot !== {old_boot!r} && document.body.dataset.state === 'starting'",
            timeout=WAIT_MS,
        )
        page.wait_for_function("document.getElementById('current-phase').textContent === 'model_init'", timeout=WAIT_MS)
        assert page.locator("#table-section").is_hidden()
        pacing.release("model_init")
        page.wait_for_function("document.body.dataset.state === 'ready'", timeout=WAIT_MS)
        assert page.text_content("#transport") == "live (server-sent events)"
        assert page.evaluate("document.body.dataset.boot") == httpx.get(second.base_url + "/startup").json()["boot_id"]
    finally:
        pacing.release_all()
        second.stop()


def test_polling_fallback_and_serving_charts(page: Any, tiny_model: Path) -> None:
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0)).start()
    try:
        srv.wait_ready()
        page.goto(srv.base_url + "/?transport=poll")
        page.wait_for_function("document.body.dataset.state === 'ready'", timeout=WAIT_MS)
        assert page.text_content("#transport") == "polling /startup"
        with srv.http() as http:
            info = http.get("/startup").json()
        cells = _table_cells(page)
        assert cells == {name: _fmt(seconds) for name, seconds in info["phase_table"]["phases"].items()}

        client = srv.client()
        for i in range(3):
            out = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=f"charts {i}",
                max_tokens=8,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            assert out.usage.completion_tokens == 8
        # Each chart states its latest values in text; TTFT and TPOT percentiles appear once requests finished.
        page.wait_for_function(
            "!document.querySelector('#chart-ttft .now').textContent.includes('p50 (solid) –')", timeout=WAIT_MS
        )
        ttft = page.text_content("#chart-ttft .now")
        assert re.search(r"p50 \(solid\) [\d.]+ (ms|s)", ttft) and "p99 (dotted)" in ttft
        assert re.search(r"p50 \(solid\) [\d.]+ (ms|s)", page.text_content("#chart-tpot .now"))
        assert "running (solid)" in page.text_content("#chart-requests .now")
        assert re.search(r"used [\d.]+ %", page.text_content("#chart-kv .now"))
        assert page.locator("#chart-ttft svg path").count() >= 1
        assert page.locator("#serving-section").is_visible()
    finally:
        srv.stop()
