"""`glowplug bench decode`: decode tokens/s per compile mode, dtype, quantization and batch size, against transformers'
`generate` on the same model and prompts, with the weight traffic set against a streaming-read probe.

Definitions (the report prints them under its table):
- decode tok/s: tokens produced after every sequence of the batch has its first token (prefill excluded), divided
  by the time from then to the end of the batch. transformers' decode time is generate(N tokens) minus
  generate(1 token) on the same inputs, so its prefill is excluded the same way.
- model_size MB (seed 003's model_size): the weight bytes one decode step reads through the kernels this path
  runs: glowplug's native layouts when compiled (kernels.native), the eager dispatcher's chosen layouts otherwise,
  the LM head included (an embedding lookup reads a few rows only, so it is left out).
- % of probe: achieved GB/s (model_size x steps/s) over a streaming-read probe (torch `sum` over 1 GiB fp32, the
  fastest of 5) measured immediately before the same repeat. The host's memory bandwidth changes from minute to
  minute on shared machines, so every repeat carries its own probe.
- step / batch-1: this cell's ms per step over the batch-1 cell's of the same configuration.
- host ms / step: per decode step, its wall time minus the time inside the model call (the compiled decode step,
  or the eager forward) and inside the sampler, as the runner books them (ModelRunner.step_times); the median over
  the run's steps. What is left is the engine's own work: scheduling, the step's input, booking the results,
  detokenizing, the outputs.
Each cell is run `repeats` times (fresh requests each time); the table shows the median and the min-max spread.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ...engine.config import EngineConfig
from .machine import PROBE_REPEATS, measure_probe, report_header

PROMPT_WORDS = (
    "glowplug", "schedules", "prefill", "chunks", "while", "decode", "steps", "stream", "tokens", "from", "a",
    "paged", "cache", "of", "blocks", "that", "share", "prefixes", "and", "free", "on", "abort",
)  # fmt: skip


class DecodeBenchConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "smollm2"
    batch_sizes: tuple[int, ...] = Field((1, 16, 64), min_length=1)
    quantization: tuple[Literal["auto", "none", "int8", "int4", "int2", "w8a8"], ...] = ("none",)
    compile: tuple[Literal["on", "off"], ...] = Field(("on", "off"), min_length=1)
    dtype: tuple[Literal["auto", "float32", "bfloat16", "float16"], ...] = Field(
        ("auto",), min_length=1,
        description="Model dtypes: unquantized runs in each; quantized formats run in the first one only.",
    )  # fmt: skip
    kv_cache_dtype: tuple[Literal["auto", "int8"], ...] = Field(
        ("auto",), min_length=1, description="KV-cache dtypes (int8: quantized KV)."
    )
    prompt_tokens: tuple[Annotated[int, Field(ge=1, le=32768)], ...] = Field(
        (64,), min_length=1,
        description="Prompt lengths: each is a context column (the tokens in the KV cache when decoding starts). "
        "Cells whose batch x (prompt + new tokens) exceeds the KV cache are left out, and listed under the table.",
    )  # fmt: skip
    new_tokens: int = Field(128, ge=4, le=4096)
    repeats: int = Field(3, ge=1, le=50, description="Timed runs per cell (median and min-max are reported).")
    quantize_lm_head: bool = True
    compare_hf: bool = Field(True, description="Time transformers' generate on the same prompts (fp32 on a CPU, bf16 "
                             "on a GPU).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where both engines run (auto: CUDA if "
                                                   "torch sees a GPU).")
    max_model_len: tuple[Annotated[int, Field(ge=16)], ...] = Field(
        (), description="Max model lengths, each a cell (default: the longest prompt + new tokens): a decode step's "
        "time must not grow with the length allowed, only with the context held.",
    )  # fmt: skip
    quality_from: Path | None = Field(None, description="Accuracy JSON whose >2x-bf16-perplexity formats get flagged.")
    out: Path | None = None

    @field_validator("max_model_len")
    @classmethod
    def _lengths_hold_the_runs(cls, v: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        if not v or "prompt_tokens" not in info.data or "new_tokens" not in info.data:
            return v  # unset, or those fields failed their own checks (reported on their own)
        longest = max(info.data["prompt_tokens"]) + info.data["new_tokens"]
        if min(v) < longest:
            raise ValueError(f"{min(v)} is shorter than the longest prompt + new tokens ({longest}); pass at least "
                             f"{longest}, or fewer --prompt-tokens/--new-tokens")
        return v


@dataclass
class DecodeRow:
    engine: str  # "glowplug" | "transformers"
    compile: str  # "on" | "off" | "-"
    dtype: str
    quantization: str
    batch: int
    tokens_per_s: list[float]
    step_ms: list[float]
    probe_gbps: list[float]
    mb_per_token: float | None = None
    kv_cache_dtype: str = "auto"
    group_size: str = "-"  # the quantized layers' group sizes ("channel" = per output channel)
    context: int = 0  # prompt tokens: what the KV cache holds when decoding starts
    level: str = "-"  # the native kernels' ISA level (base.machine.ISA_LEVELS), "-" without them
    max_model_len: int = 0  # the engine's --max-model-len (0: transformers' rows)
    kv_mb: float | None = None  # KV bytes one batch-1 decode step reads, at the decode's mean context, in MB
    skipped: str = ""  # why this cell was left out (no measurements then)
    prefill_ms: list[float] = field(default_factory=list)  # whole batch: requests added -> every first token
    host_ms: list[float] = field(default_factory=list)  # median host ms per decode step of each run (see above)
    peak_gb: list[float] = field(default_factory=list)  # process RSS high-water mark during each timed run
    hf_tokens_per_s: float | None = None  # median of transformers at the same batch (set after the run)
    batch1_step_ms: float | None = None  # median step of the same configuration at batch 1
    notes: list[str] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def shares(self) -> list[float]:
        if self.mb_per_token is None:
            return []
        return [self.mb_per_token / 1e3 / (ms / 1e3) / p for ms, p in zip(self.step_ms, self.probe_gbps)]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.skipped:
            return d
        d.update(median_tokens_per_s=self.tps, median_step_ms=self.ms, probe_share=self.shares,
                 model_size_mb=self.mb_per_token)
        return d


def make_prompts(tokenizer: Any, batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `prompt_tokens` tokens each (no prefix sharing between them)."""
    prompts = []
    for b in range(batch):
        words = [PROMPT_WORDS[(b * 7 + i * 3) % len(PROMPT_WORDS)] for i in range(prompt_tokens)]
        ids = list(tokenizer(f"Request {b}: " + " ".join(words))["input_ids"])[:prompt_tokens]
        prompts.append(ids + ids[: prompt_tokens - len(ids)])
    return prompts


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def weight_bytes_per_token(model: Any, compiled: bool) -> int:
    """Bytes of weights one batch-1 decode step reads through its kernels (see module docstring)."""
    from ...engine.models.llama import RMSNorm, TiedHead
    from ...kernels.modules import DenseLinear, QuantLinear
    from ...kernels.native import native_weight_bytes

    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            if compiled and mod.native is not None:
                total += native_weight_bytes(mod.native)
            else:
                rt = mod.runtime
                total += _tensor_bytes(rt.states[mod.dispatcher.choose(rt, 1)])
            if mod.bias is not None:
                total += _tensor_bytes(mod.bias)
        elif isinstance(mod, DenseLinear):
            total += _tensor_bytes(mod.weight) + (_tensor_bytes(mod.bias) if mod.bias is not None else 0)
        elif isinstance(mod, (TiedHead, RMSNorm)):
            total += _tensor_bytes(mod.weight)
    return total


@dataclass(frozen=True)
class EngineDecodeTiming:
    tokens_per_s: float  # decode tokens/s
    step_ms: float  # ms per decode step
    prefill_ms: float
    host_ms: float  # median over the decode steps of wall - model call - sampler (see the module docstring)


def time_engine_decode(engine: Any, prompts: list[list[int]], new_tokens: int) -> EngineDecodeTiming:
    """One batch run to completion, timed (see EngineDecodeTiming)."""
    from ...engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    p0 = time.perf_counter()
    reqs = [engine.add_request(None, params, prompt_token_ids=p) for p in prompts]
    seqs = [s for r in reqs for s in r.seqs]
    while engine.has_unfinished() and not all(s.output_token_ids for s in seqs):
        engine.step()
    prefill_ms = (time.perf_counter() - p0) * 1000
    tokens0 = sum(len(s.output_token_ids) for s in seqs)
    runner = engine.runner
    host_ns: list[int] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        # Per step, not over the run: each step's own host time, whose median leaves out the odd step that a
        # garbage collection or another process interrupted.
        before = runner.step_times()
        a = time.perf_counter_ns()
        engine.step()
        wall = time.perf_counter_ns() - a
        after = runner.step_times()
        host_ns.append(wall - (after.model_ns - before.model_ns) - (after.sample_ns - before.sample_ns))
    elapsed = time.perf_counter() - t0
    steps = len(host_ns)
    generated = sum(len(s.output_token_ids) for s in seqs) - tokens0
    host_ms = statistics.median(host_ns) / 1e6 if host_ns else 0.0
    return EngineDecodeTiming(generated / elapsed, elapsed / max(steps, 1) * 1000, prefill_ms, host_ms)


def time_hf_decode(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, float]:
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)

    def now() -> float:  # generate returns once its tokens are on the host, but be explicit on a GPU
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    with torch.inference_mode():
        t0 = now()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = now()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = now()
    decode = (t2 - t1) - (t1 - t0)
    steps = new_tokens - 1
    return len(prompts) * steps / decode, decode / steps * 1000


def _cells(cfg: DecodeBenchConfig) -> list[tuple[str, str, str, str]]:
    """(compile, dtype, quantization, kv-cache dtype) in run order: unquantized in every dtype, quantized in the
    first dtype (so each quantized row has its bf16 baseline at the same dtype and compile mode), each KV dtype."""
    out = []
    for mode in cfg.compile:
        for kv in cfg.kv_cache_dtype:
            for dtype in cfg.dtype:
                out.append((mode, dtype, "none", kv))
            out += [(mode, cfg.dtype[0], q, kv) for q in cfg.quantization if q != "none"]
    if "none" not in cfg.quantization:
        out = [c for c in out if c[2] != "none"]
    return out


def group_sizes(model: Any) -> str:
    """The distinct group sizes of the model's quantized layers ("-" unquantized, "channel" per output row)."""
    from ...kernels.modules import QuantLinear

    seen = {getattr(m, "group_size", None) for m in model.modules() if isinstance(m, QuantLinear)}
    if not seen:
        return "-"
    return "/".join(sorted(("channel" if g is None else f"g{g}") for g in seen))


def bench_device(choice: str) -> str:
    """The device both engines run on: `auto` is CUDA when torch sees a GPU."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def hf_peer_dtype(device: str) -> Any:
    """transformers' dtype: bf16 on a GPU (what its users serve in there), fp32 on a CPU (its fast dtype there)."""
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def run_decode_bench(cfg: DecodeBenchConfig) -> list[DecodeRow]:
    from glowplug.base.errors import require_extra

    from ...engine.llm import LLM
    from ...kernels.native import loaded_level
    from ..memory import PeakMemory

    if cfg.compare_hf:
        # transformers is an extra: say so now, not after the glowplug rows' minutes. It is imported only where the
        # peer runs, after them, so that the glowplug rows run in a process without it, as the server does.
        require_extra(("transformers",), "bench decode's transformers peer (--no-compare-hf skips it)", "bench")
    rows: list[DecodeRow] = []
    model_dir = None
    longest = max(cfg.prompt_tokens) + cfg.new_tokens
    device = bench_device(cfg.device)
    lens = cfg.max_model_len or (longest,)  # each at least `longest` (the config's validator)
    for (mode, dtype, quant, kv), max_len in ((c, n) for c in _cells(cfg) for n in lens):
        llm = LLM(
            config=EngineConfig.from_flat(
                model=cfg.model, dtype=dtype, quantization=quant, compile=mode, max_model_len=max_len,
                max_num_seqs=max(cfg.batch_sizes), max_num_batched_tokens=2048,  # long prompts: chunked
                quantize_lm_head=cfg.quantize_lm_head, kv_cache_dtype=kv, device=device,
            )
        )  # fmt: skip
        # The server commits its KV pool (resident, on huge pages) right after READY; a fresh offline pool instead
        # commits 4 KiB per first write, and the block manager's least-recently-freed order walks the whole pool,
        # so every run here would page-fault on fresh pages for a while. Committing measures the serving steady
        # state (engine/host_memory.py says why the offline LLM does not commit on its own).
        llm.engine.commit_kv_cache()
        model_dir = llm.startup.model_dir
        resolved = str(llm.startup.dtype).removeprefix("torch.")
        compiled = llm.engine.runner.decode_step is not None
        wbytes = weight_bytes_per_token(llm.engine.model, compiled)
        groups = group_sizes(llm.engine.model)
        level = loaded_level() or "-"
        stats = llm.engine.stats()
        capacity = stats.kv_blocks * stats.block_size
        per_token = llm.startup.kv_plan.bytes_per_token
        for batch in cfg.batch_sizes:
            for context in cfg.prompt_tokens:
                need = batch * -(-(context + cfg.new_tokens) // stats.block_size) * stats.block_size
                if need > capacity:
                    rows.append(DecodeRow("glowplug", mode, resolved, quant, batch, [], [], [], None, kv, groups,
                                          context=context, level=level, max_model_len=max_len,
                                          skipped=f"needs {need} KV tokens, the cache holds {capacity}"))  # fmt: skip
                    continue
                prompts = make_prompts(llm.tokenizer, batch, context)
                row = DecodeRow("glowplug", mode, resolved, quant, batch, [], [], [], wbytes / 1e6, kv, groups,
                                context=context, level=level, max_model_len=max_len,
                                kv_mb=per_token * (context + cfg.new_tokens / 2) / 1e6)  # fmt: skip
                if batch > llm.engine.runner.max_decode_batch and compiled:
                    row.notes.append("above the compiled batch sizes: eager steps")
                time_engine_decode(llm.engine, prompts[: min(batch, 2)], 8)  # warm this batch shape's allocations
                for _ in range(cfg.repeats):
                    row.probe_gbps.append(measure_probe(device=device))
                    with PeakMemory(device) as window:
                        timing = time_engine_decode(llm.engine, prompts, cfg.new_tokens)
                    assert window.snapshot is not None
                    row.peak_gb.append(window.snapshot.peak_bytes / 1e9)
                    row.tokens_per_s.append(timing.tokens_per_s)
                    row.step_ms.append(timing.step_ms)
                    row.prefill_ms.append(timing.prefill_ms)
                    row.host_ms.append(timing.host_ms)
                rows.append(row)
        for row in rows:  # each row's batch-1 step: same configuration and context
            if (row.compile == mode and row.quantization == quant and row.kv_cache_dtype == kv and not row.skipped
                    and row.max_model_len == max_len):  # fmt: skip
                one = next((b for b in rows if b.batch == 1 and b.context == row.context and b.compile == mode
                            and b.quantization == quant and b.kv_cache_dtype == kv and b.dtype == row.dtype
                            and b.max_model_len == max_len and not b.skipped), None)  # fmt: skip
                row.batch1_step_ms = one.ms if one is not None else None
        del llm
        if device == "cuda":
            # The next cell sizes its KV cache from the GPU's memory: this engine's must be gone first.
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()
    if cfg.compare_hf and model_dir is not None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ...engine.models.store import transformers_args

        where, kw = transformers_args(model_dir)  # a folder prepared from a GGUF: transformers reads the GGUF
        hf_dtype = hf_peer_dtype(device)
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=hf_dtype, **kw).to(device).eval()
        tok = AutoTokenizer.from_pretrained(where, **kw)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        context = cfg.prompt_tokens[0]  # the peer at the first context only: fp32 generate at long ones takes minutes
        for batch in cfg.batch_sizes:
            row = DecodeRow("transformers", "-", str(hf_dtype).removeprefix("torch."), "none", batch, [], [], [],
                            context=context)  # fmt: skip
            prompts = make_prompts(tok, batch, context)
            time_hf_decode(hf, prompts[:1], 4, pad)
            for _ in range(cfg.repeats):
                row.probe_gbps.append(measure_probe(device=device))
                tps, step_ms = time_hf_decode(hf, prompts, cfg.new_tokens, pad)
                row.tokens_per_s.append(tps)
                row.step_ms.append(step_ms)
            rows.append(row)
        hf_tps = {r.batch: r.tps for r in rows if r.engine == "transformers"}
        for r in rows:
            if r.engine == "glowplug" and r.context == context and not r.skipped:
                r.hf_tokens_per_s = hf_tps.get(r.batch)
    return rows


def render_markdown(rows: list[DecodeRow], cfg: DecodeBenchConfig, argv: list[str] | None) -> str:
    from .quality import flag_note, load_flags
    from .tables import fmt_spread

    flags = load_flags(cfg.quality_from)
    measured = [r for r in rows if not r.skipped]
    probes = [p for r in measured for p in r.probe_gbps]
    contexts = ", ".join(str(c) for c in cfg.prompt_tokens)
    hf_label = next((r.dtype for r in measured if r.engine == "transformers"), "fp32").replace("float32", "fp32")
    lines = [
        report_header("Decode throughput", argv),
        f"Model `{cfg.model}`, context (prompt tokens) {contexts}, {cfg.new_tokens} new tokens per sequence, greedy, "
        f"{cfg.repeats} runs per cell. Streaming-read probe in this run (fastest of {PROBE_REPEATS} sums over 1 GiB, "
        f"re-measured before every run): median {statistics.median(probes):.1f} GB/s, "
        f"{min(probes):.1f}-{max(probes):.1f}.",
        "",
        "| engine | ISA level | compile | dtype | quantization | group | KV cache | max model len | batch | context "
        "| decode tok/s "
        "| ms / step | host ms / step | prefill ms | peak mem GB | model_size MB | GB/s | % of probe "
        "| KV MB / step | extra ms over the shortest context | KV read at % of probe "
        f"| vs bf16 (same dtype, compile) | vs transformers {hf_label} | step / batch-1 step |",
        "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in measured:
        mb = f"{r.mb_per_token:.1f}" if r.mb_per_token is not None else ""
        share = fmt_spread([100 * s for s in r.shares], 1) if r.shares else ""
        hf = f"{r.tps / r.hf_tokens_per_s:.2f}x" if r.hf_tokens_per_s else "-"
        gbps = fmt_spread([r.mb_per_token / ms for ms in r.step_ms], 1) if r.mb_per_token is not None else "-"
        base = next((b for b in measured if b.engine == r.engine and b.quantization == "none" and b.dtype == r.dtype
                     and b.compile == r.compile and b.kv_cache_dtype == r.kv_cache_dtype and b.batch == r.batch
                     and b.context == r.context and b.max_model_len == r.max_model_len), None)  # fmt: skip
        vs_bf16 = f"{r.tps / base.tps:.2f}x" if base is not None and r.quantization != "none" else "-"
        prefill = fmt_spread(r.prefill_ms, 1) if r.prefill_ms else "-"
        host = fmt_spread(r.host_ms, 3) if r.host_ms else "-"  # transformers' generate has no such split
        peak = fmt_spread(r.peak_gb, 2) if r.peak_gb else "-"
        scale = f"{r.ms / r.batch1_step_ms:.2f}x" if r.batch1_step_ms and r.batch != 1 else ""
        kv_mb = f"{r.kv_mb * r.batch:.1f}" if r.kv_mb is not None else "-"
        extra, kv_share = _long_context(r, measured)
        note = f" ({'; '.join(r.notes)})" if r.notes else ""
        lines.append(
            f"| {r.engine} | {r.level} | {r.compile} | {r.dtype} | {r.quantization}"
            f"{' ' + flags[r.quantization] if r.quantization in flags else ''} | {r.group_size} | {r.kv_cache_dtype} "
            f"| {r.max_model_len or '-'} | {r.batch} | {r.context} | {fmt_spread(r.tokens_per_s, 1)} | {fmt_spread(r.step_ms, 2)} | {host} "
            f"| {prefill} | {peak} | {mb or '-'} | {gbps} | {share or '-'} | {kv_mb} | {extra} | {kv_share} "
            f"| {vs_bf16} | {hf} | {scale or '-'}{note} |"
        )
    lines += _max_len_table(measured)
    left_out = [r for r in rows if r.skipped]
    if left_out:
        lines += ["", "Left out (the KV cache cannot hold the batch at that context):"]
        lines += [f"- {r.compile}/{r.dtype}/{r.quantization}/KV {r.kv_cache_dtype}, batch {r.batch}, context "
                  f"{r.context}: {r.skipped}" for r in left_out]  # fmt: skip
    lines += ["", *[f"- {line}" for line in DEFINITIONS], *([f"- {flag_note(flags)}"] if flags else []), ""]
    return "\n".join(lines)


def _max_len_table(rows: list[DecodeRow]) -> list[str]:
    """With several --max-model-len cells: each cell's ms / step over the same configuration's at the shortest max
    model len, paired run by run (median and the worst pair). Issue 38's target: within 5% (8192 vs 512)."""
    lens = sorted({r.max_model_len for r in rows if r.engine == "glowplug"})
    if len(lens) < 2:
        return []
    out = ["", f"Step time against max model len {lens[0]} (same configuration, batch and context; runs paired in "
           "order):", "", "| compile | dtype | quantization | KV cache | batch | context | max model len "
           "| ms / step | ratio median | worst pair |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if r.engine != "glowplug" or r.max_model_len == lens[0]:
            continue
        base = next((b for b in rows if b.engine == "glowplug" and b.max_model_len == lens[0] and b.compile == r.compile
                     and b.dtype == r.dtype and b.quantization == r.quantization and b.kv_cache_dtype == r.kv_cache_dtype
                     and b.batch == r.batch and b.context == r.context), None)  # fmt: skip
        if base is None:
            continue
        pairs = [a / b for a, b in zip(r.step_ms, base.step_ms)]
        out.append(f"| {r.compile} | {r.dtype} | {r.quantization} | {r.kv_cache_dtype} | {r.batch} | {r.context} "
                   f"| {r.max_model_len} | {r.ms:.3f} vs {base.ms:.3f} | {statistics.median(pairs):.3f}x "
                   f"| {max(pairs):.3f}x |")  # fmt: skip
    return out


def _long_context(r: DecodeRow, rows: list[DecodeRow]) -> tuple[str, str]:
    """This row's step time over the same configuration's at the shortest context, paired run by run, and the KV
    bytes it reads more, as GB/s over that extra time against each run's probe (issue 34's long-context target: at
    least 70%)."""
    from .tables import fmt_spread

    if r.engine != "glowplug" or r.kv_mb is None:
        return "-", "-"
    same = [b for b in rows if b.engine == r.engine and b.compile == r.compile and b.dtype == r.dtype
            and b.quantization == r.quantization and b.kv_cache_dtype == r.kv_cache_dtype and b.batch == r.batch
            and b.max_model_len == r.max_model_len and b.kv_mb is not None]  # fmt: skip
    short = min(same, key=lambda b: b.context)
    if short is r:
        return "-", "-"
    assert short.kv_mb is not None
    extra = [a - b for a, b in zip(r.step_ms, short.step_ms)]
    kv_gb = (r.kv_mb - short.kv_mb) * r.batch / 1e3
    shares = [100 * kv_gb / (e / 1e3) / p for e, p in zip(extra, r.probe_gbps) if e > 0]
    return fmt_spread(extra, 2), (fmt_spread(shares, 1) if shares else "-")


DEFINITIONS = (
    "decode tok/s: tokens after every sequence's first token, over the time from then to the batch's end (prefill "
    "excluded, for both engines). Every cell with a spread: median over the runs (min–max); one run is marked n=1.",
    "ms / step: decode time over decode steps; one step produces one token per sequence.",
    "host ms / step: the median decode step's wall time minus its model call (compiled step or eager forward) and "
    "its sampler: the engine's own work per step (scheduling, inputs, booking, detokenizing, outputs).",
    "prefill ms: requests added -> every sequence of the batch has its first token (seed 000's prefill column).",
    "peak mem GB: the process's RSS high-water mark during the run (seed 003's peak_mem; VmHWM reset per run). "
    "glowplug's KV pool is committed before the runs, as the server commits it after READY, so this includes the "
    "whole pool (on the CPU at most 2 GiB by default).",
    "GB/s: model_size over ms / step, the weight bandwidth achieved (seed 003's mem/s; KV reads not included).",
    "group: the quantized layers' group sizes (channel = one scale per output row); KV cache int8: quantized KV.",
    "vs bf16: decode tok/s over the unquantized row at the same dtype, compile mode, KV dtype and batch.",
    "model_size MB: seed 003's model_size, the weight bytes one batch-1 decode step reads through the kernels the path runs (compile on: "
    "glowplug's native layouts; off: the eager dispatcher's), LM head included.",
    "% of probe: GB/s as a percentage of the streaming-read probe measured right before the same run.",
    "vs transformers: decode tok/s over transformers' `generate` at the same batch on the same prompts and device (fp32 "
    "on a CPU, bf16 on a GPU).",
    "max model len: the engine's --max-model-len; a step's time should follow the context held, not this (see "
    "the paired table below the main one when there are several).",
    "step / batch-1 step: this cell's ms per step over the batch-1 cell of the same configuration and context.",
    "ISA level: the native kernels' variant (portable, avx2, avx512, avx512_bf16, amx; GLOWPLUG_MAX_CPU_ISA caps it).",
    "context: the prompt's tokens, what the KV cache holds when decoding starts; KV MB / step: the KV bytes one step "
    "reads at the decode's mean context (prompt + half the new tokens), the whole batch.",
    "extra ms over the shortest context: this cell's ms / step minus the same configuration's at the shortest "
    "context, run by run; KV read at % of probe: the KV bytes it reads more, over that extra time, as a share of "
    "the run's probe (issue 34's target at 2,048 tokens: at least 70%).",
    "compile on: the decode step as one graph (Dynamo + Inductor, glowplug's native GEMV kernels); compile off: "
    "every step eager with stock torch kernels (F.linear, the aten packed int8/int4 kernels through the dispatcher).",
)


def rows_as_dicts(rows: list[DecodeRow]) -> list[dict[str, Any]]:  # left-out cells too, with their reason
    return [r.as_dict() for r in rows]
