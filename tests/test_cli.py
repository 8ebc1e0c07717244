"""The `glowplug` command as a user runs it: the README's main job, and flag validation."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "glowplug.cli", *args], capture_output=True, text=True, timeout=timeout
    )


LLAMA_CPP_CHAT_REPLY = "L'Étoile, la Marseillaise,"


@pytest.mark.slow
def test_readme_main_job_continues_with_paris(smollm2_dir) -> None:
    proc = _run("generate", "The capital of France is", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris")
    assert "finish_reason=" in proc.stdout


@pytest.mark.slow
def test_chat_and_several_prompts(smollm2_dir) -> None:
    # The default model's greedy chat reply, run in place on its Q4_1 file, is llama.cpp's on the same file
    # (llama-cpp-python 0.3.36, create_chat_completion, temperature 0, 12 tokens).
    proc = _run("generate", "--chat", "What is the capital of France?", "--max-tokens", "12")
    assert proc.returncode == 0 and LLAMA_CPP_CHAT_REPLY in proc.stdout, proc.stdout
    proc = _run("generate", "One", "Two", "--max-tokens", "4", "--n", "2", "--temperature", "0.8")
    assert proc.returncode == 0
    assert proc.stdout.count("completion 0") == 2 and proc.stdout.count("completion 1") == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "--temperature: Input should be greater than or equal to 0"),
        (["--max-model-len", "abc"], "--max-model-len: Input should be a valid integer"),
        (["--block-size", "12"], "--block-size: block_size must be a power of two"),
        (
            ["--quantization", "int3"],
            "--quantization: Input should be 'auto', 'none', 'int8', 'int4', 'int2' or 'w8a8'",
        ),
        (["--top-p", "0"], "--top-p: Input should be greater than 0"),
    ],
)
def test_bad_flags_name_the_flag_and_exit_2(flags: list[str], message: str) -> None:
    proc = _run("generate", "hi", *flags, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def test_config_file_is_validated_by_the_same_schema(tmp_path) -> None:
    cfg = tmp_path / "engine.toml"
    cfg.write_text("max_num_seqs = 0\n")
    proc = _run("generate", "hi", "--config", str(cfg), timeout=60)
    assert proc.returncode == 2 and "--max-num-seqs: Input should be greater than or equal to 1" in proc.stderr
    bad = tmp_path / "engine.yaml"
    bad.write_text("x: 1")
    proc = _run("generate", "hi", "--config", str(bad), timeout=60)
    assert proc.returncode == 2 and "use a .json or .toml file" in proc.stderr


def test_report_flag_rejects_unknown_suffix(tmp_path) -> None:
    proc = _run("startup", "--report-out", str(tmp_path / "table.xlsx"), timeout=60)
    assert proc.returncode == 2 and "use a file ending in .md or .csv or .json" in proc.stderr


def test_kernels_package_is_not_shadowed(tmp_path) -> None:
    """Installed, our code lives under `glowplug.`: a bare `import kernels` must not find it."""
    proc = subprocess.run(
        [sys.executable, "-c", "import glowplug.kernels, importlib.util as u; print(u.find_spec('kernels'))"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "None"


def test_other_commands_do_not_build_the_benchmark_flags() -> None:
    """`glowplug startup` and `serve` skip importing every benchmark's config (a share of their imports row);
    `bench` and `tune` still get every flag, and help still lists every command."""
    code = (
        "import sys; from glowplug import cli; cli.build_parser('startup'); "
        "print(sorted(m for m in sys.modules if m.startswith('glowplug.profiling.bench.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    listed = _run("--help").stdout
    assert "bench" in listed and "tune" in listed
    assert "--batch-sizes" in _run("bench", "decode", "--help").stdout
    assert "max-model-len" in _run("tune", "--help").stdout


def test_predict_only_imports_nothing_it_does_not_use(tmp_path) -> None:
    """`glowplug startup --predict-only` answers within a second: no torch, no server or benchmark modules, no
    other command's flags, and none of what only a failure or a cache write needs (structlog, OpenTelemetry,
    filelock, importlib.metadata). The prediction itself is still printed."""
    heavy = (
        "torch",
        "transformers",
        "fastapi",
        "uvicorn",
        "structlog",
        "opentelemetry",
        "filelock",
        "glowplug.lifecycle.config",
        "glowplug.engine.sampling_params",
        "glowplug.cache_cli",
        "glowplug.engine.stages.protocol",
    )
    code = (
        "import sys; from glowplug import cli; rc = cli.main(['startup', '--predict-only']); "
        f"print('LOADED', sorted(m for m in {heavy!r} if m in sys.modules)); sys.exit(rc)"
    )
    env = {**os.environ, "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout and "READY" in proc.stdout, proc.stdout


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the CLI (`bench startup`, `models fetch`, ...), leaves and groups alike."""
    found = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _subparsers(sub, (*path, name))
    return found


def test_every_commands_help_renders() -> None:
    """argparse formats each help string: one flag's description with a stray % breaks that command's --help."""
    from glowplug.cli import build_parser

    for path in _subparsers(build_parser()):
        parser = build_parser()
        with pytest.raises(SystemExit) as done:
            parser.parse_args([*path, "--help"])
        assert done.value.code == 0, path
