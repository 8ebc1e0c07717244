"""Start-up progress on the terminal, as the phases run: one line per stage as it starts (what it does and how long
it should take) and as it ends (its time, cache hit or miss), read from the start-up's own spans.

A span processor, like the server's live timeline (lifecycle/timeline.py), so the progress and the phase table
read the same record: a stage's time here is its span's, and its note is `phases.span_phase(span).note`, the very
text the table prints. On a terminal the running stages are a rich live display (a spinner, the elapsed time
against the estimate) above which finished stages are printed; piped, or with no terminal, each start and end
is one plain line. Everything goes to stderr, so stdout stays the command's output (the table, the generated
text).

The estimate per stage and its basis in words come from the caller (engine/startup.py plan_start: the last start
with the same cache hits and misses, else the start-up model, engine/start_estimate.py), with a `remaining`
function that turns the stages finished and running into seconds to READY: this module only phrases them. Stages
run at once, so every line names all the stages running at that moment, and each end line says how long READY
should still take.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol, TextIO

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from glowplug.profiling.names import PRE_MAIN, stage_from_span_name
from glowplug.profiling.phases import span_phase

# What each stage does, in words a user reads while waiting. A stage not listed shows its own name.
STAGE_LABELS: Mapping[str, str] = {
    "imports": "importing torch and the engine",
    "model_prepare": "preparing the model",
    "tokenizer_init": "loading the tokenizer",
    "grammar_init": "building the tokenizer's grammar view",
    "load_weights": "loading the weights",
    "quantize_weights": "quantizing the weights",
    "model_init": "building the model",
    "native_kernels": "building the native CPU kernels",
    "dynamo_transform": "tracing the decode step",
    "graph_compile": "compiling the decode step",
    "kv_cache_profiling": "sizing the KV cache",
    "kv_cache_init": "allocating the KV cache",
    "graph_capture": "preparing each batch size",
    "warmup": "warming up",
}
PREFIX = "glowplug: "
# (finished stages, running stage -> seconds elapsed) -> seconds until READY (engine PhaseEstimate.remaining_s).
Remaining = Callable[[Collection[str], Mapping[str, float]], float]


class Estimate(Protocol):
    """What the progress lines read of a start-up estimate (engine/start_estimate.py PhaseEstimate)."""

    @property
    def seconds(self) -> Mapping[str, float]:
        """Seconds per stage (see eta_phrase)."""

    @property
    def same_config(self) -> bool:
        """Whether every stage's seconds come from a start of this config."""

    @property
    def basis(self) -> str:
        """Where the seconds come from, in words."""

    @property
    def total_s(self) -> float:
        """The stages' predicted wall time."""

    def remaining_s(self, finished: Collection[str], running: Mapping[str, float]) -> float:
        """Seconds to READY from the stages finished and running (Remaining), for the later lines."""

    def qualifiers(self) -> Mapping[str, str]:
        """Per stage, the words saying where its estimate comes from (see eta_phrase)."""


def stage_label(stage: str) -> str:
    return STAGE_LABELS.get(stage, stage.replace("_", " "))


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def eta_phrase(
    stage: str, estimate: Mapping[str, float] | None, same_config: bool, qualifiers: Mapping[str, str] | None = None
) -> str:
    """How long `stage` should take, in words: "about 25 s", "first start for this config, about 25 s" (the
    estimate is another config's), "start-up model, about 25 s", or "" when nothing predicts this stage.
    `qualifiers`: stage -> the words before the time (overrides `same_config` for the stages it names)."""
    seconds = None if estimate is None else estimate.get(stage)
    if seconds is None:
        return ""  # nothing predicts this stage: the imports line already said so
    about = "under a second" if seconds < 1 else f"about {round(seconds)} s"
    qualifier = (qualifiers or {}).get(stage, "" if same_config else "first start for this config")
    return f"{qualifier}, {about}" if qualifier else about


class _Running:
    """The live display's renderable: one spinner line per running stage, re-read at every refresh."""

    def __init__(self, progress: StartupProgress) -> None:
        self._progress = progress

    def __rich__(self) -> RenderableType:
        rows = self._progress.running_rows()
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        for stage, label, elapsed, eta in rows:
            shown = f"{label} ({stage}) {_seconds(elapsed)}" + (f", {eta}" if eta else "")
            grid.add_row(Spinner("dots", style="cyan"), Text(shown))
        ready = self._progress.ready_in()
        if rows and ready is not None:
            grid.add_row(Text(""), Text(f"READY in about {_seconds(ready)}", style="dim"))
        return Group(grid) if rows else Text("")


class StartupProgress(SpanProcessor):
    """Add to the start-up's tracer provider before the pipeline runs; `close()` when it is over.

    live: rich live display (a terminal) or plain lines; None = live when `stream` is a terminal.
    estimate / same_config: seconds per stage to expect and whether they are this config's own (see eta_phrase);
        `imports_done` sets them when the caller learns them only after the imports.
    """

    def __init__(
        self,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        estimate: Mapping[str, float] | None = None,
        same_config: bool = True,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        is_tty = hasattr(self._stream, "isatty") and self._stream.isatty()
        self._live_wanted = is_tty if live is None else live
        self._estimate = dict(estimate) if estimate else None
        self._same_config = same_config
        self._lock = threading.Lock()
        self._running: dict[str, float] = {}  # stage -> perf_counter at its start; insertion order = start order
        self._finished: set[str] = set()
        self._remaining: Remaining | None = None
        self._qualifiers: dict[str, str] = {}
        self._console = Console(
            file=self._stream,
            highlight=False,
            soft_wrap=not self._live_wanted,
            force_terminal=self._live_wanted or None,
        )
        self._live: Live | None = None
        self._closed = False

    # ------------------------------------------------------------ lines

    def _say(self, text: str, style: str = "") -> None:
        """One finished line: above the live display on a terminal, else a plain line, flushed at once (a pipe
        reader sees it now, not when the buffer fills)."""
        if self._live is not None:
            self._live.console.print(Text(text, style=style))
        else:
            self._stream.write(PREFIX + text + "\n")
            self._stream.flush()

    def begin(self, model: str) -> None:
        """The first line, printed before the heavy imports, so a cold start is never silent."""
        if self._live_wanted:
            self._live = Live(
                _Running(self),
                console=self._console,
                transient=True,
                refresh_per_second=8,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
            # On a terminal the imports get a spinner of their own: they are the first long wait.
            with self._lock:
                self._running["imports"] = time.perf_counter()
            self._say(f"starting {model}", "bold")
        else:
            self._say(f"starting {model}: importing torch and the engine...", "bold")

    def note(self, text: str) -> None:
        """A line of context between the stages (the sampling defaults of `generate`)."""
        self._say(text, "dim")

    def imports_done(self, seconds: float, estimate: Estimate | None, basis: str | None = None) -> None:
        """The imports' time and what the stages should take (see plan_known)."""
        with self._lock:
            self._running.pop("imports", None)
        self._say(f"imports done in {_seconds(seconds)}; {self._take(estimate, basis)}", "dim")

    def plan_known(self, estimate: Estimate | None, basis: str | None = None) -> None:
        """What the stages should take, once known after the imports line (a start from a bundle plans once the
        bundle is installed). `estimate`: the plan's, its seconds per stage shown and followed by the later lines;
        None or empty when there is none, and then `basis` says why in words."""
        self._say(self._take(estimate, basis), "dim")

    def _take(self, estimate: Estimate | None, basis: str | None) -> str:
        """Keep `estimate` for the stage lines; the words for what the stages should take."""
        if estimate is None or not estimate.seconds:
            remaining, qualifiers = None, {}
            expect = self._expect(None, True, basis, None)
        else:
            remaining, qualifiers = estimate.remaining_s, dict(estimate.qualifiers())
            expect = self._expect(estimate.seconds, estimate.same_config, estimate.basis, estimate.total_s)
        with self._lock:
            self._remaining = remaining
            self._qualifiers = qualifiers
        return expect

    def ready_in(self) -> float | None:
        """Seconds until READY as the estimate sees the stages now; None without one."""
        now = time.perf_counter()
        with self._lock:
            remaining, finished = self._remaining, set(self._finished)
            running = {s: now - t0 for s, t0 in self._running.items() if s != "imports"}
        return None if remaining is None else remaining(finished, running)

    def _expect(
        self, estimate: Mapping[str, float] | None, same_config: bool, basis: str | None, total_s: float | None
    ) -> str:
        self._estimate = dict(estimate) if estimate else None
        self._same_config = same_config
        if self._estimate is None:
            return "first start of this model: no estimate yet" if basis is None else f"no estimate ({basis})"
        total = sum(self._estimate.values()) if total_s is None else total_s
        return f"the stages should take about {_seconds(total)} ({basis or 'from the last start of this config'})"

    @property
    def active(self) -> bool:
        """Still showing the start-up (not closed yet)."""
        return not self._closed

    def running_rows(self) -> list[tuple[str, str, float, str]]:
        now = time.perf_counter()
        with self._lock:
            running = list(self._running.items())
        return [
            (
                stage,
                stage_label(stage),
                now - t0,
                eta_phrase(stage, self._estimate, self._same_config, self._qualifiers),
            )
            for stage, t0 in running
        ]

    def close(self, *, ready_s: float | None = None) -> None:
        """Stop the live display (before anything else is printed) and, at READY, say so."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if ready_s is not None:
            self._say(f"READY in {_seconds(ready_s)}", "bold green")
        if self._live is not None:
            self._live.stop()
            self._live = None

    # ------------------------------------------------------------ SpanProcessor (on the stage's thread)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        booked = self._book(span.name, started=True)
        if booked is not None and self._live is None:
            stage, running = booked
            eta = eta_phrase(stage, self._estimate, self._same_config, self._qualifiers)
            others = [s for s in running if s != stage]
            also = f"; also running: {', '.join(others)}" if others else ""
            self._say(f"{stage}: {stage_label(stage)}..." + (f" ({eta})" if eta else "") + also)

    def on_end(self, span: ReadableSpan) -> None:
        booked = self._book(span.name, started=False)
        if booked is None:
            return
        stage, still = booked
        phase = span_phase(span)
        if phase.outcome == "failed":
            return  # the command prints the failure itself, as one line with the cause and the fix
        took = _seconds(phase.nanos / 1e9)
        note = phase.note
        ready = self.ready_in()
        after = (f"; still running: {', '.join(still)}" if still else "") + (
            f"; READY in about {_seconds(ready)}" if ready is not None and (still or ready > 0) else ""
        )
        if phase.outcome == "skipped":
            self._say(f"{stage}: skipped ({note}){after}", "dim")
        else:
            self._say(f"{stage}: done in {took}" + (f" ({note})" if note else "") + after, "green")

    def _book(self, span_name: str, *, started: bool) -> tuple[str, list[str]] | None:
        """Record that a stage started or ended: the stage and the stages running now; None for a span that is no
        stage's (the pre-main phases, the root, foreign spans) or once the display is closed."""
        stage = stage_from_span_name(span_name)
        if stage is None or stage in PRE_MAIN:
            return None
        with self._lock:
            if self._closed:
                return None
            if started:
                self._running[stage] = time.perf_counter()
            else:
                self._running.pop(stage, None)
                self._finished.add(stage)
            return stage, list(self._running)

    def shutdown(self) -> None:
        self.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
