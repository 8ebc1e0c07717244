"""Seed 004's start-up rows (vLLM, two models, one start per max-model-len) and glowplug's phases mapped onto them.

The seed is a table of vLLM start-up timings (seconds) for llama2-13b-hf and qwen-4b over max-model-len. Its
definitions, which the mapping below keeps:

- `torch.compile` equals `dynamo_transform_time` (the seed's two rows are identical in every column); the graph
  compile is its own row (`graph_compile_general_shape` / `graph_compile_cached`).
- `init_engine` holds the KV profile run, and vLLM compiles inside that run, so its init_engine holds the compile
  too: 49.44 s = kv_cache_profiling 25.51 (of which ~20 s dynamo + graph compile) + graph_capturing 23.40 + ...
- `total_time` = model_loading + init_engine + tokenizer_init, and `actual_total_time` is the wall clock, about 15 s
  larger: the seed's total leaves the process start, the imports and the serving front end unaccounted.

glowplug's own rows account for every second: leaves + unattributed - overlap = actual_total_time exactly
(profiling/phases.py). The mapping sums glowplug leaves into the seed's rows; `unaccounted` is the wall time the
seed's total_time does not cover (actual_total_time - total_time), which for glowplug is process_start + imports +
unattributed - overlap.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .tables import Cell, Missing, fmt_num, markdown_table


@dataclass(frozen=True)
class SeedRow:
    """One of seed 004's rows and the glowplug leaves whose sum stands for it (empty = a derived row)."""

    name: str
    leaves: tuple[str, ...]
    how: str


_COMPILE = ("native_kernels", "dynamo_transform_time", "graph_compile_general_shape", "graph_compile_cached")
_ENGINE = ("kv_cache_profiling", "kv_cache_init", "graph_capturing", "warmup")
_LOADING = ("model_prepare", "load_weights", "model_init", "quantize_weights")
SEED_ROWS: tuple[SeedRow, ...] = (
    SeedRow("model_loading", _LOADING, " + ".join(_LOADING)),
    SeedRow(
        "torch.compile (= dynamo)",
        ("dynamo_transform_time",),
        "dynamo_transform_time (the seed's torch.compile row equals its dynamo row)",
    ),
    SeedRow(
        "graph compile",
        ("graph_compile_general_shape", "graph_compile_cached"),
        "graph_compile_general_shape + graph_compile_cached",
    ),
    SeedRow("graph_capturing", ("graph_capturing",), "graph_capturing"),
    SeedRow(
        "init_engine",
        (*_COMPILE, *_ENGINE),
        " + ".join((*_COMPILE, *_ENGINE)) + " (vLLM compiles inside its "
        "KV profile run, so its init_engine holds the compile: here the torch.compile leaves are added)",
    ),
    SeedRow("tokenizer_init", ("tokenizer_init",), "tokenizer_init"),
)
TOTAL = "total_time (seed's definition)"
ACTUAL = "actual_total_time"
UNACCOUNTED = "unaccounted by total_time"
ACCOUNTED = "glowplug: every leaf + unattributed - overlap"
DERIVED_HOW = {
    TOTAL: "model_loading + init_engine + tokenizer_init (rows above)",
    ACTUAL: "actual_total_time: process creation -> READY (wall clock)",
    UNACCOUNTED: "actual_total_time - total_time = process_start + imports + unattributed - overlap",
    ACCOUNTED: "process_start + imports + every stage leaf + unattributed - overlap (= actual_total_time)",
}
ROW_NAMES: tuple[str, ...] = (*(r.name for r in SEED_ROWS), TOTAL, ACTUAL, UNACCOUNTED, ACCOUNTED)
# The seed's own rows for each mapped row (its torch.compile row, its graph_compile_* pair summed).
SEED_SOURCE = {
    "model_loading": ("model_loading",),
    "torch.compile (= dynamo)": ("torch.compile",),
    "graph compile": ("graph_compile_general_shape", "graph_compile_cached"),
    "graph_capturing": ("graph_capturing",),
    "init_engine": ("init_engine",),
    "tokenizer_init": ("tokenizer_init",),
    TOTAL: ("total_time",),
    ACTUAL: ("actual_total_time",),
}


def _sum(phases: Mapping[str, float | None], names: Sequence[str]) -> float | None:
    """The sum of the phases that ran; None when none of them did (a skipped phase is 0 s of the start, not a gap)."""
    values = [v for n in names if (v := phases.get(n)) is not None]
    return sum(values) if values else None


def map_phases(phases: Mapping[str, float | None], leaves: Sequence[str]) -> dict[str, float | None]:
    """One glowplug start's phase table (row -> seconds) as seed 004's rows; `leaves` are the run's leaf rows (its
    report's kinds == "leaf", unattributed included), so `ACCOUNTED` sums every second the table holds."""
    out: dict[str, float | None] = {r.name: _sum(phases, r.leaves) for r in SEED_ROWS}
    out[TOTAL] = sum(out[n] or 0.0 for n in ("model_loading", "init_engine", "tokenizer_init"))
    actual = phases.get("actual_total_time")
    out[ACTUAL] = actual
    out[UNACCOUNTED] = None if actual is None else actual - out[TOTAL]
    out[ACCOUNTED] = sum(phases.get(n) or 0.0 for n in leaves) - (phases.get("overlap") or 0.0)
    return out


# The phase table's rows that are not leaves (profiling/phases.py): aggregates, derived rows, totals, the floor.
NOT_LEAVES = frozenset(
    {
        "model_loading",
        "torch.compile",
        "init_engine",
        "overlap",
        "critical_path",
        "total_time",
        "actual_total_time",
        "floor",
    }
)


def default_leaves(phases: Mapping[str, float | None]) -> list[str]:
    """The leaf rows of a phase table whose report did not keep its row kinds (an older startup.json)."""
    return [n for n in phases if n not in NOT_LEAVES]


def seed_values(model: str, row: str) -> dict[int, float]:
    """Seed 004's value of a mapped row for one model, per max-model-len (absent where the seed has no value)."""
    out: dict[int, float] = {}
    for length, cells in SEED_004[model].items():
        values = [v for n in SEED_SOURCE.get(row, ()) if (v := cells.get(n)) is not None]
        if values:
            out[length] = sum(values)
    if row == UNACCOUNTED:
        out = {n: c["actual_total_time"] - c["total_time"] for n, c in SEED_004[model].items()}  # type: ignore[operator]
    return out


def spread_cell(values: Sequence[float], digits: int = 2) -> Cell:
    """ "median (min–max, n=N)", or why there is no value."""
    if not values:
        return Missing("no value")
    s = sorted(values)
    return f"{fmt_num(statistics.median(s), digits)} ({fmt_num(s[0], digits)}–{fmt_num(s[-1], digits)}, n={len(s)})"


def comparison_table(ours: Mapping[str, Sequence[Mapping[str, float | None]]]) -> str:
    """Seed 004's rows: glowplug's columns (name -> each run's `map_phases`), then the seed's two models, each the
    median and min-max over its max-model-len columns (start-up barely depends on the length in the seed)."""
    head = [
        "Seed 004 row",
        "glowplug phases summed",
        *(f"glowplug {k} (s)" for k in ours),
        *(f"seed {m} (s, over max-model-len)" for m in SEED_004),
    ]
    rows: list[list[Cell]] = []
    for name in ROW_NAMES:
        how = next((r.how for r in SEED_ROWS if r.name == name), DERIVED_HOW.get(name, ""))
        cells: list[Cell] = [name, how]
        cells += [spread_cell([v for m in maps if (v := m.get(name)) is not None]) for maps in ours.values()]
        for model in SEED_004:
            seed = seed_values(model, name)
            cells.append(
                spread_cell(list(seed.values()))
                if seed or name != ACCOUNTED
                else Missing("the seed does not account for every second")
            )
        rows.append(cells)
    return markdown_table(head, rows, ["l", "l"] + ["r"] * (len(ours) + len(SEED_004)))


def per_length_table(ours: Mapping[int, Sequence[Mapping[str, float | None]]]) -> str:
    """tune's view: per max-model-len, glowplug's median (min-max, n) beside the seed's value at the same length."""
    head = ["Seed 004 row"]
    for length in ours:
        head += [f"glowplug {length}", *(f"seed {m} {length}" for m in SEED_004)]
    rows: list[list[Cell]] = []
    for name in ROW_NAMES:
        cells: list[Cell] = [name]
        for length, maps in ours.items():
            cells.append(spread_cell([v for m in maps if (v := m.get(name)) is not None]))
            for model in SEED_004:
                v = seed_values(model, name).get(length)
                cells.append(fmt_num(v, 2) if v is not None else Missing("not in the seed"))
        rows.append(cells)
    return markdown_table(head, rows, ["l"] + ["r"] * (len(head) - 1))


def definitions_text() -> str:
    """Under the tables: which glowplug phases each seed row sums, and the seed's definitions."""
    lines = ["How each seed 004 row is made from glowplug's phases (the seed: vLLM, one start per max-model-len):", ""]
    lines += [f"- **{r.name}** = {r.how}" for r in SEED_ROWS]
    lines += [f"- **{k}** = {v}" for k, v in DERIVED_HOW.items()]
    lines += [
        "",
        "The seed's total_time leaves about 15 s of its wall clock unaccounted (imports, process start, "
        "the serving front end); glowplug's last row accounts for every second of its wall clock. A cell is "
        "the median (min–max, n) over runs; the seed's columns are over its max-model-len columns.",
    ]
    return "\n".join(lines)


# Seed 004 (/work/shared/seeds/004_*.txt) as printed: model -> max-model-len -> row -> seconds (None = "--").
SEED_004: dict[str, dict[int, dict[str, float | None]]] = {
    "llama2-13b-hf": {
        256: {
            "load_weights": 14.46,
            "model_init": 0.24,
            "model_loading": 14.71,
            "dynamo_transform_time": 10.82,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.35,
            "torch.compile": 10.82,
            "kv_cache_profiling": 25.41,
            "graph_capturing": 23.18,
            "kv_cache_init": 0.02,
            "init_engine": 49.05,
            "tokenizer_init": 0.12,
            "total_time": 63.88,
            "actual_total_time": 78.36,
        },
        512: {
            "load_weights": 14.34,
            "model_init": 0.24,
            "model_loading": 14.6,
            "dynamo_transform_time": 10.69,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.68,
            "torch.compile": 10.69,
            "kv_cache_profiling": 25.41,
            "graph_capturing": 24.46,
            "kv_cache_init": 0.01,
            "init_engine": 50.34,
            "tokenizer_init": 0.13,
            "total_time": 65.07,
            "actual_total_time": 79.7,
        },
        1024: {
            "load_weights": 14.32,
            "model_init": 0.25,
            "model_loading": 14.57,
            "dynamo_transform_time": 10.97,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.39,
            "torch.compile": 10.97,
            "kv_cache_profiling": 25.51,
            "graph_capturing": 23.4,
            "kv_cache_init": 0.01,
            "init_engine": 49.44,
            "tokenizer_init": 0.13,
            "total_time": 64.14,
            "actual_total_time": 79.16,
        },
        2048: {
            "load_weights": 14.23,
            "model_init": 0.24,
            "model_loading": 14.48,
            "dynamo_transform_time": 10.83,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.6,
            "torch.compile": 10.83,
            "kv_cache_profiling": 25.4,
            "graph_capturing": 23.1,
            "kv_cache_init": 0.01,
            "init_engine": 48.98,
            "tokenizer_init": 0.13,
            "total_time": 63.59,
            "actual_total_time": 78.49,
        },
        4096: {
            "load_weights": 14.29,
            "model_init": 0.25,
            "model_loading": 14.55,
            "dynamo_transform_time": 11.0,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 10.27,
            "torch.compile": 11.0,
            "kv_cache_profiling": 26.29,
            "graph_capturing": 23.55,
            "kv_cache_init": 0.01,
            "init_engine": 50.3,
            "tokenizer_init": 0.12,
            "total_time": 64.97,
            "actual_total_time": 79.81,
        },
    },
    "qwen-4b": {
        256: {
            "load_weights": 4.47,
            "model_init": 0.24,
            "model_loading": 4.73,
            "dynamo_transform_time": 10.86,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.58,
            "torch.compile": 10.86,
            "kv_cache_profiling": 24.0,
            "graph_capturing": 22.15,
            "kv_cache_init": 0.01,
            "init_engine": 46.6,
            "tokenizer_init": 0.37,
            "total_time": 51.7,
            "actual_total_time": 66.39,
        },
        512: {
            "load_weights": 4.43,
            "model_init": 0.24,
            "model_loading": 4.67,
            "dynamo_transform_time": 10.95,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.44,
            "torch.compile": 10.95,
            "kv_cache_profiling": 23.91,
            "graph_capturing": 22.66,
            "kv_cache_init": 0.01,
            "init_engine": 47.02,
            "tokenizer_init": 0.37,
            "total_time": 52.06,
            "actual_total_time": 66.94,
        },
        1024: {
            "load_weights": 4.45,
            "model_init": 0.24,
            "model_loading": 4.7,
            "dynamo_transform_time": 10.93,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.04,
            "torch.compile": 10.93,
            "kv_cache_profiling": 23.46,
            "graph_capturing": 22.09,
            "kv_cache_init": 0.05,
            "init_engine": 46.03,
            "tokenizer_init": 0.39,
            "total_time": 51.12,
            "actual_total_time": 65.65,
        },
        2048: {
            "load_weights": 4.4,
            "model_init": 0.24,
            "model_loading": 4.65,
            "dynamo_transform_time": 10.97,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.89,
            "torch.compile": 10.97,
            "kv_cache_profiling": 24.39,
            "graph_capturing": 21.97,
            "kv_cache_init": 0.01,
            "init_engine": 46.81,
            "tokenizer_init": 0.36,
            "total_time": 51.82,
            "actual_total_time": 67.51,
        },
        4096: {
            "load_weights": 4.48,
            "model_init": 0.24,
            "model_loading": 4.73,
            "dynamo_transform_time": 11.05,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.54,
            "torch.compile": 11.05,
            "kv_cache_profiling": 24.14,
            "graph_capturing": 22.39,
            "kv_cache_init": 0.01,
            "init_engine": 46.98,
            "tokenizer_init": 0.38,
            "total_time": 52.09,
            "actual_total_time": 66.83,
        },
        8192: {
            "load_weights": 4.48,
            "model_init": 0.24,
            "model_loading": 4.72,
            "dynamo_transform_time": 10.93,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.58,
            "torch.compile": 10.93,
            "kv_cache_profiling": 24.06,
            "graph_capturing": 21.4,
            "kv_cache_init": 0.01,
            "init_engine": 45.9,
            "tokenizer_init": 0.38,
            "total_time": 51.0,
            "actual_total_time": 66.08,
        },
        16384: {
            "load_weights": 4.47,
            "model_init": 0.23,
            "model_loading": 4.71,
            "dynamo_transform_time": 10.6,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.27,
            "torch.compile": 10.6,
            "kv_cache_profiling": 23.51,
            "graph_capturing": 22.33,
            "kv_cache_init": 0.01,
            "init_engine": 46.31,
            "tokenizer_init": 0.38,
            "total_time": 51.4,
            "actual_total_time": 66.31,
        },
        32768: {
            "load_weights": 4.5,
            "model_init": 0.24,
            "model_loading": 4.75,
            "dynamo_transform_time": 10.89,
            "graph_compile_general_shape": None,
            "graph_compile_cached": 9.11,
            "torch.compile": 10.89,
            "kv_cache_profiling": 23.63,
            "graph_capturing": 22.79,
            "kv_cache_init": 0.01,
            "init_engine": 46.9,
            "tokenizer_init": 0.38,
            "total_time": 52.03,
            "actual_total_time": 67.5,
        },
    },
}
