"""Capture (CUDA) or warm (CPU) the compiled decode step for each batch size, so no request pays a compile.

CPU: the graph has an unbacked batch dimension, so one compiled graph serves every batch size; the stage runs it at
each capture size against the real cache (first-call set-up, allocator warm-up) after checking that the compiled
step's guards accept that size (a guard failure would mean a request needs another compile). CUDA: a
`torch.cuda.CUDAGraph` is captured per size over the runner's persistent input buffer; a batch is padded up to the
next captured size (engine/model_runner.py), and replay needs no host work beyond writing that buffer.
"""

from __future__ import annotations

import time

import torch

from ...profiling.names import Attr
from ..model_runner import ModelRunner
from .base import StageReport
from .dynamo_transform import skipped_reason
from .context import EngineContext

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def capture_sizes(ctx: EngineContext) -> list[int]:
    """Batch sizes to capture (CUDA) or warm (CPU), up to --max-num-seqs. CUDA also captures --max-num-seqs itself,
    so every batch has a captured size to pad up to."""
    limit = ctx.config.scheduler.max_num_seqs
    picked = {s for s in ctx.config.cudagraph_capture_sizes or DEFAULT_SIZES if 1 <= s <= limit}
    if ctx.device == "cuda":
        picked.add(limit)
    return sorted(picked) or [1]


class CudaGraphDecode:
    """The decode step replayed from CUDA graphs captured per batch size over the runner's input buffer."""

    def __init__(self, runner: ModelRunner, decode_fn: object, sizes: list[int]) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.times: list[float] = []
        caches = runner.kv_cache.layers
        pool = None
        for size in sorted(sizes, reverse=True):  # largest first: later graphs reuse its memory pool
            packed = runner.padding_batch(size)  # every row padding: reads/writes the scratch block
            t0 = time.perf_counter()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the capture (allocations, lazy inits)
                    decode_fn(packed, caches)  # type: ignore[operator]
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = decode_fn(packed, caches)  # type: ignore[operator]
            pool = graph.pool()
            torch.cuda.synchronize()
            self.graphs[size] = (graph, out)
            self.times.append(round(time.perf_counter() - t0, 4))

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        graph, out = self.graphs[int(packed.shape[0])]
        graph.replay()
        return out


class GraphCapture:
    name = "graph_capture"
    # model, native: skipped_reason looks for quantized layers without native kernels; compile_fallback: why the
    # compiled step was dropped for eager, so there is nothing to capture.
    needs: tuple[str, ...] = ("runner", "decode_fn", "model", "native", "compile_fallback")
    # It sets the runner's decode step in place (and stores the runner back, see run): warmup waits for it.
    provides: tuple[str, ...] = ("runner",)

    def run(self, ctx: EngineContext) -> StageReport:
        reason = skipped_reason(ctx, ctx.compile_fallback)
        if reason is not None:
            return StageReport.skipped(reason)
        runner = ctx.need(ctx.runner, "the model runner", "kv_cache_init")
        decode_fn = ctx.need(ctx.decode_fn, "the compiled decode step", "graph_compile")
        sizes = [s for s in capture_sizes(ctx) if s <= runner.max_decode_batch]
        caches = runner.kv_cache.layers
        for size in sizes:
            packed = runner.padding_batch(size)
            if not decode_fn.guards_pass(packed, caches):
                raise RuntimeError(
                    f"the compiled decode step's guards reject batch size {size} "
                    f"({decode_fn.guard_failure(packed, caches)}): a request would need another compile. This "
                    f"is a bug in the decode graph's dynamic shapes."
                )
        if ctx.device == "cuda":
            captured = CudaGraphDecode(runner, decode_fn, sizes)
            runner.install_decode(captured, sizes)
            times = captured.times
        else:
            times = runner.warm_up(lambda packed: decode_fn.unguarded(packed, caches), sizes)
            runner.install_decode(decode_fn.serving(caches), sizes)
        ctx.runner = runner  # the same object, changed in place: the write is what the stage contract sees
        return StageReport(
            attributes={Attr.GRAPH_SIZES: sizes, Attr.GRAPH_SIZE_TIMES_S: times, Attr.RECOMPILES: 0}  # a loaded step never compiles; guards were checked above
        )
