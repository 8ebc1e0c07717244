"""The imports row's breakdown: `-X importtime` in a fresh interpreter, self time summed per top-level package."""

from __future__ import annotations

import time

from glowplug.profiling.imports import measure_import_costs, parse_importtime, top_note


def test_parse_sums_self_time_per_top_level_package() -> None:
    text = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       100 |        100 |     email.charset",
            "import time:       250 |        350 |   email",
            "import time:      1000 |       1000 | json",
            "unrelated line",
        ]
    )
    costs = parse_importtime(text)
    assert [(c.package, round(c.self_s * 1e6)) for c in costs] == [("json", 1000), ("email", 350)]
    assert top_note(costs, 1).endswith("json 0.001 s") and "of 0.001 s" in top_note(costs, 1)


def test_measured_costs_fit_inside_the_interpreter_run() -> None:
    t0 = time.perf_counter()
    costs = measure_import_costs(("email.mime.text",))
    wall = time.perf_counter() - t0
    packages = [c.package for c in costs]
    assert "email" in packages
    # The interpreter that measured them ran for `wall`; the imports are a part of it.
    assert 0 < sum(c.self_s for c in costs) < wall
    # A module the interpreter had imported at start-up is not imported again, so it is not listed twice.
    assert len(packages) == len(set(packages))
