"""ServeBenchConfig: every `glowplug bench serve` flag, validated by one pydantic model (flags are generated from it).

Pure pydantic and the stdlib: the CLI imports this module while it builds its parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from glowplug.engine.config import Quantization
from glowplug.profiling.bench.cli_support import BenchEngineFields

Arrival = Literal["poisson", "burst", "constant"]
Endpoint = Literal["completions", "chat"]
LengthDistribution = Literal["fixed", "uniform"]


class ServeBenchConfig(BenchEngineFields):
    """Load against an OpenAI-compatible server: a sweep of load points, or the soak / efficiency / overload /
    fuzz / hostile modes. Without --base-url the benchmark starts `glowplug serve` itself with the engine flags given
    here."""

    base_url: str | None = Field(
        None, description="A running server (http://127.0.0.1:8000); unset = start one with the engine flags."
    )
    served_model_name: str | None = Field(None, description="The `model` to send (default: what /v1/models lists).")
    # Pinned, not the engine's default (auto): the serve reports measure one bf16 server, release after release.
    quantization: Quantization = Field("none", description="The server's --quantization.")
    endpoint: Endpoint = Field("completions", description="completions or chat.")
    # ---- load points
    concurrency: tuple[int, ...] = Field((1, 8, 32, 64), description="Closed-loop load points: clients in flight.")
    request_rate: tuple[float, ...] = Field(
        (), description="Open-loop load points in requests/s (run after the concurrency points)."
    )
    arrival: Arrival = Field(
        "poisson", description="Open-loop arrivals: poisson, burst (groups of --burst-size) or constant."
    )
    burst_size: int = Field(8, ge=1, description="Requests per burst with --arrival burst.")
    num_prompts: int = Field(64, ge=1, description="Requests per load point and run.")
    max_duration: float = Field(600.0, gt=0, description="Seconds a load point may run before it stops sending.")
    runs: int = Field(3, ge=1, description="Runs per load point (figures are the median over runs, with spread).")
    warmup_requests: int = Field(2, ge=0, description="Untimed requests before the first load point.")
    # ---- the request set
    dataset: Path | None = Field(
        None, description="JSONL: one object a line with `prompt` (or chat `messages`) and optional `output_len`."
    )
    input_len: int = Field(128, ge=1, description="Synthetic prompt tokens (mean with --len-distribution uniform).")
    output_len: int = Field(64, ge=1, description="Tokens to generate per request (mean when uniform).")
    len_distribution: LengthDistribution = Field("fixed", description="fixed, or uniform within ±--range-ratio.")
    range_ratio: float = Field(0.5, ge=0.0, lt=1.0, description="Spread of the uniform length distribution.")
    ignore_eos: bool = Field(True, description="Generate exactly the requested output lengths.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of every request.")
    request_timeout: float = Field(600.0, gt=0, description="Seconds one request may take.")
    # ---- SLO (goodput)
    slo_ttft_ms: float | None = Field(None, gt=0, description="Goodput: time-to-first-token limit in ms.")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Goodput: time-per-output-token limit in ms.")
    # ---- the server the benchmark starts (ignored with --base-url)
    max_num_seqs: int = Field(64, ge=1, description="Engine batch limit of the started server.")
    max_model_len: int | None = Field(None, ge=16, description="max-model-len of the started server.")
    max_queue: int = Field(1024, ge=1, description="--max-queue of the started server.")
    max_queue_wait: float | None = Field(
        None, ge=0.0, description="--max-queue-wait of the started server (default: the server's own)."
    )
    # ---- modes (without one: the load-point sweep)
    soak: bool = Field(False, description="Soak: --soak-streams mixed streams for --soak-duration, then checks.")
    soak_duration: float = Field(120.0, gt=0, description="Soak seconds.")
    soak_streams: int = Field(64, ge=1, description="Concurrent soak clients.")
    hangup_fraction: float = Field(0.1, ge=0.0, le=0.5, description="Soak clients that hang up mid-stream.")
    efficiency: bool = Field(False, description="The same request set over HTTP and offline (LLM.generate).")
    efficiency_concurrency: int = Field(64, ge=1, description="HTTP clients in the efficiency run.")
    overload: bool = Field(False, description="Capacity, the sustainable rate, then --overload-factor times it.")
    overload_factor: float = Field(4.0, gt=1.0, description="Overload rate / sustainable rate.")
    sustainable_load: float = Field(0.8, gt=0.0, le=1.0, description="Sustainable rate / measured capacity.")
    sustainable_rate: float | None = Field(None, gt=0, description="Skip the capacity run: use this rate.")
    fuzz: bool = Field(False, description="schemathesis against the server's OpenAPI document.")
    fuzz_cases: int = Field(500, ge=1, description="Generated cases per fuzzed endpoint.")
    # Bounds on what the fuzzer asks the server to generate (not on the server's limits): an unbounded case asks for
    # up to max-model-len tokens, n times over, and 500 of them do not finish in minutes on a small CPU.
    fuzz_max_tokens: int = Field(
        16, ge=1, description="--fuzz: generated max_tokens/max_completion_tokens above this (or absent) are set to it."
    )
    fuzz_max_n: int = Field(2, ge=1, description="--fuzz: generated n and best_of above this are set to it.")
    fuzz_max_prompt_chars: int = Field(
        64, ge=1, description="--fuzz: strings under the generated prompt and messages are cut to this many characters."
    )
    fuzz_max_prompt_items: int = Field(
        4, ge=1, description="--fuzz: lists under the generated prompt and messages are cut to this many items."
    )
    hostile: bool = Field(
        False,
        description="Hostile input: a large prompt refused under load, the tokenizer's "
        "hold on other threads, the hostile corpus, and the limits' cost on throughput.",
    )
    hostile_prompt_mb: float = Field(20.0, gt=0, description="Size of the prompt refused under load, in MB.")
    hostile_refusals: int = Field(3, ge=1, description="Large prompts sent in a row per run.")
    hostile_streams: int = Field(4, ge=1, description="Streams generating while the large prompt is refused.")
    hostile_stream_tokens: int = Field(
        2048, ge=16, description="max_tokens of those streams (they are hung up when the run ends)."
    )
    hostile_hold_chars: int = Field(2_000_000, ge=1000, description="Prompt size for the tokenizer-hold measurement.")
    hostile_idle_connections: int = Field(300, ge=1, description="Idle connections opened at once by the corpus.")
    hostile_concurrency: int = Field(16, ge=1, description="Closed-loop clients of the limits' cost pairs.")
    hostile_timeouts: float | None = Field(
        None,
        gt=0,
        description="--body-read-timeout and --header-read-timeout of the server with the limits "
        "(default: the server's, 60 s and 20 s); the corpus's slow cases last that long.",
    )
    structured: bool = Field(
        False,
        description="Structured outputs and tool calls: TPOT of 8 constrained rows in a "
        "batch of 16, a grammar's extra TTFT, llguidance's own times, and the validity of "
        "generated objects and tool calls (with --real-model).",
    )
    structured_data: Path | None = Field(
        None, description="--structured: the schemas, prompts and tools (JSON; default: the packaged set)."
    )
    real_model: Path | None = Field(
        None,
        description="--structured: a GGUF whose server (--quantization auto) also generates the objects and "
        "the tool calls.",
    )
    structured_real_only: bool = Field(
        False, description="--structured: only --real-model's objects and tool calls -> structured_real.{json,md}."
    )
    structured_objects: int = Field(200, ge=1, description="--structured: objects generated per model.")
    structured_max_tokens: int = Field(160, ge=8, description="--structured: max_tokens of each object.")
    structured_tpot_tokens: int = Field(64, ge=4, description="--structured: tokens per stream of the TPOT batches.")
    structured_ttft_trials: int = Field(5, ge=1, description="--structured: TTFT trials (at least --runs).")
    structured_tool_tokens: int = Field(96, ge=8, description="--structured: max_tokens of each tool-call request.")
    structured_forced_prompts: int = Field(
        15, ge=1, description="--structured: tool prompts run with tool_choice required and named."
    )
    # ---- output
    # Under the working directory, named after the command: never the checkout's reports/ unless asked.
    out_dir: Path = Field(Path("serve"), description="Where the JSON, Markdown and PNG go.")
    plots: bool = True

    @model_validator(mode="after")
    def _check(self) -> ServeBenchConfig:
        if any(c < 1 for c in self.concurrency):
            raise ValueError("--concurrency values must be >= 1")
        if any(r <= 0 for r in self.request_rate):
            raise ValueError("--request-rate values must be > 0 requests/s")
        for name in ("concurrency", "request_rate"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"--{name.replace('_', '-')} lists a value twice: {list(values)}")
        if self.dataset is not None and not self.dataset.is_file():
            raise ValueError(f"--dataset {self.dataset}: file not found")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {self.base_url!r}: give a URL such as http://127.0.0.1:8000")
        if self.hostile and self.base_url is not None:
            raise ValueError("--hostile starts its own servers (with and without the limits); drop --base-url")
        if self.structured_data is not None and not self.structured_data.is_file():
            raise ValueError(f"--structured-data {self.structured_data}: file not found")
        if self.real_model is not None and not self.real_model.is_file():
            raise ValueError(f"--real-model {self.real_model}: file not found (a .gguf)")
        if self.efficiency and self.base_url is not None:
            raise ValueError("--efficiency builds the offline engine from the engine flags; drop --base-url")
        return self

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes asked for; the sweep when none is."""
        chosen = tuple(
            m for m in ("soak", "efficiency", "overload", "fuzz", "hostile", "structured") if getattr(self, m)
        )
        return chosen or ("sweep",)
