"""Triton kernels for GPUs (fused dequant GEMV for small M, dequant + tl.dot GEMM for larger M; paged decode
attention).

Triton is an optional dependency: nothing here imports it at import time. `available()` says whether it can be
used; `glowplug.kernels.triton.ops` holds the linear launchers and imports their kernels on first launch, and
`glowplug.kernels.triton.attention` the paged decode attention's launcher and custom op (registered on first use).
"""

from __future__ import annotations

import importlib.util
import os


def available() -> bool:
    """True when the `triton` package is importable (it may still lack a GPU driver; see `interpreting`)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a blocked/half-imported module whose __spec__ is None
        return False


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors through Triton's numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
