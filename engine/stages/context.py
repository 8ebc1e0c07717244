"""The state the engine's start-up stages share, as typed fields: the inputs, then the slots (each written by the
stage named beside it, and read only by the stages that declare it in `needs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from glowplug.base.artifacts import ArtifactStore, CacheSpec, Fetched
from glowplug.engine.compile import CompiledDecode, LoadedDecode, TracedDecode
from glowplug.engine.compile_cache import CompileCache, StoredReplay
from glowplug.engine.compile_replay import ReplayDecode
from glowplug.engine.config import EngineConfig
from glowplug.engine.kv_cache import KVCache
from glowplug.engine.kv_sizing import KVPlan
from glowplug.engine.llm_engine import LLMEngine
from glowplug.engine.model_runner import ModelRunner
from glowplug.engine.models.arch import ModelArch
from glowplug.engine.models.llama import DecoderLM
from glowplug.engine.models.store import model_group
from glowplug.engine.parallel import TPShard, launch_rank
from glowplug.kernels.gguf import GGUFRows

from .protocol import StartupContext

if TYPE_CHECKING:
    from glowplug.engine.models.gguf_auto import LayerFormats


T = TypeVar("T")


class StageOrderError(RuntimeError):
    pass


@dataclass
class EngineContext(StartupContext):
    """The start-up's state; it lives until READY, when build_engine keeps what serving needs and drops the rest.

    Stages see it through a ContextView (engine/stages/view.py), which also binds the methods below to the view,
    so `quant_group_size` reads `model_dir` only for a stage that needs it.
    """

    # Set by build_engine before the first stage: every stage reads them, none writes them.
    INPUTS: ClassVar[frozenset[str]] = frozenset({"config", "cache_root", "device"})

    config: EngineConfig = field(default_factory=EngineConfig)
    cache_root: Path = Path(".")
    device: str = "cpu"
    bundle: Any = None  # bundle_install (engine.bundle.BundleStart), before the pipeline when --bundle is given
    model_dir: Path | None = None  # model_prepare
    gguf_path: Path | None = None  # model_prepare (weights are read from it when model_dir has its tensor table)
    arch: ModelArch | None = None  # model_prepare
    dtype: torch.dtype = torch.float32  # model_prepare
    tokenizer: Any = None  # tokenizer_init
    # grammar_init (engine.structured.GrammarBackend, its tokenizer view built); None under --no-structured-outputs
    grammar: Any = None
    # load_weights (replaced by quantize_weights; model_init drops it once the model owns the tensors)
    state_dict: dict[str, torch.Tensor] | None = None
    # load_weights: the tensors kept as the GGUF stores them (Hugging Face weight name -> mapped rows), for the
    # layers run in place (models/gguf_auto.py); model_init builds those layers from them and drops the slot
    gguf_stored: dict[str, GGUFRows] | None = None
    weights_bytes: int = 0  # load_weights / quantize_weights
    model: DecoderLM | None = None  # model_init (its layers switched in place by native_kernels)
    native: Any = None  # native_kernels (kernels.native.NativeBuild)
    # dynamo_transform (a trace, or the stored entry); graph_compile replaces it when the stored entry will not load
    traced: TracedDecode | LoadedDecode | StoredReplay | None = None
    decode_fn: CompiledDecode | ReplayDecode | None = None  # graph_compile
    compile_cache: CompileCache | None = None  # dynamo_transform
    compile_fallback: str | None = None  # dynamo_transform / graph_compile: why --compile auto runs the step eagerly
    kv_plan: KVPlan | None = None  # kv_cache_profiling
    kv_cache: KVCache | None = None  # kv_cache_init
    runner: ModelRunner | None = None  # kv_cache_init (its decode step set in place by graph_capture)
    engine: LLMEngine | None = None  # kv_cache_init
    parallel: Any = None  # distributed_init (engine.distributed.TPGroup), only under --tensor-parallel-size > 1

    def layer_formats(self) -> LayerFormats | None:
        """Under --quantization auto, each layer's format from the GGUF's tensor types (models/gguf_auto.py); None
        under another setting, or for a checkpoint that is no GGUF (auto runs its floats as `none` would)."""
        if self.config.quant.quantization != "auto" or self.model_dir is None:
            return None
        from glowplug.engine.models.gguf_auto import plan_layers
        from glowplug.engine.models.store import gguf_table

        table = gguf_table(self.model_dir)
        return None if table is None else plan_layers(table, self.config.quant.quantize_lm_head, self.in_place())

    def in_place(self) -> bool:
        """Whether auto computes a GGUF's layers on their stored blocks: on the CPU, on one rank, with the native
        kernels not switched off (GLOWPLUG_NATIVE=0); elsewhere its layers are repacked or de-quantized."""
        import os

        return (
            self.device == "cpu"
            and self.config.tensor_parallel_size == 1
            and os.environ.get("GLOWPLUG_NATIVE", "1") != "0"
        )

    def quant_scheme(self) -> str:
        """How the weights are converted: the configured scheme; under auto, "auto" when the GGUF holds quantized
        layers, else "none" (a safetensors folder, or a GGUF of floats: nothing to quantize)."""
        q = self.config.quant
        if q.quantization != "auto":
            return q.quantization
        formats = self.layer_formats()
        return "auto" if formats is not None and formats.quantized else "none"

    def quant_group_size(self) -> tuple[int | None, str]:
        """The group size to quantize with, and why: the configured one, else for int4 the block size of a GGUF
        source (exact on its grid), else the scheme's default. Under auto, the GGUF's 32-weight blocks (each
        layer's format is in `layer_formats`)."""
        q = self.config.quant
        if q.quantization == "auto":
            from glowplug.engine.models.gguf_auto import AUTO_GROUP

            if self.quant_scheme() == "auto":
                return AUTO_GROUP, f"auto: the GGUF's {AUTO_GROUP}-weight blocks"
            return None, "auto: floats, nothing to quantize"
        if q.group_size is not None:
            return q.group_size, "configured"
        if q.quantization == "int4" and self.model_dir is not None:
            from glowplug.engine.models.store import source_quant_block

            block = source_quant_block(self.model_dir)
            if block is not None:
                return block, f"matches the source GGUF's {block}-weight blocks"
        return None, "scheme default"

    def fetch_entry(
        self, spec: CacheSpec, factors: dict[str, Any], *, build: Callable[[Path | None], T], load: Callable[[Path], T]
    ) -> Fetched[T]:
        """A stage's entry for this model (ArtifactStore.fetch, filed under the model's group, so `cache ls` and a
        miss's explanation see it with the model's other entries): loaded when stored, else built and stored."""
        store = ArtifactStore(self.cache_root)
        return store.fetch(spec, factors, group=model_group(self.config.model), build=build, load=load)

    def tp_shard(self) -> TPShard:
        """This rank's place in the tensor-parallel group (engine/parallel.py): from the config and the rank the
        launcher gave this process, so the cache probes know it before distributed_init has run."""
        return TPShard(launch_rank(), self.config.tensor_parallel_size)

    def need(self, value: Any, what: str, stage: str) -> Any:
        if value is None:
            raise StageOrderError(f"{what} is not set: stage {stage!r} must run earlier in the pipeline")
        return value
