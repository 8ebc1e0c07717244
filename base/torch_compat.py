"""The one door to torch's private APIs, and the check that this torch still has them.

The compiled decode step is built from pieces of torch that are not public API: Dynamo's full-graph capture and
its AOT-compile artifacts, the guard serialization, Inductor's and functorch's config options, Inductor's in-memory
caches and errors, and the layout of the Python wrapper Inductor generates (which the replay plan parses). The CPU
kernels call aten operators whose names start with an underscore, and the live-tensor tracker uses torch's dispatch
mode. Any torch release may move them. Every private torch name glowplug uses is named in this module and nowhere
else (tests/test_torch_compat.py scans the whole package for `torch._` outside it). It sits below every layer and
imports nothing of glowplug's, so kernels, profiling and the engine all reach torch's internals through it, so that:
- the supported torch range is one statement (SUPPORTED_RANGE, which pyproject.toml and the README repeat), and
- a capability check, run once per process, says whether this torch has those internals with the shapes the engine
  relies on (attributes and dataclass fields present, parameters where a signature is cheap to read, config options
  present) before anything is traced, compiled or loaded. With a torch outside the range or a failed check,
  `--compile auto` runs the decode step eagerly and the compile rows say why; `--compile on` fails the start.

Two tiers, because a warm start that replays the compiled step (engine/compile_replay.py) must not import Dynamo or
Inductor (that import was half of a warm start):
- check_runtime(): the version range and the one `torch._C` entry the replay needs; imports nothing.
- check_compiler(): that, and every Dynamo, Inductor, functorch and guard name below; imports `torch._dynamo`. It
  runs the first time one of those names is asked for (by the trace, or a warm start without a replay plan), which
  imports Dynamo then, as the direct imports it replaces did, so a replayed warm start never pays for it.
A third tier, _DIRECT, is not gated: the kernels' aten operators and the dispatch-mode utilities are needed by eager
serving whatever the compiler check says, and the code calling each is tested against its reference directly.
Names are resolved on first use through this module's `__getattr__` (then bound as plain module attributes, so a
kernel's call costs what `torch._int_mm` cost): `from glowplug.base.torch_compat import fullgraph_capture` inside a
function is what `from torch._dynamo.convert_frame import fullgraph_capture` was. A name asked for while its tier's
check fails raises TorchInternalsUnavailable with the check's reason.

The generated wrapper's layout (WRAPPER_* below) is not checked here: it can only be seen in a compiled graph, and a
replay plan is written only after it reproduced the compiled step bit for bit (engine/compile_replay.py), so a torch
that generates another layout gets no plan, and its warm starts load the AOT artifact.

Supported: torch >=2.11,<2.14. How that was established (CPU builds; the GPU paths were not run):
- 2.13.0 (the pinned build): the whole test suite.
- 2.11.0 and 2.12.0 (PyPI's CUDA builds, run on the CPU): each installed into a scratch virtualenv on the 2-core
  box, where a cold compiled start of the tiny test model (plan written), a warm start replaying the plan
  (fingerprint matched, no Dynamo or Inductor imported by READY) with the cold start's tokens, and the fast tests
  of tests/test_torch_compat.py passed. The other test files were not run there.
- 2.14.1: every name and shape below is there (this check passes), but a compiled start fails: its loaded guard
  manager expects the KV-cache tensors' dispatch keys as seen inside inference mode (no AutogradCPU), which
  engine/compile.py's guard checks (outside inference mode, see _load_guards) do not give. So 2.14 is outside the
  range until that is adapted; there `glowplug startup --compile auto` reaches READY eagerly, the compile rows
  naming the range.
- 2.10.0 lacks internals the engine uses (read from its wheel's sources: `AOTCompileUnpickler`,
  `AOTCompiledFunction.prepare_f_locals`, functorch's `bypass_autograd_cache_key` and `force_autograd_cache`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch

SUPPORTED_MIN = (2, 11)
SUPPORTED_BELOW = (2, 14)
SUPPORTED_RANGE = f">={SUPPORTED_MIN[0]}.{SUPPORTED_MIN[1]},<{SUPPORTED_BELOW[0]}.{SUPPORTED_BELOW[1]}"

# A test hook, read only here: when set, check_runtime() fails with its value as the reason. A torch outside the
# range cannot be installed beside the pinned one for a test, and patching this module from outside would have to
# happen inside the `glowplug` process before the engine imports it (a sitecustomize on the child's path); one
# variable read in one place exercises the same consequences, in a real `glowplug startup`, with no code of the
# test's running in the engine's process.
FAIL_ENV = "GLOWPLUG_TORCH_COMPAT_FAIL"


class TorchInternalsUnavailable(RuntimeError):
    """A private torch name was asked for while this torch failed the capability check (str: the check's reason)."""


@dataclass(frozen=True)
class Capability:
    """The capability check's verdict: ok, or not with the reason in one line ("torch 2.4.1 is outside the
    supported range >=2.11,<2.14", "torch._dynamo.convert_frame.fullgraph_capture is missing")."""

    ok: bool
    reason: str


@dataclass(frozen=True)
class _Need:
    """One private name and what the engine relies on about it.

    where: "module" or "module:attr.path". attrs: dataclass fields, class attributes or methods it must have.
    positional: how many arguments it must accept positionally (the engine calls it so). keywords: the keyword
    arguments the engine passes. options: config options the engine patches (for a config module)."""

    where: str
    attrs: tuple[str, ...] = ()
    positional: int = 0
    keywords: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


_CONVERT_FRAME = "torch._dynamo.convert_frame"
_AOT = "torch._dynamo.aot_compile"
_PACKAGE = "torch._dynamo.package"

# What a replayed warm start needs: the address of the helper through which Inductor's compiled kernel libraries
# read a tensor's data pointer (they find it in an environment variable, as Inductor sets it).
_RUNTIME: dict[str, _Need] = {
    "tensor_data_ptr_address": _Need("torch:_C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr"),
}

# Everything else: Dynamo's capture and AOT artifacts, guards, Inductor's and functorch's options and caches.
_COMPILER: dict[str, _Need] = {
    "dynamo_config": _Need("torch._dynamo.config", options=("specialize_float", "automatic_dynamic_shapes")),
    "inductor_config": _Need(
        "torch._inductor.config",
        options=(
            "cpp_wrapper",
            "freezing",
            "max_autotune",
            "cpp.vec_isa_ok",
            "size_asserts",
            "scalar_asserts",
            "alignment_asserts",
            "enable_autograd_for_aot",
        ),
    ),
    "functorch_config": _Need(
        "torch._functorch.config",
        options=(
            "strict_autograd_cache",
            "bypass_autograd_cache_key",
            "bundled_autograd_cache",
            "force_non_lazy_backward_lowering",
            "force_autograd_cache",
        ),
    ),
    # The capture (dynamo_transform) and what it hands to the compile.
    "fullgraph_capture": _Need(f"{_CONVERT_FRAME}:fullgraph_capture", positional=3),
    "get_traced_fn": _Need(f"{_CONVERT_FRAME}:get_traced_fn", positional=1),
    "get_signature": _Need(f"{_CONVERT_FRAME}:_get_signature", positional=1),
    "CaptureOutput": _Need(f"{_CONVERT_FRAME}:CaptureOutput", attrs=("graph_capture_output", "backend_input")),
    "BackendInput": _Need(
        f"{_CONVERT_FRAME}:BackendInput",
        attrs=("backend_id", "graph_module", "example_inputs", "fake_mode", "tensor_to_context"),
    ),
    "GraphCaptureOutput": _Need(
        f"{_CONVERT_FRAME}:GraphCaptureOutput", attrs=("traced_code", "build_guards", "get_runtime_env")
    ),
    "build_guards": _Need(
        f"{_CONVERT_FRAME}:GraphCaptureOutput.build_guards", positional=2, keywords=("hooks", "save", "strict_error")
    ),
    "GraphRuntimeEnv": _Need(f"{_CONVERT_FRAME}:GraphRuntimeEnv", attrs=("bytecode", "used_globals")),
    "graph_device_type": _Need("torch._dynamo.graph_utils:_graph_device_type", positional=1),
    "mark_dynamic": _Need("torch._dynamo:mark_dynamic", positional=2),
    "mark_unbacked": _Need("torch._dynamo.decorators:mark_unbacked", positional=2),
    "dynamo_timed": _Need("torch._dynamo.utils:dynamo_timed", positional=1),
    "get_metrics_context": _Need("torch._dynamo.utils:get_metrics_context"),
    "TracingContext": _Need("torch._guards:TracingContext", positional=1),
    "tracing": _Need("torch._guards:tracing", positional=1),
    # The compile (graph_compile): Inductor as torch.compile calls it, the bundled output, the guards.
    "InductorWrapper": _Need("torch:_TorchCompileInductorWrapper", positional=3),
    "BundledAOTAutogradSerializableCallable": _Need(
        "torch._dynamo.aot_compile_types:BundledAOTAutogradSerializableCallable", positional=1
    ),
    "CheckFunctionManager": _Need(
        "torch._dynamo.guards:CheckFunctionManager", attrs=("UNSUPPORTED_SERIALIZATION_GUARD_TYPES",)
    ),
    "Hooks": _Need("torch._dynamo.hooks:Hooks", keywords=("guard_filter_fn",)),
    "SourceInfo": _Need(f"{_PACKAGE}:SourceInfo", attrs=("add_code",), keywords=("inlined_sources",)),
    # The artifact: made, serialized, read back, its guards rebuilt.
    "CompileArtifacts": _Need(
        f"{_AOT}:CompileArtifacts",
        keywords=(
            "signature",
            "guard_manager",
            "guards_state",
            "backend_id",
            "compiled_fn",
            "original_code",
            "runtime_env",
            "source_info",
            "device_type",
            "backend_name",
        ),
    ),
    "AOTCompiledFunction": _Need(
        f"{_AOT}:AOTCompiledFunction",
        attrs=("guard_check", "prepare_f_locals", "serialize"),
        keywords=("_artifacts", "_extra_globals"),
    ),
    "AOTCompileUnpickler": _Need(f"{_AOT}:AOTCompileUnpickler", attrs=("load",), positional=2),
    "SerializedCode": _Need(f"{_PACKAGE}:SerializedCode", attrs=("to_code_object",)),
    "load_guard_manager": _Need(f"{_PACKAGE}:load_guard_manager", positional=3),
    "load_guards_state": _Need(f"{_PACKAGE}:load_guards_state", positional=1),
    # Inductor's in-memory state (forgotten before a retry in a fresh folder) and its toolchain error.
    "cpu_vec_isa": _Need("torch._inductor.cpu_vec_isa"),
    "clear_inductor_caches": _Need("torch._inductor.utils:clear_caches"),
    "InductorError": _Need("torch._inductor.exc:InductorError"),
    "InvalidCxxCompiler": _Need("torch._inductor.exc:InvalidCxxCompiler"),
}

# Ungated (see the module docstring): the CPU kernels' underscore aten operators (kernels/cpu.py) and the dispatch
# mode the live-tensor tracker runs under (profiling/memory.py).
_DIRECT: dict[str, _Need] = {
    "weight_int8pack_mm": _Need("torch:_weight_int8pack_mm"),
    "int_mm": _Need("torch:_int_mm"),
    "convert_weight_to_int4pack_for_cpu": _Need("torch:ops.aten._convert_weight_to_int4pack_for_cpu"),
    "weight_int4pack_mm_for_cpu": _Need("torch:ops.aten._weight_int4pack_mm_for_cpu"),
    "TorchDispatchMode": _Need("torch.utils._python_dispatch:TorchDispatchMode"),
    "tree_flatten": _Need("torch.utils._pytree:tree_flatten"),
}

# Inductor's generated Python wrapper, as the replay plan reads it (see the module docstring for how it is checked):
# kernel definitions, Inductor/Dynamo imports, and uses of the compile pool.
WRAPPER_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\[[^\]]*\], r'''.*?'''\)$", re.S | re.M)
WRAPPER_IMPORT = re.compile(r"^from (torch\._(?:inductor|dynamo)[\w.]*) import (\w+)(?: as (\w+))?$", re.M)
WRAPPER_HEAVY_IMPORT = re.compile(r"^(?:from|import) torch\._(?:inductor|dynamo)", re.M)
WRAPPER_POOL_USE = re.compile(r"\basync_compile\.(\w+)")
WRAPPER_POOL_CLASS = "AsyncCompile"  # the compile pool the wrapper instantiates
COMPILED_GRAPH_CLASS = "CompiledFxGraph"  # Inductor's compiled graph: `source_code` and `current_callable`
COMPILED_FN_GLOBAL_PREFIX = "__compiled_fn"  # the globals through which Dynamo's bytecode calls the compiled graph
KERNEL_ENTRY = "kernel"  # a compiled kernel library's Python entry point
TENSOR_DATA_PTR_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"  # where the libraries look for that helper

Config = Literal["dynamo", "inductor", "functorch"]


def _resolve(need: _Need) -> Any:
    module, _, path = need.where.partition(":")
    value: Any = importlib.import_module(module)
    for attr in path.split(".") if path else ():
        value = getattr(value, attr)
    return value


def _dotted(need: _Need) -> str:
    return need.where.replace(":", ".")


def _version_problem(version: str) -> str | None:
    """Why `version` is outside the supported range, or None. Major.minor decide (a local or pre-release suffix
    belongs to its release: 2.15.0a0 is a 2.15)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return f"torch {version} has a version glowplug cannot read (supported: {SUPPORTED_RANGE})"
    if not SUPPORTED_MIN <= (int(m[1]), int(m[2])) < SUPPORTED_BELOW:
        return f"torch {version} is outside the supported range {SUPPORTED_RANGE}"
    return None


def _shape_problem(need: _Need, value: Any) -> str | None:
    """What `value` lacks of what the engine relies on, or None."""
    where = _dotted(need)
    fields = {f.name for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) else set()
    for attr in need.attrs:
        if attr not in fields and not hasattr(value, attr):
            return f"{where} has no {attr!r}"
    for option in need.options:
        try:
            functools.reduce(getattr, option.split("."), value)
        except AttributeError:
            return f"{where} has no option {option!r}"
    if need.positional or need.keywords:
        try:
            params = list(inspect.signature(value).parameters.values())
        except (TypeError, ValueError):  # a builtin without a readable signature: its presence is what is checked
            return None
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < need.positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
            return f"{where} takes {len(positional)} positional arguments, glowplug passes {need.positional}"
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [k for k in need.keywords if k not in named]
        if missing and not any(p.kind == p.VAR_KEYWORD for p in params):
            return f"{where} takes no {', '.join(repr(k) for k in missing)} argument"
    return None


def _problems(needs: Mapping[str, _Need]) -> str | None:
    """The first of `needs` that is missing or misshapen, as a reason, or None."""
    for need in needs.values():
        try:
            value = _resolve(need)
        except (ImportError, AttributeError):
            return f"{_dotted(need)} is missing"
        problem = _shape_problem(need, value)
        if problem is not None:
            return problem
    return None


@functools.cache
def check_runtime() -> Capability:
    """The version range and what a replayed step needs; imports nothing (see the module docstring)."""
    faked = os.environ.get(FAIL_ENV)
    if faked:
        return Capability(False, f"{faked} ({FAIL_ENV} is set)")
    problem = _version_problem(str(torch.__version__)) or _problems(_RUNTIME)
    if problem is not None:
        return Capability(False, problem)
    return Capability(True, f"torch {torch.__version__} is in the supported range {SUPPORTED_RANGE}")


@functools.cache
def check_compiler() -> Capability:
    """check_runtime(), then every compiler internal with its shape; imports torch._dynamo (see the docstring)."""
    runtime = check_runtime()
    if not runtime.ok:
        return runtime
    try:
        # Dynamo as a whole first, which is the order of its own imports: another start-up stage's thread may be
        # importing it (eager code can reach it lazily), and taking one of its submodules or Inductor's first while
        # that import is under way inverts the two threads' module locks (torch 2.12 was seen to deadlock so).
        importlib.import_module("torch._dynamo")
    except ImportError:
        return Capability(False, "torch._dynamo is missing")
    problem = _problems(_COMPILER)
    if problem is not None:
        return Capability(False, problem)
    return Capability(True, f"{runtime.reason}, with the {len(_RUNTIME) + len(_COMPILER)} internals glowplug uses")


def require_runtime() -> None:
    """Raise TorchInternalsUnavailable when check_runtime() fails."""
    verdict = check_runtime()
    if not verdict.ok:
        raise TorchInternalsUnavailable(verdict.reason)


def require_compiler() -> None:
    """Raise TorchInternalsUnavailable when check_compiler() fails."""
    verdict = check_compiler()
    if not verdict.ok:
        raise TorchInternalsUnavailable(verdict.reason)


def patch_config(which: Config, changes: Mapping[str, Any]) -> AbstractContextManager[None]:
    """`torch._{dynamo,inductor,functorch}.config.patch(changes)`, for options declared above: an option the
    capability check does not verify is refused here, so a new one cannot slip past the check."""
    name = f"{which}_config"
    undeclared = sorted(set(changes) - set(_COMPILER[name].options))
    if undeclared:
        raise KeyError(
            f"{', '.join(undeclared)}: declare the option in torch_compat._COMPILER[{name!r}] so the "
            f"capability check verifies it"
        )
    return __getattr__(name).patch(dict(changes))  # type: ignore[no-any-return]


def inner_errors(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps: its causes and contexts, and an InductorError's inner exception."""
    chain: list[BaseException] = []
    frontier: list[BaseException | None] = [exc]
    while frontier:
        e = frontier.pop()
        if e is None or any(e is seen for seen in chain):
            continue
        chain.append(e)
        inner = getattr(e, "inner_exception", None)
        frontier.extend([e.__cause__, e.__context__, inner if isinstance(inner, BaseException) else None])
    return chain


def is_toolchain_error(exc: BaseException) -> bool:
    """Whether a compile failed for want of a working C++ compiler (not for anything in the cache). Only called
    after a compile, so Inductor's exception type is already imported."""
    if not check_compiler().ok:
        return False
    invalid = __getattr__("InvalidCxxCompiler")
    return any(isinstance(e, invalid) for e in inner_errors(exc))


def set_graph_backend_id(graph_module: torch.fx.GraphModule, backend_id: str) -> None:
    """Tag a captured graph with its Dynamo backend id, as torch.compile's backend call does before Inductor runs
    (Inductor's AOT bundle reads it back)."""
    graph_module._backend_id = backend_id  # type: ignore[assignment]


def aot_compiled_function(artifacts: Any, extra_globals: dict[str, Any]) -> Any:
    """An AOTCompiledFunction over `artifacts` (CompileArtifacts), its bytecode run with `extra_globals`."""
    return __getattr__("AOTCompiledFunction")(_artifacts=artifacts, _extra_globals=extra_globals)


def aot_guard_manager(fn: Any) -> Any:
    """The guard manager of an AOTCompiledFunction (its `check_verbose` names a failing guard)."""
    return fn._artifacts.guard_manager


def __getattr__(name: str) -> Any:
    """A private torch name, resolved on first use once its tier's check passed (see the module docstring)."""
    if name in _RUNTIME:
        require_runtime()
        value = _resolve(_RUNTIME[name])
    elif name in _COMPILER:
        require_compiler()
        value = _resolve(_COMPILER[name])
    elif name in _DIRECT:
        value = _resolve(_DIRECT[name])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain module attribute
    return value
