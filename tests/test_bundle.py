"""The ready-engine bundle, through the real CLI in fresh processes: create, start from it in an empty cache dir
(same tokens as a start without it, nothing compiled, traced or profiled), and the fault matrix (a truncated file,
a flipped byte in each entry kind, entries made for another torch by another glowplug version, a file that is not
a bundle). Every fault but the last gives READY; the last is refused in one line."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.bundle import HEADER, HEADER_SUM, NotABundle, install_bundle, read_header
from glowplug.base.artifacts.caches import by_name
from glowplug.profiling.names import Attr

# A compiled, quantized start of the tiny checkpoint: every cache of a start is then in the bundle.
FLAGS = ("--compile", "on", "--quantization", "int8", "--max-num-seqs", "4")
PROMPT = "The scheduler"
# The KV peak is analytic on the CPU (no kv_profile entry); the rest is what a compiled int8 start stores.
ENTRY_KINDS = ("quant", "compile", "inductor", "startup_profile", "source", "native")


def _cli(*args: str, cache: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "glowplug.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GLOWPLUG_CACHE_DIR": str(cache), **(env or {})},
    )


@pytest.fixture(scope="module")
def made(tiny_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "tiny.glowplug"
    proc = _cli(
        "bundle",
        "create",
        str(tiny_dir("llama")),
        *FLAGS,
        "--out",
        str(out),
        cache=tmp_path_factory.mktemp("unused-cache"),
    )
    assert proc.returncode == 0, proc.stderr
    return out


def _report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _start(bundle: Path, cache: Path, report: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = _cli("startup", "--bundle", str(bundle), "--report-out", str(report), *extra, cache=cache, env=env)
    assert proc.returncode == 0, proc.stderr
    return _report(report)


def _members(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(bundle, "r:") as tar:
        return [(m, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]


def _write(out: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def _largest_file_of(members: list[tuple[tarfile.TarInfo, bytes]], cache: str) -> int:
    """Index of the largest member of the first entry of `cache` (what that entry exists for)."""
    prefix = f"entries/{cache}/"
    found = [(len(d), i) for i, (m, d) in enumerate(members) if m.name.startswith(prefix)]
    assert found, f"the bundle holds no {cache} entry"
    return max(found)[1]


def _flip(data: bytes, at: int | None = None) -> bytes:
    i = len(data) // 2 if at is None else at
    return data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :]


def test_round_trip_starts_warm_with_the_same_tokens(
    made: Path, tiny_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """A fresh cache dir and a fresh process: every cache row is a hit from the bundle, nothing is compiled,
    traced or profiled, and the greedy tokens equal those of a start without the bundle."""
    cache = tmp_path / "fresh"
    report = _start(made, cache, tmp_path / "r.json")
    attrs, notes, phases = report["attributes"], report["notes"], report["phases"]
    for row in ("quantize_weights", "dynamo_transform_time"):
        assert attrs[row][Attr.CACHE_HIT] is True, (row, attrs[row])
        assert attrs[row][Attr.CACHE_FROM_BUNDLE] == made.name, (row, attrs[row])
    assert phases["graph_compile_general_shape"] is None, phases
    compiled = attrs["graph_compile_cached"]
    assert compiled[Attr.CACHE_HIT] is True and compiled["glowplug.kernels_built"] == 0, compiled
    assert report["reasons"]["graph_compile_general_shape"] == f"cache hit from bundle {made.name}"
    install = attrs["bundle_install"]
    assert install["glowplug.bundle.damaged"] == 0 and install["glowplug.bundle.installed"] >= len(ENTRY_KINDS)
    assert attrs["kv_cache_profiling"]["glowplug.kv_profile"] == "analytic", attrs["kv_cache_profiling"]
    assert notes["bundle_install"][0].startswith(f"{made.name}: "), notes["bundle_install"]
    events = [n for ns in notes.values() for n in ns if n.startswith(("cache_unusable", "cache_corrupt"))]
    assert not events, notes
    # The first ETA comes from the warm start `bundle create` recorded.
    assert "warm start of this config" in str(attrs["actual_total_time"].get(Attr.ETA_BASIS, "")), attrs

    with_bundle = _cli(
        "generate",
        "--bundle",
        str(made),
        PROMPT,
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--quiet",
        cache=tmp_path / "fresh2",
    )
    without = _cli(
        "generate",
        str(tiny_dir("llama")),
        PROMPT,
        *FLAGS,
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--quiet",
        cache=tmp_path / "own",
    )
    assert with_bundle.returncode == 0 and without.returncode == 0, (with_bundle.stderr, without.stderr)
    assert with_bundle.stdout == without.stdout and PROMPT in with_bundle.stdout


def test_a_flipped_byte_in_each_entry_kind_is_a_miss_with_cache_corrupt(made: Path, tmp_path: Path) -> None:
    """Per entry kind (installed in-process): that entry is not installed and says why on a `cache_corrupt`
    event; every other entry is."""
    members = _members(made)
    for kind in ENTRY_KINDS:
        damaged = list(members)
        i = _largest_file_of(damaged, kind)
        damaged[i] = (damaged[i][0], _flip(damaged[i][1]))
        path = _write(tmp_path / f"{kind}.glowplug", damaged)
        report = install_bundle(path, ArtifactStore(tmp_path / f"cache-{kind}"))
        bad = [e for e in report.entries if e.outcome == "damaged"]
        assert [e.cache for e in bad] == [kind], (kind, report.entries)
        assert "sha256 differs" in bad[0].reason, bad
        assert report.count("installed") == len(report.entries) - 1 - report.count("skipped")


def test_every_entry_damaged_still_reaches_ready(made: Path, tiny_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """A flipped byte in every entry at once: each is a miss with its `cache_corrupt` event, the model runs from
    where the bundle says it was made (this machine), and the start rebuilds everything: READY."""
    members = _members(made)
    largest: dict[str, int] = {}
    for i, (m, d) in enumerate(members):
        entry = "/".join(m.name.split("/")[:3])
        if m.name.startswith("entries/") and len(d) > len(members[largest.get(entry, i)][1]) or entry not in largest:
            largest[entry] = i
    for entry, i in largest.items():
        if entry.startswith("entries/"):
            members[i] = (members[i][0], _flip(members[i][1]))
    report = _start(_write(tmp_path / "all.glowplug", members), tmp_path / "cache", tmp_path / "r.json")
    attrs = report["attributes"]
    assert attrs["bundle_install"]["glowplug.bundle.installed"] == 0
    assert attrs["bundle_install"]["glowplug.bundle.model"] == str(tiny_dir("llama"))
    assert attrs["graph_compile_general_shape"][Attr.CACHE_HIT] is False
    assert any("bundle's model file was not installed" in n for n in report["notes"]["bundle_install"])


def test_a_truncated_bundle_installs_what_came_before_the_cut(made: Path, tmp_path: Path) -> None:
    data = made.read_bytes()
    cut = tmp_path / "cut.glowplug"
    members = _members(made)
    source_at = next(i for i, (m, _) in enumerate(members) if m.name.startswith("entries/source/"))
    # Cut inside the model's files: the entries before install, the model and the kernels after do not.
    offset = members[source_at][0].offset_data + 4096
    cut.write_bytes(data[:offset])
    report = _start(cut, tmp_path / "cache", tmp_path / "r.json")
    install = report["attributes"]["bundle_install"]
    assert install["glowplug.bundle.installed"] >= 4 and install["glowplug.bundle.damaged"] >= 2, install
    assert report["attributes"]["dynamo_transform_time"][Attr.CACHE_HIT] is True
    assert any(n.startswith("cache_corrupt (source)") for n in report["notes"]["bundle_install"]), report["notes"]


def _foreign(made: Path, out: Path) -> Path:
    """The bundle as another glowplug version on another torch would have made it: the header says so and the
    compile entry's factors (and so its key) name that torch."""
    members = _members(made)
    header = json.loads(members[0][1])
    header["glowplug"] = "0.0.1"
    header["machine"]["torch"] = header["machine"]["torch"] + ".other"
    header["machine"]["glowplug_source"] = "0" * 16
    renamed: dict[str, str] = {}
    for entry in header["entries"]:
        if entry["cache"] != "compile":
            continue
        factors = entry["manifest"]["factors"]
        factors["torch"] = factors["torch"] + ".other"
        factors["glowplug_source"] = "0" * 16
        key = ArtifactStore.key(by_name("compile"), factors)
        renamed[entry["key"]] = key
        entry["key"] = entry["manifest"]["key"] = key
    text = json.dumps(header).encode()
    out_members = [(members[0][0], text), (members[1][0], hashlib.sha256(text).hexdigest().encode())]
    for info, data in members[2:]:
        parts = info.name.split("/")
        if parts[1] == "compile" and parts[2] in renamed:
            info.name = "/".join([parts[0], parts[1], renamed[parts[2]], *parts[3:]])
        out_members.append((info, data))
    return _write(out, out_members)


def test_entries_for_another_torch_and_glowplug_miss_naming_the_factor(made: Path, tmp_path: Path) -> None:
    bundle = _foreign(made, tmp_path / "foreign.glowplug")
    assert read_header(bundle).glowplug == "0.0.1"
    report = _start(bundle, tmp_path / "cache", tmp_path / "r.json")
    attrs = report["attributes"]
    assert attrs["dynamo_transform_time"][Attr.CACHE_HIT] is False
    why = attrs["dynamo_transform_time"][Attr.CACHE_MISS_REASON]
    assert "torch" in why and ".other" in why and f"entry from bundle {bundle.name}" in why, why
    assert "torch: " in why and " there, " in why, why
    # What holds here still hits: the quantized weights.
    assert attrs["quantize_weights"][Attr.CACHE_HIT] is True


def test_not_a_bundle_is_refused_in_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.glowplug"
    junk.write_bytes(b"GGUF" + bytes(4000))
    proc = _cli("startup", "--bundle", str(junk), cache=tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("glowplug: error: ") and str(junk) in line and "glowplug bundle create" in line
    assert not (tmp_path / "cache").exists()


def test_a_damaged_header_is_refused(made: Path, tmp_path: Path) -> None:
    members = _members(made)
    text = members[0][1]
    members[0] = (members[0][0], text.replace(b'"glowplug":', b'"glowplug" :', 1))
    with pytest.raises(NotABundle, match="fails its checksum"):
        read_header(_write(tmp_path / "h.glowplug", members))
    assert members[1][0].name == HEADER_SUM and members[0][0].name == HEADER


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_a_member_is_copied_and_hashed_with_or_without_the_kernel_copy(
    kernel_copy: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range of the bundle lands byte for byte with hashlib's sha256 of it, whether the file system copies in the
    kernel or not (EXDEV: the copy goes through a buffer); a range the file does not hold is EOFError."""
    import errno

    from glowplug.base.artifacts import bundle as bundle_mod

    if not kernel_copy:

        def no_kernel_copy(*_args: Any) -> int:
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(bundle_mod.os, "copy_file_range", no_kernel_copy)
    data = os.urandom(3 * (1 << 22) + 12345)  # several read chunks and a tail
    src = tmp_path / "b.tar"
    src.write_bytes(data)
    offset, size = 512, len(data) - 1000
    fd = os.open(src, os.O_RDONLY)
    try:
        got = bundle_mod._copy_hashing(fd, offset, size, tmp_path / "out")
        assert (tmp_path / "out").read_bytes() == data[offset : offset + size]
        assert got == (size, hashlib.sha256(data[offset : offset + size]).hexdigest())
        with pytest.raises(EOFError, match="the bundle ends"):
            bundle_mod._copy_hashing(fd, offset, len(data), tmp_path / "cut")
    finally:
        os.close(fd)
