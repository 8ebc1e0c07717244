"""Make the shared helper module importable under any pytest import mode (prepend, append or importlib)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import os  # noqa: E402 - after the path set-up above, which the helpers' imports need

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def native_build(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The native library loaded once for the kernel tests (one variant per process). Under
    GLOWPLUG_EXPECT_ISA_LEVEL (tests/kernels/test_isa_levels.py runs these tests once per level) the variant loaded
    must be that level's: the op tests then check that level's kernels, not whatever happened to load."""
    from glowplug.kernels.native import load_native

    build = load_native(tmp_path_factory.mktemp("native-cache"))
    expected = os.environ.get("GLOWPLUG_EXPECT_ISA_LEVEL")
    if expected:
        assert build.available and build.level == expected, (build.level, build.reason, build.level_reason)
    return build
