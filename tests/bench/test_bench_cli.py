"""The benchmark modules plug into argparse through `register`, and importing them stays cheap."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from glowplug.base.flags import add_model_flags
from glowplug.profiling.bench import latency, startup_bench, throughput, tune


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glowplug")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    for module in (latency, throughput, startup_bench):
        module.register(bench, add_model_flags)
    tune.register(sub.add_parser("tune").add_subparsers(dest="tune_command", required=True), add_model_flags)
    return p


def test_flags_build_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_main(cfg: object, argv: list[str] | None = None) -> int:
        seen["cfg"] = cfg
        seen["argv"] = argv
        return 0

    # A list flag takes one value per use: repeated, or items separated by commas (base/flags.py).
    cases = {
        ("bench", "latency", "--batch-size", "1,4", "--quantization", "none", "--quantization", "int8", "--no-plots"): (
            latency,
            dict(batch_size=(1, 4), quantization=("none", "int8"), plots=False),
        ),
        ("bench", "throughput", "--configs", "interactive,base", "m", "--runs", "2"): (
            throughput,
            dict(model="m", configs=("interactive", "base"), runs=2),
        ),
        ("bench", "throughput", "--model", "m"): (throughput, dict(model="m")),
        ("bench", "startup", "--runs", "2", "--max-model-len", "auto", "--out-dir", "x"): (
            startup_bench,
            dict(runs=2, max_model_len="auto", out_dir=Path("x")),
        ),
        (
            "tune",
            "max-model-len",
            "--max-model-len",
            "256",
            "--max-model-len",
            "1024",
            "--min-concurrency",
            "4",
            "--plan",
        ): (tune, dict(max_model_len=(256, 1024), min_concurrency=4, plan=True)),
    }
    for module in (latency, throughput, startup_bench, tune):
        monkeypatch.setattr(module, "main", fake_main)  # `register` binds `main` when it is called
    p = _parser()
    for argv, (module, expected) in cases.items():
        args = p.parse_args(list(argv))
        args.argv = list(argv)  # glowplug.cli.main sets this for every command
        assert args.func(args) == 0
        assert type(seen["cfg"]).__module__ == module.__name__
        assert {k: getattr(seen["cfg"], k) for k in expected} == expected
        assert seen["argv"] == list(argv)


def test_bad_values_are_refused_by_the_schema() -> None:
    with pytest.raises(ValueError, match="lists a value twice"):
        latency.LatencyBenchConfig(batch_size=(1, 1))
    with pytest.raises(ValueError):
        throughput.ThroughputBenchConfig(configs=("no_such_config",))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        latency.LatencyBenchConfig(decode_length=1)  # no decode step to time


def test_importing_the_modules_imports_no_torch() -> None:
    code = (
        "import sys; from glowplug.profiling.bench import latency, throughput, startup_bench, tune, plots, stats; "
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
