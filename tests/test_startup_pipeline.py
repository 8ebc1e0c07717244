"""The staged start-up: span tree, phase table arithmetic, caches, KV sizing errors, failures, OTLP export."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.trace import StatusCode

from glowplug.engine.config import EngineConfig
from glowplug.engine.startup import StartupFailed, build_engine, default_stages
from glowplug.profiling.names import STARTUP_SPAN, Attr, stage_from_span_name
from glowplug.profiling.tracing import setup_tracing

STAGE_ORDER = [stage.name for stage in default_stages()]


def _start(model: Path, cache: Path, **fields: object):
    tracing = setup_tracing()
    result = build_engine(EngineConfig.from_flat(model=str(model), **fields), tracing=tracing, cache_dir=cache)
    return result, tracing


def test_span_tree_order_parentage_and_attributes(tiny_dir, tmp_path: Path) -> None:
    result, tracing = _start(tiny_dir("llama"), tmp_path, compile="off")
    spans = tracing.finished_spans()
    root = next(s for s in spans if s.name == STARTUP_SPAN)
    stages = sorted((s for s in spans if stage_from_span_name(s.name)), key=lambda s: s.start_time)
    assert sorted(stage_from_span_name(s.name) for s in stages) == sorted(STAGE_ORDER)
    # Each stage starts after every stage it declared it waits for has ended (the others may overlap it).
    by_stage = {stage_from_span_name(s.name): s for s in stages}
    for span in stages:
        for dep in span.attributes[Attr.WAITS_FOR]:
            assert by_stage[dep].end_time <= span.start_time
    assert list(by_stage["tokenizer_init"].attributes[Attr.WAITS_FOR]) == ["model_prepare"]
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in stages)
    attrs = {stage_from_span_name(s.name): dict(s.attributes) for s in stages}
    assert attrs["load_weights"][Attr.BYTES_READ] > 0 and attrs["load_weights"][Attr.READ_GBPS] > 0
    assert attrs["model_init"][Attr.PARAM_COUNT] == result.arch.num_params
    assert attrs["model_init"][Attr.DTYPE] == "float32"
    kv = attrs["kv_cache_profiling"]
    assert kv[Attr.KV_BLOCKS] == result.kv_plan.num_blocks
    assert kv[Attr.KV_TOKEN_CAPACITY] == result.kv_plan.num_blocks * 16
    assert kv[Attr.MAX_CONCURRENCY] == pytest.approx(result.kv_plan.max_concurrency, rel=1e-2)
    assert kv[Attr.PEAK_MEMORY_BYTES] > 0 and kv["glowplug.kv_profile"] == "analytic"  # the CPU's default
    assert attrs["graph_capture"][Attr.SKIPPED_REASON] == "--compile off"
    table = result.phase_table
    assert table.seconds("graph_capturing") is None and "--compile off" in table["graph_capturing"].reason
    # The engine works after READY and nothing is left allocated by the warm-up.
    assert result.engine.stats().kv_used_blocks == 0


def test_grammar_view_is_built_at_start_and_skipped_when_off(tiny_dir, tmp_path: Path) -> None:
    """grammar_init makes the grammar backend as its own row beside the weights (the row says why it is not
    cached), and its tokenizer view is built from READY on, in the background; a constrained request then decodes
    valid JSON. Off, the row is skipped with the
    flag as its reason and a constrained request is refused naming the flag."""
    from glowplug.engine.sampling_params import SamplingParams
    from glowplug.engine.structured import json_schema_grammar

    on, tracing = _start(tiny_dir("llama"), tmp_path, compile="off")
    span = next(s for s in tracing.finished_spans() if s.name == "glowplug.startup.grammar_init")
    assert set(span.attributes[Attr.WAITS_FOR]) <= {"model_prepare", "tokenizer_init"}
    row = on.phase_table["grammar_init"]
    assert row.seconds is not None and row.seconds > 0 and any("cannot be serialized" in n for n in row.notes)
    backend = on.engine.core.grammar
    assert backend is not None
    backend.prepare()  # waits for the build the READY hook started, if it has not finished
    assert backend.init_s is not None
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=12, temperature=0.0, grammar=json_schema_grammar(schema))
    on.engine.add_request(prompt_token_ids=[1, 2, 3], params=params, request_id="r")
    done = []
    while on.engine.has_unfinished():
        done += [o for o in on.engine.step() if o.finished]
    assert json.loads(done[0].outputs[0].text) in ({"ok": True}, {"ok": False})
    off, _ = _start(tiny_dir("llama"), tmp_path, compile="off", structured_outputs=False)
    assert (
        off.phase_table["grammar_init"].reason == "skipped: --no-structured-outputs (constrained requests are refused)"
    )
    assert off.engine.core.grammar is None
    with pytest.raises(ValueError, match="--no-structured-outputs"):
        off.engine.core.add("r", [1, 2, 3], params)


def test_second_start_reads_profile_cache(tiny_dir, tmp_path: Path) -> None:
    _start(tiny_dir("llama"), tmp_path, compile="off", kv_profile="measure")
    second, _ = _start(tiny_dir("llama"), tmp_path, compile="off", kv_profile="measure")
    row = second.phase_table["kv_cache_profiling"]
    # Reading the profile is the stage's own work: booked to its row, with the note.
    assert row.seconds is not None and row.seconds > 0 and row.reason is None and row.notes == ("cache hit",)


def test_kv_profile_ignores_max_model_len_and_names_what_changed(tiny_dir, tmp_path: Path) -> None:
    """The activation peak does not depend on max_model_len (the profiling forward has no KV cache), so changing
    it re-plans the cache from the stored profile; changing the batch the forward runs re-profiles, and says so."""
    _start(tiny_dir("llama"), tmp_path, compile="off", max_model_len=128, kv_profile="measure")
    other_len, _ = _start(tiny_dir("llama"), tmp_path, compile="off", max_model_len=256, kv_profile="measure")
    assert other_len.phase_table["kv_cache_profiling"].notes == ("cache hit",)
    assert other_len.kv_plan.max_model_len == 256
    other_batch, tracing = _start(
        tiny_dir("llama"), tmp_path, compile="off", max_num_batched_tokens=1024, kv_profile="measure"
    )
    span = next(s for s in tracing.finished_spans() if s.name == "glowplug.startup.kv_cache_profiling")
    assert span.attributes[Attr.CACHE_MISS_REASON] == "changed: max_num_batched_tokens 2048 -> 1024"
    assert other_batch.phase_table["kv_cache_profiling"].notes == (
        "cache miss: changed: max_num_batched_tokens 2048 -> 1024",
    )


def test_kv_too_small_fails_before_allocating(tiny_dir, tmp_path: Path) -> None:
    tracing = setup_tracing()
    cfg = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off", kv_cache_memory=20_000, max_model_len=256)
    with pytest.raises(StartupFailed) as e:
        build_engine(cfg, tracing=tracing, cache_dir=tmp_path)
    msg = str(e.value)
    # An explicit budget is checked against the model before any heavy work (config_check.check_prepared).
    assert e.value.stage == "model_prepare"
    # 2 layers x 2 kv heads x 16 dims x 2 (k, v) x 4 bytes = 512 bytes per token; 20000 B hold 2 blocks of 16.
    assert "cannot hold one sequence of 256 tokens: that needs 128 KiB (512 bytes/token)" in msg
    assert "the cache has 19.5 KiB, from --kv-cache-memory; raise --kv-cache-memory to 1MiB" in msg
    names = [stage_from_span_name(s.name) for s in tracing.finished_spans()]
    assert "load_weights" not in names and "kv_cache_init" not in names
    failed = next(s for s in tracing.finished_spans() if s.name.endswith("model_prepare"))
    assert failed.status.status_code is StatusCode.ERROR
    assert any(ev.name == "exception" for ev in failed.events)


def test_kv_budget_from_memory_utilization_fails_in_profiling_with_a_fix(tiny_dir, tmp_path: Path) -> None:
    """A budget from --memory-utilization needs the profiled activation peak, so it is checked where it is
    measured, with the same wording and a fix in terms of the flags that set it."""
    cfg = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off", memory_utilization=1e-9)
    with pytest.raises(StartupFailed) as e:
        build_engine(cfg, cache_dir=tmp_path)
    assert e.value.stage == "kv_cache_profiling"
    assert "cannot hold one sequence of 256 tokens" in str(e.value)
    assert "set --kv-cache-memory 1MiB (or raise --memory-utilization, now 1e-09, or free memory)" in str(e.value)


def test_a_budget_past_32_bit_indexing_is_capped_and_says_so(tiny_dir) -> None:
    """A budget whose blocks would put one layer's cache past 2**31 elements (a tiny model on a big GPU) keeps the
    blocks that fit (the compiled step indexes the cache in 32 bits) and names the cap in the budget's source."""
    from glowplug.engine.kv_sizing import MAX_LAYER_ELEMENTS, plan_kv_cache
    from glowplug.engine.models.arch import load_arch

    arch = load_arch(tiny_dir("llama"))
    cfg = EngineConfig.from_flat(model=str(tiny_dir("llama")), kv_cache_memory="1TiB", block_size=16)
    plan = plan_kv_cache(cfg, arch, model_dtype="float32", device="cpu", weights_bytes=0)
    per_block_elements = 16 * arch.num_key_value_heads * arch.head_dim
    allocated = plan.num_blocks + 1  # the scratch block comes on top (kv_cache_init)
    assert allocated * per_block_elements <= MAX_LAYER_ELEMENTS < (allocated + 1) * per_block_elements
    assert "under 2**31 elements" in plan.budget_source and plan.budget_source.startswith("--kv-cache-memory")


def test_max_model_len_auto_picks_largest_that_fits(tiny_dir, tmp_path: Path) -> None:
    result, _ = _start(
        tiny_dir("llama"), tmp_path, compile="off", kv_cache_memory=512 * 16 * 7 + 100, max_model_len="auto"
    )
    assert result.kv_plan.num_blocks == 7 and result.engine.max_model_len == 7 * 16
    roomy, _ = _start(tiny_dir("llama"), tmp_path, compile="off", kv_cache_memory=10_000_000, max_model_len="auto")
    assert roomy.engine.max_model_len == 256  # the model's own limit


def _glowplug(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "glowplug.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_cli_actual_total_time_against_a_clock_outside_the_process(tiny_dir, tmp_path: Path) -> None:
    """The oracle is outside the process: this test starts `glowplug startup` and times it until the child says
    READY. The child's actual_total_time (process creation -> READY, from its own spans) must fit inside that, and
    not be a small part of it (the child cannot have missed most of its own start)."""
    report, trace, chrome = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "c.json"
    cmd = [
        sys.executable,
        "-m",
        "glowplug.cli",
        "startup",
        str(tiny_dir("qwen2")),
        "--compile",
        "off",
        "--report-out",
        str(report),
        "--trace-out",
        str(trace),
        "--chrome-trace",
        str(chrome),
    ]
    env = {**os.environ, "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert proc.stderr is not None
    ready_outside = None
    for line in proc.stderr:
        if line.startswith("glowplug: READY"):
            ready_outside = time.perf_counter() - t0
    assert proc.wait(timeout=300) == 0
    exit_outside = time.perf_counter() - t0
    assert ready_outside is not None, "no READY line"
    data = json.loads(report.read_text())
    actual, phases = data["actual_total_time"], data["phases"]
    # READY is printed after the child took its READY time; the child was created after t0.
    assert actual <= ready_outside <= exit_outside
    # The READY line follows the floor probe (~0.1-0.3 s after READY); pipes and the exec add a little more.
    assert actual >= 0.7 * ready_outside - 0.5
    assert phases["process_start"] > 0 and phases["imports"] > 0
    assert phases["quantize_weights"] is None and phases["torch.compile"] is None
    assert phases["floor"] > 0 and data["attributes"]["floor"]["actual/floor"] > 0
    events = json.loads(chrome.read_text())["traceEvents"]
    assert {e["name"] for e in events if e.get("ph") == "X"} >= {STARTUP_SPAN, "glowplug.startup.warmup"}
    assert json.loads(trace.read_text().splitlines()[0])["resourceSpans"]


def test_cli_import_times_names_the_costliest_packages(tiny_dir, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    proc = _glowplug(
        "startup",
        str(tiny_dir("llama")),
        "--compile",
        "off",
        "--import-times",
        "--report-out",
        str(report),
        env={"GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    top = data["attributes"]["imports"][Attr.IMPORT_TOP]
    assert len(top) == 5 and top[0].split()[0] == "torch"  # torch is the costliest import of the start
    assert any("-X importtime" in n for n in data["notes"]["imports"])


def test_cli_failing_stage_exits_nonzero_with_one_line_cause(tiny_dir, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir("llama"), bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    proc = _glowplug(
        "startup",
        str(bad),
        "--compile",
        "off",
        "--trace-out",
        str(tmp_path / "t.json"),
        env={"GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("glowplug: state FAILED")]
    assert len(lines) == 1 and "load_weights" in lines[0] and "truncated or corrupt" in lines[0]
    from glowplug.profiling.export import read_otlp_json

    spans = [
        s
        for req in read_otlp_json(tmp_path / "t.json")
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    failed = next(s for s in spans if s.name == "glowplug.startup.load_weights")
    assert failed.status.code == 2  # STATUS_CODE_ERROR


def test_startup_spans_reach_a_real_otlp_receiver(tiny_dir, tmp_path: Path) -> None:
    from otlp_receiver import OtlpHttpReceiver

    with OtlpHttpReceiver() as rx:
        proc = _glowplug(
            "startup",
            str(tiny_dir("llama")),
            "--compile",
            "off",
            env={"GLOWPLUG_CACHE_DIR": str(tmp_path / "cache"), "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint},
        )
        assert proc.returncode == 0, proc.stderr
        spans = rx.wait_for_spans(len(STAGE_ORDER) + 3)
    by_name = {s.name: s for s in spans}
    root = by_name[STARTUP_SPAN]
    for stage in STAGE_ORDER + ["process_start", "imports"]:
        span = by_name[f"glowplug.startup.{stage}"]
        assert span.parent_span_id == root.span_id and span.trace_id == root.trace_id


def test_kv_profile_peak_is_at_least_the_largest_intermediate_and_repeatable(tiny_dir, tmp_path: Path) -> None:
    """Oracle: the forward's largest intermediates must be live at once, whatever the heap did before. The fused
    gate/up projection's output is tokens x 2*intermediate_size, the logits rows x vocab, in the run dtype (fp32)."""
    first, tracing = _start(tiny_dir("llama"), tmp_path / "a", compile="off", kv_profile="measure")
    arch = first.arch
    span = next(s for s in tracing.finished_spans() if s.name == "glowplug.startup.kv_cache_profiling")
    peak = span.attributes[Attr.PEAK_MEMORY_BYTES]
    tokens = min(2048, arch.max_position_embeddings)
    rows = min(EngineConfig().scheduler.max_num_seqs, tokens)
    bound = max(tokens * 2 * arch.intermediate_size * 4, rows * arch.vocab_size * 4, tokens * arch.hidden_size * 4)
    assert span.attributes["glowplug.memory_method"] == "live_tensor_bytes"
    assert peak >= bound
    assert peak <= 50 * bound  # and not the whole process's memory
    # An RSS reading depends on the heap the process touched before; this does not: a second cold profile in the
    # same (now well-used) process gives the same number.
    second, tracing2 = _start(tiny_dir("llama"), tmp_path / "b", compile="off", kv_profile="measure")
    span2 = next(s for s in tracing2.finished_spans() if s.name == "glowplug.startup.kv_cache_profiling")
    assert span2.attributes[Attr.CACHE_HIT] is False and span2.attributes[Attr.PEAK_MEMORY_BYTES] == peak


class _Collections:
    """The collector's own report of every collection (gc.callbacks), by generation."""

    def __init__(self) -> None:
        self.generations: list[int] = []

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "stop":
            self.generations.append(info["generation"])

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _heap_churn() -> None:
    """Grow the heap as imports do (objects that survive young collections), by more than a quarter of what the
    test process holds: full collections follow under the default thresholds."""
    kept = [[] for _ in range(len(gc.get_objects()))]
    del kept


def test_a_start_defers_full_collections_and_restores_the_thresholds(tiny_dir, tmp_path: Path) -> None:
    from glowplug.engine.stages.protocol import StageReport

    before = gc.get_threshold()
    with _Collections() as baseline:
        _heap_churn()
    assert 2 in baseline.generations, "the churn should trigger a full collection under the default thresholds"

    class Churn:  # a stage that allocates like Dynamo's and Inductor's imports do
        name = "churn"
        needs: tuple[str, ...] = ()
        provides: tuple[str, ...] = ()

        def run(self, ctx: object) -> StageReport:
            _heap_churn()
            return StageReport()

    class AtReady:  # the last stage: what the collector did up to READY
        name = "at_ready"
        needs: tuple[str, ...] = ("engine",)
        provides: tuple[str, ...] = ()
        seen: list[int] = []

        def run(self, ctx: object) -> StageReport:
            AtReady.seen = list(during.generations)
            return StageReport()

    from glowplug.engine.startup import default_stages

    stages = [Churn(), *default_stages(), AtReady()]
    cfg = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off")
    with _Collections() as during:
        build_engine(cfg, tracing=setup_tracing(), cache_dir=tmp_path, stages=stages)
    assert 0 in AtReady.seen and 2 not in AtReady.seen  # young collections ran up to READY, no full one
    assert gc.get_threshold() == before
    # A failed start restores them too.
    bad = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off", kv_cache_memory=20_000, max_model_len=256)
    with pytest.raises(StartupFailed):
        build_engine(bad, tracing=setup_tracing(), cache_dir=tmp_path)
    assert gc.get_threshold() == before


def test_a_process_start_freezes_what_it_built_at_ready(tiny_dir, tmp_path: Path) -> None:
    """The CLI defers from its entry (before the imports) and build_engine ends that at READY, freezing the start's
    objects out of later collections; nested deferrals unwind in order."""
    from glowplug.profiling.process import mark_main_entry

    before = gc.get_threshold()
    marks = mark_main_entry()
    marks.defer_full_gc()
    assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > before[2]
    assert gc.get_freeze_count() == 0
    try:
        cfg = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off")
        build_engine(cfg, tracing=setup_tracing(), cache_dir=tmp_path, marks=marks)
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()  # the test process builds more engines: hand their objects back to the collector
    marks.gc_deferral.resume(freeze=True)  # idempotent: nothing more frozen, thresholds unchanged
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
