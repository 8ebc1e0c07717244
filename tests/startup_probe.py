"""A test-only stage that keeps start-up state the StartupResult deliberately drops at READY (the compiled step
with its guards, the compile cache): add it to the pipeline and read `seen` after the start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glowplug.engine.stages.protocol import StageReport


@dataclass
class SlotProbe:
    """Reads each slot in `needs` (so it runs once their providers are done) and keeps the values."""

    needs: tuple[str, ...]
    name: str = "slot_probe"
    provides: tuple[str, ...] = ()
    seen: dict[str, Any] = field(default_factory=dict)

    def run(self, ctx: Any) -> StageReport:
        self.seen = {slot: getattr(ctx, slot) for slot in self.needs}
        return StageReport.skipped("test probe")
