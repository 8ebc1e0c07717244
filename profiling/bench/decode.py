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
- vs <peer> (transformers per --hf-dtype, llama.cpp with --peers llamacpp): paired within the run. Each repeat times
  the glowplug cell and then every peer on the same prompt token ids, back to back after one probe; ratio_i =
  glowplug tok/s_i / peer tok/s_i; the cell shows the median ratio and the worst pair (peers.py has each peer's
  decode-time definition). The peers are loaded before the first cell, so they share the process with glowplug
  (their weights are a column of the memory split).
- memory split (memory_split.py): peak RSS = weights + KV pool + peers + rest, per cell.
- host ms / step: per decode step, its wall time minus the time inside the model call (the compiled decode step,
  or the eager forward) and inside the sampler, as the runner books them (ModelRunner.step_times); the median over
  the run's steps. What is left is the engine's own work: scheduling, the step's input, booking the results,
  detokenizing, the outputs.
Each cell is run `repeats` times (fresh requests each time); the table shows the median and the min-max spread.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ...engine.config import EngineConfig
from .machine import PROBE_REPEATS, measure_probe, report_header
from .peers import Peer, PeerRuns, SkippedPeer

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
    compare_hf: bool = Field(True, description="Time transformers' generate on the same prompts, paired with every "
                             "glowplug run at the first context (one peer per --hf-dtype).")
    hf_dtype: tuple[Literal["auto", "float32", "bfloat16", "float16"], ...] = Field(
        ("auto",), min_length=1,
        description="transformers peer dtypes, one column each (auto: fp32 on a CPU, bf16 on a GPU).",
    )  # fmt: skip
    peers: tuple[Literal["llamacpp"], ...] = Field(
        (), description="Other peers, paired like transformers (llamacpp: llama-cpp-python on the same GGUF, the "
        "threads torch uses, batch 1 only; its column says why when it cannot run).",
    )  # fmt: skip
    group_size: int | None = Field(
        None, description="Quantization group size for the int8/int4/int2 cells (32, 64, 128, 256; int2: 128); "
        "unset: the engine's default. Other formats ignore it.",
    )  # fmt: skip
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
    run_at: list[str] = field(default_factory=list)  # each timed run's start, seed 003's YYYYmmddHHMMSS stamp
    peers: list[PeerRuns] = field(default_factory=list)  # peers timed back to back with each run (peers.py)
    weights_gb: float | None = None  # memory split (memory_split.py): tensors the model holds
    kv_pool_gb: float | None = None  # the engine's KV cache tensors
    peers_gb: float | None = None  # peer models resident in the same process
    rss_before_gb: float | None = None  # process RSS just before this cell's engine was built
    batch1_step_ms: float | None = None  # median step of the same configuration at batch 1
    # CUDA: this engine's graph pool after capture (allocator snapshot) and the largest captured size's activations
    graph_pool_gb: float | None = None
    graph_activation_gb: float | None = None
    graph_largest_size: int | None = None
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

    @property
    def rest_gb(self) -> list[float]:
        """Per run: peak minus weights, KV pool and peers (memory_split.py)."""
        if self.weights_gb is None or self.kv_pool_gb is None:
            return []
        return [p - self.weights_gb - self.kv_pool_gb - (self.peers_gb or 0.0) for p in self.peak_gb]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.skipped:
            return d
        d.update(median_tokens_per_s=self.tps, median_step_ms=self.ms, probe_share=self.shares,
                 model_size_mb=self.mb_per_token, rest_gb=self.rest_gb,
                 peer_ratios={p.label: p.ratios(self.tokens_per_s) for p in self.peers})  # fmt: skip
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


def hf_peer_dtype(device: str, choice: str = "auto") -> Any:
    """transformers' dtype: bf16 on a GPU (what its users serve in there), fp32 on a CPU (its fast dtype there)."""
    import torch

    if choice != "auto":
        return getattr(torch, choice)
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_peers(cfg: DecodeBenchConfig, device: str) -> list[Peer]:
    """Every requested peer, loaded once before the first glowplug cell (each is then timed inside every cell)."""
    if not cfg.compare_hf and not cfg.peers:
        return []
    import torch

    from ...engine.models.store import resolve_model
    from .peers import load_hf_peers, load_llamacpp_peer

    model_dir = resolve_model(cfg.model, quiet=True)
    out: list[Peer] = []
    if cfg.compare_hf:
        dtypes = list(dict.fromkeys(hf_peer_dtype(device, d) for d in cfg.hf_dtype))
        out += load_hf_peers(model_dir, dtypes, device)
    if "llamacpp" in cfg.peers:
        if device != "cpu":
            out.append(SkippedPeer("llama.cpp", f"the bench runs on {device}; the llama.cpp peer is CPU-only here"))
        else:
            n_ctx = cfg.prompt_tokens[0] + cfg.new_tokens + 16
            out.append(load_llamacpp_peer(model_dir, n_ctx=n_ctx, n_threads=torch.get_num_threads()))
    return out


def _engine_fields(cfg: DecodeBenchConfig, mode: str, dtype: str, quant: str, kv: str, max_len: int,
                   device: str) -> dict[str, Any]:  # fmt: skip
    fields: dict[str, Any] = dict(
        model=cfg.model, dtype=dtype, quantization=quant, compile=mode, max_model_len=max_len,
        max_num_seqs=max(cfg.batch_sizes), max_num_batched_tokens=2048,  # long prompts: chunked
        quantize_lm_head=cfg.quantize_lm_head, kv_cache_dtype=kv, device=device,
    )  # fmt: skip
    if cfg.group_size is not None and quant in ("int8", "int4", "int2"):
        fields["group_size"] = cfg.group_size  # the engine refuses a group size on the other formats
    return fields


def _time_cell(engine: Any, row: DecodeRow, prompts: list[list[int]], cfg: DecodeBenchConfig, device: str,
               peers: list[Peer]) -> None:  # fmt: skip
    """The cell's repeats; at the peer context each repeat also times every peer right after glowplug's run."""
    from datetime import datetime

    from ..memory import PeakMemory

    paired = row.context == cfg.prompt_tokens[0]
    if paired:
        row.peers = [PeerRuns(p.label, skipped=p.skip_reason(row.batch) or "") for p in peers]
    for _ in range(cfg.repeats):
        row.probe_gbps.append(measure_probe(device=device))
        row.run_at.append(datetime.now().strftime("%Y%m%d%H%M%S"))
        with PeakMemory(device) as window:
            timing = time_engine_decode(engine, prompts, cfg.new_tokens)
        assert window.snapshot is not None
        row.peak_gb.append(window.snapshot.peak_bytes / 1e9)
        row.tokens_per_s.append(timing.tokens_per_s)
        row.step_ms.append(timing.step_ms)
        row.prefill_ms.append(timing.prefill_ms)
        row.host_ms.append(timing.host_ms)
        for peer, runs in zip(peers if paired else [], row.peers):
            if runs.skipped:
                continue
            tps, step_ms = peer.time_decode(prompts, cfg.new_tokens)
            runs.tokens_per_s.append(tps)
            runs.step_ms.append(step_ms)


def graph_pool(llm: Any) -> dict[str, Any]:
    """DecodeRow's graph fields for an engine that captured CUDA graphs (empty otherwise): its pool as the
    allocator's snapshot holds it, and the activations of the largest size it captured (the graph_capturing row)."""
    from ..names import Attr, Row

    usage = llm.engine.runner.graph_pool_usage()
    if usage is None:
        return {}
    attrs = llm.startup.phase_table[Row.GRAPH_CAPTURING].attributes
    sizes, acts = list(attrs.get(Attr.GRAPH_SIZES) or []), list(attrs.get(Attr.GRAPH_SIZE_ACTIVATION_BYTES) or [])
    return {"graph_pool_gb": usage.reserved_bytes / 1e9, "graph_largest_size": max(sizes) if sizes else None,
            "graph_activation_gb": acts[-1] / 1e9 if acts else None}


def run_decode_bench(cfg: DecodeBenchConfig) -> list[DecodeRow]:
    from glowplug.base.errors import require_extra

    from ...engine.llm import LLM
    from ...kernels.native import loaded_level
    from ..memory import current_rss
    from .memory_split import held_weight_bytes, kv_pool_bytes

    if cfg.compare_hf:
        require_extra(("transformers",), "bench decode's transformers peer (--no-compare-hf skips it)", "bench")
    rows: list[DecodeRow] = []
    longest = max(cfg.prompt_tokens) + cfg.new_tokens
    device = bench_device(cfg.device)
    lens = cfg.max_model_len or (longest,)  # each at least `longest` (the config's validator)
    # Loaded before the first cell: a paired ratio needs the peer next to every glowplug run.
    peers = load_peers(cfg, device)
    peers_gb = sum(p.held_bytes for p in peers) / 1e9
    for (mode, dtype, quant, kv), max_len in ((c, n) for c in _cells(cfg) for n in lens):
        rss_before = current_rss() / 1e9
        llm = LLM(config=EngineConfig.from_flat(**_engine_fields(cfg, mode, dtype, quant, kv, max_len, device)))
        # The server commits its KV pool (resident, on huge pages) right after READY; a fresh offline pool instead
        # commits 4 KiB per first write, and the block manager's least-recently-freed order walks the whole pool,
        # so every run here would page-fault on fresh pages for a while. Committing measures the serving steady
        # state (engine/host_memory.py says why the offline LLM does not commit on its own).
        llm.engine.commit_kv_cache()
        resolved = str(llm.startup.dtype).removeprefix("torch.")
        compiled = llm.engine.runner.decode_step is not None
        wbytes = weight_bytes_per_token(llm.engine.model, compiled)
        groups = group_sizes(llm.engine.model)
        level = loaded_level() or "-"
        pool = graph_pool(llm)
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
                                kv_mb=per_token * (context + cfg.new_tokens / 2) / 1e6,
                                peers_gb=peers_gb, rss_before_gb=rss_before, **pool)  # fmt: skip
                if batch > llm.engine.runner.max_decode_batch and compiled:
                    row.notes.append("above the compiled batch sizes: eager steps")
                time_engine_decode(llm.engine, prompts[: min(batch, 2)], 8)  # warm this batch shape's allocations
                # After the warm run: an eager layer prepares its kernel states on its first forward.
                row.weights_gb = held_weight_bytes(llm.engine.model) / 1e9
                row.kv_pool_gb = kv_pool_bytes(llm.engine) / 1e9
                _time_cell(llm.engine, row, prompts, cfg, device, peers)
                rows.append(row)
        for row in rows:  # each row's batch-1 step: same configuration and context
            if (row.compile == mode and row.quantization == quant and row.kv_cache_dtype == kv and not row.skipped
                    and row.max_model_len == max_len):  # fmt: skip
                one = next((b for b in rows if b.batch == 1 and b.context == row.context and b.compile == mode
                            and b.quantization == quant and b.kv_cache_dtype == kv and b.dtype == row.dtype
                            and b.max_model_len == max_len and not b.skipped), None)  # fmt: skip
                row.batch1_step_ms = one.ms if one is not None else None
        if cfg.out is not None:  # a checkpoint per engine: a run stopped early keeps the cells it finished
            cfg.out.parent.mkdir(parents=True, exist_ok=True)
            cfg.out.with_suffix(".json").write_text(json.dumps(rows_as_dicts(rows), indent=1))
        del llm
        if device == "cuda":
            # The next cell sizes its KV cache from the GPU's memory: this engine's must be gone first.
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()
    return rows


def _paired(a: list[float], b: list[float]) -> str:
    """a_i / b_i in run order: "median x (worst w x)"; the worst pair is the smallest ratio."""
    from .peers import PairedRatio, fmt_ratio

    pairs = [x / y for x, y in zip(a, b)]
    return fmt_ratio(PairedRatio(statistics.median(pairs), min(pairs), len(pairs))) if pairs else "-"


def render_markdown(rows: list[DecodeRow], cfg: DecodeBenchConfig, argv: list[str] | None) -> str:
    from .peers import fmt_ratio, paired_ratio
    from .quality import flag_note, load_flags
    from .run_lines import run_lines
    from .tables import fmt_spread

    flags = load_flags(cfg.quality_from)
    measured = [r for r in rows if not r.skipped and r.engine == "glowplug"]
    probes = [p for r in measured for p in r.probe_gbps]
    contexts = ", ".join(str(c) for c in cfg.prompt_tokens)
    labels = list(dict.fromkeys(p.label for r in measured for p in r.peers))
    probe_text = (f"median {statistics.median(probes):.1f} GB/s, {min(probes):.1f}-{max(probes):.1f}" if probes
                  else "no runs")  # fmt: skip
    lines = [
        report_header("Decode throughput", argv),
        f"Model `{cfg.model}`, context (prompt tokens) {contexts}, {cfg.new_tokens} new tokens per sequence, greedy, "
        f"n={cfg.repeats} runs per cell. Streaming-read probe in this run (fastest of {PROBE_REPEATS} sums over 1 GiB, "
        f"re-measured before every run): {probe_text}. Peers at context {cfg.prompt_tokens[0]}, paired with every run.",
        "",
        "| engine | ISA level | compile | dtype | quantization | group | KV cache | max model len | batch | context "
        "| decode tok/s | ms / step | host ms / step | prefill ms | peak mem GB | weights GB | KV pool GB "
        "| peers GB | rest GB | RSS before the engine GB | model_size MB | GB/s | % of probe "
        "| KV MB / step | extra ms over the shortest context | KV read at % of probe "
        "| vs bf16 (same dtype, compile) | " + "".join(f"vs {lb} | " for lb in labels) + "step / batch-1 step |",
        "|---|---|---|---|---|---|---|" + "---:|" * (21 + len(labels)),
    ]
    for r in measured:
        mb = f"{r.mb_per_token:.1f}" if r.mb_per_token is not None else "-"
        share = fmt_spread([100 * s for s in r.shares], 1) if r.shares else "-"
        by_label = {p.label: p for p in r.peers}
        vs_peers = "".join(
            f"{fmt_ratio(paired_ratio(r.tokens_per_s, by_label[lb]), by_label[lb].skipped)} | " if lb in by_label
            else "- | " for lb in labels)  # fmt: skip
        gbps = fmt_spread([r.mb_per_token / ms for ms in r.step_ms], 1) if r.mb_per_token is not None else "-"
        base = next((b for b in measured if b.quantization == "none" and b.dtype == r.dtype and b.compile == r.compile
                     and b.kv_cache_dtype == r.kv_cache_dtype and b.batch == r.batch and b.context == r.context
                     and b.max_model_len == r.max_model_len), None)  # fmt: skip
        vs_bf16 = _paired(r.tokens_per_s, base.tokens_per_s) if base is not None and r.quantization != "none" else "-"
        prefill = fmt_spread(r.prefill_ms, 1) if r.prefill_ms else "-"
        host = fmt_spread(r.host_ms, 3) if r.host_ms else "-"
        peak = fmt_spread(r.peak_gb, 2) if r.peak_gb else "-"
        split = [f"{v:.3f}" if v is not None else "-" for v in (r.weights_gb, r.kv_pool_gb, r.peers_gb)]
        rest = fmt_spread(r.rest_gb, 2) if r.rest_gb else "-"
        before = f"{r.rss_before_gb:.2f}" if r.rss_before_gb is not None else "-"
        scale = f"{r.ms / r.batch1_step_ms:.2f}x" if r.batch1_step_ms and r.batch != 1 else "-"
        kv_mb = f"{r.kv_mb * r.batch:.1f}" if r.kv_mb is not None else "-"
        extra, kv_share = _long_context(r, measured)
        note = f" ({'; '.join(r.notes)})" if r.notes else ""
        lines.append(
            f"| {r.engine} | {r.level} | {r.compile} | {r.dtype} | {r.quantization}"
            f"{' ' + flags[r.quantization] if r.quantization in flags else ''} | {r.group_size} | {r.kv_cache_dtype} "
            f"| {r.max_model_len or '-'} | {r.batch} | {r.context} | {fmt_spread(r.tokens_per_s, 1)} "
            f"| {fmt_spread(r.step_ms, 2)} | {host} | {prefill} | {peak} | {' | '.join(split)} | {rest} | {before} "
            f"| {mb} | {gbps} | {share} | {kv_mb} | {extra} | {kv_share} | {vs_bf16} | {vs_peers}{scale}{note} |"
        )
    lines += _peer_table(measured)
    lines += _max_len_table(measured)
    lines += _graph_pool_table(measured)
    verdicts = decode_verdicts(rows)
    if verdicts:
        from .verdicts import verdicts_markdown

        lines += ["", "## Verdicts", "", verdicts_markdown(verdicts)]
    left_out = [r for r in rows if r.skipped]
    if left_out:
        lines += ["", "Left out (the KV cache cannot hold the batch at that context):"]
        lines += [f"- {r.compile}/{r.dtype}/{r.quantization}/KV {r.kv_cache_dtype}, batch {r.batch}, context "
                  f"{r.context}: {r.skipped}" for r in left_out]  # fmt: skip
    lines += ["", *[f"- {line}" for line in DEFINITIONS], *([f"- {flag_note(flags)}"] if flags else [])]
    per_run = [line for r in measured for line in run_lines(r, cfg, bench_device(cfg.device))]
    if per_run:
        lines += ["", "Per-run lines (seed 003's generate.py format: one line per timed run; mem/s = model_size over "
                  "that run's ms / step, peak_mem = that run's RSS high-water mark, cache_size = max model len):",
                  "", "```text", *per_run, "```"]  # fmt: skip
    return "\n".join([*lines, ""])


def _peer_table(rows: list[DecodeRow]) -> list[str]:
    """Each peer's own tok/s inside each glowplug cell, beside glowplug's runs it is paired with."""
    from .peers import paired_ratio
    from .tables import fmt_spread

    body = []
    for r in rows:
        for p in r.peers:
            if p.skipped:
                body.append(f"| {r.compile} | {r.dtype} | {r.quantization} | {r.kv_cache_dtype} | {r.batch} "
                            f"| {r.context} | {p.label} | {fmt_spread(r.tokens_per_s, 1)} | skipped: {p.skipped} "
                            "| - | - | - |")  # fmt: skip
                continue
            ratio = paired_ratio(r.tokens_per_s, p)
            assert ratio is not None
            body.append(f"| {r.compile} | {r.dtype} | {r.quantization} | {r.kv_cache_dtype} | {r.batch} | {r.context} "
                        f"| {p.label} | {fmt_spread(r.tokens_per_s, 1)} | {fmt_spread(p.tokens_per_s, 1)} "
                        f"| {fmt_spread(p.step_ms, 2)} | {ratio.median:.2f}x | {ratio.worst:.2f}x |")  # fmt: skip
    if not body:
        return []
    return ["", "Peers, paired run by run (each peer ran right after glowplug's run i, on the same prompts):", "",
            "| compile | dtype | quantization | KV cache | batch | context | peer | glowplug tok/s | peer tok/s "
            "| peer ms / step | ratio median | worst pair |",
            "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
            *body]  # fmt: skip


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


def _graph_pool_table(rows: list[DecodeRow]) -> list[str]:
    """Per engine (configuration and max model len) that captured CUDA graphs: its graph pool after capture against
    the largest captured size's activations (the target: at most 1.5x)."""
    seen: dict[tuple[str, str, str, str, int], DecodeRow] = {}
    for r in rows:
        if r.graph_pool_gb is not None:
            seen.setdefault((r.compile, r.dtype, r.quantization, r.kv_cache_dtype, r.max_model_len), r)
    if not seen:
        return []
    out = ["", "CUDA graph pool per engine (torch.cuda.memory_snapshot after capture, the graphs' pool only) against "
           "the activations of the largest captured batch (the allocator's peak over one uncaptured step):", "",
           "| compile | dtype | quantization | KV cache | max model len | largest captured batch | graph pool GB "
           "| activations GB | pool / activations |", "|---|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (mode, dtype, quant, kv, max_len), r in seen.items():
        act = r.graph_activation_gb
        ratio = f"{r.graph_pool_gb / act:.2f}x" if act else "-"
        out.append(f"| {mode} | {dtype} | {quant} | {kv} | {max_len} | {r.graph_largest_size or '-'} "
                   f"| {r.graph_pool_gb:.3f} | {f'{act:.3f}' if act is not None else '-'} | {ratio} |")
    return out


LONG_CONTEXT = 2048  # issue 34's long-context target applies at this context (prompt tokens)
LONG_CONTEXT_SHARE = 70.0  # ... the extra KV bytes read at >= 70% of the probe
MAX_LEN_RATIO = 1.05  # issue 38: a step's time at the longest max model len within 5% of the shortest's


def _kv_shares(r: DecodeRow, rows: list[DecodeRow]) -> list[float] | None:
    """Per run, the extra KV bytes over the shortest context as a % of the run's probe (see _long_context)."""
    if r.engine != "glowplug" or r.kv_mb is None:
        return None
    same = [b for b in rows if b.engine == r.engine and b.compile == r.compile and b.dtype == r.dtype
            and b.quantization == r.quantization and b.kv_cache_dtype == r.kv_cache_dtype and b.batch == r.batch
            and b.max_model_len == r.max_model_len and b.kv_mb is not None]  # fmt: skip
    short = min(same, key=lambda b: b.context)
    if short is r or short.kv_mb is None:
        return None
    extra = [a - b for a, b in zip(r.step_ms, short.step_ms)]
    kv_gb = (r.kv_mb - short.kv_mb) * r.batch / 1e3
    return [100 * kv_gb / (e / 1e3) / p for e, p in zip(extra, r.probe_gbps) if e > 0]


def decode_verdicts(rows: list[DecodeRow]) -> list[Any]:
    """The targets this run's cells can be held to, each on its worst run or pair: the KV read share at
    LONG_CONTEXT tokens (issue 34) and the step time over max model lens (issue 38)."""
    from .verdicts import Verdict

    measured = [r for r in rows if not r.skipped and r.engine == "glowplug"]
    out: list[Verdict] = []
    for r in measured:
        if r.context != LONG_CONTEXT:
            continue
        shares = _kv_shares(r, measured)
        if shares is None:
            continue
        what = f"{r.compile}/{r.dtype}/{r.quantization}/KV {r.kv_cache_dtype}, batch {r.batch}"
        worst = min(shares) if shares else None
        out.append(Verdict(f"KV read at >= {LONG_CONTEXT_SHARE:.0f}% of the probe at {LONG_CONTEXT} tokens ({what})",
                           f"worst run {worst:.1f}%" if worst is not None else "no run read more than the shortest",
                           None if worst is None else worst >= LONG_CONTEXT_SHARE))  # fmt: skip
    lens = sorted({r.max_model_len for r in measured})
    if len(lens) >= 2:
        for r in measured:
            if r.max_model_len != lens[-1]:
                continue
            base = next((b for b in measured if b.max_model_len == lens[0] and b.compile == r.compile
                         and b.dtype == r.dtype and b.quantization == r.quantization
                         and b.kv_cache_dtype == r.kv_cache_dtype and b.batch == r.batch and b.context == r.context),
                        None)  # fmt: skip
            if base is None:
                continue
            worst = max(a / b for a, b in zip(r.step_ms, base.step_ms))
            what = f"{r.compile}/{r.dtype}/{r.quantization}/KV {r.kv_cache_dtype}, batch {r.batch}, context {r.context}"
            out.append(Verdict(f"step at max model len {lens[-1]} within {100 * (MAX_LEN_RATIO - 1):.0f}% of "
                               f"{lens[0]}'s ({what})", f"worst pair {worst:.3f}x", worst <= MAX_LEN_RATIO))
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
    "peak mem GB: the process's RSS high-water mark during glowplug's run (seed 003's peak_mem; VmHWM reset per "
    "run). glowplug's KV pool is committed before the runs, as the server commits it after READY, so this includes "
    "the whole pool (on the CPU at most 2 GiB by default), and the peers' weights loaded in the same process.",
    "memory split: weights GB = the distinct tensor storages the model holds (parameters, buffers, the quantized "
    "layers' prepared kernel states); KV pool GB = the engine's KV cache tensors; peers GB = the peer models in "
    "the process (transformers' parameters, llama.cpp's mmapped GGUF); rest GB = peak - those three, per run "
    "(torch and libraries, activations, compiled graphs, and allocator pages kept from earlier cells). RSS before "
    "the engine GB: the process's RSS just before this cell's engine was built; it grows over a report's cells.",
    "GB/s: model_size over ms / step, the weight bandwidth achieved (seed 003's mem/s; KV reads not included).",
    "group: the quantized layers' group sizes as loaded (channel = one scale per output row; --group-size sets the "
    "int8/int4/int2 cells'); KV cache int8: quantized KV.",
    "vs bf16: decode tok/s over the unquantized row at the same dtype, compile mode, KV dtype, batch and context, "
    "run i over run i (median, and the worst pair = the smallest ratio). The two cells ran in different engines "
    "minutes apart, so this pairing is by run order, not back to back like the peers'.",
    "model_size MB: seed 003's model_size, the weight bytes one batch-1 decode step reads through the kernels the path runs (compile on: "
    "glowplug's native layouts; off: the eager dispatcher's), LM head included.",
    "% of probe: GB/s as a percentage of the streaming-read probe measured right before the same run.",
    "vs <peer>: paired within the run. Each repeat i times this glowplug cell, then each peer on the same prompt "
    "token ids, back to back after one probe; ratio_i = glowplug tok/s_i / peer tok/s_i; the cell shows the median "
    "ratio, the worst pair (the smallest ratio, what a verdict uses) and n. Peers run at the first context only. "
    "transformers: `generate` (greedy) in the column's dtype, decode time = generate(N) - generate(1). llama.cpp: "
    "llama-cpp-python on the GGUF the engine loaded, n_threads = torch's threads, greedy; the prompt's eval and "
    "first token are the prefill, decode time = the next N - 1 single-token evals and samples; batch 1 only.",
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
