"""What the start-up's imports cost, module by module (`glowplug startup --import-times`).

The imports row is one span (main entry -> heavy imports done); this says which packages it is made of. Python's
`-X importtime` prints, for every module a process imports, its own ("self") and cumulative microseconds. A fresh
interpreter imports exactly the start-up's module list under that flag (a module already imported here would cost
nothing a second time, so measuring in this process would be wrong), and the self times are summed per top-level
package, so the figures add up without counting a package inside another.

Only the standard library is imported at module level: the CLI imports this before anything heavy.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from glowplug.profiling.process import ProcessMarks

# What `glowplug startup` imports before it marks the imports done (glowplug/cli.py imports this same list, so the
# measurement and the row cover the same modules). torch first: its time is the floor's `import torch`.
STARTUP_IMPORTS: Final[tuple[str, ...]] = (
    "torch",
    "glowplug.engine.startup",
    "glowplug.profiling.export",
    "glowplug.profiling.phases",
)


def import_startup_modules(marks: ProcessMarks) -> None:
    """Import STARTUP_IMPORTS, as every process that starts an engine from its own main does (`glowplug startup`,
    engine/fresh_start.py), torch first and timed on its own into `marks.import_torch_s`: the floor's `import torch`
    term. transformers is not among them: the stage that needs it imports it, beside the weights loading."""
    import importlib
    import time

    t0 = time.perf_counter()
    import torch  # noqa: F401

    marks.import_torch_s = time.perf_counter() - t0
    for module in STARTUP_IMPORTS:
        importlib.import_module(module)


@dataclass(frozen=True)
class ImportCost:
    package: str
    self_s: float


def parse_importtime(stderr: str) -> list[ImportCost]:
    """Self time per top-level package from `-X importtime` output, costliest first."""
    per_package: dict[str, int] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        parts = line[len("import time:") :].split("|")
        if len(parts) != 3 or not parts[0].strip().isdigit():
            continue  # the header line
        name = parts[2].strip()
        package = name.split(".")[0]
        per_package[package] = per_package.get(package, 0) + int(parts[0])
    ranked = sorted(per_package.items(), key=lambda kv: kv[1], reverse=True)
    return [ImportCost(p, us / 1e6) for p, us in ranked]


def measure_import_costs(modules: Sequence[str] = STARTUP_IMPORTS, *, timeout_s: float = 120.0) -> list[ImportCost]:
    """Import `modules` in a fresh interpreter under `-X importtime`; self time per top-level package."""
    code = "; ".join(f"import {m}" for m in modules)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"importing {', '.join(modules)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return parse_importtime(proc.stderr)


def top_note(costs: Sequence[ImportCost], n: int = 5) -> str:
    total = sum(c.self_s for c in costs)
    top = ", ".join(f"{c.package} {c.self_s:.3f} s" for c in costs[:n])
    return f"top {min(n, len(costs))} of {total:.3f} s (-X importtime, self time per package, fresh interpreter): {top}"
