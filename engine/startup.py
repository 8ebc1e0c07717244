"""Build an engine from a config (interim: a straight sequence of the start-up steps)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import EngineConfig
from .kv_cache import KVCache
from .kv_sizing import KVPlan, plan_kv_cache
from .llm_engine import LLMEngine
from .model_runner import ModelRunner
from .models.arch import ModelArch, load_arch
from .models.loader import load_model, resolve_dtype
from .models.store import resolve_model
from .scheduler import Scheduler
from .tokenizer import eos_token_ids, load_tokenizer


@dataclass
class StartupResult:
    engine: LLMEngine
    model_dir: Path
    arch: ModelArch
    kv_plan: KVPlan
    info: dict[str, Any]


def build_engine(config: EngineConfig) -> StartupResult:
    device = config.resolved_device()
    model_dir = resolve_model(config.model)
    arch = load_arch(model_dir)
    tokenizer = load_tokenizer(model_dir)
    dtype = resolve_dtype(config.dtype, arch, device)
    max_pos = arch.max_position_embeddings
    model, ckpt = load_model(model_dir, arch, dtype, device, max_pos)
    weights = sum(t.nbytes for t in model.state_dict().values())
    plan = plan_kv_cache(config, arch, model_dtype=dtype, device=device, weights_bytes=weights)
    cache = KVCache(
        num_layers=arch.num_hidden_layers,
        num_blocks=plan.num_blocks + 1,  # +1: the runner's scratch block for padded rows
        block_size=plan.block_size,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        dtype=dtype,
        device=device,
    )
    runner = ModelRunner(model, cache, device)
    scheduler = Scheduler(config.scheduler, config.cache, plan.num_blocks, plan.max_model_len)
    engine = LLMEngine(
        tokenizer=tokenizer,
        runner=runner,
        scheduler=scheduler,
        eos_token_ids=eos_token_ids(tokenizer, arch, model_dir),
        max_model_len=plan.max_model_len,
        seed=config.seed,
    )
    return StartupResult(engine, model_dir, arch, plan, {"bytes_read": ckpt.bytes_read, "dtype": str(dtype)})
