"""`glowplug bench all --out DIR`: regenerate every report in one run, in a fixed order, and index them.

Each report is its own `glowplug ...` command run in a fresh process (so one report's memory, compiled graphs or
threads never colour the next one's timings, and each child's peak RSS is that report's own), writing under
DIR. DIR/README.md lists, per report, the exact command that made it, its exit status, wall time and peak RSS,
under one header: the run's full commit, the machine (CPU model, cores, the streaming-read bandwidth probe) and the
date.

The code is pinned: the run refuses a tree whose tracked files differ from HEAD (outside DIR, whose committed
reports an earlier chunk rewrites) unless --allow-dirty, and then says DIRTY RUN in the index and on every report.
The commit and dirty state are measured once, before the first report, and handed to every report process
(GLOWPLUG_BENCH_COMMIT, GLOWPLUG_BENCH_DIRTY), whose header prints them.

Order, and why:
  1. accuracy          perplexity per scheme vs bf16 first: every later table flags a scheme above 2x bf16's
                       (--quality-from DIR/accuracy.json)
  2. kernels           calibrates the dispatch table every later engine start reads (every format and group)
  3. decode            bf16 vs transformers on the same prompts, compile on and off
  4. decode-quantized  decode and prefill per format and batch (bf16, compile on and off)
  5. decode-kv         tok/s, GB/s, KV-quant (int8 KV) and compiled rows at batch 1
  6. decode-context    the decode step at contexts up to 8,192 tokens
  7. decode-auto       the engine's default quantization (auto) against none and int4
  8. decode-isa        decode at the avx2 level (capped), every dtype, vs transformers
  9. decode-portable   decode at the portable level (capped)
     real-decode       the real-size targets on a real-size model (needs --real-model): decode at batch 1, 4,
                       16, 32, prefill of 512 tokens, 2,048-token context, batch invariance, against llama.cpp
                       (generator loop and batched API) on the same file
     real-decode-7b    the same targets' batch-1 cell on the synthetic 7B (needs --synthetic-7b)
  10. throughput       the reference sweep's seven named configurations x schemes, Output Throughput w/o prefill
  11. latency          TGI-style tables (prefill, decode token, decode total) per quantization
  12. latency-tp       the same at TP=3 against TP=1 (gloo)
  13. tune             max-model-len sweep and plan; tune-gemma the same on Gemma 3 (needs --gemma3-gguf),
                       real-tune on a real-size model (needs --real-model)
  14. startup          N cold and N warm starts (`glowplug bench startup --predict --poll-serve`)
  15. startup-tp1/tp3  cold and warm starts at TP=1 and TP=3
  16. gemma-startup    the second model's starts (needs --gemma3-gguf; listed as skipped without it)
      real-startup     cold, warm and bundle starts of a real-size model (needs --real-model; skipped without)
  17. screenshots      the live start-up page of a real `glowplug serve`: starting, READY, phone, under load
                       (`glowplug bench screenshots`; each png is stamped with the commit and date)
  18. cache-verify     cost of verifying a warm cache hit
  19. serve            HTTP serving sweep (closed loop at 1, 8, 32 and 64 clients): TTFT/TPOT/ITL/E2E, throughput
  20. serve-efficiency the same requests over HTTP and offline: server / offline throughput, paired per run
  21. serve-overload   capacity, the sustainable rate, then 4x that rate: 429s and admitted p99 TTFT
  22. serve-fuzz       schemathesis over the server's OpenAPI document, at the default max-model-len
  23. serve-soak       two minutes of mixed streams with hang-ups, then leak and counter checks
  24. serve-hostile    a 20 MB prompt refused under load, the hostile corpus, the limits' cost on throughput
A report with a target leaves its verdicts beside it (profiling/bench/verdicts.py); the index shows FAIL naming
the missed targets for such a step, even when its command exited 0.
Not made here: reports/gpu (scripts/device_check.sh on a GPU machine; its README names its commit).
The serve reports come last: each starts its own server, and none of the in-process tables above should share
the cores with one.
`--quick` shrinks repeats and sizes to a smoke test: the README and every command line say so, and its numbers
are not measurements.

`--only NAME,NAME` / `--skip NAME,NAME` run a subset (in the fixed order), so the full set can be run in chunks.
The index describes ONE run: a run without --only starts it afresh (DIR/bench-all.json's earlier outcomes go); a
--only chunk adds its reports to it when it runs the same clean commit. A chunk at another commit (or any dirty
chunk: its code cannot be shown to be the same) becomes the index's run, and the README then says at its top that
the reports come from more than one commit and which report came from which. README.md is regenerated from
bench-all.json after every report, and every report's command is listed, run or not yet.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .cli_support import AddModelFlags, add_command, check_path

STEP_NAMES: tuple[str, ...] = (
    "accuracy",
    "kernels",
    "decode",
    "decode-quantized",
    "decode-kv",
    "decode-context",
    "decode-auto",
    "decode-isa",
    "decode-portable",
    "real-decode",
    "real-decode-7b",
    "throughput",
    "latency",
    "latency-tp",
    "tune",
    "tune-gemma",
    "real-tune",
    "startup",
    "startup-tp1",
    "startup-tp3",
    "gemma-startup",
    "real-startup",
    "screenshots",
    "cache-verify",
    "serve",
    "serve-efficiency",
    "serve-overload",
    "serve-fuzz",
    "serve-soak",
    "serve-hostile",
)
SIDECAR = "bench-all.json"  # every report's last outcome in DIR; README.md is rendered from it


# The GGUF flags of the reports a run lists as skipped without them: what the path must name, and which reports.
GGUF_FLAGS = {
    "gemma3_gguf": ("a Gemma 3 .gguf file", "the Gemma reports are"),
    "synthetic_7b": ("the synthetic 7B .gguf (scripts/synthetic_gguf.py writes one)", "real-decode-7b is"),
    "real_model": (
        "a .gguf file (`glowplug models fetch qwen2.5-coder-1.5b` prints one)",
        "the real-size reports are",
    ),
}


class BenchAllConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = "smollm2"
    # Under the working directory, named after the command: never the checkout's reports/ unless asked.
    out: Path = Field(Path("bench-all"), description="Folder of every report and its README.md.")
    quick: bool = Field(False, description="Smoke test only: tiny repeats and sizes, marked as such everywhere.")
    only: tuple[str, ...] | None = Field(None, description=f"Run these reports only, in the fixed order: {STEP_NAMES}.")
    skip: tuple[str, ...] = Field((), description="Run every report but these (combines with --only).")
    quantization: tuple[str, ...] = Field(("int8", "int4", "int2", "w8a8"), description="Schemes besides none.")
    timeout_s: float = Field(3600.0, gt=0, description="Per report.")
    gemma3_gguf: Path | None = Field(
        None,
        description="A Gemma 3 GGUF (gemma-3-270m Q4_K_M) for the second-model reports (tune-gemma, "
        "gemma-startup); "
        "without it they are listed as skipped, with this flag as the fix.",
    )
    real_model: Path | None = Field(
        None,
        description="A real-size GGUF (Qwen2.5-Coder-1.5B Q4_K_M: `glowplug models fetch qwen2.5-coder-1.5b`; "
        "or a synthetic 7B from scripts/synthetic_gguf.py) for the real-size reports (real-decode, real-tune, "
        "real-startup); without it they are listed as skipped, with this flag as the fix.",
    )
    synthetic_7b: Path | None = Field(
        None,
        description="A 7B-shape Q4_K_M GGUF (scripts/synthetic_gguf.py's Qwen2.5-7B shape) for real-decode-7b; "
        "without it that report is listed as skipped, with this flag as the fix.",
    )
    allow_dirty: bool = Field(
        False,
        description="Run although tracked files differ from HEAD (outside --out); the "
        "index and every report then say DIRTY RUN.",
    )

    @field_validator(*GGUF_FLAGS)
    @classmethod
    def _gguf_is_a_file(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        what, skipped = GGUF_FLAGS[str(info.field_name)]
        flag = str(info.field_name).replace("_", "-")
        return check_path(
            v,
            Path.is_file,
            f"no file at {{v}}: give the path of {what}, or leave --{flag} out ({skipped} then listed as skipped)",
        )

    def steps(self) -> list[str]:
        """The selected reports, in the fixed order (an unknown name fails: a typo must not silently skip one)."""
        for flag, names in (("--only", self.only or ()), ("--skip", self.skip)):
            unknown = set(names) - set(STEP_NAMES)
            if unknown:
                raise ValueError(f"{flag}: unknown report(s) {sorted(unknown)}; choose from {list(STEP_NAMES)}")
        chosen = [s for s in STEP_NAMES if (self.only is None or s in self.only) and s not in self.skip]
        if not chosen:
            raise ValueError("--only/--skip leave no report to run")
        return chosen


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]  # after `glowplug`
    outputs: list[str]  # paths relative to the out folder, linked from the README
    what: str
    env: dict[str, str] = field(default_factory=dict)  # set for this step's process only (the ISA caps)
    skip: str | None = None  # why this step cannot run in this invocation (recorded in the index, not run)


def _items(values: list[str]) -> str:
    """A list flag's value: the items joined by commas (a list flag takes one value per use)."""
    return ",".join(values)


Flag = str | bool | None  # a flag's value for _argv: the value, True for a bare flag, False or None for none
# `bench decode`'s flags in the order every decode report's command line gives them.
DECODE_FLAGS = (
    "dtype",
    "quantization",
    "group_size",
    "kv_cache_dtype",
    "batch_sizes",
    "cells",
    "compile",
    "repeats",
    "new_tokens",
    "prompt_tokens",
    "max_model_len",
    "no_compare_hf",
    "peers",
    "peer_contexts",
    "invariance",
    "targets",
    "quality_from",
    "out",
)


def _argv(head: list[str], **flags: Flag) -> list[str]:
    """A command line after `glowplug`: `head`, then each flag in the order given (`out_dir=` is --out-dir). A value
    follows its flag, True is the bare flag, and False or None leaves the flag out (one a --quick run drops)."""
    argv = list(head)
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(value)
    return argv


def plan_steps(cfg: BenchAllConfig, names: list[str] | None = None) -> list[Step]:
    """The commands of the selected reports (`names`, default: cfg.steps()), with the repeats and sizes of a full
    or a --quick run."""
    q = cfg.quick
    o = cfg.out
    m = cfg.model
    schemes = list(cfg.quantization)
    # The engine's default, per tensor as the file stores it: a row of its own in the decode and accuracy reports
    # (for the default model it is int4 on the GGUF's blocks, so the other reports' int4 rows stand for it).
    with_auto = schemes if "auto" in schemes else ["auto", *schemes]
    # The flags come from accuracy.json when this run makes it, or when an earlier chunk already did.
    has_accuracy = "accuracy" in cfg.steps() or (o / "accuracy.json").is_file()
    quality = str(o / "accuracy.json") if has_accuracy else None
    reps = reps_of(q)
    real = str(cfg.real_model or "REAL_MODEL_GGUF")
    real_skip = None if cfg.real_model else "no real-size model given: pass --real-model PATH"
    gemma = str(cfg.gemma3_gguf or "GEMMA3_GGUF")
    gemma_skip = None if cfg.gemma3_gguf else "no Gemma 3 GGUF given: pass --gemma3-gguf PATH"
    # The ISA caps of the capped decode reports: glowplug's, torch's and oneDNN's together make it run what such a
    # CPU runs (the transformers peer too).
    avx2 = {"GLOWPLUG_MAX_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    portable = {"GLOWPLUG_MAX_CPU_ISA": "portable", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    both_llamacpp = "llamacpp,llamacpp-batched"
    # The decode reports' shared settings: the quick or full prompt and output lengths most of them time; the KV
    # grid (both KV dtypes with and without int4 weights, batch 1); the real-size targets' engine (the default
    # config) against both llama.cpp peers.
    short: dict[str, Flag] = {"new_tokens": "8" if q else "32", "prompt_tokens": "16" if q else "64"}
    kv_grid: dict[str, Flag] = {
        "dtype": "bfloat16",
        "quantization": "none,int4",
        "kv_cache_dtype": "auto,int8",
        "batch_sizes": "1",
        "no_compare_hf": True,
        "quality_from": quality,
    }
    real_grid: dict[str, Flag] = {
        "quantization": "auto",
        "compile": "off" if q else "on",
        "no_compare_hf": True,
        "peers": both_llamacpp,
        "targets": not q,
    }

    def decode(
        name: str,
        what: str,
        *,
        model: str = m,
        out: str = "",
        env: dict[str, str] | None = None,
        skip: str | None = None,
        **flags: Flag,
    ) -> Step:
        """A `bench decode` report (`name`.md unless `out`): its flags in DECODE_FLAGS' order, every run repeated."""
        given = {**flags, "repeats": reps, "out": str(o / (out or f"{name}.md"))}
        if set(given) - set(DECODE_FLAGS):
            raise ValueError(f"{name}: decode flags {sorted(set(given) - set(DECODE_FLAGS))} not in DECODE_FLAGS")
        argv = _argv(["bench", "decode", model], **{f: given[f] for f in DECODE_FLAGS if f in given})
        return Step(name, argv, [out or f"{name}.md"], what, env=env or {}, skip=skip)

    # The reports run per scheme (none and every --quantization scheme) in bf16.
    per_scheme: dict[str, Flag] = {"dtype": "bfloat16", "quantization": _items(["none", *schemes])}

    def plan_or_repeats(quick_len: str) -> dict[str, Flag]:
        """A max-model-len sweep's size: a --quick run plans one length and times nothing; a full one repeats."""
        return {"max_model_len": quick_len if q else None, "plan": q, "repeats": None if q else reps}

    def tune(name: str, what: str, model: str, sub: str, skip: str | None = None, **flags: Flag) -> Step:
        """A `tune max-model-len` report in tune-max-model-len/`sub`: its plan (--plan) or its sweep."""
        folder = o / "tune-max-model-len" / sub
        argv = _argv(["tune", "max-model-len", model], **flags, min_concurrency="8", no_plots=q, out_dir=str(folder))
        report = "tune-plan.md" if "--plan" in argv else "tune.md"
        return Step(name, argv, [str(Path("tune-max-model-len", sub, report))], what, skip=skip)

    # The cold and warm starts alone (no bundle, no tracing-overhead pairs): the TP and second-model reports.
    starts: dict[str, Flag] = {"runs": reps, "no_bundle": True, "no_tracing_overhead": True}

    def startup(name: str, what: str, model: str, sub: str, skip: str | None = None, **flags: Flag) -> Step:
        """A `bench startup` report in `sub`."""
        argv = _argv(["bench", "startup", model], **flags, **_startup_out(o / sub))
        return Step(name, argv, [f"{sub}/startup.md"], what, skip=skip)

    # Every serve report: one bf16 server started by the benchmark, the same request shape unless a mode needs less,
    # each report in the one serve folder.
    serve_shape: dict[str, Flag] = {
        "dtype": "bfloat16",
        "runs": reps,
        "input_len": "16" if q else "128",
        "output_len": "4" if q else "64",
    }

    def serve(name: str, what: str, **mode: Flag) -> Step:
        """A `bench serve` report (serve/<its mode>.md): the common flags, then the mode's."""
        argv = _argv(["bench", "serve", m], **serve_shape, **mode, out_dir=str(o / "serve"))
        return Step(name, argv, [f"serve/{name.split('-')[-1]}.md"], what)

    steps = [
        Step(
            "accuracy",
            _argv(
                ["bench", "accuracy", m],
                quantization=_items(with_auto),
                window="64" if q else None,
                continuation_tokens="0" if q else None,
                out=str(o / "accuracy.md"),
            ),
            ["accuracy.md"],
            "perplexity, KL and top-1 agreement of each scheme vs bf16",
        ),
        Step(
            "kernels",
            _argv(
                ["bench", "kernels", m],
                repeats="3" if q else "10",
                isa_levels=None if q else "portable,avx2,avx512",
                ms="1" if q else None,
                formats="bf16,int4-g32,int2-g128" if q else None,
                quality_from=quality,
                out=str(o / "kernels.md"),
            ),
            ["kernels.md"],
            "every quantized linear path and native kernel per M; calibrates dispatch",
        ),
        # The peers (transformers fp32 and bf16, llama.cpp on the same GGUF when llama-cpp-python is installed) are
        # timed right after each glowplug run, on the same prompts: every ratio is a pair from one moment.
        Step(
            "decode",
            _argv(
                ["bench", "decode", m],
                batch_sizes="1" if q else "1,8,32",
                dtype="float32,bfloat16",
                compile="off" if q else "on,off",
                repeats=reps,
                new_tokens="8" if q else "32",
                prompt_tokens="16" if q else "64",
                hf_dtype="float32" if q else "float32,bfloat16",
                peers="llamacpp",
                out=str(o / "decode.md"),
            ),
            ["decode.md"],
            "decode tok/s vs transformers (fp32, bf16) and llama.cpp, paired run by run",
        ),
        # Seed 000's grid: group size 128 (for the formats that take one), batch 1 and 16, a 2048-token context
        # beside a short one.
        decode(
            "decode-quantized",
            "seed 000: decode and prefill per format, batch and context, group 128",
            dtype="bfloat16",
            quantization=_items(["none", *with_auto]),
            group_size="128",
            batch_sizes="1" if q else "1,16",
            compile="off" if q else "on",
            new_tokens="8" if q else "32",
            prompt_tokens="16" if q else "64,2048",
            no_compare_hf=True,
            quality_from=quality,
        ),
        # Seed 003's KV-quant grid at batch 1: per-run lines and the cache-size sweep (the same runs with the cache
        # sized for 2112 and for 8192 tokens); then the same grid at contexts up to 8,192 tokens.
        decode(
            "decode-kv",
            "seed 003: per-run lines, tok/s, GB/s, KV-quant, context and cache-size sweeps",
            **kv_grid,
            compile="off" if q else "on,off",
            new_tokens="8" if q else "64",
            prompt_tokens="16" if q else "512,2048",
            max_model_len="32,1024" if q else "2112,8192",
        ),
        decode(
            "decode-context",
            "issue 34: the decode step at contexts up to 8,192 tokens, KV bytes against time",
            **kv_grid,
            compile="on",
            new_tokens="8" if q else "32",
            prompt_tokens="16,64" if q else "64,512,2048,8064",
        ),
        # The engine's default (auto: each tensor as the GGUF stores it) against none and int4, and llama.cpp on the
        # same GGUF blocks, paired with every run (its generator loop at batch 1, its batched API at every batch):
        # what a CPU user compares against; the batch-invariance check per engine. The README's batch-1 figure for
        # auto comes from here.
        decode(
            "decode-auto",
            "the engine's default quantization (auto) against none, int4 and llama.cpp; batch invariance per format",
            dtype="bfloat16",
            quantization="none,auto,int4",
            batch_sizes="1" if q else "1,16",
            compile="off" if q else "on",
            **short,
            no_compare_hf=True,
            peers=both_llamacpp,
            invariance=not q,
        ),
        # The avx2 and portable levels on this machine, under the ISA caps above (auto is bfloat16 at the avx2
        # level, engine/config_check.py; int4 runs in the first dtype).
        decode(
            "decode-isa",
            "issue 34: decode at the avx2 level (capped), every dtype, vs transformers fp32",
            env=avx2,
            dtype="bfloat16,float32",
            quantization="none,int4",
            batch_sizes="1" if q else "1,16",
            compile="on",
            **short,
            quality_from=quality,
        ),
        decode(
            "decode-portable",
            "issue 34: decode at the portable level (capped): the speed any CPU gets",
            env=portable,
            dtype="auto",
            batch_sizes="1",
            compile="on",
            **short,
            no_compare_hf=True,
        ),
        # The real-size targets under the engine's default config, against llama.cpp on the same file (its
        # generator loop and its batched API, interleaved run by run): batch 1, 4, 16 and 32 at a 64-token prompt,
        # a 512-token prompt (pp512 and decode after it), the 2,048-token context, and the batch-invariance check.
        decode(
            "real-decode",
            "a real-size model (--real-model): the decode, batch, prefill, long-context and "
            "invariance targets against llama.cpp on the same file",
            model=real,
            out="real/decode.md",
            skip=real_skip,
            **real_grid,
            cells="1x16,4x16" if q else "1x64,4x64,16x64,32x64,1x512,1x2048",
            new_tokens="8" if q else "128",
            peer_contexts="16" if q else "64,512",
            invariance=not q,
        ),
        # The synthetic 7B (the real Qwen2.5-7B's tensors, random weights): its batch-1 targets.
        decode(
            "real-decode-7b",
            "the synthetic 7B (--synthetic-7b): batch-1 decode against the probe and llama.cpp on the same file",
            model=str(cfg.synthetic_7b or "SYNTHETIC_7B_GGUF"),
            out="real/decode-7b.md",
            skip=None if cfg.synthetic_7b else "no synthetic 7B given: pass --synthetic-7b PATH",
            **real_grid,
            cells="1x16" if q else "1x64",
            new_tokens="8" if q else "64",
        ),
        Step(
            "throughput",
            _argv(
                # All seven of seed 002's configurations; a scheme accuracy.json marks unusable is listed, not timed.
                ["bench", "throughput", m],
                **per_scheme,
                configs="interactive"
                if q
                else "interactive,decode_bound,prefill_bound,long_context,medium_batch,base,high_concurrency",
                runs=reps,
                warmups="0",
                quality_from=quality,
                skip_unusable=not q,
                no_plots=q,
                out_dir=str(o / "throughput"),
            ),
            ["throughput/summary.md"],
            "seed 002: named configurations x schemes, Output Throughput w/o prefill",
        ),
        Step(
            "latency",
            _argv(
                # Seed 001's grid (sequence 1024, decode 8, 10 runs, 1 warm-up) at the batch sizes of its list that
                # fit this machine's minutes (1, 2, 4; batch 8 would double the report's time).
                ["bench", "latency", m],
                **per_scheme,
                batch_size="1" if q else "1,2,4",
                sequence_length="16" if q else "1024",
                decode_length="4" if q else "8",
                runs=reps if q else "10",
                warmups="0" if q else "1",
                no_plots=q,
                out_dir=str(o / "latency"),
            ),
            ["latency/latency.md"],
            "seed 001: TGI latency and throughput tables per quantization",
        ),
        # Tensor parallel over gloo on this CPU: what the TP machinery costs a step, against TP=1 in the same run.
        Step(
            "latency-tp",
            _argv(
                ["bench", "latency", m],
                dtype="bfloat16",
                quantization="none",
                tensor_parallel_size="1,3",
                batch_size="1" if q else "1,4",
                sequence_length="16" if q else "256",
                decode_length="4" if q else "16",
                runs=reps,
                warmups="0" if q else "1",
                no_plots=q,
                out_dir=str(o / "latency" / "tp"),
            ),
            ["latency/tp/latency.md"],
            "tensor parallel (TP=3 over gloo) against TP=1: prefill and decode latency",
        ),
        tune("tune", "start-up phases and KV capacity per max-model-len", m, "", **plan_or_repeats("128")),
        # Seed 004 sweeps two models; ours are the default model and Gemma 3 (compile off, as gemma-startup: its
        # Inductor compile of a 262k-vocabulary head would be a minute per start on 2 cores).
        tune(
            "tune-gemma",
            "the same sweep on Gemma 3 270m (Q4_K_M GGUF)",
            gemma,
            "gemma",
            skip=gemma_skip,
            quantization="auto",
            compile="off",
            max_model_len="256" if q else None,
            repeats="1" if q else reps,
        ),
        # The same sweep at a real size, where the KV pool competes with weights of a GB and more (the default
        # compile: what a user of that model starts with).
        tune(
            "real-tune",
            "the same sweep on a real-size model (--real-model)",
            real,
            "real",
            skip=real_skip,
            **plan_or_repeats("256"),
        ),
        # 80 pairs: a 1% tracing-overhead target on a ~2 s warm start is ~20 ms, inside the noise of 10 pairs.
        # --predict: the prediction made before each start against it; --poll-serve: a serve start's /startup
        # polled every 0.2 s (every poll names a running stage, its ETA within 30% of the time left).
        startup(
            "startup",
            "cold and warm starts: per-phase statistics and time to READY",
            m,
            "startup",
            runs=reps,
            tracing_runs="2" if q else "80",
            bundle_isa_cap=None if q else "avx2",
            predict=True,
            poll_serve=True,
        ),
        startup(
            "startup-tp1", "cold and warm starts at TP=1, the baseline of startup-tp3", m, "startup-tp/tp1", **starts
        ),
        startup(
            "startup-tp3",
            "cold and warm starts at TP=3: per-rank phases, distributed_init",
            m,
            "startup-tp/tp3",
            tensor_parallel_size="3",
            **starts,
        ),
        # The second model: Gemma 3 (sliding-window layers, SentencePiece vocabulary), compile off as its report
        # measures preparation, not Inductor.
        startup(
            "gemma-startup",
            "Gemma 3 270m (Q4_K_M GGUF): cold and warm starts",
            gemma,
            "gemma-startup",
            skip=gemma_skip,
            compile="off",
            **starts,
            predict=True,
        ),
        # Cold, warm and bundle starts at a real size, each against its floor (the tracing-overhead pairs are the
        # default model's: 80 starts of a GB-sized model would take the run's hours).
        startup(
            "real-startup",
            "a real-size model (--real-model): cold, warm and bundle starts",
            real,
            "real/startup",
            skip=real_skip,
            runs=reps,
            no_tracing_overhead=True,
        ),
        # After startup: the page's ghosts and ETA come from the earlier starts of the same config. 16 clients put
        # visible traffic on the serving charts; the load is stopped once its screenshot is taken.
        Step(
            "screenshots",
            _argv(["bench", "screenshots", m], under_load="2" if q else "16", out=str(o / "screenshots")),
            [f"screenshots/{n}" for n in ("page.png", "page-phone.png", "page-serving.png", "screenshots.json")],
            "the live start-up page (starting, READY, phone, under load), stamped with the commit",
        ),
        Step(
            "cache-verify",
            _argv(["bench", "cache-verify", m], out=str(o / "cache-verify.md")),
            ["cache-verify.md"],
            "cost of verifying a warm cache hit, quick vs full",
        ),
        # The loads (1, 8, 32, 64); 64 prompts, so that concurrency 64 has that many in flight. About 5
        # minutes on 2 cores: concurrency 1 dominates (64 requests one after another).
        serve(
            "serve",
            "HTTP sweep: TTFT, TPOT, ITL, E2E percentiles, throughput per load",
            concurrency="1,2" if q else "1,8,32,64",
            num_prompts="2" if q else "64",
        ),
        # Concurrency = the request count: the offline side runs them as one batch, so the server must be offered
        # the same batch, else the ratio measures batch size rather than serving overhead.
        serve(
            "serve-efficiency",
            "server vs offline (LLM.generate) token throughput on one request set",
            efficiency=True,
            efficiency_concurrency="2" if q else "32",
            num_prompts="2" if q else "32",
        ),
        serve(
            "serve-overload",
            "capacity, sustainable rate, 4x overload: 429s and admitted p99 TTFT",
            overload=True,
            max_num_seqs="2" if q else "8",
            num_prompts="4" if q else "16",
        ),
        # The server's own max-model-len; each generated case's work is bounded instead (max_tokens <= 16, n <= 2,
        # prompt strings <= 64 characters and lists <= 4 items): unbounded cases asked for thousands of tokens.
        serve(
            "serve-fuzz",
            "schemathesis over the OpenAPI document: 5xx and schema violations",
            fuzz=True,
            fuzz_cases="5" if q else "500",
            fuzz_max_tokens="16",
            fuzz_max_n="2",
        ),
        serve(
            "serve-soak",
            "mixed streams with hang-ups; leaks, counters and RSS checked after",
            soak=True,
            soak_duration="10" if q else "120",
            soak_streams="2" if q else "64",
            hangup_fraction="0.1",
            max_num_seqs="4" if q else "128",
        ),
        # The server's own default max-model-len (the setting); the corpus runs with the default limits, so
        # its slow cases take the default 60 s body and 20 s head timeouts.
        # 32 requests per run of the cost pairs: each pair is four runs (A B B A), and three pairs must fit.
        serve(
            "serve-hostile",
            "a large prompt refused under load, the hostile corpus, the limits' cost on throughput",
            hostile=True,
            hostile_prompt_mb="2" if q else "20",
            num_prompts="8" if q else "32",
        ),
    ]
    by_name = {s.name: s for s in steps}
    return [by_name[name] for name in (cfg.steps() if names is None else names)]


def reps_of(quick: bool) -> str:
    """Runs per cell: 3 (the least that has a median and a spread), 1 for a --quick smoke test."""
    return "1" if quick else "3"


def _startup_out(folder: Path) -> dict[str, str]:
    """`bench startup` is being moved from --out-dir to --out: pass whichever flag its config has today."""
    from .startup_bench import StartupBenchConfig

    return {"out" if "out" in StartupBenchConfig.model_fields else "out_dir": str(folder)}


@dataclass
class StepResult:
    step: Step
    returncode: int
    wall_s: float
    peak_rss_gb: float | None
    error: str | None = None


class DirtyTreeError(RuntimeError):
    """The tree differs from HEAD and --allow-dirty was not given: nothing ran."""


def _last_line(log: Path) -> str:
    """The last non-empty line a failed report printed (its reason, for a command that exits with one), made safe
    for a Markdown table cell."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:240].replace("|", "\\|").replace("`", "'") if lines else ""


def run_step(step: Step, timeout_s: float, log: Path, out: Path, run_env: dict[str, str] | None = None) -> StepResult:
    """Run one report command in a fresh process; its peak RSS comes from the kernel's accounting of that child.
    `run_env` is what the whole run hands every report (its commit and dirty state)."""
    cmd = [sys.executable, "-m", "glowplug.cli", *step.argv]
    t0 = time.perf_counter()
    started = time.time() - 1.0  # file mtimes are wall-clock; 1 s of slack for coarse filesystem timestamps
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(run_env or {}), **step.env}
        )
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
    err = None
    if proc.returncode != 0:
        # A serve mode exits 1 when its own check fails (overload, soak, efficiency) after writing its report:
        # say the report exists, so a FAIL verdict is not mistaken for a crash.
        written = all((out / o).is_file() and (out / o).stat().st_mtime >= started for o in step.outputs)
        reason = _last_line(log)  # e.g. `bench screenshots`: "no chromium found: ..."
        err = (
            f"FAIL: report written, exit {proc.returncode} (a check in it failed; see the report and logs/{log.name})"
            if written
            else f"exit {proc.returncode}: {reason + ' ' if reason else ''}(see logs/{log.name})"
        )
    missed = missed_targets(step, out, started)
    if missed:
        err = f"FAIL: {'; '.join(missed)}" + (f" ({err})" if err else "")
    return StepResult(step, proc.returncode, time.perf_counter() - t0, rss, err)


def missed_targets(step: Step, out: Path, since: float) -> list[str]:
    """The targets the step's reports say were missed (their verdicts sidecars, written by this run)."""
    from .verdicts import failed_targets, sidecar

    missed: list[str] = []
    for output in step.outputs:
        report = out / output
        side = sidecar(report)
        if report.suffix == ".md" and side.is_file() and side.stat().st_mtime >= since:
            missed += failed_targets(report)
    return missed


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a chunk's reports may join run `a`'s index as the same code: one clean commit. A dirty tree's code
    cannot be shown to match another dirty tree's, so a dirty chunk never joins."""
    return bool(a.get("commit")) and a.get("commit") == b.get("commit") and not a.get("dirty") and not b.get("dirty")


def entry_of(r: StepResult, quick: bool, finished: str, run: dict[str, Any]) -> dict[str, Any]:
    """One report's outcome as stored in the sidecar (what README.md is rendered from), with the run it belongs
    to: a report that did not come from the index's run shows as such."""
    return {
        "argv": r.step.argv,
        "outputs": r.step.outputs,
        "what": r.step.what,
        "returncode": r.returncode,
        "wall_s": r.wall_s,
        "peak_rss_gb": r.peak_rss_gb,
        "error": r.error,
        "quick": quick,
        "finished": finished,
        "commit": run["commit"],
        "dirty": run["dirty"],
        "run": run,
    }


def _legacy_run(commit_text: str, date: str, inv: dict[str, Any] | None) -> dict[str, Any]:
    """A run header for an entry of the older sidecar format (one "commit" string, "(with uncommitted changes)")."""
    head = str(commit_text).split(" ", 1)[0]
    return {
        "command": inv["command"] if inv else "unknown (older sidecar)",
        "commit": head,
        "dirty": "uncommitted" in str(commit_text),
        "date": inv["date"] if inv else date,
        "machine": "unknown (older sidecar)",
        "probe_gbps": inv.get("probe_gbps") if inv else None,
        "probe": inv.get("probe", "") if inv else "",
        "quick": False,
    }


def load_sidecar(out: Path) -> dict[str, Any]:
    """The index's run and its reports' outcomes in `out` ({"run": None, "entries": {}} for a fresh folder). A
    sidecar that does not parse is a bug or a hand edit: fail loudly rather than drop every earlier report. The
    older format (a list of invocations, a commit string per entry) is read as one run per commit."""
    path = out / SIDECAR
    if not path.is_file():
        return {"run": None, "entries": {}}
    data: dict[str, Any] = json.loads(path.read_text())
    if "invocations" in data and "run" not in data:
        invs: list[dict[str, Any]] = data["invocations"]
        entries = data.get("entries", {})
        for e in entries.values():
            inv = next((i for i in reversed(invs) if i.get("commit") == e.get("commit")), None)
            e["run"] = _legacy_run(e.get("commit", "unknown"), e.get("finished", "?"), inv)
            e["commit"], e["dirty"] = e["run"]["commit"], e["run"]["dirty"]
        last = invs[-1] if invs else None
        run = _legacy_run(last["commit"], last["date"], last) if last else None
        return {"run": run, "entries": entries}
    data.setdefault("run", None)
    data.setdefault("entries", {})
    return data


def _commit_cell(run: dict[str, Any]) -> str:
    return f"`{run['commit']}`" + (" (with uncommitted changes: **DIRTY RUN**)" if run.get("dirty") else "")


def render_readme(cfg: BenchAllConfig, sidecar: dict[str, Any]) -> str:
    """README.md from the sidecar: one run's header (full commit, date, machine, probe), every report in the fixed
    order (the ones not run yet with the command that would make them), and, when some reports came from another
    run, a warning at the top with the full commit of each."""
    from .machine import machine_summary

    entries: dict[str, Any] = sidecar["entries"]
    run: dict[str, Any] | None = sidecar.get("run")
    quick = any(e.get("quick") for e in entries.values())
    others = {n: e for n, e in entries.items() if run is None or e.get("run") != run}
    lines = ["# Reports" + (" — INCLUDES QUICK SMOKE TESTS, NOT MEASUREMENTS" if quick else ""), ""]
    if others:
        commits = {(e["run"]["commit"], bool(e["run"].get("dirty"))) for e in entries.values()}
        lines += [
            f"> **⚠ MIXED INDEX: these reports come from {len(commits)} different runs / commits**, not from "
            "the one run below. Numbers from different code are not comparable; rerun `glowplug bench all` "
            "without --only for one run. Which report came from which commit:",
            ">",
        ]
        for name in STEP_NAMES:
            if name in entries:
                e = entries[name]
                here = " (the run below)" if run is not None and e.get("run") == run else ""
                lines.append(f"> - {name}: {_commit_cell(e['run'])}, run of {e['run']['date']}{here}")
        lines.append("")
    if run is not None:
        dirty = " — **DIRTY RUN: the code differed from this commit**" if run.get("dirty") else ""
        lines += [
            f"## Run{dirty}",
            "",
            f"- commit: {_commit_cell(run)}",
            f"- date: {run['date']}",
            f"- command: `{run['command']}`",
            f"- machine: {run.get('machine') or machine_summary()}",
        ]
        if run.get("probe_gbps") is not None:
            fastest = (
                f", fastest pass {run['probe_fastest_gbps']:.1f} GB/s"
                if run.get("probe_fastest_gbps") is not None
                else ""
            )
            lines.append(
                f"- streaming-read bandwidth probe: {run['probe_gbps']:.1f} GB/s sustained{fastest} "
                f"({run['probe']}, measured before the first report)"
            )
        lines += [f"- model: `{cfg.model}`", ""]
    if quick:
        lines += [
            "> **--quick** rows: one repeat, tiny sizes. They test that the report still renders; they are "
            "not benchmark results. Run without --quick for the real reports.",
            "",
        ]
    lines += [
        "Every report ran in its own process in the order below (the order is part of the method: "
        "accuracy first, so later tables flag unusable formats; kernels second, so later engines dispatch "
        "by this machine's calibration; the serve reports last, each with its own server). Each report opens "
        "with its own command, commit, machine, versions and date.",
        "",
        "| # | report | what it shows | command | status | finished (UTC), commit | wall (s) | peak RSS (GB) |",
        "|--:|:--|:--|:--|:--|:--|--:|--:|",
    ]
    planned = {s.name: s for s in plan_steps(cfg, list(STEP_NAMES))}
    for i, name in enumerate(STEP_NAMES, 1):
        e = entries.get(name)
        if e is None:
            step = planned[name]
            cmd = "glowplug " + " ".join(shlex.quote(a) for a in step.argv)
            lines.append(f"| {i} | {name} | {step.what} | `{cmd}` | not run yet | - | - | - |")
            continue
        links = ", ".join(f"[{p}]({p})" for p in e["outputs"])
        status = ("ok" if e["returncode"] == 0 and not e["error"] else (e["error"] or f"exit {e['returncode']}")) + (
            " (--quick)" if e.get("quick") else ""
        )
        rss = f"{e['peak_rss_gb']:.2f}" if e.get("peak_rss_gb") is not None else "n/a (not measured)"
        cmd = "glowplug " + " ".join(shlex.quote(a) for a in e["argv"])
        commit = (
            "the run's" + (" (**DIRTY RUN**)" if e["run"].get("dirty") else "")
            if name not in others
            else f"⚠ OTHER RUN: {_commit_cell(e['run'])}"
        )
        lines.append(
            f"| {i} | {links} | {e['what']} | `{cmd}` | {status} | {e['finished']}, {commit} | "
            f"{e['wall_s']:.0f} | {rss} |"
        )
    if (cfg.out / "gpu" / "README.md").is_file():
        # The one report this CPU run cannot make; it names its own commit, GPU and torch.
        lines += [
            "",
            "Not made by this run: [gpu/README.md](gpu/README.md), `scripts/device_check.sh` on a lent GPU "
            "machine (its README names the commit, the GPU and the torch it ran on).",
        ]
    lines += [
        "",
        "Logs of every command: `logs/<report>.log`. Peak RSS: the high-water mark of the largest single "
        f"process of that report (getrusage of the child and the children it waited for, such as a serve "
        f"report's server). Outcomes are kept in `{SIDECAR}`; this file is regenerated from it.",
        "",
    ]
    pngs = sorted(p.relative_to(cfg.out) for p in cfg.out.rglob("*.png"))
    if pngs:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in pngs] + [""]
    return "\n".join(lines)


def run_all(cfg: BenchAllConfig, argv: list[str] | None = None, progress: Any = None) -> list[StepResult]:
    """Run the selected reports. Raises DirtyTreeError, before anything runs or is written, when tracked files
    outside cfg.out differ from HEAD and cfg.allow_dirty is not set."""
    from .machine import command_line, git_state, machine_summary, measure_probe_stats

    say = progress or (lambda _msg: None)
    # Once, before the first report: every report of the run names this state, whatever happens to the tree later.
    state = git_state(cfg.out)
    if state.dirty and not cfg.allow_dirty:
        why = f" ({state.error})" if state.error else ""
        what = (
            f"the code differs from HEAD {state.commit}{why} (outside {cfg.out}): commit it"
            if state.commit
            else f"the code's commit is unknown{why}: run from a git checkout"
        )
        raise DirtyTreeError(
            f"{what}, or pass --allow-dirty to run anyway (the index and every report then say DIRTY RUN)"
        )
    cfg.out.mkdir(parents=True, exist_ok=True)
    logs = cfg.out / "logs"
    logs.mkdir(exist_ok=True)
    probe = measure_probe_stats(passes=2, size_bytes=64 << 20) if cfg.quick else measure_probe_stats()
    this_run = {
        "command": command_line(argv),
        "commit": state.commit or f"unknown ({state.error})",
        "dirty": state.dirty,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_summary(),
        "probe_gbps": probe.sustained,
        "probe_fastest_gbps": probe.fastest,
        "quick": cfg.quick,
        "probe": probe.describe() + (" (--quick)" if cfg.quick else ""),
    }
    # A full run is a fresh index; a chunk joins the index's run only at the same clean commit.
    sidecar = load_sidecar(cfg.out) if cfg.only is not None else {"run": None, "entries": {}}
    if sidecar["run"] is None or not same_run(sidecar["run"], this_run):
        sidecar["run"] = this_run
    run = sidecar["run"]
    results = []
    for step in plan_steps(cfg):
        say(f"[{len(results) + 1}] {step.name}: glowplug {' '.join(step.argv)}")
        if step.skip is not None:
            results.append(StepResult(step, 0, 0.0, None, f"skipped: {step.skip}"))
        else:
            results.append(run_step(step, cfg.timeout_s, logs / f"{step.name}.log", cfg.out, state.env()))
        last = results[-1]
        say(f"    {'ok' if last.returncode == 0 and not last.error else last.error} in {last.wall_s:.0f} s")
        finished = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        sidecar["entries"][step.name] = entry_of(results[-1], cfg.quick, finished, run)
        # Both files are rewritten after every report: a stopped run still says what it has.
        (cfg.out / SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n")
        (cfg.out / "README.md").write_text(render_readme(cfg, sidecar))
    return results


def main(cfg: BenchAllConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    try:
        results = run_all(cfg, argv, progress=lambda msg: err.print(msg, markup=False))
    except DirtyTreeError as e:
        err.print(f"glowplug bench all: {e}", markup=False, soft_wrap=True)
        return 2
    err.print(f"wrote {cfg.out / 'README.md'}", markup=False)
    return 0 if all(r.returncode == 0 for r in results) else 1


def _checked_main(cfg: BenchAllConfig, argv: list[str] | None) -> int:
    cfg.steps()  # an unknown --only name fails before anything runs
    return main(cfg, argv)


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "all",
        help_text="Regenerate every report into --out, in a fixed order, with README.md.",
        description=__doc__,
        config_cls=BenchAllConfig,
        add_model_flags=add_model_flags,
        runner=_checked_main,
    )
