"""The one pydantic schema for everything a user can set: CLI flags, HTTP fields and config files map onto these.

Configs are frozen so that `compute_hash()` is stable for the lifetime of an engine (it identifies the config in
`/startup`). The caches do not use it: each declares the fields it depends on as artifact-store factors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from glowplug.base.units import ByteSize

DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "int8", "int4", "int2", "w8a8"]
KVCacheDType = Literal["auto", "int8"]
KVProfile = Literal["analytic", "measure"]
OnOff = Literal["on", "off"]
CompileMode = Literal["auto", "on", "off"]

DEFAULT_MODEL = "smollm2"


class ConfigError(ValueError):
    """A setting that cannot work with this model or this machine, found before (or instead of) the heavy work.

    str() is one line: the flag, the value given, why it cannot work, and a fix that does (never "pass the value
    that just failed"). `flag` names the flag for whoever wants to point at it (the CLI, the start-up page)."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        super().__init__(message)


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
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across engine steps.")


class CacheConfig(FrozenModel):
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block.")
    kv_cache_dtype: KVCacheDType = Field(
        "auto", description="KV-cache element type; auto = the model dtype, int8 = half the memory of bf16."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse the KV blocks of a prompt prefix seen before.")
    num_gpu_blocks_override: int | None = Field(
        None,
        ge=1,
        description="Force the number of KV blocks (tests and tuning); skips the budget maths.",
        json_schema_extra={"default_text": "from the KV budget"},
    )
    kv_cache_memory: ByteSize | None = Field(
        None,
        ge=1,
        description="KV-cache budget: a size such as 2GiB, 512MiB or 1G (a plain number is bytes).",
        json_schema_extra={
            "default_text": "--memory-utilization x free memory - weights - activations, at most 2 GiB on a CPU"
        },
    )
    memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of device memory the engine may use in total (on a GPU: of its total memory, as "
        "vLLM's --gpu-memory-utilization, which is accepted too; on a CPU: of the RAM available at start).",
        validation_alias=AliasChoices("memory_utilization", "gpu_memory_utilization"),
        json_schema_extra={"flag_aliases": ["gpu_memory_utilization"]},
    )
    kv_profile: KVProfile = Field(
        "analytic",
        description="How the KV budget learns the activation peak: analytic = from the model's shapes (the CPU; "
        "the same bytes as a measured forward, in milliseconds), measure = run one forward of "
        "max-num-batched-tokens and measure it (always on CUDA, and where the analytic peak does not apply).",
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two (got {v}); try 16")
        return v


class QuantConfig(FrozenModel):
    quantization: Quantization = Field(
        "auto",
        description="Weight format of the projections. auto runs a GGUF as stored, per tensor: 4-bit blocks on the "
        "int4 kernels, 5- to 8-bit ones on int8, floats in the model dtype (a safetensors folder: none); none "
        "de-quantizes everything to the model dtype; int8/int4/int2/w8a8 re-quantize every projection.",
    )
    group_size: int | None = Field(
        None,
        description="Weights per quantization group for int8/int4/int2: 32, 64, 128 or 256 (int2: 128).",
        json_schema_extra={
            "default_text": "per channel for int8; for int4 the GGUF's 32-weight blocks, else 128; "
            "auto takes the GGUF's blocks"
        },
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
        if self.quantization == "auto":
            # auto keeps each tensor on the grid the file stores it on; a group size would re-quantize it.
            raise ValueError(
                "--group-size does not apply to quantization='auto', which takes each layer's groups from the "
                f"GGUF's own 32-weight blocks; drop --group-size, or pick a scheme to re-quantize with (e.g. "
                f"--quantization int4 --group-size {gs})"
            )
        if self.quantization in ("none", "w8a8"):
            raise ValueError(f"--group-size does not apply to quantization={self.quantization!r}; drop it")
        if gs not in allowed[self.quantization]:
            raise ValueError(
                f"group_size {gs} is not supported for {self.quantization}; use one of "
                f"{sorted(allowed[self.quantization])}"
            )
        return self


def _aliases(section: type[BaseModel]) -> set[str]:
    """The other names a section's fields accept (their AliasChoices: vLLM's --gpu-memory-utilization, say)."""
    out: set[str] = set()
    for info in section.model_fields.values():
        if isinstance(info.validation_alias, AliasChoices):
            out.update(str(c) for c in info.validation_alias.choices)
    return out


class EngineConfig(FrozenModel):
    """Everything that shapes one engine instance."""

    model: str = Field(
        DEFAULT_MODEL, description="'smollm2' (the embedded default), a local Hugging Face folder or a .gguf file."
    )
    dtype: DType = Field(
        "auto",
        description="Model dtype; auto follows the checkpoint (bfloat16 for a quantized GGUF source), but float32 on "
        "a CPU without hardware bf16 (AVX512-BF16 or AMX).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; auto = cuda when torch sees a GPU, else cpu."
    )
    max_model_len: int | Literal["auto"] | None = Field(
        None,
        description="Longest prompt + output in tokens; auto = the longest that fits the KV cache.",
        json_schema_extra={"default_text": "the model's limit (max_position_embeddings)"},
    )
    seed: int = Field(0, description="Seeds every request that does not bring its own seed.")
    compile: CompileMode = Field(
        "auto",
        description="Compile the decode step (Dynamo + Inductor, glowplug's native kernels on the CPU, CUDA graphs "
        "on a GPU); auto = on. off runs every step eagerly with stock torch ops.",
    )
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    quant: QuantConfig = QuantConfig()
    bundle: str | None = Field(
        None,
        description="A ready-engine bundle (`glowplug bundle create`): its cache entries that hold on this machine "
        "are installed into the cache before the start, and its engine flags are the defaults of flags not given.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Split the model across this many ranks (Megatron-style tensor parallelism over "
        "torch.distributed: gloo on the CPU, NCCL on CUDA); glowplug starts N-1 worker processes on this machine, "
        "or takes the ranks torchrun launched.",
    )
    distributed_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds a rank may take to join, or to answer a collective, before the whole engine fails "
        "naming it.",
    )
    structured_outputs: bool = Field(
        True,
        description="Constrained decoding (response_format json_schema/json_object, guided_*, forced tool calls): "
        "its tokenizer view is built at start; off skips that and refuses constrained requests with a 400.",
    )
    cudagraph_capture_sizes: tuple[int, ...] | None = Field(
        None,
        description="Decode batch sizes to capture (CUDA) or pre-compile (CPU).",
        json_schema_extra={"default_text": "1,2,4,8,16,24,32,48,64,96,128,192,256 up to --max-num-seqs"},
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
        sections: dict[str, type[BaseModel]] = {
            "scheduler": SchedulerConfig,
            "cache": CacheConfig,
            "quant": QuantConfig,
        }
        nested: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        for key, value in fields.items():
            if key in sections and isinstance(value, dict):
                nested[key].update(value)
                continue
            owner = next(
                (name for name, sec in sections.items() if key in sec.model_fields or key in _aliases(sec)), None
            )
            if owner is not None:
                nested[owner][key] = value
            else:
                top[key] = value
        return cls(**top, **{name: sections[name](**vals) for name, vals in nested.items() if vals})

    def compile_enabled(self) -> bool:
        return self.compile != "off" and self.tensor_parallel_size == 1

    def compile_off_reason(self) -> str:
        """Why the decode step runs eagerly when `compile_enabled()` is False, for the stages' rows."""
        if self.compile != "off" and self.tensor_parallel_size > 1:
            return (
                f"--tensor-parallel-size {self.tensor_parallel_size}: the decode step runs eagerly (the compiled "
                f"step has no collectives yet)"
            )
        return f"--compile {self.compile}"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def hash_factors(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        # The seed changes no compiled graph and no profile; a bundle only brings what a start would build.
        data.pop("seed", None)
        data.pop("bundle", None)
        # How long to wait for a rank changes nothing built; TP=1 keeps the keys it had before the field existed.
        data.pop("distributed_timeout", None)
        # Constrained decoding builds nothing any cache holds.
        data.pop("structured_outputs", None)
        if self.tensor_parallel_size == 1:
            data.pop("tensor_parallel_size", None)
        return data
