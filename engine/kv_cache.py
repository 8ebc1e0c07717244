"""The preallocated paged KV cache: one tensor pair for all layers, addressed by (block, offset-in-block).

With `kv_cache_dtype=int8` each token's key and value are stored as int8 with one fp32 scale per (token, head),
which halves (bf16) or quarters (fp32) the cache and the bytes attention reads per decode step.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.formats import dequantize_kv, quantize_kv


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed cache memory. Unused slots must hold finite values (a masked-out NaN still poisons attention's
    weighted sum), but on the CPU torch.zeros writes every page up front (~1.5 s per GiB here). numpy's calloc
    maps large blocks as copy-on-write zero pages, so the cost moves to first use and the memory is committed
    only as the cache fills."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize])
    return torch.from_numpy(raw).view(dtype)


class KVCache:
    """Keys and values for `num_blocks` blocks of `block_size` tokens, for every layer.

    Layout [layers, blocks, block_size, kv_heads, head_dim] keeps one block of one layer contiguous, so a
    sequence's context is gathered with one index per layer.
    """

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
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        store = torch.int8 if int8 else dtype
        self.k = zeros(shape, store, device)
        self.v = zeros(shape, store, device)
        self.k_scale: torch.Tensor | None = zeros(shape[:-1], torch.float32, device) if int8 else None
        self.v_scale: torch.Tensor | None = zeros(shape[:-1], torch.float32, device) if int8 else None

    @classmethod
    def wrap(
        cls, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
    ) -> KVCache:
        """A view over existing cache tensors (the custom op receives tensors, not this object)."""
        self = cls.__new__(cls)
        self.k, self.v, self.k_scale, self.v_scale = k, v, k_scale, v_scale
        return self

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[2])

    @property
    def is_int8(self) -> bool:
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None or self.v_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return self.k.nbytes + self.v.nbytes + scales

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kf = self.k[layer].view(-1, *self.k.shape[3:])
        vf = self.v[layer].view(-1, *self.v.shape[3:])
        if self.k_scale is not None and self.v_scale is not None:
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            kf.index_copy_(0, slots, kq)
            vf.index_copy_(0, slots, vq)
            self.k_scale[layer].view(-1, ks.shape[-1]).index_copy_(0, slots, ks)
            self.v_scale[layer].view(-1, vs.shape[-1]).index_copy_(0, slots, vs)
            return
        kf.index_copy_(0, slots, k.to(kf.dtype))
        vf.index_copy_(0, slots, v.to(vf.dtype))

    def _read(self, layer: int, idx: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer][idx], self.v[layer][idx]
        if self.k_scale is not None and self.v_scale is not None:
            return dequantize_kv(k, self.k_scale[layer][idx], dtype), dequantize_kv(v, self.v_scale[layer][idx], dtype)
        return k, v

    def gather(
        self, layer: int, block_table: torch.Tensor, ctx_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `ctx_len` keys and values: [ctx_len, kv_heads, head_dim] each."""
        nb = -(-ctx_len // self.block_size)
        k, v = self._read(layer, block_table[:nb], dtype)
        return k.flatten(0, 1)[:ctx_len], v.flatten(0, 1)[:ctx_len]

    def gather_batch(
        self, layer: int, block_tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values for a padded batch of block tables: [B, max_blocks * block_size, kv_heads, head_dim]."""
        k, v = self._read(layer, block_tables, dtype)
        return k.flatten(1, 2), v.flatten(1, 2)
