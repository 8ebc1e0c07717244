"""`glowplug bench cache-verify`: what verifying a warm cache hit costs, quick against full, on the model's real
files. It is the measurement behind the artifact store's checksum choice (engine/artifacts/manifest.py).

Each file is read once first, so the page cache is warm as on a warm start; the figures are then pure checking
cost (a cold page cache adds the read, which load_weights would otherwise pay).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .machine import report_header
from .stats import summarize


class CacheVerifyConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field("smollm2", description="'smollm2' or a .gguf file: a model held by the model cache.")
    repeats: int = Field(5, ge=3, le=1000, description="Timed runs per figure (median and range are reported).")
    out: Path | None = None


def _ms(fn: Callable[[], Any], repeats: int) -> str:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    s = summarize(samples)
    return f"{s.p50:.2f} ({s.min:.2f}-{s.max:.2f})"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def run_cache_verify_bench(cfg: CacheVerifyConfig, argv: list[str] | None) -> str:
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import INDUCTOR, MODEL
    from glowplug.base.artifacts.manifest import check_file, read_manifest, sha256_file
    from glowplug.engine.models.store import DEFAULT_ALIASES, default_gguf_path, prepare_model

    model_dir, fetched = prepare_model(cfg.model, quiet=True)
    if fetched is None:
        raise ValueError(f"{cfg.model!r} is a local folder, not a model-cache entry; pass 'smollm2' or a .gguf file")
    store = ArtifactStore()
    m = read_manifest(model_dir)
    n = cfg.repeats
    rows = ["| file | size | quick check | quick, ms | full (sha256), ms |", "|:--|--:|:--|--:|--:|"]
    for rel, rec in sorted(m.files.items(), key=lambda kv: -kv[1].size):
        path = model_dir / rel
        sha256_file(path)  # warm the page cache
        kind = rec.quick.split(":", 1)[0]
        rows.append(
            f"| {rel} | {_mb(rec.size)} | {kind} | {_ms(partial(check_file, path, rec, 'quick'), n)} | "
            f"{_ms(partial(check_file, path, rec, 'full'), n)} |"
        )
    total = sum(r.size for r in m.files.values())
    rows.append(
        f"| **whole entry** | {_mb(total)} | | {_ms(lambda: store.check_entry(model_dir, MODEL, mode='quick'), n)}"
        f" | {_ms(lambda: store.check_entry(model_dir, MODEL, mode='full'), n)} |"
    )
    extra = []
    if cfg.model in DEFAULT_ALIASES or cfg.model.endswith(".gguf"):
        source = default_gguf_path() if cfg.model in DEFAULT_ALIASES else Path(cfg.model)
        sha256_file(source)
        extra.append(
            f"| source {source.name} (not hashed: the key uses name, size, mtime) | "
            f"{_mb(source.stat().st_size)} | stat | {_ms(source.stat, n)} | {_ms(lambda: sha256_file(source), n)} |"
        )
    for ws in sorted((store.root / INDUCTOR.name).glob("[0-9a-f]*")):
        wm = read_manifest(ws)
        size = sum(r.size for r in wm.files.values())
        extra.append(
            f"| Inductor cache {ws.name} ({len(wm.files)} files) | {_mb(size)} | sha256 (small files) | "
            f"{_ms(partial(store.check_entry, ws, INDUCTOR, mode='quick'), n)} | "
            f"{_ms(partial(store.check_entry, ws, INDUCTOR, mode='full'), n)} |"
        )
    return "\n".join(
        [
            report_header("Cache verification cost on a warm hit: quick vs full", argv),
            f"Model cache entry `{model_dir}`. Times in ms: median (min-max) of {n} runs, page cache warm.",
            "Quick check: every file's size; files up to 8 MiB hashed whole (sha256); larger safetensors files by "
            "their header (names, dtypes, shapes, offsets); other large files by their first and last MiB. Full check: "
            "sha256 of every byte (`glowplug cache verify --full`, or GLOWPLUG_CACHE_VERIFY=full for every start).",
            "",
            *rows,
            *extra,
            "",
        ]
    )
