"""The first five minutes, as a new user meets them through the real `glowplug` command: progress while it starts,
settings checked before any heavy work (each error one line naming the flag, the value and a fix that works, within
two CPU-seconds on an empty cache), help that is true, one grammar for every command, and output that fits 80
columns. Each case of the issue is a test here; the server's side (sampling defaults, metric and /startup names)
is in tests/lifecycle/test_first_minutes_server.py."""

from __future__ import annotations

import json
import os
import pty
import re
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glowplug.base.units import ByteSize, format_bytes, parse_byte_size
from glowplug.cli import build_parser, generate_words

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
# CPU-seconds of the whole command: a config error costs about 0.6 here, `import torch` alone 3.5.
CONFIG_ERROR_BUDGET_S = 2.0


def _run(
    *args: str, cache: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """The command's result and the CPU-seconds it used (user + system): the work it did, which a loaded machine
    does not stretch as it stretches the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(  # waits for the child, so that RUSAGE_CHILDREN counts it
        [sys.executable, "-m", "glowplug.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "GLOWPLUG_CACHE_DIR": str(cache), **(env or {})},
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.fixture
def empty_cache(tmp_path: Path) -> Path:
    return tmp_path / "empty-cache"


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("glowplug: error: "), lines[0]
    return lines[0]


# ---------------------------------------------------------------- 1. progress while it starts


def _read_pty(fd: int, until: re.Pattern[str], timeout: float) -> list[tuple[float, str]]:
    """Lines (ANSI codes removed) with the time each arrived, until `until` matches one or `timeout` passes."""
    seen: list[tuple[float, str]] = []
    pending = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536).decode(errors="replace")
        except OSError:
            break
        if not chunk:
            break
        now = time.monotonic()
        pending += chunk
        *done, pending = re.split(r"\n|\x1b\[2K", pending)
        # The live display redraws its spinner line in place: the text so far counts as arrived too.
        for text in [*done, pending]:
            text = ANSI.sub("", text).strip()
            if text and (not seen or seen[-1][1] != text):
                seen.append((now, text))
        if any(until.search(t) for _, t in seen):
            break
    return seen


def test_cold_startup_shows_progress_within_two_seconds_of_the_imports(tmp_path: Path) -> None:
    """On a terminal (a pty), with an empty cache: the first line comes before the heavy imports, and the first
    stage shows up within 2 s of the imports being done. The start is stopped there: the line is what matters."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the real command, as a user types it
        os.environ["GLOWPLUG_CACHE_DIR"] = str(tmp_path / "cold")
        os.execv(sys.executable, [sys.executable, "-m", "glowplug.cli", "startup", "--compile", "off"])
    try:
        lines = _read_pty(fd, re.compile(r"model_prepare"), timeout=240)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
    texts = [t for _, t in lines]
    assert texts and texts[0].startswith("starting smollm2"), texts
    imports = next(i for i, t in enumerate(texts) if t.startswith("imports done in"))
    # A cold cache and no recorded start: the ETA is the start-up model's (its shipped prior), and says so (the
    # terminal wraps the rest of the line).
    assert "the stages should take about" in texts[imports] and "start-up model" in texts[imports], texts[imports]
    stage = next(i for i, t in enumerate(texts) if "model_prepare" in t)
    assert stage > imports and "preparing the model" in texts[stage]
    assert lines[stage][0] - lines[imports][0] <= 2.0, lines


def test_progress_lines_when_piped(tiny_dir, tmp_path: Path) -> None:
    """Piped: plain lines on stderr, one per stage start and end, with the time and the cache outcome; a second
    start of the same config has an ETA per stage; --quiet prints none of it; stdout holds only the table."""
    cache = tmp_path / "cache"
    # --kv-profile measure: the KV profile's cache gives a row whose outcome changes between the two starts.
    first, _ = _run(
        "startup", str(tiny_dir("llama")), "--compile", "off", "--kv-profile", "measure", cache=cache, timeout=300
    )
    assert first.returncode == 0, first.stderr
    err = first.stderr.splitlines()
    assert err[0] == f"glowplug: starting {tiny_dir('llama')}: importing torch and the engine..."
    # The first start of a model already has an ETA per stage, the start-up model's.
    assert any(ln.startswith("glowplug: kv_cache_profiling: sizing the KV cache... (start-up model, ") for ln in err), (
        err
    )
    done = next(ln for ln in err if ln.startswith("glowplug: kv_cache_profiling: done in "))
    assert "(cache miss: first start for this model)" in done and "READY in about" in done
    assert any(ln.startswith("glowplug: graph_compile: skipped (--compile off)") for ln in err), err
    assert "starting" not in first.stdout and "glowplug start-up phases" in first.stdout
    second, _ = _run(
        "startup", str(tiny_dir("llama")), "--compile", "off", "--kv-profile", "measure", cache=cache, timeout=300
    )
    assert second.returncode == 0, second.stderr
    # The ETA says where it comes from: the cold first start predicts the phases whose cache did the same, the
    # start-up model the KV profile, which now hits.
    imports_line = next(ln for ln in second.stderr.splitlines() if "imports done in" in ln)
    assert "the stages should take about" in imports_line and "phase by phase" in imports_line, imports_line
    assert "kv_cache_profiling) from the start-up model" in imports_line, imports_line
    assert any(
        re.fullmatch(r"glowplug: warmup: warming up\.\.\. \((about \d+ s|under a second)\)", ln)
        for ln in second.stderr.splitlines()
    ), second.stderr
    assert "glowplug: kv_cache_profiling: done in" in second.stderr and "(cache hit)" in second.stderr
    quiet, _ = _run(
        "startup",
        str(tiny_dir("llama")),
        "--compile",
        "off",
        "--kv-profile",
        "measure",
        "--quiet",
        cache=cache,
        timeout=300,
    )
    assert quiet.returncode == 0 and not [ln for ln in quiet.stderr.splitlines() if ln != "glowplug: READY"]


# ---------------------------------------------------------------- 2, 3, 7. settings checked before heavy work


def test_max_model_len_beyond_the_model_fails_at_once(empty_cache: Path) -> None:
    proc, cpu_s = _run("startup", "--max-model-len", "999999", cache=empty_cache)
    line = _one_error_line(proc)
    assert proc.returncode == 2 and cpu_s <= CONFIG_ERROR_BUDGET_S, cpu_s
    assert "--max-model-len 999999" in line and "limit of 8192 positions" in line
    assert "use --max-model-len 8192 or less" in line
    assert not empty_cache.exists()  # nothing was converted, profiled or compiled to find this out


def test_kv_memory_too_small_says_what_one_sequence_needs(empty_cache: Path) -> None:
    proc, cpu_s = _run("startup", "--kv-cache-memory", "1", "--max-model-len", "auto", cache=empty_cache)
    line = _one_error_line(proc)
    assert proc.returncode == 2 and cpu_s <= CONFIG_ERROR_BUDGET_S, cpu_s
    # No circular advice: never "--max-model-len 0", but the memory one short sequence needs, as a flag value.
    assert "max-model-len 0" not in line and "--max-model-len auto" not in line
    assert "256 tokens" in line and "raise --kv-cache-memory to 6MiB" in line and "8192 positions need" in line
    # Enough for some but not all of the model's positions: the largest length that fits, or the memory for all.
    proc, _ = _run("startup", "--kv-cache-memory", "100MiB", cache=empty_cache)
    line = _one_error_line(proc)
    assert "room for 4544 tokens" in line and "use --max-model-len 4544 or less" in line
    assert "raise --kv-cache-memory to 180MiB" in line


def test_sizes_take_units_everywhere(empty_cache: Path) -> None:
    for text, value in (
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1G", 1 << 30),
        ("1GB", 10**9),
        ("1.5 gib", 3 << 29),
        ("4096", 4096),
        (4096, 4096),
    ):
        assert parse_byte_size(text) == value, text
    from pydantic import TypeAdapter, ValidationError

    with pytest.raises(ValidationError, match="is not a size; write one such as 2GiB"):
        TypeAdapter(ByteSize).validate_python("lots")
    assert format_bytes(5 << 19) == "2.5 MiB" and format_bytes(1 << 30) == "1 GiB"
    # The same schema behind the flag and a config file: the size parses (the error is the length, not the size).
    cfg = empty_cache.parent / "engine.toml"
    cfg.write_text('kv_cache_memory = "1GiB"\nmax_model_len = 999999\n')
    proc, _ = _run("startup", "--config", str(cfg), cache=empty_cache)
    assert proc.returncode == 2 and "unable to parse" not in proc.stderr and "--max-model-len 999999" in proc.stderr
    proc, _ = _run("startup", "--kv-cache-memory", "1GiBB", cache=empty_cache)
    assert proc.returncode == 2 and "--kv-cache-memory: '1GiBB' is not a size" in proc.stderr


def test_cuda_on_a_cpu_torch_is_one_line_with_the_fix(empty_cache: Path) -> None:
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA: the flag is valid here")
    proc, cpu_s = _run("startup", "--device", "cuda", cache=empty_cache)
    line = _one_error_line(proc)
    assert proc.returncode == 2 and cpu_s <= CONFIG_ERROR_BUDGET_S, cpu_s
    assert "--device cuda" in line and "CPU-only build" in line and "use --device cpu" in line
    assert "AssertionError" not in proc.stderr


def test_bad_report_suffix_is_short(empty_cache: Path) -> None:
    proc, _ = _run("startup", "--report-out", "x.txt", cache=empty_cache)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) <= 3, proc.stderr
    assert lines[0] == "usage: glowplug startup [MODEL] [options]"
    assert (
        lines[1] == "glowplug startup: error: argument --report-out: x.txt: use a file ending in .md or .csv or .json"
    )


def _pty_run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(env)
        os.execv(argv[0], argv)
    out = ""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk.decode(errors="replace")
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out


def test_a_failed_start_is_one_line_on_a_terminal_and_log_then_line_piped(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt-neo"}))
    env = {"GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    code, out = _pty_run([sys.executable, "-m", "glowplug.cli", "startup", str(bad), "--compile", "off"], env, 240)
    lines = [ANSI.sub("", ln).strip() for ln in out.splitlines()]
    failures = [ln for ln in lines if "gpt-neo" in ln]
    assert code == 1 and len(failures) == 1, out  # no log record beside it
    assert failures[0].startswith("glowplug: state FAILED: start-up failed in model_prepare: ModelError:")
    assert "supported model types: llama, mistral, qwen2, qwen3" in failures[0]  # the fix
    piped, _ = _run("startup", str(bad), "--compile", "off", cache=tmp_path / "cache", timeout=240)
    err = [ln for ln in piped.stderr.splitlines() if "gpt-neo" in ln]
    assert piped.returncode == 1 and len(err) == 2
    assert json.loads(err[0])["level"] == "error" and err[1].startswith("glowplug: state FAILED")
    code, out = _pty_run(
        [sys.executable, "-m", "glowplug.cli", "startup", str(bad), "--compile", "off", "--verbose"], env, 240
    )
    assert code == 1 and "Traceback" in out and "glowplug.startup.model_prepare" in out


# ---------------------------------------------------------------- 4. help that is true


def test_help_lists_the_schema_values_and_real_defaults() -> None:
    text = build_parser().format_help()
    assert "import" not in text.lower() and "timestamp" not in text  # nothing for developers at the front door
    sub = {a.dest: a for a in build_parser()._actions if a.dest == "command"}["command"].choices  # type: ignore[attr-defined]
    startup = sub["startup"].format_help()
    for values in (
        "{auto,none,int8,int4,int2,w8a8}",
        "{auto,float32,bfloat16,float16}",
        "{auto,cpu,cuda}",
        "{auto,int8}",
        "{auto,on,off}",
    ):
        assert values in startup, values
    squashed = " ".join(startup.split())
    assert "--max-model-len N|auto" in squashed and "(default: the model's limit (max_position_embeddings))" in squashed
    assert "4096" not in squashed and "--kv-cache-memory SIZE" in squashed
    generate = " ".join(sub["generate"].format_help().split())
    assert "(default: the model's generation config, else 0 = greedy)" in generate
    tune_mml = subprocess.run(
        [sys.executable, "-m", "glowplug.cli", "tune", "max-model-len", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "seed 0" not in tune_mml and "sorted them as text" not in tune_mml


def test_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "glowplug.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and re.fullmatch(r"glowplug \S+ \(torch \S+, python \S+\)\n", proc.stdout)


# ---------------------------------------------------------------- 6. one grammar


def test_list_flags_never_swallow_the_prompt() -> None:
    args, extras = build_parser("generate").parse_known_args(
        ["generate", "--stop", ".", "The capital of France is", "--stop", "!", "--stop-token-ids", "2,3"]
    )
    assert not extras and args.words == ["The capital of France is"]
    assert args.stop == [".", "!"] and args.stop_token_ids == ["2", "3"]
    # A stop string is free text: a comma in it is kept.
    args, _ = build_parser("generate").parse_known_args(["generate", "--stop", "a,b", "hi"])
    assert args.stop == ["a,b"]


def test_the_model_is_positional_or_a_flag_everywhere(tiny_dir, empty_cache: Path) -> None:
    parser = build_parser()
    for command in ("startup", "serve", "models prepare", "bench decode", "tune max-model-len"):
        words = command.split()
        a, _ = parser.parse_known_args([*words, "m1"])
        b, _ = parser.parse_known_args([*words, "--model", "m1"])
        assert (a.model, a.model_option) == ("m1", None) and b.model_option == "m1", command
    model = str(tiny_dir("llama"))
    gen = build_parser("generate")
    assert generate_words(gen.parse_known_args(["generate", model, "hi"])[0]) == (model, ["hi"])
    assert generate_words(gen.parse_known_args(["generate", "smollm2", "hi", "there"])[0]) == (
        "smollm2",
        ["hi", "there"],
    )
    # One word is a prompt, whatever it says; --model makes every word a prompt.
    assert generate_words(gen.parse_known_args(["generate", "smollm2"])[0]) == ("smollm2", ["smollm2"])
    assert generate_words(gen.parse_known_args(["generate", "--model", model, "smollm2", "x"])[0]) == (
        model,
        ["smollm2", "x"],
    )
    assert generate_words(gen.parse_known_args(["generate", "The capital", "of"])[0]) == (
        "smollm2",
        ["The capital", "of"],
    )
    # serve takes --model (it was "unrecognized arguments"): the error here is the setting, found at once.
    proc, cpu_s = _run("serve", "--model", "smollm2", "--max-model-len", "999999", cache=empty_cache)
    assert proc.returncode == 2 and "--max-model-len 999999" in _one_error_line(proc) and cpu_s <= CONFIG_ERROR_BUDGET_S
    proc, _ = _run("startup", "smollm2", "--model", str(tiny_dir("llama")), cache=empty_cache)
    assert proc.returncode == 2 and "the model is given twice" in _one_error_line(proc)


def test_an_error_shows_the_commands_own_short_usage(empty_cache: Path) -> None:
    for argv, usage in (
        (["generate", "hi", "--bogus"], "usage: glowplug generate [MODEL] PROMPT [PROMPT ...] [options]"),
        (["serve", "--bogus"], "usage: glowplug serve [MODEL] [options]"),
        (["cache", "ls", "--bogus"], "usage: glowplug cache ls [options]"),
    ):
        proc, _ = _run(*argv, cache=empty_cache)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 3, proc.stderr
        assert lines[0] == usage and "error: unrecognized arguments: --bogus" in lines[1]
        assert lines[1].startswith(f"glowplug {argv[0]}") and "--help" in lines[2]


# ---------------------------------------------------------------- 8. output that fits


def _check_80(text: str, names: list[str]) -> None:
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    for name in names:  # each name whole on one line: never "graph_compile_general_sh" / "ape"
        assert any(re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", ln) for ln in lines), name


def test_phase_table_fits_80_columns_and_breaks_no_name() -> None:
    from rich.console import Console

    from glowplug.profiling.names import AGGREGATE_ROWS, LEAF_ROWS
    from glowplug.profiling.phases import from_dict, to_rich

    names = [*LEAF_ROWS, *AGGREGATE_ROWS, "unattributed", "overlap", "critical_path", "actual_total_time"]
    kinds = {n: "leaf" for n in LEAF_ROWS} | {n: "aggregate" for n in AGGREGATE_ROWS}
    kinds |= {"unattributed": "leaf", "overlap": "derived", "critical_path": "derived", "actual_total_time": "total"}
    table = from_dict(
        {
            "schema": "1",
            "trace_id": "0" * 32,
            "versions": {"python": "3", "torch": "2", "glowplug": "0"},
            "phases": {n: 1.5 for n in names},
            "kinds": kinds,
            "components": {k: list(v) for k, v in AGGREGATE_ROWS.items()},
            "reasons": {
                "graph_compile_cached": "cache miss: changed: max_num_batched_tokens 2048 -> 1024",
                "critical_path": " -> ".join(LEAF_ROWS),
            },
        }
    )
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    console.print(to_rich(table))
    text = console.export_text()
    _check_80(text, ["Σ torch.compile", *LEAF_ROWS, "actual_total_time"])
    # The aggregate's formula names its rows whole too.
    formula = text.split("Σ torch.compile", 1)[1].split("kv_cache_profiling", 1)[0]
    assert "graph_compile_general_shape" in formula


def test_cache_ls_fits_80_columns_and_honours_columns_when_piped(tmp_path: Path) -> None:
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import COMPILE, STARTUP_PROFILE

    store = ArtifactStore(tmp_path)
    long_factors = {
        "engine_config": {f"field_{i}": i for i in range(20)},
        "device": "cpu",
        "source": {"file": "a-model-with-a-very-long-file-name-Instruct.Q4_K_M.gguf", "size": 123456789},
    }
    for i in range(6):
        store.put(
            STARTUP_PROFILE if i % 2 else COMPILE,
            {**long_factors, "n": i},
            group="SmolLM2-135M-Instruct-with-an-even-longer-name",
            build=lambda f: None,
        )
    line_counts = {}
    for columns in ("80", "160"):
        proc, _ = _run("cache", "ls", cache=tmp_path, env={"COLUMNS": columns})
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        line_counts[columns] = len(lines)
        # Only a path, which is never broken, may be longer than the width (the cache dir under the title).
        assert max(len(ln) for ln in lines if ln.strip() != str(tmp_path)) <= int(columns), max(lines, key=len)
        assert len(lines) <= 3 + 6 * 6, len(lines)  # a few lines per entry (188 lines for 6 entries before)
        keys = [p.name for p in (tmp_path / "compile").iterdir() if not p.name.startswith(".")]
        for key in keys:
            assert any(key in ln for ln in lines), key
        assert "a-model-with-a-very-long-file-name-Instruct.Q4_K_M.gguf" in proc.stdout  # a long value stays whole
    assert line_counts["160"] < line_counts["80"]  # piped, yet COLUMNS decides where the lines wrap
    wide, _ = _run("cache", "ls", "--wide", cache=tmp_path, env={"COLUMNS": "80"})
    assert wide.returncode == 0 and any("field_19" in ln for ln in wide.stdout.splitlines())


def test_quantization_is_checked_against_the_shapes_in_the_first_stage(tmp_path: Path) -> None:
    from glowplug.engine.models.tiny import make_tiny_checkpoint

    odd = make_tiny_checkpoint(tmp_path / "odd", "llama", intermediate_size=40)  # 40 inputs: no group of 32 fits
    proc, _ = _run("startup", str(odd), "--quantization", "int4", "--compile", "off", cache=tmp_path / "c", timeout=300)
    last = proc.stderr.splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("glowplug: error: --quantization int4 (group size 128)"), (
        proc.stderr
    )
    assert "intermediate_size is 40" in last and "use --quantization int8 (per channel, any shape)" in last
    assert "load_weights" not in proc.stderr  # failed in model_prepare, before the weights were read
    # int8 per channel takes any shape: the same model starts.
    ok, _ = _run(
        "startup", str(odd), "--quantization", "int8", "--compile", "off", "--quiet", cache=tmp_path / "c", timeout=300
    )
    assert ok.returncode == 0, ok.stderr
