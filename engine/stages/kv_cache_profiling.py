"""The activation peak of one forward at max_num_batched_tokens, and the KV cache sized from the budget.

Two ways to the peak (`--kv-profile`):
- analytic (the default on the CPU): engine/activation_peak.py replays the forward's allocations from the model's
  shapes, in milliseconds, and is exactly the bytes the measured forward reports on every configuration its test
  covers. The measured forward cost 7.7 s of a 16.4 s cold start on the 2-core box (beside the compile, whose cores
  it shared), for a number that shapes alone decide. Nothing is cached: recomputing is cheaper than a cache lookup.
  Where it does not apply (CUDA, w8a8, a kernel path it does not mirror) the stage measures, and its row says why.
- measure: run the forward. CUDA: torch's allocator peak, as vLLM does. CPU: the peak of live tensor bytes the
  forward created (profiling/memory.py LiveTensorPeak), which sees memory the allocator reuses; an RSS high-water
  mark does not, and read 10 to 109 MB for the same forward depending on the process's heap history.

On the CPU the budget's "device memory" is the RAM still available after the weights were loaded, so the weights
are not subtracted a second time. A measured peak is an artifact-store entry (cache `kv_profile`): a warm start
reads it and skips the dummy run. It does not depend on max_model_len or the KV-cache settings (the forward runs
without a KV cache), so changing those re-plans the cache without re-profiling.

The forward's size: max_num_batched_tokens tokens (capped by the model's max_position_embeddings, part of the
model config), and logits for min(max_num_seqs, tokens) rows (a prefill batch has at most one sampled row per
sequence). So those two are keyed, and max_model_len is not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import KV_PROFILE
from glowplug.engine.activation_peak import AnalyticPeakUnsupported, activation_peak, analytic_unsupported
from glowplug.engine.attention import AttentionMetadata
from glowplug.engine.config import EngineConfig
from glowplug.engine.kv_sizing import plan_kv_cache
from glowplug.engine.models.arch import ModelArch
from glowplug.engine.parallel import tp_factors
from glowplug.engine.start_estimate import HIT, MISS
from glowplug.profiling.memory import LiveTensorPeak, PeakMemory
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

PROFILE = "profile.json"
ANALYTIC_NOTE = "analytic peak from shapes"
ANALYTIC_METHOD = "analytic_shapes"


class KVProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    activation_peak_bytes: int
    method: str
    tokens: int


def profile_factors(ctx: EngineContext) -> dict[str, Any]:
    """Only what changes the profiled forward's peak: the model, its dtype and quantization, the batch it runs
    (max_num_batched_tokens tokens, logits for max_num_seqs rows) and the device. Not max_model_len, not the
    KV-cache settings, not torch or glowplug versions (live tensor bytes are the tensors' sizes, which those do not
    change; a change of what is measured bumps the cache's version)."""
    arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
    q = ctx.config.quant
    formats = ctx.layer_formats()
    return {
        "model": arch.model_dump(mode="json"),
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "quantization": {
            "scheme": q.quantization,
            "group_size": ctx.quant_group_size()[0],
            # auto: what the file's layers run as (the forward's temporaries depend on the kernels).
            **({"layer_formats": formats.signature()} if formats is not None else {}),
        },
        "max_num_batched_tokens": ctx.config.scheduler.max_num_batched_tokens,
        "max_num_seqs": ctx.config.scheduler.max_num_seqs,
        "device": ctx.device,
        **tp_factors(ctx.config.tensor_parallel_size),  # a rank's forward is its shard's
    }


def profile_batch(ctx: EngineContext) -> tuple[int, int]:
    """(tokens, logits rows) of the profiled forward (see the module docstring)."""
    arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
    tokens = min(ctx.config.scheduler.max_num_batched_tokens, arch.max_position_embeddings)
    return tokens, min(ctx.config.scheduler.max_num_seqs, tokens)


def analytic_skipped(config: EngineConfig) -> str | None:
    """Why this config's peak is measured rather than analytic, or None when the analytic peak is asked for and
    applies as far as the config tells (the built model may still refuse: AnalyticPeakUnsupported)."""
    if config.cache.kv_profile == "measure":
        return "--kv-profile measure"
    return analytic_unsupported(config)


def _analytic(ctx: EngineContext) -> KVProfile:
    model = ctx.need(ctx.model, "the model", "model_init")
    tokens, rows = profile_batch(ctx)
    return KVProfile(
        activation_peak_bytes=activation_peak(model, ctx.dtype, tokens, rows), method=ANALYTIC_METHOD, tokens=tokens
    )


def _measure(ctx: EngineContext) -> KVProfile:
    model = ctx.need(ctx.model, "the model", "model_init")
    tokens, rows = profile_batch(ctx)
    ids = torch.zeros(tokens, dtype=torch.long, device=ctx.device)
    pos = torch.arange(tokens, device=ctx.device)

    def forward() -> None:
        hidden = model(ids, pos, AttentionMetadata.causal([tokens]))
        model.compute_logits(hidden[-rows:]).float()  # the sampler's fp32 copy (logprobs, penalties) counts too
        del hidden

    if ctx.device.startswith("cuda"):
        with torch.inference_mode(), PeakMemory(ctx.device) as window:
            forward()
        assert window.snapshot is not None
        return KVProfile(
            activation_peak_bytes=window.snapshot.peak_increase_bytes, method=window.snapshot.method, tokens=tokens
        )
    with torch.inference_mode(), LiveTensorPeak() as live:
        forward()
    return KVProfile(activation_peak_bytes=live.peak_bytes, method=live.method, tokens=tokens)


class KVCacheProfiling:
    name = "kv_cache_profiling"
    # Not the compile stages': the profiling forward runs eagerly and its tensor tracking is per thread, so it may
    # run alongside Dynamo tracing and the Inductor compile (with few cores a measured one runs after them instead:
    # `cpu_bound`, engine/stages/schedule.py).
    # model_dir: the quantization group size it keys the profile on can come from the source GGUF.
    needs: tuple[str, ...] = ("model", "arch", "dtype", "weights_bytes", "model_dir")
    provides: tuple[str, ...] = ("kv_plan",)
    caches: tuple[str, ...] = ("kv_profile",)

    def cpu_bound(self, config: EngineConfig) -> bool:
        """A measured forward on the CPU keeps every core busy; the analytic peak takes milliseconds, and a GPU's
        forward leaves the cores to the compile."""
        return analytic_skipped(config) is not None and config.resolved_device() == "cpu"

    def cache_probe(self, ctx: EngineContext) -> dict[str, str]:
        """For the ETA: whether the measured peak is stored (then the profiling forward is skipped). The analytic
        peak uses no cache, so its time does not depend on one."""
        if analytic_skipped(ctx.config) is None:
            return {}
        return {"kv_profile": HIT if ArtifactStore(ctx.cache_root).probe(KV_PROFILE, profile_factors(ctx)) else MISS}

    def run(self, ctx: EngineContext) -> StageReport:
        ctx.need(ctx.model, "the model", "model_init")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        why_measured = analytic_skipped(ctx.config)
        if why_measured is None:
            try:
                profile = _analytic(ctx)
            except AnalyticPeakUnsupported as exc:
                why_measured = str(exc)
            else:
                return self._plan(ctx, arch, profile, {Attr.KV_PROFILE: "analytic", Attr.ROW_NOTE: ANALYTIC_NOTE})
        attrs: dict[str, object] = {Attr.KV_PROFILE: "measured"}
        if ctx.config.cache.kv_profile == "analytic":  # asked for, but it does not apply: the row says why
            attrs[Attr.ROW_NOTE] = f"measured: {why_measured}"

        def build(folder: Path | None) -> KVProfile:
            profile = _measure(ctx)
            if folder is not None:
                (folder / PROFILE).write_text(profile.model_dump_json())
            return profile

        fetched = ctx.fetch_entry(
            KV_PROFILE,
            profile_factors(ctx),
            build=build,
            load=lambda folder: KVProfile.model_validate_json((folder / PROFILE).read_text()),
        )
        # A hit still ran (it read the profile): its time is booked to the row, which the table notes "cache hit".
        return self._plan(ctx, arch, fetched.value, {**attrs, **fetched.attributes()})

    @staticmethod
    def _plan(ctx: EngineContext, arch: ModelArch, profile: KVProfile, extra: dict[str, object]) -> StageReport:
        peak, method = profile.activation_peak_bytes, profile.method
        weights = 0 if ctx.device == "cpu" else ctx.weights_bytes
        # Under tensor parallelism a rank's cache holds its KV heads only: its bytes per token are its shard's.
        plan = plan_kv_cache(
            ctx.config,
            ctx.tp_shard().local_arch(arch),
            model_dtype=ctx.dtype,
            device=ctx.device,
            weights_bytes=weights,
            activation_peak_bytes=peak,
        )
        ctx.kv_plan = plan
        attrs: dict[str, object] = {
            Attr.PEAK_MEMORY_BYTES: peak,
            Attr.MEMORY_METHOD: method,
            Attr.KV_BLOCKS: plan.num_blocks,
            Attr.KV_TOKEN_CAPACITY: plan.token_capacity,
            Attr.MAX_CONCURRENCY: round(plan.max_concurrency, 2),
            Attr.MAX_MODEL_LEN: plan.max_model_len,
            Attr.KV_BUDGET_BYTES: plan.budget_bytes,
            Attr.KV_BUDGET_SOURCE: plan.budget_source,
            **extra,
        }
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
