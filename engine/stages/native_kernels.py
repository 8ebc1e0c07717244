"""Build (or load from the cache) glowplug's native CPU kernels and switch the model's linear layers to them.

The compiled decode step's projections run these GEMV kernels (kernels/native.py); a stock torch build of the same
step streams weights at about half the speed at batch 1 (reports/kernels.md). Without a C++ compiler, or off the CPU,
the stage reports why and the decode step compiles around the stock ops instead.
"""

from __future__ import annotations

from ...profiling.names import Attr
from ..start_estimate import HIT, MISS
from .base import StageReport
from .context import EngineContext

# The row-major dense kernel (fp32 layers, and the tied LM head, which is not copied into a blocked layout) serves
# decode batches up to this size; larger ones go to aten's GEMM (oneDNN). The blocked bf16 and packed kernels serve
# every batch size.
DENSE_SMALL_M = 16


class NativeKernels:
    name = "native_kernels"
    # It switches the model's layers to native kernels in place (and stores the model back, see run): later
    # readers of the model wait for it.
    needs: tuple[str, ...] = ("model", "dtype")
    provides: tuple[str, ...] = ("native", "model")
    caches: tuple[str, ...] = ("native",)

    def cache_probe(self, ctx: EngineContext) -> dict[str, str]:
        """For the ETA: whether the variant to load is in the cache dir ("hit") or must be built ("miss"). A
        prebuilt variant (made at install, beside the sources) is no cache: emptying the cache dir keeps it, so it
        adds nothing to the pattern. Sets `native` as far as the compile probe needs it (will the kernels load)."""
        if not ctx.config.compile_enabled() or ctx.device != "cpu":
            return {}
        from glowplug.kernels.native import NativeBuild, compiler_available, stored_variant

        where = stored_variant(ctx.cache_root)
        available = where not in (None, "disabled") or (where is None and compiler_available())
        ctx.native = NativeBuild(available, None, where is not None, 0.0, f"probe: {where or 'to build'}")
        if where in ("disabled", "loaded", "prebuilt"):
            return {}
        return {"native": HIT if where == "cached" else MISS}

    def run(self, ctx: EngineContext) -> StageReport:
        if not ctx.config.compile_enabled():
            return StageReport.skipped(ctx.config.compile_off_reason())
        if ctx.device != "cpu":
            return StageReport.skipped(f"native kernels are CPU kernels (device {ctx.device})")
        model = ctx.need(ctx.model, "the model", "model_init")
        from glowplug.kernels.modules import enable_native_decode
        from glowplug.kernels.native import load_native

        build = load_native(ctx.cache_root)
        ctx.native = build
        attrs: dict[str, object] = {Attr.CACHE_HIT: build.cache_hit, "glowplug.native_build": build.reason}
        if build.path is not None:
            attrs["glowplug.native_library"] = str(build.path)
        if build.level:
            attrs[Attr.ISA_LEVEL], attrs[Attr.ISA_REASON] = build.level, build.level_reason
        if build.background:
            attrs["glowplug.native_background_build"] = build.background
        if not build.available:
            return StageReport.skipped(f"native kernels unavailable: {build.reason}", attrs)  # type: ignore[arg-type]
        fallbacks: dict[str, int] = {}
        counts = enable_native_decode(model, DENSE_SMALL_M, ctx.dtype, fallbacks)
        ctx.model = model  # the same object, changed in place: the write is what the stage contract sees
        attrs.update({
            "glowplug.native_dense_layers": counts["dense"],
            "glowplug.native_quantized_layers": counts["quantized"],
            "glowplug.native_attention_layers": counts["attention"],
            Attr.BYTES_PER_TOKEN: counts["bytes_per_token"],
        })  # fmt: skip
        # Layers a native op would serve but that keep the stock path (a sliding-window attention layer: the native
        # decode attention reads the whole context), each reason with its layer count: on the span and the row.
        fallen = "; ".join(f"{n} layers: {why}" for why, n in fallbacks.items())
        if fallen:
            attrs[Attr.NATIVE_FALLBACK] = fallen
        # The row's note: the level, and why it is not the CPU's best when it is not (degrade loudly).
        attrs[Attr.ROW_NOTE] = (f"ISA {build.level_reason}" + (f"; {build.background}" if build.background else "")
                                + (f"; {fallen}" if fallen else ""))  # fmt: skip
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
