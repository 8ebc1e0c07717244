"""The artifact store itself: keys, explanations, checksums (quick and full), self-healing, workspaces, an unusable
cache dir, and `glowplug cache ls | verify | prune`."""

from __future__ import annotations

import errno
import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from opentelemetry import trace
from safetensors.torch import save_file

from glowplug.base.artifacts import ArtifactStore, CacheDirUnusable, CacheSpec
from glowplug.base.artifacts import manifest as mf
from glowplug.base.artifacts.workspace import open_workspace, seal
from glowplug.profiling.names import Attr, Event
from glowplug.profiling.tracing import setup_tracing

SPEC = CacheSpec("quant", 1, "test entries", "bypass", "recomputed")
STRICT = CacheSpec("model", 1, "test entries", "fail", "cannot run without it")


def _text_build(text: str, calls: list[Path | None]):
    def build(folder: Path | None) -> str:
        calls.append(folder)
        if folder is not None:
            (folder / "data.txt").write_text(text)
        return text

    return build


def _load(folder: Path) -> str:
    return (folder / "data.txt").read_text()


def test_key_is_the_factors_not_their_order(tmp_path: Path) -> None:
    a = ArtifactStore.key(SPEC, {"x": 1, "y": {"b": 2, "a": 1}})
    assert a == ArtifactStore.key(SPEC, {"y": {"a": 1, "b": 2}, "x": 1})
    assert a != ArtifactStore.key(SPEC, {"x": 2, "y": {"b": 2, "a": 1}})
    assert a != ArtifactStore.key(CacheSpec("quant", 2, "", "bypass", ""), {"x": 1, "y": {"b": 2, "a": 1}})


def test_hit_miss_and_the_explanation_of_a_miss(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    calls: list[Path | None] = []
    f1 = {"engine_config": {"cache": {"block_size": 16, "kv_cache_dtype": "auto"}}, "torch": "2.13.0"}
    first = store.fetch(SPEC, f1, group="m", build=_text_build("one", calls), load=_load)
    assert (first.hit, first.value, first.miss_reason) == (False, "one", "first start for this model")
    again = store.fetch(SPEC, f1, group="m", build=_text_build("x", calls), load=_load)
    assert again.hit and again.value == "one" and len(calls) == 1
    f2 = {"engine_config": {"cache": {"block_size": 32, "kv_cache_dtype": "auto"}}, "torch": "2.14.0"}
    changed = store.fetch(SPEC, f2, group="m", build=_text_build("two", calls), load=_load)
    assert changed.miss_reason == "changed: engine_config.cache.block_size 16 -> 32; torch '2.13.0' -> '2.14.0'"
    other = store.fetch(SPEC, f1 | {"torch": "9"}, group="another model", build=_text_build("3", calls), load=_load)
    assert other.miss_reason == "first start for this model"
    assert changed.attributes() == {
        Attr.CACHE_HIT: False,
        Attr.CACHE_KEY: changed.key,
        Attr.CACHE_MISS_REASON: changed.miss_reason,
    }


def _safetensors_entry(store: ArtifactStore, numel: int) -> Path:
    def build(folder: Path | None) -> None:
        assert folder is not None
        save_file({"w": torch.arange(numel, dtype=torch.float32)}, str(folder / "w.safetensors"))

    return store.fetch(SPEC, {"n": numel}, group="m", build=build, load=lambda f: None).path  # type: ignore[return-value]


def test_quick_check_reads_headers_full_check_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend 4 KiB is "large" so a 64 KiB file gets the large-file treatment (real default: 8 MiB).
    monkeypatch.setattr(mf, "WHOLE_HASH_LIMIT", 4096)
    store = ArtifactStore(tmp_path)
    entry = _safetensors_entry(store, 16384)
    f = entry / "w.safetensors"
    assert mf.read_manifest(entry).files["w.safetensors"].quick.startswith("st-header:")
    (header_len,) = struct.unpack("<Q", f.read_bytes()[:8])
    data = bytearray(f.read_bytes())
    data[8 + header_len + 1000] ^= 1  # a flipped bit in a tensor
    f.write_bytes(bytes(data))
    assert store.check_entry(entry, SPEC, mode="quick")[1] is None  # the documented limit of the quick check
    assert "sha256 differs" in (store.check_entry(entry, SPEC, mode="full")[1] or "")
    data[8 + header_len + 1000] ^= 1
    data[20] ^= 1  # a flipped bit in the header (names, shapes, offsets)
    f.write_bytes(bytes(data))
    assert "checksum differs" in (store.check_entry(entry, SPEC, mode="quick")[1] or "")


def test_small_files_are_hashed_whole_even_on_a_quick_check(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    entry = _safetensors_entry(store, 1024)
    f = entry / "w.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 1
    f.write_bytes(bytes(data))
    assert "checksum differs" in (store.check_entry(entry, SPEC, mode="quick")[1] or "")


def test_verify_mode_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mf.VERIFY_ENV, "full")
    assert ArtifactStore("x").verify == "full"
    monkeypatch.setenv(mf.VERIFY_ENV, "paranoid")
    with pytest.raises(ValueError, match="GLOWPLUG_CACHE_VERIFY='paranoid' .* use quick"):
        ArtifactStore("x")


def _traced() -> tuple[object, trace.Span]:
    tracing = setup_tracing(in_memory=True)
    return tracing, tracing.tracer().start_span("glowplug.startup.test")


def test_a_failing_load_makes_a_damaged_entry_that_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    calls: list[Path | None] = []
    store.fetch(SPEC, {"a": 1}, group="m", build=_text_build("good", calls), load=_load)

    def picky(folder: Path) -> str:
        text = _load(folder)
        if len(calls) == 1:
            raise ValueError("cannot parse this")
        return text

    tracing, span = _traced()
    with trace.use_span(span, end_on_exit=True):
        got = store.fetch(SPEC, {"a": 1}, group="m", build=_text_build("good", calls), load=picky)
    assert not got.hit and got.value == "good" and len(calls) == 2
    assert "cannot be loaded (ValueError: cannot parse this)" in got.miss_reason
    (ev,) = [e for s in tracing.finished_spans() for e in s.events]  # type: ignore[attr-defined]
    assert ev.name == Event.CACHE_CORRUPT and ev.attributes[Attr.CACHE_PATH] == str(got.path)
    assert "moved aside" in ev.attributes[Attr.CACHE_ACTION]
    assert len(list((tmp_path / ".quarantine").iterdir())) == 1


def test_a_crashed_writers_temporary_folder_is_cleaned_up(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    key = store.key(SPEC, {"a": 1})
    stale = tmp_path / "quant" / f".tmp-{key}-crashed"
    stale.mkdir(parents=True)
    (stale / "data.txt").write_text("half")
    store.fetch(SPEC, {"a": 1}, group="m", build=_text_build("whole", []), load=_load)
    assert not stale.exists()


def test_put_replaces_and_reports_a_damaged_previous_entry(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    first = store.put(SPEC, {"a": 1}, group="m", build=_text_build("v1", []))
    (first.path / "data.txt").write_text("garbage!")  # type: ignore[operator]
    second = store.put(SPEC, {"a": 1}, group="m", build=_text_build("v2", []))
    assert second.path == first.path and _load(second.path) == "v2"  # type: ignore[arg-type]
    assert second.corrupt and "data.txt" in second.corrupt[0]


def test_workspace_heals_damaged_files_and_stale_manifests(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    ws = open_workspace(store, SPEC, {"torch": "t"}, group="cpu")
    (ws.path / "a").mkdir()
    (ws.path / "a" / "k.so").write_bytes(b"\x7fELF" + b"x" * 1000)
    (ws.path / "b.py").write_text("print('hi')")
    seal(store, ws)
    assert set(mf.read_manifest(ws.path).files) == {"a/k.so", "b.py"}
    (ws.path / "a" / "k.so").write_bytes(b"\x7fELF")  # truncated
    tracing, span = _traced()
    with trace.use_span(span, end_on_exit=True):
        again = open_workspace(store, SPEC, {"torch": "t"}, group="cpu")
    assert again.path == ws.path and not (ws.path / "a" / "k.so").exists() and (ws.path / "b.py").exists()
    assert again.healed and "1 of 2 files damaged: k.so is 4 bytes" in again.healed[0]
    assert set(mf.read_manifest(ws.path).files) == {"b.py"}
    (ev,) = [e for s in tracing.finished_spans() for e in s.events]  # type: ignore[attr-defined]
    assert ev.name == Event.CACHE_CORRUPT and ev.attributes[Attr.CACHE_PATH] == str(ws.path)
    (ws.path / "manifest.json").write_text("{}")
    fresh = open_workspace(store, SPEC, {"torch": "t"}, group="cpu")
    assert fresh.healed and "malformed" in fresh.healed[0] and list(fresh.path.iterdir()) == []


# ---------------------------------------------------------------- an unusable cache dir


def test_a_file_as_cache_dir(tmp_path: Path) -> None:
    root = tmp_path / "cachefile"
    root.write_text("not a folder")
    store = ArtifactStore(root)
    calls: list[Path | None] = []
    got = store.fetch(SPEC, {"a": 1}, group="m", build=_text_build("v", calls), load=_load)
    assert got.value == "v" and calls == [None] and got.path is None
    assert got.bypassed and got.miss_reason == "cache dir unusable: is a file, not a folder"
    with pytest.raises(CacheDirUnusable) as err:
        store.fetch(STRICT, {"a": 1}, group="m", build=_text_build("v", calls), load=_load)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"GLOWPLUG_CACHE_DIR={root} is a file") and "fix: point" in line
    assert store.lookup(SPEC, {"a": 1}, group="m", load=_load).value is None


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
    ],
)
def test_a_full_disk_while_writing(tmp_path: Path, error: Exception) -> None:
    store = ArtifactStore(tmp_path)
    calls: list[Path | None] = []

    def build(folder: Path | None) -> str:
        calls.append(folder)
        if folder is not None:
            (folder / "part").write_text("x")
            raise error
        return "computed"

    got = store.fetch(SPEC, {"a": 1}, group="m", build=build, load=_load)
    assert got.value == "computed" and calls[-1] is None and "full disk" in (got.miss_reason or "")
    assert not [p for p in (tmp_path / "quant").iterdir() if p.name != ".locks"], "the half-written entry is gone"
    with pytest.raises(CacheDirUnusable, match=r"is on a full disk .*; fix: free space"):
        store.fetch(STRICT, {"a": 1}, group="m", build=build, load=_load)


# ---------------------------------------------------------------- glowplug cache ls | verify | prune


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from glowplug.cli import main

    rc = main(["cache", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cache_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GLOWPLUG_CACHE_DIR", str(tmp_path))
    store = ArtifactStore(tmp_path)
    old = store.fetch(SPEC, {"a": 1}, group="m", build=_text_build("old", []), load=_load).path
    new = store.fetch(SPEC, {"a": 2}, group="m", build=_text_build("new", []), load=_load).path
    assert old is not None and new is not None
    two_days_ago = time.time() - 2 * 86400
    os.utime(old / "manifest.json", (two_days_ago, two_days_ago))
    (tmp_path / "models").mkdir()  # an older glowplug's layout

    rc, out, _ = _cli(capsys, "ls", "--json")
    items = {i["key"]: i for i in json.loads(out)["items"]}
    assert rc == 0 and items[old.name]["factors"] == {"a": 1} and items[old.name]["size_bytes"] > 0
    assert items[old.name]["last_used"].startswith(time.strftime("%Y-%m-%d", time.gmtime(two_days_ago)))
    assert items["models"]["kind"] == "foreign"
    rc, out, _ = _cli(capsys, "ls")
    assert rc == 0 and old.name in out and "a=1" in out

    rc, out, _ = _cli(capsys, "verify", "--json")
    assert rc == 0 and all(i["ok"] for i in json.loads(out)["items"])
    (new / "data.txt").write_text("NEW")  # same size, other bytes
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 1 and "checksum differs" in out and "1 damaged" in out

    rc, out, _ = _cli(capsys, "prune", "--older-than", "1d", "--dry-run")
    assert rc == 0 and "would remove 1 item" in out and old.exists()
    rc, out, _ = _cli(capsys, "prune", "--older-than", "1d", "--json")
    assert [i["key"] for i in json.loads(out)["removed"]] == [old.name] and not old.exists()
    rc, out, _ = _cli(capsys, "prune", "--corrupt")
    assert rc == 0 and not new.exists() and not (tmp_path / "models").exists()

    rc, _, err = _cli(capsys, "prune", "--older-than", "soon")
    assert rc == 2 and "--older-than" in err and "90s, 30m, 12h, 7d or 2w" in err
    rc, _, err = _cli(capsys, "ls", "--cache", "nope")
    assert rc == 2 and "--cache" in err and "kv_profile" in err
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("GLOWPLUG_CACHE_DIR", str(tmp_path / "a-file"))
    rc, _, err = _cli(capsys, "ls")
    assert rc == 2 and err.count("\n") == 1 and "GLOWPLUG_CACHE_DIR=" in err and "fix:" in err
