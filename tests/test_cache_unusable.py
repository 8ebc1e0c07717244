"""An unusable GLOWPLUG_CACHE_DIR (a file, read-only, a full disk), through the real CLI.

The caches that only save time run without it: the start reaches READY (exit 0) with one warning line that names
GLOWPLUG_CACHE_DIR and the fix. The converted-model cache cannot (see engine/artifacts/caches.py): a start that
needs a conversion stops with one line naming GLOWPLUG_CACHE_DIR and the fix (exit 1, state FAILED).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
# The real CLI, with the GGUF conversion stood in for by a copy of a tiny checkpoint (the real one takes 25 s).
FAKE_CONVERT_CLI = (
    "import sys, pathlib, cache_faults_util as u; u.install_fake_converter(pathlib.Path(sys.argv[1])); "
    "from glowplug.cli import main; raise SystemExit(main(sys.argv[2:]))"
)


def _cli(*args: str, cache: Path, tiny_for_gguf: Path | None = None, wrap: list[str] | None = None
         ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    cmd = ([sys.executable, "-c", FAKE_CONVERT_CLI, str(tiny_for_gguf)] if tiny_for_gguf is not None
           else [sys.executable, "-m", "glowplug.cli"])  # fmt: skip
    env = {**os.environ, "GLOWPLUG_CACHE_DIR": str(cache), "PYTHONPATH": str(TESTS)}
    return subprocess.run([*(wrap or []), *cmd, *args], capture_output=True, text=True, timeout=300, env=env)


def _lines(stderr: str, cache: Path) -> list[str]:
    return [ln for ln in stderr.splitlines() if f"GLOWPLUG_CACHE_DIR={cache}" in ln]


def _check_bypassed(proc: subprocess.CompletedProcess[str], cache: Path, problem: str, report: Path) -> None:
    assert proc.returncode == 0, proc.stderr
    (line,) = _lines(proc.stderr, cache)  # one line, however many caches ran without the dir
    assert problem in line and "fix:" in line and "without caching" in line
    notes = json.loads(report.read_text())["notes"]
    assert notes["quantize_weights"][0].startswith("cache_unusable (quant)")
    assert notes["kv_cache_profiling"][0].startswith("cache_unusable (kv_profile)")


def _check_failed(proc: subprocess.CompletedProcess[str], cache: Path, problem: str) -> None:
    assert proc.returncode == 1, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("glowplug: state FAILED")]
    assert "model_prepare" in line and f"GLOWPLUG_CACHE_DIR={cache} {problem}" in line and "; fix: " in line


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "tiny.Q8_0.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return src


def _startup(model: str, report: Path) -> tuple[str, ...]:
    return ("startup", model, "--compile", "off", "--quantization", "int8", "--report-out", str(report))


# ---------------------------------------------------------------- a file


def test_cache_dir_is_a_file(tiny_dir, gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("")
    r = tmp_path / "r.json"
    _check_bypassed(_cli(*_startup(str(tiny_dir("llama")), r), cache=cache), cache, "is a file, not a folder", r)
    _check_failed(_cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama")), cache,
                  "is a file, not a folder")  # fmt: skip
    proc = _cli("cache", "ls", cache=cache)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"glowplug: error: GLOWPLUG_CACHE_DIR={cache} is a file") and "fix:" in proc.stderr


# ---------------------------------------------------------------- read-only


@contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """chmod for an ordinary user; root ignores modes, so there the immutable attribute (chattr +i) stands in."""
    if os.geteuid() != 0:
        for p in [path, *path.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        undo = ["chmod", "-R", "u+w", str(path)]
    else:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "-R", "+i", str(path)],
                                                            capture_output=True).returncode != 0:  # fmt: skip
            pytest.skip("cannot make a folder read-only here (root without chattr support)")
        undo = ["chattr", "-R", "-i", str(path)]
    try:
        try:
            (path / "probe").mkdir()
        except OSError:
            pass
        else:
            pytest.skip("the folder stayed writable")
        yield
    finally:
        subprocess.run(undo, check=False)


def test_cache_dir_is_read_only(tiny_dir, gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "ro-cache"
    cache.mkdir()
    r = tmp_path / "r.json"
    with _read_only(cache):
        _check_bypassed(_cli(*_startup(str(tiny_dir("llama")), r), cache=cache), cache, "is read-only", r)
        _check_failed(_cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama")), cache,
                      "is read-only")  # fmt: skip


def test_read_only_cache_dir_still_serves_its_entries(tiny_dir, gguf: Path, tmp_path: Path) -> None:
    """A read-only cache that already holds the converted model (a baked container image, say) still works."""
    cache = tmp_path / "baked"
    r = tmp_path / "r.json"
    warm = _cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama"))
    assert warm.returncode == 0, warm.stderr
    with _read_only(cache):
        proc = _cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama"))
        assert proc.returncode == 0, proc.stderr
        attrs = json.loads(r.read_text())["attributes"]
        for row in ("model_prepare", "quantize_weights"):
            assert attrs[row]["glowplug.cache_hit"] is True, row
        # Everything was a hit; only the start-up profile (rewritten after READY) could not be stored.
        notes = json.loads(r.read_text())["notes"]
        # (A hit's row is noted "cache hit"; no row has a cache event of its own.)
        assert {k: v for k, v in notes.items() if v != ["cache hit"]}.keys() == {"actual_total_time"}, notes
        assert [n.split(":")[0] for n in notes["actual_total_time"]] == ["cache_unusable (startup_profile)"]


# ---------------------------------------------------------------- a full disk


def _full_disk(mountpoint: Path) -> list[str]:
    """A command prefix running the rest in a private mount namespace where `mountpoint` is a full tmpfs."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    script = (f'mount -t tmpfs -o size=512k glowplug-full "{mountpoint}" && mkdir "{mountpoint}/cache" && '
              f'(dd if=/dev/zero of="{mountpoint}/fill" bs=4k 2>/dev/null; true) && exec "$@"')  # fmt: skip
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.strip()}")
    return ["unshare", "-rm", "sh", "-c", script, "sh"]


def test_cache_dir_on_a_full_disk(tiny_dir, gguf: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "full"
    mnt.mkdir()
    wrap = _full_disk(mnt)
    cache, r = mnt / "cache", tmp_path / "r.json"
    _check_bypassed(_cli(*_startup(str(tiny_dir("llama")), r), cache=cache, wrap=wrap), cache, "is on a full disk", r)
    _check_failed(_cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama"), wrap=wrap), cache,
                  "is on a full disk")  # fmt: skip
