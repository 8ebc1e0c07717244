"""Loading a case module that the Triton tests also run in a child process under TRITON_INTERPRET=1 (the flag is
read when triton's kernels are defined, so those cases run apart): the parent imports the same file by path, for
its shapes and references, without importing triton's kernels itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def load_cases(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
