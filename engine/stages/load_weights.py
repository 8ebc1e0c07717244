"""Map the safetensors shards and read every page once, so the I/O is booked here and not to a later stage."""

from __future__ import annotations

import torch

from ...profiling.names import Attr
from ..models.loader import read_checkpoint
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

    def run(self, ctx: EngineContext) -> StageReport:
        import time

        t0 = time.perf_counter()
        ckpt = read_checkpoint(ctx.need(ctx.model_dir, "the model folder", "model_prepare"))
        touched = touch_pages(ckpt.state_dict)
        seconds = time.perf_counter() - t0
        ctx.state_dict = ckpt.state_dict
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
