"""The default model's one-time conversion: manifest, atomic rename, locking, rebuild of broken caches."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
from rich.console import Console

from glowplug.engine.models import store


def _fake_convert(source: Path, out: Path, console: Console) -> None:
    """Stands in for the 25 s GGUF conversion: slow, multi-file, and logs each run."""
    with (source.parent / "runs.log").open("a") as log:
        log.write("run\n")
    (out / "config.json").write_text("{}")
    time.sleep(0.5)
    (out / "model.safetensors").write_bytes(source.read_bytes() * 3)


def _prepare_in_child(source: str, cache: str, q: "mp.Queue[str]") -> None:
    store._convert_gguf = _fake_convert  # type: ignore[assignment]
    q.put(str(store.prepare_gguf(Path(source), "fake", Path(cache), quiet=True)))


@pytest.fixture
def fake_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "src" / "fake.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    monkeypatch.setattr(store, "_convert_gguf", _fake_convert)
    return src


def _runs(src: Path) -> int:
    log = src.parent / "runs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_manifest_records_source_sha256(fake_source: Path, tmp_path: Path) -> None:
    out = store.prepare_gguf(fake_source, "fake", tmp_path / "cache", quiet=True)
    manifest = json.loads((out / store.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == store.sha256_file(fake_source)
    assert manifest["files"]["model.safetensors"] == (out / "model.safetensors").stat().st_size
    # A second call reuses the cache.
    assert store.prepare_gguf(fake_source, "fake", tmp_path / "cache", quiet=True) == out
    assert _runs(fake_source) == 1


def test_two_processes_prepare_at_once(fake_source: Path, tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    q: "mp.Queue[str]" = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(str(fake_source), str(tmp_path / "cache"), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    paths = {q.get(timeout=5), q.get(timeout=5)}
    assert len(paths) == 1
    assert _runs(fake_source) == 1, "the second process must wait for and reuse the first one's conversion"
    root = tmp_path / "cache" / "models"
    assert not [p for p in root.iterdir() if ".tmp-" in p.name], "temporary folders left behind"
    ok, why = store._manifest_ok(Path(paths.pop()), fake_source)
    assert ok, why


@pytest.mark.parametrize("damage", ["no_manifest", "truncated_file", "source_changed"])
def test_broken_cache_is_detected_and_rebuilt(fake_source: Path, tmp_path: Path, damage: str) -> None:
    cache = tmp_path / "cache"
    out = store.prepare_gguf(fake_source, "fake", cache, quiet=True)
    if damage == "no_manifest":
        (out / store.MANIFEST).unlink()  # what an interrupted copy or an older tool leaves
    elif damage == "truncated_file":
        f = out / "model.safetensors"
        f.write_bytes(f.read_bytes()[:10])
    else:
        fake_source.write_bytes(b"GGUF-other-content")
    ok, _ = store._manifest_ok(out, fake_source)
    assert not ok
    again = store.prepare_gguf(fake_source, "fake", cache, quiet=True)
    assert again == out and _runs(fake_source) == 2
    assert store._manifest_ok(out, fake_source)[0]


def test_cache_dir_comes_from_env(fake_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOWPLUG_CACHE_DIR", str(tmp_path / "envcache"))
    out = store.prepare_gguf(fake_source, "fake", quiet=True)
    assert out == tmp_path / "envcache" / "models" / "fake"


@pytest.mark.slow
def test_default_model_is_converted_for_real(smollm2_dir: Path) -> None:
    manifest = json.loads((smollm2_dir / store.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == store.sha256_file(store.default_gguf_path())
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (smollm2_dir / f).is_file()
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
