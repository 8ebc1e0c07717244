"""A tensor-parallel worker rank (1..N-1): build the engine's shard through the same start-up pipeline as rank 0,
then run the model calls rank 0 broadcasts until it says stop (engine/distributed.py).

`python -m glowplug.engine.tp_worker` is what rank 0 starts (the config comes in GLOWPLUG_TP_CONFIG); under
torchrun the CLI calls `run_worker` on every rank but 0 with the config from its flags."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from glowplug.profiling.names import STARTUP_SPAN

from .config import EngineConfig
from .distributed import CACHE_ENV, CONFIG_ENV, watch_parent
from .tp_progress import RUNDIR_ENV, write_progress
from .tp_step import serve_worker


class StageProgress(SpanProcessor):
    """Writes the stages this rank is in (several run at once: load_weights beside tokenizer_init) to the run
    folder as they begin and end: what rank 0 names when this rank dies."""

    def __init__(self, rundir: Path | None, rank: int) -> None:
        self.rundir, self.rank = rundir, rank
        self.running: list[str] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if span.name.startswith(STARTUP_SPAN + "."):
            self.running.append(span.name.removeprefix(STARTUP_SPAN + "."))
            write_progress(self.rundir, self.rank, ", ".join(self.running))

    def on_end(self, span: ReadableSpan) -> None:
        stage = span.name.removeprefix(STARTUP_SPAN + ".")
        if span.name.startswith(STARTUP_SPAN + ".") and stage in self.running:
            self.running.remove(stage)
            if self.running:
                write_progress(self.rundir, self.rank, ", ".join(self.running))


def run_worker(config: EngineConfig, cache_dir: Path | None = None) -> int:
    """Start this rank and serve until stopped; the exit status (1: its start-up failed, with one line saying why
    on stderr)."""
    from glowplug.profiling.logs import configure_logging
    from glowplug.profiling.tracing import setup_tracing

    from .startup import build_engine

    # Rank 0 reports the start; a worker says only what goes wrong (its spans are in rank 0's trace).
    configure_logging(level="warning")
    rank = int(os.environ["RANK"])
    rundir = Path(os.environ[RUNDIR_ENV]) if RUNDIR_ENV in os.environ else None
    tracing = setup_tracing()
    tracing.provider.add_span_processor(StageProgress(rundir, rank))
    try:
        result = build_engine(config, tracing=tracing, cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001 - one line for rank 0's log; rank 0 names this rank in its error
        write_progress(rundir, rank, str(getattr(exc, "stage", "") or "start-up"), "failed")
        print(f"glowplug tensor-parallel rank {rank}: {exc}", file=sys.stderr)
        if os.environ.get("GLOWPLUG_VERBOSE"):
            import traceback

            traceback.print_exc()
        return 1
    write_progress(rundir, rank, "ready", "ready")
    group = result.parallel
    assert group is not None
    try:
        serve_worker(group, result.engine.model, result.engine.runner.kv_cache, config.resolved_device())
    except Exception as exc:  # noqa: BLE001 - rank 0 is gone or failed: nothing left to serve
        print(f"glowplug tensor-parallel rank {rank}: stopped serving: {exc}", file=sys.stderr)
        return 1
    finally:
        group.close()
    return 0


def main() -> None:
    parent = os.environ.get("GLOWPLUG_TP_PARENT")
    if parent is not None:
        watch_parent(int(parent))
    config = EngineConfig.model_validate_json(os.environ[CONFIG_ENV])
    cache = os.environ.get(CACHE_ENV)
    sys.exit(run_worker(config, Path(cache) if cache else None))


if __name__ == "__main__":
    main()
