"""Where a decode cell's peak memory goes: the weights the model holds, the KV pool, peer models, and the rest.

peak_mem (seed 003's column) is the process's RSS high-water mark over a timed run (profiling/memory.py): it holds
everything resident, so two reports of one configuration can disagree by what else lived in the process. The split
makes that visible:
- weights: bytes of every distinct tensor storage the model holds: parameters, buffers, and the quantized layers'
  prepared kernel states (a repacked layout the dispatcher made is a second copy; an alias of a buffer counts once).
- KV pool: the engine's KV cache tensors (KVCache.nbytes; on the CPU committed before the runs, so resident).
- peers: the peer engines' weights loaded in the same process (transformers' parameters; llama.cpp's mmapped GGUF).
- rest: peak minus those three: torch and the libraries, activations and workspaces, compiled graphs, and the
  allocator's pages kept from earlier cells in the same process (the reason the same configuration reads higher
  after other cells ran).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from glowplug.profiling.memory import unique_storage_bytes


@dataclass(frozen=True)
class MemorySplit:
    peak_bytes: int
    weights_bytes: int
    kv_bytes: int
    peers_bytes: int = 0

    @property
    def rest_bytes(self) -> int:
        # Negative when part of the weights or the pool is not resident (an mmapped file's untouched pages).
        return self.peak_bytes - self.weights_bytes - self.kv_bytes - self.peers_bytes

    def as_gb(self) -> dict[str, float]:
        return {
            "peak": self.peak_bytes / 1e9,
            "weights": self.weights_bytes / 1e9,
            "kv_pool": self.kv_bytes / 1e9,
            "peers": self.peers_bytes / 1e9,
            "rest": self.rest_bytes / 1e9,
        }


def _walk(obj: Any) -> Iterable[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _walk(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _walk(getattr(obj, name))


def held_weight_tensors(model: Any) -> Iterable[Any]:
    """Every tensor the model holds for its weights. A quantized layer's prepared states are read without preparing
    them (`prepared_runtime`: the `runtime` property would prepare, and allocate, what the step never used)."""
    from glowplug.kernels.modules import QuantLinear

    yield from model.parameters()
    yield from model.buffers()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            runtime = mod.prepared_runtime
            if runtime is not None:
                yield from _walk(runtime.states)
            if mod.native is not None:
                yield from _walk(mod.native.tensors)


def held_weight_bytes(model: Any) -> int:
    return unique_storage_bytes(held_weight_tensors(model))


def kv_pool_bytes(engine: Any) -> int:
    """The engine's KV cache tensors, through the runner's public `kv_cache` (engine/kv_cache.py)."""
    return int(engine.runner.kv_cache.nbytes)
