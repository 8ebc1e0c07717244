"""Stage contracts: a stage reads only the context slots it declares in `needs` and writes only those in `provides`
(engine/stages/view.py ContextView), declarations name real slots, every declared provide is written, and the
start-up context is gone once READY."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from glowplug.engine import start_run, startup
from glowplug.engine.config import EngineConfig
from glowplug.engine.stages.bundle_install import BundleInstall
from glowplug.engine.stages.context import EngineContext
from glowplug.engine.stages.protocol import (
    StageContractError,
    StageReport,
    StageResult,
    StartupContext,
    StartupFailed,
    check_pipeline,
    declarations,
)
from glowplug.engine.stages.runner import run_stages
from glowplug.engine.startup import StartupResult, build_engine, default_stages
from glowplug.profiling.tracing import Tracing, setup_tracing

# Declared provides that a start writes only on some paths; each is named at its declaration.
# Provides written on one path only: traced is replaced only when the stored entry will not load; compile_fallback
# is written only when --compile auto drops the compiled step for eager (tests/test_torch_compat.py takes that path).
PATH_DEPENDENT = {"graph_compile": {"traced", "compile_fallback"}, "dynamo_transform": {"compile_fallback"}}


class Fake:
    """A stage whose body is given: `Fake("model_prepare", lambda ctx: ..., provides=(...))`."""

    def __init__(self, name: str, body: Any, *, needs: tuple[str, ...] = (), provides: tuple[str, ...] = ()) -> None:
        self.name = name
        self.needs = needs
        self.provides = provides
        self.body = body

    def run(self, ctx: Any) -> StageReport:
        self.body(ctx)
        return StageReport()


def _run(stages: list[Any], ctx: StartupContext | None = None, tracing: Tracing | None = None) -> list[StageResult]:
    tracing = tracing or setup_tracing()
    return run_stages(stages, ctx or EngineContext(), tracer=tracing.tracer())


def _contract_error(stages: list[Any], ctx: StartupContext | None = None) -> str:
    with pytest.raises(StartupFailed) as info:
        _run(stages, ctx)
    assert isinstance(info.value.cause, StageContractError), info.value.cause
    return str(info.value.cause)


def _started(config: EngineConfig, cache: Path | None, monkeypatch: pytest.MonkeyPatch) -> StartupResult:
    """build_engine, checking afterwards that the start-up contexts it made were released."""
    made: list[weakref.ref[EngineContext]] = []

    class Tracked(EngineContext):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(startup, "EngineContext", Tracked)
    monkeypatch.setattr(start_run, "EngineContext", Tracked)
    result = build_engine(config, tracing=setup_tracing(), cache_dir=cache)
    gc.collect()
    # Two: the pipeline's, and the scratch one the ETA's cache probe fills before the first stage (plan_start).
    assert len(made) == 2 and all(ref() is None for ref in made), "a start-up context outlived READY"
    assert not hasattr(result, "context")
    return result


def _assert_contracts_kept(result: StartupResult) -> None:
    """What every stage read and wrote, against what it declares."""
    declared = {stage.name: declarations(stage) for stage in default_stages()}
    assert [r.name for r in result.stages] == list(declared)
    for r in result.stages:
        needs, provides = declared[r.name]
        assert r.reads <= set(needs), f"{r.name} read {sorted(r.reads - set(needs))}, not in needs {needs}"
        assert r.writes <= set(provides), f"{r.name} wrote {sorted(r.writes - set(provides))}, not in provides"
        if r.report.skipped_reason is None:  # a stage that did its work wrote what it says it provides
            unwritten = set(provides) - r.writes - PATH_DEPENDENT.get(r.name, set())
            assert not unwritten, f"{r.name} declares {sorted(unwritten)} in provides but did not write them"


# ---------------------------------------------------------------- the real pipeline


@pytest.mark.parametrize("fields", [{}, {"quantization": "int4", "kv_cache_dtype": "int8"}])
def test_tiny_model_start_keeps_every_contract(
    tiny_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, str]
) -> None:
    """Eager starts of the tiny model (the compile stages skip; quantize_weights runs in the int4 one)."""
    config = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off", max_model_len=128, **fields)
    result = _started(config, tmp_path, monkeypatch)
    _assert_contracts_kept(result)
    by_name = {r.name: r for r in result.stages}
    assert by_name["model_prepare"].writes == {"model_dir", "gguf_path", "arch", "dtype"}
    assert (by_name["quantize_weights"].report.skipped_reason is None) == bool(fields)
    # The facts the result keeps in place of the context.
    assert result.engine.model is result.engine.runner.model
    assert str(result.model_dir) == by_name["model_prepare"].report.attributes["glowplug.model_dir"]


@pytest.mark.slow
def test_default_model_start_keeps_every_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default pipeline on the default model with the default config (compiled decode, --quantization auto:
    every stage does its work; quantize_weights makes the int4 head), in the shared cache like the other slow
    tests."""
    result = _started(EngineConfig.from_flat(max_model_len=256, max_num_seqs=4), None, monkeypatch)
    _assert_contracts_kept(result)
    skipped = {r.name for r in result.stages if r.report.skipped_reason is not None}
    assert skipped.isdisjoint({"quantize_weights", "dynamo_transform", "graph_compile", "graph_capture"}), skipped


# ---------------------------------------------------------------- what the view enforces


def test_an_undeclared_write_fails_the_stage_naming_slot_and_declarations() -> None:
    def prepare(ctx: Any) -> None:
        ctx.model_dir = Path("m")
        ctx.gguf_path = None

    message = _contract_error([Fake("model_prepare", prepare, provides=("model_dir", "arch", "dtype"))])
    assert message == (
        "stage 'model_prepare' wrote 'gguf_path', which it does not declare in provides "
        "(provides: model_dir, arch, dtype)"
    )


def test_an_undeclared_read_fails_the_stage() -> None:
    def init(ctx: Any) -> None:
        ctx.model_dir = Path("m")
        ctx.tokenizer = "t"

    stages = [
        Fake("prepare", init, provides=("model_dir", "tokenizer")),
        Fake("weights", lambda ctx: ctx.tokenizer, needs=("model_dir",)),
    ]
    assert _contract_error(stages) == (
        "stage 'weights' read 'tokenizer', which it does not declare in needs (needs: model_dir)"
    )


def test_a_stage_reads_its_own_writes_but_not_the_value_before_them() -> None:
    def rewrite(ctx: Any) -> None:
        ctx.weights_bytes = 3
        ctx.weights_bytes += 1  # its own output: readable

    results = _run([Fake("own", rewrite, provides=("weights_bytes",))])
    assert results[0].reads == frozenset() and results[0].writes == {"weights_bytes"}
    message = _contract_error(
        [Fake("bump", lambda ctx: setattr(ctx, "weights_bytes", ctx.weights_bytes + 1), provides=("weights_bytes",))]
    )
    assert message.startswith("stage 'bump' read 'weights_bytes', which it does not declare in needs")


def test_inputs_are_read_by_all_and_written_by_none() -> None:
    seen: dict[str, Any] = {}
    _run([Fake("reader", lambda ctx: seen.update(config=ctx.config, cache_root=ctx.cache_root, device=ctx.device))])
    assert set(seen) == EngineContext.INPUTS
    message = _contract_error([Fake("writer", lambda ctx: setattr(ctx, "device", "cuda"))])
    assert message == "stage 'writer' wrote 'device', an input of the start-up: inputs are read-only"


def test_writing_a_name_that_is_no_slot_fails() -> None:
    message = _contract_error([Fake("stray", lambda ctx: setattr(ctx, "scratch", 1))])
    assert message.startswith("stage 'stray' wrote 'scratch', which is not a slot of EngineContext (slots: arch, ")


def test_a_caught_violation_still_fails_the_stage() -> None:
    def swallow(ctx: Any) -> None:
        try:
            ctx.model = None
        except Exception:  # noqa: BLE001 - what a broad fallback in a stage would do
            pass

    assert _contract_error([Fake("fallback", swallow)]).startswith("stage 'fallback' wrote 'model'")


def test_context_methods_read_through_the_view() -> None:
    """quant_group_size reads model_dir (int4 without a group size): only for a stage that needs it."""
    config = EngineConfig.from_flat(quantization="int4")
    group: dict[str, Any] = {}
    stages = [
        Fake("prepare", lambda ctx: setattr(ctx, "model_dir", None), provides=("model_dir",)),
        Fake("quantize", lambda ctx: group.update(size=ctx.quant_group_size()), needs=("model_dir",)),
    ]
    _run(stages, EngineContext(config=config))
    assert group["size"] == (None, "scheme default")
    message = _contract_error([Fake("quantize", lambda ctx: ctx.quant_group_size())], EngineContext(config=config))
    assert message == "stage 'quantize' read 'model_dir', which it does not declare in needs (needs: none)"


def test_a_view_kept_past_its_stage_fails_loudly() -> None:
    kept: list[Any] = []
    ctx = EngineContext()
    _run([Fake("keeper", kept.append)], ctx)
    with pytest.raises(StageContractError, match="after the stage ended; keep the values, not the context"):
        _ = kept[0].config


# ---------------------------------------------------------------- declarations, checked before anything runs


@pytest.mark.parametrize(
    ("needs", "provides", "match"),
    [
        (
            ("modle",),
            (),
            "stage 'typo' declares 'modle' in needs, which is not a slot of EngineContext; did you mean 'model'?",
        ),
        ((), ("kv_plann",), "declares 'kv_plann' in provides, which is not a slot"),
        (("config",), (), "declares 'config' in needs, but it is an input"),
        ((), ("device",), "declares 'device' in provides, but it is an input"),
    ],
)
def test_a_bad_declaration_fails_before_any_stage_runs(
    needs: tuple[str, ...], provides: tuple[str, ...], match: str
) -> None:
    tracing = setup_tracing()
    ran: list[str] = []
    stages = [
        Fake("first", lambda ctx: ran.append("first")),
        Fake("typo", lambda ctx: None, needs=needs, provides=provides),
    ]
    with pytest.raises(StageContractError, match=match):
        _run(stages, tracing=tracing)
    assert ran == [] and tracing.finished_spans() == ()


def test_build_engine_rejects_a_bad_declaration_before_the_start(tmp_path: Path) -> None:
    tracing = setup_tracing()
    stages = [*default_stages(), Fake("probe", lambda ctx: None, needs=("engnie",))]
    with pytest.raises(StageContractError, match="'engnie' in needs.*did you mean 'engine'"):
        build_engine(EngineConfig.from_flat(model=str(tmp_path)), tracing=tracing, cache_dir=tmp_path, stages=stages)
    assert tracing.finished_spans() == ()


def test_hooks_at_ready_keep_the_stage_contract() -> None:
    """The work at READY (engine/stages/ready.py) follows the one stage protocol: its declarations name real slots
    of ReadyContext, and a hook is held to them as a stage is, even when it catches the error itself."""
    from glowplug.engine.stages.ready import ReadyContext, ready_hooks
    from glowplug.engine.stages.runner import run_in_order

    hooks = ready_hooks(EngineConfig(tensor_parallel_size=2))
    check_pipeline(hooks, ReadyContext)
    assert [h.name for h in hooks] == [
        "measure_floor",
        "record_profile",
        "seal_compile_cache",
        "phase_table",
        "prepare_grammar",
        "serve_steps",
    ]
    written = {slot for hook in hooks for slot in declarations(hook)[1]}
    assert written == ReadyContext.slot_names()

    def sneaky(ctx: Any) -> None:
        try:
            ctx.table = "a table"
        except StageContractError:
            pass

    ctx = ReadyContext(**{name: None for name in ReadyContext.INPUTS})
    with pytest.raises(StageContractError, match="stage 'sneaky' wrote 'table', which it does not declare"):
        run_in_order([Fake("sneaky", sneaky, provides=("floor",))], ctx)
    assert ctx.table is None


@pytest.mark.parametrize("missing", ["needs", "provides"])
def test_every_stage_declares_both(missing: str) -> None:
    stage = Fake("quiet", lambda ctx: None)
    delattr(stage, missing)
    with pytest.raises(StageContractError, match=f"stage 'quiet' declares no `{missing}`"):
        _run([stage])


def test_default_stages_declare_real_slots_and_no_barriers() -> None:
    check_pipeline(default_stages(), EngineContext)
    # The whole list: under tensor parallelism distributed_init writes `parallel` (kv_cache_init reads it; at TP=1
    # the slot stays None).
    stages = default_stages(EngineConfig(tensor_parallel_size=2))
    check_pipeline(stages, EngineContext)
    assert not any(getattr(stage, "barrier", False) for stage in stages)
    written = {slot for stage in stages for slot in declarations(stage)[1]}
    needed = {slot for stage in stages for slot in declarations(stage)[0]}
    # The bundle's install runs before the pipeline (build_engine), when a bundle is given.
    written |= set(declarations(BundleInstall())[1])
    # Every slot some stage reads has a writer, and every slot is written by some stage.
    assert needed <= written and written == EngineContext.slot_names()
