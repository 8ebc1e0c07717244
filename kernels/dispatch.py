"""Choose a kernel per call from (M tokens, device, N, K, format) using a small table, and calibrate that table.

The quantized kernels available on a CPU trade places as M grows (aten's packed int8/int4 kernels win at M=1 and
lose to dequant + bf16 GEMM by M=16..64), so a single kernel per format is always wrong somewhere. A layer
prepares the states of every path it can reach once at load time (`Dispatcher.prepare`); each call then costs a
dict lookup (`Dispatcher.linear`).

Table lookup order: a calibrated entry for exactly this (device, format, group, N, K), taking the measured M
nearest in log2; else the default rules for (device, format); else the device's always-valid fallback.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glowplug.base.artifacts import ArtifactStore, Fetched
from glowplug.base.artifacts.caches import KERNEL_DISPATCH
from glowplug.base.machine import cpu_model

from . import cpu, reference
from .formats import PackedWeight, fit_spec, quantize
from .triton import ops as triton_ops

TABLE_VERSION = 1
DEFAULT_MS: tuple[int, ...] = (1, 4, 16, 64, 256)
# Every format and group the engine quantizes to: int4-g32 is the default model's (the 32-weight blocks of its
# Q4 GGUF source); the -g128 specs become g64 on K=576 layers (fit_spec), as the engine's layers do.
DEFAULT_FORMATS: tuple[str, ...] = ("int8", "int8-g128", "int4-g32", "int4-g128", "int2-g128", "w8a8")

# Packed aten kernels while they are bandwidth-bound, dequant + bf16 GEMM (or one _int_mm) once M makes them
# compute-bound. (max_m, path); max_m None = any M. Crossovers measured with bench.py on the 2-core AVX-512 box
# (int8pack ~M=24, int8 planes ~M=16, int4 ~M=64 there) and pulled down towards the shared notes' AMX numbers,
# where int8pack already loses at M=16; `calibrate` replaces them with per-shape measurements.
_DEFAULT_RULES: dict[str, list[tuple[int | None, str]]] = {
    "cpu/int8_channel": [(8, "int8pack"), (None, "dequant_bf16")],
    "cpu/int8_group": [(8, "aten_int4"), (None, "dequant_bf16")],
    "cpu/int4": [(32, "aten_int4"), (None, "dequant_bf16")],
    "cpu/int2": [(32, "aten_int4"), (None, "dequant_bf16")],
    "cpu/w8a8": [(2, "int_mm_rows"), (None, "int_mm")],
    **{
        f"cuda/{k}": [(triton_ops.GEMV_MAX_M, "triton_gemv"), (None, "triton_gemm")]
        for k in ("int8_channel", "int8_group", "int4", "int2", "w8a8")
    },
}
_FALLBACKS: dict[str, tuple[str, ...]] = {
    "cpu": ("dequant_bf16", "int_mm", "reference"),
    "cuda": ("triton_gemm", "reference"),
}
_WEIGHT_ONLY = frozenset({"int8_channel", "int8_group", "int4", "int2"})
_ALL_KINDS = _WEIGHT_ONLY | {"w8a8"}


@dataclass(frozen=True)
class KernelPath:
    """One way to compute x @ W^T: which formats/devices it serves, and its load-time and per-call halves."""

    name: str
    kinds: frozenset[str]
    device_type: str  # "cpu", "cuda" or "any"
    supports: Callable[[PackedWeight], bool]
    prepare: Callable[[PackedWeight], Any]
    run: Callable[[Tensor, Any, cpu.Workspace | None], Tensor]
    max_m: int | None = None  # beyond this M the path is never sensible (not benchmarked, not chosen)


def _on_cpu(w: PackedWeight) -> bool:
    return w.qweight.device.type == "cpu"


@functools.lru_cache(maxsize=1)
def kernel_paths() -> dict[str, KernelPath]:
    paths = [
        KernelPath(
            "int8pack",
            frozenset({"int8_channel"}),
            "cpu",
            cpu.supports_int8pack,
            cpu.prepare_int8pack,
            cpu.run_int8pack,
        ),
        KernelPath(
            "aten_int4",
            frozenset({"int4", "int2", "int8_channel", "int8_group"}),
            "cpu",
            cpu.supports_aten_int4,
            cpu.prepare_aten_int4,
            cpu.run_aten_int4,
        ),
        KernelPath("dequant_bf16", _WEIGHT_ONLY, "cpu", _on_cpu, cpu.prepare_dequant, cpu.run_dequant),
        KernelPath("int_mm", frozenset({"w8a8"}), "cpu", cpu.supports_int_mm, cpu.prepare_int_mm, cpu.run_int_mm),
        KernelPath(
            "int_mm_rows",
            frozenset({"w8a8"}),
            "cpu",
            cpu.supports_int_mm,
            cpu.prepare_int_mm,
            cpu.run_int_mm_rows,
            max_m=8,
        ),
        KernelPath(
            "triton_gemv",
            _ALL_KINDS,
            "cuda",
            triton_ops.supports,
            triton_ops.prepare,
            lambda x, st, ws: triton_ops.gemv(x, st),
        ),
        KernelPath(
            "triton_gemm",
            _ALL_KINDS,
            "cuda",
            triton_ops.supports,
            triton_ops.prepare,
            lambda x, st, ws: triton_ops.gemm(x, st),
        ),
        KernelPath(
            "reference", _ALL_KINDS, "any", lambda w: True, lambda w: w, lambda x, st, ws: reference.linear(x, st)
        ),
    ]
    return {p.name: p for p in paths}


def shape_key(device_type: str, kind: str, group_size: int | None, n: int, k: int) -> str:
    return f"{device_type}/{kind}/g{group_size or 0}/{n}x{k}"


@dataclass
class DispatchTable:
    """Default rules plus calibrated per-shape winners; JSON round-trippable."""

    rules: dict[str, list[tuple[int | None, str]]] = field(
        default_factory=lambda: {key: list(rule) for key, rule in _DEFAULT_RULES.items()}
    )
    measured: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def lookup(self, device_type: str, kind: str, group_size: int | None, n: int, k: int, m: int) -> list[str]:
        """Paths in preference order for one call (the caller takes the first it has prepared)."""
        out: list[str] = []
        entries = self.measured.get(shape_key(device_type, kind, group_size, n, k))
        if entries:
            nearest = min(entries, key=lambda e: (abs(math.log2(e[0]) - math.log2(max(m, 1))), e[0]))
            out.append(nearest[1])
        for max_m, path in self.rules.get(f"{device_type}/{kind}", []):
            if max_m is None or m <= max_m:
                out.append(path)
                break
        out.extend(_FALLBACKS.get(device_type, ("reference",)))
        return out

    def reachable(self, device_type: str, kind: str, group_size: int | None, n: int, k: int) -> list[str]:
        """Every path the table could pick for this layer at some M (fallbacks not included)."""
        names = [p for _, p in self.measured.get(shape_key(device_type, kind, group_size, n, k), [])]
        names += [p for _, p in self.rules.get(f"{device_type}/{kind}", [])]
        return list(dict.fromkeys(names))

    def to_json(self) -> str:
        return json.dumps(
            {"version": TABLE_VERSION, "rules": self.rules, "measured": self.measured, "meta": self.meta},
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> DispatchTable:
        data = json.loads(text)
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"dispatch table version {data.get('version')} != {TABLE_VERSION}")
        rules = {k: [(r[0], r[1]) for r in v] for k, v in data["rules"].items()}
        measured = {k: [(int(e[0]), e[1]) for e in v] for k, v in data["measured"].items()}
        return cls(rules, measured, data.get("meta", {}))


@dataclass
class Runtime:
    """One layer's prepared kernel states on one device, and its memo of M -> chosen path."""

    kind: str
    group_size: int | None
    n: int
    k: int
    device: torch.device
    states: dict[str, Any]
    paths: dict[str, KernelPath]
    table_version: int = 0
    choice: dict[int, str] = field(default_factory=dict)


class Dispatcher:
    """Owns the table and the dequant workspace shared by all layers that use it."""

    def __init__(self, table: DispatchTable | None = None) -> None:
        self._table = table if table is not None else DispatchTable()
        self.table_version = 0
        self.workspace = cpu.Workspace()

    @property
    def table(self) -> DispatchTable:
        return self._table

    @table.setter
    def table(self, table: DispatchTable) -> None:
        # Layers prepared under the old table notice the version change and re-prepare (see QuantLinear).
        self._table = table
        self.table_version += 1

    def __deepcopy__(self, memo: dict[int, Any]) -> Dispatcher:
        # Modules hold a reference; copying a model must not duplicate (or fail on) the shared workspace.
        return self

    def valid_paths(self, w: PackedWeight) -> list[str]:
        dev = w.qweight.device.type
        return [
            p.name
            for p in kernel_paths().values()
            if w.kind in p.kinds and p.device_type in (dev, "any") and p.supports(w)
        ]

    def prepare(self, w: PackedWeight, paths: Iterable[str] | None = None) -> Runtime:
        n, k = w.shape
        group = getattr(w, "group_size", None)
        names = self._prepared_names(w, paths)
        registry = kernel_paths()
        # The path objects travel with the runtime so the per-call code never touches the lru_cache'd registry
        # (which torch.compile would re-trace on every call).
        return Runtime(
            w.kind,
            group,
            n,
            k,
            w.qweight.device,
            {name: registry[name].prepare(w) for name in names},
            {name: registry[name] for name in names},
            self.table_version,
        )

    def _prepared_names(self, w: PackedWeight, paths: Iterable[str] | None) -> list[str]:
        """The paths `prepare` builds for `w`, in preference order."""
        n, k = w.shape
        dev = w.qweight.device.type
        valid = self.valid_paths(w)
        if paths is None:
            # What the table can reach plus the first valid fallback, so a rule whose path is invalid for this
            # shape still lands on a prepared path; nothing else is built (kernel layouts cost memory).
            wanted = self.table.reachable(dev, w.kind, getattr(w, "group_size", None), n, k)
            wanted += [next(p for p in (*_FALLBACKS.get(dev, ()), "reference") if p in valid)]
        else:
            wanted = list(paths)
        return [name for name in dict.fromkeys(wanted) if name in valid] or ["reference"]

    def _pick(
        self,
        device_type: str,
        kind: str,
        group_size: int | None,
        n: int,
        k: int,
        m: int,
        prepared: dict[str, KernelPath],
    ) -> str | None:
        for name in self.table.lookup(device_type, kind, group_size, n, k, m):
            path = prepared.get(name)
            if path is not None and (path.max_m is None or m <= path.max_m):
                return name
        return None

    def choose(self, rt: Runtime, m: int) -> str:
        cached = rt.choice.get(m)
        if cached is not None:
            return cached
        name = self._pick(rt.device.type, rt.kind, rt.group_size, rt.n, rt.k, m, rt.paths)
        if name is None:
            return next(iter(rt.states))
        if not torch.compiler.is_compiling():
            rt.choice[m] = name
        return name

    def plan(self, w: PackedWeight, m: int) -> str:
        """The path `linear` takes for `w` at m rows once `prepare(w)` ran, without preparing anything (the
        activation peak from shapes, engine/activation_peak.py, needs it before the first call)."""
        registry = kernel_paths()
        prepared = {name: registry[name] for name in self._prepared_names(w, None)}
        n, k = w.shape
        picked = self._pick(w.qweight.device.type, w.kind, getattr(w, "group_size", None), n, k, m, prepared)
        return picked if picked is not None else next(iter(prepared))

    def run_path(self, name: str, x: Tensor, rt: Runtime) -> Tensor:
        return rt.paths[name].run(x, rt.states[name], self.workspace)

    def linear(self, x: Tensor, rt: Runtime) -> Tensor:
        """x [M, K] -> [M, N] in whatever dtype the chosen kernel produces (callers cast)."""
        return self.run_path(self.choose(rt, int(x.shape[0])), x, rt)


@functools.lru_cache(maxsize=1)
def default_dispatcher() -> Dispatcher:
    """The process-wide dispatcher modules use unless given one (created on first use, not at import)."""
    return Dispatcher()


# ---------------------------------------------------------------------------------------------- calibration
def time_samples_us(fn: Callable[[], Any], repeats: int = 10, warmup: int = 2, budget_s: float = 2.0) -> list[float]:
    """Every timed call of fn, in µs: `repeats` calls, or fewer (never under 3 when repeats >= 3) once budget_s of
    wall time is spent, so a slow path cannot stall a calibration."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    for i in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    return samples


def time_us(fn: Callable[[], Any], repeats: int = 10, warmup: int = 2, budget_s: float = 2.0) -> float:
    """Fastest of `repeats` timed calls of fn, in µs: the dispatcher's choice criterion.

    The minimum, not a mean or median, because the machines are shared: preemption only ever adds time (whole
    4 ms scheduler ticks when one of the two OpenMP threads is descheduled), so the minimum tracks the
    kernel's own cost while the median tracks the neighbours' load. Weights rotate through uncached copies
    (see measure_path_samples), so the minimum is not a warm-cache artefact. Reports show the median and spread of
    `time_samples_us` instead: a reader needs to see how stable a figure is, not only its best case."""
    return min(time_samples_us(fn, repeats, warmup, budget_s))


def streamed_copies(nbytes: int, stream_bytes: int) -> int:
    """How many copies of a weight to rotate through so each call reads it from DRAM, as in a real decode step
    where every other layer's weights pass through the cache in between."""
    return max(1, min(256, -(-stream_bytes // max(nbytes, 1))))


def measure_path_samples(
    dispatcher: Dispatcher,
    w: PackedWeight,
    ms: Sequence[int],
    *,
    repeats: int = 10,
    stream_bytes: int = 96 << 20,
    seed: int = 0,
) -> dict[int, dict[str, list[float]]]:
    """Every timed call (µs) of every valid path of w at each M (weights rotated through `streamed_copies`
    clones)."""
    nbytes = sum(t.numel() * t.element_size() for t in w.tensors().values())
    # The reference oracle is only worth timing when nothing else can run this weight.
    valid = [p for p in dispatcher.valid_paths(w) if p != "reference"] or dispatcher.valid_paths(w)
    copies = [w] + [_clone(w) for _ in range(streamed_copies(nbytes, stream_bytes) - 1)]
    runtimes = [dispatcher.prepare(c, valid) for c in copies]
    gen = torch.Generator().manual_seed(seed)
    out: dict[int, dict[str, list[float]]] = {}
    registry = kernel_paths()
    for m in ms:
        x = torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16).to(w.qweight.device)
        out[m] = {}
        for name in valid:
            limit = registry[name].max_m
            if limit is not None and m > limit:
                continue
            out[m][name] = time_samples_us(_rotating(dispatcher, name, x, runtimes), repeats=repeats)
    return out


def _rotating(dispatcher: Dispatcher, name: str, x: Tensor, runtimes: list[Runtime]) -> Callable[[], Tensor]:
    counter = [0]

    def call() -> Tensor:
        counter[0] = (counter[0] + 1) % len(runtimes)
        return dispatcher.run_path(name, x, runtimes[counter[0]])

    return call


def _clone(w: PackedWeight) -> PackedWeight:
    import dataclasses

    return dataclasses.replace(
        w,
        **{f.name: getattr(w, f.name).clone() for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), Tensor)},
    )


def calibration_factors(shapes: Sequence[tuple[int, int]], formats: Sequence[str], ms: Sequence[int]) -> dict[str, Any]:
    """What a calibration depends on: the artifact-store key factors of the `kernel_dispatch` cache."""
    return {
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "shapes": sorted([list(s) for s in shapes]),
        "formats": list(formats),
        "ms": list(ms),
        "table_version": TABLE_VERSION,
    }


def calibrate(
    shapes: Sequence[tuple[int, int]],
    cache_dir: str | os.PathLike[str],
    *,
    formats: Sequence[str] = DEFAULT_FORMATS,
    ms: Sequence[int] = DEFAULT_MS,
    repeats: int = 10,
    force: bool = False,
    stream_bytes: int = 96 << 20,
) -> DispatchTable:
    """Benchmark every valid CPU path for each (N, K) shape, format and M; cache the winners as JSON.

    The table is an artifact-store entry under `cache_dir` (the cache root) keyed by torch version, CPU model,
    thread count and the arguments, so a different machine or torch build re-calibrates instead of trusting
    stale timings. Returns the default rules plus the measured per-shape winners."""
    factors = calibration_factors(shapes, formats, ms)
    cached = None if force else lookup_table(cache_dir, factors).value
    if cached is not None:
        return cached
    table = DispatchTable(
        meta={
            "torch": torch.__version__,
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "timings_us": {},
        }
    )
    dispatcher = Dispatcher(table)
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        weight = torch.randn(n, k, generator=gen)
        # Calibrate what the layer will really hold: e.g. "int4-g128" on K=576 is a g64 layer.
        for spec in dict.fromkeys(fit_spec(s, k) for s in formats):
            w = quantize(weight, spec)
            samples = measure_path_samples(dispatcher, w, ms, repeats=repeats, stream_bytes=stream_bytes)
            # the fastest call of each path (see time_us) is what calibration ranks by
            timings = {m: {name: min(v) for name, v in per_path.items()} for m, per_path in samples.items()}
            key = shape_key("cpu", w.kind, getattr(w, "group_size", None), n, k)
            table.measured[key] = [(m, min(t, key=t.__getitem__)) for m, t in timings.items() if t]
            table.meta["timings_us"][key] = {str(m): {p: round(v, 1) for p, v in t.items()} for m, t in timings.items()}
    save_table(cache_dir, factors, table)
    return table


# ---------------------------------------------------------------------------------------------- the stored table
# The calibrated table is an artifact-store entry (cache `kernel_dispatch`): written by `calibrate` (`glowplug
# bench kernels`), read by the engine's model_init. A damaged table is moved aside and the engine falls back to
# the built-in rules until the next calibration.
TABLE = "table.json"


def _load_table(folder: Path) -> DispatchTable:
    return DispatchTable.from_json((folder / TABLE).read_text(encoding="utf-8"))


def lookup_table(cache_dir: str | os.PathLike[str] | None, factors: dict[str, Any]) -> Fetched[DispatchTable | None]:
    return ArtifactStore(cache_dir).lookup(KERNEL_DISPATCH, factors, group=str(factors["cpu"]), load=_load_table)  # type: ignore[arg-type]


def save_table(cache_dir: str | os.PathLike[str] | None, factors: dict[str, Any], table: DispatchTable) -> None:
    def build(folder: Path | None) -> None:
        if folder is not None:
            (folder / TABLE).write_text(table.to_json(), encoding="utf-8")

    ArtifactStore(cache_dir).put(KERNEL_DISPATCH, factors, group=str(factors["cpu"]), build=build)  # type: ignore[arg-type]
