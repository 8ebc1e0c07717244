"""How many KV blocks fit, and which max-model-len that allows.

Budget: `--kv-cache-memory BYTES` when given. Otherwise `memory_utilization` x device memory, minus the weights and
the peak activation memory of a profiling forward pass. On the CPU, "device memory" is the RAM available when the
engine starts (psutil), and the result is capped at CPU_KV_CAP_BYTES: a CPU host shares its RAM with everything
else, and a CPU engine is compute-bound long before it could use more context than that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from glowplug.base.units import format_bytes, size_flag_value

from .config import ConfigError, EngineConfig
from .models.arch import ModelArch

if TYPE_CHECKING:
    import torch

CPU_KV_CAP_BYTES = 2 << 30
# The shortest sequence worth serving (a short prompt and a short answer). When not even this fits, the error says
# what this length needs instead of offering a max-model-len too small to use.
SMALLEST_USEFUL_LEN = 256
# Bytes per element of the model dtypes, by name, so the sizing can run before torch is imported (the CLI checks
# the settings against the model first, within a second of starting).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVCacheTooSmall(ConfigError):
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


def dtype_bytes(model_dtype: torch.dtype | str) -> int:
    """Bytes per element of a torch dtype or a dtype name ("bfloat16")."""
    if isinstance(model_dtype, str):
        return DTYPE_BYTES[model_dtype.removeprefix("torch.")]
    return int(model_dtype.itemsize)


def kv_element_size(config: EngineConfig, model_dtype: torch.dtype | str) -> int:
    # int8 KV stores one byte per element plus a per-token, per-head scale (amortised over head_dim elements).
    if config.cache.kv_cache_dtype == "int8":
        return 1
    return dtype_bytes(model_dtype)


def bytes_per_token(arch: ModelArch, config: EngineConfig, model_dtype: torch.dtype | str) -> int:
    per = arch.kv_bytes_per_token(kv_element_size(config, model_dtype))
    if config.cache.kv_cache_dtype == "int8":
        per += 2 * arch.num_hidden_layers * arch.num_key_value_heads * 4  # fp32 scales
    return per


# One layer's K (or V) cache tensor stays under 2**31 elements: the compiled decode step is built with 32-bit
# indexing, which Inductor guards on, so a larger cache would fail the step's guards at capture (seen on an H100 with
# a tiny model, whose few bytes per token made 0.9 x 80 GB tens of millions of blocks). No real model's cache comes
# near: Llama-3-70B would need over two million tokens in one layer.
MAX_LAYER_ELEMENTS = 2**31 - 1
# Left free beside the cache on a GPU whose memory others hold too: CUDA graphs' pool, the sampler, the allocator's
# rounding.
GPU_HEADROOM_BYTES = 512 << 20


def device_memory(device: str) -> tuple[int, str]:
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
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
    if device.startswith("cuda"):
        # The fraction is of the GPU's total, as vLLM's; but memory another process (or another engine in this one)
        # holds is not ours to take: the cache then gets what is free, and says so, rather than failing to allocate.
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        room = free - activation_peak_bytes - GPU_HEADROOM_BYTES
        if budget > room:
            budget, source = (
                room,
                (
                    f"free GPU memory ({free / 2**30:.1f} GiB) - activation peak - "
                    f"{GPU_HEADROOM_BYTES >> 20} MiB headroom, less than {source}: other processes "
                    "or engines hold the rest"
                ),
            )
    return budget, source


def _window_caps(arch: ModelArch) -> bool:
    """A window the attention path does not apply (one for every layer: Mistral, Qwen) caps the context at its
    length, where full attention and the window agree; Gemma 3's per-layer windows are applied, so they cap nothing."""
    return arch.sliding_window is not None and arch.layer_types is None


def model_len_limit(arch: ModelArch) -> int:
    window = arch.sliding_window if _window_caps(arch) else None
    return min(arch.max_position_embeddings, window or arch.max_position_embeddings)


def check_model_len(config: EngineConfig, arch: ModelArch) -> None:
    """--max-model-len against the model's positions (raises ConfigError)."""
    limit = model_len_limit(arch)
    requested = config.max_model_len
    if isinstance(requested, int) and requested > limit:
        what = "max_position_embeddings" + (" / sliding_window" if _window_caps(arch) else "")
        raise ConfigError(
            "--max-model-len",
            f"--max-model-len {requested} exceeds the model's limit of {limit} positions ({what}); use "
            f"--max-model-len {limit} or less, or leave it unset for {limit}",
        )


def _memory_fix(config: EngineConfig, source: str, need: int, per_block: int) -> str:
    """How to give the cache `need` bytes, in terms of the setting the budget came from."""
    if source == "num_gpu_blocks_override":
        return f"raise --num-gpu-blocks-override to {-(-need // per_block)}"
    if source == "--kv-cache-memory":
        return f"raise --kv-cache-memory to {size_flag_value(need)}"
    return (
        f"set --kv-cache-memory {size_flag_value(need)} (or raise --memory-utilization, now "
        f"{config.cache.memory_utilization}, or free memory)"
    )


def _source_text(source: str, budget: int) -> str:
    shown = format_bytes(max(budget, 0))
    if source in ("--kv-cache-memory", "num_gpu_blocks_override"):
        given = "--num-gpu-blocks-override" if source == "num_gpu_blocks_override" else source
        return f"{shown}, from {given}"
    return f"{shown} = {source}"


def plan_kv_cache(
    config: EngineConfig,
    arch: ModelArch,
    *,
    model_dtype: torch.dtype | str,
    device: str,
    weights_bytes: int,
    activation_peak_bytes: int = 0,
) -> KVPlan:
    """The KV blocks the budget holds and the max-model-len they allow; raises ConfigError when the length is over
    the model's limit or one sequence does not fit (`KVCacheTooSmall`), with a fix that works."""
    check_model_len(config, arch)
    bs = config.cache.block_size
    per_token = bytes_per_token(arch, config, model_dtype)
    per_block = per_token * bs
    limit = model_len_limit(arch)
    requested = config.max_model_len
    if config.cache.num_gpu_blocks_override is not None:
        num_blocks, source = config.cache.num_gpu_blocks_override, "num_gpu_blocks_override"
        budget = num_blocks * per_block
    else:
        budget, source = kv_budget(
            config, device=device, weights_bytes=weights_bytes, activation_peak_bytes=activation_peak_bytes
        )
        num_blocks = max(budget, 0) // per_block
        # -1: the cache is allocated with one more block, the runner's scratch block (kv_cache_init).
        cap = MAX_LAYER_ELEMENTS // (bs * arch.num_key_value_heads * arch.head_dim) - 1
        if num_blocks > cap:
            num_blocks, source = cap, f"{source}, capped at {cap:,} blocks (one layer's cache under 2**31 elements)"
    largest = min(num_blocks * bs, limit)
    max_len = largest if requested == "auto" else (limit if requested is None else requested)

    def need_for(tokens: int) -> int:
        return -(-tokens // bs) * per_block

    # The shortest length worth offering: a short prompt and answer, or less when less was asked for.
    useful = min(SMALLEST_USEFUL_LEN, limit, max_len) if max_len >= 1 else min(SMALLEST_USEFUL_LEN, limit)
    if largest < useful:
        # Not even that fits: offering a shorter max-model-len would offer one too small to use (or 0).
        flag = {"num_gpu_blocks_override": "--num-gpu-blocks-override", "--kv-cache-memory": "--kv-cache-memory"}
        raise KVCacheTooSmall(
            flag.get(source, "--memory-utilization"),
            f"the KV cache cannot hold one sequence of {'even ' if useful < max_len else ''}{useful} tokens: "
            f"that needs "
            f"{format_bytes(need_for(useful))} ({per_token:,} bytes/token), the cache has "
            f"{_source_text(source, budget)}; {_memory_fix(config, source, need_for(useful), per_block)} "
            f"(the model's full {limit} positions need {format_bytes(need_for(limit))})",
        )
    if num_blocks * bs < max_len:
        length_flag = "--max-model-len" if isinstance(requested, int) else "the default --max-model-len"
        raise KVCacheTooSmall(
            "--max-model-len",
            f"the KV cache cannot hold one sequence of {length_flag} {max_len}: "
            f"that needs {format_bytes(need_for(max_len))} "
            f"({per_token:,} bytes/token), the cache has {_source_text(source, budget)}, room for {largest} tokens; "
            f"use --max-model-len {largest} or less (--max-model-len auto picks the longest that fits), or "
            f"{_memory_fix(config, source, need_for(max_len), per_block)}",
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
