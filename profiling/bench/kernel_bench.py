"""`glowplug bench kernels` and `glowplug bench accuracy`: thin command wrappers over the kernel micro-benchmark
(kernels/bench.py) on the model's real layer shapes, and over the quantization accuracy evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .machine import report_header


class KernelBenchConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "smollm2"
    ms: tuple[int, ...] = Field((1, 4, 16, 64, 256), min_length=1, description="Tokens in the batch (M).")
    formats: tuple[str, ...] | None = Field(None, description="Format specs (default: all, e.g. int4-g128).")
    # At least 3: the table shows a median and a spread, which one or two calls cannot give.
    repeats: int = Field(10, ge=3, le=1000, description="Timed calls per path and M (median and min–max shown).")
    native: bool = Field(True, description="Also time glowplug's native kernels (the compiled decode step's).")
    isa_levels: tuple[Literal["portable", "avx2", "avx512", "avx512_bf16", "amx"], ...] = Field(
        (),
        description="Also time the native kernels at these ISA levels (each in a child process capped with "
        "GLOWPLUG_MAX_CPU_ISA; levels above this CPU's are left out, and the report says so).",
    )
    native_only: bool = Field(False, description="Time only the native kernels (what --isa-levels runs per level).")
    rows_json: Path | None = Field(None, description="Also write the rows as JSON here (for --isa-levels).")
    quality_from: Path | None = Field(None, description="Accuracy JSON whose >2x-bf16-perplexity formats get flagged.")
    out: Path | None = None


def model_layer_shapes(model: str) -> list[tuple[int, int]]:
    """Distinct (N, K) of the model's projections: q, k/v, o, gate/up, down, and the LM head (the engine's default
    quantizes it), as the engine's dispatcher is calibrated on them."""
    from glowplug.engine.models.arch import load_arch
    from glowplug.engine.models.store import resolve_model

    return load_arch(resolve_model(model, quiet=True)).projection_shapes(lm_head=True)


def run_kernel_bench(cfg: KernelBenchConfig, argv: list[str] | None) -> str:
    from glowplug.base.artifacts.cachedir import cache_dir_from_env
    from glowplug.kernels.bench import DEFAULT_BENCH_FORMATS, bench_kernels, render_markdown
    from glowplug.kernels.dispatch import Dispatcher, calibrate

    shapes = model_layer_shapes(cfg.model)
    from glowplug.kernels.bench import native_available

    from .quality import flag_note, load_flags

    formats = cfg.formats or DEFAULT_BENCH_FORMATS
    if cfg.native_only:
        native, why = native_available(cache_dir_from_env())
        rows = bench_kernels(shapes, ms=cfg.ms, formats=formats, repeats=cfg.repeats, native_only=native)
        if cfg.rows_json is not None:
            cfg.rows_json.write_text(json.dumps({"rows": rows, "native": why if native else f"unavailable: {why}"}))
        return render_markdown(rows)
    # Calibrate first (cached per machine, torch and shapes): the engine's quantized layers then dispatch by the
    # measured winners, and the "chosen" column below shows those picks.
    table = calibrate(shapes, cache_dir_from_env(), repeats=cfg.repeats)
    native, why = native_available(cache_dir_from_env()) if cfg.native else (False, "--no-native")
    rows = bench_kernels(
        shapes,
        ms=cfg.ms,
        formats=formats,
        repeats=cfg.repeats,
        dispatcher=Dispatcher(table),
        native=native,
    )
    levels_note = ""
    if cfg.isa_levels:
        extra, levels_note = _other_levels(cfg)
        rows += extra
    flags = load_flags(cfg.quality_from)
    shown = ", ".join(f"{n}x{k}" for n, k in shapes)
    calibrated = ", ".join(sorted({k.split("/")[1] + "-" + k.split("/")[2] for k in table.measured}))
    return "\n".join(
        [
            report_header("Quantized linear kernels", argv),
            f"Layer shapes (N x K) of `{cfg.model}`: {shown}. Weights rotate through copies larger than the "
            "last-level cache, as in a real decode step. `*` marks the dispatcher's pick for that M. bf16 "
            "activations; each kernel called on its own (no graph). µs: the median of "
            f"{cfg.repeats} timed calls (fewer, never under 3, once a path has used 2 s; the calls column says how "
            "many), with the fastest and slowest call in brackets. GB/s and GFLOP/s are at the median. The "
            "dispatcher ranks paths by their fastest call (on a shared machine preemption only adds time), so `*` "
            f"can mark a path whose median is not the lowest. Dispatcher calibrated for: {calibrated}. "
            f"native rows (glowplug's kernels, what the compiled decode step runs): "
            f"{'included' if native else 'not measured: ' + why}.{levels_note}",
            "",
            render_markdown(rows, flags),
            "- KiB read: bytes of the layout the path really reads per call (int2 through `aten_int4` reads "
            "4-bit codes: its 2-bit codes are widened for that kernel); KiB stored: the format's canonical bytes. "
            "GB/s read = KiB read / µs.",
            *([f"- {flag_note(flags)}"] if flags else []),
            "",
        ]
    )


def _other_levels(cfg: KernelBenchConfig) -> tuple[list[dict[str, Any]], str]:
    """The native rows at each of cfg.isa_levels, each timed in a child process under GLOWPLUG_MAX_CPU_ISA (a
    process loads one variant), and a sentence for the report on what ran."""
    from glowplug.base.machine import cpu_isa_level, level_at_least

    top = cpu_isa_level()
    rows: list[dict[str, Any]] = []
    said: list[str] = []
    for level in cfg.isa_levels:
        if not level_at_least(top, level):
            said.append(f"{level}: not run (this CPU's highest level is {top})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [
                sys.executable,
                "-m",
                "glowplug.cli",
                "bench",
                "kernels",
                cfg.model,
                "--native-only",
                "--repeats",
                str(cfg.repeats),
                "--ms",
                ",".join(str(m) for m in cfg.ms),
                "--rows-json",
                str(out),
                *(["--formats", ",".join(cfg.formats)] if cfg.formats else []),
            ]
            env = {**os.environ, "GLOWPLUG_MAX_CPU_ISA": level}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0 or not out.is_file():
                said.append(f"{level}: failed ({(done.stderr.strip().splitlines() or ['?'])[-1]})")
                continue
            data = json.loads(out.read_text())
        rows += [r for r in data["rows"] if r["path"].startswith("native")]
        said.append(f"{level}: {data['native']}")
    return rows, " Native rows at other ISA levels (child processes): " + "; ".join(said) + "."


def run_accuracy_report(cfg: object, argv: list[str] | None) -> str:
    from .accuracy import AccuracyConfig, accuracy_verdicts, quality, render_markdown, run_accuracy
    from .cli_support import write_json
    from .verdicts import verdicts_markdown, write_verdicts

    assert isinstance(cfg, AccuracyConfig)
    rows = run_accuracy(cfg)
    if cfg.out is not None:
        # The perplexities next to the report: the speed reports flag unusable formats from it (--quality-from).
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(cfg.out.with_suffix(".json"), quality(rows))
    verdicts = accuracy_verdicts(rows)
    if cfg.out is not None and verdicts:
        write_verdicts(cfg.out, verdicts)
    return "\n".join(
        [
            report_header("Quantization accuracy against bf16", argv),
            f"Model `{cfg.model}`. Text: the project's own evaluation text plus greedy bf16 continuations of its "
            f"own prompts ({rows[0].tokens} scored tokens, windows of {cfg.window}). Perplexity of each scheme, "
            "mean KL(bf16 || scheme) of the next-token distributions, and top-1 agreement with bf16. Group sizes: "
            f"{cfg.group_size or 'each scheme default'}; int4's default on a model converted from a Q4_0/Q4_1 GGUF is "
            "the source's 32-weight block (exact on its grid); group-wise formats on K=576 layers use the largest "
            "allowed group that divides K.",
            "",
            render_markdown(rows),
            "## Verdicts",
            "",
            verdicts_markdown(verdicts),
            "",
        ]
    )
