"""The calibrated dispatch table as an artifact-store entry (cache `kernel_dispatch`): written by `calibrate`
(`glowplug bench kernels`), read by the engine's model_init. A damaged table is moved aside and the engine falls
back to the built-in rules until the next calibration."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from glowplug.engine.artifacts import Fetched

    from .dispatch import DispatchTable

TABLE = "table.json"


def _store(cache_dir: str | os.PathLike[str] | None) -> Any:
    # The store lives in the engine package; imported here, not at module level, so kernels stay importable alone.
    from glowplug.engine.artifacts import ArtifactStore

    return ArtifactStore(cache_dir)


def _load(folder: Path) -> DispatchTable:
    from .dispatch import DispatchTable

    return DispatchTable.from_json((folder / TABLE).read_text(encoding="utf-8"))


def lookup_table(cache_dir: str | os.PathLike[str] | None, factors: dict[str, Any]) -> Fetched[DispatchTable | None]:
    from glowplug.engine.artifacts.caches import KERNEL_DISPATCH

    return _store(cache_dir).lookup(KERNEL_DISPATCH, factors, group=str(factors["cpu"]), load=_load)  # type: ignore[no-any-return]


def save_table(cache_dir: str | os.PathLike[str] | None, factors: dict[str, Any], table: DispatchTable) -> None:
    from glowplug.engine.artifacts.caches import KERNEL_DISPATCH

    def build(folder: Path | None) -> None:
        if folder is not None:
            (folder / TABLE).write_text(table.to_json(), encoding="utf-8")

    _store(cache_dir).put(KERNEL_DISPATCH, factors, group=str(factors["cpu"]), build=build)
