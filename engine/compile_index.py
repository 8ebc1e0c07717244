"""The compile cache's factors that are known without torch, and its hit or miss as a prediction made before a
start (`glowplug startup --predict-only`) can tell it from the stored entries alone.

A start decides hit or miss by the exact key of its compile factors (engine/compile_cache.py compile_factors), and
some of them are only known once torch is imported and the model is loaded: the ISA level of the native kernels,
every layer's kernel format, Inductor's settings (torch's threads). The rest are known before: torch's version
(package metadata), the glowplug source, the device, the quantization and KV-cache fields, the dtype when it is
given, the tensor-parallel size. `forecast` compares those with every sound entry of the model (its cache group):
one that agrees on all of them is a hit (the others change only with the machine or the file, which the model's
entries were made on); none is a miss, said with what changed since the latest entry (`describe_changes`, as a
start explains its miss).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import COMPILE, source_digest
from glowplug.base.artifacts.manifest import Manifest, describe_changes

from .config import EngineConfig
from .models.store import model_group

HIT, MISS = "hit", "miss"
# The packages whose source the compiled step depends on (compile_factors' glowplug_source).
SOURCE_PACKAGES = ["", "engine", "kernels"]
# The factors a start computes only after importing torch and loading the model: not compared before it.
CHECKED_AT_START = "the native kernels' ISA level, the layers' kernel formats and Inductor's settings"


def device_label(device: str) -> str:
    """The device as compiled code depends on it: on the CPU, the CPU model (Inductor builds with -march=native); on
    a GPU, its name, compute capability and torch's CUDA version (base.machine.GpuFacts)."""
    if device.startswith("cuda"):
        from glowplug.base.machine import gpu_facts

        return gpu_facts(device).label()
    if device != "cpu":
        return device
    from glowplug.base.machine import cpu_model

    # Inductor picks its vector ISA by the CPU, capped by ATEN_CPU_CAPABILITY: a capped start compiles other code.
    capped = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return f"cpu/{cpu_model()}" + (f"/aten_cpu_capability={capped}" if capped else "")


def config_factors(config: EngineConfig) -> dict[str, Any]:
    """The engine settings that shape the compiled graph (compile_factors' `engine_config`)."""
    return {
        "quant": {
            "quantization": config.quant.quantization,
            "group_size": config.quant.group_size,
            "quantize_lm_head": config.quant.quantize_lm_head,
        },
        "cache": {"kv_cache_dtype": config.cache.kv_cache_dtype, "block_size": config.cache.block_size},
    }


def known_factors(config: EngineConfig, device: str) -> dict[str, Any]:
    """The compile factors known before a start (module docstring), named as compile_factors names them. A GPU's
    label needs torch: on a GPU the device is left out (the entries of a model are made on this machine)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    out: dict[str, Any] = {
        "engine_config": config_factors(config),
        "torch": torch_version,
        "glowplug_source": source_digest(SOURCE_PACKAGES),
    }
    if not device.startswith("cuda"):
        out["device"] = device_label(device)
    if config.dtype != "auto":
        out["dtype"] = config.dtype
    out["tensor_parallel_size"] = config.tensor_parallel_size
    return out


def _comparable(factors: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """An entry's factors as `known_factors` names them (tensor_parallel as its world size)."""
    out = {k: v for k, v in factors.items() if k in names}
    if "tensor_parallel_size" in names:
        out["tensor_parallel_size"] = int(factors.get("tensor_parallel", {}).get("world_size", 1))
    return out


@dataclass(frozen=True)
class CompileForecast:
    """The compile cache's predicted state, in words (`basis`), and the entry a hit would load."""

    state: str
    basis: str
    entry: Path | None = None


def model_entries(store: ArtifactStore, group: str) -> list[tuple[Path, Manifest, float]]:
    """The compile entries of one model (cache group) with sound files, the most recently used first."""
    return [e for e in store.entries(COMPILE, group) if store.present(COMPILE, e[0].name)]


def forecast(config: EngineConfig, store: ArtifactStore, device: str) -> CompileForecast:
    """Whether a start of `config` will load its compiled step from the cache (module docstring)."""
    entries = model_entries(store, model_group(config.model))
    if not entries:
        return CompileForecast(MISS, "compile: miss, no compiled step of this model is stored")
    ours = known_factors(config, device)
    names = set(ours)
    for path, m, _ in entries:
        if _comparable(m.factors, names) == ours:
            return CompileForecast(
                HIT,
                f"compile: hit, stored entry {path.name} of this model has this start's torch, glowplug source, "
                f"device, quantization and KV-cache settings ({CHECKED_AT_START} are checked by the start)",
                path,
            )
    changes = describe_changes(_comparable(entries[0][1].factors, names), ours)
    return CompileForecast(
        MISS, f"compile: miss, changed since the latest compiled step of this model: {'; '.join(changes)}"
    )
