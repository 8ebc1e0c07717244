"""torch.compile of the decode step, split into Dynamo tracing and Inductor compilation, with a persistent cache.

`torch.compile` does both halves lazily inside the first call, so its time cannot be attributed. The backend here
only records each graph Dynamo hands it (running it eagerly meanwhile); a later call compiles the recorded graphs
with Inductor inside the tracing context Dynamo left behind. That gives two honest stages: dynamo_transform and
graph_compile. Graphs that appear later (new batch-size specialisations during capture) compile at once.

The Inductor cache and the explanation of compile-cache misses live in compile_cache.py (the artifact store).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .attention import AttentionMetadata
from .models.llama import DecoderLM


class _Graph:
    """One Dynamo graph: eager until compiled, then the Inductor-compiled callable."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], tracing_ctx: Any) -> None:
        self.gm = gm
        self.example_inputs = example_inputs
        self.tracing_ctx = tracing_ctx
        self.fn: Callable[..., Any] = gm.forward
        self.compiled = False

    def compile(self) -> None:
        from torch._guards import tracing
        from torch._inductor.compile_fx import compile_fx

        with tracing(self.tracing_ctx):
            self.fn = compile_fx(self.gm, self.example_inputs)
        self.compiled = True

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass
class DeferredInductor:
    """A torch.compile backend that separates tracing from compiling (see module docstring)."""

    graphs: list[_Graph] = field(default_factory=list)
    compile_immediately: bool = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> _Graph:
        from torch._guards import TracingContext

        graph = _Graph(gm, example_inputs, TracingContext.try_get())
        if self.compile_immediately:
            graph.compile()
        self.graphs.append(graph)
        return graph

    def compile_pending(self) -> int:
        pending = [g for g in self.graphs if not g.compiled]
        for g in pending:
            g.compile()
        self.compile_immediately = True
        return len(pending)


def make_decode_fn(model: DecoderLM, backend: DeferredInductor) -> Callable[..., torch.Tensor]:
    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, meta))

    # The tracing inputs mark batch, context width and cache size dynamic, so one graph serves every batch >= 2
    # and every context, capture only warms it, and no request ever triggers a compile. fullgraph=True: a graph
    # break would be a silent slowdown.
    compiled = torch.compile(decode_step, backend=backend, fullgraph=True)

    def run(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # Python floats (eps, softmax scale) must stay constants: symbolic floats make AOTAutograd ask Dynamo to
        # restart tracing, which only works inside torch.compile's own loop, not in our deferred compile. Scoped
        # to the call so that no process-wide flag changes.
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(input_ids, positions, meta)

    return run


def inductor_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])
