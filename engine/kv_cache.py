"""The preallocated paged KV cache: one tensor pair for all layers, addressed by (block, offset-in-block)."""

from __future__ import annotations

import numpy as np
import torch


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
    ) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kf = self.k[layer].view(-1, *self.k.shape[3:])
        vf = self.v[layer].view(-1, *self.v.shape[3:])
        kf.index_copy_(0, slots, k.to(kf.dtype))
        vf.index_copy_(0, slots, v.to(vf.dtype))

    def gather(self, layer: int, block_table: torch.Tensor, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `ctx_len` keys and values: [ctx_len, kv_heads, head_dim] each."""
        nb = (ctx_len + self.block_size - 1) // self.block_size
        idx = block_table[:nb]
        ks = self.k[layer][idx].flatten(0, 1)[:ctx_len]
        vs = self.v[layer][idx].flatten(0, 1)[:ctx_len]
        return ks, vs

    def gather_batch(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values for a padded batch of block tables: [B, max_blocks * block_size, kv_heads, head_dim]."""
        ks = self.k[layer][block_tables].flatten(1, 2)
        vs = self.v[layer][block_tables].flatten(1, 2)
        return ks, vs
