"""Compile the traced decode step with Inductor (graph_compile_general_shape), or load the stored one
(graph_compile_cached): its replay plan when the entry has one (no Dynamo or Inductor import, see
engine/compile_replay.py), else the AOT artifact's compiled module. A stored artifact that will not load is moved
aside and the step traced and compiled again here, with the reason on the row.

A loaded replay plan is checked against its fingerprint before it serves (one small step; its outcome and cost are
span attributes): a plan that does not reproduce the logits recorded when it was compiled is rejected with a
`cache_corrupt` event and the start loads the entry's AOT artifact instead, which must then reproduce them (else
the compiled kernels themselves are suspect: the entry and the Inductor folder are moved aside and the step is
compiled again).

Under `--compile auto` a compile that fails (no working C++ compiler, say) leaves the decode step eager, with the
reason on this row and graph_capture's (`compile_fallback`); `--compile on` fails the start with it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import structlog

from glowplug.base.artifacts.caches import file_stamps
from glowplug.base.errors import one_line
from glowplug.engine.compile import CompiledDecode, LoadedDecode, TracedDecode
from glowplug.engine.compile_cache import CompileCache, StoredReplay
from glowplug.engine.compile_replay import ReplayPlan
from glowplug.engine.compile_replay_plan import check_fingerprint, make_plan
from glowplug.engine.config import EngineConfig
from glowplug.engine.kv_cache import KVCache
from glowplug.profiling.names import Attr, Row

from .context import EngineContext
from .dynamo_transform import fall_back_to_eager, inductor_settings, scratch_cache, skipped_reason, trace
from .protocol import StageReport


def checkpoint_identity(ctx: EngineContext) -> str:
    """The checkpoint the model's tensors came from, as the replay's fingerprint records it: a digest of the weight
    files' names, sizes and mtimes (how the quantize cache identifies a checkpoint, without reading it). A compile
    entry serves every checkpoint of one architecture, and logits are only comparable on the same weights; what
    else shapes the tensors (dtype, quantization, torch, glowplug's source) is already in the entry's key."""
    model_dir = ctx.need(ctx.model_dir, "the model folder", "model_prepare")
    files = sorted(model_dir.glob("*.safetensors")) + ([ctx.gguf_path] if ctx.gguf_path is not None else [])
    return hashlib.sha256(json.dumps(file_stamps(files), sort_keys=True).encode()).hexdigest()[:16]


def _scratch(ctx: EngineContext) -> Callable[[int], KVCache]:
    return lambda blocks: scratch_cache(ctx, blocks)


class GraphCompile:
    name = "graph_compile"
    # model, native, arch, dtype: skipped_reason, inductor_settings, the replay plan's scratch cache, a re-trace;
    # model_dir, gguf_path: the checkpoint's identity in the replay fingerprint.
    needs: tuple[str, ...] = (
        "traced",
        "compile_cache",
        "compile_fallback",
        "model_dir",
        "gguf_path",
        "model",
        "native",
        "arch",
        "dtype",
    )
    # traced: replaced only when the stored entry will not load (the one provide not written on every path).
    provides: tuple[str, ...] = ("decode_fn", "traced", "compile_fallback")
    # Its time depends on the compile entry, whose factors dynamo_transform owns (and probes, for the ETA).
    caches: tuple[str, ...] = ("compile",)

    def cpu_bound(self, config: EngineConfig) -> bool:
        """A cold trace or compile keeps every core busy (engine/stages/schedule.py runs such stages one at a time on
        few cores); a warm start's load is short, so holding a stage back behind it costs little."""
        return config.compile_enabled()

    def run(self, ctx: EngineContext) -> StageReport:
        reason = skipped_reason(ctx, ctx.compile_fallback)
        if reason is not None:
            return StageReport.skipped(reason)
        traced = ctx.need(ctx.traced, "the traced decode step", "dynamo_transform")
        cache = ctx.need(ctx.compile_cache, "the compile cache", "dynamo_transform")
        try:
            return self._compile(ctx, traced, cache)
        except Exception as exc:  # noqa: BLE001 - under --compile auto any failed compile means eager, with the reason
            ctx.decode_fn = None
            return fall_back_to_eager(
                ctx,
                f"the decode step did not compile ({one_line(exc)})",
                exc,
                {Attr.CACHE_KEY: cache.key, Attr.COMPILE_CACHE_DIR: str(cache.path)},
            )

    def _compile(
        self, ctx: EngineContext, traced: TracedDecode | LoadedDecode | StoredReplay, cache: CompileCache
    ) -> StageReport:
        settings = inductor_settings(ctx)
        log = structlog.get_logger("glowplug.compile")
        attrs: dict[str, object] = {}
        weights = checkpoint_identity(ctx)
        replay = "not stored"
        rejected: dict[str, object] | None = None  # the fingerprint a loaded plan failed: the AOT step must match it
        if isinstance(traced, StoredReplay):
            try:
                loaded = traced.load(cache.path)
            except Exception as exc:  # noqa: BLE001 - the plan is an optimisation over the full artifact
                replay = f"would not load ({one_line(exc)}); loaded the AOT artifact"
                log.warning("the replay plan would not load; loading the AOT artifact", error=one_line(exc))
                traced = self._full_or_trace(ctx, traced, cache)
            else:
                check = check_fingerprint(loaded, traced.plan.fingerprint, _scratch(ctx), weights)
                attrs[Attr.REPLAY_FINGERPRINT], attrs[Attr.REPLAY_FINGERPRINT_S] = check.outcome, check.seconds
                if check.ok:
                    ctx.decode_fn = loaded
                    replay = "loaded"
                else:
                    why = f"the replayed step does not reproduce the logits recorded at compile time ({check.outcome})"
                    replay = f"rejected ({why}); loaded the AOT artifact"
                    log.warning("the replay plan was rejected; loading the AOT artifact", reason=why)
                    traced.reject(why)
                    rejected = traced.plan.fingerprint
                    traced = self._full_or_trace(ctx, traced, cache)
        if isinstance(traced, LoadedDecode):
            try:
                compiled = ctx.decode_fn = cache.run(lambda: traced.compile(settings))  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - a cached artifact that will not load is a miss
                log.warning(
                    "the stored compiled decode step would not load; tracing and compiling again", error=one_line(exc)
                )
                cache.drop_artifact(f"the compiled module would not load: {one_line(exc)}")
                traced = ctx.traced = trace(ctx)
            else:
                if rejected is not None:
                    aot = check_fingerprint(compiled, rejected, _scratch(ctx), weights)
                    attrs[Attr.REPLAY_FINGERPRINT] = (
                        f"{attrs[Attr.REPLAY_FINGERPRINT]}; the AOT artifact: {aot.outcome}"
                    )
                    if not aot.ok:
                        why = (
                            f"the compiled kernels do not reproduce the logits recorded at compile time ({aot.outcome})"
                        )
                        log.warning("the stored kernels compute other logits; compiling again", reason=why)
                        cache.drop_artifact(why)
                        cache.renew_inductor(why)
                        traced = ctx.traced = trace(ctx)
        step: CompiledDecode | None = None  # compiled here from a trace: stored, with its plan
        plan: ReplayPlan | None = None
        if isinstance(traced, TracedDecode):
            step = ctx.decode_fn = cache.run(lambda: traced.compile(settings))  # retried once in a fresh folder
            try:
                plan = make_plan(step, step.model, _scratch(ctx), cache.path, weights)
                replay = "written"
            except Exception as exc:  # noqa: BLE001 - without a plan, warm starts load the AOT artifact
                replay = f"not written ({one_line(exc)})"
                log.info(
                    "no replay plan for the compiled decode step; warm starts load the AOT artifact",
                    reason=one_line(exc),
                )
        rebuilt = cache.explain_rebuilt()
        hit = cache.served_from_cache()
        cache.record(step, plan)
        attrs.update(
            {
                Attr.CACHE_HIT: hit,
                Attr.CACHE_KEY: cache.key,
                Attr.COMPILE_CACHE_DIR: str(cache.path),
                Attr.KERNELS_BUILT: len(cache.rebuilt_kernels),
                Attr.COMPILE_REPLAY: replay,
            }
        )
        if cache.workspace.source is not None:  # a read-only cache dir: where the private folder's links point
            attrs[Attr.COMPILE_CACHE_READ_ONLY_SOURCE] = str(cache.workspace.source)
        if not hit:
            attrs[Attr.CACHE_MISS_REASON] = cache.miss_reason or rebuilt or "compiled from the trace"
        elif cache.bundle:
            attrs[Attr.CACHE_FROM_BUNDLE] = cache.bundle
        return StageReport(
            attributes=attrs,  # type: ignore[arg-type]
            row=Row.GRAPH_COMPILE_CACHED if hit else Row.GRAPH_COMPILE_GENERAL_SHAPE,
        )

    @staticmethod
    def _full_or_trace(ctx: EngineContext, stored: StoredReplay, cache: CompileCache) -> LoadedDecode | TracedDecode:
        """The entry's AOT artifact instead of its plan; when that will not load either, the entry is damaged: moved
        aside, and the step traced again."""
        try:
            loaded = ctx.traced = stored.full()
            return loaded
        except Exception as exc:  # noqa: BLE001 - a damaged artifact is a miss
            cache.drop_artifact(f"the AOT artifact would not load: {one_line(exc)}")
            traced = ctx.traced = trace(ctx)
            return traced
