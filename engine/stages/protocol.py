"""The start-up stage protocol: what a stage declares and returns, and the checks on a pipeline before it runs.

A stage does its work and returns a StageReport; it never times itself. The runner (engine/stages/runner.py)
opens `glowplug.startup.<stage>` around each one, so the span is the single record the phase table, the logs and
the server's `/startup` read. Adding, skipping or reordering phases is an edit of the list passed in.

Contracts: every stage declares `needs` (the context slots it reads) and `provides` (the slots it writes), and
gets a `ContextView` (engine/stages/view.py) of the context instead of the context itself. The declared names are
checked against the context's fields before any stage runs, so a typo fails the pipeline at once.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, ClassVar, Protocol, runtime_checkable

from opentelemetry.trace import SpanContext

from glowplug.base.errors import one_line

# What OpenTelemetry accepts as an attribute value (homogeneous sequences only).
AttrValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]


@dataclass
class StageReport:
    """What a stage tells the runner; everything here ends up on the stage's span.

    skipped_reason: the stage ran but had nothing to do ("skipped: no CUDA", "cache hit", "--compile off"); its
        table row then shows no time and this reason.
    row: the table row to book the time to when it is not the stage's default, e.g. graph_compile reports
        "graph_compile_cached" on a cache hit and "graph_compile_general_shape" on a miss.
    """

    attributes: dict[str, AttrValue] = field(default_factory=dict)
    skipped_reason: str | None = None
    row: str | None = None

    @classmethod
    def skipped(cls, reason: str, attributes: Mapping[str, AttrValue] | None = None) -> StageReport:
        """`StageReport.skipped("skipped: no CUDA")`."""
        return cls(attributes=dict(attributes or {}), skipped_reason=reason)


class StageContractError(RuntimeError):
    """A stage declared, read or wrote a context slot against its contract (engine/stages/view.py)."""


@dataclass
class StartupContext:
    """State the stages share. The engine subclasses this with typed fields; every field is either an input or a
    slot.

    INPUTS: the fields set before the first stage runs (the config, and in subclasses such things as the cache
        folder and the device). Every stage may read them without declaring them; no stage may write them.
    Slots: every other field. A stage reads a slot only when it declares it in `needs`, and writes it only when it
        declares it in `provides`.
    """

    INPUTS: ClassVar[frozenset[str]] = frozenset({"config"})

    config: Any

    @classmethod
    def slot_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclass_fields(cls)) - cls.INPUTS


@runtime_checkable
class Stage(Protocol):
    """One start-up phase. `name` is the span-name suffix and (unless the report overrides it) the table row.

    needs: the context slots `run` reads (written by earlier stages); `()` for none.
    provides: the context slots `run` writes; `()` for none. A stage that does its work (its report is not
        skipped) writes each of them, unless a comment at the declaration names the path that writes it; one that
        changes a slot's object in place stores it back, so the write is what the contract and the schedule see.
    An optional `barrier = True` makes the stage run alone (engine/stages/schedule.py).
    An optional `cpu_bound(config) -> bool` says the stage keeps every core busy under that config; with few cores
    such stages run one at a time (engine/stages/schedule.py).
    `run` gets a ContextView of the context, which has the context's attributes.
    """

    name: str
    needs: tuple[str, ...]
    provides: tuple[str, ...]

    def run(self, ctx: Any) -> StageReport: ...


def declarations(stage: Stage) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(needs, provides) of `stage`; StageContractError when it does not declare both as slot-name tuples."""
    declared: list[tuple[str, ...]] = []
    for kind in ("needs", "provides"):
        value = getattr(stage, kind, None)
        if value is None:
            raise StageContractError(
                f"stage {stage.name!r} declares no `{kind}`: every stage declares the context "
                f"slots it reads (needs) and writes (provides), `()` for none"
            )
        if isinstance(value, str) or not all(isinstance(slot, str) for slot in value):
            raise StageContractError(f"stage {stage.name!r}: `{kind}` must be a tuple of slot names, not {value!r}")
        declared.append(tuple(value))
    return declared[0], declared[1]


def is_barrier(stage: Stage) -> bool:
    barrier = getattr(stage, "barrier", False)
    if not isinstance(barrier, bool):
        raise StageContractError(f"stage {stage.name!r}: `barrier` must be True or False, not {barrier!r}")
    return barrier


def check_pipeline(stages: Sequence[Stage], context_type: type[StartupContext]) -> None:
    """Before anything runs: unique names, and every stage's declarations naming slots of `context_type`."""
    _check_names(stages)
    slots = context_type.slot_names()
    for stage in stages:
        is_barrier(stage)
        for kind, declared in zip(("needs", "provides"), declarations(stage), strict=True):
            for slot in declared:
                if slot in context_type.INPUTS:
                    raise StageContractError(
                        f"stage {stage.name!r} declares {slot!r} in {kind}, but it is an input: every stage reads "
                        f"the inputs ({names_text(context_type.INPUTS)}) without declaring them, and none writes them"
                    )
                if slot not in slots:
                    close = difflib.get_close_matches(slot, sorted(slots), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise StageContractError(
                        f"stage {stage.name!r} declares {slot!r} in {kind}, which is not a slot of "
                        f"{context_type.__name__}{hint} (slots: {names_text(slots)})"
                    )


def names_text(names: Sequence[str] | frozenset[str]) -> str:
    """The names for an error message, comma-separated (a set sorted), "none" when empty."""
    return ", ".join(sorted(names) if isinstance(names, frozenset) else names) or "none"


@dataclass(frozen=True)
class StageResult:
    name: str
    row: str
    seconds: float
    report: StageReport
    span_context: SpanContext
    start_ns: int = 0  # perf_counter_ns at the stage's start and end (critical path, overlap)
    end_ns: int = 0
    thread: str = ""
    reads: frozenset[str] = frozenset()  # the slots it read from earlier stages (see ContextView)
    writes: frozenset[str] = frozenset()  # the slots it wrote


class StartupFailed(RuntimeError):
    """A stage raised; `stage` names it and `cause` is the original exception (also `__cause__`)."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        self.stage = stage
        self.cause = cause
        self.reason = one_line(cause)
        super().__init__(f"start-up failed in {stage}: {self.reason}")


def _check_names(stages: Sequence[Stage]) -> None:
    # Duplicates would book two spans to one row and make "which one failed" ambiguous.
    seen: set[str] = set()
    for stage in stages:
        name = getattr(stage, "name", None)
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"stage {stage!r} needs a non-empty `name` without dots (got {name!r})")
        if name in seen:
            raise ValueError(f"stage {name!r} appears twice in the pipeline")
        seen.add(name)
