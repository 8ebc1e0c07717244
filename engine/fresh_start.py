"""`python -m glowplug.engine.fresh_start CONFIG REPORT`: one start of the engine config in the JSON file CONFIG, in
a process of its own, timed as `glowplug startup` times one (from process creation: the process_start and imports
rows, the floor), its phase table written to REPORT and the start recorded in $GLOWPLUG_CACHE_DIR's start-up
profile; exit status 0 at READY, 1 with one `glowplug:` line on stderr when it failed.

A process of its own so that the start is a user's: nothing imported, compiled or held in memory beforehand
(engine/bundle.py runs a cold and a warm one). Its own entry point, not the CLI's, so that the engine never calls
up into the layer above it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    """Start the config in CONFIG to READY and write its phase table to REPORT (module docstring)."""
    from glowplug.profiling.process import mark_main_entry

    marks = mark_main_entry()  # the first moment our code runs: the end of the process_start row
    marks.defer_full_gc()  # one engine per process, as under `glowplug startup` (see FullGcDeferral)
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m glowplug.engine.fresh_start CONFIG.json REPORT", file=sys.stderr)
        return 2
    from glowplug.base.errors import one_line
    from glowplug.profiling.imports import import_startup_modules
    from glowplug.profiling.logs import configure_logging

    from .config import EngineConfig
    from .stages.protocol import StartupFailed

    try:
        config = EngineConfig.model_validate_json(Path(args[0]).read_text())
        configure_logging(level="warning")
        import_startup_modules(marks)
        from glowplug.profiling.phases import write_report
        from glowplug.profiling.tracing import setup_tracing

        from .startup import build_engine, plan_start

        tracing = setup_tracing()
        marks.mark_imports_done()
        result = build_engine(config, tracing=tracing, marks=marks, plan=plan_start(config))
        write_report(result.phase_table, args[1])
        tracing.shutdown()
    except Exception as exc:  # noqa: BLE001 - the caller reads one line and the exit status
        print(f"glowplug: error: {exc if isinstance(exc, StartupFailed) else one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
