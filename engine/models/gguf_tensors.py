"""GGUF weights straight from the file: a tensor table, block unpacking, and repacking into the int4/int8 layouts.

The table (name, type, shape, byte offset) is read once with `gguf.GGUFReader` when the model is prepared and kept
in the model cache entry: the reader parses every metadata field (49k tokens for SmolLM2, ~2 s here), which a warm
start does not need. A warm start maps the file and slices each tensor's bytes by offset.

Types read: the floats F32, F16, BF16; the legacy blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 weights, fp16 d);
the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-weight super-blocks) - what llama.cpp's llama-quantize writes for
its common presets. Anything else (the IQ families, TQ, MXFP4, ...) is refused when the model is prepared, naming
the tensor, its type and this list.

How each reaches the model:
- repacked exactly, when the run quantizes to that layout with groups of 32 (the codes and their grid are the
  file's own; nothing is de-quantized or re-rounded):
  - Q4_0 (d, 16 nibble bytes; w = d * (q - 8)) and Q4_1 (d, m, nibbles; w = d * q + m) -> int4 g32: the nibble
    byte j holds weight j (low) and weight j + 16 (high), exactly the planar group-32 packing of
    kernels/formats.py, so the bytes are taken as they are, with scale d and zero m + 8d (the formats'
    w = (q - 8) * scale + zero);
  - Q4_K -> int4 g32: each 32-weight sub-block has 6-bit scale sc and min m times the super-block's d and dmin
    (w = d*sc * q - dmin*m), so it is an int4 group with scale d*sc and zero 8*d*sc - dmin*m; only the nibbles
    move (Q4_K puts sub-blocks 2c and 2c+1 in the low and high nibbles of the same 32 bytes);
  - Q8_0 (d, 32 int8; w = d * q) -> int8 g32 with scale d, and Q5_0 (d, 32 high bits, nibbles;
    w = d * (q - 16)) -> int8 g32 with scale d and codes q - 16 (in [-16, 15]);
- de-quantized to the run dtype otherwise: Q4_0, Q4_1, Q5_0 and Q8_0 by the torch code below (the arithmetic
  of gguf.quants.dequantize, bit for bit, 3-4x faster than its numpy), every other type by
  gguf.quants.dequantize itself (vectorized numpy), a few rows at a time straight into the destination.
Under --quantization auto the layers to repack, and into which layout, are chosen per tensor by gguf_auto.py
(PackPlan.modules), and the ones it re-quantizes are loaded in fp32 (`load_gguf_weights`' fp32).
Q5_1, Q5_K, Q2_K, Q3_K and Q6_K have no exact glowplug layout: Q5_1/Q5_K carry an offset that int8 (symmetric)
cannot hold, Q2_K/Q3_K have no 2/3-bit layout on their 16-weight grid, and Q6_K's 16-weight scales are finer
than the smallest int8 group (32).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

# ggml's type ids and block shapes (base/ggml.py), so that a warm start does not import gguf.
from glowplug.base.ggml import (  # noqa: F401 - the type ids, also read as gguf_tensors.Q4_K etc.
    BF16,
    BLOCKS,
    F16,
    F32,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPE_NAMES,
)
from glowplug.kernels.gguf import GGUFRows

from .arch import ModelArch, ModelError
from .gguf_blocks import BLOCK, FLOAT_TYPES, TensorEntry, dequantize, raw_bytes, repack_int4, repack_int8

SUPPORTED = ", ".join(TYPE_NAMES.values())

# GGUF name -> Hugging Face name; "{i}" is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms each sublayer's input and output: llama.cpp's ffn_norm is the MLP's input norm there, which
# Hugging Face calls pre_feedforward_layernorm (post_attention_layernorm is the attention output's norm).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp writes that the model derives itself.
_IGNORED = ("rope_freqs.weight",)


class TensorTable(BaseModel):
    """`source`: where the GGUF was when it was prepared, a hint for tools (tests, benchmarks) only; the engine
    reads the file its model spec names."""

    model_config = ConfigDict(frozen=True)

    file_size: int
    tensors: tuple[TensorEntry, ...]
    source: str = ""


def hf_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor (for `model_type`'s layout), or None when the model does not take
    it."""
    if gguf_name in _IGNORED:
        return None
    stem, _, leaf = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        mapped = (_GEMMA3_LAYER_NAMES if model_type == "gemma3" else _LAYER_NAMES).get(part)
        return f"model.layers.{index}.{mapped}.{leaf}" if mapped else gguf_name
    mapped = _GLOBAL_NAMES.get(stem)
    return f"{mapped}.{leaf}" if mapped else gguf_name


def read_table(reader: Any, path: Path) -> TensorTable:
    """The tensor table of an open `gguf.GGUFReader`; an unsupported type is refused here, at prepare time."""
    entries = []
    for t in reader.tensors:
        kind = int(t.tensor_type)
        if kind not in TYPE_NAMES:
            raise ModelError(
                f"{path}: tensor {t.name!r} is stored as {getattr(t.tensor_type, 'name', f'type {kind}')}, which "
                f"glowplug does not read "
                f"(it reads {SUPPORTED}). Re-quantize the file with llama.cpp's llama-quantize to one of those "
                f"(Q4_K_M, Q5_K_M, Q8_0, ...), or pass a Hugging Face folder."
            )
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        entries.append(
            TensorEntry(name=t.name, type=kind, shape=shape, offset=int(t.data_offset), nbytes=int(t.n_bytes))
        )
    return TensorTable(file_size=path.stat().st_size, tensors=tuple(entries), source=str(path.resolve()))


def map_file(path: Path, table: TensorTable) -> torch.Tensor:
    """The file's bytes as a uint8 tensor backed by a private (copy-on-write) mapping: nothing is read yet."""
    size = path.stat().st_size
    if size != table.file_size:
        raise ModelError(
            f"{path}: the file is {size} bytes, the prepared table says {table.file_size}; "
            f"the GGUF changed after it was prepared: start again to re-prepare it"
        )
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))


def map_rows(path: Path, e: TensorEntry) -> torch.Tensor:
    """A tensor's stored rows as uint8 [rows, row bytes], mapped on its own (copy-on-write; nothing is read yet): the
    weight a layer run in place computes on. Its own mapping, so that no two graph inputs share a storage (torch.compile
    refuses inputs that alias each other)."""
    rows = 1
    for d in e.shape[:-1]:
        rows *= d
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=e.offset, shape=(rows, e.nbytes // rows)))


_NUMPY_FLOAT = {F32: np.float32, F16: np.float16, BF16: np.uint16}


def map_float(path: Path, e: TensorEntry) -> torch.Tensor:
    """A float tensor mapped on its own (zero copy, copy-on-write). Views of one mapping would all share a storage,
    and torch.compile refuses graph inputs that alias each other (two norm weights would)."""
    t = torch.from_numpy(np.memmap(path, dtype=_NUMPY_FLOAT[e.type], mode="c", offset=e.offset, shape=e.shape))
    return t.view(torch.bfloat16) if e.type == BF16 else t


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (it interleaves each head's two rotary halves)."""
    half = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, half, 2).transpose(1, 2).reshape(n_rows)


@dataclass(frozen=True)
class PackPlan:
    """Which layers to repack without de-quantizing: `scheme` int4 (from Q4_0/Q4_1/Q4_K) or int8 (from
    Q8_0/Q5_0), only when the layer's group size is 32 (the block, or Q4_K's sub-block).

    modules: under --quantization auto, the modules (Hugging Face names) to repack and each one's scheme, chosen
    per tensor by models/gguf_auto.py (which keeps a fused projection's parts together); `scheme` is then "auto"."""

    scheme: str
    group_size: int | None
    modules: Mapping[str, str] | None = None
    tied_head: str | None = None  # auto: repack the embedding's blocks into this scheme as the tied head too
    # auto, in place: the tensors (Hugging Face weight names) kept as stored rows (`GGUFWeights.stored`), not loaded
    stored: frozenset[str] = frozenset()


_PACKS = {"int4": (Q4_0, Q4_1, Q4_K), "int8": (Q8_0, Q5_0)}
_FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def _packable(entries: Mapping[str, TensorEntry], plan: PackPlan | None) -> set[str]:
    """HF module names to repack. Members of one fused projection (q/k/v, gate/up) go together or not at all."""
    if plan is not None and plan.modules is not None:
        return set(plan.modules)
    if plan is None or plan.scheme not in _PACKS:
        return set()
    from glowplug.kernels.formats import effective_group_size

    def fits(module: str) -> bool:
        e = entries.get(f"{module}.weight")
        return (
            e is not None
            and e.type in _PACKS[plan.scheme]
            and plan.group_size is not None
            and effective_group_size(e.shape[-1], plan.group_size) == BLOCK
        )

    layers = {n.rsplit(".", 3)[0] for n in entries if n.startswith("model.layers.")}
    out: set[str] = set()
    for layer in layers:
        for group in (*_FUSED_GROUPS, ("self_attn.o_proj",), ("mlp.down_proj",)):
            modules = [f"{layer}.{p}" for p in group]
            if all(fits(m) for m in modules):
                out.update(modules)
    return out


@dataclass
class GGUFWeights:
    state_dict: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]  # every HF weight's logical shape (packed ones included)
    packed: set[str]  # HF module names repacked into the quantized layout
    # A tied head repacked from the embedding's blocks (`lm_head.qweight`, ...): not a checkpoint tensor, so the
    # caller adds it after matching the checkpoint against the model.
    bytes_read: int
    tied_head: dict[str, torch.Tensor] = field(default_factory=dict)
    # Tensors kept as the file stores them (Hugging Face weight name -> its mapped rows), for the layers run in place.
    stored: dict[str, GGUFRows] = field(default_factory=dict)


def _fused_buffers(
    entries: Mapping[str, TensorEntry], packed: set[str], dtype: torch.dtype, fp32: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """One buffer per fused projection (q/k/v, gate/up) that is de-quantized, with each member's rows a slice of
    it, so fuse_checkpoint finds them adjacent and joins them without a second copy (in fp32 when its members are
    in `fp32`: the parts of one fused layer are loaded for the same use)."""
    out: dict[str, torch.Tensor] = {}
    layers = {n.rsplit(".", 3)[0] for n in entries if n.startswith("model.layers.")}
    for layer in layers:
        for group in _FUSED_GROUPS:
            names = [f"{layer}.{p}.weight" for p in group]
            parts = [entries.get(n) for n in names]
            if any(e is None or len(e.shape) != 2 for e in parts) or f"{layer}.{group[0]}" in packed:
                continue
            k = {e.shape[1] for e in parts if e is not None}
            if len(k) != 1:
                continue
            target = torch.float32 if names[0] in fp32 else dtype
            joined = torch.empty((sum(e.shape[0] for e in parts if e is not None), k.pop()), dtype=target)
            start = 0
            for n, e in zip(names, parts):
                assert e is not None
                out[n] = joined[start : start + e.shape[0]]
                start += e.shape[0]
    return out


def load_gguf_weights(
    path: Path,
    table: TensorTable,
    arch: ModelArch,
    dtype: torch.dtype | None,
    plan: PackPlan | None = None,
    fp32: frozenset[str] = frozenset(),
) -> GGUFWeights:
    """The state dict (HF names) of a GGUF: repacked per `plan`, floats in `dtype` (fp32 when None, the precision
    the quantizer starts from), q/k rows back in Hugging Face order.

    fp32: tensors (HF names) to load in fp32 whatever `dtype`: under --quantization auto, the ones a quantizer
    starts from, while the layers that stay float are loaded straight into the model dtype."""
    data = map_file(path, table)
    entries = {name: e for e in table.tensors if (name := hf_name(e.name, arch.model_type)) is not None}
    packed = _packable(entries, plan)
    schemes = (
        dict(plan.modules)
        if plan is not None and plan.modules is not None
        else {m: plan.scheme for m in packed if plan is not None}
    )
    target = dtype or torch.float32
    kept = {n.rpartition(".")[0] for n in plan.stored} if plan is not None else set()
    into = _fused_buffers(entries, packed | kept, target, fp32)
    # llama.cpp permutes q/k rows for its rotary kernel only for llama-family files (not qwen2/qwen3/gemma3).
    permute = arch.model_type in ("llama", "mistral")
    # llama.cpp's converter stores Gemma's norm weights with the 1 of x * (1 + w) added; the model (like
    # transformers' GGUF loader, which subtracts it too) takes w as Hugging Face checkpoints store it.
    norm_offset = 1.0 if arch.gemma_norms else 0.0
    sd: dict[str, torch.Tensor] = {}
    tied_head: dict[str, torch.Tensor] = {}
    stored: dict[str, GGUFRows] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    total = 0
    for name, e in entries.items():
        raw = raw_bytes(data, e)
        total += e.nbytes
        shapes[name] = e.shape
        module, _, leaf = name.rpartition(".")
        order = None
        if permute and module.endswith((".q_proj", ".k_proj")):
            heads = arch.num_attention_heads if module.endswith(".q_proj") else arch.num_key_value_heads
            order = unpermute_rows(e.shape[0], heads)
        if plan is not None and name in plan.stored:
            # The stored rows stay where they lie; llama.cpp's permuted q/k rows are put back in order by the
            # kernel, which writes stored row r to column perm[r] (the inverse of `order`).
            perm = None if order is None else torch.argsort(order).to(torch.int32)
            stored[name] = GGUFRows(map_rows(path, e), e.type, perm)
            continue
        if module in packed and leaf == "weight":  # a bias beside the blocks (Qwen2's q/k/v) stays a float
            parts = repack_int4(raw, e) if schemes[module] == "int4" else repack_int8(raw, e)
            for suffix, t in parts.items():
                sd[f"{module}.{suffix}"] = t[order] if order is not None else t
            continue
        if plan is not None and plan.tied_head is not None and name == "model.embed_tokens.weight":
            blocks = repack_int4(raw, e) if plan.tied_head == "int4" else repack_int8(raw, e)
            tied_head.update({f"lm_head.{suffix}": t for suffix, t in blocks.items()})
        wanted = torch.float32 if name in fp32 else target
        if norm_offset and name.endswith("norm.weight"):
            # Subtracted in fp32, as transformers does, before any rounding to the run dtype.
            sd[name] = (dequantize(raw, e, torch.float32) - norm_offset).to(wanted)
            continue
        if e.type in FLOAT_TYPES and order is None and name not in into:
            sd[name] = map_float(path, e).to(wanted)
            continue
        sd[name] = dequantize(raw, e, wanted, order, into.get(name))
    return GGUFWeights(
        state_dict=sd, shapes=shapes, packed=packed, bytes_read=total, tied_head=tied_head, stored=stored
    )
