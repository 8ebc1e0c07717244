"""Install a ready-engine bundle's entries into the cache dir (engine/bundle.py), first of all, when the config
names one (`--bundle FILE`). It runs before the start is planned, so the ETA's cache probe sees the hits it
installed; build_engine then runs the pipeline with the model the bundle brought."""

from __future__ import annotations

from glowplug.engine.bundle import install_for_start
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport


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
            Attr.BUNDLE_PATH: str(report.bundle),
            Attr.BUNDLE_INSTALLED: report.count("installed"),
            Attr.BUNDLE_PRESENT: report.count("present"),
            Attr.BUNDLE_DAMAGED: report.count("damaged"),
            Attr.BUNDLE_SKIPPED: report.count("skipped"),
            Attr.BUNDLE_MODEL: start.model,
            Attr.BUNDLE_DIFFERENCES: start.differences,
            Attr.ROW_NOTE: note,
        }
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
