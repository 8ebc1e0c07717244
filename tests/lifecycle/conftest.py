"""Fixtures for the service tests: a tiny long-context checkpoint, a private cache dir, a clean environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

# lifecycle_harness.py sits next to this file and tests/otlp_receiver.py one level up; neither folder is
# guaranteed to be on sys.path (that depends on pytest settings this folder does not own).
for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# Long enough for streams that are still running when a test disconnects or sends SIGTERM.
TINY_CONTEXT = 1024
# For a subprocess server, which cannot be paced: streams of thousands of tokens that outlast a signal on any machine.
LONG_CONTEXT = 8192


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glowplug.engine.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-serve"), "llama", max_position_embeddings=TINY_CONTEXT)


@pytest.fixture(scope="session")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glowplug.engine.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module", autouse=True)
def isolated_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Per test module (module-scoped so that it ends with the module and never leaks into other folders' tests):
    no export to a collector configured on the developer's machine, no proxy for 127.0.0.1, and a cache dir of
    our own, so the start-up profiles (the ETA) these tests write stay out of the user's cache. Servers started
    in subprocesses inherit it."""
    cache = tmp_path_factory.mktemp("glowplug-cache")
    with pytest.MonkeyPatch.context() as mp:
        for key in list(os.environ):
            if key.startswith("OTEL_") or key.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
                mp.delenv(key, raising=False)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("no_proxy", "127.0.0.1,localhost")
        mp.setenv("GLOWPLUG_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(autouse=True)
def reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()
