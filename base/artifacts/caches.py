"""Every cache glowplug keeps, declared in one place, with what it does when GLOWPLUG_CACHE_DIR is unusable.

| cache            | key factors                                                                 | unusable dir |
|------------------|-----------------------------------------------------------------------------|--------------|
| model            | GGUF file (name, size, mtime), converter version, tokenizers + gguf versions | fail        |
| quant            | checkpoint shards (name, size, mtime), scheme, group size, torch, kernels source | bypass  |
| compile          | model config, dtype, quant + KV-cache fields, torch, glowplug source, device | bypass      |
| inductor         | torch, device (CPU model)                                                   | bypass       |
| kv_profile       | model config, dtype, quantization, max_num_batched_tokens, max_num_seqs, device | bypass       |
| startup_profile  | the engine config (all fields but the seed), device                         | bypass       |
| kernel_dispatch  | torch, CPU model, threads, layer shapes, formats, Ms, table version         | bypass       |
| native           | kernel sources, torch, compiler version, CPU feature flags                  | bypass       |
| source           | the model's files as downloaded (names, sizes, sha256), brought by a bundle | fail         |

Why `model` fails: the engine reads the prepared folder (config, tokenizer, the GGUF's tensor table) from disk, and
a folder written somewhere else on every start would hide a broken cache dir behind a slower start each time; a
clear error asking for a usable GLOWPLUG_CACHE_DIR serves the user better. A read-only cache dir that already holds
the converted model still works (reads need no write access). Every other cache only saves time, so the start goes on
without it, recomputing what it would have held, with one warning.

A read-only cache dir (a container image layer, a shared mount) whose entries hit is a warm start with nothing said
and no write attempted (store.py, workspace.py): `inductor`, which Inductor writes even when everything hits, is
read through links from a private writable folder; `startup_profile`, rewritten after every start, keeps the
stored one. Only a miss, which cannot be stored, warns (the one line above).

A new cache is a spec here plus, where it is used, its factors and a build/load pair:
`ArtifactStore().fetch(SPEC, factors, group=model, build=..., load=...)`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FIRST_START = "first start for this model"


@dataclass(frozen=True)
class CacheSpec:
    """One cache: its folder name, entry format version, and what a start does when the cache dir is unusable.

    version: bump when what an entry holds changes meaning; older entries then become misses, explained.
    on_unusable: "bypass" builds without storing (with a warning); "fail" raises CacheDirUnusable.
    without: what running without this cache costs, for the warning and `glowplug cache ls`.
    """

    name: str
    version: int
    holds: str
    on_unusable: Literal["bypass", "fail"]
    without: str
    first: str = FIRST_START  # the miss reason when no entry for the same model was ever made


MODEL = CacheSpec(
    "model",
    2,
    "GGUF checkpoints prepared as folders (config, tokenizer, tensor table; weights stay in the GGUF)",
    "fail",
    "the prepared model must be written to disk before the engine can read it",
)
QUANT = CacheSpec(
    "quant",
    1,
    "quantized projection weights of one checkpoint for one scheme and group size",
    "bypass",
    "every start quantizes the weights again",
)
COMPILE = CacheSpec(
    "compile",
    2,
    "the AOT-compiled decode step (traced bytecode, guards, bundled Inductor output)",
    "bypass",
    "every start traces the decode step with Dynamo and compiles it with Inductor again",
)
INDUCTOR = CacheSpec(
    "inductor",
    1,
    "Inductor's cache folder: generated code, compiled kernels (.so), FX graphs, CPU probes",
    "bypass",
    "Inductor compiles into a private temporary folder, so every start compiles cold",
)
# v2: the CPU peak is live tensor bytes (profiling/memory.py LiveTensorPeak), no longer RSS growth.
KV_PROFILE = CacheSpec(
    "kv_profile",
    2,
    "activation peak of one forward at max_num_batched_tokens (sizes the KV cache)",
    "bypass",
    "every start runs the profiling forward again",
)
STARTUP_PROFILE = CacheSpec(
    "startup_profile",
    1,
    "seconds per start-up stage of the latest starts per cache hit/miss pattern, with what was "
    "known before each (the ETA, and the start-up model's fit)",
    "bypass",
    "no start-up ETA is shown and none is recorded",
)
KERNEL_DISPATCH = CacheSpec(
    "kernel_dispatch",
    1,
    "quantized-kernel dispatch table calibrated on this machine",
    "bypass",
    "quantized layers use the built-in dispatch rules and a calibration is not kept",
    first="not calibrated on this machine yet",
)

NATIVE = CacheSpec(
    "native",
    2,
    "glowplug's native CPU kernels, one variant per ISA level (.so), when none was prebuilt",
    "bypass",
    "the kernels are built again (several seconds) into a temporary folder at every start that has no prebuilt variant",
)

# Only a bundle (bundle.py, engine/bundle.py) writes it: a model file is otherwise read where the user keeps it.
SOURCE = CacheSpec(
    "source",
    1,
    "model files as downloaded (a GGUF, or a model folder's files), brought by a bundle",
    "fail",
    "a bundle's model cannot be installed, and the start needs the model where the bundle was made",
    first="no bundle brought this model",
)

ALL: tuple[CacheSpec, ...] = (
    MODEL,
    QUANT,
    COMPILE,
    INDUCTOR,
    KV_PROFILE,
    STARTUP_PROFILE,
    KERNEL_DISPATCH,
    NATIVE,
    SOURCE,
)


def by_name(name: str) -> CacheSpec:
    for spec in ALL:
        if spec.name == name:
            return spec
    raise ValueError(f"no cache named {name!r}; the caches are {', '.join(s.name for s in ALL)}")


def source_digest(packages: Iterable[str]) -> str:
    """Hash of the .py files of glowplug subpackages (e.g. ["engine", "kernels"]): a code change must never
    reuse an artifact the old code made. Their folders are found, not imported: base reads the files of layers
    above it, it does not depend on their code."""
    import importlib.util

    h = hashlib.sha256()
    roots: set[Path] = set()
    for sub in packages:
        spec = importlib.util.find_spec(f"glowplug.{sub}" if sub else "glowplug")
        if spec is None or spec.submodule_search_locations is None:
            raise ModuleNotFoundError(f"glowplug.{sub} is not an installed package" if sub else "glowplug")
        roots |= {Path(p) for p in spec.submodule_search_locations}
    for root in sorted(roots):
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def file_stamps(files: Iterable[Path]) -> dict[str, str]:
    """`{name: "size:mtime_ns"}`: identifies checkpoint files without reading them (a rewrite changes mtime)."""
    out = {}
    for f in files:
        st = f.stat()
        out[f.name] = f"{st.st_size}:{st.st_mtime_ns}"
    return out
