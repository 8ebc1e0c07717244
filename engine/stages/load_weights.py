"""Map the safetensors shards, check them against the architecture, and fuse the projections.

Every page is read once here, so the I/O is booked to this stage and not to a later one. q/k/v and gate/up are
concatenated into the model's fused projections (a copy, made in the run dtype unless the weights are about to be
quantized, which starts from the checkpoint's own precision); the other tensors stay mapped from the file."""

from __future__ import annotations

import torch

from ...profiling.names import Attr
from ..models.loader import build_meta_model, check_state_dict, fuse_checkpoint, read_checkpoint
from .base import StageReport
from .context import EngineContext

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
    needs: tuple[str, ...] = ("model_dir", "arch", "dtype")
    provides: tuple[str, ...] = ("state_dict", "weights_bytes")

    def run(self, ctx: EngineContext) -> StageReport:
        import time

        t0 = time.perf_counter()
        model_dir = ctx.need(ctx.model_dir, "the model folder", "model_prepare")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        ckpt = read_checkpoint(model_dir)
        touched = touch_pages(ckpt.state_dict)
        seconds = time.perf_counter() - t0
        checked = check_state_dict(build_meta_model(arch), ckpt.state_dict, model_dir)
        quantizing = ctx.config.quant.quantization != "none"
        ctx.state_dict = fuse_checkpoint(checked, None if quantizing else ctx.dtype)
        ctx.weights_bytes = touched
        return StageReport(
            attributes={
                Attr.BYTES_READ: ckpt.bytes_read,
                # Throughput for the span; the span itself still holds the authoritative duration.
                Attr.READ_GBPS: round(ckpt.bytes_read / max(seconds, 1e-9) / 1e9, 3),
                "glowplug.files": [str(f) for f in ckpt.files],
                "glowplug.tensors": len(ckpt.state_dict),
            }
        )
