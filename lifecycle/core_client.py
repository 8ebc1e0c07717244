"""The API server's end of the engine core: it starts the core, sends it requests, turns its outputs into text for
each request, and watches it.

The core (engine/core_proc.py) is a process of its own, so the model step never waits for this process's GIL:
HTTP, JSON, tokenizing, detokenizing, stop strings and SSE framing all happen here. A server built with an engine
factory (tests, embedders) runs the same core code on a thread instead: the frames and the sockets are the same,
only the process boundary is missing.

Two ZMQ sockets over IPC, both bound here (a restarted core gets fresh ones, so nothing meant for the old core
reaches the new one): frames to the core (PUSH) and from it (PULL), msgpack through engine/core_frames.py. The
core sends one StepOutputs frame per step, whatever the number of streams; this side runs the OutputProcessor over
it (engine/outputs.py: incremental text, stop strings, which it tells the core as FinishSeq) and hands every
request's events to its sink (lifecycle/generation.py) in one pass. The frame also carries the core's queues,
counters and the step's timing: the gauges and admission read those (`load`, `on_step`).

Faults: the core's exit is noticed within WATCH_S. Before READY it is a failed start (the server stays up and
says why, as for any failed start). After READY every open request ends with an error event, readiness turns 503
with the reason, and then either a new core starts (`--restart-core`, a new start-up and trace) or the server
exits with status 1 after `--failed-exit-delay` (the `on_fatal` callback). Start-up frames go to the progress owner.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from glowplug.engine.config import EngineConfig
from glowplug.engine.core_frames import (
    AbortRequests,
    AddRequest,
    CoreLoad,
    CoreSpec,
    Failed,
    FinishSeq,
    FromCore,
    Notice,
    PhaseEntered,
    Planned,
    Ready,
    Refused,
    Shutdown,
    SpanEnded,
    SpanStarted,
    StepOutputs,
    decode_frame,
    encode_frame,
)
from glowplug.engine.core_proc import CORE_SPEC_ENV, EngineFactory
from glowplug.engine.outputs import OutputProcessor, check_request
from glowplug.engine.sampling_params import SamplingParams
from glowplug.profiling.process import ProcessMarks

from .config import ServeConfig
from .generation import Ended, Scheduled, Sink
from .metrics import ServiceMetrics
from .progress import Progress
from .state import EngineState

log = structlog.get_logger("glowplug.lifecycle.core")

WATCH_S = 0.1  # how often the core's liveness is checked: a dead core is noticed within this
STOP_GRACE_S = 10.0  # after Shutdown, how long the core may take to exit before it is killed


@dataclass(frozen=True)
class EngineInfo:
    """What request handling may read about the engine (fixed once READY): the tokenizer (loaded in this process
    from the core's model folder), the context length, and the core's own request check."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's own check (vocabulary and length), worded exactly as the core words it."""
        check_request(prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)


@dataclass(frozen=True)
class StepReport:
    """One step as the core timed it, for whoever sizes admission from it."""

    step_s: float
    prefill_tokens: int
    decode_rows: int
    prefill_s: float


class CoreClient:
    def __init__(
        self,
        config: EngineConfig,
        serve_cfg: ServeConfig,
        *,
        progress: Progress,
        metrics: ServiceMetrics,
        factory: EngineFactory | None = None,
        marks: ProcessMarks | None = None,
        log_json: bool | None = None,
        quiet_stages: bool = False,
        configure_core_logs: bool = True,
    ) -> None:
        self.config = config
        self.serve_cfg = serve_cfg
        self.progress = progress
        self.metrics = metrics
        self._factory = factory
        self._marks = marks
        self._log_json = log_json
        self._quiet_stages = quiet_stages
        self._configure_core_logs = configure_core_logs and factory is None
        self.engine_info: EngineInfo | None = None
        self.load: CoreLoad | None = None
        self.on_step: Callable[[StepReport], None] = lambda _report: None
        self.on_request_end: Callable[[], None] = lambda: None
        self.on_fatal: Callable[[str], None] = lambda _reason: None  # a core died after READY, no restart
        self.on_notice: Callable[[Notice], None] = lambda _notice: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._push: Any = None
        self._pull: Any = None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._processor: OutputProcessor | None = None
        self._sinks: dict[str, Sink] = {}
        self._unscheduled: set[str] = set()
        self._stopping = False
        self._failure: str | None = None  # what the core said when it failed (Failed frame)
        self._ready_seen = False
        self._prompt_seen = 0
        self._generated_seen = 0
        self.restarts = 0

    # ------------------------------------------------------------ life

    @property
    def alive(self) -> bool:
        """The core runs (started, not exited)."""
        if self._proc is not None:
            return self._proc.poll() is None
        return self._thread is not None and self._thread.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Bind the sockets and start the core; call on the event loop that serves the requests."""
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context(1)
        self._dir = Path(tempfile.mkdtemp(prefix="glowplug-core-"))
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never blocks the event loop; the core reads every loop turn
        self._push.bind(f"ipc://{self._dir}/to-core")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(f"ipc://{self._dir}/from-core")
        self._stopping = False
        self._failure = None
        self._ready_seen = False
        self.engine_info = None
        self.load = None
        start = self.progress.begin()
        # Before the core exists: a prediction without torch, so /startup has a predicted READY from the first second.
        self.progress.predict_early(self.config, skip=self._factory is not None and self.config.bundle is not None)
        tp_rundir = None
        if self.config.tensor_parallel_size > 1:
            tp_rundir = self._dir / "ranks"
            tp_rundir.mkdir()
            self.progress.tp_rundir = tp_rundir
        spec = CoreSpec(
            config_json=self.config.model_dump_json(),
            to_core=f"ipc://{self._dir}/to-core",
            from_core=f"ipc://{self._dir}/from-core",
            server_pid=os.getpid(),
            traceparent=start.traceparent,
            origin_ns=start.origin_ns,
            pre_spans=start.pre_spans,
            configure_logs=self._configure_core_logs,
            log_level=self.serve_cfg.log_level,
            log_json=self._log_json,
            quiet_stages=self._quiet_stages,
            tp_rundir=None if tp_rundir is None else str(tp_rundir),
        )
        self._tasks = [
            self._loop.create_task(self._receive(), name="glowplug-core-receive"),
            self._loop.create_task(self._watch(), name="glowplug-core-watch"),
        ]
        if self._factory is not None:
            self._start_thread(spec)
        else:
            self._start_process(spec)

    def _start_process(self, spec: CoreSpec) -> None:
        clock = self._marks.clock if self._marks is not None else None
        spec.spawn_ns = clock.now_ns() if clock is not None else time.time_ns()
        env = {**os.environ, CORE_SPEC_ENV: msgspec.json.encode(spec).decode()}
        # A session of its own: Ctrl-C in the terminal reaches the server, which drains and then stops the core.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "glowplug.engine.core_proc"], env=env, start_new_session=True
        )
        self._thread = None
        self.metrics.core_pid = self._proc.pid
        log.info("engine core started", pid=self._proc.pid)

    def _start_thread(self, spec: CoreSpec) -> None:
        from glowplug.engine.core_proc import run_core

        factory = self._factory
        self._proc = None
        self._thread = threading.Thread(
            target=run_core,
            args=(spec,),
            kwargs={"factory": factory, "in_thread": True},
            name="glowplug-engine-core",
            daemon=True,
        )
        self._thread.start()

    async def stop(self, reason: str = "the server is shutting down") -> None:
        """Tell the core to shut down (it aborts what is left), wait for it to exit, close the sockets."""
        self._stopping = True
        for rid in list(self._sinks):
            self._end(rid, "abort", reason, 503)
        if self.alive and self._push is not None:
            self._send(Shutdown(reason))
        await asyncio.to_thread(self._join, STOP_GRACE_S)
        await self._close_channel()

    def _join(self, timeout: float) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine core did not stop in time; killing it", pid=self._proc.pid)
                self._proc.kill()
                self._proc.wait()
            log.info("engine core stopped", pid=self._proc.pid, exit_code=self._proc.returncode)
        elif self._thread is not None:
            self._thread.join(timeout)

    async def _close_channel(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current and not task.done():
                task.cancel()
        self._tasks = []
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(0)
        self._push = self._pull = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """Last resort (the server exits without a drain): no core is left behind."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)

    # ------------------------------------------------------------ requests (event loop)

    def _send(self, frame: Any) -> None:
        if self._push is not None:
            self._push.send(encode_frame(frame), copy=False)

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink, arrival_time: float
    ) -> None:
        processor = self._processor
        assert processor is not None, "submit before READY"
        processor.add(request_id, None, prompt_token_ids, params, arrival_time)
        self._sinks[request_id] = sink
        self._unscheduled.add(request_id)
        self._send(AddRequest(request_id, prompt_token_ids, params, arrival_time))

    def abort(self, request_id: str, *, notify: bool = False) -> None:
        """The request's client is gone (or the server gives up on it): the core frees its blocks next loop turn."""
        self._abort_local(request_id)
        self._send(AbortRequests([request_id]))
        sink = self._sinks.pop(request_id, None)
        if notify and sink is not None:
            sink(Ended(request_id, "abort", "the request was aborted", 503))

    def abort_all(self, message: str) -> None:
        """Abort every request in the core; each sink gets Ended("abort")."""
        ids = list(self._sinks)
        for rid in ids:
            self._end(rid, "abort", message, 503)
        if ids:
            self._send(AbortRequests(ids))

    def _abort_local(self, request_id: str) -> None:
        self._unscheduled.discard(request_id)
        generated = self._processor.abort(request_id) if self._processor is not None else None
        if generated:
            self.metrics.aborted_generation_tokens.inc(generated)

    def _end(self, request_id: str, reason: str, message: str, status: int) -> None:
        self._abort_local(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(Ended(request_id, reason, message, status))

    # ------------------------------------------------------------ frames from the core (event loop)

    async def _receive(self) -> None:
        pull = self._pull
        while True:
            try:
                data = await pull.recv(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                frame = decode_frame(data.buffer, FromCore)
                if isinstance(frame, StepOutputs):
                    self._outputs(frame)
                else:
                    await self._control(frame)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken frame must not end the server's only link to the core
                log.error("core frame failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    def _outputs(self, frame: StepOutputs) -> None:
        processor = self._processor
        if processor is None:
            return
        sinks = self._sinks
        if frame.first_scheduled:
            processor.scheduled(frame.first_scheduled, frame.schedule_time)
            for rid in frame.first_scheduled:
                if rid in self._unscheduled:
                    self._unscheduled.discard(rid)
                    sink = sinks.get(rid)
                    if sink is not None:
                        sink(Scheduled(rid))
        if frame.load is not None:
            self._note_load(frame.load)
        if not frame.partial:
            self.metrics.engine_step.observe(frame.step_s)
            self.on_step(StepReport(frame.step_s, frame.prefill_tokens, frame.decode_rows, frame.prefill_s))
        if not frame.updates:
            return
        stopped: list[tuple[str, int]] = []
        discarded = processor.discarded
        outputs = processor.process(frame.updates, stopped)
        if processor.discarded > discarded:
            self.metrics.aborted_generation_tokens.inc(processor.discarded - discarded)
        for out in outputs:
            sink = sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del sinks[out.request_id]
                self._unscheduled.discard(out.request_id)
            sink(out)
        for rid, index in stopped:
            self._send(FinishSeq(rid, index))

    def _note_load(self, load: CoreLoad) -> None:
        self.load = load
        m = self.metrics
        m.set_engine_gauges(running=load.running_requests, used_blocks=load.kv_used_blocks, total_blocks=load.kv_blocks)
        if load.num_prompt_tokens > self._prompt_seen:
            m.prompt_tokens.inc(load.num_prompt_tokens - self._prompt_seen)
        if load.num_generated_tokens > self._generated_seen:
            m.generation_tokens.inc(load.num_generated_tokens - self._generated_seen)
        self._prompt_seen, self._generated_seen = load.num_prompt_tokens, load.num_generated_tokens

    async def _control(self, frame: Any) -> None:
        progress = self.progress
        if isinstance(frame, SpanStarted):
            progress.span_started(frame.span)
        elif isinstance(frame, SpanEnded):
            progress.span_ended(frame.span, frame.live)
        elif isinstance(frame, PhaseEntered):
            progress.phase_entered(frame.name)
        elif isinstance(frame, Planned):
            progress.planned(frame)
        elif isinstance(frame, Ready):
            await self._ready(frame)
        elif isinstance(frame, Failed):
            self._failure = frame.reason
            self._core_failed(frame.reason)
        elif isinstance(frame, Refused):
            self._end(frame.request_id, "error", frame.message, frame.status)
        elif isinstance(frame, Notice):
            self.on_notice(frame)

    async def _ready(self, frame: Ready) -> None:
        from glowplug.engine.tokenizer import load_tokenizer

        # The tokenizer this process encodes and decodes with: the core's, loaded from the folder it prepared.
        tokenizer = await asyncio.to_thread(load_tokenizer, Path(frame.model_dir))
        if frame.tokenizer_shape is not None:
            tokenizer.adopt_shape(frame.tokenizer_shape)
        self._processor = OutputProcessor(tokenizer)
        self.engine_info = EngineInfo(tokenizer, frame.max_model_len, frame.vocab_size)
        # Baselines: the warm-up ran before serving and is not traffic.
        self.load = frame.load
        self._prompt_seen, self._generated_seen = frame.load.num_prompt_tokens, frame.load.num_generated_tokens
        self._ready_seen = True
        if not self.progress.ready(frame.phase_table, frame.ready_ns):
            return  # a drain began meanwhile: the server stops the core
        self.metrics.set_phase_durations(self.progress.table_seconds())
        # One total: the phase table's time to READY (process creation -> READY), the same number as the table,
        # /startup and the page.
        log.info(
            "engine ready",
            startup_s=round(self.progress.startup_total_s(), 3),
            model=self.config.model,
            core_pid=frame.pid or None,
        )

    # ------------------------------------------------------------ faults

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if self.alive:
                continue
            if self._stopping:
                return
            # Frames the core sent before it went (Failed, the last outputs) are read first.
            await asyncio.sleep(WATCH_S)
            reason = self._failure or self._exit_words()
            self._core_failed(reason)
            if self._ready_seen and not self._stopping:
                await self._after_death(reason)
            return

    def _exit_words(self) -> str:
        if self._proc is None:
            return "the engine core thread ended"
        code = self._proc.returncode
        killed = code is not None and code < 0
        how = f"was killed by {signal.Signals(-code).name}" if killed else f"exited with status {code}"
        stage = self.progress.phase_text()
        where = f" during {stage}" if stage else ""
        return f"the engine core (pid {self._proc.pid}) {how}{where}"

    def _core_failed(self, reason: str) -> None:
        """FAILED, and every open request ends with an error (its stream with an error event)."""
        self.progress.failed(reason)
        for rid in list(self._sinks):
            self._end(rid, "error", f"the engine failed: {reason}", 500)

    async def _after_death(self, reason: str) -> None:
        await self._close_channel_keep_watch()
        if self.serve_cfg.restart_core and self.progress.snapshot().state is EngineState.FAILED:
            self.restarts += 1
            self.metrics.core_restarts.inc()
            log.warning("engine core died; starting a new one", reason=reason, restarts=self.restarts)
            self.progress.restart()
            self.start()
            return
        log.error("engine core died", reason=reason, exit_in_s=self.serve_cfg.failed_exit_delay)
        self.on_fatal(reason)

    async def _close_channel_keep_watch(self) -> None:
        """Close the dead core's sockets (its watch task is the caller and ends by itself)."""
        self._stopping = True
        self._processor = None
        await self._close_channel()
