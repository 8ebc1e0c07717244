"""GGUF tensors used where they lie: linear layers and an embedding whose weights are the stored blocks of a mapped
.gguf file, computed by the native kernels of kernels/native/gguf.cpp.

A layer holds one `GGUFRows` per stored tensor it is made of (a fused q/k/v layer holds three, which may be of
different types: Qwen2.5's Q4_K_M files store v as Q6_K in half the layers). Nothing is de-quantized or repacked: a
start maps the file and the decode step reads exactly the file's bytes per weight. Every call, prompt or decode
step, eager or compiled, runs the same native op, whose per-row arithmetic does not depend on the batch (see
gguf.cpp), so a request's tokens do not depend on what runs beside it.

Where the native library is not loaded (no compiler and no prebuilt variant) the layers cannot run as stored:
`to_dense` de-quantizes them into ordinary layers, and the caller says so (engine/stages/native_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glowplug.base.ggml import BLOCKS, FLOATS, IN_PLACE, TYPE_NAMES

from .modules import DenseLinear, NativeSwitch

MAX_PARTS = 3  # the op takes up to three stored tensors (q, k, v)


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one stored row of `k` weights."""
    weights, nbytes = BLOCKS[ggml_type]
    return k // weights * nbytes


def fits(ggml_type: int, k: int) -> bool:
    """Whether a tensor of this type and row length can be a part of a layer run in place (a block type with a
    kernel, or a float part, with rows of whole blocks)."""
    return (ggml_type in IN_PLACE or ggml_type in FLOATS) and k % BLOCKS[ggml_type][0] == 0


@dataclass(frozen=True)
class GGUFRows:
    """One stored tensor: `data` uint8 [rows, row bytes] (a view of the mapped file), its ggml type, and for
    llama-family q/k rows, which llama.cpp's converter permutes, `perm`: int32 [rows], the output column of each stored
    row (None: in order)."""

    data: Tensor
    ggml_type: int
    perm: Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


def _empty_rows() -> Tensor:
    return torch.empty((0, 0), dtype=torch.uint8)


def _empty_perm() -> Tensor:
    return torch.empty(0, dtype=torch.int32)


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ bias) with W the row-wise concatenation of up to three stored GGUF tensors, read in place.

    The stored rows are non-persistent buffers (the state dict holds only the bias), so they are never copied into
    a checkpoint or a cache entry: the file is the weight."""

    def __init__(
        self, in_features: int, parts: list[GGUFRows], bias: bool = False, bias_dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"GGUFLinear takes 1 to {MAX_PARTS} stored tensors, got {len(parts)}")
        for p in parts:
            if (
                not fits(p.ggml_type, in_features)
                or p.data.dim() != 2
                or p.data.shape[1] != row_bytes(p.ggml_type, in_features)
            ):
                raise ValueError(
                    f"a stored tensor of type {p.ggml_type} with rows of {tuple(p.data.shape)} bytes "
                    f"does not hold {in_features}-weight rows"
                )
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.types = tuple(p.ggml_type for p in parts) + (0,) * (MAX_PARTS - len(parts))
        for i in range(MAX_PARTS):
            part = parts[i] if i < len(parts) else None
            self.register_buffer(f"rows{i}", part.data if part is not None else _empty_rows(), persistent=False)
            perm = part.perm if part is not None and part.perm is not None else _empty_perm()
            self.register_buffer(f"perm{i}", perm, persistent=False)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.out_features, dtype=bias_dtype, device="meta"), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    def parts(self) -> list[GGUFRows]:
        """The stored tensors, in output-column order."""
        out = []
        for i in range(MAX_PARTS):
            data: Tensor = getattr(self, f"rows{i}")
            if data.numel():
                perm: Tensor = getattr(self, f"perm{i}")
                out.append(GGUFRows(data, self.types[i], perm if perm.numel() else None))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads through this layer: the stored blocks, as in the file."""
        return sum(p.nbytes for p in self.parts())

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.bfloat16, torch.float32):
            x2 = x2.float()
        y: Tensor = torch.ops.glowplug_native.gguf_linear(
            x2.contiguous(),
            self.rows0,
            self.types[0],
            self.perm0,
            self.rows1,
            self.types[1],
            self.perm1,
            self.rows2,
            self.types[2],
            self.perm2,
        )
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + (self.bias if self.bias.dtype == y.dtype else self.bias.to(y.dtype))
        return y.view(*lead, self.out_features)

    def enable_native(self, small_m: int, activation_dtype: torch.dtype) -> NativeSwitch:
        """The layer already runs its native op everywhere: nothing to switch, its bytes to count."""
        return NativeSwitch("quantized", True, self.nbytes)

    def to_dense(self, dtype: torch.dtype) -> DenseLinear:
        """An ordinary layer with the de-quantized weights in `dtype` (when the native op cannot run)."""
        from .reference import gguf_dequantize

        weight = torch.empty((self.out_features, self.in_features), dtype=dtype)
        start = 0
        for p in self.parts():
            w = gguf_dequantize(p.data, p.ggml_type, self.in_features)
            if p.perm is not None:
                w = torch.empty_like(w).index_copy_(0, p.perm.long(), w)
            weight[start : start + p.rows].copy_(w)
            start += p.rows
        dense = DenseLinear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        dense.weight = nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            dense.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return dense

    def extra_repr(self) -> str:
        kinds = "+".join(TYPE_NAMES[p.ggml_type] for p in self.parts())
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={kinds}"


class GGUFEmbedding(nn.Module):
    """Token embeddings looked up from the stored GGUF rows (the chosen rows de-quantized per call, in the model's
    dtype); the matrix itself stays as the file stores it, so a tied head can read the same blocks in place."""

    def __init__(self, rows: GGUFRows, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        if rows.perm is not None or not fits(rows.ggml_type, dim):
            raise ValueError(f"an embedding of type {rows.ggml_type} cannot hold {dim}-wide rows in place")
        self.num_embeddings = rows.rows
        self.embedding_dim = dim
        self.ggml_type = rows.ggml_type
        self.dtype = dtype
        self.register_buffer("rows", rows.data, persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        out: Tensor = torch.ops.glowplug_native.gguf_rows(
            self.rows, self.ggml_type, self.embedding_dim, flat, 1 if self.dtype == torch.bfloat16 else 0
        )
        if out.dtype != self.dtype:
            out = out.to(self.dtype)
        return out.view(*ids.shape, self.embedding_dim)

    def stored(self) -> GGUFRows:
        return GGUFRows(self.rows, self.ggml_type)  # type: ignore[arg-type]

    def to_dense(self) -> nn.Embedding:
        """An ordinary embedding with the de-quantized matrix (when the native op cannot run)."""
        from .reference import gguf_dequantize

        weight = gguf_dequantize(self.rows, self.ggml_type, self.embedding_dim).to(self.dtype)  # type: ignore[arg-type]
        return nn.Embedding(self.num_embeddings, self.embedding_dim, _weight=weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored={TYPE_NAMES[self.ggml_type]}"


def stored_layers(model: nn.Module) -> int:
    """How many of `model`'s layers compute on stored GGUF rows (GGUFLinear and GGUFEmbedding)."""
    return sum(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())


def densify(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every layer that computes on stored GGUF rows by an ordinary one with its weights de-quantized to
    `dtype` (a tied head gets its own copy of the embedding's matrix). Returns the bytes of the dense weights made."""
    made = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, GGUFLinear):
            dense: nn.Module = mod.to_dense(dtype)
        elif isinstance(mod, GGUFEmbedding):
            dense = mod.to_dense()
        else:
            continue
        made += sum(t.nbytes for t in dense.state_dict().values())
        model.set_submodule(name, dense)
    return made
