"""`glowplug bench seed004 MODEL`: vLLM's start-up sweep, run by glowplug on a model of the same shape.

The reference is vLLM's start-up phases for qwen-4b and llama2-13b-hf, one start per max-model-len with its compile
cache warm. This command times glowplug the same way, each start a fresh `glowplug startup` process:

probe   the weights' files are evicted from the page cache (fsync, then posix_fadvise DONTNEED) and the first
        --probe-bytes of them read back: the disk-read probe. The same bytes read again give the page-cache rate.
cold    the files evicted again, one start with an empty cache directory at the first length: every cache misses
        and the weights come from the disk.
warm    one start per max-model-len (--repeats passes over the lengths) in the cache the cold start filled.

The report sets every start beside vLLM's column at the same length (the rows of profiling/bench/vllm_startup_rows.py),
adds the floor (weights / the disk-read probe + the start's own `import torch`), and checks the targets below.
With --decode-json (what `glowplug bench decode --out X.md` wrote as X.json, on the same model) it also checks the
decode targets. --from-runs re-renders from the seed004.json a run wrote (a run stopped early leaves the starts it
finished in it, with "partial": true).

Targets (at the qwen-4b shape on an H200):
- warm time to READY <= 1.5x its floor, and <= 0.2x vLLM's actual_total_time at the same length;
  kv_cache_profiling <= 2 s and graph_capturing <= 4 s in every warm start;
- cold time to READY <= 0.6x vLLM's actual_total_time at the cold start's length;
- decode (--decode-json; bf16 = quantization none): batch-1 bf16 at >= 75% of the bandwidth-bound rate (the weight
  bytes a step reads over the probe); batch-1 bf16 >= 3x transformers bf16 (the worst of the paired runs, as the
  decode report's verdicts use); int4 batch 1 >= 1.6x bf16; batch 64 >= 20x batch 1 in tokens/s; the batch-1 step
  at the longest max model len within 5% of the shortest's; every engine's CUDA graph pool <= 1.5x the largest
  captured batch's activations. Cells are medians over the decode report's runs unless said otherwise.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from glowplug.base.units import ByteSize
from glowplug.engine.config import Quantization
from glowplug.profiling.names import Attr, Row

from .cli_support import AddModelFlags, BenchEngineFields, add_command, check_path, prepare_out_dir, write_json
from .startup_runs import StartupRun, run_startup
from .tables import Cell, Missing, fmt_num, markdown_table
from .vllm_startup_rows import ACCOUNTED, ACTUAL, DERIVED_HOW, ROW_NAMES, SEED_004, SEED_ROWS, map_phases, seed_values

SeedModel = Literal["qwen-4b", "llama2-13b-hf"]
REPORT_JSON = "seed004.json"
REPORT_MD = "seed004.md"
# The seed's own rows that no mapped row holds alone, shown as glowplug's leaf of the same name beside the seed's.
RAW_ROWS = (Row.LOAD_WEIGHTS, Row.KV_CACHE_PROFILING)
FLOOR_ROW = "floor (weights / disk probe + import torch)"
OVER_FLOOR_ROW = "actual / floor"
# The targets' bounds (see the module docstring).
WARM_OVER_FLOOR = 1.5
WARM_OVER_SEED = 0.2
KV_PROFILE_S = 2.0
GRAPH_CAPTURE_S = 4.0
COLD_OVER_SEED = 0.6
DECODE_PROBE_SHARE = 0.75
DECODE_VS_HF = 3.0
INT4_VS_BF16 = 1.6
BATCH64_VS_BATCH1 = 20.0
MAX_LEN_STEP = 1.05
POOL_OVER_ACTIVATIONS = 1.5
Progress = Callable[[str], None]


class Seed004BenchConfig(BenchEngineFields):
    seed_model: SeedModel = Field(
        "qwen-4b",
        description="Which of vLLM's reference models this one stands for: its "
        "column is set beside each start, and its lengths are the default sweep.",
    )
    max_model_len: tuple[int, ...] | None = Field(
        None, description="Lengths of the warm starts; unset = the reference's lengths for --seed-model."
    )
    cold_max_model_len: int | None = Field(None, ge=16, description="The cold start's length; unset = the shortest.")
    quantization: Quantization = Field("none", description="As the reference ran: the checkpoint's bf16 weights.")
    repeats: int = Field(1, ge=1, description="Passes over the lengths (warm starts per length).")
    cache_dir: Path | None = Field(
        None,
        description="GLOWPLUG_CACHE_DIR for every start: absent or empty (the cold start needs it empty), "
        "kept afterwards (a later `bench decode` reuses its compile entry); unset = a temporary folder.",
    )
    probe_bytes: ByteSize = Field(
        2 << 30, ge=1 << 20, description="Bytes of the weights' files the disk-read probe reads (e.g. 2GiB)."
    )
    evict: bool = Field(
        True,
        description="Evict the weights' files from the page cache before the probe and "
        "before the cold start (--no-evict: read them as the page cache has them).",
    )
    timeout_s: float = Field(900.0, gt=0, description="Per start-up.")
    out_dir: Path = Field(Path("bench-seed004"), description="Where seed004.md/.json go.")
    from_runs: Path | None = Field(None, description="Run nothing: render from an earlier run's seed004.json.")
    decode_json: Path | None = Field(
        None, description="A `bench decode` JSON on the same model: adds the decode targets."
    )

    @field_validator("from_runs", "decode_json")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        return check_path(v, Path.is_file, "{v} is not a file; pass the JSON an earlier run wrote")

    @model_validator(mode="after")
    def _lengths(self) -> Seed004BenchConfig:
        if self.max_model_len is not None and any(n < 16 for n in self.max_model_len):
            raise ValueError("--max-model-len values must be >= 16")
        return self

    def lengths(self) -> list[int]:
        return sorted(set(self.max_model_len or SEED_004[self.seed_model]))

    def cold_length(self) -> int:
        return self.cold_max_model_len or self.lengths()[0]


# ---------------------------------------------------------------- the disk-read probe


@dataclass(frozen=True)
class ReadProbe:
    """Bytes read from the start of the weights' files in order, and the seconds it took."""

    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def evict_from_page_cache(files: Sequence[Path]) -> None:
    """Write back, then drop the files' pages from the page cache, so the next read comes from the disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_probe(files: Sequence[Path], limit: int, chunk: int = 64 << 20) -> ReadProbe:
    """Read up to `limit` bytes of `files`, in order, into one reused buffer (no copy kept)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    done = 0
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while done < limit:
                n = f.readinto(view[: min(chunk, limit - done)])
                if not n:
                    break
                done += n
        if done >= limit:
            break
    return ReadProbe(done, time.perf_counter() - t0)


def gpu_line() -> str | None:
    """`nvidia-smi`'s name, memory and driver of the first GPU, or None without one (no torch import: seconds)."""
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    line = proc.stdout.strip().splitlines()
    return f"{line[0]} (nvidia-smi: name, memory, driver)" if proc.returncode == 0 and line else None


# ---------------------------------------------------------------- running


def _entry(kind: str, length: int, run: StartupRun) -> dict[str, Any]:
    return {
        "kind": kind,
        "max_model_len": length,
        "label": run.label,
        "ok": run.ok,
        "returncode": run.returncode,
        "wall_s": run.wall_s,
        "error": run.error,
        "report": run.report,
    }


def run_seed004(
    cfg: Seed004BenchConfig, argv: list[str] | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Probe, cold start, warm sweep; returns what seed004.json holds (written after every start as well)."""
    from glowplug.engine.models.loader import checkpoint_files
    from glowplug.engine.models.store import resolve_model

    say = progress or (lambda _msg: None)
    out = prepare_out_dir(cfg.out_dir)
    cache = cfg.cache_dir or Path(tempfile.mkdtemp(prefix="glowplug-seed004-"))
    if cache.exists() and any(cache.iterdir()):
        raise ValueError(f"--cache-dir {cache} is not empty: the cold start needs an empty cache; pass a new folder")
    cache.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(resolve_model(cfg.model, quiet=True))
    data: dict[str, Any] = {
        "partial": True,
        "config": cfg.model_dump(mode="json"),
        "argv": argv,
        "gpu": gpu_line(),
        "weights_files": [str(f) for f in files],
        "weights_file_bytes": sum(f.stat().st_size for f in files),
        "runs": [],
    }
    plan = [("cold", cfg.cold_length())] + [("warm", n) for _ in range(cfg.repeats) for n in cfg.lengths()]
    say(
        f"plan: disk-read probe ({cfg.probe_bytes / 2**30:.2f} GiB), then {len(plan)} starts: "
        + ", ".join(f"{k} {n}" for k, n in plan)
    )
    if cfg.evict:
        evict_from_page_cache(files)
    disk = read_probe(files, cfg.probe_bytes)
    again = read_probe(files, cfg.probe_bytes)
    data["probe"] = {
        "bytes": disk.bytes,
        "disk_s": disk.seconds,
        "disk_gbps": disk.gbps,
        "page_cache_s": again.seconds,
        "page_cache_gbps": again.gbps,
        "evicted": cfg.evict,
    }
    say(
        f"disk-read probe: {disk.gbps:.2f} GB/s{'' if cfg.evict else ' (not evicted)'}; page cache {again.gbps:.2f} "
        "GB/s"
    )
    write_json(out / REPORT_JSON, data)
    try:
        with tempfile.TemporaryDirectory(prefix="glowplug-seed004-reports-") as tmp:
            for i, (kind, length) in enumerate(plan):
                if kind == "cold" and cfg.evict:
                    evict_from_page_cache(files)
                say(f"{kind} start {i}/{len(plan) - 1} at max-model-len {length} (cache {cache})")
                args = cfg.startup_argv(quantization=cfg.quantization, max_model_len=length)
                run = run_startup(
                    f"{kind} {length}", args, Path(tmp) / f"start-{i}.json", cache_dir=cache, timeout_s=cfg.timeout_s
                )
                ready = run.phases.get(ACTUAL)
                say(f"  READY in {ready:.2f} s" if run.ok and ready is not None else f"  failed: {run.error}")
                data["runs"].append(_entry(kind, length, run))
                write_json(out / REPORT_JSON, data)  # a checkpoint: a run stopped early keeps what it finished
    finally:
        if cfg.cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)
    data["partial"] = False
    return data


# ---------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Start:
    """One start as the report reads it back from seed004.json."""

    kind: str
    length: int
    ok: bool
    error: str | None
    report: dict[str, Any]

    @property
    def phases(self) -> dict[str, float | None]:
        return dict(self.report.get("phases") or {})

    def attr(self, row: str, key: str) -> Any:
        return (self.report.get("attributes") or {}).get(row, {}).get(key)

    def seed_rows(self) -> dict[str, float | None]:
        leaves = [n for n, k in (self.report.get("kinds") or {}).items() if k == "leaf"]
        return map_phases(self.phases, leaves)

    def floor_s(self, disk_gbps: float | None) -> float | None:
        """weights / the disk-read probe + this start's own `import torch` (None when either is unknown)."""
        weights = self.attr(Row.FLOOR, Attr.FLOOR_WEIGHTS_BYTES)
        torch_s = self.attr(Row.FLOOR, Attr.FLOOR_IMPORT_TORCH_S)
        if weights is None or torch_s is None or not disk_gbps:
            return None
        return float(weights) / (disk_gbps * 1e9) + float(torch_s)


def starts(data: Mapping[str, Any]) -> list[Start]:
    return [
        Start(r["kind"], int(r["max_model_len"]), bool(r["ok"]), r.get("error"), r.get("report") or {})
        for r in data.get("runs", [])
    ]


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _cell(values: Sequence[float], digits: int = 2, why: str = "no start") -> Cell:
    if not values:
        return Missing(why)
    med = _median(values)
    assert med is not None
    return fmt_num(med, digits) if len(values) == 1 else f"{fmt_num(med, digits)} (n={len(values)})"


def start_table(data: Mapping[str, Any]) -> str:
    """Seed 004's rows (and the floor), one column per glowplug start group (cold, then each warm length), each
    warm column followed by the seed's value at that length."""
    model: str = data["config"]["seed_model"]
    disk = (data.get("probe") or {}).get("disk_gbps")
    ok = [s for s in starts(data) if s.ok]
    groups: list[tuple[str, int, list[Start]]] = []
    for kind in ("cold", "warm"):
        for length in sorted({s.length for s in ok if s.kind == kind}):
            groups.append((kind, length, [s for s in ok if s.kind == kind and s.length == length]))
    head = ["Seed 004 row"]
    for kind, length, _ in groups:
        head += [f"glowplug {kind} {length}"] + ([f"seed {model} {length}"] if kind == "warm" else [])
    rows: list[list[Cell]] = []
    for name in (*RAW_ROWS, *ROW_NAMES, FLOOR_ROW, OVER_FLOOR_ROW):
        cells: list[Cell] = [name]
        for kind, length, group in groups:
            if name in RAW_ROWS:
                why = next((r for s in group if (r := (s.report.get("reasons") or {}).get(name))), "no start")
                cells.append(_cell([v for s in group if (v := s.phases.get(name)) is not None], why=why))
            elif name == FLOOR_ROW:
                cells.append(_cell([f for s in group if (f := s.floor_s(disk)) is not None]))
            elif name == OVER_FLOOR_ROW:
                cells.append(_cell([a / f for s in group if (a := s.phases.get(ACTUAL)) and (f := s.floor_s(disk))]))
            else:
                cells.append(_cell([v for s in group if (v := s.seed_rows().get(name)) is not None]))
            if kind == "warm":
                seed = (
                    seed_values(model, name).get(length)
                    if name in ROW_NAMES
                    else SEED_004[model].get(length, {}).get(name)
                    if name in RAW_ROWS
                    else None
                )
                why = (
                    "the seed does not account for every second"
                    if name == ACCOUNTED
                    else "not in the seed"
                    if name in (*ROW_NAMES, *RAW_ROWS)
                    else "the seed has no floor"
                )
                cells.append(fmt_num(seed, 2) if seed is not None else Missing(why))
        rows.append(cells)
    return markdown_table(head, rows)


@dataclass(frozen=True)
class Verdict:
    target: str
    measured: str
    bound: str
    passed: bool | None  # None: not measured (measured says why)

    @property
    def word(self) -> str:
        return "not measured" if self.passed is None else ("PASS" if self.passed else "FAIL")


def _none(target: str, bound: str, why: str) -> Verdict:
    return Verdict(target, why, bound, None)


def start_verdicts(data: Mapping[str, Any]) -> list[Verdict]:
    model: str = data["config"]["seed_model"]
    disk = (data.get("probe") or {}).get("disk_gbps")
    ok = [s for s in starts(data) if s.ok]
    warm = [s for s in ok if s.kind == "warm"]
    cold = [s for s in ok if s.kind == "cold"]
    out: list[Verdict] = []
    over_floor = [(s.length, a / f) for s in warm if (a := s.phases.get(ACTUAL)) and (f := s.floor_s(disk))]
    target = "warm time to READY / its floor (weights / disk probe + import torch), worst length"
    bound = f"<= {WARM_OVER_FLOOR}x"
    if over_floor:
        length, worst = max(over_floor, key=lambda p: p[1])
        out.append(
            Verdict(
                target,
                f"{worst:.2f}x (max-model-len {length}; {len(over_floor)} warm starts)",
                bound,
                worst <= WARM_OVER_FLOOR,
            )
        )
    else:
        out.append(_none(target, bound, "no warm start with a floor"))
    vs_seed = [
        (s.length, a / seed)
        for s in warm
        if (a := s.phases.get(ACTUAL)) and (seed := seed_values(model, ACTUAL).get(s.length))
    ]
    target = f"warm time to READY / seed {model}'s actual_total_time at the same length, worst length"
    bound = f"<= {WARM_OVER_SEED}x"
    if vs_seed:
        length, worst = max(vs_seed, key=lambda p: p[1])
        out.append(Verdict(target, f"{worst:.3f}x (max-model-len {length})", bound, worst <= WARM_OVER_SEED))
    else:
        out.append(_none(target, bound, "no warm start at a length the seed has"))
    for row, limit in ((Row.KV_CACHE_PROFILING, KV_PROFILE_S), (Row.GRAPH_CAPTURING, GRAPH_CAPTURE_S)):
        seed_range = [v for c in SEED_004[model].values() if (v := c.get(row)) is not None]
        target = f"warm {row}, slowest start (seed {model}: {min(seed_range):.2f}–{max(seed_range):.2f} s)"
        values = [(s.length, v) for s in warm if (v := s.phases.get(row)) is not None]
        if values:
            length, worst = max(values, key=lambda p: p[1])
            out.append(Verdict(target, f"{worst:.2f} s (max-model-len {length})", f"<= {limit:g} s", worst <= limit))
        else:
            why = next(
                (s.report.get("reasons", {}).get(row) for s in warm if s.report.get("reasons", {}).get(row)),
                "no warm start",
            )
            out.append(_none(target, f"<= {limit:g} s", f"did not run: {why}"))
    target = f"cold time to READY / {COLD_OVER_SEED} x seed {model}'s actual_total_time at the cold start's length"
    if cold and (a := cold[0].phases.get(ACTUAL)) and (seed := seed_values(model, ACTUAL).get(cold[0].length)):
        out.append(
            Verdict(
                f"cold time to READY (max-model-len {cold[0].length})",
                f"{a:.2f} s (seed {seed:.2f} s)",
                f"<= {COLD_OVER_SEED * seed:.2f} s ({COLD_OVER_SEED}x the seed)",
                a <= COLD_OVER_SEED * seed,
            )
        )
    else:
        out.append(_none(target, f"<= {COLD_OVER_SEED}x", "no cold start at a length the seed has"))
    return out


def _rows(decode: Sequence[Mapping[str, Any]], **match: Any) -> list[Mapping[str, Any]]:
    return [
        r
        for r in decode
        if r.get("engine") == "glowplug" and not r.get("skipped") and all(r.get(k) == v for k, v in match.items())
    ]


def _tps(row: Mapping[str, Any]) -> float:
    return float(statistics.median(row["tokens_per_s"]))


def decode_verdicts(decode: Sequence[Mapping[str, Any]]) -> list[Verdict]:
    """The decode targets from a `bench decode` JSON (see the module docstring); bf16 = quantization none."""
    out: list[Verdict] = []
    lens = sorted({int(r["max_model_len"]) for r in _rows(decode)})
    short = lens[0] if lens else None
    one = _rows(decode, quantization="none", batch=1, max_model_len=short)
    share = [s for s in (one[0].get("probe_share") or [])] if one else []
    bound = f">= {DECODE_PROBE_SHARE:.0%}"
    target = "batch-1 bf16 weight traffic / the bandwidth probe (the bandwidth-bound rate)"
    out.append(
        Verdict(
            target,
            f"{100 * statistics.median(share):.1f}% ({one[0]['model_size_mb']:.0f} MB per step; max model len {short})",
            bound,
            statistics.median(share) >= DECODE_PROBE_SHARE,
        )
        if share
        else _none(target, bound, "no batch-1 bf16 cell")
    )
    target, bound = "batch-1 bf16 decode / transformers bf16 generate (worst paired run)", f">= {DECODE_VS_HF:g}x"
    peers = (one[0].get("peer_ratios") or {}) if one else {}
    ratios = next((list(v) for k, v in peers.items() if k.startswith("transformers") and v), [])
    if ratios:
        out.append(
            Verdict(
                target,
                f"{min(ratios):.2f}x (median {statistics.median(ratios):.2f}x, n={len(ratios)})",
                bound,
                min(ratios) >= DECODE_VS_HF,
            )
        )
    else:
        out.append(_none(target, bound, "no transformers peer in the batch-1 bf16 cell"))
    q4 = _rows(decode, quantization="int4", batch=1, max_model_len=short)
    target, bound = "int4 batch-1 decode tok/s / bf16 batch-1", f">= {INT4_VS_BF16:g}x"
    out.append(
        Verdict(target, f"{_tps(q4[0]) / _tps(one[0]):.2f}x", bound, _tps(q4[0]) / _tps(one[0]) >= INT4_VS_BF16)
        if q4 and one
        else _none(target, bound, "no int4 or bf16 batch-1 cell")
    )
    for quant in ("none", "int4"):
        b1 = _rows(decode, quantization=quant, batch=1, max_model_len=short)
        b64 = _rows(decode, quantization=quant, batch=64, max_model_len=short)
        label = "bf16" if quant == "none" else quant
        target, bound = f"{label} batch-64 decode tok/s / batch-1", f">= {BATCH64_VS_BATCH1:g}x"
        out.append(
            Verdict(
                target, f"{_tps(b64[0]) / _tps(b1[0]):.1f}x", bound, _tps(b64[0]) / _tps(b1[0]) >= BATCH64_VS_BATCH1
            )
            if b1 and b64
            else _none(target, bound, "no batch-64 and batch-1 cells")
        )
        long = _rows(decode, quantization=quant, batch=1, max_model_len=lens[-1]) if len(lens) > 1 else []
        target = f"{label} batch-1 step at max model len {lens[-1] if lens else '-'} / at {short}"
        bound = f"<= {MAX_LEN_STEP:.2f}x"
        if long and b1:
            pairs = [a / b for a, b in zip(long[0]["step_ms"], b1[0]["step_ms"])]
            med = statistics.median(pairs)
            out.append(
                Verdict(target, f"{med:.3f}x (paired by run, worst {max(pairs):.3f}x)", bound, med <= MAX_LEN_STEP)
            )
        else:
            why = (
                "fewer than two max model lens"
                if len(lens) < 2
                else f"no {label} batch-1 cell at max model len {lens[-1] if not long else short}"
            )
            out.append(_none(target, bound, why))
    engines: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for r in _rows(decode):
        engines.setdefault((r["quantization"], r["dtype"], r["kv_cache_dtype"], r["max_model_len"]), r)
    bound = f"<= {POOL_OVER_ACTIVATIONS}x"
    pools = [(k, r) for k, r in engines.items() if r.get("graph_pool_gb") is not None and r.get("graph_activation_gb")]
    if not pools:
        out.append(
            _none("CUDA graph pool / the largest captured batch's activations", bound, "no engine captured CUDA graphs")
        )
    for (quant, dtype, _kv, max_len), r in pools:
        ratio = r["graph_pool_gb"] / r["graph_activation_gb"]
        out.append(
            Verdict(
                f"CUDA graph pool / activations at batch {r.get('graph_largest_size')} ({quant}, {dtype}, "
                f"max model len {max_len})",
                f"{ratio:.2f}x ({r['graph_pool_gb']:.3f} GB / {r['graph_activation_gb']:.3f} GB)",
                bound,
                ratio <= POOL_OVER_ACTIVATIONS,
            )
        )
    return out


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    return markdown_table(
        ["Target", "Measured", "Bound", "Verdict"],
        [[v.target, v.measured, v.bound, v.word] for v in verdicts],
        ["l", "l", "l", "l"],
    )


def pool_table(data: Mapping[str, Any]) -> str:
    """Each start's CUDA graph pool (the graph_capturing row's attributes), or why there is none."""
    rows: list[list[Cell]] = []
    for s in starts(data):
        if not s.ok:
            continue
        sizes = s.attr(Row.GRAPH_CAPTURING, Attr.GRAPH_SIZES) or []
        reserved = s.attr(Row.GRAPH_CAPTURING, Attr.GRAPH_POOL_RESERVED_BYTES)
        acts = s.attr(Row.GRAPH_CAPTURING, Attr.GRAPH_SIZE_ACTIVATION_BYTES) or []
        if reserved is None:
            why = (s.report.get("reasons") or {}).get(Row.GRAPH_CAPTURING) or "no CUDA graphs: a CPU start"
            rows.append(
                [
                    f"{s.kind} {s.length}",
                    ", ".join(map(str, sizes)) or "-",
                    Missing(why),
                    Missing(why),
                    Missing(why),
                    Missing(why),
                ]
            )
            continue
        growth = s.attr(Row.GRAPH_CAPTURING, Attr.GRAPH_POOL_BYTES)
        rows.append(
            [
                f"{s.kind} {s.length}",
                ", ".join(map(str, sizes)),
                fmt_num(reserved / 1e9, 3),
                fmt_num(growth / 1e9, 3) if growth is not None else Missing("not recorded"),
                fmt_num(acts[-1] / 1e9, 3) if acts else Missing("not recorded"),
                f"{reserved / acts[-1]:.2f}x" if acts and acts[-1] else Missing("no activations"),
            ]
        )
    return markdown_table(
        [
            "Start",
            "captured sizes",
            "graph pool GB (snapshot)",
            "reserved growth GB",
            "largest size's activations GB",
            "pool / activations",
        ],
        rows,
    )


def render_markdown(data: Mapping[str, Any], argv: list[str] | None = None) -> str:
    from .machine import report_header

    cfg = data["config"]
    model = cfg["seed_model"]
    ok = [s for s in starts(data) if s.ok]
    versions = (ok[0].report.get("versions") or {}) if ok else {}
    probe = data.get("probe") or {}
    parts = [report_header(f"Seed 004 at the {model} shape: start-up beside vLLM's, and the targets", argv)]
    ran = data.get("argv")
    if ran != argv:  # rendered from an earlier run: the header above is the renderer's
        parts.append(
            f"- the starts ran as: `glowplug {' '.join(ran)}`" if ran else "- the starts' command: not recorded"
        )
    parts += [
        f"- GPU: {data.get('gpu') or 'none seen (no nvidia-smi): the starts ran on the CPU'}",
        "- the starts' versions: " + (", ".join(f"{k} {v}" for k, v in versions.items()) or "no start finished"),
        "",
    ]
    if data.get("partial"):
        parts += [
            "**Partial run**: the command stopped before its last start; the tables hold the starts it finished.",
            "",
        ]
    n_warm = sum(1 for s in ok if s.kind == "warm")
    parts += [
        f"Model `{cfg['model']}`, `--quantization {cfg['quantization']}`, `--dtype {cfg['dtype']}`. One cold "
        f"start (empty cache dir, weights evicted from the page cache: {probe.get('evicted')}), then "
        f"{n_warm} warm start(s) in the cache it filled, each `glowplug startup` in a fresh process. Seconds; a "
        "cell with n>1 is the median of its starts.",
        "",
        "## Start-up beside seed 004",
        "",
        start_table(data),
        "",
        f"Disk-read probe: {probe.get('bytes', 0) / 2**20:,.0f} MiB of the weights' files at "
        f"{probe.get('disk_gbps', 0):.2f} GB/s after eviction, {probe.get('page_cache_gbps', 0):.2f} GB/s "
        "read again from the page cache. The floor row is the weights / the disk rate + the start's own "
        "`import torch`; each start's own report also has the engine's floor (weights / a RAM read probe).",
        "",
        "## Targets",
        "",
    ]
    verdicts = start_verdicts(data)
    decode = data.get("decode")
    parts += [verdict_table(verdicts + (decode_verdicts(decode) if decode else [])), ""]
    if decode:
        cells = sorted({(r["quantization"], int(r["max_model_len"])) for r in _rows(decode)})
        parts += [
            f"The decode targets come from `{data.get('decode_source', 'the decode JSON')}`, which holds "
            f"{len(_rows(decode))} measured cells: "
            + ", ".join(f"{q} at max model len {n}" for q, n in cells)
            + " (a `bench decode` stopped early keeps the engines it finished).",
            "",
        ]
    else:
        parts += ["The decode targets need `--decode-json` (a `glowplug bench decode` JSON on the same model).", ""]
    parts += [
        "## CUDA graph pool per start",
        "",
        pool_table(data),
        "",
        "graph pool GB: the captured graphs' pool after capture, from torch.cuda.memory_snapshot (its "
        "segments); reserved growth: torch.cuda.memory_reserved after the captures minus before (the pool and "
        "what the warm-up calls took); activations: the allocator's peak during one uncaptured call of the "
        "step at the largest size, over what was allocated before it.",
        "",
    ]
    failed = [s for s in starts(data) if not s.ok]
    if failed:
        parts += ["Starts that failed:", ""] + [f"- {s.kind} {s.length}: {s.error}" for s in failed] + [""]
    parts += ["How each row is made from glowplug's phases:", ""]
    parts += [f"- **{r.name}** = {r.how}" for r in SEED_ROWS]
    parts += [f"- **{k}** = {v}" for k, v in DERIVED_HOW.items()]
    parts += [f"- **{r}**: glowplug's row of that name, beside the seed's" for r in RAW_ROWS]
    parts += [
        "",
        "The seed's total_time leaves about 15 s of its wall clock unaccounted (imports, process start, the "
        "serving front end); glowplug's last mapped row accounts for every second of its wall clock.",
        "",
    ]
    return "\n".join(parts)


def write_reports(data: dict[str, Any], out_dir: Path, argv: list[str] | None = None) -> list[Path]:
    out = prepare_out_dir(out_dir)
    md, js = out / REPORT_MD, out / REPORT_JSON
    md.write_text(render_markdown(data, argv))
    write_json(js, data)
    return [md, js]


def main(cfg: Seed004BenchConfig, argv: list[str] | None = None) -> int:
    import json

    from rich.console import Console

    err = Console(stderr=True)
    if cfg.from_runs is not None:
        data = json.loads(cfg.from_runs.read_text())
    else:
        data = run_seed004(cfg, argv, progress=lambda msg: err.print(msg, markup=False))
    if cfg.decode_json is not None:
        decode = json.loads(cfg.decode_json.read_text())
        # a run's {"config", "facts", "rows"} (decode.DecodeRun), or the bare row list of older runs
        data["decode"] = decode["rows"] if isinstance(decode, dict) else decode
        data["decode_source"] = str(cfg.decode_json)
    paths = write_reports(data, cfg.out_dir, argv)
    print(render_markdown(data, argv))
    err.print("wrote " + ", ".join(map(str, paths)), markup=False)
    return 0 if all(s.ok for s in starts(data)) and starts(data) else 1


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "seed004",
        help_text="vLLM's start-up sweep on a model of its shape: cold, warm per max-model-len, floor, targets.",
        description=__doc__,
        config_cls=Seed004BenchConfig,
        add_model_flags=add_model_flags,
        runner=main,
    )
