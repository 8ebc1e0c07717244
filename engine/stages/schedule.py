"""The thread scheduler of the start-up stages: which stage waits for which, and running them side by side.

Overlap: a stage waits only for the latest earlier stages that provide what it needs (and for the latest earlier
stage that provides a slot it also provides, so two writers of one slot keep their list order); independent
stages run at the same time, each on its own thread, with the OpenTelemetry context (and every other contextvar)
copied in so its span still hangs off the start-up span. The schedule comes from the declarations alone. A stage
that must run alone sets `barrier = True`: it waits for everything before it and everything after it waits for
it (its view still holds it to its declarations). No engine stage is one; test harnesses that pace a start-up one
stage at a time are.

Few cores: a stage whose `cpu_bound(config)` says it keeps every core busy (the Dynamo trace, the Inductor compile,
a measured KV profile) does not run beside another such stage when the process may use fewer than
`SERIAL_CPU_BOUND_BELOW_CORES` cores (`os.sched_getaffinity`): each then waits for the CPU-bound stage before it in
list order as well, so the overlap is never two stages sharing two cores. The decision and its reason are on the
start-up span (`glowplug.stage_concurrency`, `glowplug.usable_cores`) and, on each stage it delayed, which stage it
now waits for (`glowplug.scheduling`); the extra wait is in `glowplug.waits_for`, so the critical path includes it.

Failure: the first stage in pipeline order among those that failed is the one reported (so two stages failing at
once always give the same answer); no stage starts after a failure, and the ones already running are joined
before the error is raised, so no thread outlives the start-up.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .protocol import Stage, StageContractError, StageResult, declarations, is_barrier, names_text

# Below this many usable cores, CPU-bound stages run one after another instead of side by side. 2, so only a single
# core serializes them: there, two such stages can only share it. On the 2-core AMD EPYC, cold default-model starts
# with a measured KV profile beside the compile were not slower than with it after the compile (READY minus the
# load_weights row, which disk stalls from other jobs inflated: median 36.7 s overlapped vs 44.5 s one after the
# other over 6 interleaved pairs; the quietest pair 16.3 s vs 18.5 s): the compile leaves part of the second core
# idle (Dynamo and Inductor's code generation are single-threaded Python), which the profile's forward fills.
SERIAL_CPU_BOUND_BELOW_CORES: Final = 2


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows), else the CPU
    count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def is_cpu_bound(stage: Stage, config: Any) -> bool:
    """The stage's `cpu_bound(config)` where it declares one; False otherwise."""
    probe = getattr(stage, "cpu_bound", None)
    if probe is None:
        return False
    verdict = probe(config)
    if not isinstance(verdict, bool):
        raise StageContractError(
            f"stage {stage.name!r}: `cpu_bound(config)` must return True or False, not {verdict!r}"
        )
    return verdict


@dataclass(frozen=True)
class Concurrency:
    """Whether CPU-bound stages may run side by side on this machine, and why (see the module docstring).

    serial: the CPU-bound stages, in list order, that run one after another (empty when they may overlap).
    """

    cores: int
    serial: tuple[str, ...]
    reason: str


def plan_concurrency(stages: Sequence[Stage], config: Any, cores: int | None = None) -> Concurrency:
    """The decision for this pipeline under `config` on `cores` usable cores (default: this process's)."""
    cores = usable_cores() if cores is None else cores
    heavy = tuple(s.name for s in stages if is_cpu_bound(s, config))
    have = f"{cores} usable core{'' if cores == 1 else 's'}"
    if cores >= SERIAL_CPU_BOUND_BELOW_CORES:
        return Concurrency(cores, (), f"{have}: CPU-bound stages may run side by side")
    if len(heavy) < 2:
        return Concurrency(cores, (), f"{have}: at most one CPU-bound stage ({names_text(heavy)})")
    return Concurrency(
        cores,
        heavy,
        f"{have} (under {SERIAL_CPU_BOUND_BELOW_CORES}): CPU-bound stages run one after another ({' -> '.join(heavy)})",
    )


def stage_dependencies(stages: Sequence[Stage], serial: Sequence[str] = ()) -> dict[str, tuple[str, ...]]:
    """stage name -> the names of the earlier stages it must wait for (see the module docstring).

    serial: stages that run one after another (Concurrency.serial): each also waits for the one before it there."""
    deps: dict[str, tuple[str, ...]] = {}
    previous_serial: str | None = None
    last_provider: dict[str, str] = {}
    barrier: str | None = None
    since_barrier: list[str] = []
    for stage in stages:
        needs, provides = declarations(stage)
        if is_barrier(stage):
            wait = list(since_barrier) if since_barrier else ([barrier] if barrier else [])
            deps[stage.name] = tuple(wait)
            barrier, since_barrier = stage.name, []
            last_provider = {}
            continue
        wanted = [last_provider[slot] for slot in (*needs, *provides) if slot in last_provider]
        if barrier is not None:
            wanted.append(barrier)
        if stage.name in serial:
            if previous_serial is not None:
                wanted.append(previous_serial)
            previous_serial = stage.name
        deps[stage.name] = tuple(dict.fromkeys(wanted))
        for slot in provides:
            last_provider[slot] = stage.name
        since_barrier.append(stage.name)
    return deps


_Outcome = tuple[str, "StageResult | BaseException"]


# Runs one stage: (stage, the stages it waited for, why the few cores made it wait longer or None).
RunOne = Callable[[Stage, tuple[str, ...], "str | None"], StageResult]


def run_scheduled(stages: Sequence[Stage], concurrency: Concurrency, run_one: RunOne) -> list[StageResult]:
    """Start every stage whose dependencies are done; one of the ready stages runs on this thread (a sequential
    pipeline then never leaves it, and Ctrl-C lands where it always did), the others on threads of their own.
    Results in list order; the first failure in list order is raised once every running stage is joined."""
    deps = stage_dependencies(stages, concurrency.serial)
    declared = stage_dependencies(stages)
    # The waits the few cores added (not implied by a needed slot): said on the span of the stage that waits.
    scheduling = {
        name: f"runs after {', '.join(added)}, not beside it: {concurrency.reason}"
        for name in deps
        if (added := [d for d in deps[name] if d not in declared[name]])
    }
    pending = list(stages)
    done: dict[str, StageResult] = {}
    errors: dict[str, BaseException] = {}
    finished: queue.Queue[_Outcome] = queue.Queue()
    threads: dict[str, threading.Thread] = {}

    def run(stage: Stage) -> StageResult:
        return run_one(stage, deps[stage.name], scheduling.get(stage.name))

    def on_thread(stage: Stage) -> None:
        try:
            finished.put((stage.name, run(stage)))
        except BaseException as exc:  # noqa: BLE001 - handed to the scheduling thread, which re-raises it
            finished.put((stage.name, exc))

    def collect(outcome: _Outcome) -> None:
        name, value = outcome
        threads.pop(name, None)
        if isinstance(value, BaseException):
            errors[name] = value
        else:
            done[name] = value

    try:
        while pending and not errors:
            ready = [s for s in pending if all(d in done for d in deps[s.name])]
            if not ready:
                collect(finished.get())  # something is running (the dependencies are acyclic by construction)
                continue
            inline, *others = ready
            for stage in others:
                pending.remove(stage)
                # A copy of this thread's contextvars: the OpenTelemetry context, structlog's bound fields.
                context = contextvars.copy_context()
                thread = threading.Thread(
                    target=context.run, args=(on_thread, stage), name=f"glowplug-stage-{stage.name}", daemon=True
                )
                threads[stage.name] = thread
                thread.start()
            pending.remove(inline)
            try:
                done[inline.name] = run(inline)
            except BaseException as exc:  # noqa: BLE001 - decided below, after the other stages are joined
                errors[inline.name] = exc
            while True:  # take what the other threads finished meanwhile without blocking
                try:
                    collect(finished.get_nowait())
                except queue.Empty:
                    break
    finally:
        # Join every running stage before anything is raised: a stage must not keep writing into the context of
        # a start-up that is already reported as failed (or interrupted).
        while threads:
            collect(finished.get())
    if errors:
        order = [s.name for s in stages]
        first = min(errors, key=order.index)
        raise errors[first]
    return [done[s.name] for s in stages]
