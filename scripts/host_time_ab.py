"""A/B of the decode step's host time between two source trees, in one run (issue 31's target).

Host time per decode step = the step's wall time minus the compiled model call and the sampler, the same definition
as `glowplug bench decode`'s "host ms / step" column, by the same loop (profiling/bench/timing.py `time_batch`,
loaded from this script's tree by its path, so the tree under test needs none of it). Older trees have no
step_times, so this script times both trees the same way from outside: it wraps the model runner's `sample`
function and the installed decode step with perf_counter_ns timers, and hands those to the loop as its clock.

    python scripts/host_time_ab.py --a /path/to/old/tree --b . --pairs 3 --out reports/decode-host-ab.md

Each measurement runs in its own process (so each tree imports its own code), and the two trees alternate
A, B, A, B, ... so that a slow patch of the machine lands on both. Every B run is divided by the A run beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

_PACKAGES = {
    "engine": "engine",
    "kernels": "kernels",
    "lifecycle": "lifecycle",
    "profiling": "profiling",
    "base": "base",
}


def _shim(tree: Path, where: Path) -> Path:
    """A folder whose `glowplug` package is `tree`'s source (the repository keeps the subpackages at its top level,
    and the editable install maps them into `glowplug.*` for one tree only)."""
    pkg = where / "glowplug"
    pkg.mkdir(parents=True)
    for f in (tree / "glowplug").iterdir():
        if f.suffix == ".py":
            (pkg / f.name).symlink_to(f)
    for name, folder in _PACKAGES.items():
        if (tree / folder).is_dir():
            (pkg / name).symlink_to(tree / folder)
    return where


def _timing_module() -> ModuleType:
    """profiling/bench/timing.py of this script's tree, loaded by its path (it imports only the standard library
    at load): the one decode-timing loop, whatever the tree under test holds."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "profiling" / "bench" / "timing.py"
    spec = importlib.util.spec_from_file_location("host_time_ab_timing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _measure(
    batches: list[int], new_tokens: int, prompt_tokens: int, model: str, quantization: str
) -> dict[str, dict[str, float]]:
    """In the child: build the engine (bf16, compiled) and time decode steps at each batch size."""
    from glowplug.engine import model_runner as mr
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.llm import LLM
    from glowplug.engine.sampling_params import SamplingParams

    timers = {"model": 0, "sample": 0}
    real_sample = mr.sample

    def timed_sample(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter_ns()
        try:
            return real_sample(*a, **k)
        finally:
            timers["sample"] += time.perf_counter_ns() - t

    mr.sample = timed_sample
    llm = LLM(
        config=EngineConfig.from_flat(
            model=model,
            dtype="bfloat16",
            quantization=quantization,
            compile="on",
            max_model_len=prompt_tokens + new_tokens + 16,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, prompt_tokens),
        )
    )
    engine = llm.engine
    engine.commit_kv_cache()
    runner = engine.runner
    attr = "_decode_step" if hasattr(runner, "_decode_step") else "decode_fn"
    step = getattr(runner, attr)
    assert step is not None, "no compiled decode step"

    def timed_step(packed):  # type: ignore[no-untyped-def]
        t = time.perf_counter_ns()
        try:
            return step(packed)
        finally:
            timers["model"] += time.perf_counter_ns() - t

    setattr(runner, attr, timed_step)  # a measurement harness: the same wrapper on both trees

    def booked() -> SimpleNamespace:  # the wrappers' clock, in the shape of LLMEngine.step_times()
        return SimpleNamespace(model_ns=timers["model"], sample_ns=timers["sample"])

    time_batch = _timing_module().time_batch
    vocab = 1000
    out: dict[str, dict[str, float]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for batch in batches:
        for rep in range(2):  # the first run warms this batch shape's allocations
            prompts = [[(17 + 31 * i + 7 * j) % vocab + 10 for j in range(prompt_tokens)] for i in range(batch)]
            t = time_batch(engine, prompts, params, booked=booked)
            if rep == 1:
                out[str(batch)] = {
                    "host_ms": statistics.median(t.decode_host_s) * 1e3,
                    "step_ms": statistics.median(t.decode_step_s) * 1e3,
                    "steps": len(t.decode_step_s),
                }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, help="baseline source tree")
    ap.add_argument("--b", type=Path, help="candidate source tree")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2", help="model name or GGUF path")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.child:
        print(json.dumps(_measure(batches, args.new_tokens, args.prompt_tokens, args.model, args.quantization)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        shims = {k: _shim(getattr(args, k).resolve(), Path(tmp) / k) for k in ("a", "b")}
        runs: dict[str, list[dict[str, dict[str, float]]]] = {"a": [], "b": []}
        for i in range(args.pairs):
            for k in ("a", "b"):
                env = dict(os.environ, PYTHONPATH=str(shims[k]))
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    "--batch-sizes",
                    args.batch_sizes,
                    "--new-tokens",
                    str(args.new_tokens),
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                    "--model",
                    args.model,
                    "--quantization",
                    args.quantization,
                ]
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if res.returncode:
                    sys.exit(f"{k} run {i} failed:\n{res.stderr[-3000:]}")
                runs[k].append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(k, i, runs[k][-1], file=sys.stderr, flush=True)
    lines = [
        "# Decode-step host time, A/B in one run",
        "",
        f"Command: `python scripts/host_time_ab.py {' '.join(sys.argv[1:])}`",
        "",
        f"A = `{args.a}`, B = `{args.b}`. {args.model} ({args.quantization}), bf16, compiled step, "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy; per run the median over its "
        "decode steps; runs alternate A, B.",
        "Host time = step wall time minus the compiled model call and the sampler (timed by the same wrappers in "
        "both).",
        "",
        "| batch | A host ms (median, range) | B host ms (median, range) | B/A per pair (median, worst) "
        "| A step ms | B step ms | B/A step per pair (median, worst) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in batches:
        ah = [r[str(b)]["host_ms"] for r in runs["a"]]
        bh = [r[str(b)]["host_ms"] for r in runs["b"]]
        aw = [r[str(b)]["step_ms"] for r in runs["a"]]
        bw = [r[str(b)]["step_ms"] for r in runs["b"]]
        hr = [y / x for x, y in zip(ah, bh)]
        wr = [y / x for x, y in zip(aw, bw)]
        lines.append(
            f"| {b} | {statistics.median(ah):.3f} ({min(ah):.3f}-{max(ah):.3f}) "
            f"| {statistics.median(bh):.3f} ({min(bh):.3f}-{max(bh):.3f}) "
            f"| {statistics.median(hr):.2f} ({max(hr):.2f}) "
            f"| {statistics.median(aw):.2f} | {statistics.median(bw):.2f} "
            f"| {statistics.median(wr):.2f} ({max(wr):.2f}) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
