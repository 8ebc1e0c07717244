"""Build (or load from the cache) glowplug's native CPU kernels and switch the model's linear layers to them; on a
GPU, switch the quantized layers to the Triton ops instead.

The compiled decode step's projections run these GEMV kernels (kernels/native.py); a stock torch build of the same
step streams weights at about half the speed at batch 1 (reports/kernels.md). Without a C++ compiler the stage
reports why and the decode step compiles around the stock ops instead.

On CUDA the dense projections trace as they are (F.linear), but a quantized layer's dispatcher path does not trace
with a symbolic batch, so the quantized layers are switched to the Triton GEMV/GEMM custom ops
(kernels/triton/graph_ops.py) for the compiled step and its CUDA graphs. Where Triton cannot run (not installed, a GPU
older than Ampere) the row says why, and dynamo_transform keeps the step eager with the same reason.
"""

from __future__ import annotations

from glowplug.engine.start_estimate import HIT, MISS
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

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
        gpu: dict[str, str] = {}
        said = ""
        if ctx.device.startswith("cuda"):
            # The GPU's counterpart of these kernels for attention: whether the Triton paged kernel serves decode
            # attention (asking registers its op, before the decode step is traced or loaded), or why the torch
            # ops do; on the span and in the row's skip reason, eager or compiled.
            from glowplug.engine.attention import triton_attention_unavailable_reason

            why = triton_attention_unavailable_reason(ctx.device)
            gpu[Attr.DECODE_ATTENTION] = "triton" if why is None else f"torch ops: {why}"
            said = f"; decode attention: {gpu[Attr.DECODE_ATTENTION]}"
        from glowplug.kernels.gguf import stored_layers

        # Layers computed on stored GGUF blocks run the native op in every call, eager ones included.
        in_place = stored_layers(ctx.model) if ctx.device == "cpu" and ctx.model is not None else 0
        if not ctx.config.compile_enabled() and not in_place:
            return StageReport.skipped(f"{ctx.config.compile_off_reason()}{said}", gpu)
        if ctx.device.startswith("cuda"):
            return self._triton(ctx, gpu, said)
        if ctx.device != "cpu":
            return StageReport.skipped(f"native kernels are CPU kernels (device {ctx.device}){said}", gpu)
        model = ctx.need(ctx.model, "the model", "model_init")
        from glowplug.kernels.modules import enable_native_decode
        from glowplug.kernels.native import load_native

        build = load_native(ctx.cache_root)
        ctx.native = build
        attrs: dict[str, object] = {Attr.CACHE_HIT: build.cache_hit, Attr.NATIVE_BUILD: build.reason}
        if build.path is not None:
            attrs[Attr.NATIVE_LIBRARY] = str(build.path)
        if build.level:
            attrs[Attr.ISA_LEVEL], attrs[Attr.ISA_REASON] = build.level, build.level_reason
        if build.background:
            attrs[Attr.NATIVE_BACKGROUND_BUILD] = build.background
        if not build.available:
            if in_place:
                return self._densified(ctx, model, build.reason, attrs)
            return StageReport.skipped(f"native kernels unavailable: {build.reason}", attrs)  # type: ignore[arg-type]
        if not ctx.config.compile_enabled():
            attrs[Attr.ROW_NOTE] = (
                f"ISA {build.level_reason}; {in_place} layers compute on their stored GGUF blocks; "
                f"{ctx.config.compile_off_reason()}"
            )
            return StageReport(attributes=attrs)  # type: ignore[arg-type]
        fallbacks: dict[str, int] = {}
        counts = enable_native_decode(model, DENSE_SMALL_M, ctx.dtype, fallbacks)
        ctx.model = model  # the same object, changed in place: the write is what the stage contract sees
        attrs.update(
            {
                Attr.NATIVE_DENSE_LAYERS: counts["dense"],
                Attr.NATIVE_QUANTIZED_LAYERS: counts["quantized"],
                Attr.NATIVE_ATTENTION_LAYERS: counts["attention"],
                Attr.BYTES_PER_TOKEN: counts["bytes_per_token"],
            }
        )
        # Layers a native op would serve but that keep the stock path (`NativeSwitch.fallback`; no layer of the models
        # here gives one today: sliding-window attention layers switch too, the op takes the window), each reason with
        # its layer count: on the span and the row.
        fallen = "; ".join(f"{n} layers: {why}" for why, n in fallbacks.items())
        if fallen:
            attrs[Attr.NATIVE_FALLBACK] = fallen
        # The row's note: the level, and why it is not the CPU's best when it is not (degrade loudly).
        attrs[Attr.ROW_NOTE] = (
            f"ISA {build.level_reason}"
            + (f"; {build.background}" if build.background else "")
            + (f"; {fallen}" if fallen else "")
        )
        return StageReport(attributes=attrs)  # type: ignore[arg-type]

    def _densified(self, ctx: EngineContext, model: object, reason: str, attrs: dict[str, object]) -> StageReport:
        """Without the native library the layers planned in place cannot run as stored: their weights are
        de-quantized into ordinary layers now, at the memory and speed of the model dtype, and the row says so."""
        import torch

        from glowplug.kernels.gguf import densify

        assert isinstance(model, torch.nn.Module)
        made = densify(model, ctx.dtype)
        ctx.model = model  # type: ignore[assignment]  # changed in place
        attrs[Attr.NATIVE_FALLBACK] = f"stored GGUF layers de-quantized to {ctx.dtype}: {reason}"
        attrs[Attr.ROW_NOTE] = (
            f"native kernels unavailable ({reason}): the GGUF layers planned in place were "
            f"de-quantized to {str(ctx.dtype).removeprefix('torch.')} ({made / 1e9:.2f} GB)"
        )
        return StageReport(attributes=attrs)  # type: ignore[arg-type]

    def _triton(self, ctx: EngineContext, gpu: dict[str, str], said: str) -> StageReport:
        """CUDA: the quantized layers' compiled decode through the Triton ops, or the reason they cannot; `gpu` and
        `said`: which decode attention runs, for the span and the row."""
        model = ctx.need(ctx.model, "the model", "model_init")
        from glowplug.kernels.modules import enable_triton_decode

        fallbacks: dict[str, int] = {}
        counts = enable_triton_decode(model, fallbacks)
        ctx.model = model  # changed in place, as on the CPU
        if counts["quantized"] == 0:
            return StageReport.skipped(
                f"no quantized layers: the dense projections trace as they are on CUDA{said}", gpu
            )
        attrs: dict[str, object] = {
            **gpu,
            Attr.TRITON_DECODE_LAYERS: counts["switched"],
            Attr.BYTES_PER_TOKEN: counts["bytes_per_token"],
        }
        fallen = "; ".join(f"{n} layers: {why}" for why, n in fallbacks.items())
        if fallen:
            attrs[Attr.NATIVE_FALLBACK] = fallen
        if counts["switched"] == 0:
            return StageReport.skipped(f"Triton decode kernels unavailable: {fallen}{said}", attrs)  # type: ignore[arg-type]
        attrs[Attr.ROW_NOTE] = (
            f"Triton GEMV/GEMM ops for {counts['switched']} quantized layers" + (f"; {fallen}" if fallen else "") + said
        )
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
