"""The preallocated paged KV cache: one key and one value tensor per layer, addressed by (block, offset-in-block).

Per-layer tensors (not one [layers, ...] tensor): the compiled decode step takes each layer's cache as its own graph
input, and slices of one big tensor would be aliased inputs, which torch.compile handles with a slow synthetic-base
path. With `kv_cache_dtype=int8` each token's key and value are stored as int8 with one fp32 scale per (token, head),
which halves (bf16) or quarters (fp32) the cache and the bytes attention reads per decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glowplug.kernels.formats import dequantize_kv, quantize_kv

from .host_memory import anonymous_zeros, commit


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed cache memory. Unused slots must hold finite values (a masked-out NaN still poisons attention's
    weighted sum). On the CPU each tensor is its own anonymous mapping: pages commit on first write, or all at
    once (on huge pages) by `KVCache.commit`, which the server calls after READY (engine/host_memory.py says why)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return anonymous_zeros(math.prod(shape) * itemsize).view(dtype).view(shape)


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache tensors: k/v [blocks, block_size, kv_heads, head_dim] (int8 when scaled), and for an int8
    cache the fp32 scales [blocks, block_size, kv_heads]."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def is_int8(self) -> bool:
        return self.k_scale is not None

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the new tokens' k/v [T, kv_heads, head_dim] at cache slots [T] (block * block_size + offset).

        Plain tensor ops, so the same code runs eagerly and inside the compiled decode graph (as an in-place
        scatter into the cache input)."""
        kf = self.k.view(-1, *self.k.shape[2:])
        vf = self.v.view(-1, *self.v.shape[2:])
        if self.k_scale is not None and self.v_scale is not None:
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            kf.index_copy_(0, slots, kq)
            vf.index_copy_(0, slots, vq)
            self.k_scale.view(-1, ks.shape[-1]).index_copy_(0, slots, ks)
            self.v_scale.view(-1, vs.shape[-1]).index_copy_(0, slots, vs)
            return
        kf.index_copy_(0, slots, k.to(kf.dtype))
        vf.index_copy_(0, slots, v.to(vf.dtype))

    def read(self, idx: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `idx` (any index shape) as [*idx.shape, block_size, kv_heads, head_dim] in `dtype`."""
        k, v = self.k[idx], self.v[idx]
        if self.k_scale is not None and self.v_scale is not None:
            return dequantize_kv(k, self.k_scale[idx], dtype), dequantize_kv(v, self.v_scale[idx], dtype)
        return k.to(dtype), v.to(dtype)


class KVCache:
    """Keys and values for `num_blocks` blocks of `block_size` tokens, for every layer."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        int8: bool = False,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        store = torch.int8 if int8 else dtype
        self.layers: list[LayerKV] = [
            LayerKV(
                zeros(shape, store, device),
                zeros(shape, store, device),
                zeros(shape[:-1], torch.float32, device) if int8 else None,
                zeros(shape[:-1], torch.float32, device) if int8 else None,
            )
            for _ in range(num_layers)
        ]
        self.dtype = dtype

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].k.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.layers[0].k.shape[1])

    @property
    def is_int8(self) -> bool:
        return self.layers[0].is_int8

    @property
    def device(self) -> torch.device:
        return self.layers[0].k.device

    def tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for lk in self.layers:
            out += [t for t in (lk.k, lk.v, lk.k_scale, lk.v_scale) if t is not None]
        return out

    def commit(self) -> bool:
        """Make the whole cache resident now (CPU); False where the host cannot, and pages commit on first use."""
        return self.device.type == "cpu" and commit(self.tensors())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def gather(
        self, layer: int, block_table: torch.Tensor, ctx_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `ctx_len` keys and values: [ctx_len, kv_heads, head_dim] each."""
        nb = -(-ctx_len // self.block_size)
        k, v = self.layers[layer].read(block_table[:nb], dtype)
        return k.flatten(0, 1)[:ctx_len], v.flatten(0, 1)[:ctx_len]
