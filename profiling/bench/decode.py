"""`glowplug bench decode`: decode tokens/s per compile mode, dtype, quantization and batch size, against transformers'
`generate` on the same model and prompts, with the weight traffic set against a streaming-read probe.

Definitions (the report prints them under its table):
- decode tok/s: tokens produced after every sequence of the batch has its first token (prefill excluded), divided
  by the time from then to the end of the batch. transformers' decode time is generate(N tokens) minus
  generate(1 token) on the same inputs, so its prefill is excluded the same way.
- model_size MB (seed 003's model_size): the weight bytes one decode step reads through the kernels this path
  runs: the engine's own count on its native_kernels span when compiled (Attr.BYTES_PER_TOKEN: native layouts, a
  GGUF layer's stored blocks), else the eager dispatcher's chosen layouts, the LM head included (an embedding lookup
  reads a few rows only, so it is left out).
- % of probe: achieved GB/s (model_size x steps/s) over the sustained streaming-read rate (base.machine
  measure_probe_stats: the median of 7 torch sums over max(1 GiB, 4x the L3) of fp32; the fastest pass is shown
  beside it) measured immediately before the same repeat. The host's memory bandwidth changes from minute to
  minute on shared machines, so every repeat carries its own probe.
- prefill: tok/s and FLOP/s of the batch's prompts (prefill_flops), against the cores' int8 peak
  (machine.compute_peak: threads x clock x the int8 MACs per cycle of the kernels' ISA level x 2).
- step / batch-1: this cell's ms per step over the batch-1 cell's of the same configuration.
- vs <peer> (transformers per --hf-dtype, llama.cpp with --peers llamacpp,llamacpp-batched): paired within the
  run. Each repeat times the glowplug cell and then every peer on the same prompt token ids, back to back after
  one probe (A, B, A, B...: the machine's swing reaches every engine); ratio_i = glowplug tok/s_i / peer tok/s_i;
  the cell shows the median ratio and the worst pair (peers.py has each peer's decode-time definition); the
  prefill is paired the same way. The peers are loaded before the first cell, so they share the process with
  glowplug (their weights are a column of the memory split).
- verdicts (--targets): the real-size targets, each PASS or FAIL on its worst pair or run (real_size_verdicts).
- memory split (memory_split.py): peak RSS = weights + KV pool + peers + rest, per cell.
- host ms / step: per decode step, its wall time minus the time inside the model call (the compiled decode step,
  or the eager forward) and inside the sampler, as the engine books them (LLMEngine.step_times); the median over
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

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from glowplug.engine.config import EngineConfig

from .machine import measure_probe_stats, report_header
from .peers import Peer, PeerRuns, SkippedPeer

PROMPT_WORDS = (
    "glowplug",
    "schedules",
    "prefill",
    "chunks",
    "while",
    "decode",
    "steps",
    "stream",
    "tokens",
    "from",
    "a",
    "paged",
    "cache",
    "of",
    "blocks",
    "that",
    "share",
    "prefixes",
    "and",
    "free",
    "on",
    "abort",
)


class DecodeBenchConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "smollm2"
    batch_sizes: tuple[int, ...] = Field((1, 16, 64), min_length=1)
    quantization: tuple[Literal["auto", "none", "int8", "int4", "int2", "w8a8"], ...] = ("none",)
    compile: tuple[Literal["on", "off"], ...] = Field(("on", "off"), min_length=1)
    dtype: tuple[Literal["auto", "float32", "bfloat16", "float16"], ...] = Field(
        ("auto",),
        min_length=1,
        description="Model dtypes: unquantized runs in each; quantized formats run in the first one only.",
    )
    kv_cache_dtype: tuple[Literal["auto", "int8"], ...] = Field(
        ("auto",), min_length=1, description="KV-cache dtypes (int8: quantized KV)."
    )
    prompt_tokens: tuple[Annotated[int, Field(ge=1, le=32768)], ...] = Field(
        (64,),
        min_length=1,
        description="Prompt lengths: each is a context column (the tokens in the KV cache when decoding starts). "
        "Cells whose batch x (prompt + new tokens) exceeds the KV cache are left out, and listed under the table.",
    )
    new_tokens: int = Field(128, ge=4, le=4096)
    repeats: int = Field(3, ge=1, le=50, description="Timed runs per cell (median and min-max are reported).")
    quantize_lm_head: bool = True
    compare_hf: bool = Field(
        True,
        description="Time transformers' generate on the same prompts, paired with every "
        "glowplug run at the first context (one peer per --hf-dtype).",
    )
    hf_dtype: tuple[Literal["auto", "float32", "bfloat16", "float16"], ...] = Field(
        ("auto",),
        min_length=1,
        description="transformers peer dtypes, one column each (auto: fp32 on a CPU, bf16 on a GPU).",
    )
    peers: tuple[Literal["llamacpp", "llamacpp-batched"], ...] = Field(
        (),
        description="Other peers, paired like transformers, on the same GGUF with the threads torch uses "
        "(llamacpp: llama-cpp-python's generator loop, batch 1; llamacpp-batched: llama.cpp's batched API, one "
        "llama_decode per step for every sequence, n_batch 512; a column says why when its peer cannot run).",
    )
    peer_contexts: tuple[Annotated[int, Field(ge=1)], ...] = Field(
        (),
        description="Contexts (of --prompt-tokens) at which the peers run beside glowplug (default: the first).",
    )
    cells: tuple[Annotated[str, Field(pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")], ...] = Field(
        (),
        description="BATCHxCONTEXT cells (e.g. 1x64,16x64,1x512,1x2048) to run, in this order, instead of every "
        "--batch-sizes at every --prompt-tokens; the two lists then default to what the cells name.",
    )
    invariance: bool = Field(
        False,
        description="Per engine, the batch-invariance check: 8 prompts batched against "
        "each alone and in reversed rows, 64 greedy tokens each.",
    )
    targets: bool = Field(
        False,
        description="Hold the run to the real-size targets (batch 1 against llama.cpp and "
        "the probe, batch 16 against batch 1 and llama.cpp, prefill against pp512, batch "
        "invariance): a verdict each, PASS or FAIL on the worst pair.",
    )
    from_json: Path | None = Field(
        None, description="Re-render the report from the JSON a run wrote (beside its --out); nothing is run."
    )
    group_size: int | None = Field(
        None,
        description="Quantization group size for the int8/int4/int2 cells (32, 64, 128, 256; int2: 128); "
        "unset: the engine's default. Other formats ignore it.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where both engines run (auto: CUDA if torch sees a GPU)."
    )
    max_model_len: tuple[Annotated[int, Field(ge=16)], ...] = Field(
        (),
        description="Max model lengths, each a cell (default: the longest prompt + new tokens): a decode step's "
        "time must not grow with the length allowed, only with the context held.",
    )
    quality_from: Path | None = Field(None, description="Accuracy JSON whose >2x-bf16-perplexity formats get flagged.")
    out: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _lists_from_cells(cls, data: Any) -> Any:
        """With --cells, --batch-sizes and --prompt-tokens default to the sizes the cells name."""
        if not isinstance(data, dict) or not data.get("cells"):
            return data
        cells = data["cells"]
        cells = cells.split(",") if isinstance(cells, str) else list(cells)
        pairs = [str(c).split("x", 1) for c in cells]
        try:
            batches = tuple(dict.fromkeys(int(b) for b, _ in pairs))
            contexts = tuple(dict.fromkeys(int(c) for _, c in pairs))
        except ValueError:
            return data  # the field's own pattern names the bad cell
        data = dict(data)
        data.setdefault("batch_sizes", tuple(sorted(batches)))
        data.setdefault("prompt_tokens", contexts)
        return data

    @model_validator(mode="after")
    def _cells_and_peer_contexts_are_in_the_lists(self) -> DecodeBenchConfig:
        for batch, context in self.grid():
            if batch not in self.batch_sizes or context not in self.prompt_tokens:
                raise ValueError(
                    f"cell {batch}x{context} is not in --batch-sizes {list(self.batch_sizes)} x "
                    f"--prompt-tokens {list(self.prompt_tokens)}: leave those two out with --cells"
                )
        stray = [c for c in self.peer_contexts if c not in self.prompt_tokens]
        if stray:
            raise ValueError(f"--peer-contexts {stray} are not among --prompt-tokens {list(self.prompt_tokens)}")
        return self

    def grid(self) -> list[tuple[int, int]]:
        """(batch, context) of every cell, in run order: --cells as given, else batch by batch, every context."""
        if self.cells:
            return [(int(b), int(c)) for b, c in (cell.split("x", 1) for cell in self.cells)]
        return [(b, c) for b in self.batch_sizes for c in self.prompt_tokens]

    def peer_at(self, context: int) -> bool:
        """Whether the peers run beside glowplug's cells at this context."""
        return context in (self.peer_contexts or self.prompt_tokens[:1])

    @field_validator("max_model_len")
    @classmethod
    def _lengths_hold_the_runs(cls, v: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        if not v or "prompt_tokens" not in info.data or "new_tokens" not in info.data:
            return v  # unset, or those fields failed their own checks (reported on their own)
        longest = max(info.data["prompt_tokens"]) + info.data["new_tokens"]
        if min(v) < longest:
            raise ValueError(
                f"{min(v)} is shorter than the longest prompt + new tokens ({longest}); pass at least "
                f"{longest}, or fewer --prompt-tokens/--new-tokens"
            )
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
    probe_fastest_gbps: list[float] = field(default_factory=list)  # each run's fastest probe pass (probe_gbps: median)
    prefill_flops: float | None = None  # FLOPs of the cell's whole prefill (prefill_flops below)
    bytes_source: str = ""  # where mb_per_token comes from (the engine's native_kernels span, or the bench's count)

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

    @property
    def prefill_tps(self) -> list[float]:
        """Per run, prompt tokens over the prefill's time (the whole batch's prompts)."""
        return [self.batch * self.context / (ms / 1e3) for ms in self.prefill_ms if ms > 0]

    @property
    def prefill_flops_per_s(self) -> list[float]:
        if self.prefill_flops is None:
            return []
        return [self.prefill_flops / (ms / 1e3) for ms in self.prefill_ms if ms > 0]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeRow:
        """A row as `as_dict` stored it (the derived keys it added are left out)."""
        from dataclasses import fields

        from .peers import PeerRuns

        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["peers"] = [PeerRuns.from_dict(p) for p in d.get("peers", [])]
        return cls(**kw)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.skipped:
            return d
        d.update(
            median_tokens_per_s=self.tps,
            median_step_ms=self.ms,
            probe_share=self.shares,
            model_size_mb=self.mb_per_token,
            rest_gb=self.rest_gb,
            peer_ratios={p.label: p.ratios(self.tokens_per_s) for p in self.peers},
        )
        return d


def make_prompts(tokenizer: Any, batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `prompt_tokens` tokens each (no prefix sharing between them)."""
    prompts = []
    for b in range(batch):
        words = [PROMPT_WORDS[(b * 7 + i * 3) % len(PROMPT_WORDS)] for i in range(prompt_tokens)]
        ids = list(tokenizer(f"Request {b}: " + " ".join(words))["input_ids"])[:prompt_tokens]
        prompts.append(ids + ids[: prompt_tokens - len(ids)])
    return prompts


def model_bytes_per_token(llm: Any) -> tuple[int, str]:
    """(bytes of the model one batch-1 decode step reads, where the figure comes from): `LLM.weight_traffic()`,
    labelled as the stored reports label it."""
    traffic = llm.weight_traffic()
    return traffic.bytes_per_step, "engine (native_kernels span)" if traffic.from_start else "bench (layer walk)"


def prefill_flops(arch: Any, batch: int, context: int) -> float:
    """FLOPs of prefilling `batch` prompts of `context` tokens: 2 per multiply-accumulate of every projection of
    every layer for every token, causal attention (QK^T and PV over the positions before each token: heads x
    head_dim x context^2 MACs per layer, every layer attending to the whole prompt: for a model with sliding-window
    layers an upper bound), and the LM head for each prompt's last token only (the logits a prefill samples from)."""
    h, layers = arch.hidden_size, arch.num_hidden_layers
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    per_token = layers * (h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate_size)
    attention = layers * arch.num_attention_heads * arch.head_dim * context * context
    head = arch.vocab_size * h
    return 2.0 * batch * (per_token * context + attention + head)


INVARIANCE_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colors are",
    "In a paged KV cache, each block",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The largest planet in our solar system is",
)
INVARIANCE_TOKENS = 64


@dataclass
class InvarianceResult:
    """One engine's batch-invariance check: each prompt's greedy tokens in the batch of 8 against the same prompt run
    alone, and against the batch in reversed row order."""

    compile: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    max_model_len: int
    equal: int  # prompts whose batched tokens equal their tokens alone
    total: int
    reversed_equal: int  # prompts whose tokens in the reversed batch equal their tokens alone
    tokens: int
    differ: list[str] = field(default_factory=list)  # the prompts whose batched tokens differ from alone

    @property
    def passed(self) -> bool:
        return self.equal == self.total and self.reversed_equal == self.total


def invariance_check(llm: Any, new_tokens: int = INVARIANCE_TOKENS) -> tuple[int, int, list[str]]:
    """(batched == alone count, reversed == alone count, differing prompts) through the public LLM.generate."""
    from glowplug.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = list(INVARIANCE_PROMPTS)

    def tokens(outs: list[Any]) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outs]

    batched = tokens(llm.generate(prompts, params))
    alone = [tokens(llm.generate([p], params))[0] for p in prompts]
    flipped = tokens(llm.generate(prompts[::-1], params))[::-1]
    differ = [p for p, a, b in zip(prompts, batched, alone) if a != b]
    return len(prompts) - len(differ), sum(a == b for a, b in zip(flipped, alone)), differ


@dataclass
class RunFacts:
    """What a run knows beside its rows: how the probe and the compute peak were made, the peers' builds, the
    batch-invariance checks. Stored with the rows, so a report re-renders from its JSON alone."""

    probe_method: str = ""
    threads: int = 0
    made_by: str = ""  # the run's command, commit and date (a re-rendered report names them)
    peak: dict[str, Any] | None = None  # machine.ComputePeak's fields
    peers_info: dict[str, str] = field(default_factory=dict)
    invariance: list[InvarianceResult] = field(default_factory=list)

    @property
    def peak_flops(self) -> float | None:
        from .machine import ComputePeak

        return ComputePeak(**self.peak).flops if self.peak else None

    def peak_text(self) -> str:
        from .machine import ComputePeak

        return ComputePeak(**self.peak).describe() if self.peak else "unknown"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunFacts:
        return cls(
            str(d.get("probe_method", "")),
            int(d.get("threads", 0)),
            str(d.get("made_by", "")),
            d.get("peak"),
            dict(d.get("peers_info", {})),
            [InvarianceResult(**i) for i in d.get("invariance", [])],
        )


@dataclass
class DecodeRun:
    """A `bench decode` run: its config, its facts and its rows (what the JSON beside the report holds)."""

    cfg: DecodeBenchConfig
    facts: RunFacts
    rows: list[DecodeRow]

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.cfg.model_dump(mode="json"),
            "facts": asdict(self.facts),
            "rows": rows_as_dicts(self.rows),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeRun:
        cfg = DecodeBenchConfig.model_validate(d["config"])
        return cls(cfg, RunFacts.from_dict(d.get("facts", {})), [DecodeRow.from_dict(r) for r in d["rows"]])


def json_rows(data: Any) -> list[dict[str, Any]]:
    """The rows of a `bench decode` JSON: a run's {"config", "facts", "rows"}, or the bare row list older runs
    wrote."""
    return list(data["rows"]) if isinstance(data, dict) else list(data)


@dataclass(frozen=True)
class EngineDecodeTiming:
    tokens_per_s: float  # decode tokens/s
    step_ms: float  # ms per decode step
    prefill_ms: float
    host_ms: float  # median over the decode steps of wall - model call - sampler (see the module docstring)


def time_engine_decode(engine: Any, prompts: list[list[int]], new_tokens: int) -> EngineDecodeTiming:
    """One greedy batch run to completion through `timing.time_batch`, as this report reads it: decode tok/s over
    the tokens after the prefill, and the median host time of its decode steps (see EngineDecodeTiming)."""
    from glowplug.engine.sampling_params import SamplingParams

    from .timing import time_batch

    t = time_batch(engine, prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    steps = len(t.decode_step_s)
    host_ms = statistics.median(t.decode_host_s) * 1e3 if t.decode_host_s else 0.0
    tokens_per_s = (t.generated_tokens - t.first_tokens) / t.decode_s
    return EngineDecodeTiming(tokens_per_s, t.decode_s / max(steps, 1) * 1000, t.prefill_s * 1000, host_ms)


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
    from glowplug.kernels.modules import QuantLinear

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

    from glowplug.engine.models.store import resolve_model

    from .peers import load_hf_peers, load_llamacpp_peers

    model_dir = resolve_model(cfg.model, quiet=True)
    out: list[Peer] = []
    if cfg.compare_hf:
        dtypes = list(dict.fromkeys(hf_peer_dtype(device, d) for d in cfg.hf_dtype))
        out += load_hf_peers(model_dir, dtypes, device)
    kinds = [k for k in ("llamacpp", "llamacpp-batched") if k in cfg.peers]
    if kinds:
        if device != "cpu":
            labels = {"llamacpp": "llama.cpp", "llamacpp-batched": "llama.cpp batched"}
            out += [
                SkippedPeer(labels[k], f"the bench runs on {device}; the llama.cpp peers are CPU-only here")
                for k in kinds
            ]
        else:
            longest = max(c for c in cfg.prompt_tokens if cfg.peer_at(c))
            out += load_llamacpp_peers(
                model_dir, kinds, seq_tokens=longest + cfg.new_tokens, n_threads=torch.get_num_threads()
            )
    return out


def _engine_fields(
    cfg: DecodeBenchConfig, mode: str, dtype: str, quant: str, kv: str, max_len: int, device: str
) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        model=cfg.model,
        dtype=dtype,
        quantization=quant,
        compile=mode,
        max_model_len=max_len,
        # the batch-invariance check runs its 8 prompts as one batch
        max_num_seqs=max(*cfg.batch_sizes, len(INVARIANCE_PROMPTS) if cfg.invariance else 1),
        max_num_batched_tokens=2048,  # long prompts: chunked
        quantize_lm_head=cfg.quantize_lm_head,
        kv_cache_dtype=kv,
        device=device,
        # every repeat prefills its whole prompt: a prefix-cache hit on the previous repeat's blocks is not a prefill
        enable_prefix_caching=False,
    )
    if cfg.group_size is not None and quant in ("int8", "int4", "int2"):
        fields["group_size"] = cfg.group_size  # the engine refuses a group size on the other formats
    return fields


def _time_cell(
    engine: Any, row: DecodeRow, prompts: list[list[int]], cfg: DecodeBenchConfig, device: str, peers: list[Peer]
) -> None:
    """The cell's repeats, each after its own probe; at a peer context each repeat also times every peer right after
    glowplug's run (glowplug, peer A, peer B, then the next repeat: the machine's swing reaches every engine)."""
    from datetime import datetime

    from glowplug.profiling.memory import PeakMemory

    paired = cfg.peer_at(row.context)
    if paired:
        row.peers = [PeerRuns(p.label, skipped=p.skip_reason(row.batch) or "") for p in peers]
    for _ in range(cfg.repeats):
        probe = measure_probe_stats(device=device)
        row.probe_gbps.append(probe.sustained)
        row.probe_fastest_gbps.append(probe.fastest)
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
            if not runs.skipped:
                runs.append(peer.time_run(prompts, cfg.new_tokens))


def graph_pool(llm: Any) -> dict[str, Any]:
    """DecodeRow's graph fields for an engine that captured CUDA graphs (empty otherwise): its pool as the
    allocator's snapshot holds it, and the activations of the largest size it captured (the graph_capturing row)."""
    from glowplug.profiling.names import Attr, Row

    usage = llm.engine.runner.graph_pool_usage()
    if usage is None:
        return {}
    attrs = llm.startup.phase_table[Row.GRAPH_CAPTURING].attributes
    sizes, acts = list(attrs.get(Attr.GRAPH_SIZES) or []), list(attrs.get(Attr.GRAPH_SIZE_ACTIVATION_BYTES) or [])
    return {
        "graph_pool_gb": usage.reserved_bytes / 1e9,
        "graph_largest_size": max(sizes) if sizes else None,
        "graph_activation_gb": acts[-1] / 1e9 if acts else None,
    }


def main(cfg: DecodeBenchConfig, argv: list[str] | None) -> int:
    """`glowplug bench decode`: run (or re-render --from-json), print the Markdown, and with --out write it, the
    run's JSON beside it and the verdicts sidecar `bench all` reads."""
    from rich.console import Console
    from rich.markdown import Markdown

    from .verdicts import write_verdicts

    if cfg.from_json is not None:
        run = DecodeRun.from_dict(json.loads(cfg.from_json.read_text()))
    else:
        run = run_decode_bench(cfg, argv)
    text = render_markdown(run.rows, run.cfg, argv, run.facts, from_json=cfg.from_json)
    Console().print(Markdown(text))
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(text)
        if cfg.out.with_suffix(".json").resolve() != (cfg.from_json or Path("/nonexistent")).resolve():
            cfg.out.with_suffix(".json").write_text(json.dumps(run.as_dict(), indent=1))
        verdicts = decode_verdicts(run.rows, run.cfg, run.facts)
        if verdicts:
            write_verdicts(cfg.out, verdicts)
    return 0


def run_decode_bench(cfg: DecodeBenchConfig, argv: list[str] | None = None) -> DecodeRun:
    import torch

    from glowplug.base.errors import require_extra
    from glowplug.base.machine import PROBE_PASSES, describe_probe, l3_cache_bytes, probe_size

    if cfg.compare_hf:
        require_extra(("transformers",), "bench decode's transformers peer (--no-compare-hf skips it)", "bench")
    rows: list[DecodeRow] = []
    longest = max(cfg.prompt_tokens) + cfg.new_tokens
    device = bench_device(cfg.device)
    lens = cfg.max_model_len or (longest,)  # each at least `longest` (the config's validator)
    threads = torch.get_num_threads()
    l3 = l3_cache_bytes() if device == "cpu" else None
    facts = RunFacts(
        threads=threads,
        probe_method=describe_probe(probe_size(l3), l3, PROBE_PASSES)
        if device == "cpu"
        else f"torch sum over {4 * probe_size(None) / 2**20:.0f} MiB of fp32 on {device}; "
        f"{PROBE_PASSES} passes: sustained = their median, fastest = their maximum",
    )
    # Loaded before the first cell: a paired ratio needs the peer next to every glowplug run.
    peers = load_peers(cfg, device)
    facts.peers_info = {p.label: p.info for p in peers if p.info}
    peers_gb = sum(p.held_bytes for p in peers) / 1e9
    from .machine import command_line, report_git_state

    facts.made_by = (
        f"`{command_line(argv)}` at commit {report_git_state().describe()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    run = DecodeRun(cfg, facts, rows)
    try:
        for (mode, dtype, quant, kv), max_len in ((c, n) for c in _cells(cfg) for n in lens):
            _run_engine(cfg, run, peers, peers_gb, mode, dtype, quant, kv, max_len, device)
    finally:
        for peer in peers:
            peer.close()
    return run


def _run_engine(
    cfg: DecodeBenchConfig,
    run: DecodeRun,
    peers: list[Peer],
    peers_gb: float,
    mode: str,
    dtype: str,
    quant: str,
    kv: str,
    max_len: int,
    device: str,
) -> None:
    """One engine's cells (and its batch-invariance check), appended to `run`."""
    from glowplug.base.machine import isa_choice
    from glowplug.engine.llm import LLM
    from glowplug.kernels.native import loaded_level
    from glowplug.profiling.memory import current_rss

    from .machine import compute_peak
    from .memory_split import held_weight_bytes, kv_pool_bytes

    rows, facts = run.rows, run.facts
    rss_before = current_rss() / 1e9
    llm = LLM(config=EngineConfig.from_flat(**_engine_fields(cfg, mode, dtype, quant, kv, max_len, device)))
    if device == "cpu" and facts.peak is None:  # the level the kernels loaded at is known once an engine started
        facts.peak = asdict(compute_peak(loaded_level() or isa_choice().level, facts.threads))
    # The server commits its KV pool (resident, on huge pages) right after READY; a fresh offline pool instead
    # commits 4 KiB per first write, and the block manager's least-recently-freed order walks the whole pool,
    # so every run here would page-fault on fresh pages for a while. Committing measures the serving steady
    # state (engine/host_memory.py says why the offline LLM does not commit on its own).
    llm.engine.commit_kv_cache()
    resolved = str(llm.startup.dtype).removeprefix("torch.")
    compiled = llm.engine.compiled
    wbytes, bytes_source = model_bytes_per_token(llm)
    groups = group_sizes(llm.engine.model)
    level = loaded_level() or "-"
    pool = graph_pool(llm)
    stats = llm.engine.stats()
    capacity = stats.kv_blocks * stats.block_size
    per_token = llm.startup.kv_plan.bytes_per_token
    for batch, context in cfg.grid():
        need = batch * -(-(context + cfg.new_tokens) // stats.block_size) * stats.block_size
        if need > capacity:
            rows.append(
                DecodeRow(
                    "glowplug",
                    mode,
                    resolved,
                    quant,
                    batch,
                    [],
                    [],
                    [],
                    None,
                    kv,
                    groups,
                    context=context,
                    level=level,
                    max_model_len=max_len,
                    skipped=f"needs {need} KV tokens, the cache holds {capacity}",
                )
            )
            continue
        prompts = make_prompts(llm.tokenizer, batch, context)
        row = DecodeRow(
            "glowplug",
            mode,
            resolved,
            quant,
            batch,
            [],
            [],
            [],
            wbytes / 1e6,
            kv,
            groups,
            context=context,
            level=level,
            max_model_len=max_len,
            kv_mb=per_token * (context + cfg.new_tokens / 2) / 1e6,
            peers_gb=peers_gb,
            rss_before_gb=rss_before,
            bytes_source=bytes_source,
            prefill_flops=prefill_flops(llm.startup.arch, batch, context),
            **pool,
        )
        if batch > llm.engine.runner.max_decode_batch and compiled:
            row.notes.append("above the compiled batch sizes: eager steps")
        time_engine_decode(llm.engine, prompts[: min(batch, 2)], 8)  # warm this batch shape's allocations
        # After the warm run: an eager layer prepares its kernel states on its first forward.
        row.weights_gb = held_weight_bytes(llm.engine.model) / 1e9
        row.kv_pool_gb = kv_pool_bytes(llm.engine) / 1e9
        _time_cell(llm.engine, row, prompts, cfg, device, peers)
        rows.append(row)
    for row in rows:  # each row's batch-1 step: same configuration and context
        if (
            row.compile == mode
            and row.quantization == quant
            and row.kv_cache_dtype == kv
            and not row.skipped
            and row.max_model_len == max_len
        ):
            one = next(
                (
                    b
                    for b in rows
                    if b.batch == 1
                    and b.context == row.context
                    and b.compile == mode
                    and b.quantization == quant
                    and b.kv_cache_dtype == kv
                    and b.dtype == row.dtype
                    and b.max_model_len == max_len
                    and not b.skipped
                ),
                None,
            )
            row.batch1_step_ms = one.ms if one is not None else None
    if cfg.invariance:
        equal, flipped, differ = invariance_check(llm)
        facts.invariance.append(
            InvarianceResult(
                mode, resolved, quant, kv, max_len, equal, len(INVARIANCE_PROMPTS), flipped, INVARIANCE_TOKENS, differ
            )
        )
    if cfg.out is not None:  # a checkpoint per engine: a run stopped early keeps the cells it finished
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.with_suffix(".json").write_text(json.dumps(run.as_dict(), indent=1))
    del llm
    if device == "cuda":
        # The next cell sizes its KV cache from the GPU's memory: this engine's must be gone first.
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _paired(a: list[float], b: list[float]) -> str:
    """a_i / b_i in run order: "median x (worst w x)"; the worst pair is the smallest ratio."""
    from .peers import PairedRatio, fmt_ratio

    pairs = [x / y for x, y in zip(a, b)]
    return fmt_ratio(PairedRatio(statistics.median(pairs), min(pairs), len(pairs))) if pairs else "-"


def render_markdown(
    rows: list[DecodeRow],
    cfg: DecodeBenchConfig,
    argv: list[str] | None,
    facts: RunFacts | None = None,
    from_json: Path | None = None,
) -> str:
    """The report; `from_json`: the stored run it was re-rendered from (the header then names the run's own
    command, commit and date)."""
    from .gpt_fast_lines import run_lines
    from .peers import fmt_ratio, paired_ratio
    from .quality import flag_note, load_flags
    from .tables import fmt_spread

    facts = facts or RunFacts()
    flags = load_flags(cfg.quality_from)
    measured = [r for r in rows if not r.skipped and r.engine == "glowplug"]
    probes = [p for r in measured for p in r.probe_gbps]
    fastest = [p for r in measured for p in r.probe_fastest_gbps]
    contexts = ", ".join(str(c) for c in cfg.prompt_tokens)
    labels = list(dict.fromkeys(p.label for r in measured for p in r.peers))
    probe_text = (
        f"sustained {statistics.median(probes):.1f} GB/s (median over the runs; {min(probes):.1f}-{max(probes):.1f})"
        if probes
        else "no runs"
    )
    if fastest:
        probe_text += f", fastest pass {statistics.median(fastest):.1f} GB/s ({min(fastest):.1f}-{max(fastest):.1f})"
    peer_contexts = ", ".join(str(c) for c in cfg.prompt_tokens if cfg.peer_at(c))
    peak = facts.peak_flops
    lines = [
        report_header("Decode throughput", argv),
        *(
            [f"Re-rendered from `{from_json}`: the runs were made by {facts.made_by or 'an unrecorded command'}.", ""]
            if from_json is not None
            else []
        ),
        f"Model `{cfg.model}`, context (prompt tokens) {contexts}, {cfg.new_tokens} new tokens per sequence, greedy, "
        f"n={cfg.repeats} runs per cell, {facts.threads or '?'} threads. Streaming-read probe, re-measured before "
        f"every run ({facts.probe_method or 'fastest of 5 sums over 1 GiB'}): {probe_text}. Every share (% of probe, "
        f"KV read at % of probe) is against the run's sustained rate. Peers at context {peer_contexts}, paired with "
        "every run.",
        "",
    ]
    if peak:
        lines += [f"Compute peak (the prefill's % of peak): {facts.peak_text()}.", ""]
    for label, info in facts.peers_info.items():
        lines.append(f"- peer {label}: {info}")
    if facts.peers_info:
        lines.append("")
    lines += [
        "| engine | ISA level | compile | dtype | quantization | group | KV cache | max model len | batch | context "
        "| decode tok/s | ms / step | host ms / step | prefill ms | prefill tok/s | prefill GFLOP/s | % of int8 peak "
        "| peak mem GB | weights GB | KV pool GB "
        "| peers GB | rest GB | RSS before the engine GB | model_size MB | GB/s | % of probe "
        "| KV MB / step | extra ms over the shortest context | KV read at % of probe "
        "| vs bf16 (same dtype, compile) | " + "".join(f"vs {lb} | " for lb in labels) + "step / batch-1 step |",
        "|---|---|---|---|---|---|---|" + "---:|" * (24 + len(labels)),
    ]
    for r in measured:
        mb = f"{r.mb_per_token:.1f}" if r.mb_per_token is not None else "-"
        share = fmt_spread([100 * s for s in r.shares], 1) if r.shares else "-"
        by_label = {p.label: p for p in r.peers}
        vs_peers = "".join(
            f"{fmt_ratio(paired_ratio(r.tokens_per_s, by_label[lb]), by_label[lb].skipped)} | "
            if lb in by_label
            else "- | "
            for lb in labels
        )
        gbps = fmt_spread([r.mb_per_token / ms for ms in r.step_ms], 1) if r.mb_per_token is not None else "-"
        base = next((b for b in measured if b.quantization == "none" and _same_cell(b, r, but="quantization")), None)
        vs_bf16 = _paired(r.tokens_per_s, base.tokens_per_s) if base is not None and r.quantization != "none" else "-"
        prefill = fmt_spread(r.prefill_ms, 1) if r.prefill_ms else "-"
        pp_tps = fmt_spread(r.prefill_tps, 1) if r.prefill_tps else "-"
        pp_flops = r.prefill_flops_per_s
        pp_gflops = fmt_spread([f / 1e9 for f in pp_flops], 1) if pp_flops else "-"
        pp_share = fmt_spread([100 * f / peak for f in pp_flops], 1) if pp_flops and peak else "-"
        host = fmt_spread(r.host_ms, 3) if r.host_ms else "-"
        peak_mem = fmt_spread(r.peak_gb, 2) if r.peak_gb else "-"
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
            f"| {fmt_spread(r.step_ms, 2)} | {host} | {prefill} | {pp_tps} | {pp_gflops} | {pp_share} | {peak_mem} "
            f"| {' | '.join(split)} | {rest} | {before} "
            f"| {mb} | {gbps} | {share} | {kv_mb} | {extra} | {kv_share} | {vs_bf16} | {vs_peers}{scale}{note} |"
        )
    lines += _peer_table(measured)
    lines += _max_len_table(measured)
    lines += _graph_pool_table(measured)
    lines += _invariance_table(facts, measured)
    verdicts = decode_verdicts(rows, cfg, facts)
    if verdicts:
        from .verdicts import verdicts_markdown

        lines += ["", "## Verdicts", "", verdicts_markdown(verdicts)]
    left_out = [r for r in rows if r.skipped]
    if left_out:
        lines += ["", "Left out (the KV cache cannot hold the batch at that context):"]
        lines += [
            f"- {r.compile}/{r.dtype}/{r.quantization}/KV {r.kv_cache_dtype}, batch {r.batch}, context "
            f"{r.context}: {r.skipped}"
            for r in left_out
        ]
    lines += ["", *[f"- {line}" for line in DEFINITIONS], *([f"- {flag_note(flags)}"] if flags else [])]
    per_run = [line for r in measured for line in run_lines(r, cfg, bench_device(cfg.device))]
    if per_run:
        lines += [
            "",
            "Per-run lines (seed 003's generate.py format: one line per timed run; mem/s = model_size over "
            "that run's ms / step, peak_mem = that run's RSS high-water mark, cache_size = max model len):",
            "",
            "```text",
            *per_run,
            "```",
        ]
    return "\n".join([*lines, ""])


def _peer_table(rows: list[DecodeRow]) -> list[str]:
    """Each peer's own decode and prefill inside each glowplug cell, beside glowplug's runs it is paired with."""
    from .peers import pair_ratios, paired_ratio
    from .tables import fmt_spread

    body = []
    for r in rows:
        for p in r.peers:
            cells = f"| {r.compile} | {r.dtype} | {r.quantization} | {r.kv_cache_dtype} | {r.batch} | {r.context} "
            if p.skipped:
                body.append(
                    f"{cells}| {p.label} | {fmt_spread(r.tokens_per_s, 1)} | skipped: {p.skipped} "
                    "| - | - | - | - | - | - | - |"
                )
                continue
            ratio = paired_ratio(r.tokens_per_s, p)
            assert ratio is not None
            pp = pair_ratios(p.prefill_ms, r.prefill_ms)  # peer time over glowplug's: glowplug's speed-up
            pp_cells = (
                f"{fmt_spread(r.prefill_ms, 1)} | {fmt_spread(p.prefill_ms, 1)} | {pp.median:.2f}x | {pp.worst:.2f}x"
                if pp is not None
                else "- | - | - | -"
            )
            body.append(
                f"{cells}| {p.label} | {fmt_spread(r.tokens_per_s, 1)} | {fmt_spread(p.tokens_per_s, 1)} "
                f"| {fmt_spread(p.step_ms, 2)} | {ratio.median:.2f}x | {ratio.worst:.2f}x | {pp_cells} |"
            )
    if not body:
        return []
    return [
        "",
        "Peers, paired run by run (each peer ran right after glowplug's run i, on the same prompts; prefill "
        "ratio = the peer's prefill ms over glowplug's, so above 1 glowplug is faster):",
        "",
        "| compile | dtype | quantization | KV cache | batch | context | peer | glowplug tok/s | peer tok/s "
        "| peer ms / step | ratio median | worst pair | glowplug prefill ms | peer prefill ms "
        "| prefill ratio median | prefill worst pair |",
        "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *body,
    ]


def _invariance_table(facts: RunFacts, rows: list[DecodeRow]) -> list[str]:
    """Per engine, the batch-invariance check and the batch-16 step it runs at (the invariant kernels are the
    default: that step is what invariance costs at most)."""
    if not facts.invariance:
        return []
    out = [
        "",
        f"Batch invariance ({len(INVARIANCE_PROMPTS)} prompts, {INVARIANCE_TOKENS} greedy tokens each: the "
        "batch of 8 against each prompt alone, and the batch in reversed row order against alone; LLM.generate):",
        "",
        "| compile | dtype | quantization | KV cache | max model len | batched = alone | reversed = alone "
        "| differing prompts | batch-16 ms / step (invariant kernels) |",
        "|---|---|---|---|---:|---:|---:|---|---:|",
    ]
    for inv in facts.invariance:
        b16 = next((r for r in rows if r.batch == 16 and _engine_key(r) == _engine_key(inv)), None)
        differ = "; ".join(f"`{p}`" for p in inv.differ) or "none"
        out.append(
            f"| {inv.compile} | {inv.dtype} | {inv.quantization} | {inv.kv_cache_dtype} | {inv.max_model_len} "
            f"| {inv.equal}/{inv.total} | {inv.reversed_equal}/{inv.total} | {differ} "
            f"| {b16.ms:.2f} (context {b16.context}) |"
            if b16 is not None
            else f"| {inv.compile} | {inv.dtype} | {inv.quantization} | {inv.kv_cache_dtype} | {inv.max_model_len} "
            f"| {inv.equal}/{inv.total} | {inv.reversed_equal}/{inv.total} | {differ} | no batch-16 cell |"
        )
    return out


def _max_len_table(rows: list[DecodeRow]) -> list[str]:
    """With several --max-model-len cells: each cell's ms / step over the same configuration's at the shortest max
    model len, paired run by run (median and the worst pair). Issue 38's target: within 5% (8192 vs 512)."""
    lens = sorted({r.max_model_len for r in rows if r.engine == "glowplug"})
    if len(lens) < 2:
        return []
    out = [
        "",
        f"Step time against max model len {lens[0]} (same configuration, batch and context; runs paired in order):",
        "",
        "| compile | dtype | quantization | KV cache | batch | context | max model len "
        "| ms / step | ratio median | worst pair |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.engine != "glowplug" or r.max_model_len == lens[0]:
            continue
        base = _at_max_len(r, rows, lens[0])
        if base is None:
            continue
        pairs = [a / b for a, b in zip(r.step_ms, base.step_ms)]
        out.append(
            f"| {r.compile} | {r.dtype} | {r.quantization} | {r.kv_cache_dtype} | {r.batch} | {r.context} "
            f"| {r.max_model_len} | {r.ms:.3f} vs {base.ms:.3f} | {statistics.median(pairs):.3f}x "
            f"| {max(pairs):.3f}x |"
        )
    return out


def _graph_pool_table(rows: list[DecodeRow]) -> list[str]:
    """Per engine (configuration and max model len) that captured CUDA graphs: its graph pool after capture against
    the largest captured size's activations (the target: at most 1.5x)."""
    seen: dict[tuple[Any, ...], DecodeRow] = {}
    for r in rows:
        if r.graph_pool_gb is not None:
            seen.setdefault(_engine_key(r), r)
    if not seen:
        return []
    out = [
        "",
        "CUDA graph pool per engine (torch.cuda.memory_snapshot after capture, the graphs' pool only) against "
        "the activations of the largest captured batch (the allocator's peak over one uncaptured step):",
        "",
        "| compile | dtype | quantization | KV cache | max model len | largest captured batch | graph pool GB "
        "| activations GB | pool / activations |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for (mode, dtype, quant, kv, max_len), r in seen.items():
        act = r.graph_activation_gb
        ratio = f"{r.graph_pool_gb / act:.2f}x" if act else "-"
        out.append(
            f"| {mode} | {dtype} | {quant} | {kv} | {max_len} | {r.graph_largest_size or '-'} "
            f"| {r.graph_pool_gb:.3f} | {f'{act:.3f}' if act is not None else '-'} | {ratio} |"
        )
    return out


LONG_CONTEXT = 2048  # issue 34's long-context target applies at this context (prompt tokens)
LONG_CONTEXT_SHARE = 70.0  # ... the extra KV bytes read at >= 70% of the probe
MAX_LEN_RATIO = 1.05  # issue 38: a step's time at the longest max model len within 5% of the shortest's


# What one engine is (its configuration and max model len), and what makes one of its cells: two rows that agree on
# every field of a cell measured the same thing, so a comparison varies one field and holds the others.
ENGINE_FIELDS = ("compile", "dtype", "quantization", "kv_cache_dtype", "max_model_len")
CELL_FIELDS = (*ENGINE_FIELDS, "batch", "context")


def _engine_key(r: Any) -> tuple[Any, ...]:
    """The engine a row (or a batch-invariance check) ran on: its ENGINE_FIELDS."""
    return tuple(getattr(r, f) for f in ENGINE_FIELDS)


def _same_cell(a: DecodeRow, b: DecodeRow, *, but: str) -> bool:
    """Whether two rows agree on every cell field except `but` (the one the comparison varies)."""
    return all(getattr(a, f) == getattr(b, f) for f in CELL_FIELDS if f != but)


def _at_max_len(r: DecodeRow, rows: list[DecodeRow], max_model_len: int) -> DecodeRow | None:
    """glowplug's row of r's cell at another max model len, if the run has one."""
    return next(
        (
            b
            for b in rows
            if b.engine == "glowplug" and b.max_model_len == max_model_len and _same_cell(b, r, but="max_model_len")
        ),
        None,
    )


def _kv_extra(r: DecodeRow, rows: list[DecodeRow]) -> tuple[list[float], list[float]] | None:
    """Per run, r's ms / step over the same cell's at the shortest context, and the extra KV bytes it reads over
    that extra time as a % of the run's probe (the long-context target); None for a peer's row, a row without
    KV bytes, or the shortest context itself."""
    if r.engine != "glowplug" or r.kv_mb is None:
        return None
    same = [b for b in rows if b.engine == r.engine and b.kv_mb is not None and _same_cell(b, r, but="context")]
    short = min(same, key=lambda b: b.context)
    if short is r or short.kv_mb is None:
        return None
    extra = [a - b for a, b in zip(r.step_ms, short.step_ms)]
    kv_gb = (r.kv_mb - short.kv_mb) * r.batch / 1e3
    return extra, [100 * kv_gb / (e / 1e3) / p for e, p in zip(extra, r.probe_gbps) if e > 0]


# The real-size targets (--targets), each held on its worst pair or run.
BATCH1_VS_LLAMACPP = 1.05  # batch-1 decode tok/s over llama.cpp's on the same file
BATCH1_PROBE_SHARE = 85.0  # batch-1 decode at >= 85% of (sustained probe / bytes read per token)
BATCH16_VS_BATCH1 = 6.0  # aggregate decode at batch 16 over glowplug's batch 1
BATCH16_VS_LLAMACPP = 1.2  # ... over llama.cpp decoding 16 sequences in one batch
PREFILL_CONTEXT = 512
PREFILL_VS_LLAMACPP = 2.0  # a 512-token prompt's prefill over llama.cpp's pp512
INVARIANCE_COST = 5.0  # batch invariance may cost at most 5% of the batch-16 step


def _ratio_verdict(target: str, ratio: Any, least: float, pairs: str, a: str, b: str, missing: str = "no runs") -> Any:
    """A target held on the worst of paired ratios (`ratio`: a peers.PairedRatio, None without a pair): a over b,
    both medians quoted, met when the worst pair is at least `least`."""
    from .verdicts import Verdict

    if ratio is None:
        return Verdict(target, missing, None)
    text = f"{a} vs {b} (medians); {pairs} median {ratio.median:.2f}x, worst pair {ratio.worst:.2f}x (n={ratio.n})"
    return Verdict(target, text, ratio.worst >= least)


def real_size_verdicts(rows: list[DecodeRow], cfg: DecodeBenchConfig, facts: RunFacts) -> list[Any]:
    """The real-size targets (--targets) per engine, on the cells the run has: batch 1 at the first peer context
    against every llama.cpp peer and against the sustained probe over the bytes a token reads; batch 16 at that
    context against batch 1 (paired by run order) and against llama.cpp batched; the prefill at PREFILL_CONTEXT
    against every llama.cpp peer's; the batch-invariance check; and its cost, which needs kernels that are not
    invariant to set against, so it has no verdict (the batch-16 step is quoted)."""
    from .peers import pair_ratios, paired_ratio
    from .verdicts import Verdict

    measured = [r for r in rows if not r.skipped and r.engine == "glowplug"]
    contexts = [c for c in cfg.prompt_tokens if cfg.peer_at(c)]
    out: list[Verdict] = []
    for key in dict.fromkeys(_engine_key(r) for r in measured):
        rs = [r for r in measured if _engine_key(r) == key]
        what = f"{key[0]}/{key[1]}/{key[2]}/KV {key[3]}"
        base = contexts[0] if contexts else min(r.context for r in rs)
        one = next((r for r in rs if r.batch == 1 and r.context == base), None)
        b16 = next((r for r in rs if r.batch == 16 and r.context == base), None)
        pp = next((r for r in rs if r.batch == 1 and r.context == PREFILL_CONTEXT), None)
        if one is not None:
            for p in one.peers:
                if not p.label.startswith("llama.cpp"):
                    continue
                target = f"batch-1 decode >= {BATCH1_VS_LLAMACPP:g}x {p.label} ({what}, context {base})"
                peer_tps = f"{statistics.median(p.tokens_per_s):.1f}" if p.tokens_per_s else ""
                ratio = paired_ratio(one.tokens_per_s, p)
                out.append(
                    _ratio_verdict(
                        target,
                        ratio,
                        BATCH1_VS_LLAMACPP,
                        "pairs",
                        f"{one.tps:.1f} tok/s",
                        peer_tps,
                        p.skipped or "no runs",
                    )
                )
            shares = [100 * x for x in one.shares]
            target = (
                f"batch-1 decode >= {BATCH1_PROBE_SHARE:g}% of sustained probe / bytes per token ({what}, "
                f"{one.mb_per_token or 0:.0f} MB per token)"
            )
            out.append(
                Verdict(
                    target,
                    f"worst run {min(shares):.1f}% (median {statistics.median(shares):.1f}%, n={len(shares)})"
                    if shares
                    else "no bytes per token",
                    min(shares) >= BATCH1_PROBE_SHARE if shares else None,
                )
            )
        if one is not None and b16 is not None:
            ratio = pair_ratios(b16.tokens_per_s, one.tokens_per_s)
            target = f"batch-16 aggregate decode >= {BATCH16_VS_BATCH1:g}x glowplug's batch 1 ({what}, context {base})"
            out.append(
                _ratio_verdict(
                    target, ratio, BATCH16_VS_BATCH1, "runs paired in order", f"{b16.tps:.1f} tok/s", f"{one.tps:.1f}"
                )
            )
        if b16 is not None:
            for p in b16.peers:
                if not p.label.startswith("llama.cpp") or p.skipped:
                    continue
                ratio = paired_ratio(b16.tokens_per_s, p)
                target = f"batch-16 aggregate decode >= {BATCH16_VS_LLAMACPP:g}x {p.label} at 16 sequences ({what})"
                peer_tps = f"{statistics.median(p.tokens_per_s):.1f}" if p.tokens_per_s else ""
                out.append(
                    _ratio_verdict(target, ratio, BATCH16_VS_LLAMACPP, "pairs", f"{b16.tps:.1f} tok/s", peer_tps)
                )
            out.append(
                Verdict(
                    f"batch invariance costs <= {INVARIANCE_COST:g}% of the batch-16 step ({what})",
                    f"batch-16 step {b16.ms:.2f} ms with the invariant kernels (the default); no kernels "
                    "that vary with the batch to set it against",
                    None,
                )
            )
        if pp is not None:
            for p in pp.peers:
                if not p.label.startswith("llama.cpp") or p.skipped:
                    continue
                ratio = pair_ratios(p.prefill_ms, pp.prefill_ms)
                glow = statistics.median(pp.prefill_tps) if pp.prefill_tps else 0.0
                peer = statistics.median(PREFILL_CONTEXT / (ms / 1e3) for ms in p.prefill_ms) if p.prefill_ms else 0.0
                target = f"prefill of {PREFILL_CONTEXT} tokens >= {PREFILL_VS_LLAMACPP:g}x {p.label}'s pp512 ({what})"
                out.append(
                    _ratio_verdict(target, ratio, PREFILL_VS_LLAMACPP, "pairs", f"{glow:.1f} tok/s", f"{peer:.1f}")
                )
    for inv in facts.invariance:
        what = f"{inv.compile}/{inv.dtype}/{inv.quantization}/KV {inv.kv_cache_dtype}"
        out.append(
            Verdict(
                f"batch invariance: {inv.total} prompts batched = alone = reversed rows, {inv.tokens} "
                f"greedy tokens ({what})",
                f"batched {inv.equal}/{inv.total}, reversed {inv.reversed_equal}/{inv.total}",
                inv.passed,
            )
        )
    return out


def decode_verdicts(
    rows: list[DecodeRow], cfg: DecodeBenchConfig | None = None, facts: RunFacts | None = None
) -> list[Any]:
    """The targets this run's cells can be held to, each on its worst run or pair: the KV read share at
    LONG_CONTEXT tokens (issue 34) and the step time over max model lens (issue 38); with `cfg.targets`, the
    real-size targets (real_size_verdicts) too."""
    from .verdicts import Verdict

    measured = [r for r in rows if not r.skipped and r.engine == "glowplug"]
    out: list[Verdict] = []
    if cfg is not None and cfg.targets:
        out += real_size_verdicts(rows, cfg, facts or RunFacts())
    for r in measured:
        if r.context != LONG_CONTEXT:
            continue
        kv = _kv_extra(r, measured)
        if kv is None:
            continue
        shares = kv[1]
        what = f"{r.compile}/{r.dtype}/{r.quantization}/KV {r.kv_cache_dtype}, batch {r.batch}"
        worst = min(shares) if shares else None
        out.append(
            Verdict(
                f"KV read at >= {LONG_CONTEXT_SHARE:.0f}% of the sustained probe at {LONG_CONTEXT} tokens ({what})",
                f"worst run {worst:.1f}%" if worst is not None else "no run read more than the shortest",
                None if worst is None else worst >= LONG_CONTEXT_SHARE,
            )
        )
    lens = sorted({r.max_model_len for r in measured})
    if len(lens) >= 2:
        for r in measured:
            if r.max_model_len != lens[-1]:
                continue
            base = _at_max_len(r, measured, lens[0])
            if base is None:
                continue
            worst = max(a / b for a, b in zip(r.step_ms, base.step_ms))
            what = f"{r.compile}/{r.dtype}/{r.quantization}/KV {r.kv_cache_dtype}, batch {r.batch}, context {r.context}"
            out.append(
                Verdict(
                    f"step at max model len {lens[-1]} within {100 * (MAX_LEN_RATIO - 1):.0f}% of {lens[0]}'s ({what})",
                    f"worst pair {worst:.3f}x",
                    worst <= MAX_LEN_RATIO,
                )
            )
    return out


def _long_context(r: DecodeRow, rows: list[DecodeRow]) -> tuple[str, str]:
    """This row's step time over the same configuration's at the shortest context, paired run by run, and the KV
    bytes it reads more, as GB/s over that extra time against each run's probe (issue 34's long-context target: at
    least 70%)."""
    from .tables import fmt_spread

    kv = _kv_extra(r, rows)
    if kv is None:
        return "-", "-"
    extra, shares = kv
    return fmt_spread(extra, 2), (fmt_spread(shares, 1) if shares else "-")


DEFINITIONS = (
    "decode tok/s: tokens after every sequence's first token, over the time from then to the batch's end (prefill "
    "excluded, for both engines). Every cell with a spread: median over the runs (min–max); one run is marked n=1.",
    "ms / step: decode time over decode steps; one step produces one token per sequence.",
    "host ms / step: the median decode step's wall time minus its model call (compiled step or eager forward) and "
    "its sampler: the engine's own work per step (scheduling, inputs, booking, detokenizing, outputs).",
    "prefill ms: requests added -> every sequence of the batch has its first token (seed 000's prefill column). "
    "prefill tok/s: batch x context over that time. prefill GFLOP/s: the prefill's FLOPs (2 per multiply-accumulate "
    "of every projection for every prompt token, causal attention's QK^T and PV, the LM head for each prompt's last "
    "token) over that time; % of int8 peak: against the compute peak above (cores x clock x the int8 MACs per cycle "
    "of the kernels' ISA level x 2).",
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
    "model_size MB: seed 003's model_size, the weight bytes one batch-1 decode step reads through the kernels the "
    "path runs, LM head included: the engine's own count on its native_kernels span (Attr.BYTES_PER_TOKEN: every "
    "layer switched to a native op, a GGUF layer's stored blocks as in the file) when the start made one, else the "
    "bench's walk over the layers (compile off: the eager dispatcher's layouts, a GGUF layer's stored blocks).",
    "% of probe: GB/s as a percentage of the sustained streaming-read probe (the median of its passes) measured "
    "right before the same run: the batch-1 decode's share of (sustained probe / bytes read per token).",
    "vs <peer>: paired within the run. Each repeat i times this glowplug cell, then each peer on the same prompt "
    "token ids, back to back after one probe; ratio_i = glowplug tok/s_i / peer tok/s_i; the cell shows the median "
    "ratio, the worst pair (the smallest ratio, what a verdict uses) and n. Peers run at --peer-contexts (default: "
    "the first context). transformers: `generate` (greedy) in the column's dtype, decode time = generate(N) - "
    "generate(1). llama.cpp: llama-cpp-python's generator loop on the GGUF the engine loaded, n_threads = torch's "
    "threads, greedy; the prompt's eval and first token are the prefill, decode time = the next N - 1 single-token "
    "evals and samples; batch 1 only. llama.cpp batched: the library's batched API on the same model and threads, "
    "n_seq_max = the batch, n_batch = n_ubatch = 512 (so at a 512-token prompt its prefill is llama-bench's pp512), "
    "prompts evaluated in batches of 512 tokens, then one llama_decode per step for every sequence and a greedy "
    "argmax per sequence (as llama.cpp's batched-bench, which samples nothing). The peers' builds are listed above "
    "the table.",
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
