"""The state the engine's start-up stages share, as typed fields (each filled by the stage named beside it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compile import CompiledDecode, LoadedDecode, TracedDecode
from ..compile_cache import CompileCache, StoredReplay
from ..compile_replay import ReplayDecode
from ..config import EngineConfig
from ..kv_cache import KVCache
from ..kv_sizing import KVPlan
from ..llm_engine import LLMEngine
from ..model_runner import ModelRunner
from ..models.arch import ModelArch
from ..models.llama import DecoderLM
from .base import StartupContext


class StageOrderError(RuntimeError):
    pass


@dataclass
class EngineContext(StartupContext):
    config: EngineConfig = field(default_factory=EngineConfig)
    cache_root: Path = Path(".")
    device: str = "cpu"
    model_dir: Path | None = None  # model_prepare
    gguf_path: Path | None = None  # model_prepare (weights are read from it when model_dir has its tensor table)
    arch: ModelArch | None = None  # model_prepare
    dtype: torch.dtype = torch.float32  # model_prepare
    tokenizer: Any = None  # tokenizer_init
    state_dict: dict[str, torch.Tensor] | None = None  # load_weights (replaced by quantize_weights)
    weights_bytes: int = 0  # load_weights / quantize_weights
    model: DecoderLM | None = None  # model_init
    native: Any = None  # native_kernels (kernels.native.NativeBuild)
    traced: TracedDecode | LoadedDecode | StoredReplay | None = None  # dynamo_transform (a trace, or the stored entry)
    decode_fn: CompiledDecode | ReplayDecode | None = None  # graph_compile
    compile_cache: CompileCache | None = None  # dynamo_transform
    compile_fallback: str | None = None  # dynamo_transform / graph_compile: why --compile auto runs the step eagerly
    kv_plan: KVPlan | None = None  # kv_cache_profiling
    kv_cache: KVCache | None = None  # kv_cache_init
    runner: ModelRunner | None = None  # kv_cache_init
    engine: LLMEngine | None = None  # kv_cache_init

    def quant_group_size(self) -> tuple[int | None, str]:
        """The group size to quantize with, and why: the configured one, else for int4 the block size of a GGUF
        source (exact on its grid), else the scheme's default."""
        q = self.config.quant
        if q.group_size is not None:
            return q.group_size, "configured"
        if q.quantization == "int4" and self.model_dir is not None:
            from ..models.store import source_quant_block

            block = source_quant_block(self.model_dir)
            if block is not None:
                return block, f"matches the source GGUF's {block}-weight blocks"
        return None, "scheme default"

    def need(self, value: Any, what: str, stage: str) -> Any:
        if value is None:
            raise StageOrderError(f"{what} is not set: stage {stage!r} must run earlier in the pipeline")
        return value
