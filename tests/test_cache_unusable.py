"""An unusable GLOWPLUG_CACHE_DIR (a file, read-only, a full disk), through the real CLI.

The caches that only save time run without it: the start reaches READY (exit 0) with one warning line that names
GLOWPLUG_CACHE_DIR and the fix. The converted-model cache cannot (see engine/artifacts/caches.py): a start that
needs a conversion stops with one line naming GLOWPLUG_CACHE_DIR and the fix (exit 1, state FAILED).

A read-only cache dir that holds what a start needs (a container image layer, a shared mount) is a warm start:
every cache hits, Inductor loads its stored kernels, nothing is written and nothing is said.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from glowplug.profiling.names import Attr

TESTS = Path(__file__).parent
# The real CLI, with the GGUF conversion stood in for by a copy of a tiny checkpoint (the real one takes 25 s).
FAKE_CONVERT_CLI = (
    "import sys, pathlib, cache_faults_util as u; u.install_fake_converter(pathlib.Path(sys.argv[1])); "
    "from glowplug.cli import main; raise SystemExit(main(sys.argv[2:]))"
)


def _cli(
    *args: str, cache: Path, tiny_for_gguf: Path | None = None, wrap: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = (
        [sys.executable, "-c", FAKE_CONVERT_CLI, str(tiny_for_gguf)]
        if tiny_for_gguf is not None
        else [sys.executable, "-m", "glowplug.cli"]
    )
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
    # --kv-profile measure: the KV profile is one of the caches that must run without the dir.
    return (
        "startup",
        model,
        "--compile",
        "off",
        "--quantization",
        "int8",
        "--kv-profile",
        "measure",
        "--report-out",
        str(report),
    )


# ---------------------------------------------------------------- a file


def test_cache_dir_is_a_file(tiny_dir, gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("")
    r = tmp_path / "r.json"
    _check_bypassed(_cli(*_startup(str(tiny_dir("llama")), r), cache=cache), cache, "is a file, not a folder", r)
    _check_failed(
        _cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama")), cache, "is a file, not a folder"
    )
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
        if (
            shutil.which("chattr") is None
            or subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True).returncode != 0
        ):
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
        _check_failed(
            _cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama")), cache, "is read-only"
        )


def test_read_only_cache_dir_still_serves_its_entries(tiny_dir, gguf: Path, tmp_path: Path) -> None:
    """A read-only cache that already holds the converted model (a baked container image, say) still works, and
    starts exactly as a warm start with a writable cache does: the same hits, the same notes, no cache event."""
    cache = tmp_path / "baked"
    r = tmp_path / "r.json"
    for _ in range(2):  # fill the cache, then a warm start with it writable: the notes to expect
        proc = _cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama"))
        assert proc.returncode == 0, proc.stderr
    expected = _notes_without_memory(r)
    with _read_only(cache):
        proc = _cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama"))
        assert proc.returncode == 0, proc.stderr
        attrs = json.loads(r.read_text())["attributes"]
        for row in ("model_prepare", "quantize_weights"):
            assert attrs[row]["glowplug.cache_hit"] is True, row
        # Everything was a hit, the start-up profile included: its rewrite after READY is skipped silently.
        assert _notes_without_memory(r) == expected
        assert not _lines(proc.stderr, cache), proc.stderr


def _notes_without_memory(report: Path) -> dict[str, list[str]]:
    """The start's notes per row, less the warmup row's memory at READY (a measurement, not a cache event)."""
    notes = json.loads(report.read_text())["notes"]
    return {k: [n for n in v if not n.startswith("peak RSS")] for k, v in notes.items()}


# ---------------------------------------------------------------- a read-only mount, compiled


def _read_only_mount(path: Path) -> list[str]:
    """A command prefix running the rest in a private mount namespace where `path` is a read-only bind mount of
    itself. A read-only mount stops root too (chmod does not), and it is what a container image layer or a shared
    mount is."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = f'mount --bind "{path}" "{path}" && mount -o remount,bind,ro "{path}" && exec "$@"'
    probe = subprocess.run(
        [*unshare, "sh", "-c", script, "sh", "sh", "-c", f'! touch "{path}/.probe" 2>/dev/null'],
        capture_output=True,
        text=True,
    )
    (path / ".probe").unlink(missing_ok=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.strip() or 'it stayed writable'}")
    return [*unshare, "sh", "-c", script, "sh"]


# What strace shows of a write into the cache dir: these calls name the path they change (the first quoted one;
# symlink's is its last, and a link from the private Inductor folder to a stored file changes nothing stored).
_MUTATING = (
    "mkdir",
    "mkdirat",
    "rmdir",
    "unlink",
    "unlinkat",
    "rename",
    "renameat",
    "renameat2",
    "utimensat",
    "truncate",
    "chmod",
    "fchmodat",
    "chown",
    "fchownat",
    "link",
    "linkat",
    "symlink",
    "symlinkat",
)
_OPEN_FOR_WRITING = re.compile(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC")


def _strace(log: Path) -> list[str]:
    """strace's prefix logging every open and every call that changes a file, or [] where strace cannot run."""
    if (
        shutil.which("strace") is None
        or subprocess.run(["strace", "-f", "-o", os.devnull, "true"], capture_output=True).returncode != 0
    ):
        return []
    return ["strace", "-f", "-qq", "-o", str(log), "-e", f"trace=open,openat,creat,{','.join(_MUTATING)}"]


def _write_attempts(log: Path, root: Path) -> list[str]:
    attempts = []
    for line in log.read_text().splitlines():
        m = re.match(r"^\d+\s+(\w+)\((.*)", line)
        if m is None:
            continue  # a call's result line (`<... openat resumed>`) names no path
        call, rest = m.groups()
        paths = re.findall(r'"([^"]*)"', rest)
        if call in ("open", "openat", "creat"):
            changed = paths[:1] if call == "creat" or _OPEN_FOR_WRITING.search(rest) else []
        elif call in ("symlink", "symlinkat"):
            changed = paths[-1:]
        else:
            changed = paths
        if any(p == str(root) or p.startswith(f"{root}/") for p in changed):
            attempts.append(line)
    return attempts


COMPILED = ("--compile", "on", "--quantization", "int8", "--max-num-seqs", "4", "--kv-profile", "measure")


def test_read_only_mount_starts_warm(tiny_dir, gguf: Path, tmp_path: Path) -> None:
    """A cache dir filled by a cold compiled start, then mounted read-only: every cache hits, the compile rows
    load the stored step and kernels (no kernel rebuilt), no write is attempted in the dir and nothing is said."""
    cache, cold_r, r = tmp_path / "image-layer", tmp_path / "cold.json", tmp_path / "r.json"
    cold = _cli(
        "startup", str(gguf), *COMPILED, "--report-out", str(cold_r), cache=cache, tiny_for_gguf=tiny_dir("llama")
    )
    assert cold.returncode == 0, cold.stderr
    wrap = _read_only_mount(cache)
    cold_attrs = json.loads(cold_r.read_text())["attributes"]
    assert cold_attrs["graph_compile_general_shape"][Attr.COMPILE_REPLAY] == "written", cold_attrs
    log = tmp_path / "strace.log"
    traced = _strace(log)
    proc = _cli(
        "startup",
        str(gguf),
        *COMPILED,
        "--report-out",
        str(r),
        cache=cache,
        tiny_for_gguf=tiny_dir("llama"),
        wrap=[*wrap, *traced],
    )
    assert proc.returncode == 0, proc.stderr
    assert not [ln for ln in proc.stderr.splitlines() if "GLOWPLUG_CACHE_DIR" in ln], proc.stderr
    report = json.loads(r.read_text())
    attrs, notes = report["attributes"], report["notes"]
    for row in ("model_prepare", "quantize_weights", "native_kernels", "dynamo_transform_time", "kv_cache_profiling"):
        assert attrs[row][Attr.CACHE_HIT] is True, (row, attrs[row])
    # The compile rows: the stored step, replayed from its plan over the stored kernels; nothing compiled.
    assert report["phases"]["graph_compile_general_shape"] is None, report["phases"]
    assert report["reasons"]["graph_compile_general_shape"] == "cache hit"
    compiled = attrs["graph_compile_cached"]
    assert compiled[Attr.CACHE_HIT] is True and compiled["glowplug.kernels_built"] == 0, compiled
    assert compiled[Attr.COMPILE_REPLAY] == "loaded", compiled
    assert compiled[Attr.COMPILE_CACHE_READ_ONLY_SOURCE].startswith(str(cache / "inductor")), compiled
    # No cache event of any kind: every row's note is a plain hit (the native row also names its ISA level).
    events = [n for ns in notes.values() for n in ns if n.startswith(("cache_unusable", "cache_corrupt"))]
    assert not events, notes
    if traced:
        assert not _write_attempts(log, cache), _write_attempts(log, cache)


def test_read_only_mount_miss_runs_uncached(tiny_dir, tmp_path: Path) -> None:
    """An empty read-only cache dir: everything is a miss that cannot be stored; the start compiles into private
    folders and reaches READY with one warning line naming GLOWPLUG_CACHE_DIR."""
    cache, r = tmp_path / "empty-layer", tmp_path / "r.json"
    cache.mkdir()
    proc = _cli(
        "startup", str(tiny_dir("llama")), *COMPILED, "--report-out", str(r), cache=cache, wrap=_read_only_mount(cache)
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "GLOWPLUG_CACHE_DIR" in ln]
    assert f"GLOWPLUG_CACHE_DIR={cache} is read-only" in line and "without caching" in line
    report = json.loads(r.read_text())
    assert report["attributes"]["graph_compile_general_shape"][Attr.CACHE_HIT] is False
    assert any(n.startswith("cache_unusable (compile)") for n in report["notes"]["graph_compile_general_shape"])
    assert not list(cache.iterdir())


# ---------------------------------------------------------------- a full disk


def _full_disk(mountpoint: Path) -> list[str]:
    """A command prefix running the rest in a private mount namespace where `mountpoint` is a full tmpfs."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    script = (
        f'mount -t tmpfs -o size=512k glowplug-full "{mountpoint}" && mkdir "{mountpoint}/cache" && '
        f'(dd if=/dev/zero of="{mountpoint}/fill" bs=4k 2>/dev/null; true) && exec "$@"'
    )
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
    _check_failed(
        _cli(*_startup(str(gguf), r), cache=cache, tiny_for_gguf=tiny_dir("llama"), wrap=wrap),
        cache,
        "is on a full disk",
    )
