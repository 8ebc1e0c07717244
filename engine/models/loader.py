"""Read a Hugging Face safetensors checkpoint by mmap and place it into a model built on the meta device.

The model never holds random init weights, and weights already in the target dtype are used straight from the
mmap (zero copy), so no second full copy of the weights is ever made.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from glowplug.engine.parallel import SINGLE, TPShard, shard_checkpoint
from glowplug.kernels.gguf import GGUFRows

from .arch import ModelArch, ModelError
from .gguf_auto import EMBEDDING, LayerFormats
from .llama import FUSED_MODULES, DecoderLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tensors some exporters write that the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class CheckpointData:
    state_dict: dict[str, torch.Tensor]
    files: list[Path]
    bytes_read: int


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelError(f"{index}: not a valid safetensors index ({exc}); re-export the model") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}; copy them in")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise ModelError(
        f"{model_dir}: no *.safetensors weights found. Save the model with save_pretrained(safe_serialization=True)."
    )


def read_checkpoint(model_dir: Path) -> CheckpointData:
    """mmap every shard; raises ModelError naming the file when one is truncated or corrupt."""
    sd: dict[str, torch.Tensor] = {}
    files = checkpoint_files(model_dir)
    total = 0
    for f in files:
        try:
            part = load_file(str(f), device="cpu")
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelError(
                f"{f}: cannot read safetensors file ({exc}). The file is truncated or corrupt: "
                f"re-download or re-export it."
            ) from exc
        sd.update(part)
        total += os.path.getsize(f)
    return CheckpointData(state_dict=sd, files=files, bytes_read=total)


def resolve_dtype(
    name: str, arch: ModelArch, device: str, *, quantized_source: bool = False, compiled: bool = True
) -> torch.dtype:
    """`--dtype auto` follows the checkpoint's dtype, as vLLM does (a float32 checkpoint runs in float32; bfloat16 and
    float16 ones run in bfloat16 on a CPU), except on a CPU where float32 is the faster choice (the rule and its
    measurement: config_check.resolve_dtype_name). A block-quantized source (a Q4/Q8 GGUF) has no float dtype of its
    own; it counts as bfloat16, the dtype such models are trained and published in."""
    from glowplug.engine.config_check import resolve_dtype_name

    # One rule for both: the CLI's settings check resolves the same name before torch is imported.
    return DTYPES[resolve_dtype_name(name, arch, device, quantized_source=quantized_source, compiled=compiled)]


def build_meta_model(arch: ModelArch, shard: TPShard = SINGLE) -> DecoderLM:
    with torch.device("meta"):
        return DecoderLM(arch, shard)


def check_state_dict(
    model: DecoderLM,
    sd: dict[str, torch.Tensor],
    where: Path,
    logical: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Match checkpoint tensors (Hugging Face names) to the model by name and shape; return only those it takes.

    logical: each weight's shape before packing, for a state dict whose layers are already quantized
    (`<layer>.qweight`, ... in place of `<layer>.weight`, from a GGUF); the packed tensors of the layers the
    model takes are returned with the rest."""
    expected = model.checkpoint_shapes()
    if logical is not None:
        checked = check_state_dict(model, {k: torch.empty(v, device="meta") for k, v in logical.items()}, where)
        modules = {k.rsplit(".", 1)[0] for k in checked}
        return {
            k: v
            for k, v in sd.items()
            if k in checked or (k.rsplit(".", 1)[0] in modules and not k.endswith((".weight", ".bias")))
        }
    tied = model.arch.tie_word_embeddings
    missing = [k for k in expected if k not in sd]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelError(
            f"{where}: checkpoint is missing tensor {missing[0]!r}{more}: "
            f"{', '.join(missing[:5])}. The checkpoint does not match config.json; re-export it or fix config.json."
        )
    for name, shape in expected.items():
        actual = tuple(sd[name].shape)
        if actual != shape:
            raise ModelError(
                f"{where}: tensor {name!r} has shape {list(actual)}, expected {list(shape)} from config.json. "
                f"The checkpoint and config.json disagree; use the config.json that came with these weights."
            )
    extra = [k for k in sd if k not in expected and not k.endswith(_IGNORED_SUFFIXES)]
    if tied:
        extra = [k for k in extra if k != "lm_head.weight"]
    if extra:
        raise ModelError(
            f"{where}: checkpoint has tensor {extra[0]!r} that this {type(model).__name__} does not use "
            f"({len(extra)} in all); the checkpoint's architecture does not match config.json."
        )
    return {k: sd[k] for k in expected}


def _adjacent(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """The fused tensor without a copy when the parts already lie back to back in one buffer (the GGUF loader
    de-quantizes them so), else None."""
    first = tensors[0]
    if any(t.dtype != dtype or not t.is_contiguous() or t.shape[1:] != first.shape[1:] for t in tensors):
        return None
    if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(int(t.shape[0]) for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))  # type: ignore[call-overload]


def fuse_checkpoint(sd: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint names -> model names: q/k/v rows concatenated into qkv_proj, gate/up into gate_up_proj (weights and
    biases). Floating tensors are cast to `dtype` on the way (the fused ones in the same pass as the copy); tensors
    that need neither stay the checkpoint's own (mmap'd, no copy)."""
    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    for name in sd:
        for fused, parts in FUSED_MODULES.items():
            head = "." + parts[0] + "."
            if head not in name:
                continue
            base, leaf = name.split(head)
            keys = [f"{base}.{p}.{leaf}" for p in parts]
            tensors = [sd[k] for k in keys]
            target = dtype if dtype is not None and tensors[0].is_floating_point() else tensors[0].dtype
            rows = sum(int(t.shape[0]) for t in tensors)
            adjacent = _adjacent(tensors, target)
            if adjacent is not None:
                out[f"{base}.{fused}.{leaf}"] = adjacent
                consumed.update(keys)
                continue
            joined = torch.empty((rows, *tensors[0].shape[1:]), dtype=target, device=tensors[0].device)
            start = 0
            for t in tensors:
                joined[start : start + t.shape[0]].copy_(t)
                start += int(t.shape[0])
            out[f"{base}.{fused}.{leaf}"] = joined
            consumed.update(keys)
    for name, t in sd.items():
        if name in consumed:
            continue
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t
    return out


def install_stored(model: DecoderLM, formats: LayerFormats, stored: dict[str, GGUFRows], dtype: torch.dtype) -> int:
    """Replace the model's layers that run in place (`formats.in_place()`) by GGUFLinear layers over their stored
    rows, and its embedding by a GGUFEmbedding when the plan looks it up in place; their biases stay on the meta
    device for `materialize`. Returns the stored bytes the model now reads from the file."""
    from glowplug.kernels.gguf import GGUFEmbedding, GGUFLinear

    used: dict[str, GGUFRows] = {}
    for module, fmt in formats.in_place().items():
        old = model.get_submodule(module)
        # A tied head is no linear layer: its input is the hidden state.
        in_features = int(getattr(old, "in_features", model.arch.hidden_size))
        parts = [stored[p] for p in fmt.parts]
        bias = getattr(old, "bias", None) is not None
        model.set_submodule(module, GGUFLinear(in_features, parts, bias=bias))
        used.update({p: stored[p] for p in fmt.parts})
    if formats.embedding_in_place:
        model.model.embed_tokens = GGUFEmbedding(stored[EMBEDDING], model.arch.hidden_size, dtype)  # type: ignore[assignment]
        used[EMBEDDING] = stored[EMBEDDING]  # a tied head in place reads the same rows: counted once
    return sum(r.nbytes for r in used.values())


def materialize(
    model: torch.nn.Module,
    sd: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str,
    where: Path,
    keep_dtype: frozenset[str] = frozenset(),
) -> None:
    """Assign tensors (model names, see fuse_checkpoint) into the meta model; casts only the floating tensors not
    already in `dtype` (except `keep_dtype`: quantized layers' scales keep the precision their kernels expect)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in sd]
    if missing:
        raise ModelError(f"{where}: no tensor for {missing[0]!r} ({len(missing)} missing) after loading; re-export it")
    wanted = {k: sd[k] for k in expected}
    for k, t in wanted.items():
        if tuple(t.shape) != expected[k]:
            raise ModelError(f"{where}: tensor {k!r} has shape {list(t.shape)}, expected {list(expected[k])}")
        if t.is_floating_point() and t.dtype != dtype and k not in keep_dtype:
            wanted[k] = t.to(dtype)
        if str(wanted[k].device) != device:
            wanted[k] = wanted[k].to(device)
    model.load_state_dict(wanted, strict=True, assign=True)
    model.eval().requires_grad_(False)


def load_model(
    model_dir: Path,
    arch: ModelArch,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    shard: TPShard = SINGLE,
) -> tuple[DecoderLM, CheckpointData]:
    """The model in `dtype` on `device`; under tensor parallelism (`shard`) this rank's slice of it."""
    from .store import gguf_file_for, gguf_table

    model = build_meta_model(arch, shard)
    table, source = gguf_table(model_dir), gguf_file_for(model_dir)
    if table is not None and source is not None:
        from .gguf_tensors import load_gguf_weights

        w = load_gguf_weights(source, table, arch, dtype)
        ckpt = CheckpointData(state_dict=w.state_dict, files=[source], bytes_read=w.bytes_read)
    else:
        ckpt = read_checkpoint(model_dir)
    checked = check_state_dict(build_meta_model(arch) if shard.active else model, ckpt.state_dict, model_dir)
    sd = fuse_checkpoint(shard_checkpoint(checked, arch, shard), dtype)
    materialize(model, sd, dtype, device, model_dir)
    model.model.build_rope(max_positions, device)
    return model, ckpt
