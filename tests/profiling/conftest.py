"""Fixtures shared by the observability tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

# tests/otlp_receiver.py is shared with other test folders; pyproject's pytest settings (not owned here) do not put
# tests/ on sys.path, so do it for this folder. startup_fakes.py sits next to this file.
for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from glowplug.profiling.tracing import Tracing, setup_tracing  # noqa: E402


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here may export to a collector configured on the developer's machine, or go through a proxy."""
    for key in list(os.environ):
        if key.startswith("OTEL_") or key.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    t = setup_tracing("glowplug-test")
    yield t
    t.shutdown()


@pytest.fixture(autouse=True)
def reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()
