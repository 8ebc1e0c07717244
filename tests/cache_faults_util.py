"""Shared by the cache fault tests and their worker process: one start-up, its greedy output, its cache events,
and the ways an entry gets damaged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PROMPTS = ["The scheduler", "glowplug starts", "Numbers 0 1 2"]
MAX_TOKENS = 8
DAMAGES = ("truncated", "bitflip", "empty", "missing", "garbage_manifest", "stale_glowplug", "stale_torch")

# The file each cache's fault cases damage (the one that holds what the cache is for).
DATA_FILE = {
    "model": "model.safetensors",
    "quant": "quantized.safetensors",
    "kv_profile": "profile.json",
    "startup_profile": "phases.json",
    "kernel_dispatch": "table.json",
}


def fake_converter(tiny: Path) -> Any:
    """A stand-in for the GGUF -> HF conversion (25 s for SmolLM2): "convert" by copying a tiny HF checkpoint."""

    def convert(source: Path, out: Path, console: Any) -> None:
        for f in tiny.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)

    return convert


def install_fake_converter(tiny: Path) -> None:
    """Install the stand-in for good: only for worker processes, which run one start and exit (in-process tests
    use `monkeypatch.setattr(store, "_convert_gguf", fake_converter(tiny))`, so later tests convert for real)."""
    from glowplug.engine.models import store

    store._convert_gguf = fake_converter(tiny)  # type: ignore[assignment]


def start(model: str, cache: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Build an engine, generate greedily, and return tokens, cache events, stage attributes and table notes."""
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.sampling_params import SamplingParams
    from glowplug.engine.startup import build_engine
    from glowplug.profiling.names import Event, stage_from_span_name
    from glowplug.profiling.tracing import setup_tracing

    tracing = setup_tracing(in_memory=True)
    result = build_engine(EngineConfig.from_flat(model=model, **config), tracing=tracing, cache_dir=cache)
    # What the start imported by READY (a warm compiled start replays its step without Dynamo or Inductor).
    compiler_modules = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
    eng = result.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for p in PROMPTS:
        eng.add_request(p, params)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out[o.prompt] = list(o.outputs[0].token_ids)
    events, attrs = [], {}
    for span in tracing.finished_spans():
        stage = stage_from_span_name(span.name) or span.name
        attrs[stage] = {
            k: v if isinstance(v, (str, int, float, bool)) else list(v) for k, v in (span.attributes or {}).items()
        }
        for ev in span.events:
            if ev.name in (Event.CACHE_CORRUPT, Event.CACHE_UNUSABLE):
                events.append({"stage": stage, "event": ev.name, **dict(ev.attributes or {})})
    notes = {r.name: list(r.notes) for r in result.phase_table.rows if r.notes}
    return {
        "tokens": [out[p] for p in PROMPTS],
        "events": events,
        "attrs": attrs,
        "notes": notes,
        "compiler_modules_at_ready": compiler_modules,
    }


WORKER = Path(__file__).with_name("cache_fault_worker.py")


def run_worker(args: dict[str, Any]) -> subprocess.Popen[str]:
    """One start-up in a fresh process (tests/cache_fault_worker.py); its result with worker_result()."""
    return subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )


def worker_result(proc: subprocess.Popen[str], timeout: int = 600) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{err[-4000:]}"
    line = next(ln for ln in out.splitlines()[::-1] if ln.startswith("RESULT:"))
    return json.loads(line[len("RESULT:") :])  # type: ignore[no-any-return]


def entries(cache: Path, name: str) -> list[Path]:
    folder = cache / name
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def leftovers(cache: Path) -> list[Path]:
    """Temporary folders or files of writes, anywhere in the cache (must be none after any start)."""
    return [p for p in cache.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def damage_file(path: Path, how: str) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
    elif how == "bitflip":
        flip_bit(path)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "missing":
        path.unlink()
    else:
        raise ValueError(how)


def make_stale(entry: Path, how: str) -> Path:
    """stale_glowplug: the entry at this key was written by another glowplug, in another entry format.
    stale_torch: the entry was made under another torch version (moved to the key it would have had there).
    Returns where the entry now is."""
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import by_name

    m = json.loads((entry / "manifest.json").read_text())
    m["producer"].update(glowplug="0.0.1", torch="2.0.0")
    if how == "stale_glowplug":
        m["version"] = 0
        (entry / "manifest.json").write_text(json.dumps(m))
        return entry
    if "torch" in m["factors"]:
        m["factors"]["torch"] = "2.0.0"
    m["key"] = ArtifactStore.key(by_name(m["cache"]), m["factors"])
    (entry / "manifest.json").write_text(json.dumps(m))
    moved = entry.with_name(m["key"])
    entry.rename(moved)
    return moved
