"""The ready-engine bundle: one file that makes a fresh machine's first start a warm one.

`glowplug bundle create` starts the config twice in a private, empty cache dir (each start in a fresh process, as a
user's would be): a cold start, which builds every entry (the prepared model, quantized weights, the compiled
decode step with its Inductor kernels, the KV profile), and a warm one, which proves they all hit and records a
warm start in the start-up profile, so a start from the bundle gets an ETA from a start like itself. It then packs
every entry of that cache dir, the model's own file(s) (a `source` entry: the weights as stored) and the native
kernel variants of each ISA level this CPU runs into one file (base/artifacts/bundle.py: the format, checksums and
install).

`--bundle FILE` (serve, startup, generate) and `glowplug bundle install FILE` install the entries into the cache
dir before the stages run (the bundle_install stage). Entries whose factors hold here are then hits; the others
are misses like any other, and the miss explanation names the factor that differs and the machine fact behind it
("dtype bfloat16 -> float32 (entry from bundle x.glowplug, made where cpu isa level: avx512_bf16 there, avx2
here)"). Variants of an ISA level this CPU lacks are not installed at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.bundle import (
    BUNDLE_FORMAT,
    BundleEntry,
    BundleHeader,
    InstallReport,
    entry_folders,
    install_bundle,
    read_header,
    write_bundle,
)
from glowplug.base.artifacts.caches import NATIVE, SOURCE, source_digest
from glowplug.base.artifacts.manifest import now_iso, package_version, read_manifest, sha256_file
from glowplug.base.machine import fact_changes, level_at_least, machine_facts

from .config import EngineConfig
from .models.arch import ModelError
from .models.store import DEFAULT_ALIASES, gguf_source, model_group

# The packages whose source decides whether an entry made by one glowplug serves another (the same set the
# compile cache keys on, plus the layers above, so that "made by another glowplug" is said whatever changed).
SOURCE_PACKAGES = ("", "engine", "kernels", "base", "profiling", "lifecycle")
# Model folders: the files a start reads (weights, config, tokenizer, generation and chat settings).
_FOLDER_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".gguf")


class BundleError(RuntimeError):
    """`bundle create` could not make the bundle; str() is one line with the cause."""


def bundle_facts(device: str = "cpu") -> dict[str, str]:
    """The machine facts a bundle records (base.machine.machine_facts) plus glowplug's source and the device."""
    return {**machine_facts(), "glowplug_source": source_digest(SOURCE_PACKAGES), "device": device}


def source_factors(files: list[Path]) -> dict[str, Any]:
    """A model's files by name, size and sha256: the source entry is the same model wherever it lies."""
    return {"files": {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(files)}}


def model_files(spec: str) -> list[Path]:
    """The files of the model `spec` names, as the user keeps them: the GGUF, or a model folder's files."""
    source = gguf_source(spec)
    if source is not None:
        return [source]
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ModelError(f"model {spec!r} not found: pass 'smollm2', a .gguf file or a Hugging Face folder")
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _FOLDER_SUFFIXES)


def installed_model(store: ArtifactStore, header: BundleHeader) -> Path | None:
    """Where the bundle's model lies once its source entry is installed: the GGUF, or the model folder, under
    the name it had (caches file a model under that name: models/store.py `model_group`)."""
    key, name = header.model.get("source_key"), header.model.get("file")
    if not key or not name:
        return None
    return store.entry_path(SOURCE, key) / name


@dataclass(frozen=True)
class CreateResult:
    path: Path
    size: int
    model_bytes: int  # the model's files as stored, inside the bundle
    cold_s: float  # the cold start's time to READY (process creation -> READY)
    warm_s: float
    seconds: float  # the whole `bundle create`
    entries: list[tuple[str, str, int]]  # (cache, key, bytes)


def _run_start(config_file: Path, cache: Path, report: Path) -> float:
    """One start of the config in `config_file` in a fresh process on `cache` (engine/fresh_start.py); its time to
    READY."""
    from glowplug.profiling.phases import read_report

    cmd = [sys.executable, "-m", "glowplug.engine.fresh_start", str(config_file), str(report)]
    env = {**os.environ, "GLOWPLUG_CACHE_DIR": str(cache)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [
            ln for ln in done.stderr.strip().splitlines() if ln.startswith("glowplug:")
        ] or done.stderr.splitlines()
        raise BundleError(f"the start that builds the bundle failed: {lines[-1] if lines else done.returncode}")
    return float(read_report(report).actual_total_time or 0.0)


def create_bundle(config: EngineConfig, out: Path, *, say: Callable[[str], None] = lambda _: None) -> CreateResult:
    """Make the bundle for `config` at `out` (see the module docstring)."""
    t0 = time.perf_counter()
    files = model_files(config.model)
    work = Path(tempfile.mkdtemp(prefix="glowplug-bundle-"))
    try:
        cache = work / "cache"
        config_file = work / "config.json"
        flags = config.model_dump(mode="json", exclude={"model", "bundle"})
        config_file.write_text(json.dumps({**flags, "model": config.model}))
        say(f"cold start of {config.model} into an empty cache dir (builds every entry)...")
        cold = _run_start(config_file, cache, work / "cold.json")
        say(f"cold start READY in {cold:.1f} s; warm start (checks every entry hits, records it for the ETA)...")
        warm = _run_start(config_file, cache, work / "warm.json")
        say(f"warm start READY in {warm:.1f} s; packing")
        store = ArtifactStore(cache)

        # The entry holds the GGUF, or a folder named like the model's: the model keeps its name once installed.
        is_gguf = gguf_source(config.model) is not None
        name = files[0].name if is_gguf else Path(config.model).expanduser().resolve().name

        def link(folder: Path | None) -> None:
            assert folder is not None, "the bundle's private cache dir is writable"
            into = folder if is_gguf else folder / name
            into.mkdir(exist_ok=True)
            for f in files:
                try:  # a hard link keeps the file's mtime, which the model cache keys a GGUF on
                    os.link(f, into / f.name)
                except OSError:
                    shutil.copy2(f, into / f.name)

        factors = source_factors(files)
        source = store.put(SOURCE, factors, group=model_group(config.model), build=link)
        found = list(entry_folders(store))
        have = {(c, k) for c, k, _, _ in found}
        from glowplug.kernels.native import variant_entries

        for folder in variant_entries(cache):
            if (NATIVE.name, folder.name) not in have:
                found.append((NATIVE.name, folder.name, folder, read_manifest(folder)))
        entries = [BundleEntry(cache=c, key=k, manifest=m) for c, k, _, m in found]
        header = BundleHeader(
            format=BUNDLE_FORMAT,
            created=now_iso(),
            glowplug=package_version("glowplug"),
            machine=bundle_facts(config.resolved_device()),
            config=flags,
            model={"spec": config.model, "name": model_group(config.model), "source_key": source.key, "file": name},
            entries=entries,
            info={"cold_start_s": round(cold, 3), "warm_start_s": round(warm, 3)},
        )
        size = write_bundle(out, header, [f for _, _, f, _ in found])
        sizes = [(c, k, sum(r.size for r in m.files.values())) for c, k, _, m in found]
        return CreateResult(
            out, size, sum(f.stat().st_size for f in files), cold, warm, time.perf_counter() - t0, sizes
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- using a bundle


def bundle_defaults(path: Path) -> dict[str, Any]:
    """The engine flags the bundle was made with (the defaults of a start from it) and its model spec."""
    header = read_header(path)
    return {**header.config, "model": header.model.get("spec")}


def install_filter(cpu_level: str) -> Callable[[BundleEntry], str | None]:
    def wanted(entry: BundleEntry) -> str | None:
        level = entry.manifest.factors.get("level") if entry.cache == NATIVE.name else None
        if isinstance(level, str) and not level_at_least(cpu_level, level):
            return f"the {level} kernels need a CPU this one is not ({cpu_level})"
        return None

    return wanted


@dataclass(frozen=True)
class BundleStart:
    """What the bundle_install stage leaves for the start: the install, the model to run, and what differs."""

    report: InstallReport
    model: str  # the model spec the start runs: the bundle's installed copy, or the configured one
    model_note: str | None  # why the configured model is run instead of the bundle's copy, if it is
    differences: list[str]  # machine facts that differ from where the bundle was made


def install_for_start(config: EngineConfig, cache_root: Path) -> BundleStart:
    """Install `config.bundle` into `cache_root` and choose the model: the bundle's copy when the config names the
    model the bundle was made for (or names none) and its copy is sound; else the configured model."""
    from glowplug.base.machine import isa_choice

    assert config.bundle is not None
    path = Path(config.bundle).expanduser()
    store = ArtifactStore(cache_root)
    report = install_bundle(path, store, wanted=install_filter(isa_choice().cpu_level))
    header = report.header
    differences = fact_changes(header.machine, bundle_facts(config.resolved_device()))
    model, note = config.model, None
    copy = installed_model(store, header)
    same_model = config.model == header.model.get("spec") or (
        config.model in DEFAULT_ALIASES and header.model.get("spec") in DEFAULT_ALIASES
    )
    if same_model and copy is not None:
        outcome = report.outcome_of(SOURCE.name, str(header.model.get("source_key")))
        if outcome is not None and outcome.outcome in ("installed", "present") and copy.exists():
            model = str(copy)
        else:
            why = outcome.reason if outcome is not None else "not in the bundle"
            note = f"the bundle's model file was not installed ({why}); running {config.model} as configured"
    elif not same_model:
        note = f"--model {config.model} is not the bundle's model ({header.model.get('spec')}); its entries miss"
    return BundleStart(report, model, note, differences)
