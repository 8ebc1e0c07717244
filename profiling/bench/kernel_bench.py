"""`glowplug bench kernels` and `glowplug bench accuracy`: thin command wrappers over the kernel micro-benchmark
(kernels/bench.py) on the model's real layer shapes, and over the quantization accuracy evaluation."""

from __future__ import annotations

from pathlib import Path

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
    quality_from: Path | None = Field(None, description="Accuracy JSON whose >2x-bf16-perplexity formats get flagged.")
    out: Path | None = None


def model_layer_shapes(model: str) -> list[tuple[int, int]]:
    """Distinct (N, K) of the model's projections: q, k/v, o, gate/up, down."""
    from glowplug.base.artifacts.cachedir import cache_dir_from_env
    from ...engine.models.arch import load_arch
    from ...engine.models.store import resolve_model
    from ...engine.stages.context import EngineContext
    from ...engine.stages.model_init import layer_shapes

    ctx = EngineContext(cache_root=cache_dir_from_env())
    ctx.arch = load_arch(resolve_model(model, quiet=True))
    return layer_shapes(ctx)


def run_kernel_bench(cfg: KernelBenchConfig, argv: list[str] | None) -> str:
    from glowplug.base.artifacts.cachedir import cache_dir_from_env
    from ...kernels.bench import DEFAULT_BENCH_FORMATS, bench_kernels, render_markdown
    from ...kernels.dispatch import Dispatcher, calibrate

    shapes = model_layer_shapes(cfg.model)
    # Calibrate first (cached per machine, torch and shapes): the engine's quantized layers then dispatch by the
    # measured winners, and the "chosen" column below shows those picks.
    table = calibrate(shapes, cache_dir_from_env(), repeats=cfg.repeats)
    from ...kernels.bench import native_available
    from .quality import flag_note, load_flags

    native, why = native_available(cache_dir_from_env()) if cfg.native else (False, "--no-native")
    rows = bench_kernels(
        shapes, ms=cfg.ms, formats=cfg.formats or DEFAULT_BENCH_FORMATS, repeats=cfg.repeats,
        dispatcher=Dispatcher(table), native=native,
    )  # fmt: skip
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
            f"{'included' if native else 'not measured: ' + why}.",
            "",
            render_markdown(rows, flags),
            "- KiB read: bytes of the layout the path really reads per call (int2 through `aten_int4` reads "
            "4-bit codes: its 2-bit codes are widened for that kernel); KiB stored: the format's canonical bytes. "
            "GB/s read = KiB read / µs.",
            *([f"- {flag_note(flags)}"] if flags else []),
            "",
        ]
    )


def run_accuracy_report(cfg: object, argv: list[str] | None) -> str:
    from .accuracy import AccuracyConfig, quality, render_markdown, run_accuracy
    from .cli_support import write_json

    assert isinstance(cfg, AccuracyConfig)
    rows = run_accuracy(cfg)
    if cfg.out is not None:
        # The perplexities next to the report: the speed reports flag unusable formats from it (--quality-from).
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(cfg.out.with_suffix(".json"), quality(rows))
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
        ]
    )
