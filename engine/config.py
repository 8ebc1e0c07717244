"""The one pydantic schema for everything a user can set: CLI flags, HTTP fields and config files map onto these.

Configs are frozen so that `compute_hash()` is stable for the lifetime of an engine (it identifies the config in
`/startup`). The caches do not use it: each declares the fields it depends on as artifact-store factors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "int8", "int4", "int2", "w8a8"]
KVCacheDType = Literal["auto", "int8"]
OnOff = Literal["on", "off"]
CompileMode = Literal["auto", "on", "off"]

DEFAULT_MODEL = "smollm2"


class FrozenModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    def compute_hash(self) -> str:
        """A short stable hash of the fields that decide what gets compiled and profiled."""
        payload = json.dumps(self.hash_factors(), sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def hash_factors(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class SchedulerConfig(FrozenModel):
    max_num_seqs: int = Field(32, ge=1, le=4096, description="Most sequences in one engine step.")
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Most tokens (prefill chunks + decodes) in one engine step."
    )
    enable_chunked_prefill: bool = True


class CacheConfig(FrozenModel):
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block.")
    kv_cache_dtype: KVCacheDType = "auto"
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = Field(
        None, ge=1, description="Force the number of KV blocks (tests and tuning); skips the budget maths."
    )
    kv_cache_memory: int | None = Field(None, ge=1, description="KV-cache budget in bytes.")
    memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of device memory the engine may use in total."
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two (got {v}); try 16")
        return v


class QuantConfig(FrozenModel):
    quantization: Quantization = "none"
    group_size: int | None = Field(
        None, description="Group size for int8/int4/int2 (None = the scheme's default: per-channel int8, 128 else)."
    )
    quantize_lm_head: bool = Field(
        True,
        description="Quantize the output projection with the layers (a tied head gets a quantized copy of the "
        "embedding matrix; the embedding lookup stays in the model dtype).",
    )

    @model_validator(mode="after")
    def _check_group(self) -> QuantConfig:
        gs = self.group_size
        if gs is None:
            return self
        allowed = {"int8": {32, 64, 128, 256}, "int4": {32, 64, 128, 256}, "int2": {128}}
        if self.quantization in ("none", "w8a8"):
            raise ValueError(f"--group-size does not apply to quantization={self.quantization!r}; drop it")
        if gs not in allowed[self.quantization]:
            raise ValueError(
                f"group_size {gs} is not supported for {self.quantization}; use one of "
                f"{sorted(allowed[self.quantization])}"
            )
        return self


class EngineConfig(FrozenModel):
    """Everything that shapes one engine instance."""

    model: str = Field(DEFAULT_MODEL, description="'smollm2' (the embedded default) or a local HF folder.")
    dtype: DType = Field(
        "auto",
        description="Model dtype; auto follows the checkpoint (bfloat16 for a quantized GGUF source), but float32 on "
        "a CPU without hardware bf16 (AVX512-BF16 or AMX).",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | Literal["auto"] | None = Field(
        None, description="Longest prompt + output; None = min(model limit, 4096); 'auto' = largest that fits."
    )
    seed: int = 0
    compile: CompileMode = Field(
        "auto",
        description="Compile the decode step (Dynamo + Inductor, glowplug's native kernels on the CPU, CUDA graphs "
        "on a GPU); auto = on. off runs every step eagerly with stock torch ops.",
    )
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    quant: QuantConfig = QuantConfig()
    cudagraph_capture_sizes: tuple[int, ...] | None = Field(
        None, description="Decode batch sizes to capture (CUDA) or pre-compile (CPU); None = a vLLM-like default."
    )

    @field_validator("max_model_len")
    @classmethod
    def _positive_len(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"max_model_len must be >= 1 or 'auto' (got {v})")
        return v

    @field_validator("model")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model must be 'smollm2' or a path to a Hugging Face folder")
        return v

    @classmethod
    def from_flat(cls, **fields: Any) -> EngineConfig:
        """Build from flat names as users write them (`block_size=8`, `max_num_seqs=4`, `quantization="int8"`),
        routing each to its section; nested dicts (`cache={...}`) are accepted too. One flat namespace is what the
        CLI flags and the config file use, so their names match vLLM-style flags one to one."""
        sections = {"scheduler": SchedulerConfig, "cache": CacheConfig, "quant": QuantConfig}
        nested: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        for key, value in fields.items():
            if key in sections and isinstance(value, dict):
                nested[key].update(value)
                continue
            owner = next((name for name, sec in sections.items() if key in sec.model_fields), None)
            if owner is not None:
                nested[owner][key] = value
            else:
                top[key] = value
        return cls(**top, **{name: sections[name](**vals) for name, vals in nested.items() if vals})

    def compile_enabled(self) -> bool:
        return self.compile != "off"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def hash_factors(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        # The seed changes no compiled graph and no profile.
        data.pop("seed", None)
        return data
