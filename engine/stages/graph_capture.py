"""Capture (CUDA) or warm (CPU) the compiled decode step for each batch size, so no request pays a compile.

CPU: the graph has an unbacked batch dimension, so one compiled graph serves every batch size; the stage checks that
the compiled step's guards accept each capture size (a guard failure would mean a request needs another compile) and
runs it against the real cache at the smallest sizes only (`CPU_WARM_SIZES`: batch 1 and the first batched one run
every kernel path of the step once; a larger size runs the same code over more rows, and at a real model's size
running them all cost seconds of compute per size). CUDA: the runner
captures a `torch.cuda.CUDAGraph` per size (ModelRunner.capture_graphs) over its static input buffer, under inference
mode, all in one memory pool; a batch is padded up to the next captured size (engine/graph_buckets.py), and replay
needs no host work beyond writing that buffer. The row records each size's capture time, the pool's growth and the
step's activations, and the pool as the allocator's snapshot holds it after the capture, against the largest size's
activations (which it should not much exceed).
"""

from __future__ import annotations

from glowplug.engine.graph_buckets import bucket_sizes
from glowplug.profiling.names import Attr

from .context import EngineContext
from .dynamo_transform import skipped_reason
from .protocol import StageReport

# How many of the smallest capture sizes the CPU runs (the first-call set-up of every kernel path in the step).
CPU_WARM_SIZES = 2


def capture_sizes(ctx: EngineContext) -> list[int]:
    """Batch sizes to capture (CUDA) or warm (CPU), up to --max-num-seqs. CUDA also captures --max-num-seqs itself,
    so every batch has a captured size to pad up to."""
    return bucket_sizes(
        ctx.config.scheduler.max_num_seqs, ctx.config.cudagraph_capture_sizes, include_limit=ctx.device == "cuda"
    )


def pool_note(reserved: int, size: int, activations: int) -> str:
    """The row's note: the graphs' pool against the largest captured size's activations (what it should hold)."""
    ratio = f"{reserved / activations:.2f}x" if activations > 0 else "n/a"
    return (
        f"graph pool {reserved / 1e9:.3f} GB (allocator snapshot); size {size}'s activations "
        f"{activations / 1e9:.3f} GB; pool / activations {ratio}"
    )


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
        attrs: dict[str, object] = {Attr.GRAPH_SIZES: sizes, Attr.RECOMPILES: 0}  # guards were checked above
        if ctx.device == "cuda":
            stats = runner.capture_graphs(lambda packed: decode_fn(packed, caches), sizes)
            attrs[Attr.GRAPH_SIZE_TIMES_S] = [s.seconds for s in stats]
            attrs[Attr.GRAPH_SIZE_POOL_BYTES] = [s.pool_bytes for s in stats]
            attrs[Attr.GRAPH_POOL_BYTES] = sum(s.pool_bytes for s in stats)
            attrs[Attr.GRAPH_SIZE_ACTIVATION_BYTES] = [s.activation_bytes for s in stats]
            usage = runner.graph_pool_usage()
            if usage is not None:
                attrs.update(
                    {
                        Attr.GRAPH_POOL_RESERVED_BYTES: usage.reserved_bytes,
                        Attr.GRAPH_POOL_ALLOCATED_BYTES: usage.allocated_bytes,
                        Attr.GRAPH_POOL_SEGMENTS: usage.segments,
                        Attr.GRAPH_POOL_LARGEST_BLOCKS: list(usage.largest_blocks),
                    }
                )
                attrs[Attr.ROW_NOTE] = pool_note(usage.reserved_bytes, stats[-1].size, stats[-1].activation_bytes)
        else:
            warm = sizes[:CPU_WARM_SIZES]
            attrs[Attr.GRAPH_WARMED_SIZES] = warm
            attrs[Attr.GRAPH_SIZE_TIMES_S] = runner.warm_up(lambda packed: decode_fn.unguarded(packed, caches), warm)
            runner.install_decode(decode_fn.serving(caches), sizes)
        ctx.runner = runner  # the same object, changed in place: the write is what the stage contract sees
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
