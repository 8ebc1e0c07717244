"""Warm the compiled decode step for every captured batch size, so that no request pays a compile.

On the CPU the decode graph is traced with a symbolic batch size (>= 2), so the sizes warmed here cover every batch
up to the largest one and batch 1 runs padded to 2 (a size-1 dimension would be a second graph to compile). CUDA-graph capture is the GPU
counterpart; it needs a capture-safe attention (no host syncs) that this torch attention backend is not, so on
CUDA the stage reports that instead of pretending.
"""

from __future__ import annotations

import time

import torch

from ...profiling.names import Attr
from .base import StageReport
from .context import EngineContext
from .dynamo_transform import TRACE_BATCH, dummy_decode_inputs

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def capture_sizes(ctx: EngineContext) -> list[int]:
    sizes = ctx.config.cudagraph_capture_sizes or DEFAULT_SIZES
    limit = ctx.config.scheduler.max_num_seqs
    picked = sorted({s for s in sizes if 1 <= s <= limit})
    return picked or [1]


class GraphCapture:
    name = "graph_capture"

    def run(self, ctx: EngineContext) -> StageReport:
        if not ctx.config.compile_enabled():
            return StageReport.skipped(f"--compile {ctx.config.compile}" + (" (CPU)" if ctx.config.compile == "auto" else ""))
        if ctx.device != "cpu":
            return StageReport.skipped("skipped: CUDA graph capture needs a capture-safe attention backend")
        runner = ctx.need(ctx.runner, "the model runner", "kv_cache_init")
        decode_fn = ctx.need(ctx.decode_fn, "the traced decode step", "dynamo_transform")
        sizes = capture_sizes(ctx)
        if ctx.device == "cpu":
            runner.min_decode_batch = TRACE_BATCH
            sizes = sorted({max(s, TRACE_BATCH) for s in sizes})
        times: list[float] = []
        with torch.inference_mode():
            for size in sizes:
                t0 = time.perf_counter()
                decode_fn(*dummy_decode_inputs(runner.kv_cache, size, runner.scratch_block))
                times.append(round(time.perf_counter() - t0, 4))
        runner.decode_fn = decode_fn
        runner.decode_sizes = sizes
        backend = ctx.backend
        return StageReport(
            attributes={
                Attr.GRAPH_SIZES: sizes,
                Attr.GRAPH_SIZE_TIMES_S: times,
                "glowplug.graphs_total": len(backend.graphs) if backend is not None else 0,
            }
        )
