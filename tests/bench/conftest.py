"""Fixtures of the benchmark tests: an isolated cache and environment, and the tiny model's folder as a string."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Engines built here (in-process or in child processes) write caches under tmp_path and export no traces."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("GLOWPLUG_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def tiny_model(tiny_dir: Callable[[str], Path]) -> str:
    return str(tiny_dir("llama"))


def markdown_cells(text: str) -> list[list[str]]:
    """The data cells of every Markdown table row in `text` (header separators skipped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|:") and not line.startswith("|-"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def assert_no_blank_or_nan(text: str) -> None:
    for row in markdown_cells(text):
        for cell in row:
            assert cell, f"blank cell in row {row}"
            assert "nan" not in cell.lower().split(), f"NaN cell in row {row}"
            assert cell.lower() != "n/a", f"n/a without a reason in row {row}"
