"""`glowplug bench all --out DIR`: regenerate every report in one run, in a fixed order, and index them.

Each report is its own `glowplug ...` command run in a fresh process (so one report's memory, compiled graphs or
threads never colour the next one's timings, and each child's peak RSS is that report's own), writing under
DIR. DIR/README.md lists, per report, the exact command that made it, its exit status, wall time and peak RSS,
with the commit hash, the machine (CPU model, cores, the streaming-read bandwidth probe) and the date.

Order, and why:
  1. accuracy          perplexity per scheme vs bf16 first: every later table flags a scheme above 2x bf16's
                       (--quality-from DIR/accuracy.json)
  2. kernels           calibrates the dispatch table every later engine start reads (every format and group)
  3. decode            bf16 vs transformers on the same prompts, compile on and off
  4. decode-quantized  seed 000's view: decode and prefill per format and batch (bf16, compile on and off)
  5. decode-kv         seed 003's view: tok/s, GB/s, KV-quant (int8 KV) and compiled rows at batch 1
  6. throughput        seed 002's configurations x schemes, 3 runs, Output Throughput without prefill
  7. latency           seed 001's TGI tables (prefill, decode token, decode total) per quantization
  8. tune              max-model-len sweep and plan
  9. startup           N cold and N warm starts (`glowplug bench startup`)
  10. cache-verify     cost of verifying a warm cache hit
`--quick` shrinks repeats and sizes to a smoke test: the README and every command line say so, and its numbers
are not measurements.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

STEP_NAMES: tuple[str, ...] = (
    "accuracy", "kernels", "decode", "decode-quantized", "decode-kv", "throughput", "latency", "tune", "startup",
    "cache-verify",
)  # fmt: skip


class BenchAllConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = "smollm2"
    # Under the working directory, named after the command: never the checkout's reports/ unless asked.
    out: Path = Field(Path("bench-all"), description="Folder of every report and its README.md.")
    quick: bool = Field(False, description="Smoke test only: tiny repeats and sizes, marked as such everywhere.")
    only: tuple[str, ...] | None = Field(None, description=f"Run these reports only, in the fixed order: {STEP_NAMES}.")
    quantization: tuple[str, ...] = Field(("int8", "int4", "int2", "w8a8"), description="Schemes besides none.")
    timeout_s: float = Field(3600.0, gt=0, description="Per report.")

    def steps(self) -> list[str]:
        if self.only is None:
            return list(STEP_NAMES)
        unknown = set(self.only) - set(STEP_NAMES)
        if unknown:
            raise ValueError(f"--only: unknown report(s) {sorted(unknown)}; choose from {list(STEP_NAMES)}")
        return [s for s in STEP_NAMES if s in self.only]


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]  # after `glowplug`
    outputs: list[str]  # paths relative to the out folder, linked from the README
    what: str


def plan_steps(cfg: BenchAllConfig) -> list[Step]:
    """The commands of every selected report, with the repeats and sizes of a full or a --quick run."""
    q = cfg.quick
    o = cfg.out
    m = cfg.model
    schemes = list(cfg.quantization)
    quality = ["--quality-from", str(o / "accuracy.json")] if "accuracy" in cfg.steps() else []
    reps = "1" if q else "3"
    steps = {
        "accuracy": Step("accuracy", ["bench", "accuracy", m, "--quantization", *schemes,
                                      *(["--window", "64", "--continuation-tokens", "0"] if q else []),
                                      "--out", str(o / "accuracy.md")],
                         ["accuracy.md"], "perplexity, KL and top-1 agreement of each scheme vs bf16"),
        "kernels": Step("kernels", ["bench", "kernels", m, "--repeats", "3" if q else "10",
                                    *(["--ms", "1", "--formats", "bf16", "int4-g32", "int2-g128"] if q else []),
                                    *quality, "--out", str(o / "kernels.md")],
                        ["kernels.md"], "every quantized linear path and native kernel per M; calibrates dispatch"),
        "decode": Step("decode", ["bench", "decode", m, "--batch-sizes", *(["1"] if q else ["1", "8", "32"]),
                                  "--dtype", "float32", "bfloat16", "--compile", *(["off"] if q else ["on", "off"]),
                                  "--repeats", reps, "--new-tokens", "8" if q else "64",
                                  "--prompt-tokens", "16" if q else "64", "--out", str(o / "decode.md")],
                       ["decode.md"], "decode tok/s vs transformers' generate on the same prompts"),
        "decode-quantized": Step("decode-quantized", [
            "bench", "decode", m, "--dtype", "bfloat16", "--quantization", "none", *schemes,
            "--batch-sizes", *(["1"] if q else ["1", "16"]), "--compile", *(["off"] if q else ["on", "off"]),
            "--repeats", reps, "--new-tokens", "8" if q else "32", "--prompt-tokens", "16" if q else "64",
            "--no-compare-hf", *quality, "--out", str(o / "decode-quantized.md")],
            ["decode-quantized.md"], "seed 000: decode and prefill per format, batch and group size"),
        "decode-kv": Step("decode-kv", [
            "bench", "decode", m, "--dtype", "bfloat16", "--quantization", "none", "int4",
            "--kv-cache-dtype", "auto", "int8", "--batch-sizes", "1", "--compile", *(["off"] if q else ["on", "off"]),
            "--repeats", reps, "--new-tokens", "8" if q else "64", "--prompt-tokens", "16" if q else "512",
            "--no-compare-hf", *quality, "--out", str(o / "decode-kv.md")],
            ["decode-kv.md"], "seed 003: tok/s, GB/s, KV-quant and compiled rows at batch 1"),
        "throughput": Step("throughput", [
            "bench", "throughput", m, "--dtype", "bfloat16", "--quantization", "none", *schemes,
            # high_concurrency and base are left out of the full run to keep it near 35 minutes on 2 cores.
            "--configs", *(["interactive"] if q else ["interactive", "prefill_bound", "medium_batch",
                                                       "decode_bound", "long_context"]),
            "--runs", reps, *quality, *(["--no-plots"] if q else []), "--out-dir", str(o / "throughput")],
            ["throughput/summary.md"], "seed 002: named configurations x schemes, Output Throughput w/o prefill"),
        "latency": Step("latency", [
            "bench", "latency", m, "--dtype", "bfloat16", "--quantization", "none", *schemes,
            "--batch-size", *(["1"] if q else ["1", "4", "16"]), "--sequence-length", "16" if q else "256",
            "--decode-length", "4" if q else "16", "--runs", reps, "--warmups", "0" if q else "1",
            *(["--no-plots"] if q else []), "--out-dir", str(o / "latency")],
            ["latency/latency.md"], "seed 001: TGI latency and throughput tables per quantization"),
        "tune": Step("tune", ["tune", "max-model-len", m, *(["--max-model-len", "128", "--plan"] if q else []),
                              "--min-concurrency", "8", *(["--no-plots"] if q else []),
                              "--out-dir", str(o / "tune-max-model-len")],
                     ["tune-max-model-len/" + ("tune-plan.md" if q else "tune.md")],
                     "start-up phases and KV capacity per max-model-len"),
        "startup": Step("startup", ["bench", "startup", m, "--runs", reps, *_startup_out(o / "startup")],
                        ["startup/startup.md"], "cold and warm starts: per-phase statistics and time to READY"),
        "cache-verify": Step("cache-verify", ["bench", "cache-verify", m, "--out", str(o / "cache-verify.md")],
                             ["cache-verify.md"], "cost of verifying a warm cache hit, quick vs full"),
    }  # fmt: skip
    return [steps[name] for name in cfg.steps()]


def _startup_out(folder: Path) -> list[str]:
    """`bench startup` is being moved from --out-dir to --out: pass whichever flag its config has today."""
    from .startup_bench import StartupBenchConfig

    flag = "--out" if "out" in StartupBenchConfig.model_fields else "--out-dir"
    return [flag, str(folder)]


@dataclass
class StepResult:
    step: Step
    returncode: int
    wall_s: float
    peak_rss_gb: float | None
    error: str | None = None


def run_step(step: Step, timeout_s: float, log: Path) -> StepResult:
    """Run one report command in a fresh process; its peak RSS comes from the kernel's accounting of that child."""
    cmd = [sys.executable, "-m", "glowplug.cli", *step.argv]
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = t0 + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = -9
                return StepResult(step, -9, time.perf_counter() - t0, None, f"timed out after {timeout_s:g} s")
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss is in KiB on Linux; it is the child's own high-water mark (its children are not included).
    rss = usage.ru_maxrss * 1024 / 1e9 if usage.ru_maxrss else None
    err = None if proc.returncode == 0 else f"exit {proc.returncode}: see {log.name}"
    return StepResult(step, proc.returncode, time.perf_counter() - t0, rss, err)


def git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"
    if rev.returncode != 0:
        return "unknown (not a git checkout)"
    return rev.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def render_readme(cfg: BenchAllConfig, results: list[StepResult], argv: list[str] | None, probe_gbps: float,
                  started: str) -> str:
    from .machine import command_line, machine_summary

    lines = [
        "# Reports" + (" — QUICK SMOKE TEST, NOT MEASUREMENTS" if cfg.quick else ""),
        "",
        f"- command: `{command_line(argv)}`",
        f"- commit: `{git_commit()}`",
        f"- machine: {machine_summary()}; streaming-read bandwidth probe {probe_gbps:.1f} GB/s (torch sum over "
        f"{'64 MiB fp32, fastest of 2 (--quick)' if cfg.quick else '1 GiB fp32, fastest of 5'}, measured before the "
        "first report)",
        f"- date: {started}",
        f"- model: `{cfg.model}`",
        "",
    ]
    if cfg.quick:
        lines += ["> **--quick**: one repeat, tiny sizes. These files test that every report still renders; "
                  "they are not benchmark results. Run without --quick for the real reports.", ""]
    lines += [
        "Every report ran in its own process in the order below (the order is part of the method: "
        "accuracy first, so later tables flag unusable formats; kernels second, so later engines dispatch "
        "by this machine's calibration). Each report opens with its own command, machine, versions and date.",
        "",
        "| # | report | what it shows | command | status | wall (s) | peak RSS (GB) |",
        "|--:|:--|:--|:--|:--|--:|--:|",
    ]
    for i, r in enumerate(results, 1):
        links = ", ".join(f"[{p}]({p})" for p in r.step.outputs)
        status = "ok" if r.returncode == 0 else (r.error or f"exit {r.returncode}")
        rss = f"{r.peak_rss_gb:.2f}" if r.peak_rss_gb is not None else "n/a (not measured)"
        cmd = "glowplug " + " ".join(shlex.quote(a) for a in r.step.argv)
        lines.append(f"| {i} | {links} | {r.step.what} | `{cmd}` | {status} | {r.wall_s:.0f} | {rss} |")
    lines += ["", "Logs of every command: `logs/<report>.log`. Peak RSS: the child process's high-water mark "
              "(getrusage of that process alone).", ""]
    pngs = sorted(p.relative_to(cfg.out) for p in cfg.out.rglob("*.png"))
    if pngs:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in pngs] + [""]
    return "\n".join(lines)


def run_all(cfg: BenchAllConfig, argv: list[str] | None = None, progress: Any = None) -> list[StepResult]:
    from .machine import measure_probe

    say = progress or (lambda _msg: None)
    cfg.out.mkdir(parents=True, exist_ok=True)
    logs = cfg.out / "logs"
    logs.mkdir(exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    probe = measure_probe(repeats=2 if cfg.quick else 5, size_bytes=(64 << 20) if cfg.quick else (1 << 30))
    results = []
    for step in plan_steps(cfg):
        say(f"[{len(results) + 1}] {step.name}: glowplug {' '.join(step.argv)}")
        results.append(run_step(step, cfg.timeout_s, logs / f"{step.name}.log"))
        say(f"    {'ok' if results[-1].returncode == 0 else results[-1].error} in {results[-1].wall_s:.0f} s")
        # The README is rewritten after every report: a stopped run still says what it has.
        (cfg.out / "README.md").write_text(render_readme(cfg, results, argv, probe, started))
    return results


def main(cfg: BenchAllConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    results = run_all(cfg, argv, progress=lambda msg: err.print(msg, markup=False))
    err.print(f"wrote {cfg.out / 'README.md'}", markup=False)
    return 0 if all(r.returncode == 0 for r in results) else 1


def register(subparsers: Any, add_model_flags: Any) -> Any:
    import argparse

    p = subparsers.add_parser("all", help="Regenerate every report into --out, in a fixed order, with README.md.",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2", metavar="MODEL", help="(default: smollm2)")
    add_model_flags(p, BenchAllConfig, exclude={"model"})

    def handler(args: argparse.Namespace) -> int:
        cfg = BenchAllConfig(**{k: v for k, v in vars(args).items() if k in BenchAllConfig.model_fields})
        cfg.steps()  # an unknown --only name fails before anything runs
        return main(cfg, getattr(args, "argv", None))

    p.set_defaults(func=handler)
    return p

