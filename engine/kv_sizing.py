"""How many KV blocks fit, and which max-model-len that allows.

Budget: `--kv-cache-memory BYTES` when given. Otherwise `memory_utilization` x device memory, minus the weights and
the peak activation memory of a profiling forward pass. On the CPU, "device memory" is the RAM available when the
engine starts (psutil), and the result is capped at CPU_KV_CAP_BYTES: a CPU host shares its RAM with everything
else, and a CPU engine is compute-bound long before it could use more context than that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import EngineConfig
from .models.arch import ModelArch

CPU_KV_CAP_BYTES = 2 << 30


class KVCacheTooSmall(ValueError):
    pass


@dataclass(frozen=True)
class KVPlan:
    budget_bytes: int
    bytes_per_block: int
    bytes_per_token: int
    num_blocks: int
    block_size: int
    max_model_len: int
    budget_source: str

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many sequences of full max-model-len length fit at once."""
        per_seq = -(-self.max_model_len // self.block_size)
        return self.num_blocks / per_seq


def kv_element_size(config: EngineConfig, model_dtype: torch.dtype) -> int:
    # int8 KV stores one byte per element plus a per-token, per-head scale (amortised over head_dim elements).
    if config.cache.kv_cache_dtype == "int8":
        return 1
    return torch.empty((), dtype=model_dtype).element_size()


def bytes_per_token(arch: ModelArch, config: EngineConfig, model_dtype: torch.dtype) -> int:
    per = arch.kv_bytes_per_token(kv_element_size(config, model_dtype))
    if config.cache.kv_cache_dtype == "int8":
        per += 2 * arch.num_hidden_layers * arch.num_key_value_heads * 4  # fp32 scales
    return per


def device_memory(device: str) -> tuple[int, str]:
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return total, "cuda total memory"
    import psutil

    return int(psutil.virtual_memory().available), "available RAM"


def kv_budget(config: EngineConfig, *, device: str, weights_bytes: int, activation_peak_bytes: int) -> tuple[int, str]:
    c = config.cache
    if c.kv_cache_memory is not None:
        return c.kv_cache_memory, "--kv-cache-memory"
    mem, what = device_memory(device)
    budget = int(mem * c.memory_utilization) - weights_bytes - activation_peak_bytes
    source = f"{c.memory_utilization} x {what} - weights - activation peak"
    if device == "cpu" and budget > CPU_KV_CAP_BYTES:
        budget, source = CPU_KV_CAP_BYTES, f"CPU cap ({CPU_KV_CAP_BYTES >> 30} GiB)"
    return budget, source


def model_len_limit(arch: ModelArch) -> int:
    return min(arch.max_position_embeddings, arch.sliding_window or arch.max_position_embeddings)


def plan_kv_cache(
    config: EngineConfig,
    arch: ModelArch,
    *,
    model_dtype: torch.dtype,
    device: str,
    weights_bytes: int,
    activation_peak_bytes: int = 0,
) -> KVPlan:
    bs = config.cache.block_size
    per_token = bytes_per_token(arch, config, model_dtype)
    per_block = per_token * bs
    limit = model_len_limit(arch)
    requested = config.max_model_len
    if isinstance(requested, int) and requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's limit of {limit} positions "
            f"(max_position_embeddings{' / sliding_window' if arch.sliding_window else ''}); use --max-model-len {limit} or less"
        )
    if config.cache.num_gpu_blocks_override is not None:
        num_blocks, budget, source = config.cache.num_gpu_blocks_override, 0, "num_gpu_blocks_override"
        budget = num_blocks * per_block
    else:
        budget, source = kv_budget(
            config, device=device, weights_bytes=weights_bytes, activation_peak_bytes=activation_peak_bytes
        )
        num_blocks = max(budget, 0) // per_block
    largest = min(num_blocks * bs, limit)
    if requested == "auto":
        max_len = largest
    else:
        max_len = limit if requested is None else requested
    if max_len < 1 or num_blocks * bs < max_len:
        need = -(-max_len // bs) * per_block if max_len >= 1 else per_block
        raise KVCacheTooSmall(
            f"the KV cache cannot hold one sequence of max-model-len {max_len}: it needs {need:,} bytes "
            f"({per_token:,} bytes/token), but {max(budget, 0):,} bytes are available ({source}). "
            f"The largest max-model-len that fits is {largest}; pass --max-model-len {largest} "
            f"(or --max-model-len auto), or give the cache more memory with --kv-cache-memory."
        )
    return KVPlan(
        budget_bytes=budget,
        bytes_per_block=per_block,
        bytes_per_token=per_token,
        num_blocks=int(num_blocks),
        block_size=bs,
        max_model_len=int(max_len),
        budget_source=source,
    )
