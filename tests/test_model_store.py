"""The default model's one-time conversion through the artifact store: manifest, atomic rename, locking, rebuilds."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
from rich.console import Console

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import MODEL
from glowplug.base.artifacts.manifest import read_manifest, sha256_file
from glowplug.engine.models import store


def _fake_convert(source: Path, out: Path, console: Console) -> None:
    """Stands in for the 25 s GGUF conversion: slow, multi-file, and logs each run."""
    with (source.parent / "runs.log").open("a") as log:
        log.write("run\n")
    (out / "config.json").write_text("{}")
    time.sleep(0.5)
    (out / "model.safetensors").write_bytes(source.read_bytes() * 3)


def _prepare_in_child(source: str, cache: str, q: mp.Queue[str]) -> None:
    store._convert_gguf = _fake_convert  # type: ignore[assignment]
    q.put(str(store.prepare_gguf(Path(source), "fake", Path(cache), quiet=True).value))


@pytest.fixture
def fake_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "src" / "fake.Q4_1.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    monkeypatch.setattr(store, "_convert_gguf", _fake_convert)
    return src


def _runs(src: Path) -> int:
    log = src.parent / "runs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_manifest_records_factors_and_files(fake_source: Path, tmp_path: Path) -> None:
    got = store.prepare_gguf(fake_source, "fake", tmp_path / "cache", quiet=True)
    out = got.value
    assert not got.hit and got.miss_reason == "first start for this model"
    assert out.parent == tmp_path / "cache" / "model"
    m = read_manifest(out)
    assert m.factors["source"] == {
        "file": fake_source.name,
        "size": fake_source.stat().st_size,
        "mtime_ns": fake_source.stat().st_mtime_ns,
    }
    rec = m.files["model.safetensors"]
    assert rec.size == (out / "model.safetensors").stat().st_size
    assert rec.sha256 == sha256_file(out / "model.safetensors")
    assert store.source_quant_block(out) == 32  # a Q4_1 source: int4 keeps its 32-weight blocks
    again = store.prepare_gguf(fake_source, "fake", tmp_path / "cache", quiet=True)
    assert again.hit and again.value == out and _runs(fake_source) == 1


def test_two_processes_prepare_at_once(fake_source: Path, tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    q: mp.Queue[str] = ctx.Queue()
    procs = [
        ctx.Process(target=_prepare_in_child, args=(str(fake_source), str(tmp_path / "cache"), q)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    paths = {q.get(timeout=5), q.get(timeout=5)}
    assert len(paths) == 1
    assert _runs(fake_source) == 1, "the second process must wait for and reuse the first one's conversion"
    root = tmp_path / "cache" / "model"
    assert [p.name for p in root.iterdir() if not p.name.startswith(".locks")] == [Path(paths.pop()).name]


@pytest.mark.parametrize("damage", ["no_manifest", "truncated_file", "source_changed"])
def test_broken_cache_is_detected_and_rebuilt(fake_source: Path, tmp_path: Path, damage: str) -> None:
    cache = tmp_path / "cache"
    out = store.prepare_gguf(fake_source, "fake", cache, quiet=True).value
    if damage == "no_manifest":
        (out / "manifest.json").unlink()  # what an interrupted copy or an older tool leaves
    elif damage == "truncated_file":
        f = out / "model.safetensors"
        f.write_bytes(f.read_bytes()[:10])
    else:
        fake_source.write_bytes(b"GGUF-other-content")
    again = store.prepare_gguf(fake_source, "fake", cache, quiet=True)
    assert not again.hit and _runs(fake_source) == 2
    if damage == "source_changed":
        assert again.value != out and "source.size" in (again.miss_reason or "")
    else:
        assert again.value == out and again.corrupt
    assert ArtifactStore(cache).check_entry(again.value, MODEL)[1] is None


def test_cache_dir_comes_from_env(fake_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOWPLUG_CACHE_DIR", str(tmp_path / "envcache"))
    out = store.prepare_gguf(fake_source, "fake", quiet=True).value
    assert out.parent == tmp_path / "envcache" / "model"


@pytest.mark.slow
def test_default_model_is_prepared_for_real(smollm2_dir: Path) -> None:
    m = read_manifest(smollm2_dir)
    assert m.factors["source"]["file"] == store.default_gguf_path().name
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", store.TENSOR_TABLE):
        assert (smollm2_dir / f).is_file() and f in m.files
    # The weights stay in the GGUF: the entry is a few MB, not a de-quantized copy.
    assert not list(smollm2_dir.glob("*.safetensors"))
    import json

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    table = store.gguf_table(smollm2_dir)
    assert table is not None and len(table.tensors) == 272
    assert store.source_quant_block(smollm2_dir) == 32  # Q4_1 projections
    from glowplug.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


@pytest.mark.slow
def test_real_entry_damaged_is_rebuilt(tmp_path: Path) -> None:
    src = store.default_gguf_path()
    first = store.prepare_gguf(src, store.DEFAULT_NAME, tmp_path, quiet=True)
    tok = first.value / "tokenizer.json"
    tok.write_text(tok.read_text()[:100])
    again = store.prepare_gguf(src, store.DEFAULT_NAME, tmp_path, quiet=True)
    assert not again.hit and again.corrupt
    from glowplug.engine.tokenizer import load_tokenizer

    assert len(load_tokenizer(again.value)) == 49152


@pytest.mark.slow
def test_prepared_folder_as_a_path_reads_its_gguf_or_says_it_is_gone(smollm2_dir: Path, tmp_path: Path) -> None:
    """The prepared folder itself is a valid MODEL (it reads the GGUF it was made from, with no safetensors); a copy
    whose GGUF cannot be found fails in model_prepare with the fix, not later with a missing-weights error."""
    import json
    import shutil

    from glowplug.engine.config import EngineConfig
    from glowplug.engine.stages.protocol import StartupFailed
    from glowplug.engine.startup import build_engine

    cfg = EngineConfig.from_flat(model=str(smollm2_dir), compile="off", max_num_seqs=2, max_model_len=256)
    result = build_engine(cfg, cache_dir=tmp_path / "cache")
    (weights,) = result.phase_table["load_weights"].attributes["glowplug.files"]
    assert Path(weights).suffix == ".gguf"  # load_weights read the GGUF, not the folder

    orphan = tmp_path / "orphan"
    shutil.copytree(smollm2_dir, orphan)
    (orphan / "manifest.json").unlink()
    table = json.loads((orphan / store.TENSOR_TABLE).read_text())
    table["source"] = str(tmp_path / "gone.gguf")
    (orphan / store.TENSOR_TABLE).write_text(json.dumps(table))
    cfg = EngineConfig.from_flat(model=str(orphan), compile="off", max_num_seqs=2, max_model_len=256)
    with pytest.raises(StartupFailed, match="model_prepare.*no longer there.*pass the .gguf file"):
        build_engine(cfg, cache_dir=tmp_path / "cache")


def _unsupported_architecture_gguf(path: Path, arch: str = "phi3") -> Path:
    """A GGUF whose architecture glowplug does not run, with a 100k-token vocabulary (parsing it is the slow part
    of preparing) and a tensor of a type glowplug does not read: the architecture must be refused first."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_token_list([f"t{i}" for i in range(100_000)])
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 18), dtype=np.uint8), raw_dtype=GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_fails_model_prepare_at_once(tmp_path: Path) -> None:
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.models.arch import ModelError
    from glowplug.engine.stages.context import EngineContext
    from glowplug.engine.stages.model_prepare import ModelPrepare

    src = _unsupported_architecture_gguf(tmp_path / "phi.gguf")
    ctx = EngineContext(config=EngineConfig.from_flat(model=str(src)), cache_root=tmp_path / "cache")
    t0 = time.perf_counter()
    with pytest.raises(
        ModelError,
        match=r"phi\.gguf: GGUF architecture 'phi3' is not supported; "
        r"supported: llama, qwen2, qwen3, gemma3",
    ):
        ModelPrepare().run(ctx)
    assert time.perf_counter() - t0 < 1.0
    entries = tmp_path / "cache" / "model"
    assert not entries.exists() or not [p for p in entries.iterdir() if not p.name.startswith(".")]


def test_architecture_is_read_from_the_header_alone(tmp_path: Path) -> None:
    from glowplug.engine.models.arch import ModelError
    from glowplug.engine.models.gguf_header import read_gguf_metadata
    from glowplug.engine.models.gguf_meta import check_architecture

    src = _unsupported_architecture_gguf(tmp_path / "phi.gguf")
    # Stops at the key: the vocabulary after it is not walked.
    assert read_gguf_metadata(src, stop_at="general.architecture") == {"general.architecture": "phi3"}
    assert "tokenizer.ggml.tokens" in read_gguf_metadata(src)
    with pytest.raises(ModelError, match="'phi3' is not supported"):
        check_architecture(src)
    assert check_architecture(_unsupported_architecture_gguf(tmp_path / "llama.gguf", "llama")) == "llama"
