"""The compiled decode step captured as CUDA graphs, one per batch-size bucket, and what their shared memory pool
holds: the capture the runner (engine/model_runner.py `capture_graphs`) installs at start-up (graph_capture)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

PoolId = tuple[int, int]


@dataclass(frozen=True)
class GraphCaptureStat:
    """One captured batch size: the seconds its capture took (two warm-up calls, then the capture), how much the
    shared graph pool's reserved memory grew while capturing it (torch.cuda.memory_reserved after minus before), and
    the step's activations at this size: the allocator's peak during the second, uncaptured warm-up call over what
    was allocated before it (every tensor the step makes and frees, its output included)."""

    size: int
    seconds: float
    pool_bytes: int
    activation_bytes: int


@dataclass(frozen=True)
class GraphPoolUsage:
    """The captured graphs' shared memory pool as the CUDA caching allocator holds it (`torch.cuda.memory_snapshot`,
    the segments whose pool id is the graphs'): what the graphs keep for their replays, apart from the memory the
    warm-up calls and everything else took from the default pool."""

    segments: int
    reserved_bytes: int  # the pool's segments, as cudaMalloc'd
    allocated_bytes: int  # its blocks that live tensors hold (the graphs' outputs)
    largest_blocks: tuple[int, ...]  # the largest blocks' sizes, held or free, largest first (at most 8)


class CapturedDecode:
    """The decode step replayed from CUDA graphs, one per batch-size bucket, each reading its static input (a prefix
    of the runner's serving buffer). The serving path writes its rows there already; an input held elsewhere (a
    test's, a start-up check's) is copied in first, so a call means what it says whatever tensor it is given."""

    def __init__(self, graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]]) -> None:
        self.graphs = graphs  # size -> (graph, static input, static output)

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        graph, static, out = self.graphs[int(packed.shape[0])]
        if packed.data_ptr() != static.data_ptr():
            static.copy_(packed)
        graph.replay()
        return out


def capture_decode_graphs(
    step: Callable[[torch.Tensor], torch.Tensor],
    sizes: list[int],
    padding: Callable[[int], torch.Tensor],
    device: torch.device,
) -> tuple[dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]], list[GraphCaptureStat], PoolId | None]:
    """Capture `step` as one CUDA graph per batch size, largest first so that the smaller ones reuse its memory
    from the one shared pool, each over `padding(size)`: the static input the serving path writes (the prefix of its
    buffer that size's rows take: engine/graph_buckets.py), every row padding; under inference mode as every serving
    step runs. Returns the graphs (size -> graph, static input, static output), each size's capture time and pool
    growth (ascending sizes), and the pool's id."""
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
    stats: list[GraphCaptureStat] = []
    pool: PoolId | None = None
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            packed = padding(size)  # every row padding: reads and writes the scratch block
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_reserved(device)
            t0 = time.perf_counter()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step(packed)  # lazy initialisation and the allocator's first blocks, outside the capture
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                step(packed)  # the step as it runs from now on: its peak is this size's activations
                torch.cuda.synchronize(device)
                activations = torch.cuda.max_memory_allocated(device) - base
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]
                out = step(packed)
            pool = graph.pool()
            torch.cuda.synchronize(device)
            graphs[size] = (graph, packed, out)
            grown = torch.cuda.memory_reserved(device) - before
            stats.append(GraphCaptureStat(size, round(time.perf_counter() - t0, 4), grown, activations))
    return graphs, sorted(stats, key=lambda s: s.size), None if pool is None else (int(pool[0]), int(pool[1]))


def graph_pool_usage(pool: PoolId, device: torch.device) -> GraphPoolUsage:
    """The captured graphs' pool `pool` as the allocator holds it now (see GraphPoolUsage)."""
    segments = [
        s
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", ())) == pool and s.get("device", device.index or 0) == (device.index or 0)
    ]
    blocks = sorted((int(b["size"]) for s in segments for b in s.get("blocks", ())), reverse=True)
    return GraphPoolUsage(
        len(segments),
        sum(int(s["total_size"]) for s in segments),
        sum(int(s["allocated_size"]) for s in segments),
        tuple(blocks[:8]),
    )
