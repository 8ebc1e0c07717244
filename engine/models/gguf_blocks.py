"""A GGUF tensor's bytes as weights: the table entry that locates them, their block layout, de-quantizing to a
float dtype, and repacking the blocks that have an exact glowplug layout (int4/int8 with groups of 32).

How each type reaches the model (engine/models/gguf_tensors.py says which types are read at all):
- repacked exactly, when the run quantizes to that layout with groups of 32 (the codes and their grid are the
  file's own; nothing is de-quantized or re-rounded): Q4_0/Q4_1/Q4_K -> int4 g32, Q8_0/Q5_0 -> int8 g32 (the
  arithmetic of each is at its function below);
- de-quantized to the run dtype otherwise: Q4_0, Q4_1, Q5_0 and Q8_0 by the torch code below (the arithmetic of
  gguf.quants.dequantize, bit for bit, and faster than its numpy), every other type by gguf.quants.dequantize
  itself (vectorized numpy), a few rows at a time straight into the destination.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from glowplug.base.ggml import BF16, BLOCKS, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, TYPE_NAMES

from .arch import ModelError

FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
_BLOCK_SHAPE = {t: shape for t, shape in BLOCKS.items() if t not in FLOAT_TYPES}
# Where the 4-bit codes start in a Q4_0/Q4_1 block.
_CODES_AT = {Q4_0: 2, Q4_1: 4}
# Types de-quantized by the torch code here; the other block types go through gguf.quants.dequantize.
_TORCH_DEQUANT = (Q4_0, Q4_1, Q5_0, Q8_0)
BLOCK = 32


class TensorEntry(BaseModel):
    """One tensor of the file: `shape` in torch order ([N, K] for a weight), `offset` absolute in the file."""

    model_config = ConfigDict(frozen=True)

    name: str
    type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def raw_bytes(data: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    return data[e.offset : e.offset + e.nbytes]


def _blocks(raw: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """[rows, K // block, block bytes] view of a block-quantized tensor."""
    k = e.shape[-1]
    weights, nbytes = _BLOCK_SHAPE[e.type]
    if k % weights:
        raise ModelError(
            f"tensor {e.name!r}: row length {k} is not a multiple of the {weights}-weight {TYPE_NAMES[e.type]} block"
        )
    rows = e.nbytes // (k // weights * nbytes)
    return raw.view(rows, k // weights, nbytes)


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, as fp32 [rows, G]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Codes [rows, G, 32] of a 4-bit block: byte j's low nibble is weight j, its high nibble weight j + 16."""
    qs = blocks[..., at : at + 16]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q5_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Signed codes [rows, G, 32] (in [-16, 15]) of Q5_0 blocks: bytes 2-5 are a little-endian uint32 whose bit j
    is weight j's fifth bit, bytes 6-21 the low nibbles as Q4_0 lays them out."""
    high = blocks[..., 2:6].contiguous().view(torch.int32)
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
    return (_nibbles(blocks, 6).to(torch.int32) | (bits << 4)) - 16


# Rows per de-quantization step: ~128k weights, so the fp32 intermediates of one step stay in L2 instead of
# streaming each of the ~6 passes over the whole tensor through memory (3-4x faster on SmolLM2's 135M weights).
_CHUNK_WEIGHTS = 1 << 17


def _dequantize_blocks(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """fp32 weights [rows, K] of a block-quantized row range. Q4_0/Q4_1/Q5_0/Q8_0 in torch (the arithmetic of
    gguf.quants.dequantize, 3-4x faster than its numpy on these simple blocks); the rest by gguf itself."""
    rows = blocks.shape[0]
    if kind not in _TORCH_DEQUANT:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        # gguf takes [rows, row bytes] and returns [rows, K]; the torch tensor shares the numpy array's memory.
        return torch.from_numpy(gguf_dequantize(blocks.reshape(rows, -1).numpy(), GGMLQuantizationType(kind)))
    d = _fp16(blocks, 0)[..., None]
    if kind == Q8_0:
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    elif kind == Q4_0:
        w = (_nibbles(blocks, 2).float() - 8.0) * d
    elif kind == Q5_0:
        w = _q5_0_codes(blocks).float() * d
    else:
        w = _nibbles(blocks, 4).float() * d + _fp16(blocks, 2)[..., None]
    return w.reshape(rows, -1)


def dequantize(
    raw: torch.Tensor,
    e: TensorEntry,
    dtype: torch.dtype = torch.float32,
    order: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A tensor's weights in `dtype` (computed in fp32, as gguf.quants.dequantize does, then rounded once).

    order: a row order to apply (un-permuting q/k), taken on the packed bytes, before expanding them.
    out: where to write (a slice of a fused projection), so the weights are written once."""
    if e.type in FLOAT_TYPES:
        t = raw.view(FLOAT_TYPES[e.type]).view(e.shape)
        t = t[order] if order is not None else t
        return out.copy_(t) if out is not None else t.to(dtype)
    blocks = _blocks(raw, e)
    if order is not None:
        blocks = blocks[order]
    rows = blocks.shape[0]
    out = torch.empty((rows, e.shape[-1]), dtype=dtype) if out is None else out
    step = max(1, _CHUNK_WEIGHTS // e.shape[-1])
    for r in range(0, rows, step):
        out[r : r + step].copy_(_dequantize_blocks(blocks[r : r + step], e.type))
    return out.view(e.shape)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of Q4_K/Q5_K super-blocks from their 12 packed bytes [..., 12], as
    uint8 [..., 8] each (ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, 4-7 split
    over bytes 8-11's nibbles and the top 2 bits of bytes 0-7)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _repack_q4_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q4_K super-blocks [rows, S, 144] (d, dmin, 12 scale bytes, 128 nibble bytes) -> int4 g32, codes unchanged.

    Per 64 weights Q4_K stores 32 bytes whose low nibbles are sub-block 2c and high nibbles sub-block 2c + 1; the
    planar g32 layout wants byte j of a group to hold its weights j and j + 16, so the nibbles are regrouped."""
    rows, supers = blocks.shape[0], blocks.shape[1]
    d, dmin = _fp16(blocks, 0)[..., None], _fp16(blocks, 2)[..., None]
    sc, mn = _k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(rows, supers, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, supers * 8, 32)
    qweight = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(rows, -1)
    # d * sc is exact in fp32 (11-bit by 6-bit mantissas); the zero moves gguf's -dmin*m to the formats' code 8.
    scales = (d * sc.float()).reshape(rows, -1)
    zeros = 8.0 * scales - (dmin * mn.float()).reshape(rows, -1)
    return {"qweight": qweight.contiguous(), "scales": scales.contiguous(), "zeros": zeros.contiguous()}


def repack_int4(raw: torch.Tensor, e: TensorEntry) -> dict[str, torch.Tensor]:
    """Q4_0/Q4_1/Q4_K -> the int4 g32 canonical tensors (qweight, scales, zeros) on the same grid: codes
    unchanged."""
    blocks = _blocks(raw, e)
    if e.type == Q4_K:
        return _repack_q4_k(blocks)
    at = _CODES_AT[e.type]
    qweight = blocks[..., at : at + 16].reshape(blocks.shape[0], -1).contiguous()
    d = _fp16(blocks, 0)
    # Q4_0 is centred at 8 already (zero 0); Q4_1's offset m becomes the formats' zero at code 8.
    zeros = torch.zeros_like(d) if e.type == Q4_0 else _fp16(blocks, 2) + 8.0 * d
    return {"qweight": qweight, "scales": d.contiguous(), "zeros": zeros.contiguous()}


def repack_int8(raw: torch.Tensor, e: TensorEntry) -> dict[str, torch.Tensor]:
    """Q8_0 / Q5_0 -> int8 g32 (qweight, scales): the same codes (Q5_0's re-centred to [-16, 15]) and scales."""
    blocks = _blocks(raw, e)
    if e.type == Q5_0:
        qweight = _q5_0_codes(blocks).to(torch.int8).reshape(blocks.shape[0], -1)
    else:
        qweight = blocks[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], -1)
    return {"qweight": qweight.contiguous(), "scales": _fp16(blocks, 0).contiguous()}
