"""The one vocabulary of glowplug's observability: span names, attribute keys and phase-table rows.

Logs, traces, the phase table, `/startup` and `/metrics` all use these strings, so a number can be followed from a
table cell to the span it came from and to the log line written when that span ended. The row names deliberately
match vLLM's start-up table (seed 004) where users already know them.

Bump SCHEMA_VERSION whenever a name changes meaning or disappears: reports and dashboards key on these strings.
This module only defines constants; importing it is free, so the CLI can use it before heavy imports.
"""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final = "1"
PREFIX: Final = "glowplug"

# ---------------------------------------------------------------- spans
STARTUP_SPAN: Final = "glowplug.startup"
REQUEST_SPAN: Final = "glowplug.request"
# The shutdown drain: from the signal until every in-flight request finished or was aborted.
DRAIN_SPAN: Final = "glowplug.drain"

# Stage names: each is the suffix of its span name `glowplug.startup.<stage>`.
MODEL_PREPARE: Final = "model_prepare"
TOKENIZER_INIT: Final = "tokenizer_init"
GRAMMAR_INIT: Final = "grammar_init"  # the tokenizer's view for constrained decoding
LOAD_WEIGHTS: Final = "load_weights"
MODEL_INIT: Final = "model_init"
QUANTIZE_WEIGHTS: Final = "quantize_weights"
NATIVE_KERNELS: Final = "native_kernels"
DYNAMO_TRANSFORM: Final = "dynamo_transform"
GRAPH_COMPILE: Final = "graph_compile"
KV_CACHE_PROFILING: Final = "kv_cache_profiling"
KV_CACHE_INIT: Final = "kv_cache_init"
GRAPH_CAPTURE: Final = "graph_capture"
WARMUP: Final = "warmup"

# The default pipeline order. The engine owns the actual list; this tuple is the reference order for docs and tests.
STAGES: Final[tuple[str, ...]] = (
    MODEL_PREPARE,
    TOKENIZER_INIT,
    GRAMMAR_INIT,
    LOAD_WEIGHTS,
    MODEL_INIT,
    QUANTIZE_WEIGHTS,
    NATIVE_KERNELS,
    DYNAMO_TRANSFORM,
    GRAPH_COMPILE,
    KV_CACHE_PROFILING,
    KV_CACHE_INIT,
    GRAPH_CAPTURE,
    WARMUP,
)

# Pre-main phases: they happen before any stage can run, so they are recorded afterwards from timestamps
# (process creation from the OS, then our own marks) as spans with explicit start and end times.
PROCESS_START: Final = "process_start"  # OS process creation -> first line of our code
IMPORTS: Final = "imports"  # first line of our code -> heavy imports done
# `glowplug serve` runs the engine core in a process of its own: the server starts it once its own imports are done.
CORE_PROCESS_START: Final = "core_process_start"  # the server starts the core -> the core's first line
CORE_IMPORTS: Final = "core_imports"  # the core's first line -> its heavy imports (torch, the engine) done
PRE_MAIN: Final[tuple[str, ...]] = (PROCESS_START, IMPORTS, CORE_PROCESS_START, CORE_IMPORTS)
# The Prometheus gauge of the predicted time to READY (seconds from process creation), set from the first plan on.
STARTUP_PREDICTED_METRIC: Final = "glowplug_startup_predicted_seconds"


def stage_span_name(stage: str) -> str:
    """`glowplug.startup.<stage>`; pre-main phases use the same form so one prefix finds the whole start-up."""
    return f"{STARTUP_SPAN}.{stage}"


def stage_from_span_name(span_name: str) -> str | None:
    """The stage of a `glowplug.startup.<stage>` span name, else None (root span, request spans, foreign spans)."""
    prefix = STARTUP_SPAN + "."
    if span_name.startswith(prefix) and len(span_name) > len(prefix):
        return span_name[len(prefix) :]
    return None


# ---------------------------------------------------------------- attribute keys
class Attr:
    """Span attribute keys (also the keys of structured log fields and of the JSON report's `attributes`)."""

    SCHEMA_VERSION: Final = "glowplug.schema_version"
    STAGE: Final = "glowplug.stage"
    # Tensor parallelism: which rank's span this is, of how many (every rank's start-up spans share one trace).
    RANK: Final = "rank"
    WORLD_SIZE: Final = "world_size"
    TP_BACKEND: Final = "glowplug.tp.backend"  # gloo or nccl
    VOCAB_SIZE: Final = "glowplug.vocab_size"  # the logits width a grammar's token mask covers
    TP_JOIN_S: Final = "glowplug.tp.join_s"  # launch + join + first barrier, as distributed_init measured it
    TP_LAUNCH: Final = "glowplug.tp.launch"  # who started the ranks
    TP_THREADS: Final = "glowplug.tp.threads_per_rank"  # the CPU's cores split between the ranks on it
    # On a phase-table row every rank ran: the slowest rank, slowest - fastest, and each rank's seconds.
    TP_SLOWEST_RANK: Final = "glowplug.tp.slowest_rank"
    TP_SPREAD_S: Final = "glowplug.tp.spread_s"
    TP_RANK_SECONDS: Final = "glowplug.tp.rank_seconds"
    # On actual_total_time: the rank the others waited for at the first collective after their own work.
    TP_HELD_BACK_RANK: Final = "glowplug.tp.held_back_rank"
    TP_HELD_BACK_S: Final = "glowplug.tp.held_back_s"
    # The table row a stage's time is booked to when it differs from the stage's default row.
    ROW: Final = "glowplug.row"
    BYTES_READ: Final = "glowplug.bytes_read"
    READ_GBPS: Final = "glowplug.read_gbps"
    # At READY (the warmup row): the process's resident memory and where it goes: its high-water mark, resident file
    # pages (a model mapped where it lies) and anonymous ones; the model's weights (its distinct storages, mapped or
    # not), the KV pool, and the rest of the peak (torch, graphs, activations, allocator pages).
    MEMORY_PEAK_RSS: Final = "glowplug.memory.peak_rss_bytes"
    MEMORY_RSS_FILE: Final = "glowplug.memory.rss_file_bytes"
    MEMORY_RSS_ANON: Final = "glowplug.memory.rss_anon_bytes"
    MEMORY_WEIGHTS: Final = "glowplug.memory.weights_bytes"
    MEMORY_KV_POOL: Final = "glowplug.memory.kv_pool_bytes"
    MEMORY_KV_RESIDENT: Final = "glowplug.memory.kv_resident_bytes"  # the pool's pages written so far
    MEMORY_RUNTIME: Final = "glowplug.memory.runtime_bytes"
    # load_weights: the GGUF tensors used where they lie (mapped and computed on in place), and their bytes.
    GGUF_STORED_TENSORS: Final = "glowplug.gguf_stored_tensors"
    GGUF_STORED_BYTES: Final = "glowplug.gguf_stored_bytes"
    PARAM_COUNT: Final = "glowplug.param_count"
    DTYPE: Final = "glowplug.dtype"
    QUANTIZATION: Final = "glowplug.quantization"
    CACHE_HIT: Final = "glowplug.cache_hit"  # bool
    # On the start-up span: the cache hit/miss pattern probed before the first stage ("compile=hit, model=hit"),
    # and the first ETA (at the end of the imports): predicted seconds from process creation (or the call) to
    # READY, the stages' part of it, and its basis in words. The phase table copies them to actual_total_time.
    CACHE_PATTERN: Final = "glowplug.cache_pattern"
    ETA_FIRST_READY_S: Final = "glowplug.eta.first_ready_s"
    ETA_FIRST_STAGES_S: Final = "glowplug.eta.first_stages_s"
    ETA_FIRST_AT_S: Final = "glowplug.eta.first_at_s"
    ETA_BASIS: Final = "glowplug.eta.basis"
    # The first ETA per phase, as one JSON object: stage -> {seconds, kind ("recorded" or "model"), basis, inputs}.
    ETA_PHASES: Final = "glowplug.eta.phases"
    # The start-up model's inputs as one JSON object (engine/start_inputs.py: bytes to read, resident bytes, ...).
    ETA_INPUTS: Final = "glowplug.eta.inputs"
    CACHE_KEY: Final = "glowplug.cache_key"
    CACHE_FROM_BUNDLE: Final = "glowplug.cache_from_bundle"  # a hit on an entry a bundle brought: its file name
    CACHE_MISS_REASON: Final = "glowplug.cache_miss_reason"
    PEAK_MEMORY_BYTES: Final = "glowplug.peak_memory_bytes"
    KV_BLOCKS: Final = "glowplug.kv_blocks"
    KV_TOKEN_CAPACITY: Final = "glowplug.kv_token_capacity"
    MAX_CONCURRENCY: Final = "glowplug.max_concurrency"
    MAX_MODEL_LEN: Final = "glowplug.max_model_len"
    GRAPH_SIZES: Final = "glowplug.graph_sizes"  # list[int]
    # list[float], aligned with GRAPH_SIZES on CUDA (each size captured) and with GRAPH_WARMED_SIZES on the CPU
    GRAPH_SIZE_TIMES_S: Final = "glowplug.graph_size_times_s"
    GRAPH_WARMED_SIZES: Final = "glowplug.graph_warmed_sizes"  # CPU: the sizes the step ran at (the rest: guards)
    # CUDA: how much the shared graph pool's reserved memory grew while capturing each size, and in all
    GRAPH_SIZE_POOL_BYTES: Final = "glowplug.graph_size_pool_bytes"  # list[int], aligned with GRAPH_SIZES
    GRAPH_POOL_BYTES: Final = "glowplug.graph_pool_bytes"  # int
    # CUDA: each size's activations (the allocator's peak over one uncaptured call), aligned with GRAPH_SIZES; and
    # the graphs' pool after capture as torch.cuda.memory_snapshot holds it (engine/cuda_graphs.py GraphPoolUsage)
    GRAPH_SIZE_ACTIVATION_BYTES: Final = "glowplug.graph_size_activation_bytes"  # list[int]
    GRAPH_POOL_RESERVED_BYTES: Final = "glowplug.graph_pool.reserved_bytes"  # int
    GRAPH_POOL_ALLOCATED_BYTES: Final = "glowplug.graph_pool.allocated_bytes"  # int
    GRAPH_POOL_SEGMENTS: Final = "glowplug.graph_pool.segments"  # int
    GRAPH_POOL_LARGEST_BLOCKS: Final = "glowplug.graph_pool.largest_blocks"  # list[int], bytes, largest first
    BYTES_PER_TOKEN: Final = "glowplug.bytes_per_token"  # weight bytes one decode step streams at batch 1
    RECOMPILES: Final = "glowplug.recompiles"
    SKIPPED_REASON: Final = "glowplug.skipped_reason"
    # A note a stage that ran puts on its row (the phase table shows it beside the cache notes).
    ROW_NOTE: Final = "glowplug.row_note"
    ISA_LEVEL: Final = "glowplug.isa_level"  # the native kernels' ISA level (base.machine.ISA_LEVELS)
    ISA_REASON: Final = "glowplug.isa_reason"  # why that level: the CPU's best, a cap, or the best variant stored
    # Layers a native op would serve that keep the stock path, with why and how many ("15 layers: ...").
    NATIVE_FALLBACK: Final = "glowplug.native_fallback"
    # On CUDA: which decode attention runs, "triton" (the paged kernel) or "torch ops: <why Triton cannot run>".
    DECODE_ATTENTION: Final = "glowplug.decode_attention"
    # On CUDA: the quantized layers whose compiled decode runs the Triton custom ops (kernels/triton/graph_ops.py).
    TRITON_DECODE_LAYERS: Final = "glowplug.triton_decode_layers"
    ERROR: Final = "glowplug.error"
    PID: Final = "glowplug.pid"
    CLOCK_RESOLUTION_S: Final = "glowplug.clock_resolution_s"
    # Attributes of the cache events below.
    CACHE_NAME: Final = "glowplug.cache"
    CACHE_PATH: Final = "glowplug.cache_path"
    CACHE_REASON: Final = "glowplug.cache_reason"
    CACHE_ACTION: Final = "glowplug.cache_action"
    # The stages a stage waited for (its declared dependencies in the pipeline): the critical path comes from these.
    WAITS_FOR: Final = "glowplug.waits_for"  # list[str]
    # On the start-up span: whether CPU-bound stages may overlap on this machine, and why; the cores it decided on.
    STAGE_CONCURRENCY: Final = "glowplug.stage_concurrency"
    USABLE_CORES: Final = "glowplug.usable_cores"
    # On a stage that waits for a CPU-bound stage only because the cores are few (not for a slot it needs): which.
    SCHEDULING: Final = "glowplug.scheduling"
    # OpenTelemetry's semantic-convention keys for the thread a span ran on (one trace-viewer lane per thread).
    THREAD_NAME: Final = "thread.name"
    THREAD_ID: Final = "thread.id"
    # The imports row: the costliest top-level imports (`--import-times`), "module seconds" strings, costliest first.
    IMPORT_TOP: Final = "glowplug.import_top"
    IMPORT_METHOD: Final = "glowplug.import_method"
    # The floor: weights bytes / read bandwidth + `import torch`.
    FLOOR_WEIGHTS_BYTES: Final = "glowplug.floor.weights_bytes"
    FLOOR_READ_GBPS: Final = "glowplug.floor.read_gbps"
    FLOOR_IMPORT_TORCH_S: Final = "glowplug.floor.import_torch_s"
    # What the floor's bytes are: the stages' own bytes read or mapped (load_weights' file, a cache entry's).
    FLOOR_BYTES_SOURCE: Final = "glowplug.floor.bytes_source"
    # Each stage's own keys, by stage.
    # model_prepare: the model's folder and its architecture.
    MODEL_DIR: Final = "glowplug.model_dir"
    MODEL_TYPE: Final = "glowplug.model_type"
    # tokenizer_init: whether the model has a chat template.
    CHAT_TEMPLATE: Final = "glowplug.chat_template"
    # load_weights: the checkpoint's files and tensors, and the GGUF layers repacked at load.
    FILES: Final = "glowplug.files"
    TENSORS: Final = "glowplug.tensors"
    GGUF_REPACKED_LAYERS: Final = "glowplug.gguf_repacked_layers"
    # model_init: the kernel each quantized layer runs, and the weights' bytes.
    KERNEL_DISPATCH: Final = "glowplug.kernel_dispatch"
    WEIGHTS_BYTES: Final = "glowplug.weights_bytes"
    # quantize_weights: what was quantized, how, and from what; --quantization auto's choice per layer kind.
    QUANTIZED_BYTES: Final = "glowplug.quantized_bytes"
    BITS_PER_WEIGHT: Final = "glowplug.bits_per_weight"
    GROUP_SIZE: Final = "glowplug.group_size"
    GROUP_SIZE_REASON: Final = "glowplug.group_size_reason"
    QUANTIZE_LM_HEAD: Final = "glowplug.quantize_lm_head"
    QUANTIZED_FROM: Final = "glowplug.quantized_from"
    LAYER_FORMATS: Final = "glowplug.layer_formats"
    AUTO_INT4_LAYERS: Final = "glowplug.auto.int4_layers"
    AUTO_INT8_LAYERS: Final = "glowplug.auto.int8_layers"
    AUTO_DENSE_LAYERS: Final = "glowplug.auto.dense_layers"
    AUTO_REPACKED_LAYERS: Final = "glowplug.auto.repacked_layers"
    AUTO_REQUANTIZED_LAYERS: Final = "glowplug.auto.requantized_layers"
    # native_kernels: the build, the library loaded, a background build, and the layers switched per kind.
    NATIVE_BUILD: Final = "glowplug.native_build"
    NATIVE_LIBRARY: Final = "glowplug.native_library"
    NATIVE_BACKGROUND_BUILD: Final = "glowplug.native_background_build"
    NATIVE_DENSE_LAYERS: Final = "glowplug.native_dense_layers"
    NATIVE_QUANTIZED_LAYERS: Final = "glowplug.native_quantized_layers"
    NATIVE_ATTENTION_LAYERS: Final = "glowplug.native_attention_layers"
    # dynamo_transform: the traced graph's nodes.
    GRAPH_NODES: Final = "glowplug.graph_nodes"
    # graph_compile: the cache folder, the kernels built, and the replay plan: written, loaded or why not, its
    # fingerprint check (matched / not compared (why) / how the logits differ) and that check's cost, and the stored
    # Inductor folder read through links.
    COMPILE_CACHE_DIR: Final = "glowplug.compile_cache_dir"
    KERNELS_BUILT: Final = "glowplug.kernels_built"
    COMPILE_REPLAY: Final = "glowplug.compile_replay"
    REPLAY_FINGERPRINT: Final = "glowplug.replay_fingerprint"
    REPLAY_FINGERPRINT_S: Final = "glowplug.replay_fingerprint_s"
    COMPILE_CACHE_READ_ONLY_SOURCE: Final = "glowplug.compile_cache_read_only_source"
    # kv_cache_profiling: which peak sized the cache ("analytic" or "measured"), how memory was read, the budget.
    KV_PROFILE: Final = "glowplug.kv_profile"
    MEMORY_METHOD: Final = "glowplug.memory_method"
    KV_BUDGET_BYTES: Final = "glowplug.kv_budget_bytes"
    KV_BUDGET_SOURCE: Final = "glowplug.kv_budget_source"
    # kv_cache_init: the pool's bytes and dtype.
    KV_CACHE_BYTES: Final = "glowplug.kv_cache_bytes"
    KV_CACHE_DTYPE: Final = "glowplug.kv_cache_dtype"
    # warmup: the tokens and requests it ran.
    WARMUP_TOKENS: Final = "glowplug.warmup_tokens"
    WARMUP_REQUESTS: Final = "glowplug.warmup_requests"
    # bundle_install: the bundle, what became of its entries, the model it brought and how the machine differs.
    BUNDLE_PATH: Final = "glowplug.bundle.path"
    BUNDLE_INSTALLED: Final = "glowplug.bundle.installed"
    BUNDLE_PRESENT: Final = "glowplug.bundle.present"
    BUNDLE_DAMAGED: Final = "glowplug.bundle.damaged"
    BUNDLE_SKIPPED: Final = "glowplug.bundle.skipped"
    BUNDLE_MODEL: Final = "glowplug.bundle.model"
    BUNDLE_DIFFERENCES: Final = "glowplug.bundle.differences"
    # A delay a test planted in a stage (GLOWPLUG_TEST_STAGE_DELAY), seconds.
    TEST_DELAY_S: Final = "glowplug.test_delay_s"


class Event:
    """Span event names. A stage's span carries them; the phase table shows them in the stage row's note."""

    # An artifact-store entry failed verification or could not be loaded; it was moved aside and rebuilt.
    CACHE_CORRUPT: Final = "cache_corrupt"
    # GLOWPLUG_CACHE_DIR cannot be used (a file, read-only, disk full); the cache ran without it.
    CACHE_UNUSABLE: Final = "cache_unusable"


# Events the phase table puts into the note of their stage's row.
NOTED_EVENTS: Final[tuple[str, ...]] = (Event.CACHE_CORRUPT, Event.CACHE_UNUSABLE)


class ReqAttr:
    """Attribute keys of `glowplug.request` spans."""

    REQUEST_ID: Final = "glowplug.request_id"
    PROMPT_TOKENS: Final = "glowplug.prompt_tokens"
    COMPLETION_TOKENS: Final = "glowplug.completion_tokens"
    TTFT_S: Final = "glowplug.ttft_s"
    QUEUE_TIME_S: Final = "glowplug.queue_time_s"
    FINISH_REASON: Final = "glowplug.finish_reason"


class DrainAttr:
    """Attribute keys of the `glowplug.drain` span."""

    TIMEOUT_S: Final = "glowplug.drain.timeout_s"
    IN_FLIGHT: Final = "glowplug.drain.in_flight"  # HTTP requests generating when the drain began
    FINISHED: Final = "glowplug.drain.finished"  # of those, finished within the timeout
    ABORTED: Final = "glowplug.drain.aborted"  # of those, aborted at the timeout
    CLEAN: Final = "glowplug.drain.clean"  # bool: nothing had to be aborted


# ---------------------------------------------------------------- metrics
class Metric:
    """Prometheus metric names of `/metrics` (vLLM's where it has one, with the `glowplug_` prefix). A counter is
    exposed with `_total` appended; the engine core's process metrics are ENGINE_CORE_PROCESS + `_<metric>`."""

    TTFT: Final = "glowplug_time_to_first_token_seconds"
    TPOT: Final = "glowplug_time_per_output_token_seconds"
    E2E_LATENCY: Final = "glowplug_e2e_request_latency_seconds"
    QUEUE_TIME: Final = "glowplug_request_queue_time_seconds"
    ENGINE_STEP: Final = "glowplug_engine_step_duration_seconds"
    REQUESTS_RUNNING: Final = "glowplug_num_requests_running"
    REQUESTS_WAITING: Final = "glowplug_num_requests_waiting"
    PROMPT_COST: Final = "glowplug_prompt_cost_seconds"
    PROMPT_TOKENS_WAITING: Final = "glowplug_num_prompt_tokens_waiting"
    KV_USAGE: Final = "glowplug_kv_cache_usage_ratio"
    KV_USED_BLOCKS: Final = "glowplug_kv_cache_used_blocks"
    KV_TOTAL_BLOCKS: Final = "glowplug_kv_cache_total_blocks"
    PROMPT_TOKENS: Final = "glowplug_prompt_tokens"
    GENERATION_TOKENS: Final = "glowplug_generation_tokens"
    COMPLETED_GENERATION_TOKENS: Final = "glowplug_completed_generation_tokens"
    ABORTED_GENERATION_TOKENS: Final = "glowplug_aborted_generation_tokens"
    ENGINE_CORE: Final = "glowplug_engine_core"  # the namespace of the core process's process_* metrics
    ENGINE_CORE_RESTARTS: Final = "glowplug_engine_core_restarts"
    REQUEST_FINISHED: Final = "glowplug_request_finished"
    REQUEST_REJECTED: Final = "glowplug_request_rejected"
    CLIENT_DISCONNECTS: Final = "glowplug_client_disconnects"
    CONNECTIONS_TIMED_OUT: Final = "glowplug_connections_timed_out"
    STARTUP_PHASE_DURATION: Final = "glowplug_startup_phase_duration_seconds"
    STARTUP_PREDICTED: Final = STARTUP_PREDICTED_METRIC
    ENGINE_STATE: Final = "glowplug_engine_state"


# ---------------------------------------------------------------- phase-table rows
class Row:
    """Row names of the phase table (vLLM's vocabulary where it has one)."""

    PROCESS_START: Final = PROCESS_START
    IMPORTS: Final = IMPORTS
    CORE_PROCESS_START: Final = CORE_PROCESS_START
    CORE_IMPORTS: Final = CORE_IMPORTS
    MODEL_PREPARE: Final = "model_prepare"
    TOKENIZER_INIT: Final = "tokenizer_init"
    GRAMMAR_INIT: Final = "grammar_init"
    LOAD_WEIGHTS: Final = "load_weights"
    MODEL_INIT: Final = "model_init"
    QUANTIZE_WEIGHTS: Final = "quantize_weights"
    NATIVE_KERNELS: Final = "native_kernels"
    MODEL_LOADING: Final = "model_loading"
    DYNAMO_TRANSFORM_TIME: Final = "dynamo_transform_time"
    GRAPH_COMPILE_GENERAL_SHAPE: Final = "graph_compile_general_shape"
    GRAPH_COMPILE_CACHED: Final = "graph_compile_cached"
    TORCH_COMPILE: Final = "torch.compile"
    KV_CACHE_PROFILING: Final = "kv_cache_profiling"
    KV_CACHE_INIT: Final = "kv_cache_init"
    GRAPH_CAPTURING: Final = "graph_capturing"
    WARMUP: Final = "warmup"
    INIT_ENGINE: Final = "init_engine"
    UNATTRIBUTED: Final = "unattributed"
    # Derived rows (not leaves): how the stage times relate to the wall time when stages ran at once.
    OVERLAP: Final = "overlap"  # sum of the stages' own times - the wall time they covered together
    CRITICAL_PATH: Final = "critical_path"  # the longest chain of stages that waited on each other
    TOTAL_TIME: Final = "total_time"
    ACTUAL_TOTAL_TIME: Final = "actual_total_time"
    # The floor for this config (after the totals): weights bytes / read bandwidth + import torch, and actual/floor.
    FLOOR: Final = "floor"
    ACTUAL_OVER_FLOOR: Final = "actual/floor"


# Stages whose row name differs from the stage name. Any stage not listed books to a row named like the stage,
# so a new stage shows up in the table without touching this module.
STAGE_ROWS: Final[dict[str, str]] = {
    DYNAMO_TRANSFORM: Row.DYNAMO_TRANSFORM_TIME,
    GRAPH_COMPILE: Row.GRAPH_COMPILE_GENERAL_SHAPE,
    GRAPH_CAPTURE: Row.GRAPH_CAPTURING,
}

# Stages that book to exactly one of several rows (the report's `row` picks it); the others get a reason.
STAGE_ALTERNATIVE_ROWS: Final[dict[str, tuple[str, ...]]] = {
    GRAPH_COMPILE: (Row.GRAPH_COMPILE_GENERAL_SHAPE, Row.GRAPH_COMPILE_CACHED),
}

# Leaves in display order (the default pipeline's list order). Leaves plus `unattributed` minus `overlap` add up to
# actual_total_time exactly (overlap is 0 when no two stages ran at once).
LEAF_ROWS: Final[tuple[str, ...]] = (
    Row.PROCESS_START,
    Row.IMPORTS,
    Row.MODEL_PREPARE,
    Row.TOKENIZER_INIT,
    Row.GRAMMAR_INIT,
    Row.LOAD_WEIGHTS,
    Row.MODEL_INIT,
    Row.QUANTIZE_WEIGHTS,
    Row.NATIVE_KERNELS,
    Row.DYNAMO_TRANSFORM_TIME,
    Row.GRAPH_COMPILE_GENERAL_SHAPE,
    Row.GRAPH_COMPILE_CACHED,
    Row.KV_CACHE_PROFILING,
    Row.KV_CACHE_INIT,
    Row.GRAPH_CAPTURING,
    Row.WARMUP,
)

# Leaves that only a start with an engine-core process has (`glowplug serve`): shown after `imports` when their spans
# are there, left out of the table otherwise (an in-process start has no such phase, rather than one not measured).
CORE_ROWS: Final[tuple[str, ...]] = (Row.CORE_PROCESS_START, Row.CORE_IMPORTS)

# Aggregates: each is the sum of its leaves. Unlike vLLM's table, torch.compile includes the graph compile
# (vLLM prints torch.compile == dynamo_transform_time) and the build of the native kernels the graph calls.
# init_engine is the engine's own set-up after the model exists and is compiled: profiling, KV allocation, capture and
# warm-up; compile is not in it because here it is a stage of its own (in vLLM it runs inside the profiling pass, so its
# init_engine contains it).
# model_loading includes model_prepare: finding (cold: converting) the checkpoint is the first step of loading it.
AGGREGATE_ROWS: Final[dict[str, tuple[str, ...]]] = {
    Row.MODEL_LOADING: (Row.MODEL_PREPARE, Row.LOAD_WEIGHTS, Row.MODEL_INIT, Row.QUANTIZE_WEIGHTS),
    Row.TORCH_COMPILE: (
        Row.NATIVE_KERNELS,
        Row.DYNAMO_TRANSFORM_TIME,
        Row.GRAPH_COMPILE_GENERAL_SHAPE,
        Row.GRAPH_COMPILE_CACHED,
    ),
    Row.INIT_ENGINE: (Row.KV_CACHE_PROFILING, Row.KV_CACHE_INIT, Row.GRAPH_CAPTURING, Row.WARMUP),
}
