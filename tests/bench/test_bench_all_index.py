"""`glowplug bench all`'s provenance: the dirty-tree refusal, the one-run index, the commit on every report header,
and the screenshots step's reason when it cannot run."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from glowplug.profiling.bench import all as bench_all
from glowplug.profiling.bench import machine
from glowplug.profiling.bench.all import SIDECAR, STEP_NAMES, BenchAllConfig, DirtyTreeError, Step, StepResult
from glowplug.profiling.bench.machine import COMMIT_ENV, DIRTY_ENV, GitState

COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_git_state_sees_tracked_changes_outside_the_out_folder(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "reports").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "reports" / "r.md").write_text("old\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = _git(repo, "rev-parse", "HEAD")
    assert machine.git_state(repo / "reports", repo=repo) == GitState(head, False)
    (repo / "untracked.txt").write_text("build output\n")  # untracked files are not code changes
    (repo / "reports" / "r.md").write_text("rewritten by an earlier chunk\n")
    assert machine.git_state(repo / "reports", repo=repo) == GitState(head, False)
    assert machine.git_state(None, repo=repo).dirty  # without the exclusion the rewritten report counts
    (repo / "code.py").write_text("x = 2\n")
    assert machine.git_state(repo / "reports", repo=repo) == GitState(head, True)
    # An out folder outside the repository: git refuses such a pathspec; the state must still be measured (dirty).
    assert machine.git_state(tmp_path / "elsewhere", repo=repo) == GitState(head, True)
    assert len(head) == 40


def _fake_run(monkeypatch: pytest.MonkeyPatch, state: GitState, calls: list[dict[str, Any]]) -> None:
    """run_all without child processes: the git state is `state`, each step 'runs' in no time and succeeds."""
    monkeypatch.setattr(machine, "git_state", lambda exclude=None, repo=None: state)
    from glowplug.base.machine import ProbeStats

    monkeypatch.setattr(
        machine,
        "measure_probe_stats",
        lambda passes=7, size_bytes=None: ProbeStats((12.0, 12.5, 13.0), 1 << 30, 32 << 20),
    )

    def run_step(
        step: Step, timeout_s: float, log: Path, out: Path, run_env: dict[str, str] | None = None
    ) -> StepResult:
        calls.append({"name": step.name, "env": dict(run_env or {})})
        return StepResult(step, 0, 1.0, 0.5)

    monkeypatch.setattr(bench_all, "run_step", run_step)


def test_dirty_tree_is_refused_unless_allowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict[str, Any]] = []
    _fake_run(monkeypatch, GitState(COMMIT_A, True), calls)
    out = tmp_path / "out"
    cfg = BenchAllConfig(out=out, only=("accuracy", "kernels"))
    with pytest.raises(DirtyTreeError, match="--allow-dirty"):
        bench_all.run_all(cfg)
    assert not out.exists() and calls == []  # nothing ran, nothing written
    assert bench_all.main(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "commit it, or pass --allow-dirty" in err

    allowed = BenchAllConfig(out=out, only=("accuracy", "kernels"), allow_dirty=True)
    bench_all.run_all(allowed)
    # Every report process is told the one state measured at the start.
    assert [c["env"] for c in calls] == [{COMMIT_ENV: COMMIT_A, DIRTY_ENV: "1"}] * 2
    readme = (out / "README.md").read_text()
    assert "## Run — **DIRTY RUN" in readme and f"`{COMMIT_A}` (with uncommitted changes: **DIRTY RUN**)" in readme
    rows = [ln for ln in readme.splitlines() if ln.startswith("| ") and "[" in ln.split("|")[2]]
    assert len(rows) == 2 and all("DIRTY RUN" in r for r in rows)


def _hexes(text: str) -> list[str]:
    return re.findall(r"`([0-9a-f]{7,})`", text)


def test_index_lists_one_run_and_warns_when_chunks_mix_commits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # An older index with a report that a full run must drop.
    (out / SIDECAR).write_text(
        json.dumps({"run": {"commit": "f" * 40, "dirty": False}, "entries": {"serve": {"commit": "f" * 40}}})
    )
    calls: list[dict[str, Any]] = []
    _fake_run(monkeypatch, GitState(COMMIT_A, False), calls)
    bench_all.run_all(BenchAllConfig(out=out, quick=True, skip=("serve",)), ["bench", "all", "--quick"])
    side = json.loads((out / SIDECAR).read_text())
    assert side["run"]["commit"] == COMMIT_A and "serve" not in side["entries"]  # fresh: the old history is gone
    assert len(side["entries"]) == len(STEP_NAMES) - 1
    readme = (out / "README.md").read_text()
    assert "MIXED" not in readme and readme.count("## Run") == 1 and "12.5 GB/s" in readme
    assert _hexes(readme) == [COMMIT_A]  # the full commit, once, in the run's header

    # A chunk at the same clean commit joins the run.
    bench_all.run_all(BenchAllConfig(out=out, quick=True, only=("serve",)), ["bench", "all", "--only", "serve"])
    side = json.loads((out / SIDECAR).read_text())
    assert set(side["entries"]) == set(STEP_NAMES) and "--only" not in side["run"]["command"]
    assert "MIXED" not in (out / "README.md").read_text()

    # A chunk at another commit: the index says so at its top and names each report's full commit.
    _fake_run(monkeypatch, GitState(COMMIT_B, False), calls)
    bench_all.run_all(BenchAllConfig(out=out, quick=True, only=("kernels",)), ["bench", "all", "--only", "kernels"])
    readme = (out / "README.md").read_text()
    head, _, rest = readme.partition("## Run")
    assert "MIXED INDEX" in head and "2 different runs" in head
    listed = dict(re.findall(r"^> - ([\w-]+): `([0-9a-f]+)`", head, re.M))
    assert listed == {n: (COMMIT_B if n == "kernels" else COMMIT_A) for n in STEP_NAMES}
    assert f"- commit: `{COMMIT_B}`" in rest  # the newest chunk is the index's run
    rows = {ln.split(" | ")[1]: ln for ln in rest.splitlines() if ln.startswith("| ") and "[" in ln}
    assert f"OTHER RUN: `{COMMIT_A}`" in rows["[accuracy.md](accuracy.md)"]
    assert "OTHER RUN" not in rows["[kernels.md](kernels.md)"]
    assert all(len(h) == 40 for h in _hexes(readme))  # never cut


def test_older_sidecar_format_reads_as_a_mixed_index(tmp_path: Path) -> None:
    (tmp_path / SIDECAR).write_text(
        json.dumps(
            {
                "invocations": [
                    {"command": "glowplug bench all", "commit": COMMIT_A, "date": "d1", "probe_gbps": 9.0, "probe": "p"}
                ],
                "entries": {
                    "accuracy": {"commit": COMMIT_A},
                    "serve": {"commit": f"{COMMIT_B} (with uncommitted changes)"},
                },
            }
        )
    )
    side = bench_all.load_sidecar(tmp_path)
    assert side["run"]["commit"] == COMMIT_A and side["entries"]["accuracy"]["run"] == side["run"]
    assert side["entries"]["serve"]["run"]["commit"] == COMMIT_B and side["entries"]["serve"]["dirty"]


def test_report_header_prints_the_commit_it_was_handed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMMIT_ENV, COMMIT_B)
    monkeypatch.setenv(DIRTY_ENV, "1")
    machine.report_git_state.cache_clear()
    header = machine.report_header("T", ["bench", "x"])
    assert f"- commit: {COMMIT_B} (with uncommitted changes: DIRTY RUN)" in header.splitlines()
    monkeypatch.setenv(DIRTY_ENV, "0")
    machine.report_git_state.cache_clear()
    assert f"- commit: {COMMIT_B}" in machine.report_header("T", ["bench", "x"]).splitlines()
    # Run by hand (no run handed one down): the checkout's own HEAD.
    monkeypatch.delenv(COMMIT_ENV)
    machine.report_git_state.cache_clear()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=Path(machine.__file__).resolve().parent, capture_output=True, text=True
    ).stdout.strip()
    line = next(ln for ln in machine.report_header("T", []).splitlines() if ln.startswith("- commit: "))
    assert line.removeprefix("- commit: ").split(" ")[0] == head
    machine.report_git_state.cache_clear()


def test_screenshots_without_a_browser_fail_with_the_reason_in_the_index(tmp_path: Path) -> None:
    """The real subcommand in a child process with no chromium on PATH: exit 2, the reason in screenshots.json and
    in the index row (not a silently stale png)."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    step = next(s for s in bench_all.plan_steps(BenchAllConfig(out=out, quick=True), ["screenshots"]))
    env_step = Step(
        step.name, step.argv, step.outputs, step.what, {"PATH": str(tmp_path / "no-bin"), "GLOWPLUG_CHROMIUM": ""}
    )
    r = bench_all.run_step(env_step, 120, out / "logs" / "screenshots.log", out, GitState(COMMIT_A, False).env())
    assert r.returncode == 2 and r.error is not None and "no chromium found" in r.error
    record = json.loads((out / "screenshots" / "screenshots.json").read_text())
    assert record["commit"] == COMMIT_A and record["files"] == [] and "no chromium" in record["error"]
    run = {"command": "c", "commit": COMMIT_A, "dirty": False, "date": "d", "machine": "m", "probe_gbps": None}
    side = {"run": run, "entries": {"screenshots": bench_all.entry_of(r, True, "now", run)}}
    readme = bench_all.render_readme(BenchAllConfig(out=out, quick=True), side)
    assert "no chromium found" in next(ln for ln in readme.splitlines() if "screenshots.json" in ln)


def test_a_step_without_its_input_is_listed_as_skipped_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[dict[str, Any]] = []
    _fake_run(monkeypatch, GitState(COMMIT_A, False), calls)
    out = tmp_path / "out"
    results = bench_all.run_all(BenchAllConfig(out=out, only=("gemma-startup", "cache-verify")))
    assert [c["name"] for c in calls] == ["cache-verify"]  # the Gemma step did not run
    assert bench_all.main(BenchAllConfig(out=out, only=("gemma-startup",))) == 0  # a skip is not a failure
    assert results[0].error == "skipped: no Gemma 3 GGUF given: pass --gemma3-gguf PATH"
    row = next(ln for ln in (out / "README.md").read_text().splitlines() if "gemma-startup/startup.md" in ln)
    assert "skipped: no Gemma 3 GGUF given: pass --gemma3-gguf PATH" in row

    gguf = tmp_path / "gemma.gguf"
    with pytest.raises(ValueError, match="no file at .*leave --gemma3-gguf out"):
        BenchAllConfig(out=out, gemma3_gguf=gguf)
    gguf.write_bytes(b"GGUF")
    bench_all.run_all(BenchAllConfig(out=out, only=("gemma-startup",), gemma3_gguf=gguf))
    assert calls[-1]["name"] == "gemma-startup"
    step = bench_all.plan_steps(BenchAllConfig(out=out, gemma3_gguf=gguf), ["gemma-startup"])[0]
    assert step.skip is None and str(gguf) in step.argv


def test_the_real_size_steps_run_on_real_model_and_skip_with_the_flag_without(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--real-model: startup, tune and decode at a real size run on that file; without it the three are listed as
    skipped with the flag as the fix, and a path that is no file is refused before anything runs."""
    calls: list[dict[str, Any]] = []
    _fake_run(monkeypatch, GitState(COMMIT_A, False), calls)
    out = tmp_path / "out"
    real = ("real-decode", "real-tune", "real-startup")
    results = bench_all.run_all(BenchAllConfig(out=out, only=(*real, "real-decode-7b")))
    assert calls == [] and [r.error for r in results] == [
        "skipped: no real-size model given: pass --real-model PATH",
        "skipped: no synthetic 7B given: pass --synthetic-7b PATH",
        "skipped: no real-size model given: pass --real-model PATH",
        "skipped: no real-size model given: pass --real-model PATH",
    ]
    readme = (out / "README.md").read_text()
    for output in ("real/decode.md", "tune-max-model-len/real/tune.md", "real/startup/startup.md"):
        row = next(ln for ln in readme.splitlines() if output in ln)
        assert "pass --real-model PATH" in row, row

    gguf = tmp_path / "qwen.gguf"
    with pytest.raises(ValueError, match="no file at .*models fetch qwen2.5-coder-1.5b.*leave --real-model out"):
        BenchAllConfig(out=out, real_model=gguf)
    gguf.write_bytes(b"GGUF")
    bench_all.run_all(BenchAllConfig(out=out, only=real, real_model=gguf))
    assert [c["name"] for c in calls] == list(real)
    for step in bench_all.plan_steps(BenchAllConfig(out=out, real_model=gguf), list(real)):
        assert step.skip is None and str(gguf) in step.argv, step
    # The real-size decode holds the run to the targets: every cell they quote, both llama.cpp peers, the check.
    (decode,) = bench_all.plan_steps(BenchAllConfig(out=out, real_model=gguf), ["real-decode"])
    argv = decode.argv
    assert argv[argv.index("--cells") + 1] == "1x64,4x64,16x64,32x64,1x512,1x2048"
    assert argv[argv.index("--peers") + 1] == "llamacpp,llamacpp-batched" and "--targets" in argv
    assert "--invariance" in argv and argv[argv.index("--quantization") + 1] == "auto" and "--dtype" not in argv
    seven = tmp_path / "synthetic-7b.gguf"
    seven.write_bytes(b"GGUF")
    (step,) = bench_all.plan_steps(BenchAllConfig(out=out, synthetic_7b=seven), ["real-decode-7b"])
    assert step.skip is None and str(seven) in step.argv and "--targets" in step.argv
    with pytest.raises(ValueError, match="no file at .*leave --synthetic-7b out"):
        BenchAllConfig(out=out, synthetic_7b=tmp_path / "none.gguf")
