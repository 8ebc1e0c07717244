"""The settings checked against the model and the machine before any heavy work, each failure one line naming the
flag, the value and a fix that works.

Two passes with the same checks and the same messages:
  preflight(config)   the CLI, before `import torch` and before a GGUF is converted: the device against the
                      torch build (read from torch's version file, not by importing it), --max-model-len against
                      the model's positions and an explicit KV budget (--kv-cache-memory, --num-gpu-blocks-override)
                      against one sequence, from the model's config.json or its GGUF header (milliseconds)
  check_prepared(ctx) the model_prepare stage, for every caller (library, server, CLI): the same, with the dtype
                      resolved by torch, plus the quantization against the model's tensor shapes (that needs the
                      kernels' group rules, which import torch)
A budget from --memory-utilization depends on the profiled activation peak, so it is checked where it is measured
(kv_cache_profiling), with the same wording (kv_sizing.plan_kv_cache).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from glowplug.base.machine import ISA_CAP_ENV, IsaCapError, cpu_has_native_bf16, isa_cap, isa_choice, level_at_least

from .config import ConfigError, EngineConfig
from .kv_sizing import check_model_len, plan_kv_cache
from .models.arch import ModelArch, ModelError, load_arch, parse_hf_config

if TYPE_CHECKING:
    from .stages.context import EngineContext

# GGUF file types whose weights are all in 32-weight blocks (llama.cpp's LlamaFileType: Q4_0, Q4_1, Q8_0, Q5_0,
# Q5_1): what store.source_quant_block reads from a prepared folder's tensor table.
_BLOCK_32_FILE_TYPES = frozenset({2, 3, 7, 8, 9})
TORCH_INSTALL_HINT = "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need to know about a model, read without preparing or loading it."""

    arch: ModelArch
    quantized_source: bool  # a GGUF in 32-weight blocks: the dtype counts as bfloat16 (see resolve_dtype_name)
    source: Path  # the .gguf file or the model folder


def model_facts(spec: str) -> ModelFacts:
    """The architecture of `spec` ('smollm2', a .gguf file, a folder) from its config.json or GGUF header; raises
    ModelError naming the fix when the model is not there."""
    from .models.store import DEFAULT_ALIASES, default_gguf_path

    path = default_gguf_path() if spec in DEFAULT_ALIASES else Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from .models.gguf_header import HeaderReader
        from .models.gguf_meta import build_config

        reader = HeaderReader(path)
        # Tied or not only changes the weight count, which nothing checked here depends on.
        arch = parse_hf_config(build_config(reader, path, tied=True), path)
        file_type = reader.fields.get("general.file_type")
        return ModelFacts(arch, file_type is not None and file_type.contents() in _BLOCK_32_FILE_TYPES, path)
    if path.is_dir():
        quantized = False
        table = path / "gguf_tensors.json"
        if table.is_file():  # a folder prepared from a GGUF: its dtype counts as bfloat16 either way
            quantized = True
        return ModelFacts(load_arch(path), quantized, path)
    raise ModelError(
        f"model {spec!r} not found: pass 'smollm2' for the embedded default, a local Hugging Face folder "
        f"(config.json + *.safetensors + tokenizer files) or a .gguf file. Model hubs are not contacted."
    )


def resolve_dtype_name(
    name: str, arch: ModelArch, device: str, *, quantized_source: bool = False, compiled: bool = True
) -> str:
    """`--dtype auto` as a dtype name (the rule is models/loader.resolve_dtype's, which calls this): the checkpoint's
    dtype (bfloat16 for a block-quantized source). On a CPU, bfloat16 where it is the faster choice: with hardware
    bf16 (the avx512_bf16 and amx levels), or at the avx2 and avx512 levels when the decode step is compiled
    (`compiled`), since the native kernels then read bf16 weights and multiply in fp32, and decode reads half the
    bytes of float32 (1.33x the batch-1 decode rate at the avx2 level: reports/decode-isa.md); eager prompts there
    run their bf16 projections in fp32 arithmetic (kernels/modules.DenseLinear). Else float32."""
    if name != "auto":
        return name
    declared = "bfloat16" if quantized_source else (arch.torch_dtype or "bfloat16")
    if declared not in ("float32", "bfloat16", "float16"):
        declared = "bfloat16"
    if device != "cpu":
        return declared
    if declared == "float32":
        return "float32"
    if cpu_has_native_bf16() or (compiled and level_at_least(isa_choice().level, "avx2")):
        return "bfloat16"
    return "float32"


def torch_build_cuda() -> str | None:
    """The CUDA version the installed torch was built with (None: a CPU-only build), read from torch/version.py
    without importing torch; "unknown" when the file cannot be read (then the check waits for torch itself)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda  # type: ignore[no-any-return]
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "unknown"
    for folder in spec.submodule_search_locations:
        try:
            tree = ast.parse((Path(folder) / "version.py").read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            target = (
                node.target
                if isinstance(node, ast.AnnAssign)
                else (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            )
            if isinstance(target, ast.Name) and target.id == "cuda" and node.value is not None:  # type: ignore[attr-defined]
                try:
                    value = ast.literal_eval(node.value)  # type: ignore[attr-defined]
                except ValueError:
                    return "unknown"
                return None if value is None else str(value)
    return "unknown"


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def check_device(config: EngineConfig) -> None:
    """--device cuda against the torch build (before torch is imported) and, once torch is imported, against the
    GPUs it sees. `--device auto` never fails: it picks cpu when there is no GPU."""
    if config.device != "cuda":
        return
    built = torch_build_cuda()
    if built is None:
        raise ConfigError(
            "--device",
            f"--device cuda: the installed torch ({_torch_version()}) is a CPU-only build; use --device cpu (or "
            f"leave --device auto), or {TORCH_INSTALL_HINT}",
        )
    if "torch" in sys.modules and not sys.modules["torch"].cuda.is_available():
        raise ConfigError(
            "--device",
            f"--device cuda: torch {_torch_version()} (CUDA {built}) sees no GPU (check the driver with nvidia-smi "
            f"and CUDA_VISIBLE_DEVICES); use --device cpu, or leave --device auto to use a GPU when there is one",
        )


def preflight_device(config: EngineConfig) -> str:
    """The device the engine will run on, decided without importing torch when the build says so: cpu for a CPU
    build (auto or cpu), else "unknown" until torch is imported."""
    if config.device != "auto":
        return config.device
    return "cpu" if torch_build_cuda() is None else "unknown"


def check_kv_budget(config: EngineConfig, arch: ModelArch, *, dtype: str, device: str) -> None:
    """An explicit KV budget (--kv-cache-memory or --num-gpu-blocks-override) against one sequence: exact without
    the profiled activation peak, which an explicit budget does not subtract."""
    if config.cache.kv_cache_memory is None and config.cache.num_gpu_blocks_override is None:
        return
    plan_kv_cache(config, arch, model_dtype=dtype, device=device, weights_bytes=0)


def check_quantization(config: EngineConfig, arch: ModelArch, group_size: int | None) -> None:
    """--quantization (and --group-size) against the model's projection shapes: every quantized layer needs its
    input width to be a multiple of some allowed group size no larger than the configured one. auto quantizes only
    tensors stored in GGUF blocks, on their own 32-weight grid, so any shape the file holds fits."""
    scheme_name = config.quant.quantization
    if scheme_name in ("none", "auto"):
        return
    from glowplug.kernels.registry import get_scheme

    scheme = get_scheme(scheme_name)
    gs = scheme.resolve_group_size(group_size)
    if gs is None:
        return  # per channel (int8, w8a8): any shape
    widths = {
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "attention output (heads x head_dim)": arch.num_attention_heads * arch.head_dim,
    }
    for what, k in widths.items():
        try:
            scheme.layer_group_size(k, gs)
        except ValueError:
            raise ConfigError(
                "--quantization",
                f"--quantization {scheme_name} (group size {gs}) cannot quantize this model: its {what} is {k}, not "
                f"a multiple of 32, the smallest group size; use --quantization int8 (per channel, any shape) or "
                f"--quantization none",
            ) from None


def check_tensor_parallel_config(
    config: EngineConfig, arch: ModelArch, group: Callable[[int], int | str | None] | None = None
) -> None:
    """--tensor-parallel-size against the model's heads and widths (engine/parallel.py says how each tensor splits)
    and, once the quantization's groups are known (`group`: a row-parallel input width -> its layer's group, or
    PER_CHANNEL), against their boundaries."""
    n = config.tensor_parallel_size
    if n == 1:
        return
    from .parallel import check_tensor_parallel

    if config.compile == "on":
        raise ConfigError(
            "--compile",
            f"--compile on with --tensor-parallel-size {n}: the compiled decode step has "
            f"no collectives yet; use --compile auto (tensor parallel runs the step eagerly)",
        )
    why = check_tensor_parallel(arch, n, group)
    if why is not None:
        raise ConfigError("--tensor-parallel-size", why)


def _tp_group(config: EngineConfig, group_size: int | None) -> Callable[[int], int | str | None]:
    """The quantization group of a row-parallel layer with `k` inputs (PER_CHANNEL for a per-channel format)."""
    from .parallel import PER_CHANNEL

    name = config.quant.quantization
    if name == "none":
        return lambda k: None
    if name == "auto":
        from .models.gguf_auto import AUTO_GROUP

        return lambda k: AUTO_GROUP if group_size is not None else None
    from glowplug.kernels.registry import get_scheme

    scheme = get_scheme(name)
    gs = scheme.resolve_group_size(group_size)
    if gs is None or name == "w8a8":
        return lambda k: PER_CHANNEL
    return lambda k: scheme.layer_group_size(k, gs)


def check_config(config: EngineConfig, arch: ModelArch, *, dtype: str, device: str) -> None:
    """Every check that needs only the architecture (and the dtype the KV cache will use)."""
    check_model_len(config, arch)
    check_kv_budget(config, arch, dtype=dtype, device=device)
    check_tensor_parallel_config(config, arch)


def check_isa_cap() -> None:
    """GLOWPLUG_MAX_CPU_ISA names a level (an environment setting, checked like a flag)."""
    try:
        isa_cap()
    except IsaCapError as exc:
        raise ConfigError(ISA_CAP_ENV, str(exc)) from None


def preflight(config: EngineConfig) -> ModelFacts:
    """All checks that need no torch and no prepared model (the CLI runs this first); raises ConfigError or
    ModelError. Returns what it read about the model."""
    check_device(config)
    check_isa_cap()
    facts = model_facts(config.model)
    device = preflight_device(config)
    dtype = resolve_dtype_name(
        config.dtype,
        facts.arch,
        "cpu" if device == "unknown" else device,
        compiled=config.compile_enabled(),
        quantized_source=facts.quantized_source,
    )
    check_config(config, facts.arch, dtype=dtype, device=device)
    return facts


def check_prepared(ctx: EngineContext) -> None:
    """The model_prepare stage's check, with the dtype and device the engine will use."""
    arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
    dtype = str(ctx.dtype).removeprefix("torch.")
    check_config(ctx.config, arch, dtype=dtype, device=ctx.device)
    group_size = ctx.quant_group_size()[0]
    check_quantization(ctx.config, arch, group_size)
    check_tensor_parallel_config(ctx.config, arch, _tp_group(ctx.config, group_size))
