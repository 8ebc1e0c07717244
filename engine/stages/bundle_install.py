"""Install a ready-engine bundle's entries into the cache dir (engine/bundle.py), first of all, when the config
names one (`--bundle FILE`). It runs before the start is planned, so the ETA's cache probe sees the hits it
installed; build_engine then runs the pipeline with the model the bundle brought."""

from __future__ import annotations

from ...profiling.names import Attr
from ..bundle import install_for_start
from .protocol import StageReport
from .context import EngineContext


class BundleInstall:
    name = "bundle_install"
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ("bundle",)

    def run(self, ctx: EngineContext) -> StageReport:
        start = install_for_start(ctx.config, ctx.cache_root)
        ctx.bundle = start
        report = start.report
        note = f"{report.bundle.name}: {report.summary()}"
        if start.differences:
            note += f"; made where {'; '.join(start.differences)}"
        if start.model_note:
            note += f"; {start.model_note}"
        attrs: dict[str, object] = {
            "glowplug.bundle.path": str(report.bundle),
            "glowplug.bundle.installed": report.count("installed"),
            "glowplug.bundle.present": report.count("present"),
            "glowplug.bundle.damaged": report.count("damaged"),
            "glowplug.bundle.skipped": report.count("skipped"),
            "glowplug.bundle.model": start.model,
            "glowplug.bundle.differences": start.differences,
            Attr.ROW_NOTE: note,
        }
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
