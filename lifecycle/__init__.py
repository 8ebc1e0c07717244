"""The glowplug HTTP service: `serve(EngineConfig, ServeConfig) -> int` (see `server.py`).

Names are re-exported lazily so that `import glowplug.lifecycle` (and `python -m glowplug.lifecycle`) stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeConfig", "serve"]


def __getattr__(name: str) -> Any:
    if name == "serve":
        from .server import serve

        return serve
    if name == "ServeConfig":
        from .config import ServeConfig

        return ServeConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
