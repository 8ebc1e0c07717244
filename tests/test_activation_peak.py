"""The KV profile's analytic activation peak (engine/activation_peak.py) against its oracle, the measured forward
(kv_cache_profiling `_measure`, LiveTensorPeak): within 5% on the default model and the tiny test models, and the
stage's choice between them on its span and row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from glowplug.base.artifacts.cachedir import cache_dir_from_env
from glowplug.engine.activation_peak import activation_peak
from glowplug.engine.config import EngineConfig
from glowplug.engine.stages.context import EngineContext
from glowplug.engine.stages.kv_cache_profiling import ANALYTIC_NOTE, _measure, profile_batch
from glowplug.engine.stages.runner import run_stages
from glowplug.engine.startup import build_engine, default_stages
from glowplug.profiling.names import Attr
from glowplug.profiling.tracing import setup_tracing

TOLERANCE = 0.05
# The stages that build the model the KV profile runs (native_kernels switches its layers first).
MODEL_STAGES = ("model_prepare", "load_weights", "quantize_weights", "model_init", "native_kernels")


def _model_context(cache: Path, **flat: Any) -> EngineContext:
    ctx = EngineContext(config=EngineConfig.from_flat(**flat), cache_root=cache, device="cpu")
    run_stages(
        [s for s in default_stages() if s.name in MODEL_STAGES], ctx, tracer=setup_tracing(in_memory=True).tracer()
    )
    return ctx


def _check(ctx: EngineContext) -> None:
    assert ctx.model is not None
    tokens, rows = profile_batch(ctx)
    analytic = activation_peak(ctx.model, ctx.dtype, tokens, rows)
    measured = _measure(ctx).activation_peak_bytes
    assert analytic == pytest.approx(measured, rel=TOLERANCE), f"analytic {analytic} vs measured {measured}"


@pytest.mark.parametrize(
    ("variant", "flat"),
    [
        ("llama", {}),
        ("qwen2", {}),  # q/k/v biases, tied head
        ("qwen3", {}),  # q/k norms: its peak is in attention, not the MLP
        ("mistral", {"dtype": "bfloat16", "max_num_batched_tokens": 100}),  # padded bf16 GEMMs
        ("llama", {"quantization": "int8", "max_num_batched_tokens": 64}),
    ],
)
def test_tiny_models(tiny_dir, tmp_path: Path, variant: str, flat: dict[str, Any]) -> None:
    _check(_model_context(tmp_path, model=str(tiny_dir(variant)), **flat))


@pytest.mark.parametrize(
    "flat",
    [
        {},  # the default: bf16, 2048 tokens, 32 logits rows
        {"dtype": "float32", "max_num_batched_tokens": 128},
        {"max_num_batched_tokens": 300, "max_num_seqs": 256},  # padded GEMMs; the peak moves to the logits
        {"quantization": "int8", "max_num_batched_tokens": 300},  # the dequant workspace
    ],
)
def test_default_model(smollm2_dir: Path, flat: dict[str, Any]) -> None:
    _check(_model_context(cache_dir_from_env(), **flat))


def _kv_span(tracing: Any) -> Any:
    return next(s for s in tracing.finished_spans() if s.name == "glowplug.startup.kv_cache_profiling")


def test_stage_uses_the_analytic_peak_on_the_cpu_and_says_so(tiny_dir, tmp_path: Path) -> None:
    tracing = setup_tracing()
    result = build_engine(
        EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off"), tracing=tracing, cache_dir=tmp_path
    )
    span = _kv_span(tracing)
    assert span.attributes[Attr.KV_PROFILE] == "analytic"
    assert span.attributes["glowplug.memory_method"] == "analytic_shapes"
    assert result.phase_table["kv_cache_profiling"].notes == (ANALYTIC_NOTE,)
    assert Attr.CACHE_HIT not in span.attributes  # nothing cached: recomputing is cheaper than a lookup
    # The measured mode sizes the cache from the same bytes, through the kv_profile cache.
    measured_tracing = setup_tracing()
    measured = build_engine(
        EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off", kv_profile="measure"),
        tracing=measured_tracing,
        cache_dir=tmp_path,
    )
    measured_span = _kv_span(measured_tracing)
    assert measured_span.attributes[Attr.KV_PROFILE] == "measured" and measured_span.attributes[Attr.CACHE_HIT] is False
    assert measured_span.attributes[Attr.PEAK_MEMORY_BYTES] == span.attributes[Attr.PEAK_MEMORY_BYTES]
    assert measured.kv_plan == result.kv_plan


def test_where_the_analytic_peak_does_not_apply_the_row_says_why(tiny_dir, tmp_path: Path) -> None:
    tracing = setup_tracing()
    result = build_engine(
        EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off", quantization="w8a8"),
        tracing=tracing,
        cache_dir=tmp_path,
    )
    assert _kv_span(tracing).attributes[Attr.KV_PROFILE] == "measured"
    assert result.phase_table["kv_cache_profiling"].notes == (
        "cache miss: first start for this model",
        "measured: w8a8's per-row activation quantization is not modelled",
    )
