"""The compile cache, in the artifact store: the AOT-compiled decode step per configuration, and Inductor's folder.

- cache `compile`: one entry per compiled configuration (model config, dtype, the quantization and KV-cache fields
  that shape the graph, torch, glowplug source, device) holding the serialized AOT artifact (engine/compile.py):
  a warm start loads it instead of tracing and compiling. Beside it, when one could be made and proven, the replay
  plan (engine/compile_replay.py), which a warm start loads first: it runs the same compiled kernels without
  importing Dynamo or Inductor, and falls back to the AOT artifact if it will not load. A miss is explained like
  any other cache's (which factor changed since the last compile of the same model, old -> new); an entry that will not
  unpickle or whose guards will not load is damaged: moved aside, reported, and the step is traced and compiled again.
- cache `inductor`: the TORCHINDUCTOR_CACHE_DIR, a workspace shared by every configuration (Inductor keys its own
  entries by graph and options, and a fresh folder would pay the one-time C++ toolchain probe, 15-20 s here,
  again). Inductor writes it in place; the store seals its file list after each compile and verifies it at the
  next start. A damaged file (a truncated kernel .so, say) is moved aside and Inductor rebuilds it. On a read-only
  cache dir Inductor is pointed at a private folder linking to the stored one (base/artifacts/workspace.py), so
  a warm start loads the stored kernels without a write in the cache dir instead of compiling them all again.
- If the compile still fails, the cached artifacts are suspected: the Inductor folder is moved aside (a
  `cache_corrupt` event), Inductor's in-memory caches are cleared and the compile runs once more, cold, in a
  fresh folder. A second failure is a real compile error and fails the stage. A compile that failed for want of a
  working C++ compiler is not retried: no cached file is to blame, and a fresh folder would fail the same way.
- Everything here that needs torch's compiler internals checks that this torch has them first
  (base/torch_compat.py): an entry without a replay plan is not even read when it does not.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from glowplug.base import torch_compat
from glowplug.base.artifacts import ArtifactStore, Workspace
from glowplug.base.artifacts.cachedir import report_event
from glowplug.base.artifacts.caches import COMPILE, INDUCTOR, source_digest
from glowplug.base.artifacts.manifest import list_files
from glowplug.base.artifacts.workspace import open_workspace, renew, seal
from glowplug.base.errors import one_line
from glowplug.profiling.names import Event

from .compile import CompiledDecode, InductorSettings, LoadedDecode
from .compile_index import SOURCE_PACKAGES, config_factors, device_label
from .compile_replay import PLAN_FILE, ReplayDecode, ReplayPlan, ReplayUnavailable
from .config import EngineConfig
from .models.arch import ModelArch
from .models.llama import DecoderLM
from .models.store import model_group
from .parallel import tp_factors

T = TypeVar("T")
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
ARTIFACT = "decode.aot"
_INDUCTOR_SKIP = ("locks/",)  # Inductor's lock files: not artifacts


def compile_factors(
    config: EngineConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    device: str,
    settings: InductorSettings,
    native_level: str | None = None,
    layer_formats: str | None = None,
) -> dict[str, Any]:
    """What the compiled decode step depends on. Scheduler sizes, max_model_len and capture sizes are not here:
    the graph is traced with dynamic batch, context and cache sizes, so they change no compiled code.

    native_level: the ISA level of the native kernels the step calls (None without them). The graph calls them by
    name whatever the level, but their rounding differs by level (bf16 or integer dot products, say), so the
    logits a stored entry recorded for its self-check hold only at the level it was compiled with.
    layer_formats: under --quantization auto, every layer's kernel format (gguf_auto.LayerFormats.signature):
    two files of one architecture can hold their layers in different formats, which compile to different ops."""
    return {
        "layer_formats": layer_formats,
        "native_level": native_level,
        "inductor": dataclasses.asdict(settings),
        "model_config": arch.model_dump(mode="json"),
        "dtype": str(dtype).removeprefix("torch."),
        "engine_config": config_factors(config),
        "torch": torch.__version__,
        "glowplug_source": source_digest(SOURCE_PACKAGES),
        "device": device_label(device),
        **tp_factors(config.tensor_parallel_size),
    }


@dataclass
class StoredReplay:
    """dynamo_transform's warm result when the entry has a replay plan: the plan, not yet bound (graph_compile
    loads its kernels), and the way back to the full AOT artifact."""

    plan: ReplayPlan
    folder: Path
    model: DecoderLM

    def load(self, inductor_dir: Path) -> ReplayDecode:
        return ReplayDecode.load(self.plan, inductor_dir, self.model)

    def full(self) -> LoadedDecode:
        return LoadedDecode.read((self.folder / ARTIFACT).read_bytes(), self.model)

    def reject(self, reason: str) -> None:
        """The plan loaded but does not compute what was compiled: a `cache_corrupt` event; the start goes on
        from the AOT artifact in the same entry."""
        report_event(
            Event.CACHE_CORRUPT,
            cache=COMPILE.name,
            path=self.folder,
            reason=reason,
            action="the replay plan is not used; loading the AOT artifact of the same entry",
        )


def read_entry(folder: Path, model: DecoderLM) -> StoredReplay | LoadedDecode:
    """A stored entry: its replay plan when it has a usable one, else the AOT artifact with its guards."""
    plan_path = folder / PLAN_FILE
    if plan_path.is_file():
        try:
            return StoredReplay(ReplayPlan.from_json(plan_path.read_bytes()), folder, model)
        except ReplayUnavailable as exc:
            structlog.get_logger("glowplug.compile").info(
                "replay plan not used; loading the AOT artifact", reason=str(exc)
            )
    return LoadedDecode.read((folder / ARTIFACT).read_bytes(), model)


@dataclass
class CompileCache:
    store: ArtifactStore
    key: str
    factors: dict[str, Any]
    group: str
    miss_reason: str | None  # None when this configuration was compiled before and its artifacts are sound
    workspace: Workspace
    loaded: StoredReplay | LoadedDecode | None  # the stored entry: a warm start
    rebuilt_kernels: list[str] = dataclasses.field(default_factory=list)
    bundle: str | None = None  # the bundle that brought the stored entry, if one did

    @property
    def path(self) -> Path:
        """The Inductor cache folder in use."""
        return self.workspace.path

    def run(self, compile_fn: Callable[[], T]) -> T:
        """Run `compile_fn` (the pending Inductor compiles); on failure retry once in a fresh Inductor folder.

        Kernel libraries that appear during the compile are remembered (`rebuilt_kernels`): when every graph
        lookup hit, a new library means Inductor could not load a cached one and compiled it again."""
        before = set(self._kernels())
        try:
            result = compile_fn()
        except Exception as exc:
            if torch_compat.is_toolchain_error(exc):
                raise
            log = structlog.get_logger("glowplug.compile")
            log.warning("compile failed; retrying once in a fresh Inductor cache", error=one_line(exc))
            self.renew_inductor(f"compile failed with these cached artifacts ({one_line(exc)})")
            result = compile_fn()
            before = set()
        self.rebuilt_kernels = sorted(set(self._kernels()) - before)
        return result

    def renew_inductor(self, reason: str) -> None:
        """Move the Inductor folder aside (a `cache_corrupt` event) and forget what Inductor loaded from it: the
        next compile starts cold in a fresh folder."""
        renew(self.store, self.workspace, reason)
        _point_inductor_at(self.workspace.path)
        _clear_inductor_memory()

    def _kernels(self) -> list[str]:
        return [rel for rel in list_files(self.path, skip=_INDUCTOR_SKIP) if rel.endswith(".so")]

    def served_from_cache(self) -> bool:
        """Whether graph_compile was a cache hit: the artifact loaded, and no damaged kernel had to be rebuilt
        (a healed folder still loads, but recompiles the kernels that were moved aside)."""
        return self.loaded is not None and not self.workspace.healed and not self.rebuilt_kernels

    def explain_rebuilt(self) -> str | None:
        """A loaded artifact whose kernels were nonetheless rebuilt: the cached libraries were missing or would not
        load (in a folder the store had not sealed, so nothing was verified before Inductor read it). Reported as
        a `cache_corrupt` event; the reason, or None when nothing was rebuilt behind a hit."""
        if self.loaded is None or not self.rebuilt_kernels:
            return None
        n = len(self.rebuilt_kernels)
        reason = (
            f"Inductor rebuilt {n} compiled kernel librar{'y' if n == 1 else 'ies'} behind a compile-cache hit "
            f"(the cached ones were missing or would not load), e.g. {self.rebuilt_kernels[0]}"
        )
        report_event(
            Event.CACHE_CORRUPT,
            cache=INDUCTOR.name,
            path=self.path,
            reason=reason,
            action="rebuilt by Inductor in place; the folder is sealed again",
        )
        return reason

    def record(self, step: CompiledDecode | None, plan: ReplayPlan | None = None) -> None:
        """After a successful compile: the artifact and its replay plan (when `step` was compiled from a trace) and
        the Inductor file list. A failure to serialize costs the next start a compile, never this one."""
        if step is not None:
            try:
                data = step.serialize()
            except Exception as exc:  # noqa: BLE001 - the cache is an optimisation
                structlog.get_logger("glowplug.compile").warning(
                    "the compiled decode step could not be serialized; the next start compiles again",
                    error=one_line(exc),
                )
            else:

                def build(folder: Path | None) -> None:
                    if folder is not None:
                        (folder / ARTIFACT).write_bytes(data)
                        if plan is not None:
                            (folder / PLAN_FILE).write_bytes(plan.to_json())

                self.store.put(COMPILE, self.factors, group=self.group, build=build)
        self.seal()

    def drop_artifact(self, reason: str) -> None:
        """The stored artifact loaded but would not run: moved aside (a `cache_corrupt` event); compile again."""
        path = self.store.entry_path(COMPILE, self.key)
        self.loaded = None
        self.miss_reason = f"entry was damaged ({reason})"
        if path.exists():
            self.store.quarantine(COMPILE, path, reason)

    def seal(self) -> None:
        seal(self.store, self.workspace, skip=_INDUCTOR_SKIP)


def _point_inductor_at(path: Path) -> None:
    # Inductor reads this on every cache lookup; set here (not at import) so only a compiling engine changes it.
    os.environ[INDUCTOR_ENV] = str(path)


def _clear_inductor_memory() -> None:
    """Forget what Inductor loaded or concluded from the old folder: compiled modules, and the CPU-feature probe
    results (a truncated probe .so makes the probe fail, and a cached "no AVX" would leave the retry with scalar
    kernels for the life of the process)."""
    from glowplug.base.torch_compat import clear_inductor_caches, cpu_vec_isa

    clear_inductor_caches()
    for obj in vars(cpu_vec_isa).values():
        for member in (obj, *vars(obj).values()) if isinstance(obj, type) else (obj,):
            if callable(getattr(member, "cache_clear", None)):
                member.cache_clear()


def open_compile_cache(
    cache_root: Path,
    config: EngineConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    device: str,
    settings: InductorSettings,
    model: DecoderLM,
    native_level: str | None = None,
    layer_formats: str | None = None,
) -> CompileCache:
    """Look this configuration up, loading its artifact and guards (or explaining the miss), verify the Inductor
    folder and point Inductor at it."""
    store = ArtifactStore(cache_root)
    factors = compile_factors(config, arch, dtype, device, settings, native_level, layer_formats)
    label = device_label(device)
    if not (store.entry_path(COMPILE, store.key(COMPILE, factors)) / PLAN_FILE).is_file():
        # No replay plan to load: the AOT artifact or a trace, both made of compiler internals. Checked before the
        # lookup, whose loader would take this torch's failure for a damaged entry and move a sound one aside.
        torch_compat.require_compiler()
    workspace = open_workspace(
        store, INDUCTOR, {"torch": torch.__version__, "device": label}, group=label, skip=_INDUCTOR_SKIP
    )
    _point_inductor_at(workspace.path)
    index = store.lookup(
        COMPILE, factors, group=model_group(config.model), load=lambda folder: read_entry(folder, model)
    )
    reason = index.miss_reason if not index.hit else None
    if reason is None and workspace.healed:
        where = "left out of the read-only cache dir" if workspace.source is not None else "moved aside"
        reason = f"damaged Inductor artifacts {where} and rebuilt ({workspace.healed[0]})"
    return CompileCache(
        store, index.key, factors, model_group(config.model), reason, workspace, index.value, bundle=index.bundle
    )
