"""The tensor-parallel group: launching the ranks, joining them, the per-step broadcast, and failing loudly.

Two ways in:
- `glowplug serve|generate|startup --tensor-parallel-size N` (or the library with that setting): rank 0 is the
  process the user started. Its `distributed_init` stage hosts a TCP store on a free local port and starts ranks
  1..N-1 as `python -m glowplug.engine.tp_worker`, each with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as
  torchrun would set them, the engine config, a run folder for their progress, and rank 0's trace context.
- `torchrun ... -m glowplug.cli serve ...`: every rank was started by torchrun, which set the same variables; the
  store is torchrun's own (its c10d rendezvous), and rank 0 serves while the others run `serve_worker`.

Every rank runs the whole start-up pipeline (each loads only its shard); the process group is gloo on the CPU and
NCCL on CUDA, plus a gloo "control" group with a long timeout for the per-step broadcast, since a worker waits on it
for as long as the server is idle. The scheduler runs on rank 0 only: each eager model call there first broadcasts
its batch (one object: the token ids, positions and attention metadata) and the workers run the same call on their
shard; rank 0 samples, and its tokens are the ones that count.

Faults: a worker that exits (rank 0 watches the processes it started) or never joins fails the start within
--distributed-timeout, naming the rank and the last stage it began (each rank writes it to the run folder); every
other worker is then stopped, so no process is left behind. Workers watch rank 0 the same way and exit when it is
gone.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch

from .config import EngineConfig
from .tp_progress import RUNDIR_ENV, read_progress

CONFIG_ENV = "GLOWPLUG_TP_CONFIG"  # the engine config (JSON) a spawned worker builds
CACHE_ENV = "GLOWPLUG_CACHE_DIR"
TRACEPARENT_ENV = "GLOWPLUG_TRACEPARENT"  # rank 0's trace context (W3C traceparent) for the workers' spans
# How long the control group waits for the next step: a worker waits on it for as long as the server is idle; a
# dead rank 0 still ends the wait at once (its sockets close), and the worker's parent watch ends it otherwise.
CONTROL_TIMEOUT = timedelta(days=30)
POLL_S = 0.1
STOP_GRACE_S = 10.0


class DistributedError(RuntimeError):
    """A rank that died, never joined, or stopped answering: the message names it and the stage it was in."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stage_words(entry: dict[str, Any]) -> str:
    stage = entry.get("stage")
    return f"in {stage}" if stage else "before its first stage"


@dataclass
class Launch:
    """How this process got its place in the group."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    spawner: bool  # rank 0 of a self-launched group: it starts the workers and hosts the store
    agent_store: bool  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)
    rundir: Path | None

    @classmethod
    def from_env(cls, config: EngineConfig) -> Launch:
        env = os.environ
        n = config.tensor_parallel_size
        if "RANK" not in env:
            # The server that started this process (the engine core) may have chosen the folder, to read it too.
            chosen = env.get(RUNDIR_ENV)
            rundir: Path | None = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="glowplug-tp-"))
            return cls(0, n, 0, "127.0.0.1", free_port(), True, False, rundir)
        world = int(env.get("WORLD_SIZE", n))
        if world != n:
            raise DistributedError(f"WORLD_SIZE is {world} but --tensor-parallel-size is {n}: they must agree")
        rundir = Path(env[RUNDIR_ENV]) if RUNDIR_ENV in env else None
        return cls(
            int(env["RANK"]),
            world,
            int(env.get("LOCAL_RANK", env["RANK"])),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env["MASTER_PORT"]),
            False,
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            rundir,
        )


@dataclass
class TPGroup:
    """One rank's handle on the group (the `parallel` slot of the start-up, then the engine's for its life)."""

    launch: Launch
    config: EngineConfig
    backend: str
    store: Any = None
    control: Any = None
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    join_s: float = 0.0
    threads: int | None = None  # intra-op threads this rank runs with on the CPU (None: torch's default)
    serving: bool = False  # rank 0 broadcasts its steps (after READY); the workers wait in serve_worker
    _failure: str | None = None
    _stopping: bool = False
    _closed: bool = False
    _monitor: threading.Thread | None = None
    on_failure: list[Callable[[str], None]] = field(default_factory=list)

    # Rank 0's group while it exists in this process: the server shows every rank's stage from it during the
    # start, before the start-up result (which holds the group) exists. Set by `start`, cleared by `close`.
    _starting: ClassVar[TPGroup | None] = None

    @classmethod
    def rank_progress(cls) -> list[dict[str, Any]] | None:
        """Every rank's last recorded stage and state (read_progress) for this process's group, None without one.
        Rank 0 records nothing of its own: its stages are the server's own phases."""
        group = cls._starting
        if group is None or group._closed:
            return None
        return read_progress(group.launch.rundir, group.world_size)

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    # ------------------------------------------------------------------------------------------------ start
    @classmethod
    def start(cls, config: EngineConfig, cache_root: Path, device: str, traceparent: str | None) -> TPGroup:
        """Launch (rank 0 of a self-launched group), join, set up the process groups and pass the first barrier;
        raises DistributedError naming the rank that failed."""
        import torch.distributed as dist

        launch = Launch.from_env(config)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        group = cls(launch, config, backend)
        if launch.rank == 0:
            # However rank 0 ends (a command that returns, an exception), the workers stop with it.
            atexit.register(group.close)
            # What /startup and the live page read while the start runs (rank_progress); the engine's result holds
            # the group only once the start is done.
            TPGroup._starting = group
        timeout = timedelta(seconds=config.distributed_timeout)
        t0 = time.perf_counter()
        try:
            if launch.spawner:
                group.store = dist.TCPStore(
                    "127.0.0.1",
                    launch.master_port,
                    launch.world_size,
                    is_master=True,
                    timeout=timeout,
                    wait_for_workers=False,
                )
                group._spawn(cache_root, traceparent)
                group._monitor = threading.Thread(target=group._watch, name="glowplug-tp-watch", daemon=True)
                group._monitor.start()
            else:
                # The master does not wait for the others here: _wait_for_joins does, and names who is missing.
                group.store = dist.TCPStore(
                    launch.master_addr,
                    launch.master_port,
                    launch.world_size,
                    is_master=launch.rank == 0 and not launch.agent_store,
                    timeout=timeout,
                    wait_for_workers=False,
                )
            group.store.set(f"glowplug/joined/{launch.rank}", "1")
            group._wait_for_joins()
            if backend == "nccl":
                torch.cuda.set_device(launch.local_rank)
            else:
                group.threads = group._share_cores()
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("glowplug/pg", group.store),
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
            )
            group.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            if backend == "gloo":
                # Names the rank that does not arrive, where a plain barrier would only time out.
                dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
            else:
                dist.barrier()
        except Exception as exc:
            failure = group.failure()
            group.close()
            if failure is not None:
                raise DistributedError(failure) from exc
            raise
        group.join_s = time.perf_counter() - t0
        return group

    def _share_cores(self) -> int:
        """The ranks on this machine split its cores: each takes its share of intra-op threads. Left at torch's
        default (every core), N ranks would run N x cores threads that preempt one another inside every
        collective's wait."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))  # torchrun says; self-launched: all here
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // max(1, local))
        torch.set_num_threads(threads)
        return threads

    def _spawn(self, cache_root: Path, traceparent: str | None) -> None:
        launch = self.launch
        for r in range(1, launch.world_size):
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(launch.world_size),
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(launch.master_port),
                CONFIG_ENV: self.config.model_dump_json(),
                CACHE_ENV: str(cache_root),
                "GLOWPLUG_TP_PARENT": str(os.getpid()),
            }
            if launch.rundir is not None:
                env[RUNDIR_ENV] = str(launch.rundir)
            if traceparent is not None:
                env[TRACEPARENT_ENV] = traceparent
            # A session of its own: Ctrl-C in the terminal reaches rank 0, which stops the workers itself.
            self.workers[r] = subprocess.Popen(
                [sys.executable, "-m", "glowplug.engine.tp_worker"], env=env, start_new_session=True
            )

    def _wait_for_joins(self) -> None:
        """Every rank's key in the store, or the first that cannot come: a worker that exited, or the timeout."""
        deadline = time.monotonic() + self.config.distributed_timeout
        keys = [f"glowplug/joined/{r}" for r in range(self.world_size)]
        while True:
            if self._failure is not None:
                raise DistributedError(self._failure)
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                return
            if time.monotonic() > deadline:
                progress = read_progress(self.launch.rundir, self.world_size)
                names = ", ".join(f"rank {r} ({_stage_words(progress[r])})" for r in missing)
                raise DistributedError(
                    f"{names} never joined the tensor-parallel group within "
                    f"--distributed-timeout {self.config.distributed_timeout:g} s"
                )
            time.sleep(POLL_S)

    def _watch(self) -> None:
        """Rank 0's watch over the workers it started: the first that exits while the group is up is a failure."""
        while not self._stopping:
            for r, p in self.workers.items():
                code = p.poll()
                if code is not None and not self._stopping:
                    entry = read_progress(self.launch.rundir, self.world_size)[r]
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                    self._fail(f"tensor-parallel rank {r} (pid {p.pid}) {how} {_stage_words(entry)}")
                    return
            time.sleep(POLL_S)

    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
            self._terminate_workers()
            for callback in list(self.on_failure):
                callback(message)

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Call `callback` with the message when a rank fails (the server turns FAILED, even while idle)."""
        self.on_failure.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def failure(self) -> str | None:
        """The first rank failure seen (None while every rank is up)."""
        return self._failure

    def raise_failure(self, exc: BaseException) -> None:
        """Re-raise a collective's error as the rank failure behind it, when one was seen."""
        # The collective usually notices first (the dead rank's sockets close); give the watch a moment to name it.
        deadline = time.monotonic() + 1.0
        while self._failure is None and self.workers and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
        if self._failure is not None:
            raise DistributedError(self._failure) from exc

    # --------------------------------------------------------------------------------------------- collectives
    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks: each rank's budget is measured on its own)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except RuntimeError as exc:
            self.raise_failure(exc)
            raise
        return int(t.item())

    def send_step(self, payload: dict[str, Any] | None) -> None:
        """Rank 0: the batch of the model call it is about to make (None: stop)."""
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([payload], src=0, group=self.control)
        except RuntimeError as exc:
            self.raise_failure(exc)
            raise

    def receive_step(self) -> dict[str, Any] | None:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[no-any-return]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, on every rank (the start-up records, once at READY)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    # ------------------------------------------------------------------------------------------------- stop
    def _terminate_workers(self) -> None:
        for p in self.workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        self._reap_workers()

    def _reap_workers(self) -> None:
        """Wait for every worker for up to STOP_GRACE_S in all, and kill those still running then."""
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.workers.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        """Stop every rank and leave the group: rank 0 tells the workers to stop (when they can still hear it),
        waits for them, and kills any that do not exit. Idempotent; registered at exit by rank 0."""
        if self._closed:
            return
        self._closed = True
        if TPGroup._starting is self:
            TPGroup._starting = None
        import torch.distributed as dist

        if self.rank == 0 and self.serving and self._failure is None and self.control is not None:
            # The workers wait for the next step: tell them to stop. On a thread, so that a worker that no longer
            # listens cannot hold rank 0 here; the wait below then ends it.
            def stop() -> None:
                try:
                    self.send_step(None)
                except Exception:  # noqa: BLE001 - a worker already gone: the wait below still reaps the rest
                    pass

            sender = threading.Thread(target=stop, name="glowplug-tp-stop", daemon=True)
            sender.start()
            sender.join(STOP_GRACE_S)
        elif self.workers:
            # Still starting (or a rank failed): nobody listens for a stop message; a signal ends them.
            for p in self.workers.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        self._stopping = True
        self._reap_workers()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving a broken group: nothing more to release
                pass
        self.store = None
        if self.launch.spawner and self.launch.rundir is not None:
            import shutil

            shutil.rmtree(self.launch.rundir, ignore_errors=True)


def worker_trace_context() -> Any:
    """A worker's parent context for its start-up span: rank 0's, from the traceparent it was handed (None for
    rank 0, or without one), so that every rank's spans are one trace."""
    carrier = os.environ.get(TRACEPARENT_ENV)
    if carrier is None or os.environ.get("RANK", "0") == "0":
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": carrier})


def watch_parent(parent_pid: int) -> None:
    """A worker exits when the process that started it is gone (no worker outlives rank 0)."""

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="glowplug-tp-parent", daemon=True).start()
