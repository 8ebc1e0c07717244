"""Runs the engine's start-up on a background thread, so the HTTP port is open (and answering 503 with the
current phase) for the whole start-up instead of after it.

The heavy engine import (torch, transformers) happens on this thread too, booked as the `imports` phase. Before it,
the runner makes a prediction that needs no torch (engine/start_profile.py `predict_before_start`), so `/startup`
has a predicted READY time and its basis from the first second; the engine's own plan, made after the imports
with every cache probe, replaces it. The factory is `glowplug.engine.startup.build_engine` unless one is injected (tests, embedders); it is called with
whichever of `on_phase`, `tracing`, `marks` its signature accepts, so older and newer factories both work.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from glowplug.engine.config import EngineConfig
from glowplug.profiling.names import IMPORTS
from glowplug.profiling.process import ProcessMarks
from glowplug.profiling.tracing import Tracing

from .state import Lifecycle

log = structlog.get_logger("glowplug.lifecycle.startup")

EngineFactory = Callable[..., Any]  # (config, *, on_phase=, tracing=, marks=) -> StartupResult-like (has .engine)

_STARTUP_MODULE = "glowplug.engine.startup"


def factory_kwargs(factory: EngineFactory, offered: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of `offered` keyword arguments that `factory` accepts."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def phase_table_seconds(result: Any) -> dict[str, float]:
    """Leaf rows (with a time) of the result's phase table, if the factory made one; else empty."""
    table = getattr(result, "phase_table", None)
    rows = getattr(table, "rows", None)
    if not rows:
        return {}
    return {r.name: r.seconds for r in rows if getattr(r, "kind", None) == "leaf" and r.seconds is not None}


class StartupRunner:
    """Start with `start()`; exactly one of `on_ready(result)` / `on_failed(reason, exc)` is called, on this thread.
    `on_plan()` is called on this thread after each plan is taken (the early one, the engine's, a bundle's)."""

    def __init__(
        self,
        config: EngineConfig,
        lifecycle: Lifecycle,
        *,
        on_ready: Callable[[Any], None],
        on_failed: Callable[[str, BaseException], None],
        factory: EngineFactory | None = None,
        tracing: Tracing | None = None,
        marks: ProcessMarks | None = None,
        on_plan: Callable[[], None] | None = None,
    ) -> None:
        self._config = config
        self._on_plan = on_plan
        self._lifecycle = lifecycle
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._factory = factory
        self._tracing = tracing
        self._marks = marks
        self._expected: dict[str, float] | None = None
        self._eta_basis: str | None = None
        self._eta_scale = 1.0
        self._estimate: Any = None  # engine PhaseEstimate of the latest plan
        self._early: Any = None  # the plan made before the imports (engine StartPlan), if one could be made
        self._first_ready_s: float | None = None  # the first predicted READY (seconds from the origin)
        self._thread = threading.Thread(target=self._run, name="glowplug-startup", daemon=True)

    @property
    def expected_phase_seconds(self) -> dict[str, float] | None:
        """Seconds per stage this start should take (for the ETA: from the last start with the same cache hits,
        see engine/start_estimate.py); None until known or without a profile."""
        return self._expected

    @property
    def eta_basis(self) -> str | None:
        """Where the expected times come from, in words ("from the last warm start of this config")."""
        return self._eta_basis

    @property
    def eta_scale(self) -> float:
        """What the sum of the expected stage times is multiplied by to give wall time (stages run at once)."""
        return self._eta_scale

    @property
    def estimate(self) -> Any:
        """The latest plan's PhaseEstimate (engine/start_estimate.py): per-stage seconds, their sources, the
        waits; None until a plan is made, or when it predicted nothing."""
        return self._estimate

    @property
    def early_plan(self) -> Any:
        """The plan made before the engine's imports (no torch), whose estimate has `before_s`; None without one."""
        return self._early

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def on_startup_thread(self) -> bool:
        """True when called on this runner's start-up thread (tells its spans from other start-ups' in a shared
        tracer provider)."""
        return threading.current_thread() is self._thread

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        self._lifecycle.enter_phase(IMPORTS)
        self._predict_early()
        try:
            module = importlib.import_module(_STARTUP_MODULE)
            if self._marks is not None:
                self._marks.mark_imports_done()
            plan = self._load_plan(module)
            factory = self._factory or module.build_engine
            offered = {"on_phase": self._lifecycle.enter_phase, "tracing": self._tracing, "marks": self._marks,
                       "on_plan": self._apply_plan}  # a start from a bundle plans again once it is installed
            if plan is not None:
                offered["plan"] = plan  # the factory records it with the start instead of probing again
            result = factory(self._config, **factory_kwargs(factory, offered))
        except BaseException as exc:
            reason = str(getattr(exc, "reason", "") or "") or f"{type(exc).__name__}: {exc}"
            stage = getattr(exc, "stage", None)
            if stage:
                reason = f"{stage}: {reason}"
            log.error("start-up failed", reason=reason, exc_info=exc)
            self._on_failed(reason, exc)
            return
        self._on_ready(result)

    def _load_plan(self, module: Any) -> Any:
        """The engine's plan of this start (cache pattern and ETA), setting the ETA fields; None without one."""
        plan_start = getattr(module, "plan_start", None)
        if plan_start is None:
            self._expected = self._load_expected(module)
            return None
        try:
            plan = plan_start(self._config)
        except Exception as exc:
            log.warning("no start-up ETA", error=f"{type(exc).__name__}: {exc}")
            return None
        self._apply_plan(plan)
        return plan

    def _predict_early(self) -> None:
        """The prediction made before the engine import (module docstring); a failure costs only this early ETA."""
        if self._factory is not None and self._config.bundle is not None:
            return
        try:
            from glowplug.engine.start_profile import predict_before_start
            from glowplug.base.artifacts.cachedir import cache_dir_from_env

            plan = predict_before_start(self._config, cache_dir_from_env())
        except Exception as exc:  # noqa: BLE001 - the engine's own plan follows after the imports
            log.info("no early start-up prediction", error=f"{type(exc).__name__}: {exc}")
            return
        if plan.estimate is not None and plan.estimate.seconds:
            self._early = plan
            self._apply_plan(plan)

    def _apply_plan(self, plan: Any) -> None:
        """Take the plan's ETA fields (from `_load_plan`, or from the engine once a bundle is installed)."""
        estimate = plan.estimate
        self._eta_basis = plan.basis
        if estimate is not None and estimate.seconds:
            self._expected = {str(k): float(v) for k, v in estimate.seconds.items()}
            self._eta_scale = float(estimate.scale)
            self._estimate = estimate
        if self._on_plan is not None:
            self._on_plan()

    def _load_expected(self, module: Any) -> dict[str, float] | None:
        expected = getattr(module, "expected_phase_durations", None)
        if expected is None:
            return None  # the engine's start-up profile is not there yet: no ETA, nothing else changes
        try:
            got = expected(self._config)
        except Exception as exc:
            log.warning("no start-up ETA", error=f"{type(exc).__name__}: {exc}")
            return None
        return {str(k): float(v) for k, v in got.items()} if got else None
