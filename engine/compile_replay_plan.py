"""Making a replay plan from the compiled decode step and proving it (engine/compile_replay.py says what a plan is
and how a warm start runs it), and the fingerprint step a warm start checks a loaded plan with.

Apart from the replay so that a warm start, which loads a plan, does not carry the recording and proving a cold
compile does.
"""

from __future__ import annotations

import hashlib
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from glowplug.base.torch_compat import (
    COMPILED_FN_GLOBAL_PREFIX,
    COMPILED_GRAPH_CLASS,
    WRAPPER_HEAVY_IMPORT,
    WRAPPER_IMPORT,
    WRAPPER_KERNEL_DEF,
    WRAPPER_POOL_CLASS,
    WRAPPER_POOL_USE,
)

from .attention import CONTEXT, DECODE_COLS, POSITION, SLOT, TOKEN
from .compile_replay import CACHE_FIELDS, ReplayDecode, ReplayPlan, ReplayUnavailable, tensor_meta
from .kv_cache import KVCache, LayerKV
from .model_runner import dummy_decode_batch

# The recorded steps (batch, table width, cache blocks). Every size the plan maps by value differs between them
# (3 vs 5 rows, packed widths 10 vs 11, 13 vs 17 blocks) and from the other sizes of the same step, and none equals a
# fixed dimension of any model glowplug loads (block size 16+, head_dim 64+; 4 in the tests is none of them).
PROOF_STEPS = ((3, 6, 13), (5, 7, 17))
# The fingerprint step: sizes unlike both recorded steps' (4 rows, packed width 12, 7 blocks). Row i decodes token
# FINGERPRINT_TOKENS[i] at position 0 into block i, so no row reads a slot another row writes in the same step.
FINGERPRINT_TOKENS = (1, 2, 3, 4)
FINGERPRINT_WIDTH = 8
FINGERPRINT_BLOCKS = 7

ScratchCache = Callable[[int], KVCache]  # blocks -> a zeroed cache shaped like the real one


class DecodeStep(Protocol):
    """What a fingerprint is taken of: the compiled step (engine/compile.py) or its replay."""

    def unguarded(self, packed: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor: ...


def _find_graphs(step: Any) -> list[Any]:
    """Inductor's compiled graph (a CompiledFxGraph: its `source_code` and `current_callable`) behind the
    AOT-compiled step, found through the wrappers torch puts around it. (The wrappers are functions that copy the
    graph's attributes, so the class name is what tells them apart.) The bundled cache entry holds a second one;
    which of them runs is found by calling the step."""
    fn = step.fn.fn
    roots = [v for k, v in fn.__globals__.items() if k.startswith(COMPILED_FN_GLOBAL_PREFIX)]
    seen: set[int] = set()
    found: list[Any] = []
    frontier = roots
    for _ in range(8):
        nxt: list[Any] = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if type(obj).__name__ == COMPILED_GRAPH_CLASS and isinstance(getattr(obj, "source_code", None), str):
                found.append(obj)
                continue
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    nxt.append(cell.cell_contents)
                except ValueError:
                    pass
            if hasattr(obj, "__dict__") and not isinstance(obj, (type, ModuleType, torch.Tensor)):
                nxt.extend(v for v in vars(obj).values() if callable(v) or hasattr(v, "__dict__"))
        frontier = nxt
    if not found:
        raise ReplayUnavailable("found no Inductor graph behind the compiled step")
    return found


def _rewrite(source: str, live: ModuleType, inductor_dir: Path) -> tuple[str, dict[str, list[str]]]:
    kernels: dict[str, list[str]] = {}

    def kernel(m: re.Match[str]) -> str:
        name = m.group(1)
        lib = getattr(getattr(live, name, None), "__self__", None)
        path = Path(getattr(lib, "__file__", "") or "")
        if not isinstance(lib, ModuleType) or not path.is_relative_to(inductor_dir):
            raise ReplayUnavailable(f"kernel {name} is not a library in the Inductor folder")
        kernels[name] = [lib.__name__, str(path.relative_to(inductor_dir))]
        return f"{name} = __glowplug_kernel__({name!r})"

    def deferred(m: re.Match[str]) -> str:
        module, name, alias = m.group(1), m.group(2), m.group(3) or m.group(2)
        if name == WRAPPER_POOL_CLASS:
            return f"{alias} = __glowplug_pool__"
        return f"{alias} = __glowplug_deferred__({module!r}, {name!r})"

    out = WRAPPER_IMPORT.sub(deferred, WRAPPER_KERNEL_DEF.sub(kernel, source))
    if WRAPPER_HEAVY_IMPORT.search(out):
        raise ReplayUnavailable("the wrapper imports Inductor or Dynamo in a form the replay does not defer")
    uses = set(WRAPPER_POOL_USE.findall(out)) - {"wait"}
    if uses:
        raise ReplayUnavailable(f"the wrapper defines kernels the replay cannot load ({', '.join(sorted(uses))})")
    return out, kernels


@dataclass
class _Recorded:
    """One step the compiled graph was called on: its inputs, the arguments Dynamo passed, and its logits."""

    packed: torch.Tensor
    caches: list[LayerKV]
    args: list[Any]
    logits: torch.Tensor


def _arg_sources(steps: list[_Recorded], model: torch.nn.Module) -> tuple[list[list[Any]], dict[str, list[Any]]]:
    """Where each argument Dynamo passed to the compiled graph came from, one answer that holds for every recorded
    step. Tensors are matched by identity. Integers are matched by value against the sizes that vary between steps
    (batch, packed width, cache blocks), or are a constant of the graph; the recorded steps give each varying size a
    value of its own (PROOF_STEPS), so a constant cannot pass for a size (it keeps its value while every size
    changes), and a size that equals another in one step is told apart by the other."""
    model_where: dict[int, list[Any]] = {}
    for path, module in model.named_modules():
        for attr, value in module.__dict__.items():
            items = value.items() if attr in ("_parameters", "_buffers") else [(attr, value)]
            for name, t in items:
                if isinstance(t, torch.Tensor):
                    model_where.setdefault(id(t), ["model", f"{path}:{name}"])
    candidates: list[list[list[list[Any]]]] = []  # step -> argument -> the sources that explain it
    for step in steps:
        where: dict[int, list[Any]] = {id(step.packed): ["packed"]}
        for layer, c in enumerate(step.caches):
            for field in CACHE_FIELDS:
                t = getattr(c, field)
                if t is not None:
                    where.setdefault(id(t), ["cache", layer, field])
        sizes = [
            (["packed_size", 0], step.packed.size(0)),
            (["packed_size", 1], step.packed.size(1)),
            (["cache_size", "k", 0], step.caches[0].k.size(0)),
        ]
        explained: list[list[list[Any]]] = []
        for a in step.args:
            if isinstance(a, torch.Tensor):
                src = where.get(id(a)) or model_where.get(id(a))
                if src is None:
                    raise ReplayUnavailable(
                        f"a graph input {list(a.shape)} {a.dtype} is none of the model's or step's tensors"
                    )
                explained.append([src])
            elif isinstance(a, int) and not isinstance(a, bool):
                explained.append([src for src, size in sizes if size == a] + [["const", a]])
            else:
                raise ReplayUnavailable(f"a graph input of type {type(a).__name__}")
        candidates.append(explained)
    if len({len(c) for c in candidates}) != 1:
        raise ReplayUnavailable("the compiled graph took a different number of arguments at another size")
    out: list[list[Any]] = []
    model_meta: dict[str, list[Any]] = {}
    for i, options in enumerate(zip(*candidates)):
        common = [src for src in options[0] if all(src in other for other in options[1:])]
        if len(common) != 1:
            seen = [step.args[i] if not isinstance(step.args[i], torch.Tensor) else "a tensor" for step in steps]
            raise ReplayUnavailable(
                f"graph argument {i} ({seen} over the recorded steps) is explained by {common or 'no single source'}"
            )
        src = common[0]
        if src[0] == "model":
            model_meta[src[1]] = tensor_meta(steps[0].args[i])
        out.append(src)
    return out, model_meta


def _fingerprint_input(scratch: ScratchCache) -> tuple[torch.Tensor, list[LayerKV]]:
    """The fingerprint step over a fresh zeroed cache: row i decodes FINGERPRINT_TOKENS[i] at position 0 into block
    i, and reads only the slot it has just written, so the logits depend on nothing but the model and the step."""
    cache = scratch(FINGERPRINT_BLOCKS)
    rows, bs = len(FINGERPRINT_TOKENS), cache.block_size
    packed = torch.zeros((rows, DECODE_COLS + FINGERPRINT_WIDTH), dtype=torch.int64, device=cache.device)
    for i, token in enumerate(FINGERPRINT_TOKENS):
        packed[i, TOKEN], packed[i, POSITION], packed[i, SLOT], packed[i, CONTEXT] = token, 0, i * bs, 1
        packed[i, DECODE_COLS:] = i
    return packed, cache.layers


def _logits_digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def take_fingerprint(step: DecodeStep, scratch: ScratchCache, weights: str) -> dict[str, Any]:
    """The fingerprint step's logits on `step`, as stored in the plan: their sha256 (the replay must reproduce them
    bit for bit, as it did when proven), their argmax per row (to say how they differ), and `weights`, the identity
    of the checkpoint the model was loaded from (the compile entry is shared by every checkpoint of one architecture,
    and another one's logits are not comparable)."""
    packed, caches = _fingerprint_input(scratch)
    with torch.inference_mode():
        logits = step.unguarded(packed, caches)
    return {
        "weights": weights,
        "sha256": _logits_digest(logits),
        "shape": list(logits.shape),
        "argmax": logits.argmax(-1).tolist(),
    }


@dataclass(frozen=True)
class FingerprintCheck:
    """ok: the step reproduced the fingerprint, or it could not be compared (`outcome` says which); else `outcome`
    says how it differs. seconds: the check's wall time, one 4-row step and a digest. Measured with the tiny test
    model on the shared 2-core box: under a millisecond once the process has run a step; as the process's first
    step it also pays the one-time thread-pool and first-call set-up that the first decode step would otherwise pay
    (8 ms on a quiet moment, up to 1.6 s under a load of 7 on the 2 cores)."""

    ok: bool
    outcome: str
    seconds: float


def check_fingerprint(
    step: DecodeStep, fingerprint: dict[str, Any], scratch: ScratchCache, weights: str
) -> FingerprintCheck:
    t0 = time.perf_counter()
    if fingerprint.get("weights") != weights:
        return FingerprintCheck(
            True,
            "not compared: recorded for another checkpoint of this architecture",
            round(time.perf_counter() - t0, 6),
        )
    got = take_fingerprint(step, scratch, weights)
    seconds = round(time.perf_counter() - t0, 6)
    if got["sha256"] == fingerprint["sha256"] and got["shape"] == fingerprint["shape"]:
        return FingerprintCheck(True, "matched", seconds)
    if got["shape"] != fingerprint["shape"]:
        return FingerprintCheck(False, f"logits {got['shape']}, recorded {fingerprint['shape']}", seconds)
    return FingerprintCheck(
        False, f"logits differ (argmax per row {got['argmax']}, recorded {fingerprint['argmax']})", seconds
    )


def make_plan(step: Any, model: torch.nn.Module, scratch: ScratchCache, inductor_dir: Path, weights: str) -> ReplayPlan:
    """Record the compiled step's graph arguments over PROOF_STEPS, build the plan, and prove it: the replay must
    rebuild the arguments Dynamo passed and produce bit-identical logits at each recorded step, and at the held-out
    fingerprint step, whose logits become the plan's fingerprint. `scratch(blocks)` gives a fresh zeroed cache shaped
    like the real one; `weights` identifies the model's checkpoint (see take_fingerprint)."""
    graphs = _find_graphs(step)
    originals = [g.current_callable for g in graphs]
    seen: dict[str, Any] = {}

    def spy(graph: Any, original: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        def record(args: list[Any]) -> Any:
            seen["graph"], seen["args"] = graph, list(args)
            seen["out"] = original(args)
            return seen["out"]

        return record

    steps: list[_Recorded] = []
    for g, original in zip(graphs, originals):
        g.current_callable = spy(g, original)
    try:
        with torch.inference_mode():
            for batch, width, blocks in PROOF_STEPS:
                cache = scratch(blocks)
                packed = dummy_decode_batch(batch, blocks - 1, cache.block_size, cache.device, width=width)
                logits = step.unguarded(packed, cache.layers)
                if not (isinstance(seen.get("out"), (tuple, list)) and seen["out"][0] is logits):
                    raise ReplayUnavailable("the compiled step's output is not the graph's first output")
                steps.append(_Recorded(packed, cache.layers, seen.pop("args"), logits.clone()))
    finally:
        for g, original in zip(graphs, originals):
            g.current_callable = original
    graph = seen["graph"]
    live = sys.modules.get(getattr(originals[graphs.index(graph)], "__module__", "") or "")
    if live is None:
        raise ReplayUnavailable("the compiled graph's wrapper module is not loaded")
    sources, model_meta = _arg_sources(steps, model)
    source, kernels = _rewrite(graph.source_code, live, inductor_dir)
    caches = steps[0].caches
    cache_meta = {
        f: None if getattr(caches[0], f) is None else tensor_meta(getattr(caches[0], f), skip_first=True)
        for f in CACHE_FIELDS
    }
    fingerprint = take_fingerprint(step, scratch, weights)
    plan = ReplayPlan(source, kernels, sources, model_meta, cache_meta, len(caches), torch.__version__, fingerprint)
    replay = ReplayDecode.load(plan, inductor_dir, model)
    with torch.inference_mode():
        for rec in steps:
            rebuilt = replay.arguments(rec.packed, rec.caches)
            same = len(rebuilt) == len(rec.args) and all(
                (r is a) if isinstance(a, torch.Tensor) else (r == a) for r, a in zip(rebuilt, rec.args)
            )
            if not same:
                raise ReplayUnavailable("the plan does not rebuild the arguments Dynamo passed")
            rejects = replay.guard_failure(rec.packed, rec.caches)
            if rejects:
                raise ReplayUnavailable(f"the plan rejects its own inputs: {rejects}")
            if not torch.equal(replay.unguarded(rec.packed, rec.caches), rec.logits):
                raise ReplayUnavailable("the replayed step's logits differ from the compiled step's")
    held_out = check_fingerprint(replay, fingerprint, scratch, weights)
    if not held_out.ok or held_out.outcome != "matched":
        raise ReplayUnavailable(
            f"the replayed step does not reproduce the compiled step's fingerprint: {held_out.outcome}"
        )
    return plan
