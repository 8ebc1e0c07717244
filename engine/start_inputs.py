"""What is known about a start before it runs, as named numbers: the inputs of the start-up model
(engine/start_model.py). Read without importing torch and without reading any weight, so `glowplug startup
--predict-only` answers in well under a second and a live start's plan costs milliseconds.

Inputs (all floats; `INPUT_NAMES` lists them):
  weights_bytes   the model's weight files as stored (the GGUF, or the safetensors shards): what load_weights reads
                  or maps
  convert_bytes   of those, the tensors the run does not take as stored or repacked on their own grid, but de-quantizes
                  (and, quantizing, re-quantizes): CONVERTED says which stored types each --quantization converts
  entry_bytes     the prepared cache entries the start will read (those its cache probes found: the quantized
                  weights, the compiled step, the KV profile)
  read_bytes      weights_bytes + entry_bytes: every byte the start must read or map
  resident_bytes  of read_bytes, how many the OS page cache holds now (mincore, base/residency.py); absent when the
                  system cannot tell
  params          parameters (from the architecture)
  layers          decoder layers
  shapes          distinct (type, shape) pairs among the weight matrices: how many kernels a cold compile makes
  vocab           vocabulary size (tokenizer and preparing work)
  kv_bytes        the KV pool the start allocates (the configured budget, else what max-num-seqs sequences of the
                  model length need, at most the CPU cap)
  capture_sizes   batch sizes graph_capture runs the step at
  batched_tokens  --max-num-batched-tokens (a measured KV profile's forward)
  ranks           --tensor-parallel-size
  compile         1 when the decode step is compiled, else 0
  kv_measure      1 when the KV profile is measured (a forward), 0 for the analytic peak
  quantized       1 when --quantization is not none
  probe_gbps      streaming-read bandwidth (GB/s) of this machine: the latest recorded probe (measured after READY)
  cpu_load        the run queue per usable core when the start is planned (other processes' CPU use since this
                  process began, plus this one: profiling/cpu_busy.py): above 1, CPU work (Python, compiling) runs that
                  many times slower than on an idle machine (engine/start_model.py)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glowplug.base.ggml import BLOCKS, FLOATS, IN_PLACE, Q4_0, Q4_1, Q4_K, Q5_0, Q8_0
from glowplug.base.residency import files_residency

from .config import EngineConfig

INPUT_NAMES = (
    "weights_bytes",
    "convert_bytes",
    "entry_bytes",
    "read_bytes",
    "resident_bytes",
    "params",
    "layers",
    "shapes",
    "vocab",
    "kv_bytes",
    "capture_sizes",
    "batched_tokens",
    "ranks",
    "compile",
    "kv_measure",
    "quantized",
    "probe_gbps",
    "cpu_load",
)
# Used when this machine has no recorded probe yet: a modest server's streaming read; the fit corrects it.
DEFAULT_PROBE_GBPS = 20.0
_CPU_KV_CAP = 2 << 30  # engine/kv_sizing.py CPU_KV_CAP_BYTES (imported there with its reason)


@dataclass(frozen=True)
class StartInputs:
    """The inputs of one start (see the module docstring) and the files behind `read_bytes`."""

    values: dict[str, float]
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())  # what could not be read, one line each (the basis says it)

    def get(self, name: str, default: float = 0.0) -> float:
        return float(self.values.get(name, default))

    def to_json(self) -> dict[str, float]:
        return dict(self.values)


# ---------------------------------------------------------------- model files


def weight_files(config: EngineConfig) -> list[Path]:
    """The files load_weights reads or maps: the GGUF (the embedded default, a .gguf, or the file a prepared folder
    came from), else the folder's safetensors shards."""
    from .models.store import TENSOR_TABLE, gguf_source

    source = gguf_source(config.model)
    if source is not None:
        return [source]
    folder = Path(config.model).expanduser()
    if not folder.is_dir():
        return []
    if (folder / TENSOR_TABLE).is_file():  # a folder prepared from a GGUF reads the GGUF (rare: tools, tests)
        from .models.store import gguf_file_for

        gguf = gguf_file_for(folder)
        return [gguf] if gguf is not None else []
    return sorted(folder.glob("*.safetensors"))


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


# GGML type ids -> (weights per block, bytes per block), for the types glowplug reads (engine/models/gguf_tensors.py).
GGML_BLOCKS = BLOCKS
FLOAT_TYPES = FLOATS
# The stored types each --quantization takes as they are (floats, run as stored or cast) or repacks exactly on their
# own 32-weight grid (engine/models/gguf_auto.py, gguf_tensors.repack_int4/int8): every other quantized tensor is
# converted. Under `none` every quantized tensor is de-quantized; int2 and w8a8 repack nothing.
# Under auto on the CPU every type with a native kernel runs in place (kernels/gguf.py): nothing is converted.
KEPT_TYPES: dict[str, frozenset[int]] = {
    "auto": IN_PLACE,
    "int4": frozenset({Q4_0, Q4_1, Q4_K}),
    "int8": frozenset({Q8_0, Q5_0}),
}


def tensor_bytes(kind: int, dims: tuple[int, ...]) -> int:
    """A GGUF tensor's stored bytes (0 for a type this table does not know)."""
    from math import prod

    block, size = GGML_BLOCKS.get(kind, (1, 0))
    return prod(dims) // block * size


def converted_bytes(tensors: list[tuple[int, tuple[int, ...]]], quantization: str) -> int:
    """Bytes of the tensors a run under `quantization` converts (KEPT_TYPES), of two or more dimensions."""
    kept = KEPT_TYPES.get(quantization, frozenset())
    return sum(tensor_bytes(k, d) for k, d in tensors if len(d) >= 2 and k not in FLOAT_TYPES and k not in kept)


@dataclass(frozen=True)
class GGUFLayout:
    """A GGUF header as the start-up model needs it: scalar metadata (an array as its length) and the (type id,
    dims) of every tensor."""

    metadata: dict[str, Any]
    tensors: list[tuple[int, tuple[int, ...]]]

    def arch_value(self, key: str, default: float = 0.0) -> float:
        """`<architecture>.<key>` (block_count, embedding_length, attention.head_count_kv, ...)."""
        value = self.metadata.get(f"{self.metadata.get('general.architecture', '')}.{key}", default)
        return float(value) if isinstance(value, (int, float)) else default


def read_gguf_layout(path: Path) -> GGUFLayout:
    """The header walked once over a read-only mapping: scalars kept, arrays skipped by their lengths (string items
    by their length prefixes), the tensor table read; no tensor data touched."""
    import mmap

    unpack = struct.unpack_from
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        (version,) = unpack("<I", buf, 4)
        if not 2 <= version <= 3:
            raise ValueError(f"GGUF version {version}")
        n_tensors, n_kv = unpack("<QQ", buf, 8)
        at = 24
        meta: dict[str, Any] = {}

        def string(at: int) -> tuple[str, int]:
            (n,) = unpack("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind == _GGUF_STRING:
                return at + 8 + unpack("<Q", buf, at)[0]
            if kind in _GGUF_SCALARS:
                return at + _GGUF_SCALARS[kind]
            if kind == _GGUF_ARRAY:
                item, count = unpack("<IQ", buf, at)
                at += 12
                if item in _GGUF_SCALARS:
                    return at + _GGUF_SCALARS[item] * count
                if item == _GGUF_STRING:  # a vocabulary or its merges: the hot loop, locals only
                    length = struct.Struct("<Q").unpack_from
                    for _ in range(count):
                        at += 8 + length(buf, at)[0]
                    return at
                for _ in range(count):
                    at = skip(item, at)
                return at
            raise ValueError(f"unknown GGUF value type {kind}")

        for _ in range(n_kv):
            key, at = string(at)
            (kind,) = unpack("<I", buf, at)
            at += 4
            if kind == _GGUF_STRING:
                meta[key], at = string(at)
            elif kind in _GGUF_SCALARS:
                meta[key] = unpack(_GGUF_SCALAR_FORMATS[kind], buf, at)[0]
                at += _GGUF_SCALARS[kind]
            elif kind == _GGUF_ARRAY:
                meta[key] = unpack("<Q", buf, at + 4)[0]  # the length
                at = skip(kind, at)
            else:
                raise ValueError(f"unknown GGUF value type {kind} for {key!r}")
        tensors = []
        for _ in range(n_tensors):
            _, at = string(at)
            (ndims,) = unpack("<I", buf, at)
            dims = unpack(f"<{ndims}Q", buf, at + 4)
            at += 4 + 8 * ndims
            (kind,) = unpack("<I", buf, at)
            at += 12  # the type and the offset
            tensors.append((kind, tuple(dims)))
    return GGUFLayout(meta, tensors)


def safetensors_matrices(files: Iterable[Path]) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every tensor of two or more dimensions in safetensors files, from their JSON headers."""
    out = []
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header: dict[str, Any] = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__" and len(info.get("shape", ())) >= 2:
                out.append((str(info["dtype"]), tuple(int(d) for d in info["shape"])))
    return out


# ---------------------------------------------------------------- the inputs


def entry_files(entry: Path) -> list[Path]:
    """The files of a stored cache entry (what a hit reads), its manifest left out."""
    if not entry.is_dir():
        return []
    return [p for p in entry.rglob("*") if p.is_file() and p.name != "manifest.json"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model the start-up model uses, from its header or config alone."""

    params: int
    layers: int
    shapes: int
    vocab: int
    kv_elements_per_token: int  # K and V elements one token adds to the cache, all layers
    positions: int
    tensors: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # a GGUF's (type id, dims)


def model_shape(files: list[Path], folder: Path | None) -> ModelShape:
    """From the GGUF's header (one walk, read_gguf_layout), else from the folder's config.json and the shards'
    safetensors headers."""
    from math import prod

    if len(files) == 1 and files[0].suffix == ".gguf":
        layout = read_gguf_layout(files[0])
        heads = layout.arch_value("attention.head_count", 1.0) or 1.0
        kv_heads = layout.arch_value("attention.head_count_kv", heads) or heads
        head_dim = layout.arch_value("attention.key_length", 0.0) or layout.arch_value("embedding_length") / heads
        layers = int(layout.arch_value("block_count"))
        vocab = layout.metadata.get("tokenizer.ggml.tokens")
        return ModelShape(
            params=sum(prod(d) for _, d in layout.tensors),
            layers=layers,
            shapes=len({t for t in layout.tensors if len(t[1]) >= 2}),
            vocab=int(vocab) if isinstance(vocab, int) else 0,
            kv_elements_per_token=int(2 * layers * kv_heads * head_dim),
            positions=int(layout.arch_value("context_length", 4096.0)),
            tensors=layout.tensors,
        )
    from .models.arch import load_arch

    if folder is None:
        raise ValueError("no model folder and no GGUF file")
    arch = load_arch(folder)
    return ModelShape(
        params=arch.num_params,
        layers=arch.num_hidden_layers,
        shapes=len(set(safetensors_matrices(files))),
        vocab=arch.vocab_size,
        kv_elements_per_token=2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim,
        positions=arch.max_position_embeddings,
    )


def cpu_load() -> float | None:
    """The run queue per usable core now: the other processes' busy cores since this process's entry, plus this
    process's one, over the cores (profiling/cpu_busy.py); where the entry was not sampled or is too recent, the
    1-minute load average per core. None where the system has neither."""
    import os

    from glowplug.profiling.cpu_busy import run_queue_per_core, usable_cores

    measured = run_queue_per_core()
    if measured is not None:
        return round(measured, 3)
    try:
        return round(os.getloadavg()[0] / max(1, len(usable_cores())), 3)
    except (AttributeError, OSError):
        return None


def _device(config: EngineConfig) -> str:
    from .config_check import preflight_device

    device = preflight_device(config)
    return "cpu" if device == "unknown" else device


_KV_ELEMENT_BYTES = {"float32": 4, "int8": 1}  # anything else (auto, bf16, fp16): 2


def gather_inputs(
    config: EngineConfig, *, entries: Mapping[str, Path] | None = None, probe_gbps: float | None = None
) -> StartInputs:
    """The inputs of a start of `config` (module docstring). `entries`: the cache entries its probes found (cache
    name -> entry folder), read on a hit; `probe_gbps`: the machine's latest recorded probe. What cannot be read is
    left out and named in `notes`; raises ValueError only when the model's files cannot be read at all."""
    from .graph_buckets import bucket_sizes

    notes: list[str] = []
    files = weight_files(config)
    folder = Path(config.model).expanduser() if Path(config.model).expanduser().is_dir() else None
    try:
        shape = model_shape(files, folder)
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise ValueError(f"cannot read the model's sizes from {files or config.model}: {exc}") from exc
    weights = sum(p.stat().st_size for p in files)
    quant = config.quant.quantization
    # A safetensors checkpoint holds floats: converted (quantized) unless run as stored.
    convert = converted_bytes(shape.tensors, quant) if shape.tensors else (0 if quant in ("none", "auto") else weights)
    cached = [p for entry in (entries or {}).values() for p in entry_files(entry)]
    entry_bytes = sum(p.stat().st_size for p in cached)
    values: dict[str, float] = {
        "weights_bytes": weights,
        "convert_bytes": convert,
        "entry_bytes": entry_bytes,
        "read_bytes": weights + entry_bytes,
    }
    residency = files_residency([*files, *cached])
    if residency is None:
        notes.append("page-cache residency unknown on this system (no mincore)")
    else:
        values["resident_bytes"] = residency.resident
    device = _device(config)
    sched, cache = config.scheduler, config.cache
    positions = config.max_model_len if isinstance(config.max_model_len, int) else shape.positions
    element = _KV_ELEMENT_BYTES.get(cache.kv_cache_dtype if cache.kv_cache_dtype == "int8" else config.dtype, 2)
    want = shape.kv_elements_per_token * element * positions * sched.max_num_seqs
    budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else _CPU_KV_CAP
    compiled = config.compile_enabled()
    values.update(
        {
            "params": shape.params,
            "layers": shape.layers,
            "shapes": shape.shapes,
            "vocab": shape.vocab,
            "kv_bytes": min(want, budget),
            "capture_sizes": len(
                bucket_sizes(sched.max_num_seqs, config.cudagraph_capture_sizes, include_limit=device == "cuda")
            )
            if compiled
            else 0,
            "batched_tokens": sched.max_num_batched_tokens,
            "ranks": config.tensor_parallel_size,
            "compile": 1.0 if compiled else 0.0,
            "kv_measure": 1.0 if cache.kv_profile == "measure" else 0.0,
            "quantized": 0.0 if config.quant.quantization == "none" else 1.0,
            "probe_gbps": probe_gbps if probe_gbps else DEFAULT_PROBE_GBPS,
        }
    )
    if not probe_gbps:
        notes.append(f"no recorded read probe on this machine: {DEFAULT_PROBE_GBPS:g} GB/s assumed")
    load = cpu_load()
    if load is not None:
        values["cpu_load"] = load
    return StartInputs({k: float(v) for k, v in values.items()}, tuple(str(p) for p in [*files, *cached]), tuple(notes))
