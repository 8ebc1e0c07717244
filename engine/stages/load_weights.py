"""Map the safetensors shards (or the GGUF), check them against the architecture, and fuse the projections.

A folder prepared from a GGUF reads its weights from the GGUF itself (engine/models/gguf_tensors.py): blocks on the
grid of the requested int4/int8 layout are repacked as they are, the others de-quantized to the run dtype (fp32
when a quantizer follows). Under --quantization auto the layout is chosen per layer (engine/models/gguf_auto.py):
exact repacks as above, fp32 for the layers quantize_weights re-quantizes, the model dtype for the rest.

Every page is read once here, so the I/O is booked to this stage and not to a later one. q/k/v and gate/up are
concatenated into the model's fused projections (a copy, made in the run dtype unless the weights are about to be
quantized, which starts from the checkpoint's own precision); the other tensors stay mapped from the file."""

from __future__ import annotations

import torch

from glowplug.engine.models.gguf_auto import AUTO_GROUP
from glowplug.engine.models.gguf_tensors import PackPlan, TensorTable, load_gguf_weights
from glowplug.engine.models.loader import build_meta_model, check_state_dict, fuse_checkpoint, read_checkpoint
from glowplug.engine.models.store import gguf_table
from glowplug.engine.parallel import shard_checkpoint
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

_PAGE = 4096


def touch_pages(sd: dict[str, torch.Tensor]) -> int:
    """Fault in each tensor's pages (one byte per page) and return the bytes covered."""
    total = 0
    for t in sd.values():
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel():
            flat[::_PAGE].sum()
        total += flat.numel()
    return total


class LoadWeights:
    name = "load_weights"
    needs: tuple[str, ...] = ("model_dir", "gguf_path", "arch", "dtype")
    provides: tuple[str, ...] = ("state_dict", "weights_bytes", "gguf_stored")

    def run(self, ctx: EngineContext) -> StageReport:
        import time

        t0 = time.perf_counter()
        model_dir = ctx.need(ctx.model_dir, "the model folder", "model_prepare")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        quantizing = ctx.quant_scheme() != "none"
        table = gguf_table(model_dir) if ctx.gguf_path is not None else None
        if table is not None:
            return self._from_gguf(ctx, table, quantizing, t0)
        ckpt = read_checkpoint(model_dir)
        # Names and shapes against the whole model; then this rank's slices, whose pages alone are read.
        checked = shard_checkpoint(
            check_state_dict(build_meta_model(arch), ckpt.state_dict, model_dir), arch, ctx.tp_shard()
        )
        touched = touch_pages(checked)
        seconds = time.perf_counter() - t0
        ctx.state_dict = fuse_checkpoint(checked, None if quantizing else ctx.dtype)
        ctx.gguf_stored = None  # a safetensors checkpoint has no quantized rows to run in place
        ctx.weights_bytes = touched
        return StageReport(
            attributes={
                Attr.BYTES_READ: ckpt.bytes_read if not ctx.tp_shard().active else touched,
                # Throughput for the span; the span itself still holds the authoritative duration.
                Attr.READ_GBPS: round(ckpt.bytes_read / max(seconds, 1e-9) / 1e9, 3),
                Attr.FILES: [str(f) for f in ckpt.files],
                Attr.TENSORS: len(ckpt.state_dict),
            }
        )

    def _from_gguf(self, ctx: EngineContext, table: TensorTable, quantizing: bool, t0: float) -> StageReport:
        import time

        assert ctx.gguf_path is not None and ctx.arch is not None and ctx.model_dir is not None
        q = ctx.config.quant
        formats = ctx.layer_formats() if quantizing else None
        if formats is not None:
            # auto: the layers run in place keep their stored rows (mapped, not loaded); the layers that stay float
            # load straight into the model dtype, the quantizer's inputs in fp32 (fuse_checkpoint then casts nothing:
            # every tensor already has the dtype its use wants).
            plan: PackPlan | None = PackPlan(
                "auto", AUTO_GROUP, formats.repack(), formats.tied_repack(), formats.stored_parts()
            )
            w = load_gguf_weights(ctx.gguf_path, table, ctx.arch, ctx.dtype, plan, formats.fp32_tensors())
        else:
            plan = PackPlan(q.quantization, ctx.quant_group_size()[0]) if quantizing else None
            w = load_gguf_weights(ctx.gguf_path, table, ctx.arch, None if quantizing else ctx.dtype, plan)
        # The stored rows' pages, faulted in now (from the page cache, or the disk on a cold one), so their I/O is
        # this stage's and not the first decode step's.
        stored_bytes = touch_pages({n: r.data for n, r in w.stored.items()})
        seconds = time.perf_counter() - t0
        checked = check_state_dict(build_meta_model(ctx.arch), w.state_dict, ctx.model_dir, logical=w.shapes)
        # This rank's slices, copied: the GGUF's tensors were de-quantized or repacked whole into memory, which
        # is freed once the slices are taken.
        checked = shard_checkpoint({**checked, **w.tied_head}, ctx.arch, ctx.tp_shard(), copy=True)
        ctx.state_dict = fuse_checkpoint(checked, None if quantizing else ctx.dtype)
        ctx.gguf_stored = w.stored or None
        ctx.weights_bytes = sum(t.nbytes for t in ctx.state_dict.values()) + stored_bytes
        attrs: dict[str, object] = {
            Attr.BYTES_READ: w.bytes_read,
            Attr.READ_GBPS: round(w.bytes_read / max(seconds, 1e-9) / 1e9, 3),
            Attr.FILES: [str(ctx.gguf_path)],
            Attr.TENSORS: len(table.tensors),
            # Layers taken on the GGUF's own grid (no de-quantize, no re-rounding).
            Attr.GGUF_REPACKED_LAYERS: len(w.packed),
            # Tensors used where they lie (mapped, computed on in place) and their bytes.
            Attr.GGUF_STORED_TENSORS: len(w.stored),
            Attr.GGUF_STORED_BYTES: stored_bytes,
        }
        if w.stored:
            attrs[Attr.ROW_NOTE] = (
                f"{len(w.stored)} tensors mapped in place ({stored_bytes / 1e9:.2f} GB at "
                f"{stored_bytes / max(seconds, 1e-9) / 1e9:.1f} GB/s)"
            )
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
