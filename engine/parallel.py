"""Tensor parallelism, Megatron-style: which slice of every tensor a rank holds, and the collectives the model runs.

The split (N = --tensor-parallel-size, r = this rank):
- q/k/v and gate/up are column-parallel: each rank holds a slice of their output rows, so its attention heads and its
  part of the MLP's intermediate run without any communication;
- o_proj and down_proj are row-parallel: each rank holds the matching slice of their input columns, and the partial
  outputs are summed by one all-reduce per projection (two per layer);
- the embedding and the LM head are vocab-parallel: each rank holds ceil(V / N) rows of the vocabulary (the last
  rank's padded with zero rows), an embedding lookup is summed across ranks (a row lives on one rank only) and the
  head's logits are gathered and cut back to V;
- KV heads are sharded when N divides their count, and replicated when their count divides N (rank r then holds
  KV head r // (N / kv)); each rank's paged KV cache holds only its KV heads.

Quantized tensors are sliced along the same boundaries: rows are independent in every format, and a row-parallel
slice of the input columns must fall on group boundaries (a group straddling two ranks would need both halves'
scales). `check_tensor_parallel` refuses a split that breaks a group or heads that N does not divide, naming the
numbers and the sizes that do work. A per-channel format (int8 without --group-size, w8a8) takes its scale over
the whole input row, which a row-parallel split cuts: refused the same way.

The collectives go through torch.distributed's default process group (gloo on the CPU, NCCL on CUDA), set up by the
`distributed_init` stage (engine/distributed.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .models.arch import ModelArch


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: query heads [q_start, q_start + q_heads), KV heads [kv_start, kv_start +
    kv_heads)."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


@dataclass(frozen=True)
class TPShard:
    """This rank's place in the tensor-parallel group: everything the model and the loader need to know about it."""

    rank: int = 0
    world_size: int = 1

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def heads(self, arch: ModelArch) -> HeadSplit:
        n, h, kv = self.world_size, arch.num_attention_heads, arch.num_key_value_heads
        q = h // n
        if kv >= n:
            per = kv // n
            return HeadSplit(self.rank * q, q, self.rank * per, per)
        # Fewer KV heads than ranks: each KV head is replicated on n / kv ranks, and rank r's query heads all use
        # KV head r // (n / kv) (their group is one of that head's query groups, since n / kv divides h / kv).
        return HeadSplit(self.rank * q, q, self.rank // (n // kv), 1)

    def intermediate(self, arch: ModelArch) -> int:
        return arch.intermediate_size // self.world_size

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank): every rank holds the same count, the last one padded past the vocabulary."""
        per = -(-vocab_size // self.world_size)
        return self.rank * per, per

    def local_arch(self, arch: ModelArch) -> ModelArch:
        """The architecture one rank's layers compute: its heads and its part of the MLP (the vocabulary, the hidden
        size and the head size stay: the hidden states between layers are whole on every rank)."""
        if not self.active:
            return arch
        split = self.heads(arch)
        return arch.model_copy(
            update={
                "num_attention_heads": split.q_heads,
                "num_key_value_heads": split.kv_heads,
                "intermediate_size": self.intermediate(arch),
            }
        )


SINGLE = TPShard()


def launch_rank() -> int:
    """This process's rank: RANK, as torchrun and glowplug's own launcher (engine/distributed.py) set it; 0 for
    the process a user started."""
    return int(os.environ.get("RANK", "0"))


def tp_factors(tensor_parallel_size: int) -> dict[str, Any]:
    """The factors a per-rank cache entry (quantized weights, KV profile, compile, start-up profile) adds under
    tensor parallelism: each rank's shard is a different tensor, graph and start. Empty at TP=1, so its keys stay."""
    if tensor_parallel_size == 1:
        return {}
    return {"tensor_parallel": {"world_size": tensor_parallel_size, "rank": launch_rank()}}


# Per-channel schemes: one scale over a whole input row (w8a8 also quantizes each token's activations over it).
PER_CHANNEL = "per channel"


Group = int | str | None  # a layer's quantization group: its size, PER_CHANNEL, or None (not quantized)


def _divisors_check(arch: ModelArch, n: int, group: Group | Callable[[int], Group]) -> str | None:
    """Why `n` ranks cannot split `arch` (None: they can). `group`: the row-parallel layers' quantization group, or
    a function of their input width giving it (a scheme may take a smaller group where a width needs one)."""
    h, kv, d, i = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.intermediate_size
    if h % n:
        return f"{h} attention heads are not divisible by {n}"
    if kv % n and n % kv:
        return f"{kv} KV heads neither divide into {n} ranks nor replicate evenly across them"
    if i % n:
        return f"the MLP's intermediate size {i} is not divisible by {n}"
    if n == 1:
        return None
    for what, k in (("o_proj input (heads x head_dim)", h * d), ("down_proj input (intermediate)", i)):
        g = group(k) if callable(group) else group
        if g == PER_CHANNEL:
            return (
                "a per-channel format takes each scale over a whole input row, which the row-parallel o_proj "
                "and down_proj split across ranks; pass --group-size (32, 64, 128)"
            )
        if isinstance(g, int) and (k // n) % g:
            return (
                f"the {what} width {k} splits into {k // n} columns per rank, not a multiple of the "
                f"{g}-weight quantization group"
            )
    return None


def valid_tp_sizes(arch: ModelArch, group: Group | Callable[[int], Group], limit: int = 64) -> list[int]:
    """Every tensor-parallel size up to `limit` that splits `arch` with quantization groups of `group`."""
    return [n for n in range(1, limit + 1) if _divisors_check(arch, n, group) is None]


def check_tensor_parallel(arch: ModelArch, n: int, group: Group | Callable[[int], Group]) -> str | None:
    """The one-line reason `n` ranks cannot split this model (with the sizes that can), or None."""
    why = _divisors_check(arch, n, group)
    if why is None:
        return None
    sizes = ", ".join(str(s) for s in valid_tp_sizes(arch, group))
    return f"--tensor-parallel-size {n} cannot split this model: {why}; sizes that do: {sizes}"


# ------------------------------------------------------------------------------------------- checkpoint slicing
_ROW_PARTS = ("o_proj", "down_proj")


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of t, padded with zero rows past its end (the vocabulary's last shard)."""
    part = t.narrow(0, min(start, t.shape[0]), max(0, min(count, t.shape[0] - start)))
    if part.shape[0] == count:
        return part
    pad = torch.zeros((count - part.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([part, pad])


def shard_checkpoint(
    sd: dict[str, torch.Tensor], arch: ModelArch, shard: TPShard, copy: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor of a checkpoint in Hugging Face names (before q/k/v and gate/up are fused),
    float or packed (`qweight`/`scales`/`zeros`, whose dim 0 is the output row and dim 1 runs along the input in
    whole groups). Row slices stay views unless `copy` (a row slice of a mapped file touches only its pages; a
    tensor de-quantized in memory is copied so that the whole one can be freed); column slices are copied."""
    if not shard.active:
        return sd
    split = shard.heads(arch)
    d, n, r = arch.head_dim, shard.world_size, shard.rank
    inter = shard.intermediate(arch)
    v0, vn = shard.vocab_rows(arch.vocab_size)
    out: dict[str, torch.Tensor] = {}

    def rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
        part = _rows(t, start, count)
        return part.clone() if copy and part.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else part

    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        part = module.rpartition(".")[2]
        if module in ("model.embed_tokens", "lm_head"):
            out[name] = rows(t, v0, vn)
        elif part == "q_proj":
            out[name] = rows(t, split.q_start * d, split.q_heads * d)
        elif part in ("k_proj", "v_proj"):
            out[name] = rows(t, split.kv_start * d, split.kv_heads * d)
        elif part in ("gate_proj", "up_proj"):
            out[name] = rows(t, r * inter, inter)
        elif part in _ROW_PARTS:
            if leaf == "bias":
                # Added once, after the sum: rank 0 keeps it, the others add zeros.
                out[name] = t if r == 0 else torch.zeros_like(t)
            elif t.dim() == 2 and t.shape[1] > 1:
                cols = t.shape[1] // n
                out[name] = t.narrow(1, r * cols, cols).contiguous()
            elif leaf == "smooth":
                cols = t.shape[0] // n
                out[name] = rows(t, r * cols, cols)
            else:
                out[name] = t  # a per-output-row scale [out, 1]: the same on every rank
        else:
            out[name] = t  # norms: replicated
    return out


# ------------------------------------------------------------------------------------------------ collectives
def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks, in place (the row-parallel projections' partial outputs, the embedding's rows)."""
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def gather_vocab(x: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's [..., V / N] logits side by side along the last dimension, cut back to the vocabulary."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)[..., :vocab_size]
