"""Replaying the compiled decode step on a warm start without importing Dynamo or Inductor.

A warm start that loads torch's AOT artifact (engine/compile.py) pays for importing `torch._dynamo` and Inductor's
runtime modules, which was half of a warm start (reports/startup/startup.md as of commit 7ee52f2) and none of it the
decode step's own work. What actually runs on every step is small: Inductor's generated Python wrapper
(`call(args)`), which calls compiled C++ kernels (`.so` libraries in the Inductor folder) on a flat list of tensors
and sizes.

So a cold compile also writes a *replay plan* next to the AOT artifact:
- the wrapper's source, with its kernel definitions replaced by references to the compiled libraries (no C++ is
  recompiled or even hashed at load) and its Inductor imports deferred until first use (the CPU wrapper uses none);
- where each of `call`'s arguments comes from: a model tensor (by module path and attribute), the step's packed
  input, a cache tensor, or a size of one of those;
- each model tensor's dtype, shape and stride, checked when the plan is bound to a freshly loaded model.

The plan is only written after it has been proven on the compiled step itself: the arguments it rebuilds are the
very objects Dynamo passed, and the replayed step's logits equal the compiled step's bit for bit, over two recorded
steps that differ in every size the plan maps by value (batch, table width, cache blocks) and a third, held-out step
with other sizes again (the recording and proving: engine/compile_replay_plan.py). That third step is the plan's
fingerprint: its logits' digest, with the checkpoint they were computed from, is stored in the plan, and a warm
start replays it (one small step, milliseconds, its cost on the span) and compares before serving; a plan that no
longer computes what was compiled (say, a kernel library that is not the one it was proven with) is rejected with a
`cache_corrupt` event, and the start loads the AOT artifact instead (engine/stages/graph_compile.py). A plan that
cannot be made (a wrapper with kernels other than the CPU's C++ ones, as on CUDA, or a torch whose internals moved)
is not written, and the warm start loads the full AOT artifact as before. A plan that will not load (a kernel
library missing or damaged) falls back the same way, and says so. What the plan reads of Inductor's output (the
wrapper's layout, the compiled graph's attributes) is named in base/torch_compat.py with the engine's other uses
of torch internals.

Guards: the runner builds every input itself (engine/model_runner.py), and the plan checks what Dynamo's guards
would: the packed input's dtype, rank and layout, and each cache tensor's dtype, trailing shape and layout.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glowplug.base import torch_compat
from glowplug.base.torch_compat import (
    KERNEL_ENTRY,
    TENSOR_DATA_PTR_ENV,
)

from .attention import DECODE_COLS
from .kv_cache import LayerKV

PLAN_FILE = "decode.replay.json"
PLAN_VERSION = 2  # 2: the fingerprint
CACHE_FIELDS = ("k", "v", "k_scale", "v_scale")


class ReplayUnavailable(Exception):
    """Why no replay plan can be made or loaded; the warm start then uses the full AOT artifact."""


@dataclass(frozen=True)
class ReplayPlan:
    source: str  # the wrapper, kernels as references
    kernels: dict[str, list[str]]  # wrapper name -> [module name, library path relative to the Inductor folder]
    args: list[list[Any]]  # where each of call()'s arguments comes from (compile_replay_plan)
    model_meta: dict[str, list[Any]]  # "module:attr" -> [dtype, shape, stride]
    cache_meta: dict[str, list[Any] | None]  # field -> [dtype, shape without the block dim, stride] or None
    layers: int
    torch_version: str
    fingerprint: dict[str, Any]  # see compile_replay_plan.take_fingerprint

    def to_json(self) -> bytes:
        return json.dumps({"version": PLAN_VERSION, **self.__dict__}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ReplayPlan:
        raw = json.loads(data)
        if raw.pop("version", None) != PLAN_VERSION:
            raise ReplayUnavailable(f"replay plan version is not {PLAN_VERSION}")
        plan = cls(**raw)
        if plan.torch_version != torch.__version__:
            raise ReplayUnavailable(f"replay plan made by torch {plan.torch_version}, running {torch.__version__}")
        return plan


# ------------------------------------------------------------------ loading and running a plan


class _Deferred:
    """An Inductor import of the wrapper, imported on first use (the CPU decode wrapper never uses them)."""

    def __init__(self, module: str, name: str) -> None:
        self._where = (module, name)

    def _resolve(self) -> Any:
        return getattr(importlib.import_module(self._where[0]), self._where[1])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resolve(), name)


class _InertPool:
    """Stands in for Inductor's AsyncCompile: the kernels are already compiled, so there is nothing to wait for."""

    def wait(self, scope: dict[str, Any]) -> None:
        return None


def _truncation(path: Path) -> str | None:
    """Why a kernel library is cut short, or None. dlopen maps a library's segments without checking that the file
    holds them, and touching a page past the end of the file kills the process (SIGBUS): so every loadable segment
    is checked against the file's size first (ELF64 little-endian, what Inductor builds on the CPU)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":
            return f"{path.name} is not a 64-bit little-endian ELF library ({size} bytes)"
        phoff, phentsize, phnum = struct.unpack_from("<Q", head, 32)[0], *struct.unpack_from("<HH", head, 54)
        if phoff + phentsize * phnum > size:
            return f"{path.name} is cut short ({size} bytes) before its program headers"
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if kind == 1 and offset + filesz > size:  # PT_LOAD
            return f"{path.name} is cut short ({size} bytes) inside a segment ending at byte {offset + filesz}"
    return None


def _load_kernel(module_name: str, path: Path) -> Callable[..., Any]:
    """A compiled kernel library, loaded the way Inductor loads it (same module name, so a process that later loads
    Inductor's module shares it)."""
    module = sys.modules.get(module_name)
    if module is None:
        if not path.is_file():
            raise ReplayUnavailable(f"compiled kernel library {path} is missing")
        damage = _truncation(path)
        if damage is not None:
            raise ReplayUnavailable(f"compiled kernel library damaged: {damage}")
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ReplayUnavailable(f"compiled kernel library {path} cannot be loaded")
        try:  # an extension module is dlopened by module_from_spec, and initialised by exec_module
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError) as exc:
            raise ReplayUnavailable(f"compiled kernel library {path} would not load: {exc}") from exc
        sys.modules[module_name] = module
    return getattr(module, KERNEL_ENTRY)  # type: ignore[no-any-return]


def _exec_wrapper(plan: ReplayPlan, inductor_dir: Path) -> Callable[[list[Any]], Any]:
    def kernel(name: str) -> Callable[..., Any]:
        module_name, rel = plan.kernels[name]
        return _load_kernel(module_name, inductor_dir / rel)

    # The libraries find torch's tensor-pointer helper through this variable (Inductor sets it the same way).
    os.environ[TENSOR_DATA_PTR_ENV] = str(torch_compat.tensor_data_ptr_address)

    scope: dict[str, Any] = {
        "__name__": "glowplug_decode_replay",
        "__glowplug_kernel__": kernel,
        "__glowplug_deferred__": _Deferred,
        "__glowplug_pool__": _InertPool,
    }
    exec(compile(plan.source, "<glowplug decode replay>", "exec"), scope)  # noqa: S102 - our own cached wrapper
    return scope["call"]  # type: ignore[no-any-return]


def tensor_meta(t: torch.Tensor, skip_first: bool = False) -> list[Any]:
    shape, stride = list(t.shape), list(t.stride())
    return [
        str(t.dtype).removeprefix("torch."),
        shape[1:] if skip_first else shape,
        stride[1:] if skip_first else stride,
    ]


def _model_tensor(model: torch.nn.Module, where: str) -> torch.Tensor:
    path, attr = where.rsplit(":", 1)
    value = getattr(model.get_submodule(path) if path else model, attr)
    if not isinstance(value, torch.Tensor):
        raise ReplayUnavailable(f"model attribute {where} is not a tensor")
    return value


class ReplayDecode:
    """The decode step as the plan replays it; the same interface as CompiledDecode (engine/compile.py)."""

    def __init__(self, plan: ReplayPlan, call: Callable[[list[Any]], Any], model: torch.nn.Module) -> None:
        self.plan = plan
        self.call = call
        self.model = model
        self.statics: dict[int, torch.Tensor] = {}
        for i, src in enumerate(plan.args):
            if src[0] == "model":
                t = _model_tensor(model, src[1])
                if tensor_meta(t) != plan.model_meta[src[1]]:
                    raise ReplayUnavailable(
                        f"model tensor {src[1]} is {tensor_meta(t)}, the plan was made for {plan.model_meta[src[1]]}"
                    )
                self.statics[i] = t

    @classmethod
    def load(cls, plan: ReplayPlan, inductor_dir: Path, model: torch.nn.Module) -> ReplayDecode:
        return cls(plan, _exec_wrapper(plan, inductor_dir), model)

    def guard_failure(self, packed: torch.Tensor, caches: list[LayerKV]) -> str:
        """Why these inputs differ from what the step was compiled for, or "" when they match."""
        if packed.dtype != torch.int64 or packed.dim() != 2 or packed.size(1) <= DECODE_COLS:
            return f"packed input is {packed.dtype} {list(packed.shape)}, expected int64 [B, >{DECODE_COLS}]"
        if not packed.is_contiguous() or packed.device.type != "cpu":
            return "packed input must be a contiguous CPU tensor"
        if len(caches) != self.plan.layers:
            return f"{len(caches)} cache layers, the step was compiled for {self.plan.layers}"
        for layer, c in enumerate(caches):
            for field in CACHE_FIELDS:
                t, want = getattr(c, field), self.plan.cache_meta[field]
                got = None if t is None else tensor_meta(t, skip_first=True)
                if got != want or (t is not None and not t.is_contiguous()):
                    return f"cache layer {layer} {field} is {got}, the step was compiled for {want} (contiguous)"
        return ""

    def guards_pass(self, packed: torch.Tensor, caches: list[LayerKV]) -> bool:
        return not self.guard_failure(packed, caches)

    def __call__(self, packed: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor:
        why = self.guard_failure(packed, caches)
        if why:
            raise RuntimeError(f"the compiled decode step rejects these inputs: {why}")
        return self.unguarded(packed, caches)

    def arguments(self, packed: torch.Tensor, caches: list[LayerKV]) -> list[Any]:
        """call()'s argument list for one step."""
        return [self._arg(i, src, packed, caches) for i, src in enumerate(self.plan.args)]

    def _arg(self, i: int, src: list[Any], packed: torch.Tensor, caches: list[LayerKV]) -> Any:
        kind = src[0]
        if kind == "model":
            return self.statics[i]
        if kind == "packed":
            return packed
        if kind == "cache":
            return getattr(caches[src[1]], src[2])
        if kind == "packed_size":
            return packed.size(src[1])
        if kind == "cache_size":
            return getattr(caches[0], src[1]).size(src[2])
        if kind == "const":
            return src[1]
        raise ReplayUnavailable(f"unknown argument source {src}")

    def unguarded(self, packed: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor:
        return self.call(self.arguments(packed, caches))[0]  # type: ignore[no-any-return]

    def serving(self, caches: list[LayerKV]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The step bound to the real cache: everything but the packed input and its two sizes is fixed, so a step
        copies one prepared list and fills three slots."""
        dummy = torch.zeros((1, DECODE_COLS + 1), dtype=torch.int64)
        template = self.arguments(dummy, caches)
        packed_at, rows_at, cols_at = (
            [i for i, s in enumerate(self.plan.args) if s == want]
            for want in (["packed"], ["packed_size", 0], ["packed_size", 1])
        )
        call = self.call

        def step(packed: torch.Tensor) -> torch.Tensor:
            args = template.copy()
            rows, cols = packed.shape
            for i in packed_at:
                args[i] = packed
            for i in rows_at:
                args[i] = rows
            for i in cols_at:
                args[i] = cols
            return call(args)[0]  # type: ignore[no-any-return]

        return step
